#!/usr/bin/env bash
# The CuPy backend's tensor-core kernels on a GPU, one decisive run (about 180 s):
#  1. every forward candidate tile shape (launch.FORWARD_CANDIDATES) and the 128-key dk blocks
#     against the float64 reference, float16 and bfloat16, outputs poisoned;
#  2. one markdown table: each candidate's forward next to FlashAttention-2 and the default path,
#     D=128 and 64, causal and not, and the first-call compile time of a new shape;
#  3. the backward launches with 64- and 128-key dk blocks, student and all-four, next to FA2;
#  4. while time is left, the rest of the CuPy GPU tests (the default path, forward and backward).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_out).
source "$(dirname "$0")/gpu_steps.sh" cupy
TAIL_LINES=8 run candidate_tests 85 python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py \
    -k "candidate_on_gpu or 128_key" -rfE --tb=line
TAIL_LINES=2 run forward_table 95 python benchmarks/cupy_forward_h200.py
if [ "$SECONDS" -lt 150 ]; then
    TAIL_LINES=2 run dk_keys_table 40 python benchmarks/cupy_backward_h200.py --dk-keys 64 128
fi
if [ "$SECONDS" -lt 150 ]; then
    TAIL_LINES=8 run cupy_gpu_tests $((210 - SECONDS)) python -m pytest -q -n 12 -p no:benchmark \
        tests/test_cupy_gpu.py -k "not candidate and not 128_key" -rfE --tb=line
fi
for log in forward_table dk_keys_table; do
    [ -f "$OUT/$log.log" ] && grep -E '^\||^first call|^forward ms|^backward launches|^compiled|failed' "$OUT/$log.log"
done
cat "$OUT/summary.txt"
