"""The naive materializing baseline the GPU benchmarks compare against."""

from __future__ import annotations

import torch


def naive_kl(q1, k1, q2, k2, causal: bool):
    """Both (B, H, N, N) score matrices materialized; float32 softmax math; mean over (row, head)."""
    s1 = torch.einsum("bqhd,bkhd->bhqk", q1, k1).float() * q1.shape[-1] ** -0.5
    s2 = torch.einsum("bqhd,bkhd->bhqk", q2, k2).float() * q2.shape[-1] ** -0.5
    if causal:
        n = s1.shape[-1]
        future = torch.ones(n, n, dtype=torch.bool, device=s1.device).triu(1)
        s1 = s1.masked_fill(future, float("-inf"))
        s2 = s2.masked_fill(future, float("-inf"))
    log_p1 = torch.log_softmax(s1, dim=-1)
    log_p2 = torch.log_softmax(s2, dim=-1)
    terms = log_p1.exp() * (log_p1 - log_p2)
    if causal:
        terms = terms.masked_fill(future, 0.0)
    return terms.sum(-1).mean()
