"""`streamkl.kl`: check the arguments, describe the problem, dispatch, apply autograd."""

from __future__ import annotations

import torch

from streamkl import autograd, plans
from streamkl.autograd import kl_forward
from streamkl.dispatch import choose_backend
from streamkl.problem import _call_key, build_problem, check_output_options


def kl(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    *,
    scale1: float | None = None,
    scale2: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    max_seqlen_k: int | None = None,
    mask1=None,
    mask2=None,
    reduction: str = "mean",
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str | None = None,
):
    """KL(P1 || P2) between the attention distributions P1 = softmax(scale1 * q1 k1^T) (the
    teacher, the target) and P2 = softmax(scale2 * q2 k2^T) (the student), computed in one
    streaming pass without materializing either distribution. See README.md for every argument.

    Returns the reduced KL (float32), or `(kl, lse1, lse2)` when `return_lse`.
    """
    check_output_options(reduction, return_lse)
    # a call with the arguments of one served before: that call's plan (plans.py), else the full path
    objects = (cu_seqlens, cu_seqlens_k, mask1, mask2)
    check_values = cu_seqlens is not None and _may_sync()  # only varlen checks read values
    key = None
    # (compiling first: code traced by torch.compile reads none of this; plans.WATCHED says why)
    if (not torch.compiler.is_compiling() and plans.ENABLED and (backend is None or backend.__class__ is str)
            and autograd.eager_fast_path((q1, k1, q2, k2))):
        options = (window, scale1, scale2, causal, max_seqlen, max_seqlen_k, deterministic, check_values, False)
        call_key = _call_key((q1, k1, q2, k2), options, objects)
        if call_key is not None:
            key = plans.plan_key(call_key, reduction, return_lse, backend)
            plan = plans.find(key, objects)
            if plan is not None:
                result = plan.run(q1, k1, q2, k2)
                if result is not None:
                    return result
    problem = build_problem(
        q1,
        k1,
        q2,
        k2,
        scale1=scale1,
        scale2=scale2,
        causal=causal,
        window=window,
        cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k,
        max_seqlen=max_seqlen,
        max_seqlen_k=max_seqlen_k,
        mask1=mask1,
        mask2=mask2,
        deterministic=deterministic,
        check_values=check_values,
    )
    impl = choose_backend(problem, backend)
    out, lse1, lse2 = kl_forward(problem, impl, q1, k1, q2, k2, reduction)
    if key is not None:
        grad = torch.is_grad_enabled() and (q1.requires_grad or k1.requires_grad or q2.requires_grad
                                            or k2.requires_grad)
        plans.remember(key, objects, problem, impl, reduction, return_lse, grad)
    if return_lse:
        return out, lse1.detach(), lse2.detach()
    return out


def _may_sync() -> bool:
    """Value checks of cu_seqlens read the device: skip them while compiling or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
