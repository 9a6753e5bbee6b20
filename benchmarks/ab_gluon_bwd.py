"""Interleaved A/B timing of student-backward variants on the GPU: the Gluon backward's switches
(module attributes of gluon_backward.py) against each other and against backward.py, the backward
call alone (one forward, then `backward(retain_graph=True)` timed), each variant timed in turn
for several rounds so that clock and thermal drift fall on all of them alike (the same kernel timed
twice in one tune_h200.py run differed by up to 4 %; ninth session). Prints one JSON line a
variant: the median over rounds, the spread (max - min of the rounds' medians) and the gradients'
relative error against the first variant.

    python benchmarks/ab_gluon_bwd.py --causal --variants '[{}, {"DQ_VEC2": true}, {"gluon": false}]'
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import triton

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import streamkl  # noqa: E402
from streamkl.backends.triton import backward, gluon_backward, gluon_forward  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--n", type=int, default=16384)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--causal", action="store_true")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--rep", type=int, default=100, help="do_bench milliseconds a round")
    parser.add_argument("--variants", required=True, help="JSON list of {attribute: value} (gluon_backward's; "
                        "'backward.NAME': backward.py's); 'gluon': False runs backward.py")
    parser.add_argument("--out", default=None, help="append the JSON lines to this file")
    parser.add_argument("--all-grads", action="store_true", help="all four gradients (both sides)")
    parser.add_argument("--kv-heads", type=int, default=None, help="key heads of both sides (GQA; default --heads)")
    args = parser.parse_args()
    variants = json.loads(args.variants)
    g = torch.Generator(device="cuda").manual_seed(0)
    kv = args.kv_heads or args.heads
    x = [torch.randn(1, args.n, kv if i % 2 else args.heads, args.dim, device="cuda", dtype=torch.bfloat16,
                     generator=g).requires_grad_(i >= 2 or args.all_grads) for i in range(4)]
    wrt = x if args.all_grads else x[2:]
    modules = {"": gluon_backward, "backward.": backward}  # "backward.NAME": an attribute of backward.py

    def owner(name):
        prefix = "backward." if name.startswith("backward.") else ""
        return modules[prefix], name[len(prefix):]

    defaults = {name: getattr(*owner(name)) for v in variants for name in v if name != "gluon"}

    def setup(variant):
        for name, value in defaults.items():
            setattr(*owner(name), variant.get(name, value))
        gluon_forward.USE_GLUON = variant.get("gluon", True)

    runs = []
    for variant in variants:  # compile, check, and one output each
        setup(variant)
        out = streamkl.kl(*x, backend="triton", causal=args.causal)
        grads = torch.autograd.grad(out, wrt, retain_graph=True)

        def call(out=out):
            out.backward(retain_graph=True)

        runs.append((call, [t.float() for t in grads]))
    times = [[] for _ in variants]
    for _ in range(args.rounds):
        for k, (variant, (call, _)) in enumerate(zip(variants, runs)):
            setup(variant)
            times[k].append(triton.testing.do_bench(call, warmup=20, rep=args.rep, grad_to_none=wrt,
                                                    return_mode="median"))
    setup({})
    gluon_forward.USE_GLUON = None
    ref = runs[0][1]
    lines = []
    for variant, (_, grads), ts in zip(variants, runs, times):
        err = max(((a - b).norm() / b.norm()).item() for a, b in zip(grads, ref))
        row = dict(kind="ab_bwd", n=args.n, d=args.dim, causal=args.causal, all_grads=args.all_grads, kv_heads=kv,
                   variant=variant,
                   ms=statistics.median(ts), spread=max(ts) - min(ts), rounds=[round(t, 3) for t in ts],
                   rel_err_vs_first=err, device=torch.cuda.get_device_name())
        lines.append(json.dumps(row))
        print(lines[-1], flush=True)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
