#!/usr/bin/env bash
# The Triton DSA indexer loss on a GPU: its tests (every case of tests/test_indexer_triton.py runs
# on the GPU), then dense and top-k (scattered, local) forward / backward timings at N = 8K and 32K
# next to the cuDNN SDPA forward of the teacher, with peak memory (tools/time_indexer_triton.py).
# Run from the repository root; results go under $OUT (default ./gpu_dsa_out). At most about 215 s.
set -u
OUT=${OUT:-gpu_dsa_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
run() {  # run NAME SECONDS COMMAND...: output to $OUT/NAME.log, a status line to the summary
    local name=$1 limit=$2
    shift 2
    local start=$SECONDS
    timeout "$limit" "$@" >"$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s" | tee -a "$OUT/summary.txt"
    tail -n 40 "$OUT/$name.log"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/summary.txt"
python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__)" | tee -a "$OUT/summary.txt"
if python -c "import xdist" 2>/dev/null; then workers=(-n 8); else workers=(); fi
run indexer_tests 65 python -m pytest -q -x -rfE --tb=short -p no:benchmark "${workers[@]}" tests/test_indexer_triton.py
run indexer_timings 90 python tools/time_indexer_triton.py 8192 32768
# tile alternatives at N = 32K (each line compiles one more kernel; most useful first)
run indexer_tiles_ab 60 python tools/time_indexer_triton.py 32768 --skip-stages \
    --backward-tiles 128x64x8 64x64x8 --forward-tiles 128x128x8 64x128x8 --lse-tiles 128x64x8
