"""The tile schedule: which (query tile, key tile) pairs a kernel visits, and which need element masks.

Masks, causality, the window and `cu_seqlens` are turned here, once, into a compressed list of key
tiles per (sequence, head, query tile), FlexAttention style. Every backend walks this list, so no
kernel re-derives varlen or block-sparse logic. A tile is visited iff some key in it is allowed on
side 1 or on side 2 (the union of both sides' supports); it is *partial* unless every element is
allowed on both sides, and only partial tiles pay for element masks. Each query tile lists its full
tiles first, then its partial ones (each group ascending), so a kernel runs one branch-free loop over
the full tiles and one masked loop over the rest.

A partial tile's flags say why, so kernels whose tiles never straddle a mask block (the Triton
kernels: tiles <= mask blocks, both powers of two) need no pattern loads at all:
`STRUCTURAL` (sequence bounds, causality or the window cut the tile), `OFF1` / `OFF2` (that side's
block pattern allows no key of the tile), `MIXED` (a pattern block boundary runs through the tile:
only with tiles larger than the mask blocks, which then need the pattern itself).

Built with torch ops on the inputs' device: no host sync, so CUDA-graph capture stays possible
when `max_seqlen*` are given.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamkl._cache import LRUCache
from streamkl.problem import Problem, SideMask, fold_causal

#: kv_partial / q_partial flag bits (0: a full tile, every element allowed on both sides)
STRUCTURAL, OFF1, OFF2, MIXED = 1, 2, 4, 8


@dataclass(frozen=True)
class TileSchedule:
    """Compressed key-tile lists, broadcast over size-1 sequence / head dims.

    kv_count[s, h, t]      number of key tiles visited by query tile t of sequence s, head h
    kv_full[s, h, t]       how many of them are full tiles (listed first)
    kv_index[s, h, t, i]   the i-th visited key tile: full ones ascending, then partial ones
                           ascending; entries past kv_count are unused
    kv_partial[s, h, t, i] the flags of that tile (module docstring); nonzero iff it needs masks
    Dims: s in range(1 or num_sequences), h in range(1 or H).
    """

    block_q: int
    block_k: int
    kv_count: torch.Tensor  # int32 [S', H', nQ]
    kv_index: torch.Tensor  # int32 [S', H', nQ, nK]
    kv_partial: torch.Tensor  # int8  [S', H', nQ, nK]
    kv_full: torch.Tensor  # int32 [S', H', nQ]

    @property
    def num_q_tiles(self) -> int:
        return self.kv_count.shape[-1]

    @property
    def num_k_tiles(self) -> int:
        return self.kv_index.shape[-1]

    def visited_tiles(self, batch: int, heads: int) -> int:
        """Total (query tile, key tile) visits over all sequences and heads (one host sync)."""
        s, h, _ = self.kv_count.shape
        return int(self.kv_count.sum().item()) * (batch // s) * (heads // h)


def _tile_bounds(lengths: torch.Tensor, block: int, num_tiles: int):
    """First and last index of each tile clipped to each sequence's length: [S, n] each."""
    start = torch.arange(num_tiles, device=lengths.device, dtype=torch.int64) * block
    start = start.unsqueeze(0).expand(lengths.shape[0], -1)
    last = torch.minimum(start + block, lengths.unsqueeze(1)) - 1
    return start, last


def _structural_tiles(problem: Problem, block_q: int, block_k: int, n_q: int, n_k: int):
    """(any, full) booleans [S', nQ, nK]: does the tile hold an allowed key / only allowed keys,
    from sequence bounds, causality and the window alone."""
    device = problem.device
    if problem.is_varlen:
        len_q = (problem.cu_seqlens_q[1:] - problem.cu_seqlens_q[:-1]).to(torch.int64)
        len_k = (problem.cu_seqlens_k[1:] - problem.cu_seqlens_k[:-1]).to(torch.int64)
    else:
        len_q = torch.full((1,), problem.seqlen_q, dtype=torch.int64, device=device)
        len_k = torch.full((1,), problem.seqlen_k, dtype=torch.int64, device=device)
    q0, q1 = _tile_bounds(len_q, block_q, n_q)  # [S, nQ]
    k0, k1 = _tile_bounds(len_k, block_k, n_k)  # [S, nK]
    q0, q1 = q0[:, :, None], q1[:, :, None]
    k0, k1 = k0[:, None, :], k1[:, None, :]
    offset = (len_k - len_q)[:, None, None]  # bottom-right alignment
    exists = (q0 <= q1) & (k0 <= k1)
    complete = (q1 - q0 + 1 == block_q) & (k1 - k0 + 1 == block_k)
    left, right = fold_causal(problem.causal, problem.window)
    any_allowed, all_allowed = exists, exists & complete
    if left >= 0:  # key j >= i + offset - left
        any_allowed = any_allowed & (k1 >= q0 + offset - left)
        all_allowed = all_allowed & (k0 >= q1 + offset - left)
    if right >= 0:  # key j <= i + offset + right
        any_allowed = any_allowed & (k0 <= q1 + offset + right)
        all_allowed = all_allowed & (k1 <= q0 + offset + right)
    return any_allowed, all_allowed


def _pool(pattern: torch.Tensor, dim: int, mask_block: int, tile: int, n_tiles: int, reduce_all: bool):
    """Reduce one dim of a block pattern from mask blocks to kernel tiles (any or all)."""
    if tile < mask_block:  # each mask block spans several tiles
        pattern = pattern.repeat_interleave(mask_block // tile, dim=dim)
    group = max(tile // mask_block, 1)
    pattern = pattern.movedim(dim, -1)
    size, want = pattern.shape[-1], n_tiles * group
    if want > size:  # blocks past the grid hold no key: neutral for any and all
        pad = pattern.new_full((*pattern.shape[:-1], want - size), reduce_all)
        pattern = torch.cat([pattern, pad], dim=-1)
    pattern = pattern[..., :want].reshape(*pattern.shape[:-1], n_tiles, group)
    pooled = pattern.all(-1) if reduce_all else pattern.any(-1)
    return pooled.movedim(-1, dim)


def _order(visit: torch.Tensor, partial: torch.Tensor) -> torch.Tensor:
    """Per row of the last dim: visited full tiles, then visited partial ones, then the rest, each
    group ascending (a stable sort of the group number)."""
    group = (~visit).to(torch.int8) * 2 + (visit & partial).to(torch.int8)
    return torch.argsort(group, dim=-1, stable=True)


def _pool_pattern(mask: SideMask, block_q: int, block_k: int, n_q: int, n_k: int):
    """Pool a block pattern [Bm, Hm, nbq, nbk] onto kernel tiles: (any, all) [Bm, Hm, nQ, nK]."""
    pattern = mask.pattern.bool()
    result = []
    for reduce_all in (False, True):
        pooled = _pool(pattern, 2, mask.block_q, block_q, n_q, reduce_all)
        result.append(_pool(pooled, 3, mask.block_k, block_k, n_k, reduce_all))
    return result[0], result[1]


def build_schedule(problem: Problem, block_q: int, block_k: int) -> TileSchedule:
    """Turn the problem's masks into the compressed key-tile lists for (block_q, block_k) tiles."""
    n_q = max(math.ceil(problem.seqlen_q / block_q), 1)
    n_k = max(math.ceil(problem.seqlen_k / block_k), 1)
    any_s, all_s = _structural_tiles(problem, block_q, block_k, n_q, n_k)  # [S', nQ, nK]
    any_s, all_s = any_s[:, None], all_s[:, None]  # [S', 1, nQ, nK]
    sides, flags = [], (~all_s).to(torch.int8) * STRUCTURAL
    for mask, off in ((problem.mask1, OFF1), (problem.mask2, OFF2)):
        if mask is None:
            sides.append((any_s, all_s))
        else:
            any_m, all_m = _pool_pattern(mask, block_q, block_k, n_q, n_k)
            sides.append((any_s & any_m, all_s & all_m))
            flags = flags | (~any_m).to(torch.int8) * off | (any_m & ~all_m).to(torch.int8) * MIXED
    (any1, all1), (any2, all2) = sides
    visit = any1 | any2
    partial = visit & ~(all1 & all2)
    order = _order(visit, partial)
    flags = torch.where(visit, flags, 0).expand(partial.shape)
    return TileSchedule(
        block_q=block_q,
        block_k=block_k,
        kv_count=visit.sum(-1, dtype=torch.int32).contiguous(),
        kv_index=order.to(torch.int32).contiguous(),
        kv_partial=torch.gather(flags, -1, order).contiguous(),
        kv_full=(visit & ~partial).sum(-1, dtype=torch.int32).contiguous(),
    )


_CACHE_SIZE = 32
_CACHE = LRUCache(_CACHE_SIZE)


def get_schedule(problem: Problem, block_q: int, block_k: int) -> TileSchedule:
    """`build_schedule`, cached per (problem.key, tiles): the key holds the masks' and cu_seqlens'
    identity and version, so a tensor changed in place misses the cache; the entry keeps the
    problem (and so those tensors) alive, so their ids are not reused while it exists."""
    if torch.compiler.is_compiling():
        return build_schedule(problem, block_q, block_k)
    memo = problem.memo.get("schedule")  # this problem's last tiles and schedule: no hashing of its key
    if memo is not None and memo[0] == (block_q, block_k):
        return memo[1]
    key = (problem.key, block_q, block_k)
    hit = _CACHE.get(key)
    schedule = hit[0] if hit is not None else build_schedule(problem, block_q, block_k)
    problem.memo["schedule"] = ((block_q, block_k), schedule)
    if hit is None:
        _CACHE.put(key, (schedule, problem))
    return schedule


# ---------------------------------------------------------------------------------- key-major view
@dataclass(frozen=True)
class KeyTileSchedule:
    """The same visits as a TileSchedule, listed per key tile (for key-major backward kernels).

    q_count[s, h, k]      number of query tiles visiting key tile k of sequence s, head h
    q_full[s, h, k]       how many of them are full pairs (listed first)
    q_index[s, h, k, i]   the i-th of them: full pairs ascending, then partial ones ascending;
                          entries past q_count are unused
    q_partial[s, h, k, i] the flags of that (query tile, key tile) pair, as kv_partial
    """

    block_q: int
    block_k: int
    q_count: torch.Tensor  # int32 [S', H', nK]
    q_index: torch.Tensor  # int32 [S', H', nK, nQ]
    q_partial: torch.Tensor  # int8  [S', H', nK, nQ]
    q_full: torch.Tensor  # int32 [S', H', nK]


def transpose_schedule(schedule: TileSchedule) -> KeyTileSchedule:
    """Invert a TileSchedule: for each key tile, the query tiles that visit it. Torch ops only, no
    host sync."""
    n_k = schedule.kv_index.shape[-1]
    index = schedule.kv_index.long()
    valid = torch.arange(n_k, device=index.device) < schedule.kv_count[..., None].long()  # [S', H', nQ, nK]
    # kv_index is a permutation of the key tiles per row, so each scatter target is written once
    visit = torch.zeros(index.shape, dtype=torch.bool, device=index.device).scatter_(-1, index, valid)
    partial = torch.zeros(index.shape, dtype=torch.int8, device=index.device)
    partial.scatter_(-1, index, schedule.kv_partial * valid)
    visit_t = visit.transpose(-1, -2)  # [S', H', nK, nQ]
    partial_t = partial.transpose(-1, -2)
    order = _order(visit_t, partial_t != 0)
    return KeyTileSchedule(
        block_q=schedule.block_q,
        block_k=schedule.block_k,
        q_count=visit_t.sum(-1, dtype=torch.int32).contiguous(),
        q_index=order.to(torch.int32).contiguous(),
        q_partial=torch.gather(partial_t, -1, order).contiguous(),
        q_full=(visit_t & (partial_t == 0)).sum(-1, dtype=torch.int32).contiguous(),
    )


_KEY_CACHE = LRUCache(_CACHE_SIZE)


def get_key_schedule(schedule: TileSchedule) -> KeyTileSchedule:
    """`transpose_schedule`, cached per schedule object (the cache keeps the schedule alive, so its
    id is not reused while the entry exists)."""
    if torch.compiler.is_compiling():
        return transpose_schedule(schedule)
    hit = _KEY_CACHE.get(id(schedule))
    if hit is not None and hit[0] is schedule:
        return hit[1]
    result = transpose_schedule(schedule)
    _KEY_CACHE.put(id(schedule), (schedule, result))
    return result


# ------------------------------------------------------------------------------- program order
_ORDER_CACHE = LRUCache(64)


def heaviest_first(counts: torch.Tensor, batch: int, head_lo: int, heads: int, head_step: int,
                   programs: int, reversed_ids: bool = False) -> torch.Tensor:
    """Program ids for a kernel that reads its id from a table: within each (sequence, head), the
    tiles with the most visits (`counts` [S', H', n], broadcast over size-1 dims, e.g. a key
    schedule's q_count) first; (sequence, head) blocks keep their order, so the programs running
    at once still share one head's tiles in L2. Ids are the kernel's flat launch ids,
    `(seq * heads + j) * programs + tile` for head `head_lo + j * head_step` (`reversed_ids`: the
    tile is `programs - 1 - id % programs`, as the Gluon forward counts). Launched in this order
    the GPU's block scheduler ends on the shortest programs: a longest-first list schedule, whose
    tail is one short program instead of one long one (90 % random block sparsity, key-major
    backward: ~9 % shorter in a simulation of 132 SMs). int32 [batch * heads * programs], kept
    per counts tensor and launch shape (not while capturing a CUDA graph or compiling)."""
    key = (id(counts), batch, head_lo, heads, head_step, programs, reversed_ids)
    keep = not torch.compiler.is_compiling() and not (
        counts.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if keep:
        hit = _ORDER_CACHE.get(key)
        if hit is not None and hit[0] is counts:
            return hit[1]
    full_heads = max(counts.shape[1], head_lo + (heads - 1) * head_step + 1)
    chosen = counts.expand(batch, full_heads, counts.shape[2])[:, head_lo:head_lo + heads * head_step:head_step]
    chosen = chosen[..., :programs]
    assert chosen.shape == (batch, heads, programs), (chosen.shape, batch, heads, programs)
    if reversed_ids:
        chosen = chosen.flip(-1)
    tiles = torch.sort(chosen, dim=-1, descending=True, stable=True).indices
    base = torch.arange(batch * heads, device=counts.device, dtype=torch.int64).view(batch, heads, 1) * programs
    order = (tiles + base).reshape(-1).to(torch.int32)
    if keep:
        _ORDER_CACHE.put(key, (counts, order))
    return order
