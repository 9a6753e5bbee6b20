"""GPU benchmark: streamkl's Triton backend against the naive materializing KL and one SDPA (flash)
attention of the same shape, forward and forward + backward, time and peak memory.

    python benchmarks/triton_h200.py                 # B=1, H=16, D=128, N in (4096, 16384), bf16
    python benchmarks/triton_h200.py --out DIR       # where results.json / results.md go
    python benchmarks/triton_h200.py --quick         # N=1024 only, a smoke run

Providers:
- `streamkl`: streamkl.kl(..., backend="triton"), reduction mean.
- `naive`: both (B, H, N, N) score matrices (bf16 matmul, float32 softmax math), log_softmax of
  each, KL = sum p1 (log p1 - log p2), mean; autograd for the backward. "OOM" when it does not fit.
- `sdpa`: torch.nn.functional.scaled_dot_product_attention on the teacher's q, k (v = a random
  tensor), flash backend forced: the cost of one attention of the same shape, for scale.
Modes: `forward` (no grads), `fwd+bwd student` (q2, k2 need grads: a detached teacher),
`fwd+bwd all` (q1, k1, q2, k2). SDPA's fwd+bwd computes dq, dk, dv.
Times: median of triton.testing.do_bench (CUDA events, L2 flushed between runs). Memory: peak
allocated during one run minus what was allocated before it (inputs excluded).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
from triton.testing import do_bench  # noqa: E402

import streamkl  # noqa: E402
from benchmarks.naive import naive_kl  # noqa: E402

MIB = 2**20
GRADS = {"forward": (), "fwd+bwd student": (2, 3), "fwd+bwd all": (0, 1, 2, 3)}


def make_inputs(batch, n, heads, dim, dtype, grads):
    tensors = [torch.randn(batch, n, heads, dim, device="cuda", dtype=dtype) for _ in range(4)]
    return [t.requires_grad_(i in grads) for i, t in enumerate(tensors)]


def step(provider, mode, inputs, causal, value):
    q1, k1, q2, k2 = inputs
    if provider == "streamkl":
        loss = streamkl.kl(q1, k1, q2, k2, causal=causal, backend="triton")
    elif provider == "naive":
        loss = naive_kl(q1, k1, q2, k2, causal)
    else:  # sdpa: (B, H, N, D) views of the teacher's q, k
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            out = F.scaled_dot_product_attention(q1.transpose(1, 2), k1.transpose(1, 2), value, is_causal=causal)
        loss = out.float().sum()
    if mode != "forward":
        loss.backward()
        for t in (*inputs, value):
            t.grad = None
    return loss


def measure(provider, mode, batch, n, heads, dim, dtype, causal):
    grads = GRADS[mode] if provider != "sdpa" or mode == "forward" else (0, 1)
    if provider == "sdpa" and mode == "fwd+bwd student":
        return None  # one attention has no teacher / student split
    torch.cuda.empty_cache()
    inputs = make_inputs(batch, n, heads, dim, dtype, grads)
    value = torch.randn(batch, heads, n, dim, device="cuda", dtype=dtype, requires_grad=mode != "forward")
    fn = lambda: step(provider, mode, inputs, causal, value)  # noqa: E731
    row = dict(provider=provider, mode=mode, n=n, causal=causal)
    try:
        torch.cuda.synchronize()
        fn()  # warm up: compile, caches
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        row["peak_mib"] = (torch.cuda.max_memory_allocated() - base) / MIB
        row["ms"] = do_bench(fn, warmup=50, rep=300, return_mode="median")
    except torch.cuda.OutOfMemoryError:
        row["ms"] = None
        row["peak_mib"] = None
        row["note"] = "OOM"
    fn = inputs = value = None
    torch.cuda.empty_cache()
    if provider == "streamkl" and row.get("ms"):
        # matmul flops actually needed: scores of both sides (+ dq, dk of each side with grads)
        pairs = batch * heads * n * n * (0.5 if causal else 1.0)
        sides = len(GRADS[mode]) // 2  # sides needing gradients
        mults = 2 if mode == "forward" else 2 + 2 * (2 + sides)  # fwd; dq and dk kernels
        row["tflops"] = 2 * pairs * dim * mults / (row["ms"] * 1e-3) / 1e12
    return row


def _meta(shape: dict) -> dict:
    return dict(
        command="python benchmarks/triton_h200.py " + " ".join(sys.argv[1:]),
        gpu=torch.cuda.get_device_name(),
        torch=torch.__version__,
        triton=triton.__version__,
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        shape=shape,
    )


def split_k_rows(out: Path, meta: dict):
    """Forward of few queries against many keys (chunked prefill / decode-like): split-K on and off."""
    from streamkl.backends.triton import forward

    rows = []
    heads, dim, dtype = 16, 128, torch.bfloat16
    for nq, nk in ((128, 131072), (1024, 131072)):
        inputs = [torch.randn(1, n, heads, dim, device="cuda", dtype=dtype) for n in (nq, nk, nq, nk)]
        value = torch.randn(1, heads, nk, dim, device="cuda", dtype=dtype)
        for label, override in (("split-K (heuristic)", None), ("no split", 1)):
            forward.SPLIT_OVERRIDE = override
            fn = lambda inputs=inputs: streamkl.kl(*inputs, causal=True, backend="triton")  # noqa: E731
            fn()
            rows.append(dict(nq=nq, nk=nk, provider="streamkl " + label,
                             ms=do_bench(fn, warmup=25, rep=200, return_mode="median")))
        forward.SPLIT_OVERRIDE = None
        q, k = inputs[0].transpose(1, 2), inputs[1].transpose(1, 2)
        from torch.nn.attention import SDPBackend, sdpa_kernel

        def sdpa(q=q, k=k, value=value):
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return F.scaled_dot_product_attention(q, k, value, is_causal=False)

        rows.append(dict(nq=nq, nk=nk, provider="sdpa flash (one attention)",
                         ms=do_bench(sdpa, warmup=25, rep=200, return_mode="median")))
        for r in rows[-3:]:
            print(json.dumps(r), flush=True)
    (out / "triton_h200_splitk.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        "# streamkl Triton forward: split-K for few queries against long keys",
        "",
        f"- command: `{meta['command']}`; GPU: {meta['gpu']}; torch {meta['torch']}; triton {meta['triton']};"
        f" {meta['date']}",
        f"- B=1, H={heads}, D={dim}, bf16, causal (bottom-right: every query sees ~all keys); median ms",
        "",
        "| Nq | Nk | provider | ms |",
        "|---|---|---|---|",
    ] + [f"| {r['nq']} | {r['nk']} | {r['provider']} | {r['ms']:.3f} |" for r in rows]
    (out / "triton_h200_splitk.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--sizes", default=None, help="comma-separated N values")
    parser.add_argument("--split-k", action="store_true", help="only the split-K forward comparison")
    parser.add_argument("--providers", default="streamkl,sdpa,naive", help="comma-separated subset")
    args = parser.parse_args()
    if args.split_k:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        split_k_rows(out, _meta(dict(batch=1, heads=16, dim=128, dtype="bfloat16")))
        return
    batch, heads, dim, dtype = 1, 16, 128, torch.bfloat16
    sizes = [1024] if args.quick else [4096, 16384]
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for n in sizes:
        for causal in (False, True):
            for provider in args.providers.split(","):
                for mode in GRADS:
                    row = measure(provider, mode, batch, n, heads, dim, dtype, causal)
                    if row is not None:
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    meta = _meta(dict(batch=batch, heads=heads, dim=dim, dtype=str(dtype).replace("torch.", "")))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "triton_h200.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [
        "# streamkl Triton backend on the GPU",
        "",
        f"- command: `{meta['command']}`",
        f"- GPU: {meta['gpu']}; torch {meta['torch']}; triton {meta['triton']}; {meta['date']}",
        f"- shape: B={batch}, H={heads}, D={dim}, {meta['shape']['dtype']}; times are medians (ms), memory is",
        "  peak allocation during one run beyond the inputs (MiB)",
        "",
        "| N | causal | mode | streamkl ms | streamkl MiB | streamkl TFLOP/s | sdpa ms | sdpa MiB | naive ms"
        " | naive MiB |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    fmt = lambda v, spec: "OOM" if v is None else v if isinstance(v, str) else format(v, spec)  # noqa: E731
    for n in sizes:
        for causal in (False, True):
            for mode in GRADS:
                cell = {}
                for r in rows:
                    if r["n"] == n and r["causal"] == causal and r["mode"] == mode:
                        cell[r["provider"]] = r
                absent = {"ms": "-", "peak_mib": "-", "tflops": "-"}  # provider not run (OOM is None)
                s, a, v = (cell.get(name) or absent for name in ("streamkl", "sdpa", "naive"))
                lines.append(
                    f"| {n} | {causal} | {mode} | {fmt(s.get('ms'), '.2f')} | {fmt(s.get('peak_mib'), '.0f')} | "
                    f"{fmt(s.get('tflops'), '.0f')} | "
                    f"{fmt(a.get('ms'), '.2f')} | {fmt(a.get('peak_mib'), '.0f')} | "
                    f"{fmt(v.get('ms'), '.2f')} | {fmt(v.get('peak_mib'), '.0f')} |"
                )
    (out / "triton_h200.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
