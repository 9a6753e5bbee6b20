"""Benchmark of the DSA indexer loss (issue 31): streamkl.indexer_kl against the materializing PyTorch
implementation as Megatron-LM writes it, with the teacher's cuDNN SDPA forward as the yardstick.

    python benchmarks/indexer.py --out runs/bench_indexer                 # the H200 run (bf16)
    python benchmarks/indexer.py --smoke --device cpu --out /tmp/indexer  # tiny sizes, torch backend

Shapes (GPU defaults): B=1, N in {8K, 32K, 128K}, causal; teacher H=64 query and key heads, D=128 and
192; indexer 64 heads x 128; top-k 2048 (random causal positions, the same for every provider).
Providers (each guarded: an error or "OOM" is recorded in its cell, never aborts the run):
- `streamkl-<backend>-dense`, `streamkl-<backend>-topk`: streamkl.indexer_kl(..., backend=<backend>),
  reduction mean, the teacher's lse computed by the loss (not passed in). `-topklocal`: the top-k
  stage on each row's k most recent keys instead of random ones (the tiles' best case: the
  selected keys cluster; the random selection is the worst, it touches nearly every tile).
  `-denselse`: the dense stage with the teacher's per-head lse passed in, as a model whose
  attention forward returned it would (computed once beforehand by `streamkl.kl(..., return_lse=True)`,
  not timed).
- `megatron-eager-dense|topk`, `megatron-compile-dense|topk`: the per-head score matrices and the
  indexer's [b, sq, sk] scores materialized in float32, softmaxes, heads summed and L1-normalized,
  KL summed over keys and averaged over rows; autograd for the backward; compiled with
  torch.compile(dynamic=False), its first call (compilation) excluded from the timing.
- `sdpa-cudnn`: F.scaled_dot_product_attention forward of the teacher (q, k, a random v), causal,
  cuDNN backend forced (the default SDPA choice on CPU): forward only.
Modes: `forward` (with the indexer's inputs requiring grad, as in training) and `fwd+bwd`; the
backward is derived as median(fwd+bwd) - median(forward). A streamkl mean with grad forms its
gradients in the forward (docs/indexer.md), so its forward holds nearly all the work and its
backward is a scaling: fwd+bwd is the column to compare. Timing: CUDA events, L2 flushed before
each call, one warm-up call, then as many as fit in --rep-ms (at least 3), median. Memory: the
peak allocated during one fwd+bwd call minus what was allocated just before it (inputs excluded,
their gradients included). After an OOM a provider skips its larger N.
Writes indexer.json, indexer.md and indexer.png (time and memory vs N) to --out; with --append the
cells already there are kept (the same provider, N and D measured again replace theirs), so that
runs of different shapes make one report:

    python benchmarks/indexer.py --out DIR --sizes 8192,32768 --dims 128
    python benchmarks/indexer.py --out DIR --sizes 131072 --dims 128 --providers streamkl-triton-dense --append
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import streamkl  # noqa: E402
from benchmarks.suite_runner import Timer  # noqa: E402  (the suite's timer: L2 flush, events, peak memory)

MIB = 2**20
MODES = ("forward", "fwd+bwd")


# ----------------------------------------------------------------------------- the computations
def megatron_indexer_loss(q, k, qi, ki, w, scale: float, topk_indices):
    """The DSA indexer KL as Megatron-LM computes it, dense layout (B, N, ...), causal, Nq == Nk:
    float32 per-head scores and softmax, heads summed then L1-normalized, the indexer's [b, sq, sk]
    scores, KL summed over keys and averaged over rows. Materializes everything."""
    b, sq, heads, _ = q.shape
    sk = k.shape[1]
    attention = torch.matmul(q.transpose(1, 2).float(), k.transpose(1, 2).float().transpose(-1, -2)) * scale
    index_scores = torch.einsum("bshd,btd->bsht", qi.float(), ki.float()).relu()
    index_scores = (index_scores * w.float().unsqueeze(-1)).sum(dim=2)  # [b, sq, sk]
    mask = torch.triu(torch.full((sq, sk), float("-inf"), device=q.device), diagonal=1)
    if topk_indices is not None:
        chosen = torch.full((b, sq, sk + 1), float("-inf"), device=q.device)
        slots = topk_indices.long()
        chosen = chosen.scatter(-1, torch.where(slots < 0, sk, slots), 0.0)[..., :sk]
        mask = mask + chosen
    attention = torch.softmax(attention + (mask.unsqueeze(-3) if mask.dim() == 3 else mask), dim=-1)
    attention = attention.sum(dim=1)
    attention = attention / attention.sum(dim=-1, keepdim=True)
    index_probs = torch.softmax(index_scores + mask, dim=-1)
    kl = attention * (torch.log(attention + 1e-10) - torch.log(index_probs + 1e-10))
    return kl.sum(dim=-1).mean()


_COMPILED: dict = {}


def make_inputs(n: int, dim: int, args, device, dtype):
    """The same inputs for every provider at (N, D): their losses are comparable."""
    torch.manual_seed(1000 * n + dim)
    heads, index_heads, index_dim = args.heads, args.index_heads, args.index_dim
    q = torch.randn(1, n, heads, dim, device=device, dtype=dtype)
    k = torch.randn(1, n, heads, dim, device=device, dtype=dtype)
    qi = torch.randn(1, n, index_heads, index_dim, device=device, dtype=dtype).requires_grad_()
    ki = torch.randn(1, n, index_dim, device=device, dtype=dtype).requires_grad_()
    w = (torch.randn(1, n, index_heads, device=device) * index_heads**-0.5).to(dtype).requires_grad_()
    # each row: topk random causal positions (repeats allowed, as a real selection never has them but
    # every provider must treat them alike); rows with fewer visible keys pad with -1
    rows = torch.arange(n, device=device)[:, None]
    picks = (torch.rand(n, args.topk, device=device) * (rows + 1)).long()
    picks[:, 0] = rows[:, 0]  # every row keeps its own token: no row is empty
    slots = torch.arange(args.topk, device=device)[None, :]
    picks = torch.where(slots <= rows, picks, -1)
    # the best case for the tiles: each row's topk most recent keys (its own token first), the
    # selection of an indexer that learned a sliding window; a trained indexer's lies in between
    local = torch.where(slots <= rows, rows - slots, -1)
    return (q, k, qi, ki, w), {"topk": picks.int()[None], "topklocal": local.int()[None]}


def provider_fn(provider: str, inputs, selections, args):
    """A callable running one forward (returning the loss), or raises for an unusable provider."""
    q, k, qi, ki, w = inputs
    dim = q.shape[-1]
    if provider.startswith("streamkl-"):
        _, backend, stage = provider.split("-")
        if stage == "denselse":  # the teacher's lse as the model's attention forward gives it
            with torch.no_grad():
                _, lse, _ = streamkl.kl(q, k, q, k, causal=True, reduction="none", return_lse=True, backend=backend)
            return lambda: streamkl.indexer_kl(q, k, qi, ki, w, causal=True, lse=lse, backend=backend)
        chosen = None if stage == "dense" else selections[stage]
        return lambda: streamkl.indexer_kl(q, k, qi, ki, w, causal=True, topk_indices=chosen, backend=backend)
    if provider.startswith("megatron-"):
        _, how, stage = provider.split("-")
        chosen = None if stage == "dense" else selections[stage]
        fn = megatron_indexer_loss
        if how == "compile":
            fn = _COMPILED.setdefault("megatron", torch.compile(megatron_indexer_loss, dynamic=False))
        return lambda: fn(q, k, qi, ki, w, dim**-0.5, chosen)
    if provider == "sdpa-cudnn":
        value = torch.randn_like(q)
        qt, kt, vt = (t.transpose(1, 2) for t in (q, k, value))

        def run():
            if q.is_cuda:
                from torch.nn.attention import SDPBackend, sdpa_kernel

                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)
            return F.scaled_dot_product_attention(qt, kt, vt, is_causal=True)

        return run
    raise ValueError(f"unknown provider {provider!r}")


# ----------------------------------------------------------------------------- timing and memory
def measure(timer: Timer, fn, rep_ms: float) -> tuple[float, int | None]:
    """(median ms, peak extra bytes of the first timed call) of `fn`, after one warm-up call."""
    fn()  # warm-up: compilation, autotuning, caches
    ms, peak = timer.once(fn, memory=True)
    times = [ms] + [timer.once(fn)[0] for _ in range(max(2, min(int(rep_ms / max(ms, 1e-3)), 100)))]
    return statistics.median(times), peak


def _is_oom(error: BaseException) -> bool:
    return isinstance(error, torch.OutOfMemoryError) or "out of memory" in str(error).lower()


def _free():
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_case(provider: str, n: int, dim: int, args, timer: Timer, device, dtype) -> dict:
    row = {"provider": provider, "N": n, "D": dim}
    inputs, selections = make_inputs(n, dim, args, device, dtype)
    try:
        forward = provider_fn(provider, inputs, selections, args)
        grads = inputs[2:]

        def both():
            loss = forward()
            torch.autograd.backward(loss, inputs=list(grads))

        if provider != "sdpa-cudnn":
            row["loss"] = float(forward())
        for t in grads:
            t.grad = None
        row["forward_ms"], row["forward_peak_bytes"] = measure(timer, forward, args.rep_ms)
        if provider != "sdpa-cudnn":
            row["fwd+bwd_ms"], row["peak_bytes"] = measure(timer, both, args.rep_ms)
            row["backward_ms"] = row["fwd+bwd_ms"] - row["forward_ms"]
        else:
            row["peak_bytes"] = row["forward_peak_bytes"]
    except Exception as error:  # noqa: BLE001 - every failure is a cell of the table
        row["note"] = "OOM" if _is_oom(error) else f"error: {type(error).__name__}: {str(error)[:300]}"
    del inputs, selections
    _free()
    return row


# ----------------------------------------------------------------------------- reports
def environment(device) -> dict:
    env = {"date": datetime.date.today().isoformat(), "torch": torch.__version__, "python": platform.python_version(),
           "streamkl": streamkl.__version__, "device": str(device)}
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        env["cuda"] = torch.version.cuda
        env["cudnn"] = torch.backends.cudnn.version()
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    return env


def _cell(row, key, scale=1.0, spec=".2f"):
    if "note" in row:
        return row["note"] if key == "forward_ms" else ""
    value = row.get(key)
    return "" if value is None else format(value / scale, spec)


def markdown(rows, env, args, commands) -> str:
    lines = [
        "# DSA indexer loss: streamkl.indexer_kl against the materializing implementation",
        "",
        ", ".join(f"`{command}`" for command in commands) + f"; {env['date']}, "
        f"{env.get('gpu', env['device'])}, torch {env['torch']}, triton {env.get('triton', '-')}.",
        f"B=1, causal, teacher H={args.heads} (key heads too), indexer {args.index_heads} x {args.index_dim}, "
        f"top-k {args.topk}, {args.dtype}. Backward = fwd+bwd - forward; streamkl's forward (a mean, inputs "
        "requiring grad) forms the gradients too and its backward only scales them: compare fwd+bwd. "
        "Memory: peak extra MiB of one fwd+bwd (forward for sdpa).",
        "",
        "| provider | D | N | forward ms | backward ms | fwd+bwd ms | peak extra MiB | loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        times = " | ".join(_cell(r, key) for key in ("forward_ms", "backward_ms", "fwd+bwd_ms"))
        lines.append(f"| {r['provider']} | {r['D']} | {r['N']} | {times} | {_cell(r, 'peak_bytes', MIB, '.0f')} "
                     f"| {_cell(r, 'loss', 1, '.5f')} |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (ax_time, ax_memory) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True)
    series = sorted({(r["provider"], r["D"]) for r in rows})
    for provider, dim in series:
        done = sorted((r for r in rows if (r["provider"], r["D"]) == (provider, dim) and "note" not in r),
                      key=lambda r: r["N"])
        if not done:
            continue
        label = f"{provider} D{dim}"
        key = "forward_ms" if provider == "sdpa-cudnn" else "fwd+bwd_ms"
        ax_time.plot([r["N"] for r in done], [r[key] for r in done], "o-", label=label)
        with_memory = [r for r in done if r.get("peak_bytes") is not None]
        if with_memory:
            ax_memory.plot([r["N"] for r in with_memory], [max(r["peak_bytes"], 1) / MIB for r in with_memory], "o-",
                           label=label)
    for ax, ylabel in ((ax_time, "fwd+bwd ms (sdpa: forward)"), (ax_memory, "peak extra MiB")):
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("N (tokens)")
        ax.set_ylabel(ylabel)
        ax.grid(True, which="both", alpha=0.3)
    ax_time.legend(fontsize=7)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return True


# ----------------------------------------------------------------------------- main
def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--out", required=True, help="directory for indexer.json, indexer.md, indexer.png")
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--smoke", action="store_true",
                        help="tiny sizes on any device: N 128/256, H=4, D 32/48, indexer 4 x 16, top-k 32")
    parser.add_argument("--sizes", default="8192,32768,131072", help="comma-separated N")
    parser.add_argument("--dims", default="128,192", help="comma-separated teacher head dims")
    parser.add_argument("--heads", type=int, default=64, help="teacher query heads (= key heads)")
    parser.add_argument("--index-heads", type=int, default=64)
    parser.add_argument("--index-dim", type=int, default=128)
    parser.add_argument("--topk", type=int, default=2048)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--backend", default="triton", help="streamkl backend of the streamkl providers")
    parser.add_argument("--providers", default=None, help="comma-separated subset (default: all)")
    parser.add_argument("--rep-ms", type=float, default=500.0, help="time budget per measurement")
    parser.add_argument("--append", action="store_true",
                        help="keep the results already in --out (cells measured again are replaced)")
    args = parser.parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    if args.smoke:  # tiny values for the size options left at their GPU defaults
        tiny = dict(sizes="128,256", dims="32,48", heads=4, index_heads=4, index_dim=16, topk=32, rep_ms=20.0)
        for name, value in tiny.items():
            if getattr(args, name) == parser.get_default(name):
                setattr(args, name, value)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.smoke and device.type == "cpu":
        args.dtype = "float32"
        if args.backend == "triton":
            args.backend = "torch"
    dtype = getattr(torch, args.dtype)
    providers = [f"streamkl-{args.backend}-dense", f"streamkl-{args.backend}-denselse", f"streamkl-{args.backend}-topk",
                 f"streamkl-{args.backend}-topklocal", "megatron-eager-dense",
                 "megatron-eager-topk", "megatron-compile-dense", "megatron-compile-topk", "sdpa-cudnn"]
    if args.providers:
        providers = [p for p in args.providers.split(",") if p]
    if device.type == "cpu":  # inductor on the CPU needs a C++ toolchain: not a yardstick of this benchmark
        providers = [p for p in providers if not p.startswith("megatron-compile")]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    timer = Timer(str(device))
    env = environment(device)
    commands, kept = [" ".join(["python", "benchmarks/indexer.py", *args.argv])], []
    if args.append and (out / "indexer.json").exists():
        earlier = json.loads((out / "indexer.json").read_text())
        commands, kept = earlier.get("commands", []) + commands, earlier["results"]
    rows = []

    def save():  # after every cell: a run cut short by a time limit still leaves its results
        measured = {(r["provider"], r["N"], r["D"]) for r in rows}
        table = [r for r in kept if (r["provider"], r["N"], r["D"]) not in measured] + rows
        (out / "indexer.json").write_text(json.dumps({"environment": env, "commands": commands,
                                                     "settings": vars(args), "results": table}, indent=2) + "\n")
        (out / "indexer.md").write_text(markdown(table, env, args, commands))
        return table

    for dim in (int(d) for d in args.dims.split(",")):
        for provider in providers:
            failed_at = None
            for n in sorted(int(s) for s in args.sizes.split(",")):
                if failed_at is not None:
                    rows.append({"provider": provider, "N": n, "D": dim, "note": f"skipped (OOM at N={failed_at})"})
                    continue
                row = run_case(provider, n, dim, args, timer, device, dtype)
                rows.append(row)
                print(json.dumps(row), flush=True)
                save()
                if row.get("note") == "OOM":
                    failed_at = n
    rows = save()
    plotted = plot(rows, out / "indexer.png")
    print(f"wrote {out / 'indexer.json'}, {out / 'indexer.md'}" + (f", {out / 'indexer.png'}" if plotted else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
