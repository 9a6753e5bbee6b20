"""Triton kernels of the DSA indexer loss's backward (SPEC 8): the gradients of qi, ki and w.

One program per (query tile, key tile) pair: it recomputes the teacher's head mean T and the
indexer logits z, forms dz = g (S - T), then per indexer head recomputes r = qi_t . ki and adds

    G_t[i]  += sum_j dz[i, j] 1[r > 0] ki[j]              (float32 reduction per head)
    dki[j]  += sum_i dz[i, j] w_t[i] 1[r > 0] qi_t[i]     (in registers, one float32 reduction)

and at the end dqi_t = w_t G_t and dw_t = sum_j dz relu(r) = qi_t . G_t (no per-pair work for dw).
A key tile's programs are launched next to each other, and every program of a launch reads the
same few query tiles: both sides' teacher and indexer tiles are shared in L2 by the programs
running at the same time.

G goes into a workspace that holds only a slab of rows: the host runs the backward slab by slab
(two row ranges per launch, one from each end of the rows, so that every causal launch has about
the same work), and `_finish_rows_kernel` turns each slab's workspace into dqi and dw in the input
dtype and zeroes it for the next launch.
"""

from __future__ import annotations

import triton
import triton.language as tl

from streamkl.backends.triton.indexer_kernels import (
    LOG2E,
    _allowed,
    _descriptor_batch,
    _index_logits,
    _lower_bound,
    _mm,
    _selection_mask,
    _span,
    _teacher_probs,
    _tile_selection,
)


@triton.jit
def _backward_kernel(
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, HEAD_LSE, INDEX_LSE, GRAD, G_DESC, G, DKI_DESC, DKI, SEL, TILES, CU_Q, CU_K,
    SUMS, stride_wb, stride_wn, stride_wh, stride_lb, stride_lh, stride_rb, stride_gr, stride_gh,
    stride_dkb, stride_dkn, stride_sums,
    lo0, hi0, base0, lo1, hi1, base1,
    seqlen_q, seqlen_k, heads, group, index_heads, qk_scale, topk, q_tiles, k_tiles, span_tiles,
    BLOCK_D: tl.constexpr, INDEX_DIM: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr, TOPK: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, STEPS_K: tl.constexpr, CHUNK: tl.constexpr, LOSS: tl.constexpr,
):
    """One program per (key tile, sequence, row range, query tile of the range): the row range is
    flat rows [lo, hi) (batch entry b's row i is b * seqlen_q + i; packed rows as they are), its
    workspace rows start at `base`, and it touches at most `span_tiles` query tiles. dki (float32)
    and G are added by reductions. LOSS: the loss's per-row sums over the tile's keys, sum T log T
    and sum T z, are added to SUMS[0] and SUMS[1] (flat rows) too (the loss formed with the
    gradients, when the forward knows the upstream gradient)."""
    # a key tile's programs (both ranges, every query tile) are neighbours: its teacher keys are
    # read from memory once for all of them, and every key tile's program reads the same queries
    span = tl.program_id(0) % span_tiles
    rest = tl.program_id(0) // span_tiles
    first = rest % 2 == 0
    k_tile = rest // 2 % k_tiles
    seq = rest // 2 // k_tiles
    lo = tl.where(first, lo0, lo1)
    hi = tl.where(first, hi0, hi1)
    base = tl.where(first, base0, base1)
    q_start, len_q, k_start, len_k = _span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    desc_b = _descriptor_batch(seq, VARLEN)
    flat0 = q_start if VARLEN else seq * seqlen_q  # flat row of the sequence's row 0
    r0 = tl.maximum(lo - flat0, 0)
    r1 = tl.minimum(hi - flat0, len_q)
    q_tile = r0 // BLOCK_M + span
    run = (r0 < r1) & (k_tile * BLOCK_N < len_k) & (q_tile * BLOCK_M < r1)
    if CAUSAL:  # the key tile's first key is past every row of the query tile
        run = run & ((q_tile + 1) * BLOCK_M + (len_k - len_q) > k_tile * BLOCK_N)
    if TOPK:
        run = run & (tl.load(TILES + (seq * q_tiles + q_tile) * k_tiles + k_tile, mask=run, other=0) != 0)
    if run:
        seq64 = seq.to(tl.int64)
        o_j = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
        m_j = o_j < len_k
        o_e = tl.arange(0, BLOCK_E)
        k_row = k_start + k_tile * BLOCK_N
        W += seq64 * stride_wb + q_start.to(tl.int64) * stride_wn
        HEAD_LSE += seq64 * stride_lb + q_start
        # packed keys past the sequence (the next one's) read as 0: no NaN leaks across sequences
        b_ki = KI_DESC.load([desc_b, k_row, 0, 0]).reshape([BLOCK_N, BLOCK_E])
        if VARLEN:
            b_ki = tl.where(m_j[:, None], b_ki, 0.0).to(b_ki.dtype)
        o_i = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
        m_i = (o_i >= r0) & (o_i < r1)
        q_row = q_start + q_tile * BLOCK_M
        m_ij = _allowed(o_i, o_j, len_q, len_k, CAUSAL) & m_i[:, None]
        ws_row = flat0 + q_tile * BLOCK_M - lo + base  # workspace row of o_i[0]
        o_ws = (ws_row + tl.arange(0, BLOCK_M)).to(tl.int64)
        if TOPK:  # the rows' selected keys in the tile (SEL's rows: the workspace's): one binary
            p_sel = SEL + o_ws * topk  # search, then a load for most tiles
            sel_end = tl.where(m_i, topk, 0)
            cursor = _lower_bound(p_sel, sel_end, k_tile * BLOCK_N, STEPS_K)
            word0, word1, word2, word3, _, _ = _tile_selection(p_sel, cursor, sel_end, k_tile * BLOCK_N, BLOCK_N,
                                                               CHUNK)
            m_ij = m_ij & _selection_mask(word0, word1, word2, word3, o_j, k_tile * BLOCK_N)
        b_t = _teacher_probs(Q_DESC, K_DESC, HEAD_LSE, desc_b, q_row, k_row, o_i, m_i, m_ij, stride_lh,
                             heads, group, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, IEEE, INTERPRET)
        b_z = _index_logits(QI_DESC, b_ki, W, desc_b, q_row, o_i, m_i, stride_wn, stride_wh, index_heads, BLOCK_M,
                            BLOCK_N, BLOCK_E, IEEE, INTERPRET)
        if LOSS:
            p_sums = SUMS + flat0.to(tl.int64) + o_i
            tl.atomic_add(p_sums, tl.sum(tl.where(b_t == 0.0, 0.0, b_t * tl.log(b_t)), axis=1), mask=m_i,
                          sem="relaxed")
            tl.atomic_add(p_sums + stride_sums, tl.sum(tl.where(m_ij, b_t * b_z, 0.0), axis=1), mask=m_i,
                          sem="relaxed")
        b_lse = tl.load(INDEX_LSE + seq64 * stride_rb + q_start + o_i, mask=m_i, other=0.0) * LOG2E
        b_g = tl.load(GRAD + seq64 * stride_rb + q_start + o_i, mask=m_i, other=0.0)
        b_p = tl.exp2(b_z * LOG2E - b_lse[:, None])
        b_dz = tl.where(m_ij, b_g[:, None] * (b_p - b_t), 0.0)  # [BM, BN]
        b_dki = tl.zeros([BLOCK_N, BLOCK_E], tl.float32)
        b_w_next = tl.load(W + o_i * stride_wn, mask=m_i, other=0.0)  # each head's weights one head ahead
        for t in tl.range(0, index_heads):
            b_qi = QI_DESC.load([desc_b, q_row, t, 0]).reshape([BLOCK_M, BLOCK_E])
            if VARLEN:
                b_qi = tl.where(m_i[:, None], b_qi, 0.0).to(b_qi.dtype)
            b_w = b_w_next.to(tl.float32)
            b_w_next = tl.load(W + o_i * stride_wn + (t + 1) * stride_wh, mask=m_i & (t + 1 < index_heads),
                               other=0.0)
            b_r = _mm(b_qi, tl.trans(b_ki), IEEE, INTERPRET)  # [BM, BN]
            b_dr = tl.where(b_r > 0.0, b_dz, 0.0)
            b_dki += _mm(tl.trans((b_dr * b_w[:, None]).to(b_qi.dtype)), b_qi, IEEE, INTERPRET)
            b_grow = _mm(b_dr.to(b_qi.dtype), b_ki, IEEE, INTERPRET)  # [BM, BE], 0 on masked rows
            if INTERPRET:
                p_g = G + (o_ws * stride_gr + t * stride_gh)[:, None] + o_e[None, :]
                tl.atomic_add(p_g, b_grow, mask=m_i[:, None] & (o_e[None, :] < INDEX_DIM), sem="relaxed")
            else:
                # rows of the tile outside [r0, r1) add zeros to their neighbours' rows
                G_DESC.atomic_add([0, ws_row, t, 0], b_grow.reshape([1, BLOCK_M, 1, BLOCK_E]))
        if INTERPRET:
            DKI += seq64 * stride_dkb + k_start.to(tl.int64) * stride_dkn
            tl.atomic_add(DKI + o_j[:, None] * stride_dkn + o_e[None, :], b_dki,
                          mask=m_j[:, None] & (o_e[None, :] < INDEX_DIM), sem="relaxed")
        else:
            # keys of the tile past the sequence add zeros to the next sequence's rows
            DKI_DESC.atomic_add([desc_b, k_row, 0, 0], b_dki.reshape([1, BLOCK_N, 1, BLOCK_E]))


@triton.jit
def _finish_rows_kernel(
    G, QI, W, DQI, DW, lo, base, seqlen_q, index_heads,
    stride_gr, stride_gh, stride_qb, stride_qn, stride_qh, stride_wb, stride_wn,
    INDEX_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_E: tl.constexpr, VARLEN: tl.constexpr,
):
    """dqi = w * G and dw = qi . G (per head) of flat row `lo + program id` from the workspace (dqi,
    dw contiguous); the row's workspace is zeroed again for the next launch."""
    row = lo + tl.program_id(0)
    if VARLEN:
        b, i = row.to(tl.int64) * 0, row.to(tl.int64)
    else:
        b, i = (row // seqlen_q).to(tl.int64), (row % seqlen_q).to(tl.int64)
    ws = (row - lo + base).to(tl.int64)
    o_h = tl.arange(0, BLOCK_H)
    o_e = tl.arange(0, BLOCK_E)
    m_h = o_h < index_heads
    m_he = m_h[:, None] & (o_e[None, :] < INDEX_DIM)
    p_g = G + ws * stride_gr + o_h[:, None] * stride_gh + o_e[None, :]
    b_g = tl.load(p_g, mask=m_he, other=0.0)
    b_w = tl.load(W + b * stride_wb + i * stride_wn + o_h, mask=m_h, other=0.0).to(tl.float32)
    p_qi = QI + b * stride_qb + i * stride_qn + o_h[:, None] * stride_qh + o_e[None, :]
    b_qi = tl.load(p_qi, mask=m_he, other=0.0).to(tl.float32)
    tl.store(p_g, tl.zeros([BLOCK_H, BLOCK_E], tl.float32), mask=m_he)
    row64 = row.to(tl.int64)
    p_dqi = DQI + row64 * index_heads * INDEX_DIM + o_h[:, None] * INDEX_DIM + o_e[None, :]
    tl.store(p_dqi, (b_w[:, None] * b_g).to(DQI.dtype.element_ty), mask=m_he)
    tl.store(DW + row64 * index_heads + o_h, tl.sum(b_qi * b_g, axis=1).to(DW.dtype.element_ty), mask=m_h)

