"""The one autograd function all backends share, registered as `torch.library` custom ops.

`streamkl::kl_forward` and `streamkl::kl_backward` carry the problem as plain tensors, ints,
floats and a backend name, with fake (meta) implementations, so `torch.compile(fullgraph=True)`
sees two opaque ops and no graph break. The backend chosen in forward also runs the backward.

Plain eager calls take `_EagerKL`, an autograd.Function running the very same forward and backward
(`run_forward`, `run_backward`) on the front end's already validated `Problem`: the custom-op
machinery costs more host time per call than the rest of the front end, and eager needs none of it.
"""

from __future__ import annotations

from collections import OrderedDict

import torch

from streamkl.backends.base import Backend, empty_rows_to_zero
from streamkl.dispatch import get_backend
from streamkl.problem import Problem, SideMask, describe_problem, structural_row_count
from streamkl.sparse.schedule import get_schedule

NEG_INF = float("-inf")

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
    """The inverse of `pack_problem`. No validation: the front end checked these arguments before
    packing them (`build_problem`), so the op does not check them a second time."""
    (causal, left, right, seqlen_q, seqlen_k, block1_q, block1_k, block2_q, block2_k, deterministic) = ints
    return describe_problem(
        q1,
        k1,
        q2,
        k2,
        floats[0],
        floats[1],
        bool(causal),
        (left, right),
        cu_q,
        cu_k,
        seqlen_q,
        seqlen_k,
        None if mask1 is None else SideMask(mask1, block1_q, block1_k),
        None if mask2 is None else SideMask(mask2, block2_q, block2_k),
        bool(deterministic),
    )


def run_forward(problem: Problem, impl: Backend, q1, k1, q2, k2):
    """(kl_rows, lse1, lse2, expect), schedule: the backend's forward over its tile schedule."""
    schedule = get_schedule(problem, *impl.tile_sizes(problem))
    return impl.forward(problem, q1, k1, q2, k2, schedule), schedule


def run_backward(problem: Problem, impl: Backend, schedule, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs):
    """(dq1, dk1, dq2, dk2), None where `needs` is False."""
    # a row whose side-1 support is empty has KL 0 whatever the scores: its gradient is exactly 0
    if impl.zeroes_empty_rows:  # the kernels do it as they load the row (no extra pass here)
        grad_rows = grad_rows.float()
    else:
        grad_rows = empty_rows_to_zero(grad_rows, lse1, problem.is_varlen)
    return impl.backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, tuple(needs))


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
    return run_forward(problem, get_backend(backend), q1, k1, q2, k2)[0]


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
    grads = run_backward(problem, impl, schedule, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs)
    return tuple(g if g is not None else t.new_empty(0) for g, t in zip(grads, (q1, k1, q2, k2)))


@kl_backward_op.register_fake
def _(grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2, ints, floats, backend, needs):
    return tuple(torch.empty_like(t) if need else t.new_empty(0) for t, need in zip((q1, k1, q2, k2), needs))


def _setup_context(ctx, inputs, output):
    q1, k1, q2, k2, cu_q, cu_k, mask1, mask2, ints, floats, backend = inputs
    _, lse1, lse2, expect = output
    ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, _expect_to_save(ctx, lse1, expect), cu_q, cu_k, mask1, mask2)
    ctx.ints, ctx.floats, ctx.backend = ints, floats, backend


def _expect_to_save(ctx, lse1: torch.Tensor, expect: torch.Tensor) -> torch.Tensor:
    """E enters only side 1's gradients (dS1 = g p (d - E)): when neither q1 nor k1 needs a
    gradient (a detached teacher, the usual distillation), lse1 stands in for it (same shape and
    layout, never read for side 2), so the forward keeps 8 bytes per (row, head) until the
    backward instead of 12."""
    needs = getattr(ctx, "needs_input_grad", None)
    if needs is not None and not needs[0] and not needs[1]:
        return lse1
    return expect


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


# ------------------------------------------------------------------------------ reductions
def mean_count(kl_rows: torch.Tensor, lse1: torch.Tensor, problem: Problem | None = None, schedule=None):
    """What `mean` divides by: the rows whose side-1 support is non-empty, at least 1. A host int
    where the structure says it (`structural_row_count`), else a device tensor (no sync), kept
    with the call's tile schedule when one is given (`_count_memo`)."""
    count = None if problem is None else structural_row_count(problem)
    if count is not None:
        return max(count, 1)
    memo = _count_memo(schedule, problem)
    if memo is not None and memo[1] in memo[0]:
        return memo[0][memo[1]]
    # a side-1 block mask (or varlen lengths unknown on the host): count the rows lse1 says are
    # non-empty; count_nonzero makes no int64 copy of the mask (a bool .sum() does on some devices)
    count = torch.count_nonzero(lse1 != NEG_INF).clamp_(min=1)
    if memo is not None:
        memo[0][memo[1]] = count
    return count


_COUNT_CACHE: OrderedDict = OrderedDict()


def _count_memo(schedule, problem):
    """(dict, key) where the count of a side-1 masked problem is kept, or None. Which rows have an
    empty side-1 support is structure (the masks, lengths, causality and window: what the tile
    schedule is cached by, `get_schedule`) and the batch and head counts, so the count made from
    lse1 by the first call holds for every later call with the same schedule (three launches
    fewer a call). Not while capturing a CUDA graph (a count made there holds no value until the
    graph replays) or compiling. The cache keeps its schedules alive, so their ids are not reused."""
    if schedule is None or problem is None or torch.compiler.is_compiling():
        return None
    if problem.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        return None
    hit = _COUNT_CACHE.get(id(schedule))
    if hit is None or hit[0] is not schedule:
        hit = _COUNT_CACHE[id(schedule)] = (schedule, {})
        while len(_COUNT_CACHE) > 64:
            _COUNT_CACHE.popitem(last=False)
    return hit[1], (problem.batch, problem.heads)


def reduce_rows(kl_rows: torch.Tensor, lse1: torch.Tensor, reduction: str, problem=None, count=None, schedule=None):
    """The SPEC's reductions; `mean` divides by the rows whose side-1 support is non-empty
    (`count`: `mean_count`'s, computed here if not given)."""
    if reduction == "none":
        return kl_rows
    if reduction == "sum":
        return kl_rows.sum()
    count = mean_count(kl_rows, lse1, problem, schedule) if count is None else count
    if type(count) is int and count == kl_rows.numel():  # every row counts: one kernel
        return kl_rows.mean()
    return kl_rows.sum() / count


def rows_gradient(grad_out: torch.Tensor, shape, reduction: str, count) -> torch.Tensor:
    """The rows' upstream gradient of a reduced loss: grad_out (a scalar) spread over the rows,
    divided by the mean's count (as autograd would through `reduce_rows`; expanded, no copy)."""
    if reduction == "mean":
        grad_out = grad_out / count
    return grad_out.expand(shape)


# ------------------------------------------------------------------------------ eager fast path
class _EagerKL(torch.autograd.Function):
    """The same forward and backward as the custom ops, for eager calls: the front end's `Problem`
    and backend go straight to the backend, and the forward's tile schedule to the backward.

    This skips, per call, the ops' re-description of the problem from packed ints, the custom-op
    wrapper's Python dispatch layers (autograd wrapper, redispatch, alias checks, dynamo guard) and
    its per-call walk of the op schema in setup_context (`fill_defaults`), which alone cost more
    than the rest of the front end. Under torch.compile, tracing modes and functorch transforms
    the front end calls the custom ops instead (see `eager_fast_path`)."""

    @staticmethod
    def forward(ctx, q1, k1, q2, k2, problem, impl, reduction, plan=None):
        # plan: a `plans.CallPlan` of this call, whose launcher runs the forward unless it declines
        outputs = None if plan is None else plan.launch(q1, k1, q2, k2)
        if outputs is None:
            outputs, schedule = run_forward(problem, impl, q1, k1, q2, k2)
        else:
            schedule = plan.schedule
        kl_rows, lse1, lse2, expect = outputs
        ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, _expect_to_save(ctx, lse1, expect))
        ctx.problem, ctx.impl, ctx.schedule, ctx.plan = problem, impl, schedule, plan
        ctx.reduction, ctx.rows_shape = reduction, kl_rows.shape
        # the reduction inside the function: one autograd node for the whole loss (the engine ran
        # two or three more, each with its kernels, for the reduction's ops)
        ctx.count = 1
        if reduction == "mean":
            ctx.count = plan.count if plan is not None and plan.count is not None else \
                mean_count(kl_rows, lse1, problem, schedule)
        out = reduce_rows(kl_rows, lse1, reduction, problem, ctx.count)
        ctx.mark_non_differentiable(lse1, lse2, expect)
        ctx.set_materialize_grads(False)
        return out, lse1, lse2, expect

    @staticmethod
    def backward(ctx, grad_out, grad_lse1, grad_lse2, grad_expect):
        needs = ctx.needs_input_grad[:4]
        if grad_out is None or not any(needs):
            return (None,) * 8
        q1, k1, q2, k2, lse1, lse2, expect = ctx.saved_tensors
        problem, impl = ctx.problem, ctx.impl
        grad_rows = grad_out
        if ctx.reduction != "none":
            grad_rows = rows_gradient(grad_out, ctx.rows_shape, ctx.reduction, ctx.count)
        if torch.is_grad_enabled():
            # create_graph=True: the backward op, so that a double backward raises as it does on the
            # ops' path (no autograd formula for kl_backward) instead of silently missing terms
            cu_q, cu_k, mask1, mask2, ints, floats = pack_problem(problem)
            grads = torch.ops.streamkl.kl_backward(
                grad_rows, q1, k1, q2, k2, lse1, lse2, expect, cu_q, cu_k, mask1, mask2,
                ints, floats, impl.name, list(needs),
            )  # fmt: skip
        else:
            plan = ctx.plan  # its backward launcher once a backward of the plan took the full path
            grads = None if plan is None else plan.backward(q1, k1, q2, k2, lse1, lse2, expect, grad_rows)
            if grads is None:
                grads = run_backward(problem, impl, ctx.schedule, grad_rows, q1, k1, q2, k2, lse1, lse2, expect, needs)
                if plan is not None:
                    plan.learn_backward(needs)
        return tuple(g if need else None for g, need in zip(grads, needs)) + (None, None, None, None)


def eager_fast_path(tensors) -> bool:
    """True when `_EagerKL` may stand in for the custom ops: plain eager tensors, no tracing.

    Anything that needs the ops to be opaque (torch.compile / export, a dispatch mode such as
    FakeTensorMode, make_fx or FlopCounterMode, a functorch transform, a tensor subclass) takes the
    custom ops."""
    if torch.compiler.is_compiling() or torch._C._len_torch_dispatch_stack():
        return False
    if torch._C._functorch.peek_interpreter_stack() is not None:
        return False
    return all(type(t) is torch.Tensor or type(t) is torch.nn.Parameter for t in tensors)


def kl_forward(problem: Problem, impl: Backend, q1, k1, q2, k2, reduction: str = "none"):
    """(KL reduced by `reduction`, lse1, lse2) of a validated problem, differentiable in q1, k1,
    q2, k2 through whichever of the two paths applies."""
    if eager_fast_path((q1, k1, q2, k2)):
        if torch.is_grad_enabled() and (q1.requires_grad or k1.requires_grad or q2.requires_grad or k2.requires_grad):
            out, lse1, lse2, _ = _EagerKL.apply(q1, k1, q2, k2, problem, impl, reduction)
            return out, lse1, lse2
        (kl_rows, lse1, lse2, _), schedule = run_forward(problem, impl, q1, k1, q2, k2)
        return reduce_rows(kl_rows, lse1, reduction, problem, schedule=schedule), lse1, lse2
    cu_q, cu_k, pattern1, pattern2, ints, floats = pack_problem(problem)
    kl_rows, lse1, lse2, _ = torch.ops.streamkl.kl_forward(
        q1, k1, q2, k2, cu_q, cu_k, pattern1, pattern2, ints, floats, impl.name
    )
    return reduce_rows(kl_rows, lse1, reduction, problem), lse1, lse2
