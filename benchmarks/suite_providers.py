"""The suite's providers: the calls it times (streamkl's backends, the naive materializing KL, SDPA) and
their inputs, for the kernel-time cases and the host-time cells."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F

import streamkl
from benchmarks.naive import naive_kl
from streamkl.varlen import cu_seqlens_from_lengths

PROVIDERS = ("streamkl-triton", "streamkl-cupy", "streamkl-torch", "naive", "naive-compile", "sdpa", "sdpa-flash")
SDPA = ("sdpa", "sdpa-flash")
LABELS = {"sdpa": "sdpa (default)", "sdpa-flash": "sdpa-flash (FlashAttention-2)"}
STREAMKL = {"streamkl-triton": "triton", "streamkl-cupy": "cupy", "streamkl-torch": "torch"}
MODES = ("forward", "fwd+bwd student", "fwd+bwd all")
GRADS = {"forward": (), "fwd+bwd student": (2, 3), "fwd+bwd all": (0, 1, 2, 3)}
SECTIONS = ("nsweep", "dsweep", "sparsity", "varlen", "long")
HOST_MODES = ("forward", "training forward", "backward")
MIB = 2**20

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
