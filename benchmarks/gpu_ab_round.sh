#!/usr/bin/env bash
# One device-tool call: the Gluon student backward under Nsight Compute (one launch, clocks left
# alone; NCU_SECONDS=0 skips it), then interleaved A/B timings (benchmarks/ab_gluon_bwd.py) of its
# switches against each other and backward.py at N=16K, D=128, causal and not. Results under $OUT.
#   bash benchmarks/gpu_ab_round.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
if [ "${NCU_SECONDS:-120}" != 0 ]; then
  timeout "${NCU_SECONDS:-120}" ncu --clock-control none -k regex:kl_bwd_gluon -c 1 \
    --section SpeedOfLight --section WarpStateStats --section SchedulerStats --section MemoryWorkloadAnalysis \
    --section ComputeWorkloadAnalysis --section LaunchStats --section Occupancy \
    python benchmarks/ab_gluon_bwd.py --n "${NCU_N:-8192}" --causal --rounds 1 --rep 5 --variants '[{}]' \
    > "$OUT/ncu.txt" 2>&1
  echo "ncu rc=$?"; grep -E "Duration|Issue Slots|No Eligible|Warp Cycles Per Issued|Stall|Compute \(SM\) Thr|Memory Thr|L2 Hit" "$OUT/ncu.txt" | head -30
fi
CAUSAL_VARIANTS=${CAUSAL_VARIANTS:-'[{}, {"DQ_VEC2": true}, {"gluon": false}]'}
PLAIN_VARIANTS=${PLAIN_VARIANTS:-'[{}, {"DQ_VEC2": false}, {"gluon": false}]'}
timeout "${AB_SECONDS:-150}" python benchmarks/ab_gluon_bwd.py --causal --rounds "${ROUNDS:-7}" \
  --variants "$CAUSAL_VARIANTS" --out "$OUT/ab.jsonl" 2>&1 | cut -c1-220
timeout "${AB_SECONDS:-150}" python benchmarks/ab_gluon_bwd.py --rounds "${ROUNDS:-7}" \
  --variants "$PLAIN_VARIANTS" --out "$OUT/ab.jsonl" 2>&1 | cut -c1-220
