"""Where one `streamkl.kl` call's time goes: its kernels (torch.profiler) and its host path (cProfile).

    python tools/profile_call.py                            # N=16K, D=128, causal, student grads, H200 shapes
    python tools/profile_call.py --n 1024 --sparsity 0.9 --grads all
    python tools/profile_call.py --n 1024 --cprofile        # the host path's Python functions instead
                                                            # (the forward, and the backward on its thread)
    PYTHONPATH=<tree>:$PWD python tools/profile_call.py --n 1024 --cprofile --grads none --sort tottime
                                                            # another tree's no-grad forward, by own time

Prints the profiler's table of device kernels (name, calls, device time per call) for `--iters`
calls after a warm-up, and the call's host time (wall time of the Python call on an idle GPU).
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import math
import pstats
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import streamkl  # noqa: E402

GRADS = {"none": (), "student": (2, 3), "all": (0, 1, 2, 3)}


def make_call(args):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = getattr(torch, args.dtype)
    grads = GRADS[args.grads]
    shape = (1, args.n, args.heads, args.dim)
    inputs = [torch.randn(shape, device=device, dtype=dtype).requires_grad_(i in grads) for i in range(4)]
    kwargs = dict(causal=args.causal, backend=args.backend)
    if args.sparsity is not None:
        blocks = math.ceil(args.n / args.block)
        keep = max(1, round(blocks * (1.0 - args.sparsity)))
        scores = torch.rand(1, args.heads, blocks, blocks, generator=torch.Generator().manual_seed(1234))
        pattern = torch.zeros(scores.shape, dtype=torch.bool).scatter_(-1, scores.topk(keep, -1).indices, True)
        kwargs["mask1"] = kwargs["mask2"] = streamkl.BlockMask.from_dense(pattern.to(device), block_size=args.block)

    def call():
        loss = streamkl.kl(*inputs, **kwargs)
        if grads:
            loss.backward()
            for t in inputs:
                t.grad = None

    return call, device


@contextlib.contextmanager
def _profiled_backward(profiler: cProfile.Profile):
    """Within the block, `profiler` records every run of streamkl's autograd backward on a thread
    other than this one (cProfile records only the thread that enables it, so it is enabled inside
    the backward itself; on this thread the caller's profiler already sees it, and a second one
    would displace it)."""
    from streamkl import autograd

    original = autograd._KL.backward
    calling = threading.get_ident()

    def backward(ctx, *grads):
        if threading.get_ident() == calling:
            return original(ctx, *grads)
        profiler.enable()
        try:
            return original(ctx, *grads)
        finally:
            profiler.disable()

    autograd._KL.backward = staticmethod(backward)
    try:
        yield
    finally:
        autograd._KL.backward = staticmethod(original)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--n", type=int, default=16384, help="tokens")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128, help="head dim of both sides")
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--grads", default="student", choices=tuple(GRADS), help="inputs that require grad")
    parser.add_argument("--sparsity", type=float, default=None, help="random block mask on both sides")
    parser.add_argument("--block", type=int, default=128, help="mask block size")
    parser.add_argument("--backend", default=None, help="streamkl backend (None: auto)")
    parser.add_argument("--iters", type=int, default=10, help="profiled calls")
    parser.add_argument("--cprofile", action="store_true", help="cProfile of the host path instead of kernels")
    parser.add_argument("--top", type=int, default=25, help="rows printed")
    parser.add_argument("--sort", default="cumulative", choices=("cumulative", "tottime", "ncalls"),
                        help="order of the cProfile rows")
    args = parser.parse_args(argv)
    call, device = make_call(args)
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(3):
        call()
    sync()
    spans = []
    for _ in range(max(args.iters, 5)):
        sync()
        start = time.perf_counter()
        call()
        spans.append((time.perf_counter() - start) * 1e6)
    sync()
    print(f"host time per call: {statistics.median(spans):.0f} us (median of {len(spans)}, idle GPU before each)")
    if args.cprofile:
        calling, backward = cProfile.Profile(), cProfile.Profile()
        with _profiled_backward(backward):
            calling.enable()
            for _ in range(args.iters):
                call()
            calling.disable()
            sync()
        print("== the calling thread (the forward; the backward too for CPU tensors)")
        pstats.Stats(calling).sort_stats(args.sort).print_stats(args.top)
        if GRADS[args.grads] and device == "cuda":
            print("== inside the autograd node's backward, on autograd's device thread (which a profile of "
                  "the calling thread does not see)")
            pstats.Stats(backward).sort_stats(args.sort).print_stats(args.top)
        return 0
    activities = [torch.profiler.ProfilerActivity.CPU]
    if device == "cuda":
        activities.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(args.iters):
            call()
        sync()
    sort = "self_cuda_time_total" if device == "cuda" else "self_cpu_time_total"
    print(prof.key_averages().table(sort_by=sort, row_limit=args.top))
    return 0


if __name__ == "__main__":
    sys.exit(main())
