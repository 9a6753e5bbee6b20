"""The CuPy backend's tensor-core forward on a GPU: every candidate tile shape of
`launch.FORWARD_CANDIDATES` timed side by side next to FlashAttention-2 (SDPA with the flash
backend forced) and the default path (`streamkl.kl`, the shape `launch.forward_shape` picks), at
B=1, H=16, N=16384, bf16, D=128 and 64, causal and not; then the first-call time of a new shape
(forward and backward compile, in a fresh CuPy cache). Prints one markdown table; one JSON line per
measurement on stdout too. Correctness of the candidates: tests/test_cupy_gpu.py -k candidate.

    python benchmarks/cupy_forward_h200.py                           # all candidates, about a minute
    python benchmarks/cupy_forward_h200.py --config k32-m2-w4 k64-m1-w8 --dims 64
    python benchmarks/cupy_forward_h200.py --first-call              # only the compile time of a new shape
"""

from __future__ import annotations

import argparse
import functools
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streamkl  # noqa: E402
from streamkl.backends.cupy import emulate, launch  # noqa: E402
from streamkl.problem import build_problem  # noqa: E402
from streamkl.sparse.schedule import get_schedule  # noqa: E402

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


def _warm(variant) -> str:
    """Compile one variant in a worker process (CuPy's disk cache keeps it): '' or the error."""
    try:
        launch._mma_functions(launch.INPUT_CODES[torch.bfloat16], (variant,), 0)
        return ""
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"[:300]


def compile_all(variants) -> dict:
    """Compile every variant (one NVRTC module each, as the backend does): first in parallel
    worker processes, which fill CuPy's disk cache, then here from that cache. {variant:
    function or the error text}."""
    if emulate.emulating():
        return dict.fromkeys(variants)
    spawn = multiprocessing.get_context("spawn")
    try:
        with ProcessPoolExecutor(max_workers=min(12, len(variants)), mp_context=spawn) as pool:
            errors = [error for error in pool.map(_warm, variants) if error]
        if errors:
            print(f"compile errors: {errors}", file=sys.stderr)
    except Exception as exc:  # the compiles below then run here, one after another
        print(f"parallel compile failed: {type(exc).__name__}: {exc}"[:400], file=sys.stderr)
    code = launch.INPUT_CODES[torch.bfloat16]
    device = torch.cuda.current_device()
    functions = {}
    for variant in variants:
        try:
            functions[variant] = launch._mma_functions(code, (variant,), device)[variant.name]
        except Exception as exc:
            functions[variant] = f"{type(exc).__name__}: {exc}"[:300]
    return functions


def rel_l2(a: torch.Tensor, e: torch.Tensor) -> float:
    finite = torch.isfinite(e)
    a, e = a[finite].double(), e[finite].double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def candidates(names, dims, repeats: int, n: int, heads: int) -> list[dict]:
    """One row per (config, dim, causal): the forward's median ms, next to FA2's."""
    variants = {(name, dim): launch.MmaForward.of(dim, dim, launch.FORWARD_CANDIDATES[name])
                for name in names for dim in dims}
    start = time.perf_counter()
    functions = compile_all(list(dict.fromkeys(variants.values())))
    print(f"compiled {len(functions)} variants in {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
    rows = []
    for dim in dims:
        x = inputs((1, n), (1, n), heads, (heads, heads), (dim, dim), torch.bfloat16)
        q, k, v = (t.transpose(1, 2) for t in x[:3])
        for causal in (False, True):
            case = dict(dim=dim, causal=causal)
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                fa2 = timed(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal))
            rows.append(dict(case, config="FA2", ms=fa2))
            default = functools.partial(streamkl.kl, *x, reduction="none", backend="cupy", causal=causal)
            rows.append(dict(case, config="default (streamkl.kl)", ms=timed(default, repeats), fa2_ms=fa2,
                             variant=launch.forward_variant(build_problem(*x)).name))
            expected = default()
            problem = build_problem(*x, causal=causal)
            for name in names:
                variant = variants[(name, dim)]
                function = functions[variant]
                row = dict(case, config=name, variant=variant.name, fa2_ms=fa2, smem=variant.shared_bytes)
                if isinstance(function, str):
                    rows.append(dict(row, ms=float("nan"), error=function))
                    continue
                row.update(regs=getattr(function, "num_regs", "?"),
                           local_bytes=getattr(function, "local_size_bytes", "?"))
                schedule = get_schedule(problem, variant.block_q, variant.block_k)
                run = functools.partial(launch.forward_with, variant, problem, *x, schedule)
                row["ms"] = timed(run, repeats)
                try:
                    row["rel_diff"] = rel_l2(run()[0], expected)  # against the default path: a gross error shows
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                rows.append(row)
            print(f"D{dim} causal={causal} done", file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict], dims) -> str:
    """Markdown: one line per config, one column per case, "ms (x FA2)"; regs / local bytes per dim."""
    cases = [(dim, causal) for dim in dims for causal in (False, True)]
    names = list(dict.fromkeys(r["config"] for r in rows))
    cell = {(r["config"], r["dim"], r["causal"]): r for r in rows}
    head = ["config", *(f"D{d}{' causal' if c else ''}" for d, c in cases), *(f"regs/spill D{d}" for d in dims)]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name in names:
        out = [name]
        for dim, causal in cases:
            r = cell.get((name, dim, causal))
            if r is None or r["ms"] != r["ms"]:
                out.append("failed" if r is not None else "")
                continue
            text = f"{r['ms']:.2f}"
            if "fa2_ms" in r:
                text += f" ({r['ms'] / r['fa2_ms']:.2f})"
            if r.get("rel_diff", 0.0) > 1e-3 or "error" in r:
                text += " WRONG"
            out.append(text)
        for dim in dims:
            r = cell.get((name, dim, False), {})
            out.append(f"{r['regs']}/{r['local_bytes']}" if "regs" in r else "")
        lines.append("| " + " | ".join(out) + " |")
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
    parser.add_argument("--config", nargs="+", default=list(launch.FORWARD_CANDIDATES),
                        choices=list(launch.FORWARD_CANDIDATES), help="candidate tile shapes (default: all)")
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
        rows = candidates(args.config, args.dims, args.repeats, args.n, args.heads)
        print(f"\nforward ms (x FA2), bf16, B=1, H={args.heads}, N={args.n}; regs/spill: registers and local bytes "
              "per thread")
        print(table(rows, args.dims), flush=True)
        for r in rows:
            print(json.dumps(r))
    if not args.no_first_call:
        print(f"first call of a new shape (fresh CuPy cache): {json.dumps(first_call())}", flush=True)


if __name__ == "__main__":
    main()
