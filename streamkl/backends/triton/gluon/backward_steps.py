"""The Gluon backward's per-step pieces: which query rows a step takes, their statistics, the
probabilities and dS of a step (dense, or a listed pair full or partial), and the dq tiles' TMA
reductions. Arithmetic in log2 units, as the portable backward (backward._tile_dscores)."""

from __future__ import annotations

from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia import hopper
from triton.experimental.gluon.language.nvidia.hopper import tma

from streamkl.backends.triton._compat import tma_reduce_add as _tma_reduce_add
from streamkl.backends.triton.gluon.common import _listed_allowed


@gluon.jit
def _reduce_dq(dq_desc, dq_smem, values, row, col):
    """dq2[row:row + 64, col:col + 64] += values through this warpgroup's float32 shared tile:
    the previous reduction must have read it first (`store_wait`, a step later: long done)."""
    tma.store_wait(0)
    dq_smem.store(values)
    hopper.fence_async_shared()
    _tma_reduce_add(dq_desc, [row, col], dq_smem)

@gluon.jit
def _dq_out(dq, out_scale2, DQ_RAW: gl.constexpr):
    """A dq2 tile as added to the float32 buffer: times the output scale, or as it is (DQ_RAW: the
    host's flush scales it)."""
    if DQ_RAW:
        return dq
    return dq * out_scale2

@gluon.jit
def _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M: gl.constexpr):
    """DIAG: how many of a causal program's steps, from its first, meet the diagonal (masked)."""
    x = gl.maximum(k0 + 2 * 64 - 1 - offset, 0)  # steps from row 0 below x: on the diagonal
    return gl.minimum(gl.maximum((x + BLOCK_M - 1) // BLOCK_M - first_tile, 0), n_tiles)

@gluon.jit
def _step_rows(i, index, first_tile, n_per, len_q, BLOCK_M: gl.constexpr, LISTED: gl.constexpr,
               TAIL: gl.constexpr, GQA2: gl.constexpr):
    """Step i's first query row (sequence-local), the first row it owns (TAIL: earlier ones
    belong to the step before) and its query head within the group (GQA2)."""
    h_in = 0
    if LISTED:  # step i: half i % 2 of the (i // 2)-th listed 128-row query tile
        tile_row0 = gl.load(index + i // 2) * 128 + (i % 2) * BLOCK_M
    else:
        t = i
        if GQA2:  # step i: tile t of the group's query head h_in (n_per tiles a head)
            h_in = i // n_per
            t = i - h_in * n_per
        tile_row0 = (first_tile + t) * BLOCK_M
    fresh_row0 = tile_row0
    if TAIL:  # a last partial step shifted back to end at the sequence's last row
        tile_row0 = gl.minimum(tile_row0, len_q - BLOCK_M)
    return tile_row0, fresh_row0, h_in

@gluon.jit
def _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH: gl.constexpr, p_in=None):
    """(p, q, t) of a step's unmasked scores: with BOTH, t = log2(p / q) first, so that p, q and t
    are all that stay live (registers); else t is p (unused)."""
    if BOTH:
        u2 = st2 * scale2 - lse2[:, None]
        t = st1 * scale1 - lse1[:, None] - u2
        p = gl.exp2(u2 + t)
        q = gl.exp2(u2)
    else:
        if p_in is None:
            p = gl.exp2(st1 * scale1 - lse1[:, None])
        else:  # (EARLY_P: computed while side 2's product ran)
            p = p_in
        q = gl.exp2(st2 * scale2 - lse2[:, None])
        t = p
    return p, q, t

@gluon.jit
def _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2: gl.constexpr):
    """The statistics' and g's offsets of query head h_in of the group (GQA2), else as given."""
    if GQA2:
        return o_stat + h_in * stride_sh, o_grad + h_in * stride_gh
    return o_stat, o_grad

@gluon.jit
def _step_ahead(j, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
                stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M: gl.constexpr, LISTED: gl.constexpr,
                TAIL: gl.constexpr, GQA2: gl.constexpr, BOTH: gl.constexpr, layout: gl.constexpr,
                G_ONE: gl.constexpr = False):
    """Step j's rows (`_step_rows`) and raw statistics (lse1, lse2, g and with BOTH
    E), loaded a step before they are used; j == n_tiles (past the last step) loads nothing (the
    rows clamped to a listed step, the statistics masked: such a row may be past the sequence).
    G_ONE: g is not loaded (lse1 in its place)."""
    j_in = gl.maximum(gl.minimum(j, n_tiles - 1), 0)
    tile_row0, fresh_row0, h_in = _step_rows(j_in, index, first_tile, n_per, len_q, BLOCK_M, LISTED, TAIL,
                                             GQA2)
    o_stat_j, o_grad_j = _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2)
    o_r = gl.arange(0, BLOCK_M, layout=layout).to(gl.int64)
    stats = o_stat_j + (o_stat_j * 0 + tile_row0) * stride_sn + o_r * stride_sn
    mask = (o_r * 0 + j) < n_tiles
    lse1 = gl.load(LSE1 + stats, mask=mask, other=0.0)
    lse2 = gl.load(LSE2 + stats, mask=mask, other=0.0)
    if G_ONE:
        g = lse1  # (unused)
    else:
        g = gl.load(GRAD + o_grad_j + (o_grad_j * 0 + tile_row0) * stride_gn + o_r * stride_gn, mask=mask,
                    other=0.0)
    if BOTH:
        e_raw = gl.load(EXPECT + stats, mask=mask, other=0.0)
    else:
        e_raw = lse1  # (unused)
    return tile_row0, fresh_row0, h_in, lse1, lse2, g, e_raw

@gluon.jit
def _times_g(g, x, G_ONE: gl.constexpr):
    """g x, g a row's upstream gradient; G_ONE (one g for every row): x, g in the output scales."""
    if G_ONE:
        return x
    return g[:, None] * x

@gluon.jit
def _ds1(g, p, t, e_row, G_ONE: gl.constexpr):
    """BOTH's dS1 = g p (t ln 2 + E'), t = log2(p / q), E' the row's minus KL; G_ONE: without g."""
    if G_ONE:
        return p * (t * 0.6931471805599453 + e_row[:, None])
    return g[:, None] * p * (t * 0.6931471805599453 + e_row[:, None])

@gluon.jit
def _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH: gl.constexpr, p_in=None,
               G_ONE: gl.constexpr = False):
    """LISTED: (dS2, dS1) of a step of a full pair (every row has keys on both sides); dS1 is
    dS2 without BOTH."""
    p, q, t = _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH, p_in)
    ds = _times_g(g, q - p, G_ONE)
    ds1 = ds
    if BOTH:
        ds1 = _ds1(g, p, t, e_row, G_ONE)
    return ds, ds1

@gluon.jit
def _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j, flag_ptr, len_q, len_k,
                  window_left, window_right, BOTH: gl.constexpr, G_ONE: gl.constexpr = False):
    """LISTED: (dS2, dS1) of a step of a partial pair: backward._tile_dscores's masks, transposed."""
    tile_flags = gl.load(flag_ptr).to(gl.int32)
    a1, a2 = _listed_allowed(o_i[:, None], o_j[None, :], tile_flags, len_q, len_k, window_left, window_right)
    p = gl.exp2(gl.where(a1, st1 * scale1, float("-inf")) - lse1[:, None])
    q = gl.exp2(gl.where(a2, st2 * scale2, float("-inf")) - lse2[:, None])
    ds = gl.where(a2, _times_g(g, q - p, G_ONE), 0.0)  # dS2 kept to side 2's support
    ds1 = ds
    if BOTH:  # (side 2 allows every key side 1 does: `applies_both`); selected, as t and E are NaN
        # on rows without keys (lse +inf, E -inf - -inf)
        t = (st1 * scale1 - lse1[:, None]) - (st2 * scale2 - lse2[:, None])
        ds1 = gl.where(a1, _ds1(g, p, t, e_row, G_ONE), 0.0)
    return ds, ds1

@gluon.jit
def _step_stats(tile_row0, h_in, LSE1, LSE2, GRAD, o_stat, o_grad, stride_sn, stride_gn, stride_sh, stride_gh,
                BLOCK_M: gl.constexpr, GQA2: gl.constexpr, layout: gl.constexpr):
    """A step's rows' statistics (lse1, lse2, g) in `layout`: 64-bit bases from the step's first
    row, then the rows' offsets (64-bit too, so that with a row stride of 1 their constant parts
    become the loads' immediate offsets rather than a pointer each)."""
    o_stat_i, o_grad_i = _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2)
    o_r = gl.arange(0, BLOCK_M, layout=layout).to(gl.int64)
    stats = o_stat_i + (o_stat_i * 0 + tile_row0) * stride_sn
    grads = o_grad_i + (o_grad_i * 0 + tile_row0) * stride_gn
    lse1 = gl.load(LSE1 + stats + o_r * stride_sn)
    lse2 = gl.load(LSE2 + stats + o_r * stride_sn)
    g = gl.load(GRAD + grads + o_r * stride_gn)
    return lse1, lse2, g
