"""The backward: scores recomputed tile by tile from the saved (lse1, lse2, E), in two kernels
that own disjoint outputs, so no atomics and bitwise-reproducible gradients by construction:

- `_kl_bwd_dq_kernel`, query-major over the TileSchedule: dq1, dq2 of one query tile;
- `_kl_bwd_dk_kernel`, key-major over the transposed schedule: dk1, dk2 of one key tile, summed
  over the query heads that share the key head (GQA) inside the program.

With d = s1 - s2 (0 off side 1's support), p = exp(s1 - lse1), q = exp(s2 - lse2) and the row's
upstream gradient g:  dS1 = g * p * (d - E),  dS2 = g * (q - p);  dq = scale * dS @ k,
dk = scale * dS^T @ q. Only the requested gradients are computed: a side that needs none costs only
its score recomputation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamkl.backends.triton.common import (
    LN2_K,
    LOG2E_K,
    _dot,
    _side_allowed,
    _structural_allowed,
    broadcast_strides,
    dim_blocks,
    group_sizes,
    head_strides,
    interpreting,
    launch,
    log2_scales,
    mask_args,
    num_k_tiles,
    num_q_tiles,
    pipeline_stages,
    row_strides,
    stat_strides,
    varlen_args,
    window_bounds,
)
from streamkl.problem import Problem
from streamkl.sparse.schedule import TileSchedule, get_key_schedule


@triton.jit
def _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat, o_grad, m_i):
    """Per-row (lse1, lse2) in log2 units, E and g, made safe for the tile formulas."""
    b_lse1 = tl.load(LSE1 + o_stat, mask=m_i, other=float("-inf"))
    b_lse2 = tl.load(LSE2 + o_stat, mask=m_i, other=float("-inf"))
    b_e = tl.load(EXPECT + o_stat, mask=m_i, other=0.0)
    b_g = tl.load(GRAD + o_grad, mask=m_i, other=0.0)
    # an empty row's lse is -inf: +inf makes its p = exp2(s - lse) exactly 0
    b_lse1 = tl.where(b_lse1 == float("-inf"), float("inf"), b_lse1 * LOG2E_K)
    b_lse2 = tl.where(b_lse2 == float("-inf"), float("inf"), b_lse2 * LOG2E_K)
    return b_lse1, b_lse2, b_e, b_g


@triton.jit
def _tile_dscores(
    b_s1, b_s2, partial, o_i, o_j, len_q, len_k, window_left, window_right,
    p_mask1, stride_m1q, stride_m1k, mask1_block_q, mask1_block_k,
    p_mask2, stride_m2q, stride_m2k, mask2_block_q, mask2_block_k,
    b_lse1, b_lse2, b_e, b_g,
    HAS_MASK1: tl.constexpr, HAS_MASK2: tl.constexpr,
):
    """(dS1, dS2) [BQ, BK] of one tile from its log2-unit scores; element masks on partial tiles.

    d and E run over keys allowed on both sides; an uncovered row's infinite part is a constant,
    and dS2 is kept to side 2's support."""
    if partial != 0:
        m_struct = _structural_allowed(o_i, o_j, len_q, len_k, window_left, window_right)
        m_a1 = _side_allowed(m_struct, o_i, o_j, p_mask1, stride_m1q, stride_m1k, mask1_block_q, mask1_block_k,
                             HAS_MASK1)
        m_a2 = _side_allowed(m_struct, o_i, o_j, p_mask2, stride_m2q, stride_m2k, mask2_block_q, mask2_block_k,
                             HAS_MASK2)
        b_s1 = tl.where(m_a1, b_s1, float("-inf"))
        b_s2 = tl.where(m_a2, b_s2, float("-inf"))
        b_diff = tl.where(m_a1 & m_a2, b_s1 - b_s2, 0.0)
        b_p = tl.exp2(b_s1 - b_lse1[:, None])  # [BQ, BK]
        b_ds1 = b_g[:, None] * b_p * (b_diff * LN2_K - b_e[:, None])
        b_ds2 = tl.where(m_a2, b_g[:, None] * (tl.exp2(b_s2 - b_lse2[:, None]) - b_p), 0.0)
    else:
        b_p = tl.exp2(b_s1 - b_lse1[:, None])  # [BQ, BK]
        b_ds1 = b_g[:, None] * b_p * ((b_s1 - b_s2) * LN2_K - b_e[:, None])
        b_ds2 = b_g[:, None] * (tl.exp2(b_s2 - b_lse2[:, None]) - b_p)
    return b_ds1, b_ds2


@triton.jit
def _kl_bwd_dq_kernel(
    Q1, K1, Q2, K2,
    LSE1, LSE2, EXPECT, GRAD,
    DQ1, DQ2,
    CU_Q, CU_K,
    KV_COUNT, KV_INDEX, KV_PARTIAL,
    MASK1, MASK2,
    stride_q1b, stride_q1n, stride_q1h,
    stride_k1b, stride_k1n, stride_k1h,
    stride_q2b, stride_q2n, stride_q2h,
    stride_k2b, stride_k2n, stride_k2h,
    stride_gb, stride_gn, stride_gh,
    stride_sb, stride_sh, stride_sn,
    stride_d1b, stride_d1n, stride_d1h,
    stride_d2b, stride_d2n, stride_d2h,
    stride_cs, stride_ch, stride_ct,
    stride_is, stride_ih, stride_it,
    stride_m1s, stride_m1h, stride_m1q, stride_m1k,
    stride_m2s, stride_m2h, stride_m2q, stride_m2k,
    mask1_block_q, mask1_block_k, mask2_block_q, mask2_block_k,
    seqlen_q, seqlen_k, heads, group1, group2,
    scale1, scale2,  # scale * log2(e)
    window_left, window_right,
    dim1, dim2, q_programs,
    SUB_TILES: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    USE_VARLEN: tl.constexpr, HAS_MASK1: tl.constexpr, HAS_MASK2: tl.constexpr,
    IEEE: tl.constexpr, NEED_DQ1: tl.constexpr, NEED_DQ2: tl.constexpr,
):
    # flat grid, query tiles fastest, last query tiles first (as in the forward)
    pid_bh = tl.program_id(0) // q_programs
    pid_q = q_programs - 1 - (tl.program_id(0) - pid_bh * q_programs)
    seq = pid_bh // heads
    head = pid_bh % heads
    tile = pid_q // SUB_TILES
    if USE_VARLEN:
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        len_k = tl.load(CU_K + seq + 1) - k_start
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    seq64 = seq.to(tl.int64)

    o_i = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m_i = o_i < len_q
    o_d1 = tl.arange(0, BLOCK_D1)
    o_d2 = tl.arange(0, BLOCK_D2)
    m_d1 = o_d1 < dim1
    m_d2 = o_d2 < dim2
    o_rows = (q_start + o_i).to(tl.int64)
    b_q1 = tl.load(Q1 + seq64 * stride_q1b + head * stride_q1h + o_rows[:, None] * stride_q1n + o_d1[None, :],
                   mask=m_i[:, None] & m_d1[None, :], other=0.0)  # [BQ, BD1]
    b_q2 = tl.load(Q2 + seq64 * stride_q2b + head * stride_q2h + o_rows[:, None] * stride_q2n + o_d2[None, :],
                   mask=m_i[:, None] & m_d2[None, :], other=0.0)  # [BQ, BD2]
    o_stat = seq64 * stride_sb + head * stride_sh + o_rows * stride_sn
    o_grad = seq64 * stride_gb + head * stride_gh + o_rows * stride_gn
    b_lse1, b_lse2, b_e, b_g = _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat, o_grad, m_i)

    p_k1 = K1 + seq64 * stride_k1b + (head // group1) * stride_k1h + o_d1[None, :]
    p_k2 = K2 + seq64 * stride_k2b + (head // group2) * stride_k2h + o_d2[None, :]
    p_count = KV_COUNT + seq * stride_cs + head * stride_ch + tile * stride_ct
    p_index = KV_INDEX + seq * stride_is + head * stride_ih + tile * stride_it
    p_partial = KV_PARTIAL + seq * stride_is + head * stride_ih + tile * stride_it
    p_mask1 = MASK1 + seq * stride_m1s + head * stride_m1h
    p_mask2 = MASK2 + seq * stride_m2s + head * stride_m2h

    b_dq1 = tl.zeros([BLOCK_Q, BLOCK_D1], tl.float32)
    b_dq2 = tl.zeros([BLOCK_Q, BLOCK_D2], tl.float32)
    n_visit = tl.load(p_count)
    for visit in range(0, n_visit):
        k_tile = tl.load(p_index + visit)
        partial = tl.load(p_partial + visit)
        o_j = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
        m_j = o_j < len_k
        o_keys = (k_start + o_j).to(tl.int64)
        b_k1 = tl.load(p_k1 + o_keys[:, None] * stride_k1n, mask=m_j[:, None] & m_d1[None, :], other=0.0)  # [BK, BD1]
        b_k2 = tl.load(p_k2 + o_keys[:, None] * stride_k2n, mask=m_j[:, None] & m_d2[None, :], other=0.0)  # [BK, BD2]
        b_s1 = _dot(b_q1, tl.trans(b_k1), IEEE) * scale1  # [BQ, BK]
        b_s2 = _dot(b_q2, tl.trans(b_k2), IEEE) * scale2  # [BQ, BK]
        b_ds1, b_ds2 = _tile_dscores(
            b_s1, b_s2, partial, o_i, o_j, len_q, len_k, window_left, window_right,
            p_mask1, stride_m1q, stride_m1k, mask1_block_q, mask1_block_k,
            p_mask2, stride_m2q, stride_m2k, mask2_block_q, mask2_block_k,
            b_lse1, b_lse2, b_e, b_g, HAS_MASK1, HAS_MASK2,
        )
        if NEED_DQ1:
            b_dq1 += _dot(b_ds1.to(b_k1.dtype), b_k1, IEEE)  # [BQ, BD1]
        if NEED_DQ2:
            b_dq2 += _dot(b_ds2.to(b_k2.dtype), b_k2, IEEE)  # [BQ, BD2]

    if NEED_DQ1:
        p_dq1 = DQ1 + seq64 * stride_d1b + head * stride_d1h + o_rows[:, None] * stride_d1n + o_d1[None, :]
        b_dq1 = b_dq1 * (scale1 * LN2_K)
        tl.store(p_dq1, b_dq1.to(DQ1.dtype.element_ty), mask=m_i[:, None] & m_d1[None, :])
    if NEED_DQ2:
        p_dq2 = DQ2 + seq64 * stride_d2b + head * stride_d2h + o_rows[:, None] * stride_d2n + o_d2[None, :]
        b_dq2 = b_dq2 * (scale2 * LN2_K)
        tl.store(p_dq2, b_dq2.to(DQ2.dtype.element_ty), mask=m_i[:, None] & m_d2[None, :])


@triton.jit
def _kl_bwd_dk_kernel(
    Q1, K1, Q2, K2,
    LSE1, LSE2, EXPECT, GRAD,
    DK1, DK2,
    CU_Q, CU_K,
    Q_COUNT, Q_INDEX, Q_PARTIAL,
    MASK1, MASK2,
    stride_q1b, stride_q1n, stride_q1h,
    stride_k1b, stride_k1n, stride_k1h,
    stride_q2b, stride_q2n, stride_q2h,
    stride_k2b, stride_k2n, stride_k2h,
    stride_gb, stride_gn, stride_gh,
    stride_sb, stride_sh, stride_sn,
    stride_d1b, stride_d1n, stride_d1h,
    stride_d2b, stride_d2n, stride_d2h,
    stride_cs, stride_ch, stride_ck,
    stride_is, stride_ih, stride_ik,
    stride_m1s, stride_m1h, stride_m1q, stride_m1k,
    stride_m2s, stride_m2h, stride_m2q, stride_m2k,
    mask1_block_q, mask1_block_k, mask2_block_q, mask2_block_k,
    seqlen_q, seqlen_k, heads, group1, group2, group_drive,
    scale1, scale2,  # scale * log2(e)
    window_left, window_right,
    dim1, dim2, k_programs,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    USE_VARLEN: tl.constexpr, HAS_MASK1: tl.constexpr, HAS_MASK2: tl.constexpr,
    IEEE: tl.constexpr, NEED_DK1: tl.constexpr, NEED_DK2: tl.constexpr,
):
    # one program per (key tile, sequence, key head of the driving side); it loops over the query
    # heads of that key head's group, so the GQA sum stays inside the program
    pid_bh = tl.program_id(0) // k_programs  # flat grid, key tiles fastest
    pid_k = tl.program_id(0) - pid_bh * k_programs
    heads_k = heads // group_drive
    seq = pid_bh // heads_k
    head_k = pid_bh % heads_k
    if USE_VARLEN:
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        len_k = tl.load(CU_K + seq + 1) - k_start
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    seq64 = seq.to(tl.int64)

    o_j = pid_k * BLOCK_K + tl.arange(0, BLOCK_K)
    m_j = o_j < len_k
    o_keys = (k_start + o_j).to(tl.int64)
    o_d1 = tl.arange(0, BLOCK_D1)
    o_d2 = tl.arange(0, BLOCK_D2)
    m_d1 = o_d1 < dim1
    m_d2 = o_d2 < dim2

    b_dk1 = tl.zeros([BLOCK_K, BLOCK_D1], tl.float32)
    b_dk2 = tl.zeros([BLOCK_K, BLOCK_D2], tl.float32)
    for member in range(0, group_drive):
        head = head_k * group_drive + member
        p_k1 = K1 + seq64 * stride_k1b + (head // group1) * stride_k1h + o_keys[:, None] * stride_k1n + o_d1[None, :]
        p_k2 = K2 + seq64 * stride_k2b + (head // group2) * stride_k2h + o_keys[:, None] * stride_k2n + o_d2[None, :]
        b_k1 = tl.load(p_k1, mask=m_j[:, None] & m_d1[None, :], other=0.0)  # [BK, BD1]
        b_k2 = tl.load(p_k2, mask=m_j[:, None] & m_d2[None, :], other=0.0)  # [BK, BD2]
        p_q1 = Q1 + seq64 * stride_q1b + head * stride_q1h + o_d1[None, :]
        p_q2 = Q2 + seq64 * stride_q2b + head * stride_q2h + o_d2[None, :]
        p_count = Q_COUNT + seq * stride_cs + head * stride_ch + pid_k * stride_ck
        p_index = Q_INDEX + seq * stride_is + head * stride_ih + pid_k * stride_ik
        p_partial = Q_PARTIAL + seq * stride_is + head * stride_ih + pid_k * stride_ik
        p_mask1 = MASK1 + seq * stride_m1s + head * stride_m1h
        p_mask2 = MASK2 + seq * stride_m2s + head * stride_m2h
        n_visit = tl.load(p_count)
        for visit in range(0, n_visit):
            q_tile = tl.load(p_index + visit)
            partial = tl.load(p_partial + visit)
            o_i = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
            m_i = o_i < len_q
            o_rows = (q_start + o_i).to(tl.int64)
            m_q1 = m_i[:, None] & m_d1[None, :]
            b_q1 = tl.load(p_q1 + o_rows[:, None] * stride_q1n, mask=m_q1, other=0.0)  # [BQ, BD1]
            m_q2 = m_i[:, None] & m_d2[None, :]
            b_q2 = tl.load(p_q2 + o_rows[:, None] * stride_q2n, mask=m_q2, other=0.0)  # [BQ, BD2]
            o_stat = seq64 * stride_sb + head * stride_sh + o_rows * stride_sn
            o_grad = seq64 * stride_gb + head * stride_gh + o_rows * stride_gn
            b_lse1, b_lse2, b_e, b_g = _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat, o_grad, m_i)
            b_s1 = _dot(b_q1, tl.trans(b_k1), IEEE) * scale1  # [BQ, BK]
            b_s2 = _dot(b_q2, tl.trans(b_k2), IEEE) * scale2  # [BQ, BK]
            b_ds1, b_ds2 = _tile_dscores(
                b_s1, b_s2, partial, o_i, o_j, len_q, len_k, window_left, window_right,
                p_mask1, stride_m1q, stride_m1k, mask1_block_q, mask1_block_k,
                p_mask2, stride_m2q, stride_m2k, mask2_block_q, mask2_block_k,
                b_lse1, b_lse2, b_e, b_g, HAS_MASK1, HAS_MASK2,
            )
            if NEED_DK1:
                b_dk1 += _dot(tl.trans(b_ds1.to(b_q1.dtype)), b_q1, IEEE)  # [BK, BD1]
            if NEED_DK2:
                b_dk2 += _dot(tl.trans(b_ds2.to(b_q2.dtype)), b_q2, IEEE)  # [BK, BD2]

    if NEED_DK1:
        p_dk1 = DK1 + seq64 * stride_d1b + head_k * stride_d1h + o_keys[:, None] * stride_d1n + o_d1[None, :]
        b_dk1 = b_dk1 * (scale1 * LN2_K)
        tl.store(p_dk1, b_dk1.to(DK1.dtype.element_ty), mask=m_j[:, None] & m_d1[None, :])
    if NEED_DK2:
        p_dk2 = DK2 + seq64 * stride_d2b + head_k * stride_d2h + o_keys[:, None] * stride_d2n + o_d2[None, :]
        b_dk2 = b_dk2 * (scale2 * LN2_K)
        tl.store(p_dk2, b_dk2.to(DK2.dtype.element_ty), mask=m_j[:, None] & m_d2[None, :])


def bwd_config(problem: Problem, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(rows per dq program, num_warps, num_stages) of the dq kernel."""
    if interpreting():
        return block_q, 4, 1
    block_d1, block_d2 = dim_blocks(problem)
    big = max(block_d1, block_d2) > 128
    rows = min(block_q, 32 if big else 64)
    row_bytes = (block_d1 + block_d2) * problem.dtype.itemsize
    stages = pipeline_stages(block_k * row_bytes, rows * row_bytes)
    return rows, 8 if big else 4, stages


def dk_config(problem: Problem, block_q: int, block_k: int) -> tuple[int, int]:
    """(num_warps, num_stages) of the dk kernel, which streams query tiles."""
    if interpreting():
        return 4, 1
    block_d1, block_d2 = dim_blocks(problem)
    row_bytes = (block_d1 + block_d2) * problem.dtype.itemsize
    stages = pipeline_stages(block_q * row_bytes, block_k * row_bytes, most=2)
    return (4 if max(block_d1, block_d2) <= 64 else 8), stages


def _grad_buffer(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    # varlen rows past cu_seqlens[-1] are never visited: they start at 0
    return torch.zeros(t.shape, dtype=t.dtype, device=t.device) if varlen else torch.empty(t.shape, dtype=t.dtype,
                                                                                          device=t.device)


def kl_backward(problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule: TileSchedule, needs):
    """Launch the backward: (dq1, dk1, dq2, dk2) in the input dtype, None where not needed."""
    varlen = problem.is_varlen
    grads = [_grad_buffer(t, varlen) if need else None for t, need in zip((q1, k1, q2, k2), needs)]
    if q1.numel() == 0 or k1.numel() == 0 or not any(needs):
        return tuple(None if g is None else g.zero_() for g in grads)
    grad_rows = grad_rows.float()
    block_q, block_k = schedule.block_q, schedule.block_k
    block_d1, block_d2 = dim_blocks(problem)
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    left, right = window_bounds(problem)
    cu_q, cu_k = varlen_args(problem, schedule.kv_count)
    mask1 = mask_args(problem.mask1, schedule.kv_partial)
    mask2 = mask_args(problem.mask2, schedule.kv_partial)
    ieee = problem.dtype == torch.float32
    common_strides = (
        *head_strides(q1, varlen), *head_strides(k1, varlen),
        *head_strides(q2, varlen), *head_strides(k2, varlen),
        *row_strides(grad_rows, varlen), *stat_strides(lse1, varlen),
    )
    mask_tail = (*mask1[1:5], *mask2[1:5], mask1[5], mask1[6], mask2[5], mask2[6])
    flags = dict(
        BLOCK_K=block_k, BLOCK_D1=block_d1, BLOCK_D2=block_d2, USE_VARLEN=varlen,
        HAS_MASK1=problem.mask1 is not None, HAS_MASK2=problem.mask2 is not None, IEEE=ieee,
    )
    dq1, dk1, dq2, dk2 = grads
    placeholder = lse1  # any tensor, for the pointers of gradients not asked for

    def out_strides(t):
        return head_strides(t, varlen) if t is not None else (0, 0, 0)

    if needs[0] or needs[2]:
        rows, num_warps, num_stages = bwd_config(problem, block_q, block_k)
        sub_tiles = block_q // rows
        q_programs = num_q_tiles(problem, block_q) * sub_tiles
        grid = (q_programs * problem.batch * problem.heads,)
        args = (
            q1, k1, q2, k2, lse1, lse2, expect, grad_rows,
            placeholder if dq1 is None else dq1, placeholder if dq2 is None else dq2,
            cu_q, cu_k, schedule.kv_count, schedule.kv_index, schedule.kv_partial, mask1[0], mask2[0],
            *common_strides, *out_strides(dq1), *out_strides(dq2),
            *broadcast_strides(schedule.kv_count), *broadcast_strides(schedule.kv_index)[:3],
            *mask_tail,
            problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2,
            scale1, scale2, left, right, problem.dim1, problem.dim2, q_programs,
        )
        constexprs = dict(SUB_TILES=sub_tiles, BLOCK_Q=rows, NEED_DQ1=needs[0], NEED_DQ2=needs[2], **flags)
        launch(_kl_bwd_dq_kernel, grid, args, (problem.dtype, *sorted(constexprs.items())), num_warps, num_stages,
               **constexprs)

    if needs[1] or needs[3]:
        keys = get_key_schedule(schedule)
        # one launch when both sides group query heads alike, else one per side
        if needs[1] and needs[3] and group1 != group2:
            launches = [(group1, True, False), (group2, False, True)]
        else:
            launches = [(group1 if needs[1] else group2, needs[1], needs[3])]
        num_warps, num_stages = dk_config(problem, block_q, block_k)
        for group_drive, need1, need2 in launches:
            k_programs = num_k_tiles(problem, block_k)
            grid = (k_programs * problem.batch * (problem.heads // group_drive),)
            args = (
                q1, k1, q2, k2, lse1, lse2, expect, grad_rows,
                dk1 if need1 else placeholder, dk2 if need2 else placeholder,
                cu_q, cu_k, keys.q_count, keys.q_index, keys.q_partial, mask1[0], mask2[0],
                *common_strides, *out_strides(dk1 if need1 else None), *out_strides(dk2 if need2 else None),
                *broadcast_strides(keys.q_count), *broadcast_strides(keys.q_index)[:3],
                *mask_tail,
                problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2, group_drive,
                scale1, scale2, left, right, problem.dim1, problem.dim2, k_programs,
            )
            constexprs = dict(BLOCK_Q=block_q, NEED_DK1=need1, NEED_DK2=need2, **flags)
            launch(_kl_bwd_dk_kernel, grid, args, (problem.dtype, *sorted(constexprs.items())), num_warps,
                   num_stages, **constexprs)
    return tuple(grads)

