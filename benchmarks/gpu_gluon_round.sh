#!/usr/bin/env bash
# One device-tool call for the Gluon kernels (streamkl/backends/triton/gluon_forward.py, the
# default forward at D=128 on sm_90; gluon_backward.py, the default student backward where measured faster): their GPU tests first (a
# deadlocked barrier protocol would hang: every step is under `timeout`), then their timing against
# the Triton kernels and SDPA at N=16K (tune_h200.py --section gluon: forward both variants, student
# backward, its experimental knob (DQ_VEC2) and forced-only scopes: GLUON_PARTS=bwd,bwd-knobs,bwd-forced),
# then (REST_SECONDS != 0)
# test_errors + test_cupy_gpu. The tests run on 8 workers (one process: 240 s was too short in the
# seventh session's first round).
# then (SPARSE_SECONDS=80, off by default) the sparsity section with STREAMKL_GLUON=1 and without.
# Limits: tests 150 s, tuning 300 s (~8 min with the machine start: one call).
#   bash benchmarks/gpu_gluon_round.sh        # results under $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
timeout "${GLUON_TEST_SECONDS:-150}" python -m pytest -q -rf --tb=short -p no:benchmark -n 8 tests/test_triton_gpu.py \
  -k "gluon or device" > "$OUT/gluon_tests.txt" 2>&1
echo "gluon tests rc=$?" >> "$OUT/gluon_tests.txt"
tail -15 "$OUT/gluon_tests.txt"
timeout "${GLUON_TUNE_SECONDS:-300}" python benchmarks/tune_h200.py --out "$OUT" --section gluon --gluon-parts "${GLUON_PARTS:-fwd,bwd,bwd-knobs,bwd-forced}" > "$OUT/tune.log" 2>&1
grep '"gluon' "$OUT/tune.log"
if [ "${REST_SECONDS:-0}" != 0 ]; then
  timeout "${REST_SECONDS:-100}" python -m pytest -q -p no:benchmark -n 8 tests/test_errors.py tests/test_cupy_gpu.py 2>&1 \
    | tail -5 > "$OUT/tests_rest.txt"
  tail -2 "$OUT/tests_rest.txt"
fi
if [ "${SPARSE_SECONDS:-0}" != 0 ]; then
  # the block-sparsity section with the Gluon kernels forced (their listed paths) and without
  for mode in 1 default; do
    if [ "$mode" = 1 ]; then export STREAMKL_GLUON=1; else unset STREAMKL_GLUON; fi
    timeout "${SPARSE_SECONDS:-80}" python benchmarks/suite.py --out /tmp/sparse_$mode --name sparse_gluon_$mode \
      --sections sparsity --providers streamkl-triton --max-seconds $(( ${SPARSE_SECONDS:-80} - 20 )) > /dev/null 2>&1
    cp /tmp/sparse_$mode/sparse_gluon_$mode.md "$OUT/" 2>/dev/null
    grep "90%\|no mask" "$OUT/sparse_gluon_$mode.md" | head -6
  done
  unset STREAMKL_GLUON
fi
