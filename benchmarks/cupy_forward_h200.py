"""The CuPy backend's tensor-core forward on a GPU: correctness against the float64 reference
(outputs poisoned), the first-call compile time of a new shape, then forward times at B=1, H=16,
N=16384, bf16, D=128 and 64, causal and not, next to FlashAttention-2 (SDPA with the flash
backend forced) and the Triton backend, then the kernel's template variants side by side (tile
shapes, warps, stages). Prints tables; one JSON line per row on stdout too.

    python benchmarks/cupy_forward_h200.py            # H200 (sm_90), about two minutes
"""

from __future__ import annotations

import functools
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import streamkl  # noqa: E402
from streamkl import BlockMask  # noqa: E402
from streamkl.backends import base  # noqa: E402
from streamkl.backends.cupy import launch  # noqa: E402
from streamkl.problem import build_problem  # noqa: E402
from streamkl.reference import reference_kl  # noqa: E402
from streamkl.varlen import cu_seqlens_from_lengths  # noqa: E402

DEVICE = "cuda"


def rel_l2(a: torch.Tensor, e: torch.Tensor) -> float:
    finite = torch.isfinite(e)
    a, e = a[finite].double(), e[finite].double()
    return ((a - e).norm() / e.norm().clamp_min(1e-30)).item()


def inputs(shape_q, shape_k, heads, heads_k, dims, dtype):
    (h1, h2), (d1, d2) = heads_k, dims
    shapes = [(*shape_q, heads, d1), (*shape_k, h1, d1), (*shape_q, heads, d2), (*shape_k, h2, d2)]
    return [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]


def correctness() -> list[dict]:
    os.environ[base.POISON_ENV] = "1"  # a row the kernel never writes stays NaN and fails
    rows = []
    mask_pattern = torch.rand(2, 4, 5, 9, device=DEVICE) < 0.5
    mask_pattern[..., 0] = True
    wider = mask_pattern | (torch.rand(mask_pattern.shape, device=DEVICE) < 0.3)
    cases = [
        ("B2-Nq300-Nk257-H4-Hk4x2-D128x64-causal", (2, 300), (2, 257), 4, (4, 2), (128, 64), dict(causal=True)),
        ("B1-Nq1000-Nk1000-H4-Hk1x2-D64x48", (1, 1000), (1, 1000), 4, (1, 2), (64, 48), {}),
        ("B1-Nq200-Nk190-H2-Hk1x2-D256x256", (1, 200), (1, 190), 2, (1, 2), (256, 256), {}),
        ("B1-Nq150-Nk150-H2-Hk2x1-D200x130-win40", (1, 150), (1, 150), 2, (2, 1), (200, 130), dict(window=(40, 40))),
        ("B1-Nq77-Nk170-H2-Hk2x2-D7x40-unaligned", (1, 77), (1, 170), 2, (2, 2), (7, 40), {}),
        ("B2-Nq260-Nk520-H4-Hk2x4-D64x32-masks", (2, 260), (2, 520), 4, (2, 4), (64, 32),
         dict(causal=True, mask1=BlockMask.from_dense(mask_pattern, (64, 64)),
              mask2=BlockMask.from_dense(wider, (64, 64)))),
    ]
    for dtype in (torch.bfloat16, torch.float16):
        for name, sq, sk, h, hk, dims, kw in cases:
            row = dict(case=name, dtype=str(dtype).split(".")[-1], kl=float("nan"))
            try:  # one failing case (a compile error, a fault) still leaves the others' lines
                x = inputs(sq, sk, h, hk, dims, dtype)
                out, lse1, lse2 = streamkl.kl(*x, reduction="none", return_lse=True, backend="cupy", **kw)
                ref, r1, r2 = reference_kl(*(t.double() for t in x), **kw)
                row.update(kernel=launch.forward_variant(build_problem(*x, **kw)).name,
                           kl=rel_l2(out, ref), lse1=rel_l2(lse1, r1), lse2=rel_l2(lse2, r2),
                           inf_pattern=bool(torch.equal(torch.isinf(out), torch.isinf(ref))),
                           nan=bool(torch.isnan(out).any()))
                row["ok"] = (max(row["kl"], row["lse1"], row["lse2"]) <= 1e-2 and row["inf_pattern"]
                             and not row["nan"])
            except Exception as exc:
                row.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            rows.append(row)
    # varlen with empty sequences
    len_q, len_k = [37, 0, 1000, 5, 64, 0], [50, 3, 0, 20, 777, 9]
    cu_q, cu_k = cu_seqlens_from_lengths(len_q, DEVICE), cu_seqlens_from_lengths(len_k, DEVICE)
    x = inputs((sum(len_q) + 6,), (sum(len_k) + 2,), 4, (2, 1), (128, 64), torch.bfloat16)
    kw = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=True)
    out = streamkl.kl(*x, reduction="none", backend="cupy", **kw)
    ref, _, _ = reference_kl(*(t.double() for t in x), **kw)
    row = dict(case="varlen-empty-seqs-D128x64-causal", dtype="bfloat16", kl=rel_l2(out, ref),
               nan=bool(torch.isnan(out).any()))
    row["ok"] = row["kl"] <= 1e-2 and not row["nan"]
    rows.append(row)
    del os.environ[base.POISON_ENV]
    return rows


def median_ms(fn, repeats: int = 20) -> float:
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


def timing() -> list[dict]:
    rows = []
    n, h = 16384, 16
    for dim in (128, 64):
        x = inputs((1, n), (1, n), h, (h, h), (dim, dim), torch.bfloat16)
        # compile time of a new shape: the first call of a variant not used above (NVRTC, unless
        # CuPy's disk cache already holds it from an earlier run)
        start = time.perf_counter()
        streamkl.kl(*x, reduction="none", backend="cupy", causal=True)
        torch.cuda.synchronize()
        first_call_s = time.perf_counter() - start
        q, k, v = (t.transpose(1, 2) for t in x[:3])
        for causal in (False, True):
            row = dict(shape=f"B1-H16-N{n}-D{dim}", causal=causal, first_call_s=round(first_call_s, 2))
            for name in ("cupy", "triton"):
                row[f"{name}_ms"] = timed(functools.partial(
                    streamkl.kl, *x, reduction="none", backend=name, causal=causal))
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                row["fa2_ms"] = timed(functools.partial(F.scaled_dot_product_attention, q, k, v, is_causal=causal))
            row["cupy/fa2"] = row["cupy_ms"] / row["fa2_ms"]
            row["cupy/triton"] = row["cupy_ms"] / row["triton_ms"]
            rows.append(row)
    return rows


def variants() -> list[dict]:
    """The tensor-core forward's template variants side by side (same inputs, each on its own
    schedule), and each one's largest difference from the default variant's KL."""
    from streamkl.backends.cupy.launch import MmaForward
    from streamkl.sparse.schedule import get_schedule

    rows = []
    n, h = 16384, 16
    for dim in (128, 64):
        x = inputs((1, n), (1, n), h, (h, h), (dim, dim), torch.bfloat16)
        for causal in (False, True):
            problem = build_problem(*x, causal=causal)
            default = launch.forward_variant(problem)
            reference = None
            for v in [default, MmaForward(dim, dim, 64, 1), MmaForward(dim, dim, 32, 1),
                      MmaForward(dim, dim, 64, 2), MmaForward(dim, dim, 32, 2, stages=3),
                      MmaForward(dim, dim, 32, 2, warps=8)]:
                schedule = get_schedule(problem, v.block_q, v.block_k)
                run = functools.partial(launch.forward_with, v, problem, *x, schedule)
                ms = timed(run, repeats=10)
                if ms != ms:  # failed (NaN): reported on stderr
                    continue
                kl = run()[0]
                reference = kl if reference is None else reference
                rows.append(dict(shape=f"B1-H16-N{n}-D{dim}", causal=causal, variant=v.name, ms=ms,
                                 smem=v.shared_bytes, max_diff=(kl - reference).abs().max().item()))
    return rows


def main():
    print(torch.cuda.get_device_name(), "torch", torch.__version__, file=sys.stderr)
    checks = correctness()
    print(f"{'case':44s} {'dtype':9s} {'kl':>9s} {'lse1':>9s} {'lse2':>9s}  ok")
    for r in checks:
        print(f"{r['case']:44s} {r['dtype']:9s} {r['kl']:9.2e} {r.get('lse1', 0):9.2e} {r.get('lse2', 0):9.2e}  "
              f"{r['ok']} {r.get('error', '')}")
    times = timing()
    print(f"\n{'shape':20s} {'causal':6s} {'cupy ms':>8s} {'triton':>8s} {'FA2':>8s} {'cupy/FA2':>9s} "
          f"{'cupy/tri':>9s} {'1st call s':>10s}")
    for r in times:
        print(f"{r['shape']:20s} {str(r['causal']):6s} {r['cupy_ms']:8.2f} {r['triton_ms']:8.2f} {r['fa2_ms']:8.2f} "
              f"{r['cupy/fa2']:9.2f} {r['cupy/triton']:9.2f} {r['first_call_s']:10.2f}")
    ab = variants()
    print(f"\n{'shape':20s} {'causal':6s} {'variant':42s} {'ms':>8s} {'smem':>7s} {'max diff':>9s}")
    for r in ab:
        print(f"{r['shape']:20s} {str(r['causal']):6s} {r['variant']:42s} {r['ms']:8.2f} {r['smem']:7d} "
              f"{r['max_diff']:9.2e}")
    for r in checks + times + ab:
        print(json.dumps(r))
    if not all(r["ok"] for r in checks):
        sys.exit(1)


if __name__ == "__main__":
    main()
