#!/usr/bin/env bash
# One device-tool call: the shared test suite on every backend (torch on CUDA, triton, cupy), then
# both examples at GPU settings. Usage (device tool, carrying .minilm, a float16 copy of the
# MiniLM model folder): bash benchmarks/gpu_round.sh
set -u
export PYTHONUNBUFFERED=1 PYTHONPATH=$PWD
OUT=${OUT:-/tmp/streamkl-out}
mkdir -p "$OUT"
python -m streamkl info
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
timeout 170 python -m pytest -q -p no:benchmark -n 8 tests/test_kl.py tests/test_varlen.py tests/test_block_mask.py \
  tests/test_errors.py 2>&1 | tail -25 | tee "$OUT/tests.txt"
export STREAMKL_MINILM_DIR=$PWD/.minilm
timeout 120 python examples/attention_transfer.py --device cuda --steps 1000 --tokens-per-step 32768 --max-len 256 \
  --student-dim 16 --out "$OUT/attention_transfer" 2>&1 | grep -v "it/s\]" | tail -20
timeout 130 python examples/sparse_distill.py --device cuda --seq-len 32768 --block-size 64 --topk 16 --steps 200 \
  --dtype bfloat16 --out "$OUT/sparse_distill" 2>&1 | grep -v "it/s\]" | tail -30
