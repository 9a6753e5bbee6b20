"""The autograd path every backend shares: `_KL` (one autograd.Function) and two `torch.library`
ops with fake implementations.

`streamkl::kl_forward` and `streamkl::kl_backward` carry the problem as plain tensors, ints and
floats (the backend's index among them), so `torch.compile(fullgraph=True)` and dispatch modes see
two opaque ops and no graph break; eager calls run the same implementations (`run_forward`,
`run_backward`) directly on the front end's problem. The backend chosen in forward also runs the
backward. The ops are defined with
`torch.library.Library` (define + impl) rather than the `torch.library.custom_op` decorator: the
same public registration, without the decorator's per-call Python wrappers.
"""

from __future__ import annotations

import contextlib

import torch

from streamkl._cache import LRUCache
from streamkl._compat import dispatch_modes_active
from streamkl.backends.base import Backend, empty_rows_to_zero
from streamkl.dispatch import PRIORITY, get_backend
from streamkl.problem import Problem, SideMask, describe_problem, known_host_values
from streamkl.reduction import mean_count
from streamkl.sparse.schedule import get_schedule

_PLAIN = (torch.Tensor, torch.nn.Parameter)
_NO_CONTEXT = contextlib.nullcontext()  # grad already off: torch.no_grad() would cost a microsecond for nothing
_LIBRARY = torch.library.Library("streamkl", "FRAGMENT")
_LIBRARY.define(
    "kl_forward(Tensor q1, Tensor k1, Tensor q2, Tensor k2, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, "
    "Tensor? mask1, Tensor? mask2, int[] ints, float[] floats) -> (Tensor, Tensor, Tensor, Tensor)"
)
_LIBRARY.define(
    "kl_backward(Tensor grad_rows, Tensor q1, Tensor k1, Tensor q2, Tensor k2, Tensor lse1, Tensor lse2, "
    "Tensor expect, Tensor? cu_seqlens_q, Tensor? cu_seqlens_k, Tensor? mask1, Tensor? mask2, int[] ints, "
    "float[] floats, bool[] needs) -> (Tensor, Tensor, Tensor, Tensor)"
)


def pack_problem(problem: Problem, backend: str) -> tuple:
    """Problem and backend name -> the ops' problem arguments (cu_q, cu_k, pattern1, pattern2, ints,
    floats); `unpack_problem` is the inverse. Few arguments: the autograd wrapper of an op walks its
    schema once per argument on each call."""
    mask1, mask2 = problem.mask1, problem.mask2
    left, right = problem.window
    ints = [
        int(problem.causal), left, right, problem.seqlen_q, problem.seqlen_k,
        0 if mask1 is None else mask1.block_q, 0 if mask1 is None else mask1.block_k,
        0 if mask2 is None else mask2.block_q, 0 if mask2 is None else mask2.block_k,
        int(problem.deterministic), -1 if problem.tail_start_q is None else problem.tail_start_q,
        PRIORITY.index(backend),
    ]
    cu_q, cu_k = problem.cu_seqlens_q, problem.cu_seqlens_k
    # one table for both sides travels once: autograd.Function under torch.compile refuses a tensor
    # passed twice
    pattern1 = None if mask1 is None else mask1.pattern
    pattern2 = None if mask2 is None or mask2.pattern is pattern1 else mask2.pattern
    return (cu_q, None if cu_k is cu_q else cu_k, pattern1, pattern2, ints, [problem.scale1, problem.scale2])


_UNPACKED = LRUCache(64)


def _state(t):
    return None if t is None else (id(t), t._version)


def unpack_problem(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats) -> tuple[Problem, Backend]:
    """The Problem and backend of the ops' arguments. No validation: the front end checked them
    (`build_problem`). cu_k None is cu_q; mask2 None with a block size is mask1's pattern. The host
    copies of cu_seqlens come from the front end's cache (never while compiling): keyed by the
    tables' identity and version, they are the tables' values.

    Kept per arguments (outside of torch.compile): the ints and floats, every input's metadata,
    and the tables and patterns by identity and version (the memo keeps them alive)."""
    if cu_k is None:
        cu_k = cu_q
    host_q = host_k = None
    if cu_q is not None:
        host_q = known_host_values(cu_q)
        host_k = host_q if cu_k is cu_q else known_host_values(cu_k)
    key = None
    if (q1.__class__ in _PLAIN and k1.__class__ in _PLAIN and q2.__class__ in _PLAIN and k2.__class__ in _PLAIN
            and not torch.compiler.is_compiling()):
        key = (tuple(ints), tuple(floats), q1.shape, q1.stride(), q1.requires_grad, k1.shape, k1.stride(),
               k1.requires_grad, q2.shape, q2.stride(), q2.requires_grad, k2.shape, k2.stride(), k2.requires_grad,
               q1.dtype, q1.device, k1.dtype, k1.device, q2.dtype, q2.device, k2.dtype, k2.device,
               _state(cu_q), _state(cu_k), _state(mask1), _state(mask2), id(host_q), id(host_k))
        hit = _UNPACKED.get(key)
        if hit is not None:
            return hit[0], hit[1]
    causal, left, right, seqlen_q, seqlen_k, block1_q, block1_k, block2_q, block2_k, deterministic, tail, backend = ints
    problem = describe_problem(
        q1, k1, q2, k2, floats[0], floats[1], bool(causal), (left, right), cu_q, cu_k, seqlen_q, seqlen_k,
        None if mask1 is None else SideMask(mask1, block1_q, block1_k),
        None if block2_q == 0 else SideMask(mask1 if mask2 is None else mask2, block2_q, block2_k),
        bool(deterministic), None if tail < 0 else tail, host_q, host_k,
    )
    impl = get_backend(PRIORITY[backend])
    if key is not None:  # (the Problem holds the tables, patterns and host copies: their ids stay theirs)
        _UNPACKED.put(key, (problem, impl))
    return problem, impl


def run_forward(problem: Problem, impl: Backend, q1, k1, q2, k2) -> tuple:
    """(kl_rows, lse1, lse2, expect): the backend's forward over its tile schedule."""
    schedule = get_schedule(problem, *impl.tile_sizes(problem))
    return impl.forward(problem, q1, k1, q2, k2, schedule)


def run_backward(problem: Problem, impl: Backend, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs) -> tuple:
    """(dq1, dk1, dq2, dk2), None where `needs` is False."""
    schedule = get_schedule(problem, *impl.tile_sizes(problem))
    # a row whose side-1 support is empty has KL 0 whatever the scores: its gradient is exactly 0
    if impl.zeroes_empty_rows:  # the kernels do it as they load the row (no extra pass here)
        grad_rows = grad_rows.float()
    else:
        grad_rows = empty_rows_to_zero(grad_rows, lse1, problem.is_varlen)
    return impl.backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, tuple(needs))


def _forward_impl(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats):
    problem, impl = unpack_problem(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats)
    with torch.no_grad():  # a kernel: its own ops are not differentiated (`_KL` is the autograd)
        return run_forward(problem, impl, q1, k1, q2, k2)


def _forward_fake(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats):
    if cu_q is not None:
        row_shape, lse_shape = (q1.shape[0], q1.shape[1]), (q1.shape[1], q1.shape[0])
    else:
        row_shape, lse_shape = (q1.shape[0], q1.shape[1], q1.shape[2]), (q1.shape[0], q1.shape[2], q1.shape[1])
    new = lambda shape: q1.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return new(row_shape), new(lse_shape), new(lse_shape), new(lse_shape)


def _backward_impl(grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2, ints, floats, needs):
    problem, impl = unpack_problem(q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats)
    with torch.no_grad():  # the op has no derivative (`_KL` raises on a second one)
        grads = run_backward(problem, impl, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (q1, k1, q2, k2)))


def _backward_fake(grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2, ints, floats, needs):
    return tuple(torch.empty_like(t) if need else t.new_empty(0) for t, need in zip((q1, k1, q2, k2), needs))


class _KL(torch.autograd.Function):
    """The autograd of `streamkl.kl`: the forward (the reduction included) and its backward.

    An `autograd.Function` around the ops (FlashAttention's arrangement) rather than
    `torch.library.register_autograd`, whose wrapper walks the op's schema on every call; eager and
    torch.compile take it alike. `call` is the front end's (Problem, Backend) when nobody traces the
    call (`_direct`): the ops' implementations then run without the dispatcher's round trip and
    a second description of the problem. Under torch.compile, a dispatch mode or tensor subclasses
    it is None and the ops run with their packed arguments, which follow it (a direct call passes
    none: each argument of `apply` costs host time). The reduction happens here, so the
    graph holds one node, and the backward reads a reduced loss's gradient as one value expanded
    over the rows. There is no second derivative: under create_graph=True the gradients carry
    `_NoSecondDerivative`, so a double backward raises rather than dropping terms."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, reduction, count, call, *packed):
        # packed: pack_problem's (cu_q, cu_k, mask1, mask2, ints, floats) where `call` is None; empty
        # otherwise (each argument of apply costs host time)
        if call is not None:
            kl_rows, lse1, lse2, expect = run_forward(*call, q1, k1, q2, k2)
            tables, ints, floats = (), None, None
        else:
            kl_rows, lse1, lse2, expect = torch.ops.streamkl.kl_forward(q1, k1, q2, k2, *packed)
            tables, ints, floats = packed[:4], packed[4], packed[5]
        # E enters only side 1's gradients (dS1 = g p (d - E)): for a detached teacher lse1 stands in
        # for it (same shape, never read for side 2), so the forward keeps 8 bytes a (row, head), not 12
        needs = ctx.needs_input_grad
        saved_expect = lse1 if not needs[0] and not needs[1] else expect
        ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, saved_expect, *tables)
        ctx.call, ctx.ints, ctx.floats, ctx.packed = call, ints, floats, len(packed)
        ctx.reduction, ctx.count, ctx.row_shape = reduction, count, kl_rows.shape
        ctx.mark_non_differentiable(lse1, lse2)
        ctx.set_materialize_grads(False)
        return _reduce(kl_rows, reduction, count), lse1, lse2

    @staticmethod
    def backward(ctx, grad_out, grad_lse1, grad_lse2):
        need_q1, need_k1, need_q2, need_k2 = ctx.needs_input_grad[:4]
        needs = [need_q1, need_k1, need_q2, need_k2]
        rest = (None,) * (3 + ctx.packed)  # reduction, count, call and the packed problem
        if grad_out is None or not (need_q1 or need_k1 or need_q2 or need_k2):
            return (None,) * 4 + rest
        q1, k1, q2, k2, lse1, lse2, expect, *tables = ctx.saved_tensors
        # a reduced loss: its gradient one value over the rows (stride 0), as DivBackward and
        # SumBackward would have made it
        if ctx.reduction == "mean":
            grad_out = grad_out / ctx.count
        grad_rows = grad_out if ctx.reduction == "none" else grad_out.expand(ctx.row_shape)
        if ctx.call is not None:
            run = lambda: run_backward(*ctx.call, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs)  # noqa: E731
        else:
            run = lambda: torch.ops.streamkl.kl_backward(  # noqa: E731
                grad_rows, q1, k1, q2, k2, lse1, lse2, expect, *tables, ctx.ints, ctx.floats, needs)
        if not torch.is_grad_enabled():  # the usual backward (grad mode is on only under create_graph=True)
            dq1, dk1, dq2, dk2 = run()
            return (dq1 if need_q1 else None, dk1 if need_k1 else None, dq2 if need_q2 else None,
                    dk2 if need_k2 else None, *rest)
        with torch.no_grad():  # the op has no derivative: a second one raises
            grads = run()
        anchor = next(t for t, need in zip((q1, k1, q2, k2), needs) if need)  # requires grad: records the node
        wanted = _NoSecondDerivative.apply(anchor, *(g for g, need in zip(grads, needs) if need))
        wanted = iter(wanted if isinstance(wanted, tuple) else (wanted,))
        return tuple(next(wanted) if need else None for need in needs) + rest


def _reduce(kl_rows: torch.Tensor, reduction: str, count) -> torch.Tensor:
    """The SPEC's reductions; `count` (an int or a device scalar) divides the mean."""
    if reduction == "none":
        return kl_rows
    if reduction == "mean" and count.__class__ is int and count == kl_rows.numel():
        return kl_rows.mean()  # every row counts (the common case): one launch, not two
    total = kl_rows.sum()
    # not divided in place: torch 2.11's compiled autograd.Function then returns zero gradients
    return total / count if reduction == "mean" else total


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the first gradients through; differentiating them again raises."""

    @staticmethod
    def forward(ctx, anchor, *grads):
        return grads if len(grads) > 1 else grads[0]

    @staticmethod
    def backward(ctx, *grads):
        raise RuntimeError("streamkl.kl has no second derivative (its backward is not differentiable)")


_LIBRARY.impl("kl_forward", _forward_impl, "CompositeExplicitAutograd")
_LIBRARY.impl("kl_backward", _backward_impl, "CompositeExplicitAutograd")
torch.library.register_fake("streamkl::kl_forward", _forward_fake, lib=_LIBRARY)
torch.library.register_fake("streamkl::kl_backward", _backward_fake, lib=_LIBRARY)


def kl_forward(problem: Problem, impl: Backend, q1, k1, q2, k2, reduction: str) -> tuple:
    """(the KL reduced per `reduction`, lse1, lse2) of a validated problem, differentiable in q1,
    k1, q2, k2 (the lse are not)."""
    count = mean_count(problem) if reduction == "mean" else 1
    direct = _direct(q1, k1, q2, k2)
    if torch.is_grad_enabled() and (q1.requires_grad or k1.requires_grad or q2.requires_grad or k2.requires_grad):
        if direct:
            return _KL.apply(q1, k1, q2, k2, reduction, count, (problem, impl))
        if torch.compiler.is_compiling():  # dynamo refuses a tensor passed twice to an autograd Function
            q1, k1, q2, k2 = _distinct((q1, k1, q2, k2))
        return _KL.apply(q1, k1, q2, k2, reduction, count, None, *pack_problem(problem, impl.name))
    if direct:
        with torch.no_grad() if torch.is_grad_enabled() else _NO_CONTEXT:
            kl_rows, lse1, lse2, _ = run_forward(problem, impl, q1, k1, q2, k2)
    else:
        kl_rows, lse1, lse2, _ = torch.ops.streamkl.kl_forward(q1, k1, q2, k2, *pack_problem(problem, impl.name))
    return _reduce(kl_rows, reduction, count), lse1, lse2


def _direct(q1, k1, q2, k2) -> bool:
    """Whether the ops' implementations may run without the dispatcher: plain tensors, nothing
    tracing (torch.compile, a dispatch mode such as make_fx's or FlopCounterMode)."""
    return (q1.__class__ in _PLAIN and k1.__class__ in _PLAIN and q2.__class__ in _PLAIN and k2.__class__ in _PLAIN
            and not torch.compiler.is_compiling() and not dispatch_modes_active())


def _distinct(tensors: tuple) -> tuple:
    """The tensors, a repeated one replaced by a view of itself (gradients still reach it)."""
    out = []
    for t in tensors:
        out.append(t.view_as(t) if any(t is seen for seen in out) else t)
    return tuple(out)
