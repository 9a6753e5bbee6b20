"""The suite's measurements: the timer (kernel, synchronized and host time, memory), the cases and their
priorities, and the loops that run them within the time budget."""

from __future__ import annotations

import gc
import json
import statistics
import time

import torch

from benchmarks.suite_providers import HOST_MODES, MIB, MODES, SDPA, STREAMKL, make_case_fn, make_host_fns, sdpa_kernels

START = time.perf_counter()  # the run's start: the time budget (--max-seconds) counts from here


class Timer:
    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.flush = torch.empty(256 * MIB, dtype=torch.int8, device=device) if self.cuda else None

    def back_to_back(self, fn, repeats: int) -> list[float]:
        """ms of `repeats` calls enqueued back to back (L2 flushed before each, as
        triton.testing.do_bench), one synchronization at the end: the host's per-call time hides
        behind the GPU's work as in a training loop, and the events bracket only device time."""
        events = []
        for _ in range(repeats):
            self.flush.zero_()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            events.append((start, end))
        self.sync()
        return [start.elapsed_time(end) for start, end in events]

    def sync(self):
        if self.cuda:
            torch.cuda.synchronize()

    def once(self, fn, memory: bool = False):
        """(ms, peak extra bytes or None) of one call."""
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return (time.perf_counter() - start) * 1e3, None
        self.flush.zero_()  # cold L2, as do_bench
        self.sync()
        if memory:
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        peak = torch.cuda.max_memory_allocated() - base if memory else None
        return start.elapsed_time(end), peak

    def host_us(self, fn, repeats: int, before=None) -> list[float]:
        """The wall time of `repeats` Python calls of `fn`, us, each started on an idle GPU: `before()`
        (untimed) then a synchronization, then the timer around `fn()` alone, which never waits for the
        device (its kernels are only enqueued)."""
        spans = []
        for _ in range(repeats):
            if before is not None:
                before()
            self.sync()
            start = time.perf_counter()
            fn()
            spans.append((time.perf_counter() - start) * 1e6)
        self.sync()
        return spans

    def measure(self, fn, rep_ms: float, warmup_ms: float, warm: bool = True) -> dict:
        first_s = None
        if warm:
            begin = time.perf_counter()
            fn()  # compile, autotune, caches
            self.sync()
            first_s = time.perf_counter() - begin
        ms, peak = self.once(fn, memory=True)
        times, b2b = [ms], None
        if warm:
            for _ in range(min(int(warmup_ms / max(ms, 1e-3)), 50)):
                fn()
            repeats = min(int(rep_ms / max(ms, 1e-3)), 200)
            times += [self.once(fn)[0] for _ in range(repeats)]
            if self.cuda:
                b2b = statistics.median(self.back_to_back(fn, max(repeats, 1)))
        return dict(ms=statistics.median(times), b2b_ms=b2b, peak_bytes=peak, repeats=len(times),
                    first_call_s=first_s)


def _free(collect: bool):
    if collect:  # after an exception: its traceback held the frames' tensors (gc is ~0.1 s, so not always)
        gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _is_oom(exc: BaseException) -> bool:
    return isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower()


def run_host(args) -> list[dict]:
    """Host time per call (us): each provider, head dim, N and mode of `HOST_MODES`."""
    timer = Timer(args.device)
    sizes = (128,) if args.quick else (1024, 4096)
    dims = (32,) if args.quick else (128, 64)
    cuda = args.device.startswith("cuda")
    providers = [p for p in args.providers if p in (*STREAMKL, "sdpa") or (p == "sdpa-flash" and cuda)]
    rows = []
    for provider in providers:
        for d in dims:
            for n in sizes:
                for mode in HOST_MODES:
                    row = dict(provider=provider, N=n, H=args.host_heads, D=d, mode=mode, causal=True,
                               host_us=None, host_us_p10=None, repeats=0, error=None)
                    try:
                        before, call = make_host_fns(provider, mode, n, d, args)
                        timer.host_us(call, 1 if args.quick else 3, before)  # compile, caches
                        spans = sorted(timer.host_us(call, args.host_repeats, before))
                        row.update(host_us=statistics.median(spans), host_us_p10=spans[len(spans) // 10],
                                   repeats=len(spans))
                    except Exception as exc:  # noqa: BLE001 -- recorded, never aborts the run
                        row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
                    rows.append(row)
                    print(json.dumps({k: v for k, v in row.items() if v is not None}), flush=True)
    return rows


def build_cases(args) -> list[dict]:
    """Every case with a priority; run in priority order (stable), so a cut budget drops the least useful."""
    q = args.quick
    h, d = (2, 32) if q else (16, 128)
    sizes = [256, 512] if q else [1024 * 2**i for i in range(8)]  # 1K .. 128K
    head_n = sizes[-1] if q else 16384
    providers = [p for p in args.providers if p != "naive-compile"]
    cases = []

    def add(priority, section, provider, mode, **shape):
        row = dict(section=section, provider=provider, mode=mode, B=1, H=h, D=d, causal=False, layout="dense")
        row.update(shape)
        if provider in SDPA and (mode == "fwd+bwd student" or row.get("sparsity") is not None
                                         or row["layout"] == "varlen"):
            return  # one attention has no teacher / student split, no KL block mask, no varlen here
        if provider in ("naive", "naive-compile") and (row.get("sparsity") is not None or row["layout"] != "dense"):
            return  # naive: the dense sweeps only
        cases.append(dict(row, priority=priority))

    if "nsweep" in args.sections:
        for n in sizes:
            for causal in (False, True):
                for provider in providers:
                    for mode in MODES:
                        add(0 if n == head_n else 4, "nsweep", provider, mode, N=n, causal=causal)
        if "naive-compile" in args.providers:
            compile_sizes = [256] if q else args.compile_sizes
            for n in compile_sizes:
                for causal in (False, True):
                    for mode in MODES:
                        add(3.6, "nsweep", "naive-compile", mode, N=n, causal=causal)
    if "dsweep" in args.sections:
        for causal in (False, True):
            for provider in providers:
                for mode in MODES:
                    add(1, "dsweep", provider, mode, N=head_n, D=d // 2, causal=causal)
    if "sparsity" in args.sections:
        for sparsity in (0.0, 0.5, 0.75, 0.9, 0.95):
            for provider in providers:
                if provider in STREAMKL:
                    for mode in MODES:
                        add(2, "sparsity", provider, mode, N=head_n if not q else 512, sparsity=sparsity)
    if "varlen" in args.sections:
        seqs, n = (4, 128) if q else (16, 4096)
        for provider in providers:
            for mode in MODES:
                add(3, "varlen", provider, mode, N=n, seqs=seqs, causal=True, layout="varlen")
                add(3, "varlen", provider, mode, B=seqs, N=n, causal=True, layout="batched")
    if "long" in args.sections and not q and "streamkl-triton" in args.providers:
        for n in (262144, 524288, 1048576):
            add(3.5, "long", "streamkl-triton", "fwd+bwd student", N=n, H=8, causal=True)
    cases.sort(key=lambda c: c["priority"])
    return cases


def run_cases(cases: list[dict], args) -> list[dict]:
    timer = Timer(args.device)
    oom_at = {}  # (provider, mode, D, layout) -> smallest N that ran out of memory
    last = {}  # (provider, mode, D, causal, layout, sparsity) -> (N, ms) of the last measured size
    rows = []
    profiled = set()  # the sdpa modes whose kernels were listed (one profiled call each)
    for case in cases:
        row = {k: v for k, v in case.items() if k != "priority"}
        row.update(ms=None, b2b_ms=None, peak_bytes=None, extra_bytes_per_row_head=None, note=None, error=None)
        provider, n = case["provider"], case["N"]
        tokens = n * case["B"] * case.get("seqs", 1)
        rows_heads = case["B"] * case.get("seqs", 1) * case["H"]
        scale_key = (provider, case["mode"], case["D"], case["causal"], case["layout"], case.get("sparsity"))
        predicted = None
        if scale_key in last:  # the work grows as N^2 per (sequence, head)
            n0, rows_heads0, ms0 = last[scale_key]
            predicted = ms0 * (n / n0) ** 2 * rows_heads / rows_heads0
        # A slow call of a kernel already compiled at a smaller N needs no warm-up call: one timed call.
        # naive-compile recompiles per shape, so it always warms up.
        single = predicted is not None and predicted > args.single_call_ms and provider != "naive-compile"
        single = single or case["section"] == "long"
        elapsed = time.perf_counter() - START
        compile_s = args.compile_estimate_s if provider == "naive-compile" else 0.0
        oom_n = oom_at.get((provider, case["mode"], case["D"], case["layout"]))
        if provider == "sdpa-flash" and not timer.cuda and not args.sdpa_any:
            row["note"] = "n/a (CUDA only)"
        elif provider == "streamkl-torch" and tokens > args.torch_max_n:
            row["note"] = "skipped (slow)"
        elif oom_n is not None and n > oom_n:
            row["note"] = f"skipped (OOM at N={oom_n})"
        elif predicted is not None and predicted > args.max_call_ms and case["section"] != "long":
            row["note"] = "skipped (slow)"
        elif elapsed + (1.1 if single else 2.5) * (predicted or 0.0) / 1e3 + compile_s > args.max_seconds:
            row["note"] = "skipped (time budget)"
        else:
            run, failed = None, False
            try:
                run = make_case_fn(case, args)
                rep_ms = 0.0 if single else args.rep_ms
                result = timer.measure(run, rep_ms, args.warmup_ms, warm=not single)
                row.update(result)
                if result["peak_bytes"] is not None:
                    row["extra_bytes_per_row_head"] = result["peak_bytes"] / (tokens * case["H"])
                last[scale_key] = (n, rows_heads, result["ms"])
                row["sdpa_backend"] = getattr(run, "sdpa_backend", None)
                if provider == "sdpa" and timer.cuda and case["mode"] not in profiled and result["ms"] < 100:
                    profiled.add(case["mode"])
                    try:
                        row["sdpa_kernels"] = sdpa_kernels(run)
                    except Exception as exc:  # noqa: BLE001 -- a missing kernel list never fails the case
                        row["sdpa_kernels"] = dict(family=f"unknown ({type(exc).__name__})", kernels=[])
            except Exception as exc:  # noqa: BLE001 -- recorded, never aborts the run
                failed = True
                if _is_oom(exc):
                    row["note"] = "OOM"
                    key = (provider, case["mode"], case["D"], case["layout"])
                    oom_at[key] = min(n, oom_at.get(key, n))
                else:
                    row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"
            run = None
            _free(failed)
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if v is not None}), flush=True)
    return rows

