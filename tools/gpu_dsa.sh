#!/usr/bin/env bash
# The Triton DSA indexer loss on a GPU: its tests (every case of tests/test_indexer_triton.py runs
# on the GPU), then dense and top-k (scattered, local) forward / backward timings at N = 32K next
# to the cuDNN SDPA forward of the teacher, with peak memory, then a sweep of tile shapes and
# pipeline depths of the dense kernels at N = 32K (tools/time_indexer_triton.py).
# Run from the repository root; results go under $OUT (default ./gpu_dsa_out). At most about 250 s.
# The benchmark (benchmarks/indexer.py) is tools/gpu_dsa_bench.sh.
TAIL_LINES=40
source "$(dirname "$0")/gpu_steps.sh" dsa
if python -c "import xdist" 2>/dev/null; then workers=(-n 8); else workers=(); fi
# the sm_90a compile checks (slow) are CPU-side: not repeated here
run indexer_tests 150 python -m pytest -q -x -rfE --tb=short -p no:benchmark -m "not slow" "${workers[@]}" tests/test_indexer_triton.py
run indexer_timings 45 python tools/time_indexer_triton.py 32768
# BMxBNxWARPSxSTAGES at N = 32K, each one more compile, most promising first (configured: lse
# 128x128x8x3, forward 128x64x8x3, backward 64x64x4x3); a line per configuration as it ends
run indexer_tiles_sweep 55 python tools/time_indexer_triton.py 32768 --skip-stages \
    --forward-tiles 64x128x4x3 64x64x4x3 64x64x4x4 \
    --backward-tiles 64x64x4x4 64x64x8x3 128x64x8x3 \
    --lse-tiles 64x128x4x3 128x64x8x3
