#!/usr/bin/env bash
# Every test that can use the GPU (the shared suite on every backend and the GPU-only files), the
# benchmark suite, then its headline rows again with --overlap-host (calls back to back, host time
# hidden; the target sections; only its markdown comes back: $OUT holds at most 8 files). All of it
# takes ~11 min, over one device call's 10: two calls, e.g.
#   SUITE_BUDGET=0 OVERLAP_BUDGET=0 bash benchmarks/gpu_perf_round.sh      # tests
#   TEST_SECONDS=0 bash benchmarks/gpu_perf_round.sh                      # suite + overlap rerun
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
{ python -m streamkl info; nvidia-smi --query-gpu=name,driver_version --format=csv,noheader; } > "$OUT/tests.txt" 2>&1
if [ "${TEST_SECONDS:-420}" != 0 ]; then  # the full set: 229 s with 12 workers (sixth session), 327 s (eighteenth)
  timeout "${TEST_SECONDS:-420}" python -m pytest -q -rf --tb=short -p no:benchmark -n 12 tests/test_kl.py tests/test_varlen.py \
    tests/test_block_mask.py tests/test_errors.py tests/test_host_overhead.py tests/test_triton_gpu.py \
    tests/test_gpu_capture.py tests/test_cupy_gpu.py 2>&1 | tail -40 >> "$OUT/tests.txt"
  # the failures' names on stdout too: $OUT keeps 8 files, and a caller's extra outputs can crowd
  # tests.txt out (seventeenth session: a failure whose name was lost that way)
  grep -E "^(FAILED|ERROR) " "$OUT/tests.txt" | cut -c1-200
  tail -3 "$OUT/tests.txt"
fi
if [ "${SUITE_BUDGET:-215}" != 0 ]; then
  timeout $(( ${SUITE_BUDGET:-215} + 20 )) python benchmarks/suite.py --out "$OUT" --max-seconds "${SUITE_BUDGET:-215}" \
    > "$OUT/suite.log" 2>&1
  grep -A40 "Targets" "$OUT/suite.md" | head -45
fi
if [ "${OVERLAP_BUDGET:-100}" != 0 ]; then
  timeout $(( ${OVERLAP_BUDGET:-100} + 30 )) python benchmarks/suite.py --out /tmp/streamkl-overlap --name suite_overlap \
    --overlap-host --sections nsweep,dsweep,sparsity,varlen --providers streamkl-triton,sdpa-flash,naive \
    --max-seconds "${OVERLAP_BUDGET:-100}" > /dev/null 2>&1
  cp /tmp/streamkl-overlap/suite_overlap.md "$OUT/" 2>/dev/null
fi
