"""BOTH over block masks (`gluon_backward.BOTH_LISTED`) against backward.py's two kernels, on the
90 % block-sparse all-gradients call (the suite's masks, the same mask both sides, N=16K, H=16,
D=128, bf16): forward + backward medians back to back (host hidden), alternating the switch
every 15 calls, and each variant's kernels from torch.profiler. One JSON line on stdout.

    python benchmarks/ab_both_listed.py > $OUT/ab_both_listed.json      # H200 (sm_90)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

from suite import Timer, block_mask  # noqa: E402

import streamkl  # noqa: E402
from streamkl.backends.triton import gluon_backward  # noqa: E402


def main():
    n, h = 16384, 16
    x = [torch.randn(1, n, h, 128, device="cuda", dtype=torch.bfloat16).requires_grad_(True) for _ in range(4)]
    mask = block_mask(n, h, 0.9, 128, "cuda")

    def run():
        streamkl.kl(*x, mask1=mask, mask2=mask, backend="triton").backward()
        for t in x:
            t.grad = None

    times, kernels = {True: [], False: []}, {}
    for flag in times:
        gluon_backward.BOTH_LISTED = flag
        for _ in range(3):
            run()
    torch.cuda.synchronize()
    timer = Timer("cuda", overlap_host=True)
    for r in range(6):
        for flag in (True, False) if r % 2 else (False, True):
            gluon_backward.BOTH_LISTED = flag
            times[flag] += timer.overlapped(run, 15)
    for flag in times:
        gluon_backward.BOTH_LISTED = flag
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            run()
            torch.cuda.synchronize()
        kernels[flag] = {e.key[:40]: round(e.device_time_total / 1e3, 3) for e in prof.key_averages()
                         if e.device_time_total > 20}
    print(json.dumps({str(flag): dict(overlap_ms=round(statistics.median(times[flag]), 4), kernels=kernels[flag])
                      for flag in times}))


if __name__ == "__main__":
    main()
