"""A/B of host-side changes: the same calls timed from two source trees, in alternating processes.

The suite's synchronized measure (L2 flushed, device synchronized, one call between CUDA events:
host time before the first launch included) moves with the host's Python as much as with the
kernels, and the device machine can differ between calls: comparing a change against a suite run
of an earlier session mixes both. This runs each tree's `streamkl` in its own process, rounds
alternating (A B A B), on the same GPU, and prints one JSON line per (tree, round, case): the
median synchronized ms, the median host ms of one call (Python time, GPU idle before it) and the
median back-to-back ms (host hidden). A tree is a directory holding a `streamkl` package, e.g. one
exported with `git archive REV streamkl | tar -x -C old`.

    python benchmarks/ab_trees.py --trees old,. --rounds 2 --out $OUT/ab_trees.jsonl

`--interleave PACKAGE` instead times both in one process, call by call alternating (the host's
state drifts between processes): PACKAGE is the old tree imported under another name, e.g.
`git archive REV streamkl | tar -x -C old && mv old/streamkl old/streamkl_old && sed -i
's/\\bstreamkl\\b/streamkl_old/g' $(find old -name '*.py')` (its custom ops get that namespace).

    PYTHONPATH=old python benchmarks/ab_trees.py --interleave streamkl_old --out $OUT/ab.jsonl

`--flip SWITCHES` interleaves this tree with a copy of itself whose module switches are set
otherwise (the copy made here, in a temporary directory, as the package `streamkl_flip`: the device
machine's copy of the tree has no git history to export an old one from); its rows are "old":

    python benchmarks/ab_trees.py --flip backends.triton.gluon_backward.DIAG_LAST=False --cases "all D=128 causal"
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent

CASES = {  # name: (D, causal, sparsity, grads)
    "fwd D=64": (64, False, None, ()),
    "fwd D=64 causal": (64, True, None, ()),
    "fwd D=128": (128, False, None, ()),
    "fwd D=128 causal": (128, True, None, ()),
    "fwd 90%": (128, False, 0.9, ()),
    "student 90%": (128, False, 0.9, (2, 3)),
    "all 90%": (128, False, 0.9, (0, 1, 2, 3)),
    "all D=128": (128, False, None, (0, 1, 2, 3)),
    "all D=128 causal": (128, True, None, (0, 1, 2, 3)),
    "student D=128": (128, False, None, (2, 3)),
    "student D=128 causal": (128, True, None, (2, 3)),
    "student D=64": (64, False, None, (2, 3)),
    "student D=64 causal": (64, True, None, (2, 3)),
    # the varlen target's pair: 16 packed causal sequences of 4096 tokens and the batched dense call
    "varlen all": (128, True, None, (0, 1, 2, 3)),
    "batched all": (128, True, None, (0, 1, 2, 3)),
    "varlen student": (128, True, None, (2, 3)),
}
SEQS, SEQ_LEN = 16, 4096  # the varlen cases' shape (their N and heads are the call's --heads)


def make_inputs(name, n, h, d, grads):
    """The case's four inputs and the keyword arguments its layout adds (cu_seqlens for varlen)."""
    import torch

    extra = {}
    if name.startswith("varlen"):
        shape = (SEQS * SEQ_LEN, h, d)
        from streamkl.varlen import cu_seqlens_from_lengths

        extra = dict(cu_seqlens=cu_seqlens_from_lengths([SEQ_LEN] * SEQS, device="cuda"), max_seqlen=SEQ_LEN)
    elif name.startswith("batched"):
        shape = (SEQS, SEQ_LEN, h, d)
    else:
        shape = (1, n, h, d)
    inputs = [torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(i in grads) for i in range(4)]
    return inputs, extra


def make_run(lib, inputs, kwargs, grads):
    """One call of `lib.kl` (forward, with a backward when some input needs a gradient)."""

    def run():
        loss = lib.kl(*inputs, **kwargs)
        if grads:
            loss.backward()
            for t in inputs:
                t.grad = None

    return run


def flipped_package(spec: str) -> str:
    """A copy of this tree's `streamkl`, imported as `streamkl_flip`, with the module switches of
    `spec` set ("backends.triton.gluon_backward.DIAG_LAST=False,..."; values Python literals, set on
    the imported modules: the switches are read at call time). Returns the package's name."""
    import ast
    import importlib
    import re
    import shutil
    import tempfile

    root = Path(tempfile.mkdtemp(prefix="ab-flip-"))
    shutil.copytree(HERE.parent / "streamkl", root / "streamkl_flip", ignore=shutil.ignore_patterns("__pycache__"))
    for path in (root / "streamkl_flip").rglob("*.py"):  # (its custom ops get that namespace too)
        path.write_text(re.sub(r"\bstreamkl\b", "streamkl_flip", path.read_text()))
    sys.path.insert(0, str(root))
    for item in spec.split(","):
        target, value = item.split("=", 1)
        module, name = target.strip().rsplit(".", 1)
        loaded = importlib.import_module(f"streamkl_flip.{module}")
        if not hasattr(loaded, name):
            raise SystemExit(f"--flip: streamkl.{module} has no {name}")
        setattr(loaded, name, ast.literal_eval(value))
    return "streamkl_flip"


def interleaved(args):
    """Both packages in this process, each repetition timing one call of each (order alternating)."""
    import importlib


    sys.path.insert(0, str(HERE.parent))
    sys.path.insert(1, str(HERE))
    from suite import Timer, block_mask

    import streamkl

    libs = {"new": streamkl, "old": importlib.import_module(args.interleave)}
    n, h = args.n, args.heads
    timer, overlap = Timer("cuda"), Timer("cuda", overlap_host=True)
    rows = []
    for name in args.cases.split(","):
        d, causal, sparsity, grads = CASES[name]
        inputs, extra = make_inputs(name, n, h, d, grads)
        kwargs = {label: dict(causal=causal, backend="triton", **extra) for label in libs}
        if sparsity is not None:
            pattern = block_mask(n, h, sparsity, 128, "cuda").to_dense()
            for label, lib in libs.items():  # each package's own BlockMask
                kwargs[label]["mask1"] = kwargs[label]["mask2"] = lib.BlockMask.from_dense(pattern, 128)
        runs = {label: make_run(lib, inputs, kwargs[label], grads) for label, lib in libs.items()}
        for run in runs.values():
            for _ in range(3):
                run()
        sync = {label: [] for label in runs}
        host = {label: [] for label in runs}
        back = {label: [] for label in runs}
        for rep in range(args.repeats):
            for label in (("old", "new") if rep % 2 else ("new", "old")):
                sync[label].append(timer.once(runs[label])[0])
                host[label] += timer.host_ms(runs[label], 1)
                if rep % 5 == 0:  # calls back to back (host hidden where the GPU is the bound)
                    back[label] += overlap.overlapped(runs[label], 5)
        for label in runs:
            row = dict(case=name, tree=label, old=args.flip or args.interleave,
                       sync_ms=round(statistics.median(sync[label]), 4),
                       host_ms=round(statistics.median(host[label]), 4),
                       host_min_ms=round(min(host[label]), 4), overlap_ms=round(statistics.median(back[label]), 4))
            rows.append(row)
            print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in rows))


def worker(args):
    sys.path.insert(0, str(Path(args.worker).resolve()))
    sys.path.insert(1, str(HERE))
    import torch
    from suite import Timer, block_mask

    import streamkl

    assert Path(streamkl.__file__).resolve().is_relative_to(Path(args.worker).resolve()), streamkl.__file__
    n, h = args.n, args.heads
    timer, overlap = Timer("cuda"), Timer("cuda", overlap_host=True)
    for name in args.cases.split(","):
        d, causal, sparsity, grads = CASES[name]
        inputs, extra = make_inputs(name, n, h, d, grads)
        kwargs = dict(causal=causal, backend="triton", **extra)
        if sparsity is not None:
            kwargs["mask1"] = kwargs["mask2"] = block_mask(n, h, sparsity, 128, "cuda")

        run = make_run(streamkl, inputs, kwargs, grads)
        for _ in range(3):
            run()
        torch.cuda.synchronize()
        sync = [timer.once(run)[0] for _ in range(args.repeats)]
        host = timer.host_ms(run, args.repeats)
        back = overlap.overlapped(run, args.repeats)
        print(json.dumps(dict(tree=args.worker, case=name, sync_ms=round(statistics.median(sync), 4),
                              host_ms=round(statistics.median(host), 4), overlap_ms=round(statistics.median(back), 4))),
              flush=True)
    if args.engine:  # the autograd engine's own cost: a Function doing one scalar op each way on CUDA
        class Scalar(torch.autograd.Function):
            @staticmethod
            def forward(ctx, x):
                return x.sum()

            @staticmethod
            def backward(ctx, g):
                return g.expand(4)

        x = torch.zeros(4, device="cuda", requires_grad=True)
        spans = []
        for _ in range(200):
            loss = Scalar.apply(x)
            torch.cuda.synchronize()
            start = time.perf_counter()
            loss.backward()
            spans.append((time.perf_counter() - start) * 1e6)
            x.grad = None
        print(json.dumps(dict(tree=args.worker, case="engine: backward() of a one-op Function",
                              host_us=round(statistics.median(spans), 1))), flush=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--trees", default="old,.")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--interleave", default=None, help="the old tree's package name: both in one process")
    parser.add_argument("--flip", default=None, help="interleave with a copy of this tree, these switches set")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--engine", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        return worker(args)
    if args.flip:
        args.interleave = flipped_package(args.flip)
    if args.interleave:
        return interleaved(args)
    lines = []
    for round_ in range(args.rounds):
        for tree in args.trees.split(","):
            command = [sys.executable, __file__, "--worker", tree, "--cases", args.cases, "--n", str(args.n),
                       "--heads", str(args.heads), "--repeats", str(args.repeats)]
            if round_ == 0:
                command.append("--engine")
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode:
                print(result.stderr[-3000:], file=sys.stderr)
            for line in result.stdout.splitlines():
                row = dict(json.loads(line), round=round_)
                lines.append(row)
                print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text("".join(json.dumps(row) + "\n" for row in lines))


if __name__ == "__main__":
    main()
