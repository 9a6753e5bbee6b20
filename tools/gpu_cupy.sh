#!/usr/bin/env bash
# The CuPy backend on a GPU (about 200 s):
#  1. tests/test_cupy_gpu.py whole: every SPEC feature on the default path against the float64
#     reference (outputs poisoned), both forward tile shapes, stream, CUDA graph, large shapes;
#  2. the forward next to FlashAttention-2, D=128 and 64, causal and not, with each shape's
#     registers and spilled bytes (benchmarks/cupy_forward_h200.py);
#  3. forward, student and all-four backward of the CuPy and Triton backends next to FA2, and
#     the first-call compile time (benchmarks/cupy_backward_h200.py; rows print as they finish).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_out).
source "$(dirname "$0")/gpu_steps.sh" cupy
TAIL_LINES=8 run cupy_gpu_tests 95 python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py -rfE --tb=line
TAIL_LINES=2 run forward_table 30 python benchmarks/cupy_forward_h200.py --no-first-call --repeats 8
TAIL_LINES=2 run backward_table $((205 - SECONDS)) python benchmarks/cupy_backward_h200.py
grep -E '^\||^D[0-9]+:|^forward ms|failed' "$OUT/forward_table.log"
grep -vE '^\{' "$OUT/backward_table.log" | tail -n 8
cat "$OUT/summary.txt"
