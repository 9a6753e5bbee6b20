"""The ring computation of the KL and its gradients, and the autograd.Function around it.

Forward: at ring step t a rank holds the keys of rank r - t; it runs the backend's forward on its
query rows against them (the pairs `pair_at` allows) and folds the statistics into its rows
(`merge.RowStats`), while the next key shard is already in flight. Backward: the key shards go
round again; each rank runs the backend's backward with the merged (global) lse1, lse2, E of its
rows, which is exact because every key's gradient term depends on the row only through them
(SPEC section 4). dq sums at home; each shard's dk accumulates in a float32 buffer that travels
with it one step behind and arrives back at its owner after P steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streamkl.autograd import _NoSecondDerivative, run_backward, run_forward
from streamkl.backends.base import Backend
from streamkl.distributed.merge import RowStats
from streamkl.distributed.ring import GRADS_TAG, KEYS_TAG, Ring, wait
from streamkl.problem import build_problem


@dataclass(frozen=True)
class RingSetup:
    """What every rank agreed on (`api.kl`), and this rank's backend."""

    ring: Ring
    impl: Backend
    lengths: tuple[int, ...]  # every rank's shard length
    batch: int
    heads_k1: int
    heads_k2: int
    dim1: int
    dim2: int
    dtype: torch.dtype
    scale1: float
    scale2: float
    causal: bool
    deterministic: bool

    def key_shapes(self, owner: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
        n = self.lengths[owner]
        return (self.batch, n, self.heads_k1, self.dim1), (self.batch, n, self.heads_k2, self.dim2)

    def key_numel(self, owner: int) -> tuple[int, int]:
        (b, n, h1, d1), (_, _, h2, d2) = self.key_shapes(owner)
        return b * n * h1 * d1, b * n * h2 * d2


@dataclass(frozen=True)
class Pair:
    """The part of (this rank's queries) x (a key shard) with allowed keys."""

    rows: slice
    keys: slice
    causal: bool


_ALL = slice(None)


def pair_at(setup: RingSetup, step: int) -> Pair | None:
    """Which queries see which keys of the shard held at `step`; None when none do.

    Load-balanced causal layout (rank r: chunks r and 2P-1-r, ascending positions within a shard):
    its own shard is causal in the shard's order; a shard of an earlier rank s < r (chunks s and
    2P-1-s) is seen fully by both query chunks through its first chunk only; a shard of a later
    rank is seen fully, by the second query chunk only."""
    ring = setup.ring
    owner = ring.owner(step)
    if setup.lengths[ring.rank] == 0 or setup.lengths[owner] == 0:
        return None
    if not setup.causal:
        return Pair(_ALL, _ALL, False)
    if step == 0:
        return Pair(_ALL, _ALL, True)
    half = setup.lengths[ring.rank] // 2
    if owner < ring.rank:
        return Pair(_ALL, slice(0, half), False)
    return Pair(slice(half, None), _ALL, False)


def pack_keys(k1: torch.Tensor, k2: torch.Tensor) -> torch.Tensor:
    """One flat contiguous buffer holding both key shards: one message per ring step."""
    return torch.cat([k1.reshape(-1), k2.reshape(-1)])


def unpack_keys(setup: RingSetup, buffer: torch.Tensor, owner: int) -> tuple[torch.Tensor, torch.Tensor]:
    shape1, shape2 = setup.key_shapes(owner)
    numel1, numel2 = setup.key_numel(owner)
    return buffer[:numel1].view(shape1), buffer[numel1 : numel1 + numel2].view(shape2)


def _problem(setup: RingSetup, q1, k1, q2, k2, causal: bool):
    return build_problem(q1, k1, q2, k2, scale1=setup.scale1, scale2=setup.scale2, causal=causal,
                         deterministic=setup.deterministic)


def _pair_tensors(pair: Pair, q1, k1, q2, k2):
    return q1[:, pair.rows], k1[:, pair.keys], q2[:, pair.rows], k2[:, pair.keys]


def ring_forward(setup: RingSetup, q1, k1, q2, k2) -> RowStats:
    """This rank's rows' statistics over the whole sequence's keys."""
    ring = setup.ring
    keys, buffer, stats = (k1, k2), None, None
    if ring.size > 1:
        buffer = pack_keys(k1.detach(), k2.detach())
    for step in range(ring.size):
        works = incoming = None
        if step + 1 < ring.size:  # the next shard travels while this one is used
            incoming = buffer.new_empty(sum(setup.key_numel(ring.owner(step + 1))))
            works = ring.pass_on(buffer, incoming, KEYS_TAG)
        pair = pair_at(setup, step)
        if pair is not None:
            parts = _pair_tensors(pair, q1, keys[0], q2, keys[1])
            problem = _problem(setup, *parts, pair.causal)
            shard_stats = RowStats.of_shard(*run_forward(problem, setup.impl, *parts))
            if stats is None:  # step 0: the rank's own shard, seen by every row
                stats = shard_stats
            else:
                stats.merge_(shard_stats, pair.rows)
        wait(works)
        if incoming is not None:
            buffer = incoming
            keys = unpack_keys(setup, buffer, ring.owner(step + 1))
    if stats is None:  # a rank without tokens
        empty = q1.new_empty((setup.batch, q1.shape[2], 0), dtype=torch.float32)
        stats = RowStats(empty, empty.clone(), empty.clone(), empty.clone())
    return stats


def ring_backward(setup: RingSetup, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, needs) -> tuple:
    """(dq1, dk1, dq2, dk2) of this rank's shard, None where `needs` is False. Collective."""
    ring = setup.ring
    needs = tuple(bool(n) for n in needs)
    dq = [torch.zeros(q.shape, dtype=torch.float32, device=q.device) if need else None
          for q, need in ((q1, needs[0]), (q2, needs[2]))]
    needs_keys = needs[1] or needs[3]
    keys, buffer = (k1, k2), None
    if ring.size > 1:
        buffer = pack_keys(k1, k2)
    grad_works = grad_incoming = None
    for step in range(ring.size):
        owner = ring.owner(step)
        works = incoming = None
        if step + 1 < ring.size:
            incoming = buffer.new_empty(sum(setup.key_numel(ring.owner(step + 1))))
            works = ring.pass_on(buffer, incoming, KEYS_TAG)
        contribution = None
        if needs_keys:  # this rank's dk terms for the held shard, both sides in one flat buffer
            contribution = torch.zeros(sum(setup.key_numel(owner)), dtype=torch.float32, device=q1.device)
        pair = pair_at(setup, step)
        if pair is not None:
            parts = _pair_tensors(pair, q1, keys[0], q2, keys[1])
            problem = _problem(setup, *parts, pair.causal)
            stats = [_rows_of(t, pair.rows) for t in (lse1, lse2, expect)]
            grads = run_backward(problem, setup.impl, _rows_of(grad_rows, pair.rows, dim=1), *parts, *stats, needs)
            for dq_side, dq_part in zip(dq, (grads[0], grads[2])):
                if dq_side is not None:
                    dq_side[:, pair.rows] += dq_part
            if needs_keys:
                dk1_total, dk2_total = unpack_keys(setup, contribution, owner)
                for total, part in ((dk1_total, grads[1]), (dk2_total, grads[3])):
                    if part is not None:
                        total[:, pair.keys] += part
        if needs_keys:
            if grad_works is not None:  # the shard's dk from the ranks before this one
                wait(grad_works)
                contribution += grad_incoming
            if ring.size > 1:  # on to the next holder; the last step hands it to its owner
                grad_incoming = contribution.new_empty(sum(setup.key_numel(ring.owner(step + 1))))
                grad_works = ring.pass_on(contribution, grad_incoming, GRADS_TAG)
            else:
                grad_incoming = contribution
        wait(works)
        if incoming is not None:
            buffer = incoming
            keys = unpack_keys(setup, buffer, ring.owner(step + 1))
    dk = (None, None)
    if needs_keys:
        wait(grad_works)
        dk = unpack_keys(setup, grad_incoming, ring.rank)
    dtype = q1.dtype
    return (
        None if dq[0] is None else dq[0].to(dtype),
        dk[0].to(dtype) if needs[1] else None,
        None if dq[1] is None else dq[1].to(dtype),
        dk[1].to(dtype) if needs[3] else None,
    )


def _rows_of(t: torch.Tensor, rows: slice, dim: int = 2) -> torch.Tensor:
    """The rows `rows` of a statistic ((B, H, n): dim 2) or of grad_rows ((B, n, H): dim 1)."""
    if rows == _ALL:
        return t
    return (t[:, :, rows] if dim == 2 else t[:, rows]).contiguous()


class RingKL(torch.autograd.Function):
    """(kl_rows, lse1, lse2) of this rank's rows; the backward is `ring_backward` (collective:
    every rank of the group must run it)."""

    @staticmethod
    def forward(ctx, setup: RingSetup, q1, k1, q2, k2):
        with torch.no_grad():
            stats = ring_forward(setup, q1, k1, q2, k2)
        lse1, lse2 = stats.lse1.contiguous(), stats.lse2.contiguous()
        expect = stats.expect.contiguous()
        ctx.setup = setup
        ctx.save_for_backward(q1, k1, q2, k2, lse1, lse2, expect)
        ctx.mark_non_differentiable(lse1, lse2)
        return stats.rows(), lse1, lse2

    @staticmethod
    def backward(ctx, grad_rows, grad_lse1, grad_lse2):
        needs = [bool(n) for n in ctx.needs_input_grad[1:5]]
        q1, k1, q2, k2, lse1, lse2, expect = ctx.saved_tensors
        with torch.no_grad():
            grads = ring_backward(ctx.setup, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, needs)
        if torch.is_grad_enabled():  # create_graph=True: a second derivative raises, never drops terms
            anchor = next(t for t, need in zip((q1, k1, q2, k2), needs) if need)
            wanted = _NoSecondDerivative.apply(anchor, *(g for g in grads if g is not None))
            wanted = iter(wanted if isinstance(wanted, tuple) else (wanted,))
            grads = tuple(next(wanted) if g is not None else None for g in grads)
        return (None, *grads)
