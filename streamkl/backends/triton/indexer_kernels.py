"""Triton kernels of the DSA indexer loss (SPEC 8): teacher lse and forward statistics (the
backward is in `indexer_backward.py`).

Scores work in base 2 (`exp2`, scores times `scale * log2(e)`); statistics are written in natural
logs. Every kernel walks (query tile, key tile) pairs of one sequence and builds the tile's mask
from the structure (sequence bounds, bottom-right causality) and, in the top-k stage, from each
row's selection sorted ascending (`SEL`, unusable slots BIG_INDEX at the end). The lse and forward
kernels walk every row's selection with a cursor as they walk the key tiles in order: the next
tile to visit is the one of the smallest next key over the tile's rows (tiles no row selected are
not visited), and a tile's keys are read for all rows at once, CHUNK slots a load (one load for
most tiles). The backward, one program per tile, starts its rows' cursors by a binary search and
skips tiles no row selected by a per-(query tile, key tile) table (`TILES`).

Layout of the pointers each kernel gets: inputs at any strides with a contiguous last dim;
head-major statistics `[B, H, N]` / `[H, T]` through (batch, head) strides and a row offset;
row statistics `[B, N]` / `[T]` through a batch stride and a row offset (varlen: batch stride 0,
row offset cu_seqlens[seq]).
"""

from __future__ import annotations

import triton
import triton.language as tl

LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
BIG_INDEX = tl.constexpr(1 << 30)  # the host's filler of unusable selection slots; sorts after every key


@triton.jit
def _span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN: tl.constexpr):
    """(first query row, query length, first key row, key length) of sequence `seq`."""
    if VARLEN:
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        len_k = tl.load(CU_K + seq + 1) - k_start
    else:
        q_start = seq * 0
        len_q = seqlen_q
        k_start = seq * 0
        len_k = seqlen_k
    return q_start, len_q, k_start, len_k


@triton.jit
def _tile_order(pid, tiles, CAUSAL: tl.constexpr):
    """(query tile, the rest of the program id) of a flat grid; causal: the longest rows first."""
    tile = pid % tiles
    if CAUSAL:
        tile = tiles - 1 - tile
    return tile, pid // tiles


@triton.jit
def _descriptor_batch(seq, VARLEN: tl.constexpr):
    """The descriptors' leading coordinate: the batch entry, or 0 for packed rows (one [1, T] batch)."""
    if VARLEN:
        return seq * 0
    else:
        return seq


@triton.jit
def _window(second, lo0, hi0, lo1, hi1, flat0, len_q):
    """A launch's row window (flat rows [lo0, hi0), or [lo1, hi1) when `second`) within one sequence
    whose row 0 is flat row `flat0`: (r0, r1) its rows in the sequence, and `shift` that maps a
    sequence row r to its window row r + shift (the windows' rows one after the other)."""
    lo = tl.where(second, lo1, lo0)
    hi = tl.where(second, hi1, hi0)
    r0 = tl.maximum(lo - flat0, 0)
    r1 = tl.minimum(hi - flat0, len_q)
    return r0, r1, flat0 - lo + tl.where(second, hi0 - lo0, 0)


@triton.jit
def _selection_kernel(
    TOP, SEL, TILES, CU_Q, CU_K, stride_top, lo0, hi0, lo1, batch, seqlen_q, seqlen_k, topk, q_tiles, k_tiles,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, TABLE: tl.constexpr, BLOCK_K: tl.constexpr,
    TILE_M: tl.constexpr, TILE_N: tl.constexpr,
):
    """One program per window row (flat row lo0 + id in the first window, lo1 + id - (hi0 - lo0)
    after it): the row's selection sorted ascending into SEL's row `id`, the slots it cannot use
    (-1, past its causal limit, a row of no sequence) BIG_INDEX; with TABLE, a 1 in TILES
    [S, q_tiles, k_tiles] for every (query tile, key tile) it selects a key of."""
    w = tl.program_id(0)
    row = tl.where(w < hi0 - lo0, lo0 + w, lo1 + w - (hi0 - lo0))
    if VARLEN:  # the sequence: the first of cu_seqlens[1:] past the row
        first = row * 0 + 1
        last = row * 0 + batch + 1
        while first < last:
            mid = (first + last) // 2
            past = tl.load(CU_Q + mid) > row
            first = tl.where(past, first, mid + 1)
            last = tl.where(past, mid, last)
        inside = first <= batch
        seq = tl.minimum(first, batch) - 1
    else:
        inside = row >= 0
        seq = row // seqlen_q
    q_start, len_q, k_start, len_k = _span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    pos = row - q_start if VARLEN else row % seqlen_q
    limit = len_k
    if CAUSAL:
        limit = tl.minimum(len_k, pos + len_k - len_q + 1)
    o_k = tl.arange(0, BLOCK_K)
    keys = tl.load(TOP + row.to(tl.int64) * stride_top + o_k, mask=o_k < topk, other=-1)
    keys = tl.sort(tl.where((keys >= 0) & (keys < limit) & inside, keys, BIG_INDEX))
    tl.store(SEL + w.to(tl.int64) * topk + o_k, keys, mask=o_k < topk)
    if TABLE:
        tile = (seq.to(tl.int64) * q_tiles + pos // TILE_M) * k_tiles + keys // TILE_N
        tl.store(TILES + tile, tl.full([BLOCK_K], 1, tl.uint8), mask=keys < BIG_INDEX)


@triton.jit
def _mm(b_a, b_b, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """a @ b with float32 accumulation; full float32 (no TF32) for float32 inputs."""
    if INTERPRET:
        # the interpreter multiplies 16-bit blocks wrongly; their float32 product is exact
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(b_a, b_b, input_precision="ieee")
    else:
        return tl.dot(b_a, b_b)


@triton.jit
def _lower_bound(p_sel, hi, target, STEPS_K: tl.constexpr):
    """[BM] int32: in each row's sorted selection p_sel[r][0 : hi[r]], the first slot whose key is
    >= target (a scalar)."""
    lo = hi * 0
    for _ in tl.static_range(STEPS_K):
        live = lo < hi
        mid = (lo + hi) // 2
        value = tl.load(p_sel + mid, mask=live, other=0)
        right = live & (value < target)
        lo = tl.where(right, mid + 1, lo)
        hi = tl.where(right | (~live), hi, mid)
    return lo


@triton.jit
def _or(a, b):
    return a | b


@triton.jit
def _key_at(p_sel, cursor, end):
    """[BM] int32: each row's selected key in slot `cursor` (BIG_INDEX at or past the row's `end`)."""
    return tl.load(p_sel + cursor, mask=cursor < end, other=BIG_INDEX)


@triton.jit
def _tile_selection(p_sel, cursor, end, first, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    """Each row's selected keys in [first, first + BLOCK_N) (BLOCK_N <= 128), read from its sorted
    selection p_sel[r][cursor[r] : end[r]] whose keys are all >= first: (four [BM] int32 words of
    bits, key first + 32 w + b as bit b of word w; the cursor past them; the row's next key or
    BIG_INDEX). 32-bit words: 64-bit ones double the registers of the expanded [BM, BN] mask.

    The slots are read CHUNK at a time for all rows at once (one load of [BM, CHUNK] contiguous
    runs), again only while some row's chunk lay wholly inside the tile: one load per tile for
    most tiles, whatever the number of keys a row has in it."""
    o_c = tl.arange(0, CHUNK)
    word0 = cursor * 0
    word1 = cursor * 0
    word2 = cursor * 0
    word3 = cursor * 0
    next_key = cursor * 0
    more = tl.max(cursor, axis=0) >= 0  # a true scalar
    while more:
        slot = cursor[:, None] + o_c[None, :]  # [BM, CHUNK]
        keys = tl.load(p_sel[:, None] + slot, mask=slot < end[:, None], other=BIG_INDEX)
        rel = keys - first
        inside = rel < BLOCK_N  # a prefix of the chunk: the selection is sorted
        bit = tl.where(inside, 1, 0) << (rel & 31)
        word = rel >> 5
        word0 |= tl.reduce(tl.where(word == 0, bit, 0), 1, _or)
        word1 |= tl.reduce(tl.where(word == 1, bit, 0), 1, _or)
        word2 |= tl.reduce(tl.where(word == 2, bit, 0), 1, _or)
        word3 |= tl.reduce(tl.where(word == 3, bit, 0), 1, _or)
        taken = tl.sum(inside.to(tl.int32), axis=1)
        cursor += taken
        next_key = tl.min(tl.where(inside, BIG_INDEX, keys), axis=1)
        more = tl.max(taken, axis=0) == CHUNK
    return word0, word1, word2, word3, cursor, next_key


@triton.jit
def _selection_mask(word0, word1, word2, word3, o_j, first):
    """[BM, BN] bool from `_tile_selection`'s four words: key o_j[c] (in [first, first + 128)) is
    selected by row r."""
    rel = o_j - first  # [BN]
    index = (rel >> 5)[None, :]
    b_word = tl.where(index == 0, word0[:, None], word1[:, None])
    b_word = tl.where(index == 2, word2[:, None], b_word)
    b_word = tl.where(index == 3, word3[:, None], b_word)  # [BM, BN]
    return ((b_word >> (rel & 31)[None, :]) & 1) != 0


@triton.jit
def _allowed(o_i, o_j, len_q, len_k, CAUSAL: tl.constexpr):
    """[BM, BN] bool: the keys each row may range over by structure (sequence bounds, causality)."""
    m_ij = (o_i[:, None] < len_q) & (o_j[None, :] < len_k)
    if CAUSAL:
        m_ij = m_ij & (o_j[None, :] <= o_i[:, None] + (len_k - len_q))
    return m_ij


@triton.jit
def _teacher_probs(Q_DESC, K_DESC, LSE, desc_b, q_row, k_row, o_i, m_i, m_ij, stride_lh, heads, group, qk_scale,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IEEE: tl.constexpr,
                   INTERPRET: tl.constexpr):
    """T [BM, BN] float32: the mean over the teacher heads of each head's softmax, 0 off the mask.

    q_row, k_row: descriptor rows of the tiles' first query and key; LSE: the sequence's first row
    of head 0's lse."""
    b_t = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    # each head's lse is loaded one head ahead: its latency (an L2 read) hides behind a head's work
    b_lse_next = tl.load(LSE + o_i, mask=m_i, other=0.0)
    for h in tl.range(0, heads):
        b_q = Q_DESC.load([desc_b, q_row, h, 0]).reshape([BLOCK_M, BLOCK_D])
        b_k = K_DESC.load([desc_b, k_row, h // group, 0]).reshape([BLOCK_N, BLOCK_D])
        b_lse = b_lse_next * LOG2E  # [BM]
        b_lse_next = tl.load(LSE + (h + 1) * stride_lh + o_i, mask=m_i & (h + 1 < heads), other=0.0)
        b_s = _mm(b_q, tl.trans(b_k), IEEE, INTERPRET) * qk_scale
        b_t += tl.exp2(b_s - b_lse[:, None])
    return tl.where(m_ij, b_t * (1.0 / heads), 0.0)


@triton.jit
def _relu(x):
    """max(x, 0) keeping NaN, as torch's relu (the default maximum lowers to PTX max.f32, which drops it)."""
    return tl.maximum(x, 0.0, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _index_logits(QI_DESC, b_ki, W, desc_b, q_row, o_i, m_i, stride_wn, stride_wh, index_heads, BLOCK_M: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr):
    """z [BM, BN] float32 = sum_t w_t * relu(qi_t . ki) (unmasked); b_ki [BN, BE] the key tile."""
    b_z = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    b_w_next = tl.load(W + o_i * stride_wn, mask=m_i, other=0.0)  # each head's weights one head ahead
    for t in tl.range(0, index_heads):
        b_qi = QI_DESC.load([desc_b, q_row, t, 0]).reshape([BLOCK_M, BLOCK_E])
        b_w = b_w_next.to(tl.float32)
        b_w_next = tl.load(W + o_i * stride_wn + (t + 1) * stride_wh, mask=m_i & (t + 1 < index_heads), other=0.0)
        b_r = _mm(b_qi, tl.trans(b_ki), IEEE, INTERPRET)
        b_z += b_w[:, None] * _relu(b_r)
    return b_z


@triton.jit
def _online_lse(b_s, b_m, b_l):
    """The running (max, sum of exp2) of each row, base 2, after the [BM, BN] scores b_s (NaN kept)."""
    b_new = tl.maximum(b_m, tl.max(b_s, axis=1), propagate_nan=tl.PropagateNan.ALL)
    b_ref = tl.where(b_new == float("-inf"), 0.0, b_new)
    b_l = b_l * tl.exp2(b_m - b_ref) + tl.sum(tl.exp2(b_s - b_ref[:, None]), axis=1)
    return b_new, b_l


@triton.jit
def _lse_program(span_tiles, windows, lo0, hi0, lo1, hi1, CU_Q, CU_K, seqlen_q, seqlen_k, groups,
                 BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr, VARLEN: tl.constexpr):
    """What an lse program covers, from its id: (run, group, seq, q_start, len_q, k_start, len_k,
    desc_b, shift, q_tile, o_i, m_i, k_end); `group` in [0, groups) is its head or block of heads,
    `run` false when its query tile holds none of the window's rows."""
    span, rest = _tile_order(tl.program_id(0), span_tiles, CAUSAL)
    group = rest % groups
    rest = rest // groups
    second = (windows == 2) & (rest % windows == 0)  # the later rows first
    seq = rest // windows
    q_start, len_q, k_start, len_k = _span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    desc_b = _descriptor_batch(seq, VARLEN)
    r0, r1, shift = _window(second, lo0, hi0, lo1, hi1, q_start if VARLEN else seq * seqlen_q, len_q)
    q_tile = r0 // BLOCK_M + span
    o_i = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = (o_i >= r0) & (o_i < r1)
    k_end = len_k
    if CAUSAL:
        k_end = tl.minimum(len_k, (q_tile + 1) * BLOCK_M + len_k - len_q)
    run = (r0 < r1) & (q_tile * BLOCK_M < r1)
    return run, group, seq, q_start, len_q, k_start, len_k, desc_b, shift, q_tile, o_i, m_i, k_end


@triton.jit
def _finish_lse(b_m, b_l):
    """The natural-log lse from the base-2 running (max, sum); -inf for an empty row, NaN kept."""
    b_lse = tl.where(b_l > 0, (b_m + tl.log2(b_l)) * LN2, float("-inf"))
    return tl.where(b_l == b_l, b_lse, float("nan"))


@triton.jit
def _head_lse_kernel(
    Q_DESC, K_DESC, LSE, CU_Q, CU_K,
    stride_lb, stride_lh,
    lo0, hi0, lo1, hi1, windows, span_tiles,
    seqlen_q, seqlen_k, heads, group, qk_scale,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
):
    """The dense stage's teacher per-head lse over each row's allowed keys: one program per (query
    tile, head, sequence). The leading key tiles every row of the query tile may use whole are
    walked without a mask."""
    run, h, seq, q_start, len_q, k_start, len_k, desc_b, shift, q_tile, o_i, m_i, k_end = _lse_program(
        span_tiles, windows, lo0, hi0, lo1, hi1, CU_Q, CU_K, seqlen_q, seqlen_k, heads, BLOCK_M, CAUSAL, VARLEN)
    if run:
        b_q = Q_DESC.load([desc_b, q_start + q_tile * BLOCK_M, h, 0]).reshape([BLOCK_M, BLOCK_D])
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        open_tiles = len_k // BLOCK_N
        if CAUSAL:  # the tile's first row's last key
            open_tiles = tl.minimum(open_tiles, tl.maximum(q_tile * BLOCK_M + len_k - len_q + 1, 0) // BLOCK_N)
        for k_tile in tl.range(0, open_tiles):  # no mask to build: the loop the exponentials bound
            b_k = K_DESC.load([desc_b, k_start + k_tile * BLOCK_N, h // group, 0]).reshape([BLOCK_N, BLOCK_D])
            b_s = _mm(b_q, tl.trans(b_k), IEEE, INTERPRET) * qk_scale
            b_m, b_l = _online_lse(b_s, b_m, b_l)
        for k_tile in tl.range(open_tiles, tl.cdiv(k_end, BLOCK_N)):
            o_j = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
            b_k = K_DESC.load([desc_b, k_start + k_tile * BLOCK_N, h // group, 0]).reshape([BLOCK_N, BLOCK_D])
            m_ij = _allowed(o_i, o_j, len_q, len_k, CAUSAL)
            b_s = tl.where(m_ij, _mm(b_q, tl.trans(b_k), IEEE, INTERPRET) * qk_scale, float("-inf"))
            b_m, b_l = _online_lse(b_s, b_m, b_l)
        tl.store(LSE + seq.to(tl.int64) * stride_lb + h * stride_lh + q_start + o_i, _finish_lse(b_m, b_l), mask=m_i)


@triton.jit
def _topk_lse_kernel(
    Q_DESC, K_DESC, LSE, SEL, CU_Q, CU_K,
    stride_lb, stride_lh,
    lo0, hi0, lo1, hi1, windows, span_tiles,
    seqlen_q, seqlen_k, heads, group, qk_scale, topk,
    BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PROGRAM_HEADS: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, IEEE: tl.constexpr, INTERPRET: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """The top-k stage's teacher per-head lse over each row's selected keys of the launch's row
    windows (one or two): one program per (query tile of a window, block of PROGRAM_HEADS heads,
    window, sequence), PROGRAM_HEADS dividing the heads. Only the key tiles holding a selected key
    are visited: each row's sorted selection (SEL's window row) is walked by a cursor, the next
    tile the one of the rows' smallest next key. A visited tile's selection is read once for all
    the program's heads; the heads' running (max, sum) are the rows of [PROGRAM_HEADS, BLOCK_M]
    blocks."""
    run, hb, seq, q_start, len_q, k_start, len_k, desc_b, shift, q_tile, o_i, m_i, k_end = _lse_program(
        span_tiles, windows, lo0, hi0, lo1, hi1, CU_Q, CU_K, seqlen_q, seqlen_k, heads // PROGRAM_HEADS, BLOCK_M,
        CAUSAL, VARLEN)
    if run:
        h0 = hb * PROGRAM_HEADS
        q_row = q_start + q_tile * BLOCK_M
        p_sel = SEL + (o_i + shift).to(tl.int64) * topk
        sel_end = tl.where(m_i, topk, 0)
        cursor = o_i * 0
        next_tile = tl.min(_key_at(p_sel, cursor, sel_end), axis=0) // BLOCK_N
        o_h = tl.arange(0, PROGRAM_HEADS)
        b_m = tl.full([PROGRAM_HEADS, BLOCK_M], float("-inf"), tl.float32)
        b_l = tl.zeros([PROGRAM_HEADS, BLOCK_M], tl.float32)
        for k_tile in tl.range(0, tl.cdiv(k_end, BLOCK_N)):
            if k_tile == next_tile:
                o_j = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
                k_row = k_start + k_tile * BLOCK_N
                word0, word1, word2, word3, cursor, next_key = _tile_selection(
                    p_sel, cursor, sel_end, k_tile * BLOCK_N, BLOCK_N, CHUNK)
                next_tile = tl.min(next_key, axis=0) // BLOCK_N
                m_ij = _allowed(o_i, o_j, len_q, len_k, CAUSAL) & _selection_mask(
                    word0, word1, word2, word3, o_j, k_tile * BLOCK_N)
                for t in tl.range(0, PROGRAM_HEADS):
                    h = h0 + t
                    b_q = Q_DESC.load([desc_b, q_row, h, 0]).reshape([BLOCK_M, BLOCK_D])
                    b_k = K_DESC.load([desc_b, k_row, h // group, 0]).reshape([BLOCK_N, BLOCK_D])
                    b_s = tl.where(m_ij, _mm(b_q, tl.trans(b_k), IEEE, INTERPRET) * qk_scale, float("-inf"))
                    row = o_h[:, None] == t  # head t's row of the running statistics
                    b_mt, b_lt = _online_lse(b_s, tl.sum(tl.where(row, b_m, 0.0), axis=0),  # (NaN kept)
                                             tl.sum(tl.where(row, b_l, 0.0), axis=0))
                    b_m = tl.where(row, b_mt[None, :], b_m)
                    b_l = tl.where(row, b_lt[None, :], b_l)
        p_lse = LSE + seq.to(tl.int64) * stride_lb + (h0 + o_h)[:, None] * stride_lh + q_start + o_i[None, :]
        tl.store(p_lse, _finish_lse(b_m, b_l), mask=m_i[None, :])


@triton.jit
def _forward_kernel(
    Q_DESC, K_DESC, QI_DESC, KI_DESC, W, HEAD_LSE, PARTS, SEL, CU_Q, CU_K,
    stride_wb, stride_wn, stride_wh, stride_lb, stride_lh, stride_pc, stride_ps,
    lo0, hi0, lo1, hi1, windows, span_tiles,
    seqlen_q, seqlen_k, heads, group, index_heads, qk_scale, topk, splits, split_tiles,
    BLOCK_D: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, VARLEN: tl.constexpr, TOPK: tl.constexpr, IEEE: tl.constexpr,
    INTERPRET: tl.constexpr, STEPS_K: tl.constexpr, CHUNK: tl.constexpr, TEACHER: tl.constexpr = True,
):
    """Per row of the launch's row windows (one or two), over one split of the key tiles (split s:
    tiles [s * split_tiles, (s + 1) * split_tiles)): the running max m and sum l of exp2(z),
    a = sum T log T and b = sum T z, written to PARTS[0..3, s, window row] (untouched where the
    split has no key tile: the host's neutral values). The host merges the splits: lse(z),
    loss = a - b + lse(z). One program per (query tile of a window, window, sequence, split); the
    splits of a query tile are consecutive programs, so the query tile's teacher and indexer
    queries (all heads) are read from memory once for all of them. Top-k: as the lse kernel, from
    each row's first selected key in the split (one binary search)."""
    split = tl.program_id(0) % splits
    span, rest = _tile_order(tl.program_id(0) // splits, span_tiles, CAUSAL)
    second = (windows == 2) & (rest % windows == 0)  # the later rows first
    seq = rest // windows
    q_start, len_q, k_start, len_k = _span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, VARLEN)
    desc_b = _descriptor_batch(seq, VARLEN)
    r0, r1, shift = _window(second, lo0, hi0, lo1, hi1, q_start if VARLEN else seq * seqlen_q, len_q)
    q_tile = r0 // BLOCK_M + span
    o_i = q_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_i = (o_i >= r0) & (o_i < r1)
    k_end = len_k
    if CAUSAL:
        k_end = tl.minimum(len_k, (q_tile + 1) * BLOCK_M + len_k - len_q)
    k_first = split * split_tiles
    k_last = tl.minimum(k_first + split_tiles, tl.cdiv(k_end, BLOCK_N))
    if (r0 < r1) & (q_tile * BLOCK_M < r1) & (k_first < k_last):
        seq64 = seq.to(tl.int64)
        q_row = q_start + q_tile * BLOCK_M
        W += seq64 * stride_wb + q_start.to(tl.int64) * stride_wn
        HEAD_LSE += seq64 * stride_lb + q_start
        p_sel = SEL + (o_i + shift).to(tl.int64) * topk
        sel_end = tl.where(m_i, topk, 0)
        cursor = o_i * 0
        next_tile = k_first
        if TOPK:
            cursor = _lower_bound(p_sel, sel_end, k_first * BLOCK_N, STEPS_K)
            next_tile = tl.min(_key_at(p_sel, cursor, sel_end), axis=0) // BLOCK_N
        b_m = tl.full([BLOCK_M], float("-inf"), tl.float32)  # running max of z (base 2)
        b_l = tl.zeros([BLOCK_M], tl.float32)
        b_a = tl.zeros([BLOCK_M], tl.float32)  # sum T log T
        b_b = tl.zeros([BLOCK_M], tl.float32)  # sum T z
        for k_tile in tl.range(k_first, k_last):
            active = True
            if TOPK:
                active = k_tile == next_tile
            if active:
                o_j = k_tile * BLOCK_N + tl.arange(0, BLOCK_N)
                k_row = k_start + k_tile * BLOCK_N
                m_ij = _allowed(o_i, o_j, len_q, len_k, CAUSAL)
                if TOPK:
                    word0, word1, word2, word3, cursor, next_key = _tile_selection(
                        p_sel, cursor, sel_end, k_tile * BLOCK_N, BLOCK_N, CHUNK)
                    next_tile = tl.min(next_key, axis=0) // BLOCK_N
                    m_ij = m_ij & _selection_mask(word0, word1, word2, word3, o_j, k_tile * BLOCK_N)
                if TEACHER:
                    b_t = _teacher_probs(Q_DESC, K_DESC, HEAD_LSE, desc_b, q_row, k_row, o_i, m_i, m_ij, stride_lh,
                                         heads, group, qk_scale, BLOCK_M, BLOCK_N, BLOCK_D, IEEE, INTERPRET)
                b_ki = KI_DESC.load([desc_b, k_row, 0, 0]).reshape([BLOCK_N, BLOCK_E])
                b_z = _index_logits(QI_DESC, b_ki, W, desc_b, q_row, o_i, m_i, stride_wn, stride_wh, index_heads,
                                    BLOCK_M, BLOCK_N, BLOCK_E, IEEE, INTERPRET)
                if TEACHER:
                    b_a += tl.sum(tl.where(b_t == 0.0, 0.0, b_t * tl.log(b_t)), axis=1)
                    b_b += tl.sum(tl.where(m_ij, b_t * b_z, 0.0), axis=1)
                b_m, b_l = _online_lse(tl.where(m_ij, b_z * LOG2E, float("-inf")), b_m, b_l)
        p_part = PARTS + split * stride_ps + o_i + shift
        tl.store(p_part, b_m, mask=m_i)
        tl.store(p_part + stride_pc, b_l, mask=m_i)
        tl.store(p_part + 2 * stride_pc, b_a, mask=m_i)
        tl.store(p_part + 3 * stride_pc, b_b, mask=m_i)
