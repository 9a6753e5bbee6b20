#!/usr/bin/env bash
# session 14, device call 2: full GPU tests at main (kept backward plans, DQ_SPLIT64), then A/Bs
set -u
export PYTHONUNBUFFERED=1 TRITON_CACHE_DIR=/tmp/tc
rm -rf old && mkdir -p old/a old/b
git archive c3bf283 streamkl | tar -x -C old/a && mv old/a/streamkl old/a/streamkl_old
sed -i 's/\bstreamkl\b/streamkl_old/g' $(find old/a -name '*.py')
cp -r streamkl old/b/streamkl_nosplit && sed -i 's/\bstreamkl\b/streamkl_nosplit/g' $(find old/b -name '*.py')
sed -i 's/^DQ_SPLIT64 = True/DQ_SPLIT64 = False/' old/b/streamkl_nosplit/backends/triton/gluon_backward.py
grep -c "^DQ_SPLIT64 = False" old/b/streamkl_nosplit/backends/triton/gluon_backward.py
SUITE_BUDGET=0 OVERLAP_BUDGET=0 TEST_SECONDS=330 bash benchmarks/gpu_perf_round.sh
grep -E "^FAILED" $OUT/tests.txt | sed 's/^FAILED //; s/ - .*//' > /tmp/failed.txt
if [ -s /tmp/failed.txt ]; then
  PYTHONPATH=. timeout 120 python -m pytest -q -x --tb=short -p no:benchmark $(head -5 /tmp/failed.txt) > $OUT/failed_detail.txt 2>&1
  tail -30 $OUT/failed_detail.txt
fi
PYTHONPATH=old/b:. timeout 100 python benchmarks/ab_trees.py --interleave streamkl_nosplit --repeats 20 \
  --cases "student D=64,student D=64 causal" --out $OUT/ab_dq_split64.jsonl 2>&1 | tail -4
PYTHONPATH=old/a:. timeout 140 python benchmarks/ab_trees.py --interleave streamkl_old --repeats 30 \
  --cases "student 90%,all 90%,fwd 90%,student D=128 causal,all D=128 causal" --out $OUT/ab_backward_plans.jsonl 2>&1 | tail -10
