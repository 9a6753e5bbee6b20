"""CPU benchmark: the chunked torch backend against the naive materializing KL.

    python benchmarks/cpu.py            # N = 1024 .. 8192, H = 4, D = 64, float32, B = 1
    python benchmarks/cpu.py --quick    # tiny N, one repeat, prints the table (smoke run)

Naive: both full score matrices in float32, log_softmax of each, KL = sum p1 * (log p1 - log p2),
autograd for the backward. Modes: `forward` (no input needs a gradient), `backward_all` (gradients
for q1, k1, q2, k2) and `backward_student` (q2, k2 only: a detached teacher).

Times are medians over repeats after one warmup round, the two providers alternating inside one
process so that load from elsewhere on the machine hits both alike. Peak extra memory is the growth
of the process's peak RSS (`ru_maxrss`) over one forward (+ backward) run, each (provider, N, mode)
in a fresh worker process, with the peak reset just before the run (`/proc/self/clear_refs`).
Results go to benchmarks/results/cpu.json and cpu.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import platform
import resource
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without installing
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

import streamkl  # noqa: E402
from streamkl.backends.torch_chunked import TorchChunkedBackend  # noqa: E402

PROVIDERS = ("naive", "torch")
MODES = ("forward", "backward_all", "backward_student")
GRAD_INPUTS = {"forward": (), "backward_all": (0, 1, 2, 3), "backward_student": (2, 3)}
HEADS, HEAD_DIM, BATCH = 4, 64, 1
FULL_SIZES = (1024, 2048, 4096, 8192)
QUICK_SIZES = (100,)
TARGET_N, TARGET_TIME_RATIO, TARGET_MEMORY_RATIO = 4096, 1.5, 0.10
MIB = 2**20


# ---------------------------------------------------------------------- the two providers
def naive_kl(q1, k1, q2, k2):
    """Mean KL over rows and heads by materializing both (B, H, N, N) score matrices."""
    s1 = torch.einsum("bqhd,bkhd->bhqk", q1, k1) * q1.shape[-1] ** -0.5
    s2 = torch.einsum("bqhd,bkhd->bhqk", q2, k2) * q2.shape[-1] ** -0.5
    log_p1 = torch.log_softmax(s1, dim=-1)
    log_p2 = torch.log_softmax(s2, dim=-1)
    return (log_p1.exp() * (log_p1 - log_p2)).sum(-1).mean()


def streamkl_torch(q1, k1, q2, k2):
    return streamkl.kl(q1, k1, q2, k2, reduction="mean", backend="torch")


FUNCTIONS = {"naive": naive_kl, "torch": streamkl_torch}


def make_inputs(n: int, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    return [torch.randn(BATCH, n, HEADS, HEAD_DIM, generator=generator) for _ in range(4)]


def run_once(provider: str, inputs, mode: str):
    """One forward (+ backward): (forward seconds, backward seconds or None, KL value)."""
    leaves = [t.detach().requires_grad_(i in GRAD_INPUTS[mode]) for i, t in enumerate(inputs)]
    start = time.perf_counter()
    out = FUNCTIONS[provider](*leaves)
    middle = time.perf_counter()
    backward = None
    if GRAD_INPUTS[mode]:
        out.backward()
        backward = time.perf_counter() - middle
    return middle - start, backward, out.item()


# ---------------------------------------------------------------------- workers (fresh processes)
def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def _reset_peak_rss() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where unsupported."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def memory_worker(provider: str, n: int, mode: str) -> dict:
    inputs = make_inputs(n)
    run_once(provider, make_inputs(32, seed=1), mode)  # load lazily initialized code paths first
    reset = _reset_peak_rss()
    before = _peak_rss_bytes()
    run_once(provider, inputs, mode)
    return {"peak_extra_bytes": _peak_rss_bytes() - before, "peak_reset": reset}


def timing_worker(n: int, mode: str, repeats: int) -> dict:
    inputs = make_inputs(n)
    samples = {p: {"forward": [], "backward": [], "value": None} for p in PROVIDERS}
    for round_index in range(repeats + 1):  # round 0 is the warmup
        for provider in PROVIDERS:
            forward, backward, value = run_once(provider, inputs, mode)
            if round_index == 0:
                continue
            samples[provider]["forward"].append(forward)
            if backward is not None:
                samples[provider]["backward"].append(backward)
            samples[provider]["value"] = value
    # ratios paired by round: load from elsewhere that hits one round hits both providers
    result = {
        "forward_ratio": statistics.median(
            t / n for t, n in zip(samples["torch"]["forward"], samples["naive"]["forward"])
        ),
        "backward_ratio": statistics.median(
            t / n for t, n in zip(samples["torch"]["backward"], samples["naive"]["backward"])
        )
        if samples["naive"]["backward"]
        else None,
    }
    for provider, s in samples.items():
        result[provider] = {
            "forward_s": statistics.median(s["forward"]),
            "backward_s": statistics.median(s["backward"]) if s["backward"] else None,
            "forward_samples_s": s["forward"],
            "backward_samples_s": s["backward"],
            "value": s["value"],
        }
    return result


def _in_fresh_process(context, function, *args):
    with context.Pool(1) as pool:
        return pool.apply(function, args)


# ---------------------------------------------------------------------- environment and report
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def environment(argv) -> dict:
    backend = TorchChunkedBackend
    return {
        "command": "python benchmarks/cpu.py " + " ".join(argv),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "load_average_at_start": list(os.getloadavg()),  # other jobs on the machine skew the times
        "torch": torch.__version__,
        "python": platform.python_version(),
        "streamkl": streamkl.__version__,
        "torch_backend_tiles": {"q_tile": backend.q_tile, "k_chunk": backend.k_chunk},
        "shape": {"B": BATCH, "H": HEADS, "D": HEAD_DIM, "dtype": "float32"},
    }


def _fmt(value, spec=".3f"):
    return "-" if value is None else format(value, spec)


def _loads(values) -> str:
    return ", ".join(f"{v:.1f}" for v in values)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else a / b


def rows_with_ratios(results: list[dict]) -> list[dict]:
    for row in results:
        row["memory_ratio"] = _ratio(row["torch"]["peak_extra_bytes"], row["naive"]["peak_extra_bytes"])
    return results


def target_checks(results: list[dict]) -> list[str]:
    lines = []
    for row in results:
        if row["n"] != TARGET_N:
            continue
        checks = [("forward time", row["forward_ratio"], TARGET_TIME_RATIO)]
        if row["backward_ratio"] is not None:
            checks.append(("backward time", row["backward_ratio"], TARGET_TIME_RATIO))
        checks.append(("peak extra memory", row["memory_ratio"], TARGET_MEMORY_RATIO))
        for what, ratio, limit in checks:
            verdict = "met" if ratio is not None and ratio <= limit else "MISSED"
            lines.append(f"- {row['mode']}, {what}: torch / naive = {_fmt(ratio)} (target <= {limit}): {verdict}")
    return lines


def markdown(env: dict, results: list[dict]) -> str:
    out = [
        "# streamkl torch backend vs naive materializing KL, CPU",
        "",
        f"- command: `{env['command']}`",
        f"- date: {env['date']}",
        f"- CPU: {env['cpu_model']}, {env['cpu_count']} cores, torch threads {env['torch_threads']}",
        f"- load average (1, 5, 15 min) at start {_loads(env['load_average_at_start'])}, "
        f"at end {_loads(env['load_average_at_end'])}",
        f"- torch {env['torch']}, python {env['python']}, streamkl {env['streamkl']}",
        f"- torch backend tiles: q_tile {env['torch_backend_tiles']['q_tile']}, "
        f"k_chunk {env['torch_backend_tiles']['k_chunk']}",
        f"- shape: B={BATCH}, Nq=Nk=N, H={HEADS}, D={HEAD_DIM}, float32; reduction mean",
        "- times: median seconds over repeats after one warmup round, providers alternating in one process; "
        "ratios are torch / naive, the median of the per-round ratios; backward modes time the forward "
        "with autograd on",
        "- memory: growth of peak RSS over one forward (+ backward), fresh process per cell, MiB",
        "",
        "| N | mode | naive fwd s | torch fwd s | fwd ratio | naive bwd s | torch bwd s | bwd ratio "
        "| naive MiB | torch MiB | mem ratio |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in results:
        naive, ours = row["naive"], row["torch"]
        out.append(
            f"| {row['n']} | {row['mode']} | {_fmt(naive['forward_s'])} | {_fmt(ours['forward_s'])} "
            f"| {_fmt(row['forward_ratio'], '.2f')} | {_fmt(naive['backward_s'])} | {_fmt(ours['backward_s'])} "
            f"| {_fmt(row['backward_ratio'], '.2f')} | {naive['peak_extra_bytes'] / MIB:.1f} "
            f"| {ours['peak_extra_bytes'] / MIB:.1f} | {_fmt(row['memory_ratio'], '.3f')} |"
        )
    checks = target_checks(results)
    if checks:
        out += [
            "",
            f"Targets at N = {TARGET_N} (time ratio <= {TARGET_TIME_RATIO}, memory ratio <= {TARGET_MEMORY_RATIO}):",
            "",
        ] + checks
    return "\n".join(out) + "\n"


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny N, one repeat (smoke run)")
    parser.add_argument("--sizes", type=int, nargs="+", help="sequence lengths N (default 1024 2048 4096 8192)")
    parser.add_argument("--repeats", type=int, help="timed repeats after the warmup (default 3, quick 1)")
    parser.add_argument(
        "--out",
        type=Path,
        help="folder for cpu.json and cpu.md (default benchmarks/results; "
        "with --quick nothing is written unless given)",
    )
    args = parser.parse_args(argv)
    sizes = args.sizes or (QUICK_SIZES if args.quick else FULL_SIZES)
    repeats = args.repeats or (1 if args.quick else 3)
    out_dir = args.out if args.out or args.quick else ROOT / "benchmarks" / "results"

    # forkserver: each worker is a fresh process forked from a server that has only imported
    # torch (and torch._dynamo, which the first custom-op call imports lazily, for seconds)
    methods = multiprocessing.get_all_start_methods()
    context = multiprocessing.get_context("forkserver" if "forkserver" in methods else "spawn")
    if "forkserver" in methods:
        context.set_forkserver_preload(["torch", "torch._dynamo", "streamkl"])
    env = environment(argv)
    results = []
    for n in sizes:
        for mode in MODES:
            row = {"n": n, "mode": mode, **_in_fresh_process(context, timing_worker, n, mode, repeats)}
            for provider in PROVIDERS:
                row[provider].update(_in_fresh_process(context, memory_worker, provider, n, mode))
            results.append(row)
            naive, ours = row["naive"], row["torch"]
            print(
                f"N={n:5d} {mode:16s} fwd {naive['forward_s']:.3f} / {ours['forward_s']:.3f} s  "
                f"bwd {_fmt(naive['backward_s'])} / {_fmt(ours['backward_s'])} s  "
                f"mem {naive['peak_extra_bytes'] / MIB:.1f} / {ours['peak_extra_bytes'] / MIB:.1f} MiB  "
                f"(naive / torch)",
                flush=True,
            )
    results = rows_with_ratios(results)
    env["load_average_at_end"] = list(os.getloadavg())
    report = markdown(env, results)
    print()
    print(report)
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        (out_dir / "cpu.json").write_text(json.dumps({"environment": env, "results": results}, indent=2) + "\n")
        (out_dir / "cpu.md").write_text(report)
        print(f"wrote {out_dir / 'cpu.json'} and {out_dir / 'cpu.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
