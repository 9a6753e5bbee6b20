"""Where one `streamkl.kl` call's host time goes, stage by stage, without a profiler's overhead.

The front end's stages (argument checks, backend choice, the autograd layers, output allocation,
launch arguments, TMA descriptors, Triton's JIT launch path, the reduction, the backward's
engine) are wrapped by timers (about 1 us each); each call starts on an idle GPU (synchronized,
as the suite's synchronized timings do) and on a small problem, so the GPU never holds the host
back. For each mode it prints one JSON line: the call's host time, when (us from the call's
start) each kernel was launched, and each stage's inclusive time and first entry.

Then it times Triton's launch path against launching the kernel it compiled directly
(`CompiledKernel.run` with the same arguments): what a launch cache could save.

    python benchmarks/host_timeline.py --out DIR        # CUDA GPU; writes DIR/host_timeline.jsonl
    python benchmarks/host_timeline.py --out DIR --n 16384 --heads 16 --torch-ops   # the suite's shape
"""

from __future__ import annotations

import argparse
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

import streamkl  # noqa: E402
import streamkl.api  # noqa: E402
import streamkl.autograd  # noqa: E402
from streamkl.backends.triton import TritonBackend, backward, common, forward, gluon_backward, gluon_forward  # noqa: E402

_T0 = [0.0]
_STATS: dict = {}


def _record(name, start, end):
    total, count, first = _STATS.get(name, (0.0, 0, None))
    offset = start - _T0[0]
    _STATS[name] = (total + end - start, count + 1, offset if first is None else first)


def _wrap(owner, attr, name=None, static=False):
    # (a class's own attribute, so that a staticmethod stays one; Tensor methods such as `to` live on
    # the C base class since torch 2.11: those by getattr)
    fn = owner.__dict__[attr] if isinstance(owner, type) and attr in owner.__dict__ else getattr(owner, attr)
    inner = fn.__func__ if isinstance(fn, staticmethod) else fn
    label = name or f"{getattr(owner, '__name__', type(owner).__name__)}.{attr}"

    @functools.wraps(inner)
    def timed(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            _record(label, start, time.perf_counter())

    setattr(owner, attr, staticmethod(timed) if static or isinstance(fn, staticmethod) else timed)


def instrument():
    api = streamkl.api
    for attr in ("build_problem", "choose_backend", "kl_forward"):
        _wrap(api, attr, f"api.{attr}")
    for attr in ("run_forward", "run_backward", "get_schedule", "reduce_rows"):
        _wrap(streamkl.autograd, attr, f"autograd.{attr}")
    _wrap(streamkl.autograd._EagerKL, "forward", "EagerKL.forward")
    _wrap(streamkl.autograd._EagerKL, "backward", "EagerKL.backward")
    _wrap(TritonBackend, "forward", "TritonBackend.forward")
    _wrap(TritonBackend, "backward", "TritonBackend.backward")
    _wrap(forward, "kl_forward", "forward.kl_forward")
    _wrap(forward, "gluon_serves", "forward.gluon_serves")
    _wrap(backward, "kl_backward", "backward.kl_backward")
    for attr in ("kl_forward", "launch_args", "descriptors", "new_outputs", "write_tail_rows"):
        if hasattr(gluon_forward, attr):
            _wrap(gluon_forward, attr, f"gluon_forward.{attr}")
    for attr in ("kl_backward", "launch_args", "applies"):
        if hasattr(gluon_backward, attr):
            _wrap(gluon_backward, attr, f"gluon_backward.{attr}")
    _wrap(common, "launch", "common.launch")
    _wrap(common, "direct_launch", "common.direct_launch")  # (the callers import it at call time)
    for kernel in (gluon_forward._kl_fwd_gluon_kernel, gluon_backward._kl_bwd_gluon_kernel,
                   forward._kl_fwd_kernel, backward._kl_bwd_kv_kernel, backward._kl_bwd_dq_kernel):
        _wrap(kernel, "run", f"launch:{kernel.fn.__name__}")
    _wrap(torch.Tensor, "backward", "Tensor.backward")


def instrument_torch_ops():
    """The torch calls of the front end and the backends' Python code (allocations, copies)."""
    for name in ("empty", "zeros", "empty_like", "zeros_like", "where", "count_nonzero", "ones_like"):
        _wrap(torch, name, f"torch.{name}")
    for name in ("to", "contiguous", "zero_", "copy_", "float", "sum", "mean", "__truediv__", "clamp_", "view",
                 "transpose", "amax"):
        _wrap(torch.Tensor, name, f"Tensor.{name}")


def inputs_for(args, sparsity, mode):
    n, h, d = args.n, args.heads, 128
    inputs = [torch.randn(1, n, h, d, device="cuda", dtype=torch.bfloat16) for _ in range(4)]
    if mode != "forward":
        for t in inputs[2:] if mode == "student" else inputs:
            t.requires_grad_(True)
    kwargs = dict(backend="triton", causal=args.causal)
    if sparsity:
        from suite import block_mask

        kwargs["mask1"] = kwargs["mask2"] = block_mask(n, h, sparsity, 128, "cuda")
        kwargs.pop("causal")
    return inputs, kwargs


def timeline(args, sparsity, mode):
    inputs, kwargs = inputs_for(args, sparsity, mode)

    def run():
        loss = streamkl.kl(*inputs, **kwargs)
        if mode != "forward":
            loss.backward()
            for t in inputs:
                t.grad = None

    for _ in range(5):
        run()
    torch.cuda.synchronize()
    _STATS.clear()
    host = []
    for _ in range(args.repeats):
        torch.cuda.synchronize()
        _T0[0] = time.perf_counter()
        run()
        host.append((time.perf_counter() - _T0[0]) * 1e6)
    torch.cuda.synchronize()
    stages = {name: dict(us=round(total / count * 1e6, 1), calls=count / args.repeats,
                         first_us=round(first * 1e6, 1))
              for name, (total, count, first) in sorted(_STATS.items(), key=lambda kv: kv[1][2])}
    return dict(mode=mode, sparsity=sparsity, causal=args.causal, n=args.n, heads=args.heads,
                host_us=round(statistics.median(host), 1), host_min_us=round(min(host), 1), stages=stages)


def launch_paths(args):
    """Triton's launch path vs the compiled kernel's own launcher, on the Gluon forward's arguments."""
    inputs, kwargs = inputs_for(args, None, "forward")
    captured = {}
    kernel = gluon_forward._kl_fwd_gluon_kernel
    original = kernel.run

    def capture(*a, grid, warmup, **kw):
        captured.update(args=a, grid=grid, kw=kw)
        compiled = original(*a, grid=grid, warmup=warmup, **kw)
        captured["compiled"] = compiled
        return compiled

    kernel.run = capture
    streamkl.kl(*inputs, **kwargs)
    kernel.run = original
    torch.cuda.synchronize()
    if "compiled" not in captured:
        return dict(launch_paths="the Gluon forward did not run")
    a, grid, kw, compiled = captured["args"], captured["grid"], captured["kw"], captured["compiled"]
    names = kernel.arg_names
    full = list(a) + [kw[name] for name in names[len(a):]]
    stream = torch.cuda.current_stream().cuda_stream

    def jit_launch():
        kernel[grid](*a, **kw)

    def direct():
        compiled.run(grid[0], 1, 1, stream, compiled.function, compiled.packed_metadata, None, None, None, *full)

    descs = [x for x in a if type(x).__name__ == "TensorDescriptor"]

    def make_descs():
        gluon_forward.descriptors(None, *inputs, 128)

    out = {}
    for label, fn, count in (("jit_launch_us", jit_launch, 200), ("direct_launch_us", direct, 200),
                             ("descriptors_us", make_descs, 200)):
        for _ in range(10):
            fn()
        torch.cuda.synchronize()
        best = []
        for _ in range(5):
            start = time.perf_counter()
            for _ in range(count):
                fn()
            best.append((time.perf_counter() - start) / count * 1e6)
            torch.cuda.synchronize()
        out[label] = round(min(best), 1)
    out["tensordesc_args"] = len(descs)
    return out


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--n", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--torch-ops", action="store_true", help="time the torch calls too")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    rows = [launch_paths(args)]
    print(json.dumps(rows[0]), flush=True)
    instrument()
    if args.torch_ops:
        instrument_torch_ops()
    for sparsity in (None, 0.9):
        for mode in ("forward", "student", "all"):
            row = timeline(args, sparsity, mode)
            print(json.dumps(row), flush=True)
            rows.append(row)
    with open(args.out / "host_timeline.jsonl", "a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
