"""The portable backward kernels (tl.*): scores recomputed tile by tile from the saved (lse1, lse2, E).

One side's gradients (a detached teacher, the usual distillation): one key-major kernel over the
transposed schedule. A program owns one key tile (of one sequence and key head, looping over the
query heads that share it: GQA sums stay inside), streams the query tiles that visit it,
accumulates dk in registers and adds each tile's dq into a float32 buffer with atomics (TMA bulk
reductions on Hopper): the scores are computed once.

Both sides' gradients, or `deterministic=True`: two kernels that own disjoint outputs, no atomics,
bitwise-reproducible gradients: `_kl_bwd_dq_kernel` (query-major, dq1, dq2) and the key-major
kernel without its dq part (dk1, dk2). The scores are computed twice; with two dk accumulators
the atomic pass crowds the registers and measured slower.

With d = s1 - s2 (0 off side 1's support), p = exp(s1 - lse1), q = exp(s2 - lse2) and the row's
upstream gradient g:  dS1 = g * p * (d - E),  dS2 = g * (q - p);  dq = scale * dS @ k,
dk = scale * dS^T @ q. Only the requested gradients are computed: a side that needs none costs only
its score recomputation. Full tiles (listed first by the schedule) run without any mask.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from streamkl.backends.base import empty_rows_to_zero
from streamkl.backends.triton.common import (
    _INTERPRET,
    LN2_K,
    LOG2E_K,
    _dot,
    _partial_allowed,
    _sequence_span,
    broadcast_strides,
    check_tiles,
    dim_blocks,
    even_dims,
    group_sizes,
    head_strides,
    log2_scales,
    num_k_tiles,
    num_q_tiles,
    row_strides,
    stat_strides,
    varlen_args,
    window_bounds,
)
from streamkl.backends.triton.launch import launch
from streamkl.backends.triton.select import Backward
from streamkl.problem import Problem
from streamkl.sparse.schedule import TileSchedule, get_key_schedule, get_schedule, heaviest_first


@triton.jit
def _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat, o_grad, m_i, MASKED: tl.constexpr):
    """Per-row (lse1, lse2) in log2 units, E and g, made safe for the tile formulas."""
    if MASKED:
        b_lse1 = tl.load(LSE1 + o_stat, mask=m_i, other=float("-inf"))
        b_lse2 = tl.load(LSE2 + o_stat, mask=m_i, other=float("-inf"))
        b_e = tl.load(EXPECT + o_stat, mask=m_i, other=0.0)
        b_g = tl.load(GRAD + o_grad, mask=m_i, other=0.0)
    else:
        b_lse1 = tl.load(LSE1 + o_stat)
        b_lse2 = tl.load(LSE2 + o_stat)
        b_e = tl.load(EXPECT + o_stat)
        b_g = tl.load(GRAD + o_grad)
    # a row whose side-1 support is empty has KL 0 whatever the scores: its gradient is exactly 0
    # (the upstream g may be anything there, NaN included: the front end leaves it to this load)
    b_g = tl.where(b_lse1 == float("-inf"), 0.0, b_g)
    # an empty row's lse is -inf: +inf makes its p = exp2(s - lse) exactly 0
    b_lse1 = tl.where(b_lse1 == float("-inf"), float("inf"), b_lse1 * LOG2E_K)
    b_lse2 = tl.where(b_lse2 == float("-inf"), float("inf"), b_lse2 * LOG2E_K)
    return b_lse1, b_lse2, b_e, b_g


@triton.jit
def _tile_dscores(
    b_r1, b_r2, scale1, scale2, flags, o_i, o_j, len_q, len_k, window_left, window_right,
    b_lse1, b_lse2, b_e, b_g, MASKED: tl.constexpr, FOLD: tl.constexpr,
):
    """(dS1, dS2) [BQ, BK] of one tile from its raw score products (s = r * scale, log2 units);
    element masks on partial tiles. Without the softmax scales, which the float32 products take
    afterwards: dS is rounded to the input dtype for the next products, and float16 has little
    room below 6e-5 (see `kl_backward` on the upstream gradient's normalization).

    d and E run over keys allowed on both sides; an uncovered row's infinite part is a constant,
    and dS2 is kept to side 2's support. FOLD (full tiles): each exponent's argument is one FMA,
    r * scale - lse."""
    if MASKED:
        b_s1 = b_r1 * scale1
        b_s2 = b_r2 * scale2
        m_a1, m_a2 = _partial_allowed(flags, o_i, o_j, len_q, len_k, window_left, window_right)
        b_s1 = tl.where(m_a1, b_s1, float("-inf"))
        b_s2 = tl.where(m_a2, b_s2, float("-inf"))
        b_diff = tl.where(m_a1 & m_a2, b_s1 - b_s2, 0.0)
        b_p = tl.exp2(b_s1 - b_lse1[:, None])  # [BQ, BK]
        b_ds1 = b_g[:, None] * b_p * (b_diff * LN2_K - b_e[:, None])
        b_ds2 = tl.where(m_a2, b_g[:, None] * (tl.exp2(b_s2 - b_lse2[:, None]) - b_p), 0.0)
    elif FOLD:
        b_p = tl.exp2(b_r1 * scale1 - b_lse1[:, None])  # [BQ, BK]
        b_q = tl.exp2(b_r2 * scale2 - b_lse2[:, None])
        # dS1 only where side 1's gradients are asked for (dead code otherwise)
        b_ds1 = b_g[:, None] * b_p * ((b_r1 * scale1 - b_r2 * scale2) * LN2_K - b_e[:, None])
        b_ds2 = b_g[:, None] * (b_q - b_p)
    else:
        b_s1 = b_r1 * scale1
        b_s2 = b_r2 * scale2
        b_p = tl.exp2(b_s1 - b_lse1[:, None])  # [BQ, BK]
        b_ds1 = b_g[:, None] * b_p * ((b_s1 - b_s2) * LN2_K - b_e[:, None])
        b_ds2 = b_g[:, None] * (tl.exp2(b_s2 - b_lse2[:, None]) - b_p)
    return b_ds1, b_ds2


@triton.jit
def _load_tile(p, m_rows, m_cols, MASKED: tl.constexpr, EVEN_D: tl.constexpr):
    """A [rows, dim] tile (pointers given); rows masked only on partial tiles, columns only for
    head dims below their power-of-two block."""
    if MASKED:
        return tl.load(p, mask=m_rows[:, None] & m_cols[None, :], other=0.0)
    elif EVEN_D:
        return tl.load(p)
    else:
        return tl.load(p, mask=m_cols[None, :], other=0.0)


@triton.jit
def _dq_step(
    b_q1, b_q2, b_dq1, b_dq2, p_k1, p_k2, k_tile, flags, o_i, len_q, len_k, k_start,
    window_left, window_right, stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
    b_lse1, b_lse2, b_e, b_g,
    BLOCK_K: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    NEED_DQ1: tl.constexpr, NEED_DQ2: tl.constexpr, FOLD: tl.constexpr,
):
    o_j = k_tile * BLOCK_K + tl.arange(0, BLOCK_K)
    m_j = o_j < len_k
    o_keys = (k_start + o_j).to(tl.int64)
    b_k1 = _load_tile(p_k1 + o_keys[:, None] * stride_k1n, m_j, m_d1, MASKED, EVEN_D)  # [BK, BD1]
    b_k2 = _load_tile(p_k2 + o_keys[:, None] * stride_k2n, m_j, m_d2, MASKED, EVEN_D)  # [BK, BD2]
    b_r1 = _dot(b_q1, tl.trans(b_k1), IEEE)  # [BQ, BK]
    b_r2 = _dot(b_q2, tl.trans(b_k2), IEEE)  # [BQ, BK]
    b_ds1, b_ds2 = _tile_dscores(b_r1, b_r2, scale1, scale2, flags, o_i, o_j, len_q, len_k, window_left,
                                 window_right, b_lse1, b_lse2, b_e, b_g, MASKED, FOLD)
    if NEED_DQ1:
        b_dq1 += _dot(b_ds1.to(b_k1.dtype), b_k1, IEEE)  # [BQ, BD1]
    if NEED_DQ2:
        b_dq2 += _dot(b_ds2.to(b_k2.dtype), b_k2, IEEE)  # [BQ, BD2]
    return b_dq1, b_dq2


@triton.jit
def _kl_bwd_dq_kernel(
    Q1, K1, Q2, K2,
    LSE1, LSE2, EXPECT, GRAD, G_SCALE,  # G_SCALE (NORM_G only): what GRAD was divided by
    DQ1, DQ2,
    CU_Q, CU_K,
    KV_COUNT, KV_FULL, KV_INDEX, KV_FLAGS,
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
    seqlen_q, seqlen_k, heads, group1, group2,
    scale1, scale2,  # scale * log2(e)
    window_left, window_right,
    dim1, dim2, q_programs,
    SUB_TILES: tl.constexpr,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    USE_VARLEN: tl.constexpr, EVEN_D: tl.constexpr,
    IEEE: tl.constexpr, NEED_DQ1: tl.constexpr, NEED_DQ2: tl.constexpr,
    FOLD: tl.constexpr, NORM_G: tl.constexpr,
):
    # flat grid, query tiles fastest, last query tiles first (as in the forward)
    pid_bh = tl.program_id(0) // q_programs
    pid_q = q_programs - 1 - (tl.program_id(0) - pid_bh * q_programs)
    seq = pid_bh // heads
    head = pid_bh % heads
    tile = pid_q // SUB_TILES
    q_start, len_q, k_start, len_k = _sequence_span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, USE_VARLEN)
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
    b_lse1, b_lse2, b_e, b_g = _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat, o_grad, m_i, True)

    p_k1 = K1 + seq64 * stride_k1b + (head // group1) * stride_k1h + o_d1[None, :]
    p_k2 = K2 + seq64 * stride_k2b + (head // group2) * stride_k2h + o_d2[None, :]
    o_count = seq * stride_cs + head * stride_ch + tile * stride_ct
    p_index = KV_INDEX + seq * stride_is + head * stride_ih + tile * stride_it
    p_flags = KV_FLAGS + seq * stride_is + head * stride_ih + tile * stride_it

    b_dq1 = tl.zeros([BLOCK_Q, BLOCK_D1], tl.float32)
    b_dq2 = tl.zeros([BLOCK_Q, BLOCK_D2], tl.float32)
    n_visit = tl.load(KV_COUNT + o_count)
    n_full = tl.load(KV_FULL + o_count)
    for visit in range(0, n_full):
        k_tile = tl.load(p_index + visit)
        b_dq1, b_dq2 = _dq_step(
            b_q1, b_q2, b_dq1, b_dq2, p_k1, p_k2, k_tile, 0, o_i, len_q, len_k, k_start,
            window_left, window_right, stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
            b_lse1, b_lse2, b_e, b_g, BLOCK_K, False, EVEN_D, IEEE, NEED_DQ1, NEED_DQ2, FOLD,
        )
    for visit in range(n_full, n_visit):
        k_tile = tl.load(p_index + visit)
        flags = tl.load(p_flags + visit).to(tl.int32)
        b_dq1, b_dq2 = _dq_step(
            b_q1, b_q2, b_dq1, b_dq2, p_k1, p_k2, k_tile, flags, o_i, len_q, len_k, k_start,
            window_left, window_right, stride_k1n, stride_k2n, m_d1, m_d2, scale1, scale2,
            b_lse1, b_lse2, b_e, b_g, BLOCK_K, True, EVEN_D, IEEE, NEED_DQ1, NEED_DQ2, FOLD,
        )

    g_scale = 1.0
    if NORM_G:
        g_scale = tl.load(G_SCALE)
    if NEED_DQ1:
        p_dq1 = DQ1 + seq64 * stride_d1b + head * stride_d1h + o_rows[:, None] * stride_d1n + o_d1[None, :]
        b_dq1 = b_dq1 * (scale1 * LN2_K * g_scale)
        tl.store(p_dq1, b_dq1.to(DQ1.dtype.element_ty), mask=m_i[:, None] & m_d1[None, :])
    if NEED_DQ2:
        p_dq2 = DQ2 + seq64 * stride_d2b + head * stride_d2h + o_rows[:, None] * stride_d2n + o_d2[None, :]
        b_dq2 = b_dq2 * (scale2 * LN2_K * g_scale)
        tl.store(p_dq2, b_dq2.to(DQ2.dtype.element_ty), mask=m_i[:, None] & m_d2[None, :])


@triton.jit
def _add_dq(
    p, b_dq, DQ_DESC, dq_row, dq_col, q_tile, m_i, m_d,
    BLOCK_Q: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, DQ_TMA: tl.constexpr,
):
    """Add one query tile's dq [BQ, D] (float32, pointers `p`) into the accumulator: element
    atomics masked as the tile needs, or with DQ_TMA one bulk tensor-memory reduction of the whole
    tile at (dq_row + the tile's first row, dq_col) of the 2-D view. Its rows past the sequence land
    in the next sequence's rows (or are clipped at the tensor's end): they are zeroed first, since
    their dS is 0 but 0 times an infinite key is NaN."""
    if DQ_TMA:
        if MASKED:
            b_dq = tl.where(m_i[:, None], b_dq, 0.0)
        if _INTERPRET:  # no descriptor reductions there: the same whole-tile add, clipped at the end
            o_flat = dq_row + q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
            tl.atomic_add(p, b_dq, mask=(o_flat < DQ_DESC.shape[0])[:, None] & m_d[None, :], sem="relaxed")
        else:
            DQ_DESC.atomic_add([dq_row + q_tile * BLOCK_Q, dq_col], b_dq)
    elif MASKED:
        tl.atomic_add(p, b_dq, mask=m_i[:, None] & m_d[None, :], sem="relaxed")
    elif EVEN_D:
        tl.atomic_add(p, b_dq, sem="relaxed")
    else:
        tl.atomic_add(p, b_dq, mask=m_d[None, :], sem="relaxed")


@triton.jit
def _kv_step(
    b_k1, b_k2, b_dk1, b_dk2, q_tile, flags, o_j, len_q, len_k, q_start,
    p_q1, p_q2, p_dq1, p_dq2, LSE1, LSE2, EXPECT, GRAD, o_stat_h, o_grad_h,
    stride_q1n, stride_q2n, stride_dq1n, stride_dq2n, stride_sn, stride_gn,
    window_left, window_right, m_d1, m_d2, scale1, scale2, out_scale1, out_scale2,
    DQ1_DESC, DQ2_DESC, dq_row, dq_col1, dq_col2,
    BLOCK_Q: tl.constexpr, MASKED: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    NEED_DK1: tl.constexpr, NEED_DK2: tl.constexpr, ATOMIC_DQ1: tl.constexpr, ATOMIC_DQ2: tl.constexpr,
    FOLD: tl.constexpr, DQ_TMA: tl.constexpr,
):
    """One query tile against the program's key tile: dk accumulated, dq added atomically
    (`_add_dq`). out_scale*: each side's softmax scale times the upstream gradient's rescaling."""
    o_i = q_tile * BLOCK_Q + tl.arange(0, BLOCK_Q)
    m_i = o_i < len_q
    o_rows = (q_start + o_i).to(tl.int64)
    b_q1 = _load_tile(p_q1 + o_rows[:, None] * stride_q1n, m_i, m_d1, MASKED, EVEN_D)  # [BQ, BD1]
    b_q2 = _load_tile(p_q2 + o_rows[:, None] * stride_q2n, m_i, m_d2, MASKED, EVEN_D)  # [BQ, BD2]
    b_lse1, b_lse2, b_e, b_g = _row_stats(LSE1, LSE2, EXPECT, GRAD, o_stat_h + o_rows * stride_sn,
                                          o_grad_h + o_rows * stride_gn, m_i, MASKED)
    b_r1 = _dot(b_q1, tl.trans(b_k1), IEEE)  # [BQ, BK]
    b_r2 = _dot(b_q2, tl.trans(b_k2), IEEE)  # [BQ, BK]
    b_ds1, b_ds2 = _tile_dscores(b_r1, b_r2, scale1, scale2, flags, o_i, o_j, len_q, len_k, window_left,
                                 window_right, b_lse1, b_lse2, b_e, b_g, MASKED, FOLD)
    if NEED_DK1 or ATOMIC_DQ1:
        b_ds1 = b_ds1.to(b_q1.dtype)
    if NEED_DK2 or ATOMIC_DQ2:
        b_ds2 = b_ds2.to(b_q2.dtype)
    if NEED_DK1:
        b_dk1 += _dot(tl.trans(b_ds1), b_q1, IEEE)  # [BK, BD1]
    if NEED_DK2:
        b_dk2 += _dot(tl.trans(b_ds2), b_q2, IEEE)  # [BK, BD2]
    if ATOMIC_DQ1:
        _add_dq(p_dq1 + o_rows[:, None] * stride_dq1n, _dot(b_ds1, b_k1, IEEE) * out_scale1, DQ1_DESC, dq_row,
                dq_col1, q_tile, m_i, m_d1, BLOCK_Q, MASKED, EVEN_D, DQ_TMA)  # [BQ, BD1]
    if ATOMIC_DQ2:
        _add_dq(p_dq2 + o_rows[:, None] * stride_dq2n, _dot(b_ds2, b_k2, IEEE) * out_scale2, DQ2_DESC, dq_row,
                dq_col2, q_tile, m_i, m_d2, BLOCK_Q, MASKED, EVEN_D, DQ_TMA)  # [BQ, BD2]
    return b_dk1, b_dk2


@triton.jit
def _kl_bwd_kv_kernel(
    Q1, K1, Q2, K2,
    LSE1, LSE2, EXPECT, GRAD, G_SCALE,  # G_SCALE (NORM_G only): what GRAD was divided by
    DK1, DK2, DQ1, DQ2,  # DQ*: float32 accumulators, only with ATOMIC_DQ*
    DQ1_DESC, DQ2_DESC,  # DQ_TMA only: the accumulators as 2-D [tokens, heads * dim] descriptors
    CU_Q, CU_K,
    Q_COUNT, Q_FULL, Q_INDEX, Q_FLAGS,
    ORDER,  # ORDERED only: the launch ids in the order to run them (`schedule.heaviest_first`)
    stride_q1b, stride_q1n, stride_q1h,
    stride_k1b, stride_k1n, stride_k1h,
    stride_q2b, stride_q2n, stride_q2h,
    stride_k2b, stride_k2n, stride_k2h,
    stride_gb, stride_gn, stride_gh,
    stride_sb, stride_sh, stride_sn,
    stride_d1b, stride_d1n, stride_d1h,
    stride_d2b, stride_d2n, stride_d2h,
    stride_a1b, stride_a1n, stride_a1h,
    stride_a2b, stride_a2n, stride_a2h,
    stride_cs, stride_ch, stride_ck,
    stride_is, stride_ih, stride_ik,
    seqlen_q, seqlen_k, heads, group1, group2, group_drive,
    head_base,  # the first query head of this launch's chunk (`heads` of them)
    scale1, scale2,  # scale * log2(e)
    window_left, window_right,
    dim1, dim2, k_programs,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_D1: tl.constexpr, BLOCK_D2: tl.constexpr,
    USE_VARLEN: tl.constexpr, EVEN_D: tl.constexpr, IEEE: tl.constexpr,
    NEED_DK1: tl.constexpr, NEED_DK2: tl.constexpr, ATOMIC_DQ1: tl.constexpr, ATOMIC_DQ2: tl.constexpr,
    FOLD: tl.constexpr, DQ_TMA: tl.constexpr, NORM_G: tl.constexpr,
    ORDERED: tl.constexpr,  # this program's id read from ORDER (each head's busiest key tiles first)
):
    # one program per (key tile, sequence, key head of the driving side); it loops over the query
    # heads of that key head's group, so the GQA sum stays inside the program. Heads are counted
    # from head_base (a chunk of the heads); the float32 dq accumulators hold the chunk's heads only
    pid = tl.program_id(0)
    if ORDERED:
        pid = tl.load(ORDER + pid)
    pid_bh = pid // k_programs  # flat grid, key tiles fastest
    pid_k = pid - pid_bh * k_programs
    heads_k = heads // group_drive
    seq = pid_bh // heads_k
    head_k = pid_bh % heads_k + head_base // group_drive  # chunks hold whole groups
    q_start, len_q, k_start, len_k = _sequence_span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, USE_VARLEN)
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
    dq_row = q_start if USE_VARLEN else seq * seqlen_q  # the sequence's first row in the 2-D view
    g_scale = 1.0
    if NORM_G:
        g_scale = tl.load(G_SCALE)
    out_scale1 = scale1 * LN2_K * g_scale  # the softmax scales in natural units, times g's norm
    out_scale2 = scale2 * LN2_K * g_scale
    for member in range(0, group_drive):
        head = head_k * group_drive + member  # of all heads
        local = head - head_base  # of the chunk's accumulators
        p_k1 = K1 + seq64 * stride_k1b + (head // group1) * stride_k1h + o_keys[:, None] * stride_k1n + o_d1[None, :]
        p_k2 = K2 + seq64 * stride_k2b + (head // group2) * stride_k2h + o_keys[:, None] * stride_k2n + o_d2[None, :]
        b_k1 = tl.load(p_k1, mask=m_j[:, None] & m_d1[None, :], other=0.0)  # [BK, BD1]
        b_k2 = tl.load(p_k2, mask=m_j[:, None] & m_d2[None, :], other=0.0)  # [BK, BD2]
        p_q1 = Q1 + seq64 * stride_q1b + head * stride_q1h + o_d1[None, :]
        p_q2 = Q2 + seq64 * stride_q2b + head * stride_q2h + o_d2[None, :]
        p_dq1 = DQ1 + seq64 * stride_a1b + local * stride_a1h + o_d1[None, :]
        p_dq2 = DQ2 + seq64 * stride_a2b + local * stride_a2h + o_d2[None, :]
        o_stat_h = seq64 * stride_sb + head * stride_sh
        o_grad_h = seq64 * stride_gb + head * stride_gh
        o_count = seq * stride_cs + head * stride_ch + pid_k * stride_ck
        p_index = Q_INDEX + seq * stride_is + head * stride_ih + pid_k * stride_ik
        p_flags = Q_FLAGS + seq * stride_is + head * stride_ih + pid_k * stride_ik
        n_visit = tl.load(Q_COUNT + o_count)
        n_full = tl.load(Q_FULL + o_count)
        for visit in range(0, n_full):
            q_tile = tl.load(p_index + visit)
            b_dk1, b_dk2 = _kv_step(
                b_k1, b_k2, b_dk1, b_dk2, q_tile, 0, o_j, len_q, len_k, q_start,
                p_q1, p_q2, p_dq1, p_dq2, LSE1, LSE2, EXPECT, GRAD, o_stat_h, o_grad_h,
                stride_q1n, stride_q2n, stride_a1n, stride_a2n, stride_sn, stride_gn,
                window_left, window_right, m_d1, m_d2, scale1, scale2, out_scale1, out_scale2,
                DQ1_DESC, DQ2_DESC, dq_row, local * dim1, local * dim2,
                BLOCK_Q, False, EVEN_D, IEEE, NEED_DK1, NEED_DK2, ATOMIC_DQ1, ATOMIC_DQ2, FOLD, DQ_TMA,
            )
        for visit in range(n_full, n_visit):
            q_tile = tl.load(p_index + visit)
            flags = tl.load(p_flags + visit).to(tl.int32)
            b_dk1, b_dk2 = _kv_step(
                b_k1, b_k2, b_dk1, b_dk2, q_tile, flags, o_j, len_q, len_k, q_start,
                p_q1, p_q2, p_dq1, p_dq2, LSE1, LSE2, EXPECT, GRAD, o_stat_h, o_grad_h,
                stride_q1n, stride_q2n, stride_a1n, stride_a2n, stride_sn, stride_gn,
                window_left, window_right, m_d1, m_d2, scale1, scale2, out_scale1, out_scale2,
                DQ1_DESC, DQ2_DESC, dq_row, local * dim1, local * dim2,
                BLOCK_Q, True, EVEN_D, IEEE, NEED_DK1, NEED_DK2, ATOMIC_DQ1, ATOMIC_DQ2, FOLD, DQ_TMA,
            )

    if NEED_DK1:
        p_dk1 = DK1 + seq64 * stride_d1b + head_k * stride_d1h + o_keys[:, None] * stride_d1n + o_d1[None, :]
        b_dk1 = b_dk1 * out_scale1
        tl.store(p_dk1, b_dk1.to(DK1.dtype.element_ty), mask=m_j[:, None] & m_d1[None, :])
    if NEED_DK2:
        p_dk2 = DK2 + seq64 * stride_d2b + head_k * stride_d2h + o_keys[:, None] * stride_d2n + o_d2[None, :]
        b_dk2 = b_dk2 * out_scale2
        tl.store(p_dk2, b_dk2.to(DK2.dtype.element_ty), mask=m_j[:, None] & m_d2[None, :])


def _grad_buffer(t: torch.Tensor, varlen: bool) -> torch.Tensor:
    # varlen rows past cu_seqlens[-1] are never visited: they start at 0
    if varlen:
        return torch.zeros(t.shape, dtype=t.dtype, device=t.device)
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def _heads(t: torch.Tensor, varlen: bool, lo: int, hi: int) -> torch.Tensor:
    """The heads [lo, hi) of an input or gradient ([B, N, H, ...] or [T, H, ...]): a view."""
    return t[:, lo:hi] if varlen else t[:, :, lo:hi]


def dq_descriptors(problem: Problem, accum: tuple, block_q: int):
    """2-D [tokens, heads * dim] TMA descriptors of the float32 dq accumulators (None for a side
    without one), or None where an accumulator is shorter than a box."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    descs = []
    for a, dim in zip(accum, (problem.dim1, problem.dim2)):
        if a is None:
            descs.append(None)
            continue
        width = a.shape[-2] * dim  # contiguous, aligned float32: allocated here
        if a.numel() < block_q * width:
            return None
        descs.append(TensorDescriptor(a, [a.numel() // width, width], [width, 1], [block_q, dim]))
    return descs


#: float16 backward: the upstream row gradient's largest magnitude after rescaling
#: (`rescaled_upstream`): float16 student gradients at N=512, H=8 then match float64 rounded to
#: float16 (4e-3 relative L2); without it 7.7e-3.
G_PEAK = 64.0


def rescaled_upstream(problem: Problem, grad_rows: torch.Tensor, lse1: torch.Tensor):
    """(g, g_scale): the rows' upstream gradient in float32 and what it was divided by (None: not).

    dS = g (q - p) is rounded to the input dtype for the next products, and float16 keeps full
    precision only above 6e-5: the mean over N * H rows makes g ~ 1 / (N * H), which would flush
    most of dS to 0 at long contexts. For float16 inputs g is rescaled so that its largest
    magnitude is G_PEAK (the products are linear in it; |dS2| <= G_PEAK, |dS1| <= G_PEAK p |d - E|),
    empty rows zeroed first, and the kernels multiply the factor back in float32 with the softmax
    scales. bfloat16 has float32's range and skips this. No host sync."""
    grad_rows = grad_rows.float()
    if problem.dtype != torch.float16:
        return grad_rows, None
    grad_rows = empty_rows_to_zero(grad_rows, lse1, problem.is_varlen)  # before the peak is taken
    top = grad_rows.abs().amax()
    g_scale = torch.where(top > 0, top, torch.ones_like(top)) / G_PEAK
    return grad_rows / g_scale, g_scale




def kl_backward(problem: Problem, choice: Backward, q1, k1, q2, k2, lse1, lse2, expect, grad_rows,
                schedule: TileSchedule, needs: tuple):
    """(dq1, dk1, dq2, dk2) in the input dtype, None where not needed (`choice`: "atomic" or
    "two-kernels")."""
    varlen = problem.is_varlen
    need_dq1, need_dk1, need_dq2, need_dk2 = needs
    atomic = choice.kind == "atomic"
    dk1 = _grad_buffer(k1, varlen) if need_dk1 else None
    dk2 = _grad_buffer(k2, varlen) if need_dk2 else None
    grad_rows, g_scale = rescaled_upstream(problem, grad_rows, lse1)
    block_d1, block_d2 = dim_blocks(problem)
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    left, right = window_bounds(problem)
    cu_q, cu_k = varlen_args(problem, schedule.kv_count)
    flags = dict(BLOCK_D1=block_d1, BLOCK_D2=block_d2, USE_VARLEN=varlen, EVEN_D=even_dims(problem),
                 IEEE=problem.dtype == torch.float32, NORM_G=g_scale is not None, FOLD=problem.dtype.itemsize == 2)
    placeholder = lse1  # any tensor, for the pointers of gradients not asked for
    g_scale = placeholder if g_scale is None else g_scale

    def out_strides(t):
        return head_strides(t, varlen) if t is not None else (0, 0, 0)

    block_q, block_k = choice.block_q, choice.block_k
    if (block_q, block_k) != (schedule.block_q, schedule.block_k):
        schedule = get_schedule(problem, block_q, block_k)
    dq1 = dq2 = None
    if not atomic:
        dq1 = _grad_buffer(q1, varlen) if need_dq1 else None
        dq2 = _grad_buffer(q2, varlen) if need_dq2 else None
    if not atomic and (need_dq1 or need_dq2):
        dq_q, dq_k = choice.dq_block_q, choice.dq_block_k
        dq_schedule = schedule if (dq_q, dq_k) == (block_q, block_k) else get_schedule(problem, dq_q, dq_k)
        check_tiles(problem, dq_q, dq_k)
        sub_tiles = dq_q // choice.dq_rows
        q_programs = num_q_tiles(problem, dq_q) * sub_tiles
        args = (
            q1, k1, q2, k2, lse1, lse2, expect, grad_rows, g_scale,
            placeholder if dq1 is None else dq1, placeholder if dq2 is None else dq2,
            cu_q, cu_k, dq_schedule.kv_count, dq_schedule.kv_full, dq_schedule.kv_index, dq_schedule.kv_partial,
            *head_strides(q1, varlen), *head_strides(k1, varlen),
            *head_strides(q2, varlen), *head_strides(k2, varlen),
            *row_strides(grad_rows, varlen), *stat_strides(lse1, varlen),
            *out_strides(dq1), *out_strides(dq2),
            *broadcast_strides(dq_schedule.kv_count), *broadcast_strides(dq_schedule.kv_index)[:3],
            problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2,
            scale1, scale2, left, right, problem.dim1, problem.dim2, q_programs,
        )  # fmt: skip
        constexprs = dict(SUB_TILES=sub_tiles, BLOCK_Q=choice.dq_rows, BLOCK_K=dq_k, NEED_DQ1=need_dq1,
                          NEED_DQ2=need_dq2, **flags)
        launch(_kl_bwd_dq_kernel, (q_programs * problem.batch * problem.heads,), args, choice.dq_warps,
               choice.dq_stages, constexprs)

    side1 = need_dk1 or (atomic and need_dq1)
    side2 = need_dk2 or (atomic and need_dq2)
    if not (side1 or side2):
        return dq1, dk1, dq2, dk2
    check_tiles(problem, block_q, block_k)
    keys = get_key_schedule(schedule)
    # one launch when both sides group query heads alike, else one per side
    if side1 and side2 and group1 != group2:
        launches = [(group1, True, False), (group2, False, True)]
    else:
        launches = [(group1 if side1 else group2, side1, side2)]
    k_programs = num_k_tiles(problem, block_k)
    tables = (keys.q_count, keys.q_full, keys.q_index, keys.q_partial)
    chunks = choice.chunks
    per_chunk = problem.heads // chunks
    accum = (None, None)
    if atomic:  # float32 accumulators of one chunk of heads, every visit adds into them
        accum = tuple(
            torch.zeros(_heads(q, varlen, 0, per_chunk).shape, dtype=torch.float32, device=q.device) if need else None
            for q, need in ((q1, need_dq1), (q2, need_dq2))
        )
        if chunks > 1:  # every row of every chunk is copied in, varlen tail rows included (zeros)
            dq1 = torch.empty_like(q1) if need_dq1 else None
            dq2 = torch.empty_like(q2) if need_dq2 else None
    dq_descs = dq_descriptors(problem, accum, block_q) if atomic and choice.dq_tma else None
    # every launch (chunk) takes the whole tensors and its first head
    strides = (
        *head_strides(q1, varlen), *head_strides(k1, varlen), *head_strides(q2, varlen), *head_strides(k2, varlen),
        *row_strides(grad_rows, varlen), *stat_strides(lse1, varlen), *out_strides(dk1), *out_strides(dk2),
    )
    table_strides = (*broadcast_strides(tables[0]), *broadcast_strides(tables[2])[:3])
    for chunk in range(chunks):
        lo, hi = chunk * per_chunk, (chunk + 1) * per_chunk
        if chunk:
            for a in accum:
                if a is not None:
                    a.zero_()
        for group_drive, on1, on2 in launches:
            atomic1, atomic2 = on1 and atomic and need_dq1, on2 and atomic and need_dq2
            grid = (k_programs * problem.batch * (per_chunk // group_drive),)
            order = heaviest_first(keys.q_count, problem.batch, lo, per_chunk // group_drive, group_drive,
                                   k_programs) if choice.ordered else placeholder
            args = (
                q1, k1, q2, k2, lse1, lse2, expect, grad_rows, g_scale,
                dk1 if on1 and need_dk1 else placeholder, dk2 if on2 and need_dk2 else placeholder,
                accum[0] if atomic1 else placeholder, accum[1] if atomic2 else placeholder,
                *((d if d is not None else placeholder) for d in (dq_descs or (None, None))),
                cu_q, cu_k, *tables, order, *strides, *out_strides(accum[0]), *out_strides(accum[1]), *table_strides,
                problem.seqlen_q, problem.seqlen_k, per_chunk, group1, group2, group_drive, lo,
                scale1, scale2, left, right, problem.dim1, problem.dim2, k_programs,
            )
            constexprs = dict(
                BLOCK_Q=block_q, BLOCK_K=block_k, NEED_DK1=on1 and need_dk1, NEED_DK2=on2 and need_dk2,
                ATOMIC_DQ1=atomic1, ATOMIC_DQ2=atomic2, DQ_TMA=dq_descs is not None, ORDERED=choice.ordered,
                **flags,
            )
            launch(_kl_bwd_kv_kernel, grid, args, choice.kv_warps, choice.kv_stages, constexprs)
        if atomic and chunks > 1:
            for out, a in zip((dq1, dq2), accum):
                if a is not None:
                    _heads(out, varlen, lo, hi).copy_(a)
    if atomic and chunks == 1:
        dq1 = accum[0].to(q1.dtype) if accum[0] is not None else None
        dq2 = accum[1].to(q2.dtype) if accum[1] is not None else None
    return dq1, dk1, dq2, dk2
