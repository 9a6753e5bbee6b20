"""The CuPy backend on a GPU, forward and backward: at B=1, H=16, N=16384, bf16, D=128 and 64,
causal and not, the forward, the student backward (gradients of q2, k2) and the all-four backward
of the CuPy and Triton backends next to FlashAttention-2 (SDPA with the flash backend forced:
its forward, and its backward for q, k, v), plus the first-call time of a new shape (NVRTC
compile of the forward and backward kernels, unless CuPy's disk cache holds them). Prints a
table; one JSON line per row on stdout too. Helpers come from cupy_forward_h200.py.

    python benchmarks/cupy_backward_h200.py            # H200 (sm_90), about a minute
"""

from __future__ import annotations

import argparse
import functools
import json
import sys
import time

import torch
import torch.nn.functional as F
from cupy_forward_h200 import inputs, timed
from torch.nn.attention import SDPBackend, sdpa_kernel

import streamkl

STUDENT, ALL_FOUR = (False, False, True, True), (True, True, True, True)


def kl_backward_ms(x, needs, causal: bool, backend: str) -> float:
    """Median time of the backward alone: the forward runs once, its graph is kept."""
    try:
        leaves = [t.detach().requires_grad_(need) for t, need in zip(x, needs)]
        out = streamkl.kl(*leaves, reduction="sum", backend=backend, causal=causal)
    except Exception as exc:
        print(f"failed: {type(exc).__name__}: {exc}"[:400], file=sys.stderr)
        return float("nan")
    wanted = [t for t in leaves if t.requires_grad]
    return timed(lambda: torch.autograd.grad(out, wanted, retain_graph=True), repeats=10)


def fa2_ms(x, causal: bool) -> tuple[float, float]:
    q, k, v = (t.detach().transpose(1, 2).requires_grad_() for t in x[:3])
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        forward = timed(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal))
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
        upstream = torch.randn_like(out)
        backward = timed(lambda: torch.autograd.grad(out, (q, k, v), upstream, retain_graph=True), repeats=10)
    return forward, backward


def first_call_s(dim: int) -> float:
    """Forward and all-four backward of a shape no earlier call used (the kernels compile)."""
    x = [t.detach().requires_grad_() for t in inputs((1, 300), (1, 300), 2, (2, 2), (dim, dim + 16),
                                                      torch.bfloat16)]
    start = time.perf_counter()
    streamkl.kl(*x, backend="cupy", causal=True).backward()
    torch.cuda.synchronize()
    return time.perf_counter() - start


HEADER = (f"{'shape':20s} {'causal':6s} {'FA2 fwd':>8s} {'FA2 bwd':>8s} | {'cupy fwd':>8s} {'/FA2':>5s} "
          f"{'student':>8s} {'/FA2b':>5s} {'all4':>8s} {'/FA2b':>5s} | {'tri fwd':>8s} {'student':>8s} "
          f"{'all4':>8s} | {'1st call s':>10s}")


def line(r: dict) -> str:
    return (f"{r['shape']:20s} {str(r['causal']):6s} {r['fa2_fwd']:8.2f} {r['fa2_bwd']:8.2f} | "
            f"{r['cupy_fwd']:8.2f} {r['cupy_fwd'] / r['fa2_fwd']:5.2f} "
            f"{r['cupy_student']:8.2f} {r['cupy_student'] / r['fa2_bwd']:5.2f} "
            f"{r['cupy_all4']:8.2f} {r['cupy_all4'] / r['fa2_bwd']:5.2f} | "
            f"{r['triton_fwd']:8.2f} {r['triton_student']:8.2f} {r['triton_all4']:8.2f} | {r['first_call_s']:10.2f}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64], help="head dims (both sides)")
    args = parser.parse_args()
    print(torch.cuda.get_device_name(), "torch", torch.__version__, file=sys.stderr)
    print("times in ms, median; /FA2: over the FA2 forward, /FA2b: over the FA2 backward")
    print(HEADER, flush=True)
    rows = []
    n, h = 16384, 16
    for dim in args.dims:
        compile_s = first_call_s(dim)
        x = inputs((1, n), (1, n), h, (h, h), (dim, dim), torch.bfloat16)
        for causal in (False, True):
            row = dict(shape=f"B1-H16-N{n}-D{dim}", causal=causal, first_call_s=round(compile_s, 2))
            row["fa2_fwd"], row["fa2_bwd"] = fa2_ms(x, causal)
            for name in ("cupy", "triton"):  # the Triton rows last: their first call compiles longer
                row[f"{name}_fwd"] = timed(functools.partial(
                    streamkl.kl, *x, reduction="none", backend=name, causal=causal), repeats=10)
                row[f"{name}_student"] = kl_backward_ms(x, STUDENT, causal, name)
                row[f"{name}_all4"] = kl_backward_ms(x, ALL_FOUR, causal, name)
            rows.append(row)
            print(line(row), flush=True)
    for r in rows:
        print(json.dumps(r))


if __name__ == "__main__":
    main()
