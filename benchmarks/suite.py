"""The benchmark suite: every provider in one process; kernel time, host time and memory; JSON, markdown, plots.

    python benchmarks/suite.py                          # the GPU run (about 6 minutes, --max-seconds 330)
    python benchmarks/suite.py --host-only              # host time per call only (under a minute)
    python benchmarks/suite.py --quick --device cpu     # smoke run: tiny N, torch backend + naive
    python benchmarks/suite.py --sections nsweep,sparsity --providers streamkl-triton,sdpa,sdpa-flash

Providers (each guarded: an error is recorded as a string in its cell, never aborts the run):
- `streamkl-triton`, `streamkl-cupy`, `streamkl-torch`: streamkl.kl(..., backend=...), reduction mean.
  The chunked torch backend runs only up to `--torch-max-n` tokens ("skipped (slow)" beyond).
- `naive`: eager; both (B, H, N, N) score matrices (input-dtype matmul, float32 softmax math),
  log_softmax of each, KL = sum p1 (log p1 - log p2), mean; autograd for the backward. "OOM" when
  it does not fit; larger N of the same (provider, mode, D) are then skipped.
- `naive-compile`: the same function under torch.compile(dynamic=False): compiled once per shape
  by the warm-up call (its time is reported as `first_call_s`), then timed. Only at `--compile-sizes`.
- `sdpa`: one F.scaled_dot_product_attention of the teacher's shape (q1, k1, a random v), no backend
  forced (PyTorch's default dispatch: cuDNN on an H200; on the CPU whatever torch picks): the speed
  peer. The backend it dispatched to is recorded per case (`sdpa_backend`, the dispatcher's own
  choice, torch._fused_sdp_choice) and, on CUDA, the kernel names of its first call per mode
  (torch.profiler, `sdpa_kernels`). Its fwd+bwd computes dq, dk, dv (no student-only mode).
- `sdpa-flash`: the same call with the flash backend forced (FlashAttention-2), the second peer.
Modes: `forward` (no input needs a gradient), `fwd+bwd student` (q2, k2 need gradients: a detached
teacher), `fwd+bwd all` (q1, k1, q2, k2). Backward times are DERIVED: median(fwd+bwd) - median(fwd),
each measured separately.
Timing: CUDA events around each call, L2 flushed before each (as triton.testing.do_bench), one
warm-up call (compilation) then as many calls as fit in `--rep-ms` (at least 1), median, two ways:
`b2b_ms`, the calls enqueued back to back with one synchronization at the end, as do_bench and a
training loop do, so the events bracket the kernels' time only (the headline figure); and `ms`,
the device synchronized before each call, so the call's host time before its first launch
(Python, launches) counts too. Host time per call (section `host`, `--host-only` alone): the wall
time of the Python call, median over many calls, each started on an idle GPU (synchronized before
the timer starts, never inside it), for the no-grad forward, the training forward (the student's
inputs require grad) and the backward (`loss.backward()`), at N = 1K and 4K. Memory: the
peak allocated during the first timed call minus what was allocated just before it (inputs excluded,
gradients of the inputs included); also per (query row, head). A call predicted (quadratic in N from
the provider's last size) to take more than `--single-call-ms` is timed once without warm-up (its
kernels were compiled at the smaller N; never for naive-compile); past `--max-call-ms` it is
"skipped (slow)"; a case that would overrun `--max-seconds` is "skipped (time budget)". Sections run
by priority: host time, headline (N=16K), D sweep, sparsity, varlen, long context (single call
each), naive-compile, the rest of the N sweep.

Sweeps (GPU defaults, bf16, B=1, H=16, D=128): N = 1K..128K causal and not; D = 64 at N=16K;
block sparsity 0/50/75/90/95 % (blocks 128, the same random mask on both sides, non-causal) at 16K;
varlen 16 x 4096 packed vs B=16 N=4096 batched (causal); longest context N = 256K/512K/1M, H=8,
causal, fwd+bwd student, streamkl-triton only. The targets (against naive, dense, and the attention
ratios against both peers, sdpa-flash and sdpa) are computed from the back-to-back times and marked
met / NOT met in the markdown and on stdout; the goals were set against sdpa-flash.

This file is the command line; the providers and their inputs are in `suite_providers.py`, the timer,
the cases and the loops that run them in `suite_runner.py`, the targets, tables and plots in
`suite_report.py`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from benchmarks.suite_providers import PROVIDERS, SECTIONS  # noqa: E402
from benchmarks.suite_report import environment, fmt, markdown, plots, targets  # noqa: E402
from benchmarks.suite_runner import START, build_cases, run_cases, run_host  # noqa: E402


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes, a smoke run (cpu: torch backend + naive)")
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    parser.add_argument("--name", default=None, help="output file stem (default suite, suite_quick with --quick)")
    parser.add_argument("--providers", default=None, help=f"comma-separated subset of {','.join(PROVIDERS)}")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--dtype", default=None, choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--rep-ms", type=float, default=None, help="timed calls fill this many ms (50; 5 quick)")
    parser.add_argument("--warmup-ms", type=float, default=None, help="untimed calls after the first (10; 0 quick)")
    parser.add_argument("--max-seconds", type=float, default=330.0, help="skip cases that would run past this")
    parser.add_argument("--max-call-ms", type=float, default=3000.0, help="skip a provider's larger N past this")
    parser.add_argument("--single-call-ms", type=float, default=200.0,
                        help="a call predicted slower than this (already compiled at a smaller N) is timed once")
    parser.add_argument("--torch-max-n", type=int, default=4096, help="tokens up to which streamkl-torch runs")
    parser.add_argument("--compile-sizes", default="4096", help="N at which naive-compile runs")
    parser.add_argument("--compile-estimate-s", type=float, default=15.0,
                        help="time one naive-compile compilation is budgeted (skipped when it would not fit)")
    parser.add_argument("--compile-backend", default="inductor", help="torch.compile backend for naive-compile")
    parser.add_argument("--block", type=int, default=128, help="block size of the sparsity sweep")
    parser.add_argument("--host-only", action="store_true", help="only the host time per call (writes suite_host.*)")
    parser.add_argument("--no-host", action="store_true", help="skip the host time per call")
    parser.add_argument("--host-repeats", type=int, default=None, help="timed calls per host-time cell (200; 3 quick)")
    parser.add_argument("--host-heads", type=int, default=None, help="heads of the host-time calls (16; 2 quick)")
    parser.add_argument("--sdpa-any", action="store_true", help="let sdpa-flash pick any backend (as sdpa does)")
    args = parser.parse_args(argv)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.device is None:
        if not torch.cuda.is_available():
            print("suite.py: no CUDA device here; for a smoke run use `--quick --device cpu`.")
            return 0
        args.device = "cuda"
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print("suite.py: CUDA requested but not available; for a smoke run use `--quick --device cpu`.")
        return 0
    cpu = not args.device.startswith("cuda")
    if args.providers is None:
        args.providers = "streamkl-torch,naive,naive-compile,sdpa" if cpu else ",".join(PROVIDERS)
    args.providers = [p for p in args.providers.split(",") if p]
    unknown = [p for p in args.providers if p not in PROVIDERS]
    if unknown:
        print(f"suite.py: unknown providers {unknown}; valid: {PROVIDERS}")
        return 2
    args.sections = [s for s in args.sections.split(",") if s]
    args.compile_sizes = [int(s) for s in args.compile_sizes.split(",") if s]
    args.dtype = args.dtype or ("float32" if cpu else "bfloat16")
    args.torch_dtype = getattr(torch, args.dtype)
    args.rep_ms = args.rep_ms if args.rep_ms is not None else (5.0 if args.quick else 50.0)
    args.warmup_ms = args.warmup_ms if args.warmup_ms is not None else (0.0 if args.quick else 10.0)
    if cpu and not args.quick:
        print("suite.py: a full run on the CPU takes very long; consider --quick.")
    args.host_repeats = args.host_repeats or (3 if args.quick else 200)
    args.host_heads = args.host_heads or (2 if args.quick else 16)
    name = args.name or ("suite_quick" if args.quick else "suite") + ("_host" if args.host_only else "")
    torch.manual_seed(0)
    env = environment(args)
    print(json.dumps(env), flush=True)

    host_rows = [] if args.no_host else run_host(args)
    rows = [] if args.host_only else run_cases(build_cases(args), args)
    goals = targets(rows, args) if rows else []
    total_s = time.perf_counter() - START
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    md = markdown(rows, host_rows, env, goals, args, total_s)
    (out / f"{name}.md").write_text(md)
    report = dict(environment=env, settings={k: v for k, v in vars(args).items() if k != "torch_dtype"},
                  total_seconds=total_s, targets=goals, host=host_rows, results=rows, plots=[])
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))  # before plots can fail
    try:
        written = plots(rows, out, name) if rows else []
    except Exception as exc:  # noqa: BLE001 -- the numbers are already written
        print(f"plots failed: {type(exc).__name__}: {exc}")
        written = []
    report["plots"] = written
    (out / f"{name}.json").write_text(json.dumps(report, indent=1, default=str))
    print(md)
    print("targets:")
    for g in goals:
        met = "n/a" if g["met"] is None else ("met" if g["met"] else "NOT met")
        vs_sdpa = f"; vs default SDPA {fmt(g['value_sdpa'])}" if g.get("value_sdpa") is not None else ""
        print(f"  [{met:>7}] {g['provider']}: {g['target']} = {fmt(g['value'])} (goal {g['goal']}){vs_sdpa}")
    print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}, {', '.join(written)}; {total_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
