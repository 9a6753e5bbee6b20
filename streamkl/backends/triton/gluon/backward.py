"""The Gluon backward's host side: the launch plan (grid, constexprs, scalar arguments), the float32
dq accumulators in head chunks, and the flush of each chunk into the 16-bit gradients. The kernel
is backward_kernel.py; `select.py` decides where it serves."""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from triton.experimental.gluon import language as gl

from streamkl._cache import LRUCache
from streamkl.backends.triton.backward import rescaled_upstream
from streamkl.backends.triton.common import (
    LN2,
    broadcast_strides,
    cdiv,
    group_sizes,
    listed,
    log2_scales,
    row_strides,
    stat_strides,
    window_bounds,
)
from streamkl.backends.triton.gluon.backward_kernel import _kl_bwd_gluon_kernel
from streamkl.backends.triton.gluon.common import flat_descriptor, gl_dtype
from streamkl.backends.triton.launch import Bound, launcher
from streamkl.backends.triton.select import key_major, tile_fit
from streamkl.problem import Problem
from streamkl.sparse.schedule import get_key_schedule, heaviest_first

BLOCK_N = 128  # keys a program: two consumer warpgroups of 64
BLOCK_M = 64  # query rows a step


@functools.lru_cache(maxsize=4)
def ds_shared_layout(dtype: torch.dtype):
    """The shared layout of a step's dS tile, [64 rows, 128 keys]."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl_dtype(dtype))


@functools.lru_cache(maxsize=4)
def dq_layout(cols: int = 64):
    """The shared layout of a [64, cols] float32 dq tile."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, cols], gl.float32)


def constexprs(problem: Problem, both: bool, g_one: bool, unscaled: bool, programs: int) -> dict:
    """The kernel's variant for this problem (backward_kernel.py's module docstring says what each
    does; the choices were measured on the H200: each where it was faster)."""
    dim = problem.dim2
    is_listed = listed(problem)
    tail = not is_listed and tile_fit(problem) == "tail"
    gqa2 = group_sizes(problem)[1] > 1
    student = not both
    diag = problem.causal and not is_listed and not tail and not gqa2
    # D=64 student: the consumer warpgroups split the query tiles (causal: not with tails or GQA)
    split_rows = student and dim == 64 and not is_listed and (not problem.causal or not (tail or gqa2))
    if both:
        stages = 2  # the second dS^T pair takes a third slot's room
    elif split_rows:
        stages = 6 if problem.causal else 4
    else:
        stages = 3 if dim > 64 else 4
    key_first = key_major(problem, programs)
    return dict(
        D=dim, BLOCK_M=BLOCK_M, STAGES=stages, CAUSAL=problem.causal, DS_LAYOUT=ds_shared_layout(problem.dtype),
        LISTED=is_listed, NORM_G=not unscaled, VARLEN=problem.is_varlen, TAIL=tail, GQA2=gqa2,
        DQ_LAYOUT=dq_layout(64), KEY_MAJOR=key_first, BOTH=both, DIAG=diag, ORDERED=is_listed and not key_first,
        AHEAD=student, ROT=both and diag, LSPLIT=is_listed and student,
        EARLY_P=student and dim == 64 and not problem.causal and not is_listed,
        DK_DEFER=student and dim == 64, G_ONE=g_one, DQ_RAW=student, SPLIT_ROWS=split_rows,
    )


class Plan(NamedTuple):
    grid: tuple
    run: Bound  # the kernel with every argument after the call's tensors fixed
    flush_grid: tuple
    flush: Bound  # _flush_dq_kernel with the chunk's sizes and the dq scale fixed


def plan(problem: Problem, lse1, grad_rows, dq2, dk2, schedule, unscaled: bool, head_lo: int, heads: int,
         both: bool, g_one: bool) -> Plan:
    """One launch over `heads` query heads from `head_lo` (`dq2`: their float32 accumulator). Block
    masks or a window: `schedule` (128 x 128 tiles) walked through its key-major view."""
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    k_programs = cdiv(problem.seqlen_k, BLOCK_N)
    varlen = problem.is_varlen
    cu_q, cu_k = (problem.cu_seqlens_q, problem.cu_seqlens_k) if varlen else (None, None)
    is_listed = listed(problem)
    if is_listed:
        assert schedule is not None and (schedule.block_q, schedule.block_k) == (128, BLOCK_N)
        keys = get_key_schedule(schedule)
        lists = (keys.q_count, keys.q_full, keys.q_index, keys.q_partial)
        list_strides = (*broadcast_strides(keys.q_count), *broadcast_strides(keys.q_index)[:3])
        window = window_bounds(problem)
    else:
        lists, list_strides, window = (None,) * 4, (0,) * 6, (-1, -1)
    programs = k_programs * problem.batch * (heads // group2)
    kinds = constexprs(problem, both, g_one, unscaled, programs)
    order = None
    if kinds["ORDERED"]:  # each head's busiest key tiles first
        order = heaviest_first(keys.q_count, problem.batch, head_lo, heads // group2, group2, k_programs)
    fixed = (
        cu_q, cu_k, *lists, order,
        *stat_strides(lse1, varlen), *row_strides(grad_rows, varlen), *row_strides(dq2, varlen),
        *row_strides(dk2, varlen),
        *list_strides, *window,
        problem.seqlen_q, problem.seqlen_k, heads // group2, head_lo, group1, group2,
        scale1, scale2, scale2 * LN2, scale1 * LN2, k_programs,
    )  # fmt: skip
    unused = torch.empty(1, dtype=torch.float32, device=problem.device)  # the pointers no branch reads
    fixed = tuple(unused if t is None else t for t in fixed)
    flush_grid, flush = flush_plan(problem, head_lo, heads, both, scaled=not both,
                                   scale_ptr=not both and (g_one or not unscaled))
    return Plan((programs,), launcher(_kl_bwd_gluon_kernel, 4, None, **kinds).bind(fixed), flush_grid, flush)


def call_args(q1, k1, q2, k2, lse1, lse2, grad_rows, dq2, dk2, g_scale=None, both=None) -> tuple:
    """The launch's leading arguments, those each call's tensors make: the inputs' descriptors, the
    statistics, g, the accumulators and gradients (and their descriptors), g's scale."""
    descs = [flat_descriptor(t, box) for t, box in ((q1, BLOCK_M), (k1, BLOCK_N), (q2, BLOCK_M), (k2, BLOCK_N))]
    return (
        *descs, lse1, lse2, grad_rows, dq2, dk2, flat_descriptor(dq2, BLOCK_M, dq_layout(64)),
        *((both[0], both[1], flat_descriptor(both[2], BLOCK_M, dq_layout(64))) if both is not None
          else (dk2, lse1, descs[0])),
        lse1 if g_scale is None else g_scale,
    )  # fmt: skip


def g_layout(problem: Problem, grad_rows: torch.Tensor, lse1: torch.Tensor, both: bool):
    """(g, g_scale, g_one): the upstream gradient as the kernel reads it. A reduced loss's g (one
    value expanded over the rows, strides 0) is read as it is (unscaled: that one value, G_ONE);
    any other g head-major, so that each thread's rows are one base's immediate offsets."""
    g, g_scale = rescaled_upstream(problem, grad_rows, lse1)
    uniform = not any(g.stride())
    g_one = uniform and g_scale is None
    if not (uniform and (both or g_one)):
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    return g, g_scale, g_one


@triton.jit
def _flush_dq_kernel(A1, A2, O1, O2, SCALE_T, rows, width, stride_or, col0, scale,
                     TWO: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr, SCALED: tl.constexpr,
                     SCALE_PTR: tl.constexpr):
    """One or two float32 dq accumulators [rows, width] (contiguous) into their heads' columns of the
    16-bit gradients [rows, stride_or] from column col0; SCALED: the first times `scale` (and with
    SCALE_PTR times the value at SCALE_T)."""
    o_r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    o_c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    m = (o_r < rows)[:, None] & (o_c < width)[None, :]
    o_a = o_r.to(tl.int64)[:, None] * width + o_c[None, :]
    o_o = o_r.to(tl.int64)[:, None] * stride_or + col0 + o_c[None, :]
    x = tl.load(A1 + o_a, mask=m, other=0.0)
    if SCALED:
        if SCALE_PTR:
            scale = scale * tl.load(SCALE_T)
        x = x * scale
    tl.store(O1 + o_o, x.to(O1.dtype.element_ty), mask=m)
    if TWO:
        y = tl.load(A2 + o_a, mask=m, other=0.0)
        tl.store(O2 + o_o, y.to(O2.dtype.element_ty), mask=m)


def flush_plan(problem: Problem, head_lo: int, heads: int, two: bool, scaled: bool, scale_ptr: bool):
    """(grid, bound kernel) writing one or two float32 dq accumulators [..., heads, D] (contiguous)
    into the 16-bit gradients' heads from `head_lo` [..., H, D] (contiguous) in one launch, a
    chunk's `out[..., lo:hi, :].copy_(a)` for each; `scaled`: the first one times the softmax
    scale (log2 scale x LN2) and, with `scale_ptr`, times the value its SCALE_T argument points
    at. Launched as `bound.planned(grid, a1, a2, o1, o2, scale_t)`. The caller zeroes the
    accumulators: a read-then-write of the same addresses in one program would need one layout
    for both, which Triton does not promise."""
    assert not (scaled and two) and (not two or problem.dim1 == problem.dim2)
    dim = problem.dim2
    width = heads * dim
    rows = problem.total_q if problem.is_varlen else problem.batch * problem.seqlen_q
    scale = log2_scales(problem)[1] * LN2 if scaled else 1.0
    run = launcher(_flush_dq_kernel, 4, None, TWO=two, BLOCK_R=16, BLOCK_C=256, SCALED=scaled,
                   SCALE_PTR=scale_ptr).bind((rows, width, problem.heads * dim, head_lo * dim, scale))
    return (max(cdiv(rows, 16), 1), cdiv(width, 256)), run


_PLANS = LRUCache(64)


def kl_backward(problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, both: bool,
                chunks: int):
    """(dq1, dk1, dq2, dk2): the student's gradients (dq1, dk1 None), or with `both` all four. The
    float32 dq accumulators hold one chunk of the heads at a time (`select._chunks`), so the extra
    memory stays under the size of the gradients returned."""
    # packed keys past cu_seqlens_k[-1] belong to no sequence: their gradient is 0, not written
    dk2 = torch.zeros_like(k2) if problem.is_varlen else torch.empty_like(k2)
    dk1 = (torch.zeros_like(k1) if problem.is_varlen else torch.empty_like(k1)) if both else None
    g, g_scale, g_one = g_layout(problem, grad_rows, lse1, both)
    per_chunk = problem.heads // chunks
    shape = (*q2.shape[:-2], per_chunk, q2.shape[-1])
    # the float32 accumulators (with both: dq2's and dq1's in one allocation, one zero fill)
    pair = torch.zeros((2 if both else 1, *shape), dtype=torch.float32, device=q2.device)
    accums = pair.unbind(0)
    accum2 = accums[0]
    accum1 = accums[1] if both else None
    dq2 = torch.empty_like(q2)
    dq1 = torch.empty_like(q1) if both else None
    # what fixes the launches' specialization besides the problem (`Bound.planned`): g's layout and
    # alignment, the statistics' strides and alignment (the other tensors are new or checked)
    aligned = g.data_ptr() % 16 == 0 and lse1.data_ptr() % 16 == 0 and lse2.data_ptr() % 16 == 0 and (
        expect.data_ptr() % 16 == 0)
    variant = (both, g.stride(), aligned, lse1.stride(), lse2.stride(), g_scale is None, g_one, chunks)
    memo = problem.memo.get("gluon.backward")  # this problem's last plans: no hashing of its key
    if memo is not None and memo[0] == variant:
        plans = memo[1]
    else:
        plans = _PLANS.get_or_make((problem.key, *variant), lambda: (problem, [
            plan(problem, lse1, g, accum2, dk2, schedule, g_scale is None, chunk * per_chunk, per_chunk, both, g_one)
            for chunk in range(chunks)]))[1]
        problem.memo["gluon.backward"] = (variant, plans)
    # every chunk: the same tensors (the accumulators flushed and zeroed between them)
    args = call_args(q1, k1, q2, k2, lse1, lse2, g, accum2, dk2, g_scale, (dk1, expect, accum1) if both else None)
    # the flush's tensors: the accumulators, the new (contiguous) gradients, the student's factor (its
    # dq2 is added unscaled: the flush scales it by the softmax scale and g's one value or scale)
    if both:
        flush_args = (accum2, accum1, dq2, dq1, accum2)
    else:
        factor = g if g_one else g_scale
        flush_args = (accum2, accum2, dq2, dq2, accum2 if factor is None else factor)
    for chunk, launch_plan in enumerate(plans):
        launch_plan.run.planned(launch_plan.grid, *args)
        launch_plan.flush.planned(launch_plan.flush_grid, *flush_args)
        if chunk + 1 < chunks:
            pair.zero_()
    return dq1, dk1, dq2, dk2


def compile_for_hopper(dtype=torch.bfloat16, dim: int = 128, causal: bool = False, listed: bool = False,
                       varlen: bool = False, tail: bool = False, gqa2: bool = False, both: bool = False,
                       g_one: bool = False):
    """The backward compiled for sm_90a without a GPU (`common.compile_sm90`), with the variant
    `constexprs` would choose for a problem of this description."""
    from streamkl.backends.triton.gluon.common import compile_sm90

    t = torch.empty(2, BLOCK_N, 4, dim, dtype=dtype)
    accum = torch.empty(2, BLOCK_N, 4, dim)
    descs = [flat_descriptor(t, rows) for rows in (BLOCK_M, BLOCK_N, BLOCK_M, BLOCK_N)]
    stats = torch.empty(4, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32)
    examples = dict(zip(("q1_desc", "k1_desc", "q2_desc", "k2_desc"), descs))
    examples.update(LSE1=stats, LSE2=stats, GRAD=stats, DQ2=stats, DK2=t, dq_desc=flat_descriptor(accum, BLOCK_M,
                    dq_layout(64)), DK1=t, EXPECT=stats, dq1_desc=flat_descriptor(accum, BLOCK_M, dq_layout(64)),
                    G_SCALE=stats, CU_Q=cu, CU_K=cu, Q_COUNT=cu, Q_FULL=cu, Q_INDEX=cu,
                    Q_FLAGS=torch.zeros(3, dtype=torch.int8), ORDER=cu)
    for name in ("stride_sb", "stride_sh", "stride_gb", "stride_gh", "stride_dqb", "stride_dqn", "stride_dqh",
                 "stride_dkb", "stride_dkn", "stride_dkh", "seqlen_q", "seqlen_k", "heads", "head_lo", "group1",
                 "group2", "k_programs"):
        examples[name] = 1024
    for name in ("stride_cs", "stride_ch", "stride_ct", "stride_is", "stride_ih", "stride_it", "window_left",
                 "window_right"):
        examples[name] = 7
    examples.update(stride_sn=1, stride_gn=1, scale1=0.5, scale2=0.5, out_scale2=0.5, out_scale1=0.5)
    student = not both
    diag = causal and not listed and not tail and not gqa2
    split_rows = student and dim == 64 and not listed and (not causal or not (tail or gqa2))
    stages = 2 if both else (6 if causal else 4) if split_rows else (3 if dim > 64 else 4)
    kinds = dict(
        D=dim, BLOCK_M=BLOCK_M, STAGES=stages, CAUSAL=causal, DS_LAYOUT=ds_shared_layout(dtype), LISTED=listed,
        NORM_G=dtype == torch.float16, VARLEN=varlen, TAIL=tail, GQA2=gqa2, DQ_LAYOUT=dq_layout(64),
        KEY_MAJOR=False, BOTH=both, DIAG=diag, ORDERED=listed, AHEAD=student, ROT=both and diag,
        LSPLIT=listed and student, EARLY_P=student and dim == 64 and not causal and not listed,
        DK_DEFER=student and dim == 64, G_ONE=g_one and dtype != torch.float16, DQ_RAW=student,
        SPLIT_ROWS=split_rows,
    )
    return compile_sm90(_kl_bwd_gluon_kernel, examples, kinds)
