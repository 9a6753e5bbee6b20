"""A/B of source trees on the GPU: the suite's Triton cases, tree A against trees B, C, ..., interleaved.

Each tree is a directory holding a `streamkl` package (a checkout, or `git worktree add /tmp/old REV`).
The packages are all named `streamkl`, so each round runs each tree in its own process
(PYTHONPATH=tree), the order reversed every other round (A B C, C B A, ...): drift of the machine
lands on all. Per case a worker measures

- `kernel_ms`: calls enqueued back to back (L2 flushed before each, one sync at the end), the median
  of CUDA-event times: the kernels' time as in a training loop (the suite's headline column);
- `host_us`: the wall time of one Python call started on an idle GPU (synchronized before the
  timer starts), median: for the no-grad forward, the training forward (the student's inputs
  require grad) and the backward, at N = 1K and 4K;
- `step_us`: a training step (forward and backward of the student) repeated back to back, time
  per step: where the host is slower than the kernels (small N), this is the host's time.

The report is a markdown table of the medians over rounds and the ratios to A, plus the raw JSON lines.

    git worktree add /tmp/streamkl-old <old-commit>
    python tools/ab_trees.py /tmp/streamkl-old . --rounds 4 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

# name: (N, D, causal, sparsity, grads, layout); grads index q1, k1, q2, k2
KERNEL_CASES = {
    "forward D=128": (16384, 128, False, None, (), "dense"),
    "forward D=128 causal": (16384, 128, True, None, (), "dense"),
    "forward D=64": (16384, 64, False, None, (), "dense"),
    "forward D=64 causal": (16384, 64, True, None, (), "dense"),
    "fwd+bwd student D=128": (16384, 128, False, None, (2, 3), "dense"),
    "fwd+bwd student D=128 causal": (16384, 128, True, None, (2, 3), "dense"),
    "fwd+bwd student D=64": (16384, 64, False, None, (2, 3), "dense"),
    "fwd+bwd student D=64 causal": (16384, 64, True, None, (2, 3), "dense"),
    "fwd+bwd all D=128": (16384, 128, False, None, (0, 1, 2, 3), "dense"),
    "fwd+bwd all D=128 causal": (16384, 128, True, None, (0, 1, 2, 3), "dense"),
    "forward 90% sparse": (16384, 128, False, 0.9, (), "dense"),
    "fwd+bwd student 90% sparse": (16384, 128, False, 0.9, (2, 3), "dense"),
    "fwd+bwd all 90% sparse": (16384, 128, False, 0.9, (0, 1, 2, 3), "dense"),
    "fwd+bwd student varlen 16x4K": (4096, 128, True, None, (2, 3), "varlen"),
    "fwd+bwd all varlen 16x4K": (4096, 128, True, None, (0, 1, 2, 3), "varlen"),
}
HOST_MODES = ("forward", "training forward", "backward")
HOST_SHAPES = ((1024, 128), (4096, 128), (1024, 64), (4096, 64))  # (N, D), causal, H=16
HEADS, SEQS, BLOCK = 16, 16, 128


# ----------------------------------------------------------------------------- the worker (one tree)
def _inputs(torch, shape, grads):
    return [torch.randn(shape, device="cuda", dtype=torch.bfloat16).requires_grad_(i in grads) for i in range(4)]


def _block_mask(torch, streamkl, n, sparsity):
    """The suite's mask: per head, each query block keeps the same number of random key blocks."""
    blocks = math.ceil(n / BLOCK)
    keep = max(1, round(blocks * (1.0 - sparsity)))
    scores = torch.rand(1, HEADS, blocks, blocks, generator=torch.Generator().manual_seed(1234))
    pattern = torch.zeros(1, HEADS, blocks, blocks, dtype=torch.bool).scatter_(-1, scores.topk(keep, -1).indices, True)
    return streamkl.BlockMask.from_dense(pattern.cuda(), block_size=BLOCK)


def _kernel_ms(torch, run, repeats):
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device="cuda")
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    events = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        run()
        end.record()
        events.append((start, end))
    torch.cuda.synchronize()
    return statistics.median(start.elapsed_time(end) for start, end in events)


def _host_us(torch, call, repeats, before=None):
    spans = []
    for _ in range(repeats + 3):  # the first three warm caches
        if before is not None:
            before()
        torch.cuda.synchronize()
        start = time.perf_counter()
        call()
        spans.append((time.perf_counter() - start) * 1e6)
    torch.cuda.synchronize()
    return statistics.median(spans[3:])


def _step_us(torch, streamkl, n, d, steps):
    """Microseconds per student training step, `steps` steps enqueued back to back."""
    q1, k1 = _inputs(torch, (1, n, HEADS, d), ())[:2]
    q2, k2 = _inputs(torch, (1, n, HEADS, d), (0, 1))[:2]

    def step():
        streamkl.kl(q1, k1, q2, k2, causal=True, backend="triton").backward()
        q2.grad = k2.grad = None

    for _ in range(10):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps * 1e6


def worker(tree: str, cases: list[str], repeats: int, host_repeats: int) -> None:
    import torch

    import streamkl

    if not Path(streamkl.__file__).resolve().is_relative_to(Path(tree).resolve()):
        raise SystemExit(f"imported {streamkl.__file__}, not the tree {tree}: is streamkl installed in site-packages?")
    torch.manual_seed(0)
    for name in cases:
        n, d, causal, sparsity, grads, layout = KERNEL_CASES[name]
        kwargs = dict(causal=causal, backend="triton")
        if layout == "varlen":
            inputs = _inputs(torch, (SEQS * n, HEADS, d), grads)
            kwargs.update(cu_seqlens=torch.arange(SEQS + 1, device="cuda", dtype=torch.int32) * n, max_seqlen=n)
        else:
            inputs = _inputs(torch, (1, n, HEADS, d), grads)
        if sparsity is not None:
            kwargs["mask1"] = kwargs["mask2"] = _block_mask(torch, streamkl, n, sparsity)

        def run(inputs=inputs, kwargs=kwargs, grads=grads):
            loss = streamkl.kl(*inputs, **kwargs)
            if grads:
                loss.backward()
                for t in inputs:
                    t.grad = None

        print(json.dumps(dict(case=name, metric="kernel_ms", value=_kernel_ms(torch, run, repeats))), flush=True)
        del inputs, kwargs, run
        torch.cuda.empty_cache()
    for n, d in HOST_SHAPES:
        for mode in HOST_MODES:
            grad = mode != "forward"
            q1, k1 = _inputs(torch, (1, n, HEADS, d), ())[:2]
            q2, k2 = _inputs(torch, (1, n, HEADS, d), (0, 1) if grad else ())[:2]

            def forward(q1=q1, k1=k1, q2=q2, k2=k2):
                return streamkl.kl(q1, k1, q2, k2, causal=True, backend="triton")

            if mode == "backward":
                held = {}

                def before(q2=q2, k2=k2, held=held, forward=forward):
                    q2.grad = k2.grad = None
                    held["loss"] = forward()

                value = _host_us(torch, lambda held=held: held.pop("loss").backward(), host_repeats, before)
            else:
                value = _host_us(torch, forward, host_repeats)
            case = f"host {mode}, N={n} D={d} causal"
            print(json.dumps(dict(case=case, metric="host_us", value=value)), flush=True)
        print(json.dumps(dict(case=f"training step, N={n} D={d} causal", metric="step_us",
                              value=_step_us(torch, streamkl, n, d, host_repeats))), flush=True)


# ----------------------------------------------------------------------------- the driver
def run_tree(tree: Path, args) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(tree))
    env.pop("STREAMKL_BACKEND", None)
    command = [sys.executable, str(Path(__file__).resolve()), "--worker", str(tree), "--cases", ",".join(args.cases),
               "--repeats", str(args.repeats), "--host-repeats", str(args.host_repeats)]
    result = subprocess.run(command, capture_output=True, text=True, env=env, cwd=tree)
    if result.returncode:
        raise SystemExit(f"tree {tree} failed:\n{result.stderr[-4000:]}")
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def report(rows: list[dict], trees: dict[str, Path]) -> str:
    labels = list(trees)
    lines = ["# A/B of source trees (medians over rounds)", ""]
    lines += [f"- {label}: `{tree}`" for label, tree in trees.items()]
    lines += [f"- rounds: {max(r['round'] for r in rows) + 1}, the trees' order reversed every other round; kernel_ms: "
              "back to back, CUDA events, L2 flushed; host_us: one call on an idle GPU", "",
              "| case | metric | " + " | ".join(labels) + " | " + " | ".join(f"{x}/A" for x in labels[1:]) + " |",
              "|---|---|" + "---|" * (2 * len(labels) - 1)]
    keys = list(dict.fromkeys((r["case"], r["metric"]) for r in rows))
    for case, metric in keys:
        values = {}
        for label in labels:
            seen = [r["value"] for r in rows if (r["case"], r["metric"], r["tree"]) == (case, metric, label)]
            values[label] = statistics.median(seen) if seen else float("nan")
        fmt = ".3f" if metric == "kernel_ms" else ".0f"
        ratios = [values[x] / values["A"] if values["A"] else float("nan") for x in labels[1:]]
        lines.append(f"| {case} | {metric} | " + " | ".join(f"{values[x]:{fmt}}" for x in labels) + " | "
                     + " | ".join(f"{r:.3f}" for r in ratios) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("trees", nargs="*", help="the baseline tree A (a directory holding streamkl/), then the "
                        "trees measured against it (B, C, ...; default: .)")
    parser.add_argument("--rounds", type=int, default=4, help="processes per tree, alternating")
    parser.add_argument("--cases", default=",".join(KERNEL_CASES), help="comma-separated kernel cases")
    parser.add_argument("--repeats", type=int, default=30, help="back-to-back calls per kernel case")
    parser.add_argument("--host-repeats", type=int, default=100, help="calls per host-time cell")
    parser.add_argument("--out", type=Path, default=None, help="directory for ab_trees.md and ab_trees.jsonl")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.cases = [c for c in args.cases.split(",") if c]
    unknown = [c for c in args.cases if c not in KERNEL_CASES]
    if unknown:
        parser.error(f"unknown cases {unknown}; known: {list(KERNEL_CASES)}")
    if args.worker:
        worker(args.worker, args.cases, args.repeats, args.host_repeats)
        return 0
    if not args.trees:
        parser.error("give tree A (e.g. a `git worktree` of the old commit) and the trees to compare (default .)")
    paths = args.trees if len(args.trees) > 1 else [*args.trees, "."]
    trees = {chr(ord("A") + i): Path(tree).resolve() for i, tree in enumerate(paths)}
    for label, tree in trees.items():
        if not (tree / "streamkl" / "__init__.py").exists():
            parser.error(f"tree {label} ({tree}) holds no streamkl package")
    rows = []
    for round_ in range(args.rounds):
        for label in list(trees) if round_ % 2 == 0 else list(trees)[::-1]:
            for row in run_tree(trees[label], args):
                rows.append(dict(row, tree=label, round=round_))
                print(json.dumps(rows[-1]), flush=True)
            if args.out:  # after every tree: a run cut short still leaves its table
                args.out.mkdir(parents=True, exist_ok=True)
                (args.out / "ab_trees.md").write_text(report(rows, trees))
                (args.out / "ab_trees.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(report(rows, trees))
    return 0


if __name__ == "__main__":
    sys.exit(main())
