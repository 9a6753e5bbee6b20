#!/usr/bin/env bash
# The CuPy backend on a GPU: its own tests, the shared suite on backend cupy, then forward and
# backward timings next to FlashAttention-2 (benchmarks/cupy_backward_h200.py).
# Run from the repository root; results go under $OUT (default ./gpu_cupy_out). About 200 s: the
# GPU tests compile one NVRTC module per (dtype, head dims) family (several seconds each, spread
# over the workers); the shared suite on cupy runs only while the total stays under 200 s.
source "$(dirname "$0")/gpu_steps.sh" cupy
run timings 110 python benchmarks/cupy_backward_h200.py
run cupy_gpu_tests 150 python -m pytest -q -n 12 -p no:benchmark tests/test_cupy_gpu.py -rfE --tb=short
if [ "$SECONDS" -lt 200 ]; then
    run shared_suite_cupy $((260 - SECONDS)) python -m pytest -q -n 12 -p no:benchmark tests/test_kl.py \
        tests/test_varlen.py tests/test_block_mask.py -k cupy -rfE --tb=short
fi
cat "$OUT/timings.log"
