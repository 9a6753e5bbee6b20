"""The portable forward kernel (tl.*, any NVIDIA GPU from Ampere on, and the CPU interpreter).

One program per (query tile, sequence * head) streams its scheduled key tiles once, keeping the
SPEC's five running statistics per row plus a flags word (uncovered, side-1 support): a
branch-free loop over the schedule's full tiles, then a masked loop over its partial ones (the
schedule's flags, no block-pattern loads). Keys through TMA descriptors at D <= 64 on Hopper.
With few query tiles against long key lists the lists are cut into slices (split-K) whose raw
statistics are merged exactly afterwards (`combine_splits`).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from streamkl.backends.base import finalize_rows, new_outputs, write_tail_rows
from streamkl.backends.triton.common import (
    LN2,
    LN2_K,
    _dot,
    _partial_allowed,
    _sequence_span,
    broadcast_strides,
    cdiv,
    check_tiles,
    dim_blocks,
    even_dims,
    group_sizes,
    head_strides,
    log2_scales,
    num_q_tiles,
    row_strides,
    stat_strides,
    varlen_args,
    window_bounds,
)
from streamkl.backends.triton.launch import Launcher, launcher
from streamkl.backends.triton.select import Forward, tma_inputs
from streamkl.problem import Problem
from streamkl.sparse.schedule import TileSchedule


@triton.jit
def _fwd_scores(
    b_q1, b_q2, p_k1, p_k2, k_tile, len_k, k_start, stride_k1n, stride_k2n, m_d1, m_d2,
    K1_DESC, K2_DESC, desc_row, desc_col1, desc_col2,
    BLOCK_K: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    USE_TMA: tl.constexpr,
):
    """The raw products q1 k1^T, q2 k2^T [BQ, BK] of one key tile (keys loaded transposed)."""
    o_j = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    o_keys = (k_start + o_j).to(tl.int64)
    p_kt1 = p_k1 + o_keys[None, :] * stride_k1n
    p_kt2 = p_k2 + o_keys[None, :] * stride_k2n
    if USE_TMA:
        # tensor-memory-accelerator loads of [BK, D] rows; rows past the tensor read as 0, rows of
        # the next sequence only on partial tiles, where the structural mask drops them
        b_k1 = tl.trans(K1_DESC.load([desc_row + k_tile * BLOCK_K, desc_col1]))
        b_k2 = tl.trans(K2_DESC.load([desc_row + k_tile * BLOCK_K, desc_col2]))
    elif MASKED:
        m_j = o_j < len_k
        b_k1 = tl.load(p_kt1, mask=m_d1[:, None] & m_j[None, :], other=0.0)  # [BD1, BK]
        b_k2 = tl.load(p_kt2, mask=m_d2[:, None] & m_j[None, :], other=0.0)  # [BD2, BK]
    elif EVEN_D:
        b_k1 = tl.load(p_kt1)
        b_k2 = tl.load(p_kt2)
    else:
        b_k1 = tl.load(p_kt1, mask=m_d1[:, None], other=0.0)
        b_k2 = tl.load(p_kt2, mask=m_d2[:, None], other=0.0)
    b_r1 = _dot(b_q1, b_k1, IEEE)  # [BQ, BK], raw products
    b_r2 = _dot(b_q2, b_k2, IEEE)
    return b_r1, b_r2


@triton.jit
def _fold_stats(b_r1, b_r2, scale1, scale2, b_m1, b_m2, b_l1, b_l2, b_acc):
    """The online statistics after one full tile, scales folded (`_fwd_step`'s FOLD)."""
    b_m1_new = tl.maximum(b_m1, tl.max(b_r1, axis=1) * scale1)
    b_m2_new = tl.maximum(b_m2, tl.max(b_r2, axis=1) * scale2)
    b_t1 = b_r1 * scale1 - b_m1_new[:, None]  # one FMA each
    b_t2 = b_r2 * scale2 - b_m2_new[:, None]
    b_e1 = tl.exp2(b_t1)
    b_alpha1 = tl.exp2(b_m1 - b_m1_new)
    b_sum1 = tl.sum(b_e1, axis=1)
    b_l1 = b_l1 * b_alpha1 + b_sum1
    b_acc = b_acc * b_alpha1 + (tl.sum(b_e1 * (b_t1 - b_t2), axis=1) + (b_m1_new - b_m2_new) * b_sum1)
    b_l2 = b_l2 * tl.exp2(b_m2 - b_m2_new) + tl.sum(tl.exp2(b_t2), axis=1)
    return b_m1_new, b_m2_new, b_l1, b_l2, b_acc


@triton.jit
def _fwd_step(
    b_q1, b_q2, p_k1, p_k2, k_tile, flags, o_i, len_q, len_k, k_start, window_left, window_right,
    stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
    b_m1, b_m2, b_l1, b_l2, b_acc, b_flags,
    K1_DESC, K2_DESC, desc_row, desc_col1, desc_col2,
    BLOCK_K: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    USE_TMA: tl.constexpr, FOLD: tl.constexpr,
):
    """One key tile of the online statistics. MASKED=False: a full tile (every key in range and
    allowed on both sides, every row in range): no masks, no -inf guards.

    FOLD (full tiles, positive scales): the scale is folded into each exponent's argument (one FMA
    per score instead of a multiply and a subtract), row maxima are taken on the raw products, and
    the side-1 expectation accumulates e1 * (t1 - t2) with t = s - m, plus (m1 - m2) * sum(e1) per
    row: the same sum of e1 * (s1 - s2), ~30 % fewer float32 operations per score. float32 inputs
    keep the direct s1 - s2 of every score, exact to its last bits when the distributions agree."""
    o_j = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    b_r1, b_r2 = _fwd_scores(
        b_q1, b_q2, p_k1, p_k2, k_tile, len_k, k_start, stride_k1n, stride_k2n, m_d1, m_d2,
        K1_DESC, K2_DESC, desc_row, desc_col1, desc_col2, BLOCK_K, MASKED, EVEN_D, IEEE, USE_TMA,
    )
    if MASKED:
        b_s1 = b_r1 * scale1  # log2 units
        b_s2 = b_r2 * scale2
        m_a1, m_a2 = _partial_allowed(flags, o_i, o_j, len_q, len_k, window_left, window_right)
        b_s1 = tl.where(m_a1, b_s1, float("-inf"))
        b_s2 = tl.where(m_a2, b_s2, float("-inf"))
        b_diff = tl.where(m_a1 & m_a2, b_s1 - b_s2, 0.0)
        # flags: bit 0 a key allowed on side 1 only (uncovered), bit 1 any key allowed on side 1
        b_flags = b_flags | tl.max((m_a1 & ~m_a2).to(tl.int32), axis=1) | (tl.max(m_a1.to(tl.int32), axis=1) * 2)
        b_m1_new = tl.maximum(b_m1, tl.max(b_s1, axis=1))
        b_m2_new = tl.maximum(b_m2, tl.max(b_s2, axis=1))
        # rows without any key yet keep max -inf: shift by 0 there so no inf - inf appears
        b_shift1 = tl.where(b_m1_new == float("-inf"), 0.0, b_m1_new)
        b_shift2 = tl.where(b_m2_new == float("-inf"), 0.0, b_m2_new)
    elif FOLD:
        b_m1_new, b_m2_new, b_l1, b_l2, b_acc = _fold_stats(b_r1, b_r2, scale1, scale2, b_m1, b_m2, b_l1, b_l2, b_acc)
    else:
        b_s1 = b_r1 * scale1
        b_s2 = b_r2 * scale2
        b_diff = b_s1 - b_s2
        b_m1_new = tl.maximum(b_m1, tl.max(b_s1, axis=1))
        b_m2_new = tl.maximum(b_m2, tl.max(b_s2, axis=1))
        b_shift1 = b_m1_new
        b_shift2 = b_m2_new
    if MASKED or not FOLD:
        b_alpha1 = tl.exp2(b_m1 - b_shift1)
        b_e1 = tl.exp2(b_s1 - b_shift1[:, None])  # [BQ, BK]
        b_l1 = b_l1 * b_alpha1 + tl.sum(b_e1, axis=1)
        b_acc = b_acc * b_alpha1 + tl.sum(b_e1 * b_diff, axis=1)
        b_l2 = b_l2 * tl.exp2(b_m2 - b_shift2) + tl.sum(tl.exp2(b_s2 - b_shift2[:, None]), axis=1)
    return b_m1_new, b_m2_new, b_l1, b_l2, b_acc, b_flags


@triton.jit
def _kl_fwd_kernel(
    Q1, K1, Q2, K2,
    KL, LSE1, LSE2, EXPECT,
    PARTS,  # split-K only: raw statistics [6, splits, *lse shape], laid out like lse per (stat, split)
    CU_Q, CU_K,
    KV_COUNT, KV_FULL, KV_INDEX, KV_FLAGS,
    K1_DESC, K2_DESC,  # tensor descriptors of the keys as 2-D [tokens, heads * dim] (USE_TMA only)
    stride_q1b, stride_q1n, stride_q1h,
    stride_k1b, stride_k1n, stride_k1h,
    stride_q2b, stride_q2n, stride_q2h,
    stride_k2b, stride_k2n, stride_k2h,
    stride_klb, stride_kln, stride_klh,
    stride_sb, stride_sh, stride_sn,
    stride_cs, stride_ch, stride_ct,
    stride_is, stride_ih, stride_it,
    seqlen_q, seqlen_k, heads, group1, group2,
    scale1, scale2,  # scale * log2(e)
    window_left, window_right,
    dim1, dim2,
    q_programs, visits_per_split, stride_part_stat, stride_part_split,
    SUB_TILES: tl.constexpr,  # programs per schedule query tile
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    USE_VARLEN: tl.constexpr, DENSE_KEYS: tl.constexpr, EVEN_D: tl.constexpr,
    IEEE: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
    FOLD: tl.constexpr,
):
    # one flat grid axis, query tiles fastest (no 65535 limit on sequences x heads); last query
    # tiles first: under causality they visit the most key tiles (less tail at the end)
    pid_bh = tl.program_id(0) // q_programs
    pid_q = q_programs - 1 - (tl.program_id(0) - pid_bh * q_programs)
    seq = pid_bh // heads
    head = pid_bh % heads
    tile = pid_q // SUB_TILES  # the schedule's query tile
    q_start, len_q, k_start, len_k = _sequence_span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, USE_VARLEN)
    seq64 = seq.to(tl.int64)

    o_i = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)  # sequence-local query rows
    m_i = o_i < len_q
    o_d1 = tl.arange(0, BLOCK_D1)
    o_d2 = tl.arange(0, BLOCK_D2)
    m_d1 = o_d1 < dim1
    m_d2 = o_d2 < dim2
    o_rows = (q_start + o_i).to(tl.int64)

    p_q1 = Q1 + seq64 * stride_q1b + head * stride_q1h + o_rows[:, None] * stride_q1n + o_d1[None, :]
    p_q2 = Q2 + seq64 * stride_q2b + head * stride_q2h + o_rows[:, None] * stride_q2n + o_d2[None, :]
    b_q1 = tl.load(p_q1, mask=m_i[:, None] & m_d1[None, :], other=0.0)  # [BQ, BD1]
    b_q2 = tl.load(p_q2, mask=m_i[:, None] & m_d2[None, :], other=0.0)  # [BQ, BD2]

    # key heads of this query head, per side (GQA); key tiles are loaded transposed
    p_k1 = K1 + seq64 * stride_k1b + (head // group1) * stride_k1h + o_d1[:, None]
    p_k2 = K2 + seq64 * stride_k2b + (head // group2) * stride_k2h + o_d2[:, None]
    o_count = seq * stride_cs + head * stride_ch + tile * stride_ct
    p_index = KV_INDEX + seq * stride_is + head * stride_ih + tile * stride_it
    p_flags = KV_FLAGS + seq * stride_is + head * stride_ih + tile * stride_it

    b_m1 = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    b_m2 = tl.full([BLOCK_Q], float("-inf"), tl.float32)
    b_l1 = tl.zeros([BLOCK_Q], tl.float32)
    b_l2 = tl.zeros([BLOCK_Q], tl.float32)
    b_acc = tl.zeros([BLOCK_Q], tl.float32)
    b_flags = tl.zeros([BLOCK_Q], tl.int32)  # bit 0: uncovered, bit 1: a side-1 key allowed (structure)
    desc_row = k_start if USE_VARLEN else seq * seqlen_k  # first key row of this sequence
    desc_col1 = (head // group1) * dim1
    desc_col2 = (head // group2) * dim2

    n_visit = tl.load(KV_COUNT + o_count)
    n_full = tl.load(KV_FULL + o_count)
    lo = 0
    hi = n_visit
    if SPLIT:  # this program streams one slice of the key-tile list; a combine step merges slices
        lo = tl.program_id(1) * visits_per_split
        hi = tl.minimum(n_visit, lo + visits_per_split)
    # the full tiles (listed first): no masks; without block masks they are consecutive key tiles
    k_first = 0
    if DENSE_KEYS:
        k_first = tl.load(p_index)
    for visit in range(lo, tl.minimum(n_full, hi)):
        if DENSE_KEYS:
            k_tile = k_first + visit
        else:
            k_tile = tl.load(p_index + visit)
        b_m1, b_m2, b_l1, b_l2, b_acc, b_flags = _fwd_step(
            b_q1, b_q2, p_k1, p_k2, k_tile, 0, o_i, len_q, len_k, k_start, window_left, window_right,
            stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
            b_m1, b_m2, b_l1, b_l2, b_acc, b_flags, K1_DESC, K2_DESC, desc_row, desc_col1, desc_col2,
            BLOCK_K=BLOCK_K, MASKED=False, EVEN_D=EVEN_D, IEEE=IEEE, USE_TMA=USE_TMA,
            FOLD=FOLD,
        )
    # a full tile allows every key to every row on both sides
    b_flags = b_flags | tl.where(tl.minimum(n_full, hi) > lo, 2, 0)
    # then the partial tiles, masked as their flags say
    for visit in range(tl.maximum(n_full, lo), hi):
        k_tile = tl.load(p_index + visit)
        flags = tl.load(p_flags + visit).to(tl.int32)
        b_m1, b_m2, b_l1, b_l2, b_acc, b_flags = _fwd_step(
            b_q1, b_q2, p_k1, p_k2, k_tile, flags, o_i, len_q, len_k, k_start, window_left, window_right,
            stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
            b_m1, b_m2, b_l1, b_l2, b_acc, b_flags, K1_DESC, K2_DESC, desc_row, desc_col1, desc_col2,
            BLOCK_K=BLOCK_K, MASKED=True, EVEN_D=EVEN_D, IEEE=IEEE, USE_TMA=USE_TMA,
            FOLD=FOLD,
        )

    o_stat = seq64 * stride_sb + head * stride_sh + o_rows * stride_sn
    if SPLIT:
        p_parts = PARTS + tl.program_id(1) * stride_part_split + o_stat
        tl.store(p_parts, b_m1, mask=m_i)
        tl.store(p_parts + stride_part_stat, b_l1, mask=m_i)
        tl.store(p_parts + 2 * stride_part_stat, b_m2, mask=m_i)
        tl.store(p_parts + 3 * stride_part_stat, b_l2, mask=m_i)
        tl.store(p_parts + 4 * stride_part_stat, b_acc, mask=m_i)
        tl.store(p_parts + 5 * stride_part_stat, b_flags.to(tl.float32), mask=m_i)
    else:
        # finalize (SPEC 4), back to natural logs; large terms cancelled first: m1 - m2, log l1 - log l2.
        # Empty and uncovered rows by structure; l == 0 on a row that is neither: its allowed
        # scores are all -inf by value (an infinite input), and it reads NaN (E too), as softmax does
        m_empty1 = (b_flags & 2) == 0
        b_lse1 = (b_m1 + tl.log2(b_l1)) * LN2_K
        b_lse2 = (b_m2 + tl.log2(b_l2)) * LN2_K
        b_expect = tl.where(m_empty1, 0.0, b_acc / tl.where(m_empty1, 1.0, b_l1)) * LN2_K
        b_kl = b_expect - ((b_m1 - b_m2) + tl.log2(b_l1) - tl.log2(b_l2)) * LN2_K
        b_kl = tl.where((b_l1 == 0.0) | (b_l2 == 0.0), float("nan"), b_kl)
        b_kl = tl.where((b_flags & 1) != 0, float("inf"), b_kl)  # E stays finite: the backward needs it
        b_kl = tl.where(m_empty1, 0.0, b_kl)

        tl.store(KL + seq64 * stride_klb + o_rows * stride_kln + head * stride_klh, b_kl, mask=m_i)
        tl.store(LSE1 + o_stat, b_lse1, mask=m_i)
        tl.store(LSE2 + o_stat, b_lse2, mask=m_i)
        tl.store(EXPECT + o_stat, b_expect, mask=m_i)


class Plan(NamedTuple):
    """What the forward's launch takes that the call's tensors do not change."""

    grid: tuple
    tables: tuple  # cu_seqlens (or placeholders) and the schedule's four lists
    scalars: tuple  # every argument after the inputs' head strides
    constexprs: dict  # keys by pointers
    run: Launcher  # keys by pointers
    run_tma: Launcher  # keys through TMA descriptors


def plan(problem: Problem, choice: Forward, schedule: TileSchedule) -> Plan:
    varlen = problem.is_varlen
    block_q, block_k = schedule.block_q, schedule.block_k
    check_tiles(problem, block_q, block_k)
    sub_tiles = block_q // choice.rows
    block_d1, block_d2 = dim_blocks(problem)
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    left, right = window_bounds(problem)
    cu_q, cu_k = varlen_args(problem, schedule.kv_count)
    q_programs = num_q_tiles(problem, block_q) * sub_tiles
    grid = (q_programs * problem.batch * problem.heads,)
    visits_per_split = cdiv(schedule.num_k_tiles, choice.splits)
    part_strides = (0, 0)
    if choice.splits > 1:
        grid = (*grid, choice.splits)
        part_strides = torch.empty((6, choice.splits, *problem.lse_shape), device="meta").stride()[:2]
    kl_rows = torch.empty(problem.row_shape, device="meta")  # the outputs' strides (new_outputs)
    lse = torch.empty(problem.lse_shape, device="meta")
    scalars = (
        *row_strides(kl_rows, varlen), *stat_strides(lse, varlen),
        *broadcast_strides(schedule.kv_count), *broadcast_strides(schedule.kv_index)[:3],
        problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2,
        scale1, scale2, left, right, problem.dim1, problem.dim2,
        q_programs, visits_per_split, *part_strides,
    )  # fmt: skip
    constexprs = dict(
        SUB_TILES=sub_tiles, BLOCK_Q=choice.rows, BLOCK_K=block_k, BLOCK_D1=block_d1, BLOCK_D2=block_d2,
        USE_VARLEN=varlen, DENSE_KEYS=problem.mask1 is None and problem.mask2 is None,
        EVEN_D=even_dims(problem), IEEE=problem.dtype == torch.float32, SPLIT=choice.splits > 1,
        USE_TMA=False, FOLD=choice.fold,
    )
    tables = (cu_q, cu_k, schedule.kv_count, schedule.kv_full, schedule.kv_index, schedule.kv_partial)
    run = launcher(_kl_fwd_kernel, choice.num_warps, choice.num_stages, **constexprs)
    run_tma = launcher(_kl_fwd_kernel, choice.num_warps, choice.num_stages, **dict(constexprs, USE_TMA=True))
    return Plan(grid, tables, scalars, constexprs, run, run_tma)


def key_descriptors(problem: Problem, k1: torch.Tensor, k2: torch.Tensor, block_k: int):
    """TMA descriptors of both key tensors as 2-D [tokens, heads * dim], or None where these keys
    do not fit them (not contiguous or aligned, a box taller than the tensor)."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    if not tma_inputs(k1, k2):
        return None
    descs = []
    for k, dim in ((k1, problem.dim1), (k2, problem.dim2)):
        width = k.shape[-2] * dim
        if (width * k.element_size()) % 16 or k.numel() < block_k * width:
            return None
        descs.append(TensorDescriptor(k, [k.numel() // width, width], [width, 1], [block_k, dim]))
    return descs


def kl_forward(problem: Problem, choice: Forward, launch_plan: Plan, q1, k1, q2, k2):
    """(kl_rows, lse1, lse2, expect) as backends/base.py documents."""
    varlen = problem.is_varlen
    kl_rows, lse1, lse2, expect = new_outputs(problem)
    # every row of a sequence is written by its program; varlen rows past cu_seqlens[-1] are not
    write_tail_rows(problem, kl_rows, lse1, lse2, expect)
    if kl_rows.numel() == 0:
        return kl_rows, lse1, lse2, expect
    block_k = launch_plan.constexprs["BLOCK_K"]
    descs = key_descriptors(problem, k1, k2, block_k) if choice.tma_keys else None
    parts = lse1  # a placeholder unless split
    if choice.splits > 1:
        parts = torch.empty((6, choice.splits, *problem.lse_shape), dtype=torch.float32, device=lse1.device)
    args = (
        q1, k1, q2, k2, kl_rows, lse1, lse2, expect, parts, *launch_plan.tables, *(descs or (k1, k2)),
        *head_strides(q1, varlen), *head_strides(k1, varlen), *head_strides(q2, varlen), *head_strides(k2, varlen),
        *launch_plan.scalars,
    )
    (launch_plan.run if descs is None else launch_plan.run_tma)(launch_plan.grid, *args)
    if choice.splits > 1:
        combine_splits(problem, parts, kl_rows, lse1, lse2, expect)
        write_tail_rows(problem, kl_rows, lse1, lse2, expect)  # the combine wrote the tail rows too
    return kl_rows, lse1, lse2, expect


def combine_splits(problem: Problem, parts: torch.Tensor, kl_rows, lse1, lse2, expect) -> None:
    """Merge the slices' raw statistics exactly (online-softmax rescaling, log2 units), finalize
    with the SPEC's edge rules and write the outputs in place. Torch ops on the device, no sync."""
    m1, l1, m2, l2, acc, flags = parts.unbind(0)  # each [splits, *lse shape]
    top1, top2 = m1.amax(0), m2.amax(0)
    shift1 = torch.where(top1 == float("-inf"), 0.0, top1)
    shift2 = torch.where(top2 == float("-inf"), 0.0, top2)
    weight1 = torch.exp2(m1 - shift1)  # a slice without keys (max -inf) weighs 0
    l1 = (l1 * weight1).sum(0)
    acc = (acc * weight1).sum(0)
    l2 = (l2 * torch.exp2(m2 - shift2)).sum(0)
    flags = flags.to(torch.int32)
    uncovered = (flags & 1).amax(0) != 0
    empty1 = (flags & 2).amax(0) == 0  # no key allowed on side 1 in any slice (structure)
    # back to natural logs: maxima and the expectation's sum scale by ln 2, the sums l do not
    kl, row_lse1, row_lse2, row_e = finalize_rows(top1 * LN2, l1, top2 * LN2, l2, acc * LN2, uncovered, empty1)
    lse1.copy_(row_lse1)
    lse2.copy_(row_lse2)
    expect.copy_(row_e)
    kl_rows.copy_(kl.transpose(0, 1) if problem.is_varlen else kl.transpose(1, 2))
