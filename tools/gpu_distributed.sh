#!/usr/bin/env bash
# streamkl.distributed over NCCL on CUDA: the GPU test of tests/test_distributed.py (one rank per
# GPU, up to two), then the CPU gloo suite for comparison. Run from the repository root; results
# under $OUT (default ./gpu_distributed_out).
set -uo pipefail
OUT=${OUT:-gpu_distributed_out}
mkdir -p "$OUT"
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH}
{
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
  python -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version())"
} > "$OUT/env.txt" 2>&1
timeout 200 python -m pytest -q -p no:benchmark -p no:cacheprovider -m gpu tests/test_distributed.py -rA \
  > "$OUT/nccl.txt" 2>&1
echo "nccl rc=$?" >> "$OUT/nccl.txt"
timeout 60 python -m pytest -q -p no:benchmark -p no:cacheprovider tests/test_distributed.py \
  > "$OUT/gloo.txt" 2>&1
echo "gloo rc=$?" >> "$OUT/gloo.txt"
tail -n 3 "$OUT"/*.txt
