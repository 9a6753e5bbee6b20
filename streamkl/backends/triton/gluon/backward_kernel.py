"""The Gluon backward kernel: one program per (128-key tile, sequence, side-2 key head).

A producer warp loads both sides' key tiles once, then streams the 64-row query tiles that see
them (both sides) through an mbarrier ring. Two consumer warpgroups own 64 keys each and, per
query tile, take the scores s = q k^T of both sides against their keys (async wgmma), p and q
from the saved row statistics, dS2 = g (q - p), then dk2 += dS2^T q2 and dq2 = dS2 k2 over all
128 keys (dS2 through shared memory, which both products read); each warpgroup's [64, 64] piece
of the dq2 tile is added to a float32 buffer by a TMA bulk reduction. With BOTH the same program
returns all four gradients: dS1 next to dS2, dk1 next to dk2, dq1 by TMA reductions after dq2's.
At head dim 64 the student's program splits the query tiles instead (backward_rows.py).

Variants are constexprs that `select.py` derives from the problem:
- CAUSAL with DIAG (dense whole tiles, no GQA): the diagonal's steps (masked) and the rest
  (unmasked) in two loops; with BOTH and ROT the unmasked loop first (fewer spills).
- LISTED (block masks, windows): the key-major view of a 128 x 128 schedule, each listed query
  tile in two 64-row steps; LSPLIT runs the full pairs and the partial pairs in two loops.
- TAIL: a last partial key tile / query step shifted back to end at the sequence's end, the keys
  and rows an earlier tile owns masked. GQA2: a program takes its group's query heads in turn.
- AHEAD: each step's statistics loaded a step ahead. EARLY_P: side 1's exponentials while side
  2's product runs. DK_DEFER: a step's dk product waited for in the next step.
- G_ONE: a reduced loss's single upstream g, moved into the output scales; DQ_RAW: dq2 added
  unscaled, the host's flush scales it once.
"""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from streamkl.backends.triton.gluon.backward_rows import _split_rows
from streamkl.backends.triton.gluon.backward_steps import (
    _diag_steps,
    _dq_out,
    _ds1,
    _full_pair,
    _partial_pair,
    _reduce_dq,
    _step_ahead,
    _step_probs,
    _step_rows,
    _step_stats,
    _times_g,
)
from streamkl.backends.triton.gluon.common import _load_then_stream


@gluon.jit
def _bwd_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                  LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dq, o_dk,
                  stride_sn, stride_gn, stride_dqn, stride_dkn,
                  k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                  n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                  n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                  WG: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                  CAUSAL: gl.constexpr, LISTED: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr,
                  BOTH: gl.constexpr, DIAG: gl.constexpr, AHEAD: gl.constexpr, ROT: gl.constexpr,
                  LSPLIT: gl.constexpr, EARLY_P: gl.constexpr, DK_DEFER: gl.constexpr, G_ONE: gl.constexpr,
                  DQ_RAW: gl.constexpr):
    """One warpgroup, 64 keys (k0 + 64 * WG ...): dk2 of its keys; per query tile, its half of the
    tile's dS2 into shared memory (two buffers, alternating), then, once both warpgroups' halves
    are there (`ds_bar`), the tile's dq2 = dS2 k2 over all 128 keys, added by a TMA reduction:
    each warpgroup its 64 columns every tile at D=128, or at D=64 one warpgroup all 64 (turns by
    tile parity)."""
    HALF: gl.constexpr = 64
    DQ_COLS: gl.constexpr = 64  # dq2's columns a warpgroup computes in a step
    # the score tiles [rows, keys] (S = q k^T: the rows across the wgmma M dimension, each thread
    # two rows' statistics)
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 64, 16])
    d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])  # [keys or rows, D]
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    o_j = k0 + WG * HALF + gl.arange(0, HALF, layout=key_layout)  # sequence-local keys
    ka1 = k1_smem.slice(WG * HALF, HALF)
    ka2 = k2_smem.slice(WG * HALF, HALF)
    gl.static_assert(BLOCK_M == HALF)  # (the layout above: both dims of a score tile 64)
    zero_s = gl.zeros([BLOCK_M, HALF], gl.float32, s_layout)
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, DQ_COLS, 16])  # [rows, DQ_COLS of D]
    zero_q = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, q_layout)
    if D > DQ_COLS:  # this warpgroup's DQ_COLS columns of dq2, k2[:, cols], every tile
        kb2 = k2_smem.slice(WG * DQ_COLS, DQ_COLS, dim=1)
    else:  # D = 64: all of dq2's columns, every other tile (turns by parity)
        kb2 = k2_smem
    dk = gl.zeros([HALF, D], gl.float32, d_layout)
    ds1_smem, DK1, EXPECT, dq1_desc, out_scale1 = both
    if BOTH:  # side 1's gradients too: dk1 in registers, dq1 by TMA reductions
        dk1 = gl.zeros([HALF, D], gl.float32, d_layout)
        kb1 = k1_smem.slice(WG * 64, 64, dim=1)
    else:
        kb1 = kb2  # (unused)
    o_d = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))
    mbarrier.wait(k_bar, 0)
    # DIAG (causal, dense whole tiles, no GQA): two loops, the steps on the diagonal (masked) then
    # the rest (no mask: with BOTH the masks' registers made ptxas spill in every step)
    if DIAG:
        n_diag = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
    elif LSPLIT:  # LISTED_LOOPS: the full pairs' steps (listed first), then the partial pairs'
        n_diag = gl.minimum(2 * n_full_listed, n_tiles)
    else:
        n_diag = n_tiles
    if AHEAD:  # the first step's rows and statistics (then each step loads the next one's)
        a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
            n_tiles * 0, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
            stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, LISTED, TAIL, GQA2, BOTH, row_layout, G_ONE)
        if BOTH:  # (E is carried from step to step with BOTH only)
            a_e = e_next
    # (ROT: the same two loops in the other order, the unmasked steps first: the producer streams
    # the query tiles from the diagonal's end around to its start; `i` counts the stream, `r`
    # is the step's query tile, the diagonal's last)
    # DK_DEFER (student): a step's dk product is waited for with the next step's score products,
    # which the tensor cores run after it anyway; `held` is the query slot it still reads (-1: none)
    DEFER: gl.constexpr = DK_DEFER and not BOTH
    held = n_tiles * 0 - 1
    if DEFER:  # (the loops carry dk as an accumulator in flight)
        dk = hopper.warpgroup_mma_init(dk)
    for phase in gl.static_range(2 if DIAG or LSPLIT else 1):
        if ROT:
            if phase == 0:
                i_lo = n_diag * 0
                i_hi = n_tiles - n_diag
                shift = n_diag
            else:
                i_lo = n_tiles - n_diag
                i_hi = n_tiles
                shift = n_diag - n_tiles
        elif phase == 0:
            i_lo = n_diag * 0
            i_hi = n_diag
        else:
            i_lo = n_diag
            i_hi = n_tiles
        for i in range(i_lo, i_hi):
            if ROT:
                r = i + shift
            else:
                r = i
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            t1 = hopper.warpgroup_mma(q1_smem.index(slot), ka1.permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
            t2 = hopper.warpgroup_mma(q2_smem.index(slot), ka2.permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
            if AHEAD:  # this step's, loaded a step ago; then the next step's (used there)
                tile_row0 = a_row0
                fresh_row0 = a_fresh
                h_in = a_h
                lse1 = a_lse1
                lse2 = a_lse2
                g = a_g
                if BOTH:
                    e_row = a_e
                a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
                    i + 1, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
                    stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, LISTED, TAIL, GQA2, BOTH, row_layout,
                    G_ONE)
                if BOTH:
                    a_e = e_next
            else:
                tile_row0, fresh_row0, h_in = _step_rows(r, index, first_tile, n_per, len_q, BLOCK_M,
                                                         LISTED, TAIL, GQA2)
            o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)  # sequence-local rows
            if not AHEAD:
                # the rows' statistics straight into the score layout (two rows a thread from one 64-bit base)
                lse1, lse2, g = _step_stats(tile_row0, h_in, LSE1, LSE2, GRAD, o_stat, o_grad, stride_sn,
                                            stride_gn, stride_sh, stride_gh, BLOCK_M, GQA2, row_layout)
            lse1 = lse1 * 1.4426950408889634
            lse2 = lse2 * 1.4426950408889634
            if BOTH:  # minus the row's KL: (lse1 - lse2) - E in natural units (E as backward._row_stats;
                # lse1, lse2 are in log2 units here)
                if not AHEAD:
                    e_row = gl.load(EXPECT + o_stat + (o_stat * 0 + tile_row0) * stride_sn
                                    + gl.arange(0, BLOCK_M, layout=row_layout).to(gl.int64) * stride_sn)
                e_row = (lse1 - lse2) * 0.6931471805599453 - e_row
            if G_ONE:  # an empty row's gradient is 0: its p and q made 0 by +inf statistics (no g to zero)
                lse2 = gl.where(lse1 == float("-inf"), float("inf"), lse2)
                lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
            else:
                g = gl.where(lse1 == float("-inf"), 0.0, g)  # an empty row's gradient is 0 whatever g is
            if LISTED:  # rows without keys on a side (lse -inf): +inf makes their p, q exactly 0
                lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
                lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
            if EARLY_P and not BOTH and not TAIL and (not LISTED or (LSPLIT and phase == 0)):
                # side 1's exponentials while the tensor cores run side 2's product
                st1 = hopper.warpgroup_mma_wait(1, deps=[t1])
                p_early = gl.exp2(st1 * scale1 - lse1[:, None])
                if DEFER:
                    st2, dk = hopper.warpgroup_mma_wait(0, deps=[t2, dk])
                else:
                    st2 = hopper.warpgroup_mma_wait(0, deps=[t2])
            else:
                p_early = None
                if DEFER:
                    st1, st2, dk = hopper.warpgroup_mma_wait(0, deps=[t1, t2, dk])
                else:
                    st1, st2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
            if DEFER:  # the step before's dk product, waited for with these: its query slot is read
                if held >= 0:
                    mbarrier.arrive(empty.index(held), count=1)
            if LISTED:
                visit = r // 2
                if not BOTH:
                    e_row = g  # (unused)
                if LSPLIT and phase == 0:  # LISTED_LOOPS: the full pairs' loop
                    ds, ds1 = _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH, p_early, G_ONE)
                elif LSPLIT:  # the partial pairs' loop
                    ds, ds1 = _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j,
                                            flags_list + visit, len_q, len_k, window_left, window_right, BOTH,
                                            G_ONE)
                elif visit < n_full_listed:  # (every row of a full pair has keys on both sides)
                    ds, ds1 = _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH, None, G_ONE)
                else:
                    ds, ds1 = _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j,
                                            flags_list + visit, len_q, len_k, window_left, window_right, BOTH,
                                            G_ONE)
            else:
                p, q, t = _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH, p_early)
                if TAIL:  # keys / rows that an earlier tile / step owns (shifted back): dS2 0 here
                    allowed = (o_j >= k_fresh)[None, :] & (o_i >= fresh_row0)[:, None]
                    if CAUSAL:
                        allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
                    p = gl.where(allowed, p, 0.0)
                    q = gl.where(allowed, q, 0.0)
                elif CAUSAL and (phase == (1 if ROT else 0) or not DIAG):  # DIAG: only the diagonal's masked
                    allowed = o_j[None, :] <= (o_i + offset)[:, None]
                    p = gl.where(allowed, p, 0.0)
                    q = gl.where(allowed, q, 0.0)
                ds = _times_g(g, q - p, G_ONE)
                if BOTH:  # dS1 = g p (ln(p / q) - KL) = g p ((s1 - s2) ln 2 - E); 0 where p is
                    ds1 = _ds1(g, p, t, e_row, G_ONE)
            ds_t = ds.to(ds_smem.dtype)  # this warpgroup's [rows, keys] of dS2, in the input dtype
            # dS2 through shared memory, the tile's [rows, 128 keys] (the warpgroups' halves side
            # by side): dk2 += dS2^T q2 reads this warpgroup's half transposed, dq2 = dS2 k2 both.
            # Buffer i % 2: its previous readers (tile i - 2) are done, since the other
            # warpgroup arrived on tile i - 1's barrier after its dq2 product of tile i - 2
            ds_all = ds_smem.index(i % 2)
            ds_own = ds_all.slice(WG * HALF, HALF, dim=1)
            ds_own.store(ds_t)
            if BOTH:
                ds1_all = ds1_smem.index(i % 2)
                ds1_own = ds1_all.slice(WG * HALF, HALF, dim=1)
                ds1_own.store(ds1.to(ds_smem.dtype))
            hopper.fence_async_shared()
            mbarrier.arrive(ds_bar.index(i % 2), count=1)
            # dS^T as a transposed (MN-major) shared operand
            ds_own = ds_own.permute((1, 0))
            if BOTH:
                ds1_own = ds1_own.permute((1, 0))
            dk = hopper.warpgroup_mma(ds_own, q2_smem.index(slot), dk, is_async=True)
            if BOTH:
                dk1 = hopper.warpgroup_mma(ds1_own, q1_smem.index(slot), dk1, is_async=True)
                dk, dk1 = hopper.warpgroup_mma_wait(0, deps=[dk, dk1])
                mbarrier.arrive(empty.index(slot), count=1)  # this slot's query tiles are read
            elif DEFER:  # (waited for with the next step's score products, or after the loops)
                held = slot
            else:
                dk = hopper.warpgroup_mma_wait(0, deps=[dk])
                mbarrier.arrive(empty.index(slot), count=1)  # this slot's query tiles are read
            if D > DQ_COLS:
                mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)  # both halves of dS2^T stored
                dq = hopper.warpgroup_mma(ds_all, kb2, zero_q, use_acc=False)
                # this warpgroup's [64, DQ_COLS] piece by one TMA bulk reduction
                _reduce_dq(dq_desc, dq_smem, _dq_out(dq, out_scale2, DQ_RAW), q_row + tile_row0,
                           dq_col + h_in * D + WG * DQ_COLS)
                if BOTH:  # dq1 through the same shared tile, once the TMA unit has read dq2's
                    dq1 = hopper.warpgroup_mma(ds1_all, kb1, zero_q, use_acc=False)
                    _reduce_dq(dq1_desc, dq_smem, dq1 * out_scale1, q_row + tile_row0,
                               dq_col + h_in * D + WG * 64)
            elif i % 2 == WG:  # (each warpgroup waits on every phase of its own buffer's barrier)
                mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)
                dq = hopper.warpgroup_mma(ds_all, kb2, zero_q, use_acc=False)
                _reduce_dq(dq_desc, dq_smem, _dq_out(dq, out_scale2, DQ_RAW), q_row + tile_row0,
                           dq_col + h_in * D)
    if DEFER:  # the last step's dk product
        dk = hopper.warpgroup_mma_wait(0, deps=[dk])
        if held >= 0:
            mbarrier.arrive(empty.index(held), count=1)
    tma.store_wait(0)  # the last reduction has read its shared tile before the program's memory goes
    keys = (k0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, d_layout))).to(gl.int64)
    p_dk = DK2 + o_dk + keys[:, None] * stride_dkn + o_d[None, :]
    if TAIL:  # keys before k_fresh are the previous tile's (this one shifted back)
        own = (keys >= k_fresh)[:, None] & (o_d < D)[None, :]
        gl.store(p_dk, (dk * out_scale2).to(DK2.dtype.element_ty), mask=own)
    else:
        gl.store(p_dk, (dk * out_scale2).to(DK2.dtype.element_ty))
    if BOTH:  # (whole tiles only: `applies_both`)
        p_dk1 = DK1 + o_dk + keys[:, None] * stride_dkn + o_d[None, :]
        gl.store(p_dk1, (dk1 * out_scale1).to(DK1.dtype.element_ty))

@gluon.jit
def _bwd_consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                    LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dq, o_dk,
                    stride_sn, stride_gn, stride_dqn, stride_dkn,
                    k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                    n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                    n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                    D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                    LISTED: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr,
                    BOTH: gl.constexpr, DIAG: gl.constexpr,
                    AHEAD: gl.constexpr, ROT: gl.constexpr, LSPLIT: gl.constexpr, EARLY_P: gl.constexpr,
                    DK_DEFER: gl.constexpr, G_ONE: gl.constexpr, DQ_RAW: gl.constexpr):
    _bwd_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                  LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dq, o_dk,
                  stride_sn, stride_gn, stride_dqn, stride_dkn,
                  k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                  n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                  n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                  1, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, BOTH, DIAG, AHEAD,
                  ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)


@gluon.jit
def _kl_bwd_gluon_kernel(
    q1_desc, k1_desc, q2_desc, k2_desc,  # 2-D [B * N, H * D] views, boxes [64, D] / [128, D]
    LSE1, LSE2, GRAD,
    DQ2,  # the float32 dq2 buffer (not read: dq2 goes through dq_desc)
    DK2,
    dq_desc,  # the float32 dq2 buffer as 2-D [B * N, heads * D] in [64, 64] boxes (TMA reductions)
    DK1, EXPECT, dq1_desc,  # BOTH: side 1's dk, the rows' E, its float32 dq buffer
    G_SCALE,  # NORM_G (float16): what GRAD was divided by
    CU_Q, CU_K,  # VARLEN: cu_seqlens (int32); else unused
    Q_COUNT, Q_FULL, Q_INDEX, Q_FLAGS,  # LISTED: the key-major schedule (128 x 128 tiles); else unused
    ORDER,  # ORDERED: the launch ids in the order to run them (`schedule.heaviest_first`); else unused
    stride_sb, stride_sh, stride_sn,  # lse [B, H, N]
    stride_gb, stride_gn, stride_gh,  # g [B, N, H]
    stride_dqb, stride_dqn, stride_dqh,  # the float32 dq2 buffer [B, N, H, D]
    stride_dkb, stride_dkn, stride_dkh,  # dk2 [B, N, H, D]
    stride_cs, stride_ch, stride_ct,  # the key schedule's counts [S', H', nK] (broadcast strides)
    stride_is, stride_ih, stride_it,  # its lists [S', H', nK, nQ], the last dim contiguous
    window_left, window_right,  # LISTED: causality folded into window_right; -1 unbounded
    seqlen_q, seqlen_k, heads, head_lo, group1, group2,  # heads: programs a sequence (key heads of side 2
    # in this launch's chunk of query heads, from head_lo)
    scale1, scale2, out_scale2, out_scale1, k_programs,
    D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
    DS_LAYOUT: gl.constexpr,  # shared layout of the [BLOCK_M, 128] dS tiles
    LISTED: gl.constexpr,  # block masks or a window: walk the key schedule's query-tile lists
    NORM_G: gl.constexpr,  # float16: GRAD was divided by G_SCALE (backward.py's reason)
    VARLEN: gl.constexpr,  # packed sequences (lengths known on the host: `tile_fit`)
    TAIL: gl.constexpr,  # some length not a whole number of tiles: last tiles shifted back
    GQA2: gl.constexpr,  # side-2 GQA: a program per key head, its group's query heads in turn
    DQ_LAYOUT: gl.constexpr,  # dq_desc's shared layout
    KEY_MAJOR: gl.constexpr,  # programs ordered key tile first (short causal launches)
    BOTH: gl.constexpr,  # side 1's gradients too
    DIAG: gl.constexpr,  # causal, dense whole tiles, no GQA: unmasked steps after the diagonal's
    ORDERED: gl.constexpr,  # LISTED: this program's id read from ORDER (each head's busiest key tiles first)
    AHEAD: gl.constexpr,  # each step's statistics loaded a step earlier
    ROT: gl.constexpr,  # DIAG: the unmasked steps first, the diagonal's last
    LSPLIT: gl.constexpr,  # LISTED: the full pairs' steps in one loop, the partial pairs' in a second
    EARLY_P: gl.constexpr,  # student: side 1's exponentials while side 2's score product runs (`EARLY_P`)
    DK_DEFER: gl.constexpr,  # student: each step's dk product waited for in the next step (`DK_DEFER`)
    G_ONE: gl.constexpr = False,  # student: one g for every row (a reduced loss), in the output scales (`G_ONE`)
    DQ_RAW: gl.constexpr = False,  # student: dq2 added unscaled, the host's flush scales it (`DQ_RAW`)
    SPLIT_ROWS: gl.constexpr = False,  # student, D=64: each consumer warpgroup its own query tiles
):
    pid = gl.program_id(0)
    if ORDERED:
        pid = gl.load(ORDER + pid)
    if KEY_MAJOR:
        n_bh = gl.num_programs(0) // k_programs
        pid_k = pid // n_bh
        pid_bh = pid - pid_k * n_bh
    else:
        pid_bh = pid // k_programs
        pid_k = pid - pid_bh * k_programs
    if NORM_G:  # the products are linear in g: the factor comes back with the softmax scale
        out_scale2 = out_scale2 * gl.load(G_SCALE)
        out_scale1 = out_scale1 * gl.load(G_SCALE)
    if G_ONE:  # dS2 = q - p: g (the one value of a reduced loss's expanded g) comes back with the scale
        g_one = gl.load(GRAD)
        out_scale2 = out_scale2 * g_one
        out_scale1 = out_scale1 * g_one  # (BOTH: dS1 = p (ln(p / q) - KL))
    seq = pid_bh // heads
    if GQA2:  # the group's first query head (side 1's key head is the group's: group1 % group2 == 0)
        head = head_lo + (pid_bh % heads) * group2
        head2 = head // group2
    else:
        head = head_lo + pid_bh % heads
        head2 = head
    k_fresh = pid_k * 128  # this program's keys from here (earlier ones: the tile before)
    if VARLEN:  # packed sequences: rows start_q ..., keys start_k ...; grid sized by the longest
        start_q = gl.load(CU_Q + seq)
        seqlen_q = gl.load(CU_Q + seq + 1) - start_q
        start_k = gl.load(CU_K + seq)
        seqlen_k = gl.load(CU_K + seq + 1) - start_k
        row_base = start_q.to(gl.int64)  # the statistics, g and dq2 are packed too
        key_base = start_k.to(gl.int64)
    else:
        start_q = seq * seqlen_q
        start_k = seq * seqlen_k
        row_base = 0
        key_base = 0
    if VARLEN:
        if k_fresh >= seqlen_k:  # past this sequence's keys (the grid is sized by the longest)
            return
    k0 = k_fresh
    if TAIL:  # a last partial key tile shifted back to end at the sequence's last key
        k0 = gl.minimum(k_fresh, seqlen_k - 128)
    offset = seqlen_k - seqlen_q
    first_tile = 0
    if CAUSAL:  # query rows i see key k_fresh once i + offset >= k_fresh
        first_tile = gl.maximum(k_fresh - offset, 0) // BLOCK_M
    if LISTED:  # the query tiles (128 rows, two steps each) visiting this key tile, full ones first
        o_count = seq * stride_cs + head * stride_ch + pid_k * stride_ct
        n_tiles = 2 * gl.load(Q_COUNT + o_count)
        n_full_listed = gl.load(Q_FULL + o_count)
        o_list = seq.to(gl.int64) * stride_is + head * stride_ih + pid_k * stride_it
        index = Q_INDEX + o_list
        flags_list = Q_FLAGS + o_list
        first_tile = 0
    else:
        if TAIL:
            n_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M - first_tile
        else:
            n_tiles = seqlen_q // BLOCK_M - first_tile
        n_full_listed = n_tiles
        index = Q_INDEX
        flags_list = Q_FLAGS
    n_per = n_tiles  # (GQA2: steps a query head; the loops run over the group's heads in turn)
    if GQA2:
        n_tiles = n_tiles * group2

    if SPLIT_ROWS:
        _split_rows(q1_desc, k1_desc, q2_desc, k2_desc, LSE1, LSE2, GRAD, DK2, dq_desc, seq, head, row_base,
                    key_base, start_q, start_k, k0, offset, first_tile, n_tiles, stride_sb, stride_sh,
                    stride_sn, stride_gb, stride_gh, stride_gn, stride_dkb, stride_dkh, stride_dkn, head_lo,
                    group1, scale1, scale2, out_scale2, head2, seqlen_q, k_fresh, n_per, D, BLOCK_M, STAGES,
                    CAUSAL, DIAG, EARLY_P, G_ONE, DQ_RAW, DQ_LAYOUT, DS_LAYOUT, TAIL, GQA2)
    else:
        q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [STAGES, BLOCK_M, D], q1_desc.layout)
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, D], q2_desc.layout)
        k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [128, D], k1_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [128, D], k2_desc.layout)
        # two buffers
        ds_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)
        if BOTH:
            ds1_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)
            both = (ds1_smem, DK1, EXPECT, dq1_desc, out_scale1)
        else:
            both = (ds_smem, DK2, LSE1, dq_desc, out_scale2)
        # each consumer warpgroup's float32 dq2 tile on its way to the TMA unit
        dq_all = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, 64], DQ_LAYOUT)
        dq_smem0 = dq_all.index(0)
        dq_smem1 = dq_all.index(1)
        ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(k_bar, count=1)
        for s in gl.static_range(2):
            mbarrier.init(ds_bar.index(s), count=2)  # both consumer warpgroups' halves stored
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)
        hopper.fence_async_shared()

        seq64 = seq.to(gl.int64)
        o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
        o_grad = seq64 * stride_gb + head * stride_gh + row_base * stride_gn
        o_dq = seq64 * stride_dqb + (head - head_lo) * stride_dqh + row_base * stride_dqn  # the chunk's accumulator
        o_dk = seq64 * stride_dkb + head2 * stride_dkh + key_base * stride_dkn
        q_row = start_q
        k_row = start_k + k0
        dq_col = (head - head_lo) * D  # the head's first column in the chunk's accumulator
        rot = 0
        if ROT:  # the producer's stream starts past the diagonal's steps
            rot = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
        gl.warp_specialize(
            [
                (_bwd_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                                 LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dq, o_dk,
                                 stride_sn, stride_gn, stride_dqn, stride_dkn,
                                 k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                 n_full_listed, index, flags_list, seqlen_q, seqlen_k, window_left, window_right,
                                 k_fresh, n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem0, q_row, dq_col,
                                 both, 0, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, BOTH,
                                 DIAG, AHEAD, ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)),
                (_bwd_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                                   LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dq, o_dk,
                                   stride_sn, stride_gn, stride_dqn, stride_dkn,
                                   k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                   n_full_listed, index, flags_list, seqlen_q, seqlen_k, window_left, window_right,
                                   k_fresh, n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem1, q_row,
                                   dq_col, both, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, BOTH,
                                   DIAG, AHEAD, ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)),
                (_load_then_stream, (k1_desc, k2_desc, k1_smem, k2_smem, k_bar, k_row, (head // group1) * D,
                                     head2 * D, q1_desc, q2_desc, q1_smem, q2_smem, ready, empty,
                                     q_row + first_tile * BLOCK_M, head * D, head * D, n_tiles, index, BLOCK_M,
                                     STAGES, LISTED, 2, seqlen_q - BLOCK_M - first_tile * BLOCK_M, TAIL,
                                     n_per, D, GQA2, rot, ROT)),
            ],
            [4, 1],
            [240, 32],  # (the default partition gets the rest of 3 x 168: 232; 232 / 40 spilled more with BOTH)
        )
