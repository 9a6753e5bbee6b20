"""The always-available backend: the SPEC's one-pass algorithm in chunked PyTorch, CPU or GPU.

It walks the tile schedule exactly as the kernels do: for each (sequence, query tile) it streams
the visited key tiles in chunks, keeps the five running statistics per row, and never holds more
than one (heads, query tile, key chunk) block of scores.
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass

import torch

from streamkl._constants import NEG_INF
from streamkl.backends.base import (
    Backend,
    finalize_rows,
    lse_view,
    new_outputs,
    row_view,
    sequence_spans,
    write_tail_rows,
)
from streamkl.problem import Problem, SideMask
from streamkl.sparse.schedule import TileSchedule


def element_allowed(problem: Problem, mask: SideMask | None, seq: int, rows, cols, len_q: int, len_k: int):
    """Boolean [Hm, R, C]: keys allowed for query rows `rows` (sequence-local) on one side.

    `cols` is [C] (the same keys for every head) or [H, C] (each head its own keys)."""
    i = rows[:, None]
    j = cols[..., None, :]  # [1, C] or [H, 1, C]
    offset = len_k - len_q
    allowed = (i < len_q) & (j < len_k)
    if problem.causal:
        allowed = allowed & (j <= i + offset)
    left, right = problem.window
    if left >= 0:
        allowed = allowed & (j >= i + offset - left)
    if right >= 0:
        allowed = allowed & (j <= i + offset + right)
    if allowed.dim() == 2:
        allowed = allowed[None]
    if mask is not None:
        pattern = mask.pattern[seq if mask.pattern.shape[0] > 1 else 0]  # [Hm, nbq, nbk]
        block_rows = torch.clamp(rows // mask.block_q, max=pattern.shape[1] - 1)
        block_cols = torch.clamp(cols // mask.block_k, max=pattern.shape[2] - 1)
        by_row = pattern[:, block_rows]  # [Hm, R, nbk]
        if cols.dim() == 1:
            allowed = allowed & by_row[:, :, block_cols]
        else:
            heads, width = cols.shape
            by_row = by_row.expand(heads, -1, -1)
            index = block_cols[:, None, :].expand(heads, rows.numel(), width)
            allowed = allowed & torch.gather(by_row, 2, index)
    return allowed


@dataclass
class _Chunk:
    """A group of visited key tiles, processed as one block of scores.

    cols: a slice (contiguous keys shared by all heads), a [C] index tensor (shared keys), or an
    [H, C] index tensor (per-head keys of a per-head schedule, padded; `valid` marks real ones)."""

    cols: slice | torch.Tensor
    col_ids: torch.Tensor
    needs_mask: bool
    valid: torch.Tensor | None = None


def _chunks(tiles: list[int], partial: list[int], block_k: int, len_k: int, max_tiles: int, device):
    """Group a shared visited-tile list into key chunks."""
    for start in range(0, len(tiles), max_tiles):
        group = tiles[start : start + max_tiles]
        needs_mask = any(partial[start : start + max_tiles])
        first, last = group[0], group[-1]
        if last - first + 1 == len(group):  # contiguous tiles: a view, no gather
            cols = torch.arange(first * block_k, min((last + 1) * block_k, len_k), device=device)
            yield _Chunk(slice(int(cols[0]), int(cols[-1]) + 1), cols, needs_mask)
        else:
            cols = torch.cat(
                [torch.arange(t * block_k, min((t + 1) * block_k, len_k), device=device) for t in group]
            )
            yield _Chunk(cols, cols, needs_mask)


def _per_head_chunks(count, index, block_k: int, len_k: int, max_tiles: int, device):
    """Chunks of a per-head schedule row: every head gathers its own key tiles, padded to the
    longest list, so all heads run in one batched product and work follows each head's sparsity."""
    longest = int(count.max())
    offsets = torch.arange(block_k, device=device)
    for start in range(0, longest, max_tiles):
        slots = torch.arange(start, min(start + max_tiles, longest))
        tiles = index[:, slots].to(device=device, dtype=torch.int64)  # [H, S]
        used = (slots[None, :] < count[:, None]).to(device)  # [H, S]
        cols = (tiles[..., None] * block_k + offsets).flatten(1)  # [H, S * BK]
        valid = (used[..., None] & (cols.view(*tiles.shape, block_k) < len_k)).flatten(1)
        cols = torch.where(valid, cols, 0)
        yield _Chunk(cols, cols, True, valid)


def _full_float32(method):
    """Run with float32 products in full precision whatever the caller's global setting
    (torch.set_float32_matmul_precision("high") would allow TF32): the SPEC forbids TF32."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        previous = torch.get_float32_matmul_precision()
        guard = contextlib.nullcontext() if previous == "highest" else _matmul_precision("highest", previous)
        with guard:
            return method(*args, **kwargs)

    return wrapper


@contextlib.contextmanager
def _matmul_precision(value: str, restore: str):
    torch.set_float32_matmul_precision(value)
    try:
        yield
    finally:
        torch.set_float32_matmul_precision(restore)


class _Sides:
    """Per-(sequence, query tile, heads) views, upcast to float32, grouped for GQA."""

    def __init__(self, problem: Problem, tensors, seq, span, rows, heads):
        _, q_start, len_q, k_start, len_k = span
        self.problem = problem
        self.heads = heads  # slice: all heads, or one head of a per-head schedule
        self.q, self.k = [], []
        for q, k in ((tensors[0], tensors[1]), (tensors[2], tensors[3])):
            q_seq = row_view(problem, q, seq, q_start, len_q)[_as_slice(rows)]  # [R, H, D]
            k_seq = row_view(problem, k, seq, k_start, len_k)  # [len_k, Hk, D]
            q_seq = q_seq[:, heads]
            k_seq = k_seq[:, _kv_heads(problem, heads, k_seq.shape[1])]
            self.q.append(q_seq.transpose(0, 1).float())  # [h, R, D]
            self.k.append(k_seq)

    def keys(self, side: int, cols) -> torch.Tensor:
        """[hk, C, D] shared keys, or [H, C, D] when `cols` is a per-head [H, C] index."""
        k = self.k[side]
        if isinstance(cols, torch.Tensor) and cols.dim() == 2:
            heads = cols.shape[0]
            kv_head = torch.arange(heads, device=cols.device) // (heads // k.shape[1])
            return k[cols, kv_head[:, None]].float()
        return k[cols].transpose(0, 1).float()

    def scores(self, side: int, keys: torch.Tensor) -> torch.Tensor:
        """scale * q @ k^T for all selected heads at once: [h, R, C]."""
        q = self.q[side]
        hk = keys.shape[0]
        h, r, d = q.shape
        grouped = q.reshape(hk, h // hk, r, d)
        scale = self.problem.scale1 if side == 0 else self.problem.scale2
        return (torch.matmul(grouped, keys.transpose(-1, -2)[:, None]) * scale).reshape(h, r, -1)


class TorchChunkedBackend(Backend):
    name = "torch"
    q_tile = 256
    k_chunk = 1024

    def tile_sizes(self, problem: Problem) -> tuple[int, int]:
        masks = [m for m in (problem.mask1, problem.mask2) if m is not None]
        if masks:  # tiles of the masks' granularity, so work follows the sparsity
            return min(m.block_q for m in masks), min(m.block_k for m in masks)
        return self.q_tile, 256

    # ------------------------------------------------------------------ walking the schedule
    def _walk(self, problem: Problem, schedule: TileSchedule):
        """Yield (seq, span, rows, heads, chunks) for every query tile; chunks is empty when the
        tile visits no key (its rows still have to be written)."""
        count = schedule.kv_count.cpu()
        index = schedule.kv_index.cpu()
        partial = schedule.kv_partial.cpu()
        per_seq, per_head = count.shape[0] > 1, count.shape[1] > 1
        block_q, block_k = schedule.block_q, schedule.block_k
        max_tiles = max(self.k_chunk // block_k, 1)
        device = problem.device
        for span in sequence_spans(problem):
            seq, _, len_q, _, len_k = span
            s = seq if per_seq else 0
            for tile in range((len_q + block_q - 1) // block_q):
                rows = torch.arange(tile * block_q, min((tile + 1) * block_q, len_q), device=device)
                if per_head:
                    row = (count[s, :, tile], index[s, :, tile])
                    chunks = list(_per_head_chunks(*row, block_k, len_k, max_tiles, device))
                else:
                    n = int(count[s, 0, tile])
                    # the schedule lists full tiles before partial ones: ascending keys make
                    # contiguous runs (views, no gather) here
                    pairs = sorted(zip(index[s, 0, tile, :n].tolist(), partial[s, 0, tile, :n].tolist()))
                    tiles, flags = [t for t, _ in pairs], [f for _, f in pairs]
                    chunks = list(_chunks(tiles, flags, block_k, len_k, max_tiles, device)) if n else []
                yield seq, span, rows, slice(None), chunks

    def _masks(self, problem, seq, span, rows, chunk: _Chunk):
        _, _, len_q, _, len_k = span
        out = []
        for mask in (problem.mask1, problem.mask2):
            allowed = element_allowed(problem, mask, seq, rows, chunk.col_ids, len_q, len_k)
            if chunk.valid is not None:  # padding of per-head key lists
                allowed = allowed & chunk.valid[:, None, :]
            out.append(allowed)
        return out

    # ------------------------------------------------------------------ forward
    @_full_float32
    def forward(self, problem: Problem, q1, k1, q2, k2, schedule: TileSchedule):
        device = problem.device
        kl_rows, lse1, lse2, expect = new_outputs(problem)
        write_tail_rows(problem, kl_rows, lse1, lse2, expect)
        tensors = (q1, k1, q2, k2)
        for seq, span, rows, heads, chunks in self._walk(problem, schedule):
            sides = _Sides(problem, tensors, seq, span, rows, heads)
            shape = (sides.q[0].shape[0], rows.numel())
            m1 = torch.full(shape, NEG_INF, device=device)
            m2 = torch.full(shape, NEG_INF, device=device)
            l1 = torch.zeros(shape, device=device)
            l2 = torch.zeros(shape, device=device)
            acc = torch.zeros(shape, device=device)
            uncovered = torch.zeros(shape, dtype=torch.bool, device=device)
            seen1 = torch.zeros(shape, dtype=torch.bool, device=device)  # any side-1 key allowed
            for chunk in chunks:
                s1 = sides.scores(0, sides.keys(0, chunk.cols))
                s2 = sides.scores(1, sides.keys(1, chunk.cols))
                if chunk.needs_mask:
                    allowed1, allowed2 = self._masks(problem, seq, span, rows, chunk)
                    s1 = s1.masked_fill(~allowed1, NEG_INF)
                    s2 = s2.masked_fill(~allowed2, NEG_INF)
                    uncovered |= (allowed1 & ~allowed2).any(-1)
                    seen1 |= allowed1.any(-1)
                    diff = torch.where(allowed1 & allowed2, s1 - s2, 0.0)
                else:
                    seen1.fill_(True)
                    diff = s1 - s2
                m1_new = torch.maximum(m1, s1.amax(-1))
                m2_new = torch.maximum(m2, s2.amax(-1))
                # rows with no key yet keep max -inf; shift by 0 there so no inf - inf appears
                m1_safe = torch.where(m1_new == NEG_INF, 0.0, m1_new)
                m2_safe = torch.where(m2_new == NEG_INF, 0.0, m2_new)
                alpha1 = torch.exp(m1 - m1_safe)
                e1 = torch.exp(s1 - m1_safe[..., None])
                l1 = l1 * alpha1 + e1.sum(-1)
                acc = acc * alpha1 + (e1 * diff).sum(-1)
                l2 = l2 * torch.exp(m2 - m2_safe) + torch.exp(s2 - m2_safe[..., None]).sum(-1)
                m1, m2 = m1_new, m2_new
            kl, row_lse1, row_lse2, row_e = finalize_rows(m1, l1, m2, l2, acc, uncovered, ~seen1)
            _, q_start, len_q, _, _ = span
            row_slice = _as_slice(rows)
            row_view(problem, kl_rows, seq, q_start, len_q)[row_slice, heads] = kl.transpose(0, 1)
            lse_view(problem, lse1, seq, q_start, len_q)[heads, row_slice] = row_lse1
            lse_view(problem, lse2, seq, q_start, len_q)[heads, row_slice] = row_lse2
            lse_view(problem, expect, seq, q_start, len_q)[heads, row_slice] = row_e
        return kl_rows, lse1, lse2, expect

    # ------------------------------------------------------------------ backward
    @_full_float32
    def backward(self, problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        device = problem.device
        tensors = (q1, k1, q2, k2)
        grads = [
            torch.zeros(t.shape, dtype=torch.float32, device=device) if need else None
            for t, need in zip(tensors, needs)
        ]
        side_needed = (needs[0] or needs[1], needs[2] or needs[3])
        # a per-head schedule accumulates dk per query head (no two heads add to one row: exact and
        # deterministic), then sums each GQA group once at the end
        per_head = schedule.kv_count.shape[1] > 1
        per_head_dk = [
            torch.zeros((*k.shape[:-2], problem.heads, k.shape[-1]), dtype=torch.float32, device=device)
            if per_head and needs[2 * side + 1] else None
            for side, k in ((0, k1), (1, k2))
        ]
        for seq, span, rows, heads, chunks in self._walk(problem, schedule):
            if not chunks:
                continue
            _, q_start, len_q, k_start, len_k = span
            sides = _Sides(problem, tensors, seq, span, rows, heads)
            row_slice = _as_slice(rows)
            row_lse1 = lse_view(problem, lse1, seq, q_start, len_q)[heads, row_slice][..., None]
            row_lse2 = lse_view(problem, lse2, seq, q_start, len_q)[heads, row_slice][..., None]
            row_e = lse_view(problem, expect, seq, q_start, len_q)[heads, row_slice][..., None]
            g = row_view(problem, grad_rows, seq, q_start, len_q)[row_slice, heads].transpose(0, 1)[..., None]
            # empty rows (lse -inf) must give p = 0, not exp(+inf)
            row_lse1 = torch.where(row_lse1 == NEG_INF, float("inf"), row_lse1)
            row_lse2 = torch.where(row_lse2 == NEG_INF, float("inf"), row_lse2)
            dq_tile = [torch.zeros_like(sides.q[0]) if needs[0] else None, None,
                       torch.zeros_like(sides.q[1]) if needs[2] else None, None]
            for chunk in chunks:
                cols, needs_mask = chunk.cols, chunk.needs_mask
                keys1, keys2 = sides.keys(0, cols), sides.keys(1, cols)
                s1 = sides.scores(0, keys1)
                s2 = sides.scores(1, keys2)
                if needs_mask:
                    allowed1, allowed2 = self._masks(problem, seq, span, rows, chunk)
                    s1 = s1.masked_fill(~allowed1, NEG_INF)
                    s2 = s2.masked_fill(~allowed2, NEG_INF)
                p = torch.exp(s1 - row_lse1)
                dscores = [None, None]
                if side_needed[0]:
                    diff = s1 - s2
                    if needs_mask:  # d over keys allowed on both sides (E was summed there too)
                        diff = torch.where(allowed1 & allowed2, diff, 0.0)
                    dscores[0] = g * p * (diff - row_e) * problem.scale1
                if side_needed[1]:
                    dscores[1] = g * (torch.exp(s2 - row_lse2) - p) * problem.scale2
                    if needs_mask:
                        dscores[1] = torch.where(allowed2, dscores[1], 0.0)
                for side, keys in ((0, keys1), (1, keys2)):
                    ds = dscores[side]
                    if ds is None:
                        continue
                    hk = keys.shape[0]
                    h, r, c = ds.shape
                    if needs[2 * side]:
                        grouped = ds.reshape(hk, h // hk, r, c)
                        dq_tile[2 * side] += torch.matmul(grouped, keys[:, None]).reshape(h, r, -1)
                    if needs[2 * side + 1]:
                        q = sides.q[side]
                        dk = torch.matmul(
                            ds.reshape(hk, (h // hk) * r, c).transpose(-1, -2), q.reshape(hk, (h // hk) * r, -1)
                        )  # [hk, C, D]: sums over the query heads sharing each key head
                        if chunk.valid is not None:  # per-head keys: one row of dk per query head
                            target = row_view(problem, per_head_dk[side], seq, k_start, len_k)
                            heads_all = torch.arange(h, device=device)[:, None]
                            flat = (cols * h + heads_all).flatten()
                            target.view(-1, target.shape[-1]).index_add_(0, flat, dk.flatten(0, 1))
                            continue
                        k_heads = _kv_heads(problem, heads, tensors[2 * side + 1].shape[-2])
                        target = row_view(problem, grads[2 * side + 1], seq, k_start, len_k)[:, k_heads]
                        if isinstance(cols, slice):
                            target[cols] += dk.transpose(0, 1)
                        else:  # indices are unique within a chunk: deterministic even on CUDA
                            target.index_add_(0, cols, dk.transpose(0, 1))
            for side in (0, 1):
                if dq_tile[2 * side] is not None:
                    target = row_view(problem, grads[2 * side], seq, q_start, len_q)
                    target[row_slice, heads] += dq_tile[2 * side].transpose(0, 1)
        for side, expanded in enumerate(per_head_dk):
            if expanded is not None:
                kv_heads = tensors[2 * side + 1].shape[-2]
                grouped = expanded.unflatten(-2, (kv_heads, problem.heads // kv_heads))
                grads[2 * side + 1] += grouped.sum(-2)
        return tuple(None if g is None else g.to(problem.dtype) for g in grads)


def _as_slice(rows: torch.Tensor) -> slice:
    return slice(int(rows[0]), int(rows[-1]) + 1)


def _kv_heads(problem: Problem, heads: slice, num_kv_heads: int) -> slice:
    """The key heads serving a head slice: all of them, or the one of a single query head."""
    if heads.start is None:
        return slice(None)
    kv_head = heads.start // (problem.heads // num_kv_heads)
    return slice(kv_head, kv_head + 1)
