"""`streamkl.kl`: check the arguments, describe the problem, dispatch, apply autograd, reduce."""

from __future__ import annotations

import torch

from streamkl.autograd import kl_forward
from streamkl.dispatch import choose_backend
from streamkl.problem import build_problem, check_output_options
from streamkl.sparse.block_mask import BlockMask


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
    mask1: BlockMask | None = None,
    mask2: BlockMask | None = None,
    reduction: str = "mean",
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """KL(P1 || P2) between two attention distributions, in one streaming pass.

    P1 = softmax(scale1 * q1 k1^T) is the target (the teacher), P2 = softmax(scale2 * q2 k2^T) the
    distribution being fitted (the student), both over the same keys; per query row and head,
    KL = sum_j P1 (log P1 - log P2), as `F.kl_div(log P2, P1)` reads it. Neither distribution is
    ever materialized. Gradients flow to whichever inputs require them.

    Args:
        q1: teacher queries, (B, Nq, H, D1), or (T, H, D1) packed with `cu_seqlens`.
        k1: teacher keys, (B, Nk, H1k, D1) or (Tk, H1k, D1); H must be a multiple of H1k (GQA).
        q2: student queries, (B, Nq, H, D2) or (T, H, D2).
        k2: student keys, (B, Nk, H2k, D2) or (Tk, H2k, D2); H must be a multiple of H2k.
            The four share one dtype (float16, bfloat16 or float32) and device; any strides with a
            contiguous last dimension.
        scale1: the teacher's score scale (a temperature is a scale); default 1 / sqrt(D1).
        scale2: the student's score scale; default 1 / sqrt(D2).
        causal: query i sees key j iff j <= i + Nk - Nq (bottom-right aligned, per sequence).
        window: (left, right): query i sees keys i + Nk - Nq - left ... i + Nk - Nq + right;
            -1 leaves that side unbounded.
        cu_seqlens: int32 (S + 1,) cumulative query lengths of packed sequences; starts at 0,
            non-decreasing, last entry <= T. Rows past its last entry get KL 0.
        cu_seqlens_k: the same for the keys; defaults to `cu_seqlens`.
        max_seqlen: the longest query sequence (at most T); computed when omitted (one host sync).
        max_seqlen_k: the longest key sequence (at most Tk); defaults as `max_seqlen`.
        mask1: a `BlockMask` restricting side 1 (the teacher) to its allowed blocks; None: dense.
        mask2: a `BlockMask` restricting side 2 (the student); None: dense.
        reduction: "none" (per row and head), "sum", or "mean" (over the (row, head) pairs whose
            side-1 support is non-empty; 0 when there are none).
        return_lse: also return the natural-log logsumexp of each side's scaled, masked scores.
        deterministic: bitwise reproducible gradients (no atomic accumulation).
        backend: "triton", "cupy", "torch" or "auto"; default `$STREAMKL_BACKEND`, else "auto".

    Returns:
        The KL, float32: (B, Nq, H) or (T, H) for "none", a scalar otherwise. With `return_lse`,
        `(kl, lse1, lse2)`, each lse float32 (B, H, Nq) or (H, T), -inf on empty rows. A row whose
        side-1 support is empty has KL 0; a key allowed on side 1 but not on side 2 gives KL +inf;
        NaN or inf inputs give NaN.

    Raises:
        TypeError: an argument of the wrong type or dtype (the message names it).
        ValueError: an argument of the wrong shape, device or value, or a backend that cannot
            serve the inputs (the message names it and lists the backends' reasons).
    """
    check_output_options(reduction, return_lse)
    problem = build_problem(
        q1, k1, q2, k2, scale1=scale1, scale2=scale2, causal=causal, window=window, cu_seqlens=cu_seqlens,
        cu_seqlens_k=cu_seqlens_k, max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k, mask1=mask1, mask2=mask2,
        deterministic=deterministic, check_values=cu_seqlens is not None and _may_read_values(),
    )
    impl = choose_backend(problem, backend)
    out, lse1, lse2 = kl_forward(problem, impl, q1, k1, q2, k2, reduction)
    if return_lse:
        return out, lse1.detach(), lse2.detach()
    return out


def _may_read_values() -> bool:
    """Value checks of cu_seqlens read the device: skip them while compiling or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())
