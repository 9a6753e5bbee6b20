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
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import gc
import json
import math
import platform
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

import streamkl  # noqa: E402
from benchmarks.naive import naive_kl  # noqa: E402
from streamkl.varlen import cu_seqlens_from_lengths  # noqa: E402

PROVIDERS = ("streamkl-triton", "streamkl-cupy", "streamkl-torch", "naive", "naive-compile", "sdpa", "sdpa-flash")
SDPA = ("sdpa", "sdpa-flash")
LABELS = {"sdpa": "sdpa (default)", "sdpa-flash": "sdpa-flash (FlashAttention-2)"}
STREAMKL = {"streamkl-triton": "triton", "streamkl-cupy": "cupy", "streamkl-torch": "torch"}
MODES = ("forward", "fwd+bwd student", "fwd+bwd all")
GRADS = {"forward": (), "fwd+bwd student": (2, 3), "fwd+bwd all": (0, 1, 2, 3)}
SECTIONS = ("nsweep", "dsweep", "sparsity", "varlen", "long")
HOST_MODES = ("forward", "training forward", "backward")
MIB = 2**20
_START = time.perf_counter()


# ----------------------------------------------------------------------------- the computations
_COMPILED = {}


def compiled_naive(backend: str):
    if backend not in _COMPILED:
        config = torch._dynamo.config
        for name in ("recompile_limit", "cache_size_limit"):  # one graph per shape and mode, never eager fallback
            if hasattr(config, name):
                setattr(config, name, 256)
        if hasattr(config, "accumulated_recompile_limit"):
            config.accumulated_recompile_limit = 4096
        _COMPILED[backend] = torch.compile(naive_kl, dynamic=False, backend=backend)
    return _COMPILED[backend]


def block_mask(n: int, heads: int, sparsity: float, block: int, device) -> streamkl.BlockMask:
    """Per head, each query block keeps the same number of random key blocks (at least one)."""
    blocks = math.ceil(n / block)
    keep = max(1, round(blocks * (1.0 - sparsity)))
    generator = torch.Generator().manual_seed(1234)
    scores = torch.rand(1, heads, blocks, blocks, generator=generator)
    chosen = scores.topk(keep, dim=-1).indices
    pattern = torch.zeros(1, heads, blocks, blocks, dtype=torch.bool).scatter_(-1, chosen, True)
    return streamkl.BlockMask.from_dense(pattern.to(device), block_size=block)


def make_case_fn(case: dict, args):
    """Inputs for one case and a closure running one call (forward, or forward + backward)."""
    device, dtype = args.device, args.torch_dtype
    provider, mode = case["provider"], case["mode"]
    b, n, h, d, causal = case["B"], case["N"], case["H"], case["D"], case["causal"]
    grads = GRADS[mode]
    if case.get("layout") == "varlen":
        shape = (case["seqs"] * n, h, d)
    else:
        shape = (b, n, h, d)
    inputs = [torch.randn(shape, device=device, dtype=dtype).requires_grad_(i in grads) for i in range(4)]
    q1, k1, q2, k2 = inputs
    if provider in SDPA:
        need = mode != "forward"
        q, k = q1.detach().transpose(1, 2).requires_grad_(need), k1.detach().transpose(1, 2).requires_grad_(need)
        value = torch.randn(b, h, n, d, device=device, dtype=dtype, requires_grad=need)
        grad_out = torch.randn(b, h, n, d, device=device, dtype=dtype)
        context = sdpa_context(provider, args.sdpa_any)

        def run():
            with context():
                out = F.scaled_dot_product_attention(q, k, value, is_causal=causal)
            if need:
                out.backward(grad_out)
                q.grad = k.grad = value.grad = None

        with context():
            run.sdpa_backend = sdpa_choice(q, k, value, causal)
        return run
    kwargs = dict(causal=causal)
    if provider in STREAMKL:
        kwargs["backend"] = STREAMKL[provider]
        if case.get("layout") == "varlen":
            kwargs["cu_seqlens"] = cu_seqlens_from_lengths([n] * case["seqs"], device=device)
            kwargs["max_seqlen"] = n
        if case.get("sparsity") is not None:
            mask = block_mask(n, h, case["sparsity"], args.block, device)
            kwargs["mask1"] = kwargs["mask2"] = mask
        fn = lambda: streamkl.kl(q1, k1, q2, k2, **kwargs)  # noqa: E731
    elif provider == "naive":
        fn = lambda: naive_kl(q1, k1, q2, k2, causal)  # noqa: E731
    elif provider == "naive-compile":
        compiled = compiled_naive(args.compile_backend)
        fn = lambda: compiled(q1, k1, q2, k2, causal)  # noqa: E731
    else:
        raise ValueError(f"unknown provider {provider!r}")

    def run():
        loss = fn()
        if mode != "forward":
            loss.backward()
            for t in inputs:
                t.grad = None

    return run


def sdpa_context(provider: str, sdpa_any: bool = False):
    """A factory of the context a provider's SDPA call runs in: no restriction for `sdpa`, flash for `sdpa-flash`."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    if provider == "sdpa" or sdpa_any:
        return contextlib.nullcontext
    return lambda: sdpa_kernel([SDPBackend.FLASH_ATTENTION])


def sdpa_choice(q, k, v, causal: bool) -> str | None:
    """The backend SDPA's dispatcher picks for these inputs (its own query, no kernel runs)."""
    from torch.nn.attention import SDPBackend

    try:
        return SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, causal)).name
    except Exception:  # noqa: BLE001 -- a private query: unknown rather than a failed case
        return None


def sdpa_kernels(run) -> dict:
    """The device kernels of one call under torch.profiler, and the attention family their names show."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
        torch.cuda.synchronize()
    names = sorted({e.name for e in prof.events() if e.device_type == DeviceType.CUDA})
    text = " ".join(names).lower()
    family = next((f for f, keys in (("cudnn", ("cudnn",)), ("flash", ("flash",)),
                                     ("efficient", ("fmha", "efficient", "cutlass"))) if any(x in text for x in keys)),
                  "other (math?)")
    return dict(family=family, kernels=[name[:120] for name in names][:12])


def make_host_fns(provider: str, mode: str, n: int, d: int, args) -> tuple:
    """(before, call) for one host-time measurement: `call` is what is timed, `before` prepares it
    (untimed). The student's inputs require grad in the training modes (a detached teacher)."""
    device, dtype, h = args.device, args.torch_dtype, args.host_heads
    grad = mode != "forward"
    q1, k1 = (torch.randn(1, n, h, d, device=device, dtype=dtype) for _ in range(2))
    q2, k2 = (torch.randn(1, n, h, d, device=device, dtype=dtype, requires_grad=grad) for _ in range(2))
    if provider in SDPA:
        q, k = q2.transpose(1, 2), k2.transpose(1, 2)
        value = torch.randn_like(q, requires_grad=grad)
        grad_out = torch.randn_like(q)
        context = sdpa_context(provider)

        def forward():
            with context():
                return F.scaled_dot_product_attention(q, k, value, is_causal=True)

        backward = lambda out: out.backward(grad_out)  # noqa: E731
        leaves = (q2, k2, value)
    else:
        forward = lambda: streamkl.kl(q1, k1, q2, k2, causal=True, backend=STREAMKL[provider])  # noqa: E731
        backward = lambda loss: loss.backward()  # noqa: E731
        leaves = (q2, k2)
    if mode != "backward":
        return None, forward
    held = {}

    def before():
        for t in leaves:
            t.grad = None
        held["out"] = forward()

    return before, lambda: backward(held.pop("out"))


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


# ----------------------------------------------------------------------------- timing and memory
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


# ----------------------------------------------------------------------------- the cases
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


def case_key(case: dict) -> tuple:
    return (case["section"], case["provider"], case["mode"], case["B"], case["N"], case["H"], case["D"],
            case["causal"], case["layout"], case.get("sparsity"))


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
        elapsed = time.perf_counter() - _START
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


# ----------------------------------------------------------------------------- targets
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


# ----------------------------------------------------------------------------- reports
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


def _fmt(v, spec=".3f"):
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
        lines.append(f"| {g['provider']} | {g['target']} | {_fmt(g['value'], '.3f')} | "
                     f"{_fmt(g.get('value_sdpa'), '.3f') if peer else '-'} | {g['goal']} | {met[0]} | "
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
                        cells.append(_fmt(_bwd(rows, mode_p, **want)))
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


# ----------------------------------------------------------------------------- main
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
    total_s = time.perf_counter() - _START
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
        vs_sdpa = f"; vs default SDPA {_fmt(g['value_sdpa'])}" if g.get("value_sdpa") is not None else ""
        print(f"  [{met:>7}] {g['provider']}: {g['target']} = {_fmt(g['value'])} (goal {g['goal']}){vs_sdpa}")
    print(f"wrote {out / (name + '.json')}, {out / (name + '.md')}, {', '.join(written)}; {total_s:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
