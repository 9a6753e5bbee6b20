"""The Gluon student backward at head dim 64 with the query tiles split between the consumer
warpgroups (SPLIT_ROWS): each warpgroup takes its own 64-row query tiles against all 128 keys of
the program, so neither waits for the other's half of dS within a step (the keys' split,
backward_kernel._bwd_consumer, waits for it before every dq2 product). The score products are
[64, 128] wgmma tiles, dS2 feeds the dq2 product from registers, and one fence a step hands the
previous step's dq2 tile to the TMA unit."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma

from streamkl.backends.triton._compat import tma_reduce_add as _tma_reduce_add
from streamkl.backends.triton.gluon.backward_steps import _diag_steps, _dq_out, _step_ahead, _times_g
from streamkl.backends.triton.gluon.common import _load_then_stream


@gluon.jit
def _rows_stats(lse1, lse2, g, G_ONE: gl.constexpr):
    """A step's loaded statistics as its exponentials take them (log2 units; an empty
    row's p and q made 0 by +inf, or its g 0)."""
    lse1 = lse1 * 1.4426950408889634
    lse2 = lse2 * 1.4426950408889634
    if G_ONE:
        lse2 = gl.where(lse1 == float("-inf"), float("inf"), lse2)
        lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
    else:
        g = gl.where(lse1 == float("-inf"), 0.0, g)
    return lse1, lse2, g

@gluon.jit
def _rows_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                   LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                   k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                   dq_col, more, WG: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                   STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIAG: gl.constexpr, EARLY_P: gl.constexpr,
                   G_ONE: gl.constexpr, DQ_RAW: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
    """The rows' split (student, D=64): one warpgroup, the stream's query tiles of its parity (tile i
    when i % 2 == WG) against all 128 of the program's keys, so that the two warpgroups never
    wait for each other within a step: the [64 rows, 128 keys] scores of both sides, p and q
    from the rows' statistics (loaded a step ahead), dS2 = g (q - p); dq2 = dS2 k2 with dS2
    from registers, dk2^T += q2^T dS2 with dS2 through this warpgroup's shared tile, left in
    flight until the next step's score products. Each step's dq2 tile goes to one of two shared
    float32 tiles and is handed to the TMA unit after the next step's dS2 fence (one fence a
    step: ptxas makes each a MEMBAR.ALL.CTA, which waits for every load in flight). Each
    warpgroup's dk2^T covers its own rows; warpgroup 1 hands its sum to warpgroup 0 through
    shared memory at the end, which stores dk2. `more`: (n_per, len_q, k_fresh, stride_sh,
    stride_gh) for TAIL (a last partial key tile and query step shifted back, the keys and rows
    an earlier one owns masked) and GQA2 (the group's query heads in turn, n_per steps each)."""
    n_per, len_q, k_fresh, stride_sh, stride_gh = more
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, 128, 16])  # [rows or D, 128 keys]
    q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                       instr_shape=[16, D, 16])  # dq2 [rows, D]
    a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
    key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
    row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    gl.static_assert(D == BLOCK_M)  # (dk2^T [D, 128] shares the scores' layout)
    o_j = k0 + gl.arange(0, 128, layout=key_layout)  # sequence-local keys
    zero_s = gl.zeros([BLOCK_M, 128], gl.float32, s_layout)
    zero_q = gl.zeros([BLOCK_M, D], gl.float32, q_layout)
    dkt = hopper.warpgroup_mma_init(gl.zeros([D, 128], gl.float32, s_layout))  # in flight across steps
    ds_own = ds_smem.index(WG)
    held = n_tiles * 0 - 1  # the query slot the dk product in flight still reads (-1: none)
    pend_row = n_tiles * 0 - 1  # the first row of the dq2 tile staged and not yet handed over (-1: none)
    pend_buf = n_tiles * 0  # its shared tile (of this warpgroup's two)
    pend_col = dq_col  # its columns in the accumulator
    mbarrier.wait(k_bar, 0)
    if DIAG:  # the steps on the diagonal (masked) first, then the rest
        n_diag = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
    else:
        n_diag = n_tiles
    a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
        n_tiles * 0 + WG, n_tiles, LSE1, first_tile, n_per, len_q, LSE1, LSE2, GRAD, LSE1, o_stat, o_grad,
        stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, False, TAIL, GQA2, False, row_layout, G_ONE)
    a_lse1, a_lse2, a_g = _rows_stats(a_lse1, a_lse2, a_g, G_ONE)
    for phase in gl.static_range(2 if DIAG else 1):
        if phase == 0:
            i_lo = n_tiles * 0 + WG
            i_hi = n_diag
        else:  # this warpgroup's first tile from n_diag on
            i_lo = n_diag + ((n_diag + WG) & 1)
            i_hi = n_tiles
        for i in range(i_lo, i_hi, 2):
            slot = i % STAGES
            mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
            t1 = hopper.warpgroup_mma(q1_smem.index(slot), k1_smem.permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
            t2 = hopper.warpgroup_mma(q2_smem.index(slot), k2_smem.permute((1, 0)), zero_s, use_acc=False,
                                      is_async=True)
            tile_row0 = a_row0
            fresh_row0 = a_fresh
            h_in = a_h
            lse1 = a_lse1
            lse2 = a_lse2
            g = a_g
            a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
                i + 2, n_tiles, LSE1, first_tile, n_per, len_q, LSE1, LSE2, GRAD, LSE1, o_stat, o_grad,
                stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, False, TAIL, GQA2, False, row_layout,
                G_ONE)
            # (the dk product in flight finishes before these: wgmma groups complete in order)
            if EARLY_P:  # side 1's exponentials while the tensor cores run side 2's product
                st1, dkt = hopper.warpgroup_mma_wait(1, deps=[t1, dkt])
                if held >= 0:
                    mbarrier.arrive(empty.index(held), count=1)
                p = gl.exp2(st1 * scale1 - lse1[:, None])
                st2 = hopper.warpgroup_mma_wait(0, deps=[t2])
            else:
                st1, st2, dkt = hopper.warpgroup_mma_wait(0, deps=[t1, t2, dkt])
                if held >= 0:
                    mbarrier.arrive(empty.index(held), count=1)
                p = gl.exp2(st1 * scale1 - lse1[:, None])
            q = gl.exp2(st2 * scale2 - lse2[:, None])
            if TAIL:  # keys / rows that an earlier tile / step owns (shifted back): dS2 0 here
                o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)
                allowed = (o_j >= k_fresh)[None, :] & (o_i >= fresh_row0)[:, None]
                if CAUSAL:
                    allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
                p = gl.where(allowed, p, 0.0)
                q = gl.where(allowed, q, 0.0)
            elif CAUSAL and (phase == 0 or not DIAG):
                o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)
                allowed = o_j[None, :] <= (o_i + offset)[:, None]
                p = gl.where(allowed, p, 0.0)
                q = gl.where(allowed, q, 0.0)
            ds_t = _times_g(g, q - p, G_ONE).to(ds_own.dtype)
            ds_own.store(ds_t)  # (read by the dk product; the previous one's finished above)
            hopper.fence_async_shared()  # (and the step before's dq2 tile, staged at its end)
            gl.thread_barrier()  # every thread's fence before the TMA unit reads (the barrier the compiler
            # places for the stores comes before the fence when the stores were the step before's)
            if pend_row >= 0:
                _tma_reduce_add(dq_desc, [q_row + pend_row, pend_col], dq_all.index(2 * WG + pend_buf))
            dq = hopper.warpgroup_mma(gl.convert_layout(ds_t, a_layout), k2_smem, zero_q, use_acc=False,
                                      is_async=True)
            dkt = hopper.warpgroup_mma(q2_smem.index(slot).permute((1, 0)), ds_own, dkt, is_async=True)
            held = slot
            dq = hopper.warpgroup_mma_wait(1, deps=[dq])
            tma.store_wait(1)  # the reduction of this tile's buffer (two steps ago) has read it
            pend_buf = (i // 2) % 2
            dq_all.index(2 * WG + pend_buf).store(_dq_out(dq, out_scale2, DQ_RAW))
            pend_row = tile_row0
            pend_col = dq_col + h_in * D  # (GQA2: the step's query head's columns)
            # the next step's statistics, in by now (the fence above waited for them)
            a_lse1, a_lse2, a_g = _rows_stats(a_lse1, a_lse2, a_g, G_ONE)
    if pend_row >= 0:  # the last dq2 tile
        hopper.fence_async_shared()
        _tma_reduce_add(dq_desc, [q_row + pend_row, pend_col], dq_all.index(2 * WG + pend_buf))
    dkt = hopper.warpgroup_mma_wait(0, deps=[dkt])
    if held >= 0:
        mbarrier.arrive(empty.index(held), count=1)
    tma.store_wait(0)  # the last reductions have read their shared tiles
    if WG == 1:  # this warpgroup's rows' dk2^T to warpgroup 0
        dk_smem.store(dkt)
        mbarrier.arrive(dk_bar, count=1)
    else:
        mbarrier.wait(dk_bar, 0)
        dkt = dkt + dk_smem.load(s_layout)
        keys = (k0 + gl.arange(0, 128, layout=key_layout)).to(gl.int64)
        o_d = gl.arange(0, D, layout=row_layout)
        p_dk = DK2 + o_dk + keys[None, :] * stride_dkn + o_d[:, None]
        if TAIL:  # keys before k_fresh are the previous tile's (this one shifted back)
            own = (keys >= k_fresh)[None, :] & (o_d < D)[:, None]
            gl.store(p_dk, (dkt * out_scale2).to(DK2.dtype.element_ty), mask=own)
        else:
            gl.store(p_dk, (dkt * out_scale2).to(DK2.dtype.element_ty))

@gluon.jit
def _rows_consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                     LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                     k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                     dq_col, more, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                     CAUSAL: gl.constexpr, DIAG: gl.constexpr, EARLY_P: gl.constexpr, G_ONE: gl.constexpr,
                     DQ_RAW: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
    _rows_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                   LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                   k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                   dq_col, more, 1, D, BLOCK_M, STAGES, CAUSAL, DIAG, EARLY_P, G_ONE, DQ_RAW, TAIL, GQA2)

@gluon.jit
def _split_rows(q1_desc, k1_desc, q2_desc, k2_desc, LSE1, LSE2, GRAD, DK2, dq_desc, seq, head, row_base,
                key_base, start_q, start_k, k0, offset, first_tile, n_tiles, stride_sb, stride_sh,
                stride_sn, stride_gb, stride_gh, stride_gn, stride_dkb, stride_dkh, stride_dkn, head_lo,
                group1, scale1, scale2, out_scale2, head2, seqlen_q, k_fresh, n_per, D: gl.constexpr,
                BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIAG: gl.constexpr,
                EARLY_P: gl.constexpr, G_ONE: gl.constexpr, DQ_RAW: gl.constexpr, DQ_LAYOUT: gl.constexpr,
                DS_LAYOUT: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
    """The rows' split: a program's shared memory, barriers and partitions (`_rows_consumer` twice, the
    producer as the default kernel's: each slot's query tiles read by one warpgroup). head2: side
    2's key head (GQA2: the group's; `head` its first query head)."""
    q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [STAGES, BLOCK_M, D], q1_desc.layout)
    q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, D], q2_desc.layout)
    k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [128, D], k1_desc.layout)
    k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [128, D], k2_desc.layout)
    ds_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)  # a tile a warpgroup
    dq_all = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, D], DQ_LAYOUT)  # two a warpgroup
    # warpgroup 1's dk2^T at the end: its two dq2 tiles' room (32 KB), once its reductions have read them
    dk_smem = dq_all.index(2)._reinterpret(gl.float32, [D, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
    dk_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(k_bar, count=1)
    mbarrier.init(dk_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=1)  # (one warpgroup reads a slot's tiles)
    hopper.fence_async_shared()
    seq64 = seq.to(gl.int64)
    o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
    o_grad = seq64 * stride_gb + head * stride_gh + row_base * stride_gn
    o_dk = seq64 * stride_dkb + head2 * stride_dkh + key_base * stride_dkn
    q_row = start_q
    dq_col = (head - head_lo) * D
    more = (n_per, seqlen_q, k_fresh, stride_sh, stride_gh)
    gl.warp_specialize(
        [
            (_rows_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                              LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                              k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc,
                              dq_all, q_row, dq_col, more, 0, D, BLOCK_M, STAGES, CAUSAL, DIAG, EARLY_P,
                              G_ONE, DQ_RAW, TAIL, GQA2)),
            (_rows_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready,
                                empty, LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn,
                                stride_dkn, k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                dq_desc, dq_all, q_row, dq_col, more, D, BLOCK_M, STAGES, CAUSAL, DIAG,
                                EARLY_P, G_ONE, DQ_RAW, TAIL, GQA2)),
            (_load_then_stream, (k1_desc, k2_desc, k1_smem, k2_smem, k_bar, start_k + k0, (head // group1) * D,
                                 head2 * D, q1_desc, q2_desc, q1_smem, q2_smem, ready, empty,
                                 q_row + first_tile * BLOCK_M, head * D, head * D, n_tiles, LSE1, BLOCK_M,
                                 STAGES, False, 2, seqlen_q - BLOCK_M - first_tile * BLOCK_M, TAIL, n_per, D,
                                 GQA2)),
        ],
        [4, 1],
        [240, 24],  # (both consumers at 240: at 232 one spilled in its loop)
    )
