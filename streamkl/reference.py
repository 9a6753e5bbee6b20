"""The float64 materializing reference: the oracle of the tests and the baseline of the benchmarks.

Written for clarity, not speed: it builds both Nq x Nk distributions per sequence and follows the
SPEC's edge rules literally. It is deliberately independent of the tile schedule.
"""

from __future__ import annotations

import torch

from streamkl.problem import Problem, SideMask, build_problem


def allowed_matrix(problem: Problem, len_q: int, len_k: int, mask: SideMask | None, seq: int) -> torch.Tensor:
    """Boolean [Hm, len_q, len_k]: which keys each query row may see on one side."""
    device = problem.device
    i = torch.arange(len_q, device=device)[:, None]
    j = torch.arange(len_k, device=device)[None, :]
    offset = len_k - len_q
    allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=device)
    if problem.causal:
        allowed &= j <= i + offset
    left, right = problem.window
    if left >= 0:
        allowed &= j >= i + offset - left
    if right >= 0:
        allowed &= j <= i + offset + right
    allowed = allowed[None]
    if mask is not None:
        pattern = mask.pattern[seq if mask.pattern.shape[0] > 1 else 0]  # [Hm, nbq, nbk]
        blocks = pattern[:, i[:, 0] // mask.block_q][:, :, j[0] // mask.block_k]
        allowed = allowed & blocks
    return allowed


def _expand_heads(k: torch.Tensor, heads: int) -> torch.Tensor:
    """[N, Hk, D] -> [H, N, D], repeating each key head for its group of query heads."""
    return k.repeat_interleave(heads // k.shape[1], dim=1).transpose(0, 1)


def _sequence_kl(problem, q1, k1, q2, k2, seq):
    """KL rows [N, H] and lse1, lse2 [H, N] of one sequence, float64, differentiable."""
    heads = problem.heads
    q1, k1, q2, k2 = (t.double() for t in (q1, k1, q2, k2))
    s1 = problem.scale1 * torch.einsum("hqd,hkd->hqk", q1.transpose(0, 1), _expand_heads(k1, heads))
    s2 = problem.scale2 * torch.einsum("hqd,hkd->hqk", q2.transpose(0, 1), _expand_heads(k2, heads))
    len_q, len_k = q1.shape[0], k1.shape[0]
    allowed1 = allowed_matrix(problem, len_q, len_k, problem.mask1, seq).expand(heads, -1, -1)
    allowed2 = allowed_matrix(problem, len_q, len_k, problem.mask2, seq).expand(heads, -1, -1)
    empty1 = ~allowed1.any(-1, keepdim=True)
    empty2 = ~allowed2.any(-1, keepdim=True)
    neg_inf = torch.tensor(float("-inf"), dtype=torch.float64, device=s1.device)
    # empty rows get harmless zeros so that no NaN reaches the gradient through where()
    s1m = torch.where(allowed1, s1, neg_inf).masked_fill(empty1, 0.0)
    s2m = torch.where(allowed2, s2, neg_inf).masked_fill(empty2, 0.0)
    lse1 = torch.logsumexp(s1m, -1)
    lse2 = torch.logsumexp(s2m, -1)
    log_p1 = s1m - lse1[..., None]
    log_p2 = s2m - lse2[..., None]
    both = allowed1 & allowed2
    log_p1 = torch.where(both, log_p1, 0.0)  # masked entries: finite placeholders, dropped below
    log_p2 = torch.where(both, log_p2, 0.0)
    terms = torch.where(both, log_p1.exp() * (log_p1 - log_p2), 0.0)
    kl = terms.sum(-1)
    uncovered = (allowed1 & ~allowed2).any(-1) | (~empty1[..., 0] & empty2[..., 0])
    kl = torch.where(uncovered, torch.inf, kl)
    kl = torch.where(empty1[..., 0], 0.0, kl)
    lse1 = torch.where(empty1[..., 0], -torch.inf, lse1)
    lse2 = torch.where(empty2[..., 0], -torch.inf, lse2)
    return kl.transpose(0, 1), lse1, lse2


def reference_kl(q1, k1, q2, k2, **kwargs):
    """KL(P1 || P2) per row in float64, and lse1, lse2, by materializing both distributions.

    Takes the arguments of `streamkl.kl` except `reduction`, `return_lse` and `backend`; returns
    `(kl_rows, lse1, lse2)` shaped as `streamkl.kl(..., reduction="none", return_lse=True)` returns
    them, in float64, differentiable with respect to the inputs.
    """
    problem = build_problem(q1, k1, q2, k2, allow_float64=True, **kwargs)
    if not problem.is_varlen:
        outs = [_sequence_kl(problem, q1[b], k1[b], q2[b], k2[b], b) for b in range(problem.batch)]
        if not outs:
            empty = q1.new_zeros((0, problem.seqlen_q, problem.heads), dtype=torch.float64)
            return empty, empty.transpose(1, 2), empty.transpose(1, 2)
        return tuple(torch.stack([o[i] for o in outs]) for i in range(3))
    cu_q = problem.cu_seqlens_q.tolist()
    cu_k = problem.cu_seqlens_k.tolist()
    total = problem.total_q
    kl_parts, lse1_parts, lse2_parts = [], [], []
    for seq in range(problem.batch):
        qa, qb, ka, kb = cu_q[seq], cu_q[seq + 1], cu_k[seq], cu_k[seq + 1]
        kl, lse1, lse2 = _sequence_kl(problem, q1[qa:qb], k1[ka:kb], q2[qa:qb], k2[ka:kb], seq)
        kl_parts.append(kl)
        lse1_parts.append(lse1)
        lse2_parts.append(lse2)
    tail = total - cu_q[-1]  # rows past cu_seqlens[-1]: KL 0, empty support
    zeros = q1.new_zeros((tail, problem.heads), dtype=torch.float64)
    kl_parts.append(zeros)
    lse1_parts.append(torch.full((problem.heads, tail), -torch.inf, dtype=torch.float64, device=q1.device))
    lse2_parts.append(lse1_parts[-1])
    return torch.cat(kl_parts), torch.cat(lse1_parts, dim=1), torch.cat(lse2_parts, dim=1)
