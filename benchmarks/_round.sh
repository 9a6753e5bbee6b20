set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
timeout 110 python benchmarks/sync_gap.py --out $OUT/sync_gap.jsonl --profile 200 > $OUT/sync_gap.txt 2>&1
grep -v "^{" $OUT/sync_gap.txt | grep -E "ncalls|^ +[0-9]" | head -90 | cut -c1-140
cut -c1-330 $OUT/sync_gap.jsonl
SUITE_BUDGET=0 OVERLAP_BUDGET=0 TEST_SECONDS=430 bash benchmarks/gpu_perf_round.sh
