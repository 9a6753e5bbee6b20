"""Host-side overhead of one `streamkl.kl` call: the front end alone, with the kernels stubbed out.

The selected backend's `forward` / `backward` are replaced by stubs that only allocate outputs of
the right shapes (see streamkl/backends/base.py), so what is timed is the Python / framework path:
argument checks, backend choice, the custom ops and autograd, the tile-schedule cache, the
front end's few torch ops (the reduction, the gradient's empty-row masking).

    python tools/host_overhead.py                 # forward and forward+backward, microseconds per call
    python tools/host_overhead.py --profile fwd   # cProfile of the forward path (or fwdbwd), top entries

Runs on the CPU on tiny tensors by default. `--device cuda` times the same path with CUDA tensors:
no streamkl kernel runs, only the front end's torch ops are launched, so it is host time too.
"""

from __future__ import annotations

import argparse
import contextlib
import cProfile
import pstats
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import streamkl  # noqa: E402
from streamkl.backends import base  # noqa: E402
from streamkl.dispatch import choose_backend  # noqa: E402
from streamkl.problem import build_problem  # noqa: E402


def _stub_forward(problem, q1, k1, q2, k2, schedule):
    return base.new_outputs(problem)


def _stub_backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
    return tuple(torch.empty_like(t) if need else None for t, need in zip((q1, k1, q2, k2), needs))


def make_inputs(args):
    shape_q = (args.batch, args.seqlen, args.heads, args.dim)
    shape_k = (args.batch, args.seqlen, args.heads_k, args.dim)
    make = lambda shape, grad: torch.randn(shape, device=args.device, dtype=args.dtype, requires_grad=grad)  # noqa: E731
    return make(shape_q, False), make(shape_k, False), make(shape_q, True), make(shape_k, True)


@contextlib.contextmanager
def stub_backend(inputs, backend):
    """Within the block, the backend instance chosen for `inputs` runs output-only stubs for its
    forward/backward (instance attributes, removed on exit); yields that instance."""
    impl = choose_backend(build_problem(*inputs), backend)
    impl.forward = _stub_forward
    impl.backward = _stub_backward
    try:
        yield impl
    finally:
        del impl.forward, impl.backward


def time_per_call(fn, iters: int, repeats: int) -> float:
    """Best of `repeats` runs of `iters` calls, in microseconds per call."""
    for _ in range(max(iters // 10, 10)):
        fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(iters):
            fn()
        best = min(best, (time.perf_counter() - start) / iters)
    return best * 1e6


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float16", "bfloat16", "float32"])
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seqlen", type=int, default=64)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--heads-k", type=int, default=2)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--backend", default=None, help="backend to stub (default: what auto picks)")
    parser.add_argument("--iters", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--profile", choices=["fwd", "fwdbwd"], default=None)
    parser.add_argument("--top", type=int, default=30)
    args = parser.parse_args(argv)
    args.dtype = getattr(torch, args.dtype)

    inputs = make_inputs(args)
    with stub_backend(inputs, args.backend) as impl:
        return run(args, impl, inputs)


def run(args, impl, inputs):
    q1, k1, q2, k2 = inputs

    def fwd():
        with torch.no_grad():
            streamkl.kl(q1, k1, q2, k2, causal=args.causal, backend=args.backend)

    def fwdbwd():
        streamkl.kl(q1, k1, q2, k2, causal=args.causal, backend=args.backend).backward()
        q2.grad = k2.grad = None

    def grad_fwd():  # forward with autograd recording, no backward
        streamkl.kl(q1, k1, q2, k2, causal=args.causal, backend=args.backend)

    def reference():  # a floor: the cheapest PyTorch work of the same shape
        torch.empty((args.batch, args.seqlen, args.heads), device=args.device).sum()

    fns = {"fwd": fwd, "fwdbwd": fwdbwd}
    if args.profile:
        fn = fns[args.profile]
        for _ in range(50):
            fn()
        profiler = cProfile.Profile()
        profiler.enable()
        for _ in range(args.iters):
            fn()
        profiler.disable()
        stats = pstats.Stats(profiler).sort_stats("tottime")
        stats.print_stats(args.top)
        stats.sort_stats("cumulative").print_stats(args.top)
        return None

    print(f"backend {impl.name} (stubbed), device {args.device}, q {tuple(q1.shape)} {args.dtype}")
    results = {}
    for name, fn in (
        ("forward, no_grad", fwd),
        ("forward, grad recorded", grad_fwd),
        ("forward + backward", fwdbwd),
        ("floor: empty().sum()", reference),
    ):
        results[name] = time_per_call(fn, args.iters, args.repeats)
        print(f"{name:>24}: {results[name]:8.1f} us/call")
    return results


if __name__ == "__main__":
    main()
