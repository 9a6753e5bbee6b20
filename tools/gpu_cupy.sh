#!/usr/bin/env bash
# The CuPy backend's tensor-core forward on a GPU, one decisive run (about 180 s):
#  1. every candidate tile shape (launch.FORWARD_CANDIDATES) against the float64 reference,
#     float16 and bfloat16, outputs poisoned (tests/test_cupy_gpu.py -k candidate_on_gpu);
#  2. one markdown table: each candidate's forward next to FlashAttention-2 and the default path,
#     D=128 and 64, causal and not, plus the first-call compile time of a new shape;
#  3. while time is left, the rest of the CuPy GPU tests (the default path, forward and backward).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_out).
source "$(dirname "$0")/gpu_steps.sh" cupy
run candidate_tests 75 python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py -k candidate_on_gpu \
    -rfE --tb=short
TAIL_LINES=40 run forward_table 110 python benchmarks/cupy_forward_h200.py
if [ "$SECONDS" -lt 170 ]; then
    run cupy_gpu_tests $((230 - SECONDS)) python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py \
        -k "not candidate" -rfE --tb=short
fi
cat "$OUT/summary.txt"
