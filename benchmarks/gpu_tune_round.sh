#!/usr/bin/env bash
# One device-tool call: the tuning sweep (benchmarks/tune_h200.py) with the configurations given
# in FWD_CONFIGS / BWD_CONFIGS (JSON lists), its host-time probe and accuracy check of every
# configuration, then (if TEST_SECONDS > 0) the GPU tests. Results under $OUT.
# Usage (device tool): FWD_CONFIGS='[...]' BWD_CONFIGS='[...]' bash benchmarks/gpu_tune_round.sh
# (TUNE_ARGS: more tune_h200.py options, e.g. '--bwd-modes all --bwd-dims 128')
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
timeout "${TUNE_SECONDS:-330}" python benchmarks/tune_h200.py --out "$OUT" --section "${SECTIONS:-fwd,bwd,sparse,host,check}" \
  ${FWD_CONFIGS:+--fwd-configs "$FWD_CONFIGS"} ${BWD_CONFIGS:+--bwd-configs "$BWD_CONFIGS"} ${CHUNK_NS:+--chunk-ns "$CHUNK_NS"} ${TUNE_ARGS:-} > "$OUT/tune.log" 2>&1
tail -5 "$OUT/tune.log"
if [ "${TEST_SECONDS:-0}" != 0 ]; then
  timeout "$TEST_SECONDS" python -m pytest -q -p no:benchmark -n 8 ${TESTS:-tests/test_triton_gpu.py} 2>&1 | tail -30 > "$OUT/tests.txt"
  tail -3 "$OUT/tests.txt"
fi
