#!/usr/bin/env bash
# The CuPy backend on a GPU (about 200 s):
#  1. tests/test_cupy_gpu.py whole: every SPEC feature on the default path against the float64
#     reference (outputs poisoned), both forward tile shapes, stream, CUDA graph, large shapes;
#  2. forward, student and all-four backward of the CuPy and Triton backends next to
#     FlashAttention-2, D=128 and 64, causal and not, and the first-call compile time
#     (benchmarks/cupy_backward_h200.py; rows print as they finish);
#  3. while time is left, the forward table with each shape's registers and spilled bytes
#     (benchmarks/cupy_forward_h200.py).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_out).
source "$(dirname "$0")/gpu_steps.sh" cupy
TAIL_LINES=8 run cupy_gpu_tests 105 python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py -rfE --tb=line
TAIL_LINES=0 run backward_table $((200 - SECONDS)) python benchmarks/cupy_backward_h200.py
if [ "$SECONDS" -lt 175 ]; then
    TAIL_LINES=0 run forward_table $((205 - SECONDS)) python benchmarks/cupy_forward_h200.py --no-first-call
fi
grep -vE '^\{' "$OUT/backward_table.log" | tail -n 8
[ -f "$OUT/forward_table.log" ] && grep -E '^\||^D[0-9]+:|^forward ms|failed' "$OUT/forward_table.log"
cat "$OUT/summary.txt"
