"""The CuPy backend's tensor-core forward on a GPU: the default path (`streamkl.kl`, the tile shape
`launch.forward_shape` chooses) next to FlashAttention-2 (SDPA with the flash backend forced), at
B=1, H=16, N=16384, bf16, D=128 and 64, causal and not, with each shape's registers and local
(spilled) bytes per thread; then the first-call time of a new shape (forward and backward compile,
in a fresh CuPy cache). Prints one markdown table; one JSON line per measurement on stdout too.
Correctness: tests/test_cupy_gpu.py.

    python benchmarks/cupy_forward_h200.py                           # about half a minute
    python benchmarks/cupy_forward_h200.py --dims 64 --no-first-call
    python benchmarks/cupy_forward_h200.py --first-call              # only the compile time of a new shape
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streamkl  # noqa: E402
from streamkl.backends.cupy import emulate, launch  # noqa: E402
from streamkl.problem import build_problem  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # cpu: a smoke run on the emulator


def inputs(shape_q, shape_k, heads, heads_k, dims, dtype):
    (h1, h2), (d1, d2) = heads_k, dims
    shapes = [(*shape_q, heads, d1), (*shape_k, h1, d1), (*shape_q, heads, d2), (*shape_k, h2, d2)]
    return [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]


def sync() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def median_ms(fn, repeats: int = 20) -> float:
    if DEVICE == "cpu":
        start = time.perf_counter()
        fn()
        return (time.perf_counter() - start) * 1e3
    flush = torch.empty(256 * 2**20, dtype=torch.int8, device=DEVICE)
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def timed(fn, repeats: int = 20) -> float:
    """median_ms, or NaN (the error on stderr) when the call fails."""
    try:
        return median_ms(fn, repeats)
    except Exception as exc:
        print(f"failed: {type(exc).__name__}: {exc}"[:400], file=sys.stderr)
        return float("nan")


def kernel_resources(variant) -> dict:
    """Registers and local (spilled) bytes per thread of the compiled `variant`, shared bytes."""
    resources = dict(shape=variant.label, smem=variant.shared_bytes)
    if not emulate.emulating():
        try:  # the module the default path compiled (cached)
            code, device = launch.INPUT_CODES[torch.bfloat16], torch.cuda.current_device()
            function = launch._mma_functions(code, (variant,), device)[variant.name]
            resources.update(regs=function.num_regs, local_bytes=function.local_size_bytes)
        except Exception as exc:
            print(f"resources of {variant.name}: {type(exc).__name__}: {exc}"[:400], file=sys.stderr)
    return resources


def forward_rows(dims, repeats: int, n: int, heads: int) -> list[dict]:
    """One row per (provider, dim, causal): FA2's and the CuPy forward's median ms."""
    rows = []
    for dim in dims:
        x = inputs((1, n), (1, n), heads, (heads, heads), (dim, dim), torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in x[:3])
        for causal in (False, True):
            case = dict(dim=dim, causal=causal)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fa2 = timed(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal), repeats)
            rows.append(dict(case, provider="FA2", ms=fa2))
            cupy = timed(functools.partial(streamkl.kl, *x, reduction="none", backend="cupy", causal=causal), repeats)
            variant = launch.forward_variant(build_problem(*x, causal=causal))
            rows.append(dict(case, provider="cupy", ms=cupy, fa2_ms=fa2, variant=variant.name,
                             **kernel_resources(variant)))
            print(f"D{dim} causal={causal} done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], dims) -> str:
    """Markdown: FA2 and the CuPy forward, one column per case, "ms (x FA2)"; the shape and its
    registers / local bytes per dim."""
    cases = [(dim, causal) for dim in dims for causal in (False, True)]
    cell = {(r["provider"], r["dim"], r["causal"]): r for r in rows}
    head = ["provider", *(f"D{d}{' causal' if c else ''}" for d, c in cases)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for provider in ("FA2", "cupy"):
        out = [provider]
        for dim, causal in cases:
            r = cell[(provider, dim, causal)]
            text = "failed" if r["ms"] != r["ms"] else f"{r['ms']:.2f}"
            if "fa2_ms" in r and r["ms"] == r["ms"]:
                text += f" ({r['ms'] / r['fa2_ms']:.2f})"
            out.append(text)
        lines.append("| " + " | ".join(out) + " |")
    for dim in dims:
        r = cell[("cupy", dim, False)]
        lines.append(f"\nD{dim}: {r['shape']}, {r.get('regs', '?')} registers, {r.get('local_bytes', '?')} local "
                     f"bytes per thread, {r['smem']} shared bytes per block")
    return "\n".join(lines)


def first_call_child() -> None:
    """Forward, then backward, of a shape no other call uses (prints one JSON line)."""
    dims = (96, 80)
    x = [t.requires_grad_() for t in inputs((1, 300), (1, 300), 2, (2, 2), dims, torch.bfloat16)]
    sync()
    start = time.perf_counter()
    out = streamkl.kl(*x, backend="cupy", causal=True)
    sync()
    forward = time.perf_counter() - start
    start = time.perf_counter()
    out.backward()
    sync()
    backward = time.perf_counter() - start
    print(json.dumps(dict(first_call=f"D{dims[0]}x{dims[1]} bf16", forward_s=round(forward, 2),
                          backward_s=round(backward, 2))))


def first_call() -> dict:
    """first_call_child in a fresh process and a fresh CuPy kernel cache (nothing compiled yet)."""
    with tempfile.TemporaryDirectory() as cache:
        env = dict(os.environ, CUPY_CACHE_DIR=cache)
        result = subprocess.run([sys.executable, __file__, "--first-call-child"], env=env, capture_output=True,
                                text=True, timeout=120)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        return dict(first_call="failed", error=result.stderr[-600:])
    return json.loads(lines[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dims", type=int, nargs="+", default=[128, 64], help="head dims (both sides)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--n", type=int, default=16384, help="sequence length (queries and keys)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--first-call", action="store_true", help="only the first-call time of a new shape")
    parser.add_argument("--no-first-call", action="store_true", help="skip the first-call time")
    parser.add_argument("--first-call-child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.first_call_child:
        return first_call_child()
    print(torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch", torch.__version__, file=sys.stderr)
    if not args.first_call:
        rows = forward_rows(args.dims, args.repeats, args.n, args.heads)
        print(f"\nforward ms (x FA2), bf16, B=1, H={args.heads}, N={args.n}")
        print(table(rows, args.dims), flush=True)
        for r in rows:
            print(json.dumps(r))
    if not args.no_first_call:
        print(f"first call of a new shape (fresh CuPy cache): {json.dumps(first_call())}", flush=True)


if __name__ == "__main__":
    main()
