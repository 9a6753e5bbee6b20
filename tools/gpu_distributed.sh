#!/usr/bin/env bash
# streamkl.distributed over NCCL on CUDA: the GPU test of tests/test_distributed.py (one rank per
# GPU, up to two), then the CPU gloo suite for comparison. Run from the repository root; results
# under $OUT (default ./gpu_distributed_out).
source "$(dirname "$0")/gpu_steps.sh" distributed
run nccl 200 python -m pytest -q -p no:benchmark -p no:cacheprovider -m gpu tests/test_distributed.py -rA
run gloo 60 python -m pytest -q -p no:benchmark -p no:cacheprovider tests/test_distributed.py
