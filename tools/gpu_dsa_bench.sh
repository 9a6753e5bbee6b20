#!/usr/bin/env bash
# The DSA indexer benchmark (issue 31) on the H200: streamkl (triton) against the materializing
# implementation (eager, torch.compile) and the teacher's cuDNN SDPA forward, B = 1, causal, bf16,
# teacher H = 64, indexer 64 x 128, top-k 2048: N = 8K and 32K at D = 128, then the dense stage at
# 128K, then D = 192 at 32K, all into one report $OUT/bench/indexer.{json,md,png} (each cell saved
# as it ends; OOM recorded, not fatal). Run from the repository root; at most about 250 s.
source "$(dirname "$0")/gpu_steps.sh" dsa_bench
bench=(python benchmarks/indexer.py --out "$OUT/bench" --rep-ms 200)
run bench_d128 140 "${bench[@]}" --sizes 8192,32768 --dims 128
run bench_d128_128k 50 "${bench[@]}" --sizes 131072 --dims 128 --providers streamkl-triton-dense,sdpa-cudnn --append
run bench_d192 50 "${bench[@]}" --sizes 32768 --dims 192 \
    --providers streamkl-triton-dense,streamkl-triton-topk,megatron-eager-dense,sdpa-cudnn --append
cat "$OUT/bench/indexer.md"
