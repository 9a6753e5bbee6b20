#!/usr/bin/env bash
# One device-tool call for the experimental Gluon kernels (streamkl/backends/triton/gluon_forward.py,
# gluon_backward.py): their GPU tests first (a deadlocked barrier protocol would hang: every step is
# under `timeout`), then their timing against the Triton kernels and SDPA at N=16K (tune_h200.py
# --section gluon: forward both variants, student backward),
# then the GPU test files not re-run since the fifth session's last change (errors, CuPy).
#   bash benchmarks/gpu_gluon_round.sh        # results under $OUT
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
timeout "${GLUON_TEST_SECONDS:-150}" python -m pytest -q -p no:benchmark tests/test_triton_gpu.py -k gluon \
  > "$OUT/gluon_tests.txt" 2>&1
echo "gluon tests rc=$?" >> "$OUT/gluon_tests.txt"
tail -15 "$OUT/gluon_tests.txt"
timeout "${GLUON_TUNE_SECONDS:-260}" python benchmarks/tune_h200.py --out "$OUT" --section gluon > "$OUT/tune.log" 2>&1
grep '"gluon' "$OUT/tune.log"
if [ "${REST_SECONDS:-100}" != 0 ]; then
  timeout "${REST_SECONDS:-100}" python -m pytest -q -p no:benchmark -n 8 tests/test_errors.py tests/test_cupy_gpu.py 2>&1 \
    | tail -5 > "$OUT/tests_rest.txt"
  tail -2 "$OUT/tests_rest.txt"
fi
