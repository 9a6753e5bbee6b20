"""The one autograd function all backends share, registered as `torch.library` custom ops.

`streamkl::kl_forward` and `streamkl::kl_backward` carry the problem as plain tensors, ints,
floats and a backend name, with fake (meta) implementations, so `torch.compile(fullgraph=True)`
sees two opaque ops and no graph break. The backend chosen in forward also runs the backward.
"""

from __future__ import annotations

import dataclasses

import torch

from streamkl.dispatch import get_backend
from streamkl.problem import Problem, SideMask, build_problem
from streamkl.sparse.schedule import get_schedule

# ints carried through the op, in this order
_INT_FIELDS = (
    "causal",
    "window_left",
    "window_right",
    "max_seqlen_q",
    "max_seqlen_k",
    "mask1_block_q",
    "mask1_block_k",
    "mask2_block_q",
    "mask2_block_k",
    "deterministic",
)


def pack_problem(problem: Problem):
    """Problem -> (cu_seqlens_q, cu_seqlens_k, mask1, mask2, ints, floats) for the custom ops."""
    masks = [problem.mask1, problem.mask2]
    ints = [
        int(problem.causal),
        problem.window[0],
        problem.window[1],
        problem.seqlen_q,
        problem.seqlen_k,
    ]
    for mask in masks:
        ints += [mask.block_q, mask.block_k] if mask is not None else [0, 0]
    ints.append(int(problem.deterministic))
    floats = [problem.scale1, problem.scale2]
    patterns = [None if m is None else m.pattern for m in masks]
    return problem.cu_seqlens_q, problem.cu_seqlens_k, patterns[0], patterns[1], ints, floats


def unpack_problem(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats) -> Problem:
    values = dict(zip(_INT_FIELDS, ints))
    varlen = cu_q is not None
    problem = build_problem(
        q1,
        k1,
        q2,
        k2,
        scale1=floats[0],
        scale2=floats[1],
        causal=bool(values["causal"]),
        window=(values["window_left"], values["window_right"]),
        cu_seqlens=cu_q,
        cu_seqlens_k=cu_k,
        max_seqlen=values["max_seqlen_q"] if varlen else None,
        max_seqlen_k=values["max_seqlen_k"] if varlen else None,
        deterministic=bool(values["deterministic"]),
        check_values=False,
    )
    sides = {}
    for side, pattern in (("1", mask1), ("2", mask2)):
        sides[f"mask{side}"] = (
            None
            if pattern is None
            else SideMask(pattern, values[f"mask{side}_block_q"], values[f"mask{side}_block_k"])
        )
    return dataclasses.replace(problem, **sides)


def _row_shapes(q1, cu_q):
    if cu_q is not None:
        total, heads = q1.shape[0], q1.shape[1]
        return (total, heads), (heads, total)
    batch, seqlen, heads = q1.shape[:3]
    return (batch, seqlen, heads), (batch, heads, seqlen)


@torch.library.custom_op("streamkl::kl_forward", mutates_args=())
def kl_forward_op(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    mask1: torch.Tensor | None,
    mask2: torch.Tensor | None,
    ints: list[int],
    floats: list[float],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = unpack_problem(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, mask1, mask2, ints, floats)
    impl = get_backend(backend)
    schedule = get_schedule(problem, *impl.tile_sizes(problem))
    return impl.forward(problem, q1, k1, q2, k2, schedule)


@kl_forward_op.register_fake
def _(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, mask1, mask2, ints, floats, backend):
    row_shape, lse_shape = _row_shapes(q1, cu_seqlens_q)
    new = lambda shape: q1.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return new(row_shape), new(lse_shape), new(lse_shape), new(lse_shape)


@torch.library.custom_op("streamkl::kl_backward", mutates_args=())
def kl_backward_op(
    grad_rows: torch.Tensor,
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    lse1: torch.Tensor,
    lse2: torch.Tensor,
    expect: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    mask1: torch.Tensor | None,
    mask2: torch.Tensor | None,
    ints: list[int],
    floats: list[float],
    backend: str,
    needs: list[bool],
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    problem = unpack_problem(q1, k1, q2, k2, cu_seqlens_q, cu_seqlens_k, mask1, mask2, ints, floats)
    impl = get_backend(backend)
    schedule = get_schedule(problem, *impl.tile_sizes(problem))
    # a row whose side-1 support is empty has KL 0 whatever the scores: its gradient is exactly 0
    grad_rows = torch.where(_rows_from_lse(lse1, cu_seqlens_q is not None) == float("-inf"), 0.0, grad_rows.float())
    grads = impl.backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, tuple(needs))
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (q1, k1, q2, k2)))


@kl_backward_op.register_fake
def _(grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2, ints, floats, backend, needs):
    return tuple(torch.empty_like(t) if need else t.new_empty(0) for t, need in zip((q1, k1, q2, k2), needs))


def _rows_from_lse(lse: torch.Tensor, varlen: bool) -> torch.Tensor:
    """lse [B, H, N] or [H, T] -> row layout [B, N, H] or [T, H]."""
    return lse.transpose(0, 1) if varlen else lse.transpose(1, 2)


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats, backend = inputs
    _, lse1, lse2, expect = output
    ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2)
    ctx.ints, ctx.floats, ctx.backend = ints, floats, backend


def _backward(ctx, grad_rows, grad_lse1, grad_lse2, grad_expect):
    q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2 = ctx.saved_tensors
    needs = [bool(n) for n in ctx.needs_input_grad[:4]]
    if grad_rows is None or not any(needs):
        return (None,) * 11
    grads = torch.ops.streamkl.kl_backward(
        grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2,
        ctx.ints, ctx.floats, ctx.backend, needs,
    )
    return tuple(g if need else None for g, need in zip(grads, needs)) + (None,) * 7


torch.library.register_autograd("streamkl::kl_forward", _backward, setup_context=_setup_context)
