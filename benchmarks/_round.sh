set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 200 python -m pytest -q -rf --tb=short -p no:benchmark -n 6 tests/test_triton_gpu.py \
  -k "raw or launcher or stream_handle or planned_rows or plan" tests/test_plans.py tests/test_host_overhead.py \
  tests/test_raw_launch.py > $OUT/focused.txt 2>&1
rc=$?
tail -40 $OUT/focused.txt
timeout 90 python benchmarks/sync_gap.py --out /tmp/sync_gap.jsonl > /dev/null 2>&1
cut -c1-200 /tmp/sync_gap.jsonl
if [ $rc = 0 ]; then TEST_SECONDS=0 OVERLAP_BUDGET=0 bash benchmarks/gpu_perf_round.sh; fi
