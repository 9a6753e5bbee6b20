"""Hopper forward in Gluon: one program per (128-row query tile, sequence, head), three partitions.

- A producer warp loads both sides' query tiles once, then streams the key tiles of both sides
  through a ring of STAGES shared-memory slots with TMA (mbarriers: `ready` when a slot's bytes
  have landed, `empty` when both consumers have read it).
- Two consumer warpgroups of 64 rows each issue s1 = q1 k1^T and s2 = q2 k2^T as asynchronous
  wgmma and keep the SPEC's five running statistics in log2 units (the portable kernel's
  arithmetic, scales folded on full tiles). On a full tile a warpgroup waits for side 1's product
  alone and takes side 1's terms while the tensor cores still run side 2's; a shared store of the
  side-1 row sums before the second wait keeps ptxas from sinking those exponentials past it.
  While one warpgroup runs its exponentials, the other's products occupy the tensor cores.

Why a second forward: Triton 3.6 cannot warp-specialize this loop on Hopper, and the portable
kernel runs products and softmax in the same warps one after the other.

Scope (`select.py`): 16-bit inputs, head dims 64 or 128, positive scales, contiguous 16-byte
aligned inputs, sm_90. Dense or packed sequences of any lengths: a last partial key tile and the
next packed sequence's keys are masked, TMA boxes past the tensor read zeros, rows past a
sequence are not written. Block masks and windows (LISTED): the schedule's key-tile lists of
128 x 128 tiles, partial tiles masked as their flags say (common._partial_allowed's rules),
dense sequences only. A row whose scores are all -inf by value reads NaN, as in the portable
kernel.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import mbarrier

from streamkl.backends.base import new_outputs, write_tail_rows
from streamkl.backends.triton.common import (
    broadcast_strides,
    cdiv,
    group_sizes,
    listed,
    log2_scales,
    row_strides,
    stat_strides,
    window_bounds,
)
from streamkl.backends.triton.gluon.common import _listed_allowed, _load_then_stream, flat_descriptor
from streamkl.backends.triton.launch import Bound, launcher
from streamkl.problem import Problem

BLOCK_M = 128  # query rows a program: two consumer warpgroups of 64
BLOCK_N = 128  # keys a tile


def stages(dim: int) -> int:
    """Ring slots: both query tiles and STAGES slots of both key tiles fit the H200's 227 KB
    (D=128: 64 KB + 2 x 64 KB; D=64: 32 KB + 3 x 32 KB)."""
    return 2 if dim > 64 else 3


@gluon.jit
def _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc):
    """A key tile every key of which is allowed to every row: scales folded, the maxima on the
    raw products, one FMA per exponent argument (forward._fold_stats)."""
    m1_new = gl.maximum(m1, gl.max(r1, axis=1) * scale1)
    m2_new = gl.maximum(m2, gl.max(r2, axis=1) * scale2)
    t1s = r1 * scale1 - m1_new[:, None]
    t2s = r2 * scale2 - m2_new[:, None]
    e1 = gl.exp2(t1s)
    alpha1 = gl.exp2(m1 - m1_new)
    sum1 = gl.sum(e1, axis=1)
    l1 = l1 * alpha1 + sum1
    acc = acc * alpha1 + (gl.sum(e1 * (t1s - t2s), axis=1) + (m1_new - m2_new) * sum1)
    l2 = l2 * gl.exp2(m2 - m2_new) + gl.sum(gl.exp2(t2s), axis=1)
    return m1_new, m2_new, l1, l2, acc

@gluon.jit
def _full_tile_side1(r1, scale1, m1):
    """`_full_tile`'s side-1 terms, which need side 1's product only: (m1_new, t1s,
    e1, alpha1, sum1), taken while the tensor cores run side 2's product."""
    m1_new = gl.maximum(m1, gl.max(r1, axis=1) * scale1)
    t1s = r1 * scale1 - m1_new[:, None]
    e1 = gl.exp2(t1s)
    alpha1 = gl.exp2(m1 - m1_new)
    return m1_new, t1s, e1, alpha1, gl.sum(e1, axis=1)

@gluon.jit
def _full_tile_side2(r2, scale2, side1, m2, l1, l2, acc):
    """The rest of `_full_tile` once side 2's product is in (the same arithmetic;
    `_full_tile` does not call the two halves, as that reorders the default build's PTX)."""
    m1_new, t1s, e1, alpha1, sum1 = side1
    m2_new = gl.maximum(m2, gl.max(r2, axis=1) * scale2)
    t2s = r2 * scale2 - m2_new[:, None]
    l1 = l1 * alpha1 + sum1
    acc = acc * alpha1 + (gl.sum(e1 * (t1s - t2s), axis=1) + (m1_new - m2_new) * sum1)
    l2 = l2 * gl.exp2(m2 - m2_new) + gl.sum(gl.exp2(t2s), axis=1)
    return m1_new, m2_new, l1, l2, acc

@gluon.jit
def _early_tile(t1, t2, sink, empty_bar, scale1, scale2, m1, m2, l1, l2, acc):
    """A full tile: wait for side 1's product alone, take its terms, store their row
    sums to `sink` (a shared store that keeps the exponentials before the next wait in ptxas's
    schedule), wait for side 2's, release the slot, finish the statistics."""
    r1 = hopper.warpgroup_mma_wait(1, deps=[t1])
    side1 = _full_tile_side1(r1, scale1, m1)
    sink.store(side1[4])
    r2 = hopper.warpgroup_mma_wait(0, deps=[t2])
    mbarrier.arrive(empty_bar, count=1)  # both products are in registers
    return _full_tile_side2(r2, scale2, side1, m2, l1, l2, acc)

@gluon.jit
def _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc):
    """A key tile with masked scores (log2 units, -inf where not allowed; diff = s1 - s2 where
    both sides allow, else 0): forward._fwd_step's masked branch. Rows without an allowed key
    yet keep max -inf and shift by 0, so no inf - inf appears."""
    m1_new = gl.maximum(m1, gl.max(s1, axis=1))
    m2_new = gl.maximum(m2, gl.max(s2, axis=1))
    shift1 = gl.where(m1_new == float("-inf"), 0.0, m1_new)
    shift2 = gl.where(m2_new == float("-inf"), 0.0, m2_new)
    alpha1 = gl.exp2(m1 - shift1)
    e1 = gl.exp2(s1 - shift1[:, None])
    l1 = l1 * alpha1 + gl.sum(e1, axis=1)
    acc = acc * alpha1 + gl.sum(e1 * diff, axis=1)
    l2 = l2 * gl.exp2(m2 - shift2) + gl.sum(gl.exp2(s2 - shift2[:, None]), axis=1)
    return m1_new, m2_new, l1, l2, acc


@gluon.jit
def _tile_stats(r1, r2, tile, n_full, o_i, offset, len_k, scale1, scale2, m1, m2, l1, l2, acc,
                BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr, col_layout: gl.constexpr):
    """The five running statistics after one key tile's raw products r1, r2, in log2 units:
    forward._fold_stats on full tiles and forward._fwd_step's masked branch on the others,
    written again in Gluon (a Gluon kernel cannot call those Triton functions); the three
    change together. Tiles from n_full on are masked: keys past the sequence's len_k keys
    (TAIL: a last partial tile, or the next packed sequence's keys) and, causal, keys
    j > i + offset. Without either, no masked code is compiled."""
    if CAUSAL or TAIL:
        if tile < n_full:
            m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
        else:
            # key j is allowed to row i when j < len_k and, causal, j <= i + offset (both sides)
            o_j = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            allowed = o_j[None, :] < len_k
            if CAUSAL:
                allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
            s1 = gl.where(allowed, r1 * scale1, float("-inf"))
            s2 = gl.where(allowed, r2 * scale2, float("-inf"))
            diff = gl.where(allowed, s1 - s2, 0.0)
            m1_new, m2_new, l1, l2, acc = _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc)
    else:
        m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
    return m1_new, m2_new, l1, l2, acc

@gluon.jit
def _listed_tile_stats(r1, r2, visit, n_full, index, flags_list, o_i, len_q, len_k, window_left, window_right,
                       scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                       BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
    """`_tile_stats` for a schedule's key-tile list (block masks, windows): the visit-th listed
    tile, full (no masks) before n_full, else masked as its flags say, as forward._fwd_step and
    common._partial_allowed do: sequence bounds, causality and the window (causality folded
    into window_right, -1 unbounded), less the sides whose block pattern is off for the tile
    (OFF1 = 2, OFF2 = 4; the tile never straddles a mask block). row_flags: bit 0 a key
    allowed on side 1 only (uncovered row), bit 1 a key allowed on side 1."""
    if visit < n_full:
        m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
    else:
        tile_flags = gl.load(flags_list + visit).to(gl.int32)
        o_j = gl.load(index + visit) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
        a1, a2 = _listed_allowed(o_i[:, None], o_j[None, :], tile_flags, len_q, len_k, window_left, window_right)
        s1 = gl.where(a1, r1 * scale1, float("-inf"))
        s2 = gl.where(a2, r2 * scale2, float("-inf"))
        diff = gl.where(a1 & a2, s1 - s2, 0.0)
        only1 = gl.max((a1 & ~a2).to(gl.int32), axis=1)
        row_flags = row_flags | only1 | (gl.max(a1.to(gl.int32), axis=1) * 2)
        m1_new, m2_new, l1, l2, acc = _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc)
    return m1_new, m2_new, l1, l2, acc, row_flags

@gluon.jit
def _plain_tile(t1, t2, empty_bar, i, n_full, n_full_listed, index, flags_list, o_i, offset, len_q, len_k,
                 window_left, window_right, scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                 BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr, LISTED: gl.constexpr,
                 col_layout: gl.constexpr):
    """A key tile the plain way: wait for both products, release the slot, then the statistics
    (`_listed_tile_stats` for a schedule's list, else `_tile_stats`); row_flags as it comes
    without a list."""
    r1, r2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
    mbarrier.arrive(empty_bar, count=1)  # both products are in registers
    if LISTED:
        m1, m2, l1, l2, acc, row_flags = _listed_tile_stats(
            r1, r2, i, n_full_listed, index, flags_list, o_i, len_q, len_k, window_left, window_right,
            scale1, scale2, m1, m2, l1, l2, acc, row_flags, BLOCK_N, col_layout)
    else:
        m1, m2, l1, l2, acc = _tile_stats(r1, r2, i, n_full, o_i, offset, len_k, scale1, scale2, m1, m2, l1,
                                          l2, acc, BLOCK_N, CAUSAL, TAIL, col_layout)
    return m1, m2, l1, l2, acc, row_flags

@gluon.jit
def _consumer(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
              KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
              row0, len_q, len_k, n_tiles, scale1, scale2,
              n_full_listed, index, flags_list, window_left, window_right,
              WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              TAIL: gl.constexpr, LISTED: gl.constexpr):
    """One warpgroup, 64 query rows (row0 + 64 * WG ...) of a sequence of len_q rows against
    len_k keys: the products and the online statistics of every key tile, then the rows'
    (KL, lse1, lse2, E), rows past len_q not written. LISTED: the key tiles are a schedule's
    list (index, flags_list; the first n_full_listed full), with the plain variant only."""
    HALF: gl.constexpr = 64
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
    first = row0 + WG * HALF  # sequence-local index of this warpgroup's first row
    o_i = first + gl.arange(0, HALF, layout=row_layout)
    m1 = gl.full([HALF], float("-inf"), gl.float32, row_layout)
    m2 = gl.full([HALF], float("-inf"), gl.float32, row_layout)
    l1 = gl.zeros([HALF], gl.float32, row_layout)
    l2 = gl.zeros([HALF], gl.float32, row_layout)
    acc = gl.zeros([HALF], gl.float32, row_layout)
    row_flags = gl.zeros([HALF], gl.int32, row_layout)  # LISTED: bit 0 uncovered, bit 1 side-1 key
    zero = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
    offset = len_k - len_q  # causal (bottom-right aligned): row i sees keys j <= i + offset
    # key tiles before n_full allow every key to every row of this warpgroup
    n_full = gl.minimum(len_k // BLOCK_N, n_tiles)
    if CAUSAL:
        n_full = gl.minimum(gl.maximum(first + offset + 1, 0) // BLOCK_N, n_full)
    a1 = q1_smem.slice(WG * HALF, HALF)
    a2 = q2_smem.slice(WG * HALF, HALF)
    mbarrier.wait(q_bar, 0)
    for i in range(n_tiles):
        slot = i % STAGES
        mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
        t1 = hopper.warpgroup_mma(a1, k1_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        t2 = hopper.warpgroup_mma(a2, k2_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
        if not (CAUSAL or TAIL or LISTED):  # every tile full: side 1's terms under side 2's
            m1, m2, l1, l2, acc = _early_tile(t1, t2, sink, empty.index(slot), scale1, scale2, m1, m2, l1,
                                              l2, acc)
        else:  # the same on the full tiles (a list's first n_full_listed), the others masked
            if LISTED:
                n_early = n_full_listed
            else:
                n_early = n_full
            if i < n_early:
                m1, m2, l1, l2, acc = _early_tile(t1, t2, sink, empty.index(slot), scale1, scale2, m1, m2,
                                                  l1, l2, acc)
            else:
                m1, m2, l1, l2, acc, row_flags = _plain_tile(
                    t1, t2, empty.index(slot), i, n_full, n_full_listed, index, flags_list, o_i, offset,
                    len_q, len_k, window_left, window_right, scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                    BLOCK_N, CAUSAL, TAIL, LISTED, col_layout)
    # finalize (SPEC 4) as the Triton kernel does, natural logs. Both sides share one structure
    # (no masks here), so no row is uncovered; a row is empty when it sees no key (len_k == 0,
    # or causal with i + offset < 0): KL 0, lse -inf, E 0, whatever its values
    if LISTED:  # from the structure the schedule and the masked tiles saw (full tiles: bit 1)
        row_flags = row_flags | gl.where(n_full_listed > 0, 2, 0)
        empty_row = (row_flags & 2) == 0
    elif CAUSAL:
        empty_row = o_i + offset < 0
    else:
        empty_row = gl.full([HALF], len_k, gl.int32, row_layout) == 0
    lse1 = (m1 + gl.log2(l1)) * 0.6931471805599453
    lse2 = (m2 + gl.log2(l2)) * 0.6931471805599453
    expect = gl.where(empty_row, 0.0, acc / l1 * 0.6931471805599453)
    kl = expect - ((m1 - m2) + gl.log2(l1) - gl.log2(l2)) * 0.6931471805599453
    kl = gl.where((l1 == 0.0) | (l2 == 0.0), float("nan"), kl)
    if LISTED:
        kl = gl.where((row_flags & 1) != 0, float("inf"), kl)  # E stays finite: the backward needs it
    kl = gl.where(empty_row, 0.0, kl)
    rows = o_i.to(gl.int64)
    keep = o_i < len_q
    gl.store(KL + o_kl + rows * stride_kln, kl, mask=keep)
    gl.store(LSE1 + o_stat + rows * stride_sn, lse1, mask=keep)
    gl.store(LSE2 + o_stat + rows * stride_sn, lse2, mask=keep)
    gl.store(EXPECT + o_stat + rows * stride_sn, expect, mask=keep)

@gluon.jit
def _consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
                KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                row0, len_q, len_k, n_tiles, scale1, scale2,
                n_full_listed, index, flags_list, window_left, window_right,
                BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr,
                LISTED: gl.constexpr):
    _consumer(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
              KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
              row0, len_q, len_k, n_tiles, scale1, scale2,
              n_full_listed, index, flags_list, window_left, window_right,
              1, BLOCK_N, STAGES, CAUSAL, TAIL, LISTED)

@gluon.jit
def _kl_fwd_gluon_kernel(
    q1_desc, k1_desc, q2_desc, k2_desc,  # 2-D [tokens, H * D] views, boxes [128, D] / [BLOCK_N, D]
    KL, LSE1, LSE2, EXPECT,
    CU_Q, CU_K,  # varlen: cu_seqlens (int32); else unused
    KV_COUNT, KV_FULL, KV_INDEX, KV_FLAGS,  # LISTED: the schedule (sparse/schedule.py); else unused
    stride_klb, stride_kln, stride_klh,
    stride_sb, stride_sh, stride_sn,
    stride_cs, stride_ch, stride_ct,  # the schedule's counts [S', H', nQ] (broadcast strides)
    stride_is, stride_ih, stride_it,  # its lists [S', H', nQ, nK], the last dim contiguous
    window_left, window_right,  # LISTED: causality folded into window_right; -1 unbounded
    seqlen_q, seqlen_k, heads, group1, group2,  # varlen: the longest sequences
    scale1, scale2,  # scale * log2(e), both > 0
    q_programs,
    D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
    CAUSAL: gl.constexpr, VARLEN: gl.constexpr,
    TAIL: gl.constexpr,  # varlen, or Nk not a multiple of BLOCK_N: a last key tile to mask
    LISTED: gl.constexpr,  # block masks or a window: walk the schedule's key-tile lists
):
    # one flat grid axis, query tiles fastest, the last (longest under causality) first
    pid_bh = gl.program_id(0) // q_programs
    pid_q = q_programs - 1 - (gl.program_id(0) - pid_bh * q_programs)
    seq = pid_bh // heads
    head = pid_bh % heads
    row0 = pid_q * 128
    if VARLEN:  # packed sequences: rows start_q ..., keys start_k ...; grid sized by the longest
        start_q = gl.load(CU_Q + seq)
        len_q = gl.load(CU_Q + seq + 1) - start_q
        start_k = gl.load(CU_K + seq)
        len_k = gl.load(CU_K + seq + 1) - start_k
        row_base = start_q.to(gl.int64)  # the outputs' rows are packed too
    else:
        start_q = seq * seqlen_q
        len_q = seqlen_q
        start_k = seq * seqlen_k
        len_k = seqlen_k
        row_base = 0
    if row0 >= len_q:  # past this sequence's rows
        return
    offset = len_k - len_q  # causal: row i sees keys j <= i + offset
    if LISTED:  # this query tile's visited key tiles, full ones first
        o_count = seq * stride_cs + head * stride_ch + pid_q * stride_ct
        n_tiles = gl.load(KV_COUNT + o_count)
        n_full_listed = gl.load(KV_FULL + o_count)
        o_list = seq.to(gl.int64) * stride_is + head * stride_ih + pid_q * stride_it
        index = KV_INDEX + o_list
        flags_list = KV_FLAGS + o_list
    else:
        n_tiles = (len_k + BLOCK_N - 1) // BLOCK_N
        if CAUSAL:
            n_tiles = gl.minimum(gl.maximum(row0 + 128 + offset + BLOCK_N - 1, 0) // BLOCK_N, n_tiles)
        n_full_listed = n_tiles
        index = KV_INDEX
        flags_list = KV_FLAGS

    q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [128, D1], q1_desc.layout)
    q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [128, D2], q2_desc.layout)
    k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
    k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES, BLOCK_N, D2], k2_desc.layout)
    q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    # each consumer warpgroup's side-1 row sums, stored before it waits for side 2's product: ptxas
    # keeps that shared store before the wait, and with it the exponentials the sums need
    sink0 = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    sink1 = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
    ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(q_bar, count=1)
    for s in gl.static_range(STAGES):
        mbarrier.init(ready.index(s), count=1)
        mbarrier.init(empty.index(s), count=2)  # released by both consumer warpgroups
    hopper.fence_async_shared()

    seq64 = seq.to(gl.int64)
    o_kl = seq64 * stride_klb + head * stride_klh + row_base * stride_kln
    o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
    # TMA boxes may run past the sequence (into the next one: masked) or the tensor (zeros)
    q_row = start_q + row0
    k_row = start_k
    gl.warp_specialize(
        [
            (_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink0,
                         KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                         row0, len_q, len_k, n_tiles, scale1, scale2,
                         n_full_listed, index, flags_list, window_left, window_right,
                         0, BLOCK_N, STAGES, CAUSAL, TAIL, LISTED)),
            (_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink1,
                           KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                           row0, len_q, len_k, n_tiles, scale1, scale2,
                           n_full_listed, index, flags_list, window_left, window_right,
                           BLOCK_N, STAGES, CAUSAL, TAIL, LISTED)),
            (_load_then_stream, (q1_desc, q2_desc, q1_smem, q2_smem, q_bar, q_row, head * D1, head * D2,
                                 k1_desc, k2_desc, k1_smem, k2_smem, ready, empty, k_row,
                                 (head // group1) * D1, (head // group2) * D2, n_tiles, index, BLOCK_N, STAGES,
                                 LISTED, 1, 0, False, 1, 0, False)),
        ],
        [4, 1],
        [232, 40],
    )



class Plan(NamedTuple):
    """What a launch takes that the call's tensors do not change."""

    grid: tuple
    run: Bound  # the kernel with every argument after the call's tensors fixed


def plan(problem: Problem, schedule=None) -> Plan:
    """The launch plan; with block masks or a window, `schedule` has 128 x 128 tiles."""
    varlen = problem.is_varlen
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    q_programs = cdiv(problem.seqlen_q, BLOCK_M)
    cu = (problem.cu_seqlens_q, problem.cu_seqlens_k) if varlen else (None, None)
    is_listed = listed(problem)
    if is_listed:
        assert schedule is not None and (schedule.block_q, schedule.block_k) == (BLOCK_M, BLOCK_N)
        lists = (schedule.kv_count, schedule.kv_full, schedule.kv_index, schedule.kv_partial)
        list_strides = (*broadcast_strides(schedule.kv_count), *broadcast_strides(schedule.kv_index)[:3])
        window = window_bounds(problem)
    else:
        lists, list_strides, window = (None,) * 4, (0,) * 6, (-1, -1)
    rows = torch.empty(problem.row_shape, device="meta")  # the outputs' strides (new_outputs: contiguous)
    stats = torch.empty(problem.lse_shape, device="meta")
    scalars = (
        *row_strides(rows, varlen), *stat_strides(stats, varlen), *list_strides, *window,
        problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2,
        scale1, scale2, q_programs,
    )  # fmt: skip
    constexprs = dict(D1=problem.dim1, D2=problem.dim2, BLOCK_N=BLOCK_N, STAGES=stages(max(problem.dim1, problem.dim2)),
                      CAUSAL=problem.causal, VARLEN=varlen, TAIL=varlen or problem.seqlen_k % BLOCK_N != 0,
                      LISTED=is_listed)
    unused = torch.empty(1, dtype=torch.int32, device=problem.device)  # the pointers no branch reads
    tensors = tuple(unused if t is None else t for t in (*cu, *lists))
    run = launcher(_kl_fwd_gluon_kernel, 4, None, **constexprs).bind((*tensors, *scalars))
    return Plan((q_programs * problem.batch * problem.heads,), run)


def kl_forward(problem: Problem, launch_plan: Plan, q1, k1, q2, k2):
    """(kl_rows, lse1, lse2, expect) through the Gluon kernel (`select.py` decided it serves)."""
    kl_rows, lse1, lse2, expect = new_outputs(problem)
    write_tail_rows(problem, kl_rows, lse1, lse2, expect)  # varlen rows past cu_seqlens[-1]
    descs = (flat_descriptor(q1, BLOCK_M), flat_descriptor(k1, BLOCK_N), flat_descriptor(q2, BLOCK_M),
             flat_descriptor(k2, BLOCK_N))
    launch_plan.run.planned(launch_plan.grid, *descs, kl_rows, lse1, lse2, expect)
    return kl_rows, lse1, lse2, expect


def compile_for_hopper(dtype=torch.bfloat16, dim=128, causal: bool = False, varlen: bool = False,
                       listed: bool = False):
    """The forward compiled for sm_90a without a GPU (`common.compile_sm90`) at one configuration;
    `dim` one head dim or (teacher's, student's)."""
    from streamkl.backends.triton.gluon.common import compile_sm90

    dim1, dim2 = dim if isinstance(dim, tuple) else (dim, dim)
    t1, t2 = (torch.empty(2, BLOCK_M, 4, d, dtype=dtype) for d in (dim1, dim2))
    descs = [flat_descriptor(t, rows) for t, rows in ((t1, BLOCK_M), (t1, BLOCK_N), (t2, BLOCK_M), (t2, BLOCK_N))]
    stats = torch.empty(4, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32)
    examples = dict(zip(("q1_desc", "k1_desc", "q2_desc", "k2_desc"), descs))
    examples.update(KL=stats, LSE1=stats, LSE2=stats, EXPECT=stats, CU_Q=cu, CU_K=cu, KV_COUNT=cu, KV_FULL=cu,
                    KV_INDEX=cu, KV_FLAGS=torch.zeros(3, dtype=torch.int8))
    for name in ("stride_klb", "stride_kln", "stride_klh", "stride_sb", "stride_sh", "stride_sn", "seqlen_q",
                 "seqlen_k", "heads", "group1", "group2", "q_programs"):
        examples[name] = 1024
    for name in ("stride_cs", "stride_ch", "stride_ct", "stride_is", "stride_ih", "stride_it", "window_left",
                 "window_right"):
        examples[name] = 7
    examples.update(scale1=0.5, scale2=0.5)
    constexprs = dict(D1=dim1, D2=dim2, BLOCK_N=BLOCK_N, STAGES=stages(max(dim1, dim2)), CAUSAL=causal,
                      VARLEN=varlen, TAIL=varlen, LISTED=listed)
    return compile_sm90(_kl_fwd_gluon_kernel, examples, constexprs)
