"""The suite's reports: the targets, the markdown tables, the plots and the run's environment."""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

import torch

import streamkl
from benchmarks.suite_providers import HOST_MODES, LABELS, MIB, MODES, PROVIDERS, SDPA, SECTIONS


def kernel_ms(r: dict) -> float | None:
    """The back-to-back time where it was measured (GPU, warm), else the synchronized one."""
    return r["b2b_ms"] if r.get("b2b_ms") is not None else r.get("ms")


def _find(rows, **want):
    for r in rows:
        if all(r.get(k) == v for k, v in want.items()) and kernel_ms(r) is not None:
            return kernel_ms(r)
    return None


def _bwd(rows, mode, **want):
    fb, f = _find(rows, mode=mode, **want), _find(rows, mode="forward", **want)
    return None if fb is None or f is None else fb - f


def targets(rows, args) -> list[dict]:
    """The performance targets, for each streamkl GPU provider that ran (cpu: the torch backend)."""
    head_n = 512 if args.quick else 16384
    out = []
    ours = [p for p in ("streamkl-triton", "streamkl-cupy", "streamkl-torch") if any(r["provider"] == p for r in rows)]
    if args.device.startswith("cuda"):
        ours = [p for p in ours if p != "streamkl-torch"] or ours

    def add(provider, name, value, limit, kind, value_sdpa=None):
        """`value` against sdpa-flash (FlashAttention-2) where a peer is involved; `value_sdpa` against sdpa."""
        def met(v):
            return None if v is None else (v <= limit if kind == "<=" else v >= limit)

        out.append(dict(provider=provider, target=name, value=value, goal=f"{kind} {limit}", met=met(value),
                        value_sdpa=value_sdpa, met_sdpa=met(value_sdpa)))

    for p in ours:
        for causal in (False, True):
            c = "causal" if causal else "non-causal"
            for section, d, fwd_limit, bwd_limit in (("nsweep", 128, 0.8, 0.6), ("dsweep", 64, 1.0, 0.5)):
                d = d if not args.quick else (32 if section == "nsweep" else 16)
                shape = dict(section=section, N=head_n, D=d, causal=causal, layout="dense")
                fwd = _find(rows, provider=p, mode="forward", **shape)
                peer_fwd = [_find(rows, provider=s, mode="forward", **shape) for s in ("sdpa-flash", "sdpa")]
                add(p, f"forward / attention forward, D={d} N={head_n} {c}",
                    _ratio(fwd, peer_fwd[0]), fwd_limit, "<=", _ratio(fwd, peer_fwd[1]))
                peer_bwd = [_bwd(rows, "fwd+bwd all", provider=s, **shape) for s in ("sdpa-flash", "sdpa")]
                for grads, limit in (("student", bwd_limit), ("all", 1.0))[:2 if section == "nsweep" else 1]:
                    bwd = _bwd(rows, f"fwd+bwd {grads}", provider=p, **shape)
                    add(p, f"backward {grads} / attention backward, D={d} N={head_n} {c}",
                        _ratio(bwd, peer_bwd[0]), limit, "<=", _ratio(bwd, peer_bwd[1]))
        shape = dict(section="nsweep", N=head_n, D=32 if args.quick else 128, causal=True, layout="dense")
        naive_fwd = _find(rows, provider="naive", mode="forward", **shape)
        add(p, f"naive / streamkl forward speedup, N={head_n} causal",
            _ratio(naive_fwd, _find(rows, provider=p, mode="forward", **shape)), 55, ">=")
        for mode in ("fwd+bwd student", "fwd+bwd all"):
            add(p, f"naive / streamkl backward speedup ({mode.split()[-1]}), N={head_n} causal",
                _ratio(_bwd(rows, mode, provider="naive", **shape), _bwd(rows, mode, provider=p, **shape)), 14, ">=")
        sparse_n = 512 if args.quick else 16384
        for mode in MODES:
            dense = _find(rows, provider=p, mode=mode, section="nsweep", N=sparse_n, causal=False, layout="dense")
            add(p, f"90 % block sparsity / dense (no mask), {mode}",
                _ratio(_find(rows, provider=p, mode=mode, section="sparsity", sparsity=0.9), dense), 0.15, "<=")
        for mode in MODES:
            add(p, f"varlen / batched dense, {mode}",
                _ratio(_find(rows, provider=p, mode=mode, section="varlen", layout="varlen"),
                       _find(rows, provider=p, mode=mode, section="varlen", layout="batched")), 1.1, "<=")
    return out


def _ratio(a, b):
    return None if a is None or b is None or b <= 0 else a / b


def environment(args) -> dict:
    env = dict(
        command="python benchmarks/suite.py " + " ".join(sys.argv[1:]),
        date=datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        device=torch.cuda.get_device_name() if args.device.startswith("cuda") else platform.processor() or "cpu",
        python=platform.python_version(),
        torch=torch.__version__,
        streamkl=getattr(streamkl, "__version__", None),
    )
    try:
        env["available_backends"] = list(streamkl.available_backends())
    except Exception as exc:  # noqa: BLE001
        env["available_backends"] = f"{type(exc).__name__}: {exc}"
    for name in ("triton", "cupy"):
        try:
            env[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001
            env[name] = None
    return env


def _cell_ms(r, key="ms"):
    if r is None:
        return "-"
    if r.get(key) is not None:
        return f"{r[key]:.3f}"
    if r.get("ms") is not None:  # measured, but not this way (a single call: no back-to-back time)
        return "-"
    return r.get("note") or (f"error: {r['error'][:80]}" if r.get("error") else "-")


def _cell_kernel_ms(r):
    return _cell_ms(r, "b2b_ms")


def host_markdown(host_rows, args) -> list[str]:
    """The host-time table: us per call, median (10th percentile)."""
    if not host_rows:
        return []
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in host_rows)]
    where = ", each on an idle GPU" if args.device.startswith("cuda") else " (CPU: the whole computation)"
    lines = ["", f"## Host time per call, us (H={args.host_heads}, causal, {args.dtype}; median (10th percentile) "
             f"of {args.host_repeats} calls{where})", "",
             "| N | D | call | " + " | ".join(LABELS.get(p, p) for p in providers) + " |",
             "|" + "---|" * (3 + len(providers))]
    keys = sorted({(r["N"], r["D"]) for r in host_rows}, key=lambda k: (-k[1], k[0]))
    for n, d in keys:
        for mode in HOST_MODES:
            cells = []
            for p in providers:
                match = [r for r in host_rows if (r["provider"], r["N"], r["D"], r["mode"]) == (p, n, d, mode)]
                r = match[0] if match else None
                if r is None:
                    cells.append("-")
                elif r["host_us"] is None:
                    cells.append(f"error: {(r['error'] or '')[:80]}")
                else:
                    cells.append(f"{r['host_us']:.0f} ({r['host_us_p10']:.0f})")
            label = {"forward": "forward, no grad", "training forward": "forward, student requires grad",
                     "backward": "backward"}[mode]
            lines.append(f"| {n} | {d} | {label} | " + " | ".join(cells) + " |")
    return lines


def _cell_mib(r):
    if r is None:
        return "-"
    if r.get("peak_bytes") is not None:
        mib = r["peak_bytes"] / MIB
        return f"{mib:.{0 if mib >= 100 else 1}f} ({r['extra_bytes_per_row_head']:.0f} B)"
    return "n/a" if r.get("ms") is not None else _cell_ms(r)


def fmt(v, spec=".3f"):
    return "-" if v is None else format(v, spec)


def sdpa_summary(rows) -> str:
    """Which backend the default SDPA used: the dispatcher's choices over its cases, and the profiled kernels."""
    mine = [r for r in rows if r["provider"] == "sdpa" and r.get("ms") is not None]
    if not mine:
        return "sdpa not run"
    choices = {}
    for r in mine:
        choices[r.get("sdpa_backend") or "unknown"] = choices.get(r.get("sdpa_backend") or "unknown", 0) + 1
    text = "dispatcher's choice (torch._fused_sdp_choice) " + ", ".join(f"{k} in {v} cases" for k, v in choices.items())
    seen = [f"{r['mode']} N={r['N']}: {r['sdpa_kernels']['family']} ({'; '.join(r['sdpa_kernels']['kernels'][:3])})"
            for r in mine if r.get("sdpa_kernels")]
    return text + ("; kernels of its first call (torch.profiler): " + " | ".join(seen) if seen else
                   "; kernel names not profiled (CUDA only)")


def markdown(rows, host_rows, env, goals, args, total_s) -> str:
    cuda = args.device.startswith("cuda")
    clock = ("CUDA events, L2 flushed before each call; back to back: the calls enqueued with one sync at the "
             "end (the kernels' time, as in a training loop); synchronized: the device synchronized before each "
             "call (the host's time before the first launch included)") if cuda else "wall clock"
    lines = [
        "# streamkl benchmark suite" + (" (host time only)" if args.host_only else ""),
        "",
        f"- command: `{env['command']}`",
        f"- device: {env['device']}; torch {env['torch']}; triton {env['triton']}; cupy {env['cupy']}; "
        f"python {env['python']}; {env['date']}; total {total_s:.0f} s",
        f"- dtype {args.dtype}; times: median ms ({clock}, warm-up call first; rep {args.rep_ms:g} ms); memory: "
        "peak allocated during one call beyond what was allocated before it (inputs excluded, input gradients "
        "included), MiB (bytes per query row and head)",
        "- skipped (slow): streamkl-torch beyond its token cap, or a call predicted (quadratic in N) past "
        f"{args.max_call_ms:g} ms; skipped (time budget): past --max-seconds {args.max_seconds:g}; OOM: "
        "torch.OutOfMemoryError, larger N of that provider and mode skipped",
        "- backward = median(fwd+bwd) - median(forward), back to back where measured; sdpa, sdpa-flash = one "
        "attention of the teacher's shape (fwd+bwd: dq, dk, dv), sdpa with PyTorch's default dispatch, "
        "sdpa-flash with the FlashAttention-2 backend forced",
        f"- default SDPA backend: {sdpa_summary(rows)}",
        *host_markdown(host_rows, args),
    ]
    if goals:
        lines += ["", "## Targets (back to back)" if cuda else "## Targets", "",
                  "Ratios to an attention are given against both peers: FlashAttention-2 (sdpa-flash) and "
                  "PyTorch's default SDPA (sdpa); the goals were set against FlashAttention-2.", "",
                  "| provider | target | value (vs FlashAttention-2) | value vs default SDPA | goal | met "
                  "(vs FlashAttention-2) | met vs default SDPA |", "|---|---|---|---|---|---|---|"]
    for g in goals:
        met = ["n/a" if m is None else ("met" if m else "NOT met") for m in (g["met"], g.get("met_sdpa"))]
        peer = "attention" in g["target"]
        lines.append(f"| {g['provider']} | {g['target']} | {fmt(g['value'], '.3f')} | "
                     f"{fmt(g.get('value_sdpa'), '.3f') if peer else '-'} | {g['goal']} | {met[0]} | "
                     f"{met[1] if peer else '-'} |")
    providers = [p for p in PROVIDERS if any(r["provider"] == p for r in rows)]
    titles = dict(nsweep="N sweep", dsweep="D sweep", sparsity="Block sparsity (blocks "
                  f"{args.block}, same mask both sides, non-causal)", varlen="Varlen (causal): packed sequences "
                  "(layout varlen, N per sequence) vs the batched dense call",
                  long="Longest context (streamkl-triton, single call, no warm-up)")
    for section in SECTIONS:
        sec = [r for r in rows if r["section"] == section]
        if not sec:
            continue
        shapes = []
        for r in sec:
            shape = (r["B"], r["N"], r["H"], r["D"], r["causal"], r["layout"], r.get("sparsity"), r["mode"])
            if shape not in shapes:
                shapes.append(shape)
        shapes.sort(key=lambda s: (s[4], s[3], MODES.index(s[7]), -1 if s[6] is None else s[6], s[5], s[1]))
        cols = [p for p in providers if any(r["provider"] == p for r in sec)]
        tables = [("time, ms, back to back", _cell_kernel_ms), ("time, ms, synchronized", _cell_ms)] if cuda else [
            ("time, ms", _cell_ms)]
        for label, cell in (*tables, ("memory, MiB (bytes per row, head)", _cell_mib)):
            lines += ["", f"## {titles[section]}: {label}", "",
                      "| B | N | H | D | causal | layout | sparsity | mode | "
                      + " | ".join(LABELS.get(p, p) for p in cols) + " |",
                      "|" + "---|" * (8 + len(cols))]
            for b, n, h, d, causal, layout, sparsity, mode in shapes:
                cells = []
                for p in cols:
                    match = [r for r in sec if r["provider"] == p and (r["B"], r["N"], r["H"], r["D"], r["causal"],
                             r["layout"], r.get("sparsity"), r["mode"]) == (b, n, h, d, causal, layout, sparsity, mode)]
                    cells.append(cell(match[0] if match else None))
                sp = "-" if sparsity is None else f"{sparsity:.0%}"
                head = f"| {b} | {n} | {h} | {d} | {causal} | {layout} | {sp} | {mode} | "
                lines.append(head + " | ".join(cells) + " |")
        if section in ("nsweep", "dsweep"):
            lines += ["", f"## {titles[section]}: backward (derived), ms", "",
                      "| N | D | causal | grads | " + " | ".join(LABELS.get(p, p) for p in cols) + " |",
                      "|" + "---|" * (4 + len(cols))]
            for n, d, causal in sorted({(r["N"], r["D"], r["causal"]) for r in sec}, key=lambda s: (s[2], s[1], s[0])):
                for mode in MODES[1:]:
                    cells = []
                    for p in cols:
                        want = dict(section=section, provider=p, N=n, D=d, causal=causal)
                        mode_p = "fwd+bwd all" if p in SDPA else mode
                        cells.append(fmt(_bwd(rows, mode_p, **want)))
                    lines.append(f"| {n} | {d} | {causal} | {mode.split()[-1]} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def plots(rows, out: Path, name: str) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:  # noqa: BLE001
        print(f"no plots: {exc}")
        return []
    sweep = [r for r in rows if r["section"] == "nsweep"]
    providers = [p for p in PROVIDERS if any(r["provider"] == p and kernel_ms(r) is not None for r in sweep)]
    written = []

    def series(provider, mode, causal, value):
        pts = sorted((r["N"], value(r)) for r in sweep if r["provider"] == provider and r["mode"] == mode
                     and r["causal"] == causal and value(r) is not None)
        return [p[0] for p in pts], [p[1] for p in pts]

    def grid(filename, ylabel, value, modes=MODES):
        fig, axes = plt.subplots(2, len(modes), figsize=(5 * len(modes), 8), squeeze=False)
        drawn = False
        for row_i, causal in enumerate((False, True)):
            for col, mode in enumerate(modes):
                ax = axes[row_i][col]
                for p in providers:
                    xs, ys = series(p, mode, causal, lambda r, p=p, mode=mode: value(r, p, mode))
                    if xs:
                        ax.plot(xs, ys, marker="o", label=p)
                        drawn = True
                ax.set_xscale("log", base=2)
                ax.set_yscale("log")
                ax.set_title(f"{mode}, {'causal' if causal else 'non-causal'}")
                ax.set_xlabel("N")
                ax.set_ylabel(ylabel)
                ax.grid(True, which="both", alpha=0.3)
        if drawn:
            axes[0][0].legend(fontsize=8)
            fig.tight_layout()
            path = out / filename
            fig.savefig(path, dpi=110)
            written.append(str(path))
        plt.close(fig)

    grid(f"{name}_time.png", "median ms (back to back on the GPU)", lambda r, p, m: kernel_ms(r))
    grid(f"{name}_memory.png", "peak extra MiB",
         lambda r, p, m: None if r["peak_bytes"] is None else max(r["peak_bytes"], 1) / MIB)

    def speedup(r, p, mode):  # naive ms / provider ms at the same shape
        naive = _find(sweep, provider="naive", mode=mode, N=r["N"], causal=r["causal"], D=r["D"])
        return None if naive is None or kernel_ms(r) is None or p == "naive" else naive / kernel_ms(r)

    grid(f"{name}_speedup.png", "speedup over naive (x)", speedup)
    return written

