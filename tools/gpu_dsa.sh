#!/usr/bin/env bash
# The Triton DSA indexer loss on a GPU: its tests (every case of tests/test_indexer_triton.py runs
# on the GPU), then dense and top-k (scattered, local) forward / backward timings at N = 8K and 32K
# next to the cuDNN SDPA forward of the teacher, with peak memory (tools/time_indexer_triton.py).
# Run from the repository root; results go under $OUT (default ./gpu_dsa_out). At most about 215 s.
TAIL_LINES=40
source "$(dirname "$0")/gpu_steps.sh" dsa
if python -c "import xdist" 2>/dev/null; then workers=(-n 8); else workers=(); fi
run indexer_tests 65 python -m pytest -q -x -rfE --tb=short -p no:benchmark "${workers[@]}" tests/test_indexer_triton.py
run indexer_timings 90 python tools/time_indexer_triton.py 8192 32768
# tile alternatives at N = 32K (each line compiles one more kernel; most useful first)
run indexer_tiles_ab 60 python tools/time_indexer_triton.py 32768 --skip-stages \
    --backward-tiles 128x64x8 64x64x8 --forward-tiles 128x128x8 64x128x8 --lse-tiles 128x64x8
