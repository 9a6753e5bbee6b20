"""Exact merge of the per-row statistics of disjoint key sets.

A query row's keys are split in shards; each shard s gives the SPEC's statistics over its keys
(section 4): `kl_s`, `lse1_s`, `lse2_s` and `E_s = E_{P1,s}[s1 - s2]`. With the shard weights
w1_s = exp(lse1_s - lse1), w2_s = exp(lse2_s - lse2) (the share of each side's mass in the shard),

    lse = logsumexp_s lse_s,    E = sum_s w1_s E_s,
    KL  = sum_s w1_s (kl_s + log w1_s - log w2_s)       (the chain rule of KL; = E - lse1 + lse2)

The chain-rule form keeps each shard's own cancellation of its large terms (near-identical
distributions keep their small KL), and one shard gives back its KL bit for bit. Where it is NaN
the row takes E - lse1 + lse2, which is what one pass gives there: a shard whose side-2 scores are
all -inf by value has a NaN shard KL (its l2 is 0) while the whole row's KL is +inf (finite p1
against a zero p2). Otherwise the edge rules follow from the arithmetic as in one pass: a shard
whose side-1 scores are all -inf by value (lse1_s = -inf although the shard is not empty) makes the
row's KL and E NaN, as a -inf score among finite ones does (0 * -inf); NaN propagates. Shards with
no allowed key at all are never merged (the caller skips them).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_NAN = float("nan")


@dataclass
class RowStats:
    """The merged statistics of some rows over the key shards seen so far; all float32 (B, H, R)."""

    kl: torch.Tensor
    lse1: torch.Tensor
    lse2: torch.Tensor
    expect: torch.Tensor

    @classmethod
    def of_shard(cls, kl_rows: torch.Tensor, lse1: torch.Tensor, lse2: torch.Tensor, expect: torch.Tensor) -> RowStats:
        """One shard's backend outputs: kl_rows (B, R, H), the others (B, H, R)."""
        value_empty = lse1 == float("-inf")  # a computed shard is never structurally empty
        return cls(
            kl=kl_rows.transpose(1, 2).clone(),
            lse1=lse1.clone(),
            lse2=lse2.clone(),
            expect=torch.where(value_empty, _NAN, expect),
        )

    def merge_(self, other: RowStats, rows: slice = slice(None)) -> None:
        """Fold `other` (statistics of further keys for rows `rows` of self) into self, in place."""
        kl, lse1, lse2, expect = (t[..., rows] for t in (self.kl, self.lse1, self.lse2, self.expect))
        merged = merge_stats(kl, lse1, lse2, expect, other.kl, other.lse1, other.lse2, other.expect)
        for target, value in zip((kl, lse1, lse2, expect), merged):
            target.copy_(value)

    def rows(self) -> torch.Tensor:
        """The KL per row, (B, R, H) contiguous: the layout of `streamkl.kl`'s rows."""
        kl = torch.where(torch.isnan(self.kl), self.expect - self.lse1 + self.lse2, self.kl)
        return kl.transpose(1, 2).contiguous()


def merge_stats(kl_a, lse1_a, lse2_a, expect_a, kl_b, lse1_b, lse2_b, expect_b) -> tuple:
    """(kl, lse1, lse2, expect) of the union of two disjoint key sets a and b, same shapes.

    Neither set is structurally empty; a set's lse1 of -inf (scores all -inf by value) carries NaN
    in its expect (`RowStats.of_shard`), which the weights propagate."""
    lse1 = torch.logaddexp(lse1_a, lse1_b)
    lse2 = torch.logaddexp(lse2_a, lse2_b)
    log_w1_a, log_w1_b = lse1_a - lse1, lse1_b - lse1
    log_w2_a, log_w2_b = lse2_a - lse2, lse2_b - lse2
    w1_a, w1_b = torch.exp(log_w1_a), torch.exp(log_w1_b)
    kl = w1_a * (kl_a + log_w1_a - log_w2_a) + w1_b * (kl_b + log_w1_b - log_w2_b)
    expect = w1_a * expect_a + w1_b * expect_b
    return kl, lse1, lse2, expect
