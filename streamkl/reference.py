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


# ------------------------------------------------------------------------------ the indexer loss
def _sequence_indexer_kl(q, k, qi, ki, w, lse, topk, scale: float, causal: bool):
    """SPEC 8 for one sequence, float64: (loss [n], head_lse [H, n], index_lse [n])."""
    len_q, heads, len_k = q.shape[0], q.shape[1], k.shape[0]
    q, k, qi, ki, w = (t.double() for t in (q, k, qi, ki, w))
    i = torch.arange(len_q, device=q.device)[:, None]
    j = torch.arange(len_k, device=q.device)[None, :]
    allowed = torch.ones(len_q, len_k, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= j <= i + len_k - len_q
    if topk is not None:
        chosen = torch.zeros(len_q, len_k + 1, dtype=torch.bool, device=q.device)
        slots = topk.long()
        chosen.scatter_(1, torch.where(slots < 0, len_k, slots), True)  # -1 -> a spare column
        allowed &= chosen[:, :len_k]
    empty = ~allowed.any(-1)  # [n]
    scores = scale * torch.einsum("ihd,jhd->hij", q, _expand_heads(k, heads).transpose(0, 1))
    scores = scores.masked_fill(~allowed, -torch.inf).masked_fill(empty[:, None], 0.0)
    head_lse = torch.logsumexp(scores, -1) if lse is None else lse.double()  # [H, n]
    probs = torch.where(allowed, torch.exp(scores - head_lse[..., None]), 0.0)
    teacher = probs.mean(0)  # [n, m]
    logits = torch.einsum("it,itj->ij", w, torch.einsum("itd,jd->itj", qi, ki).relu())
    logits = logits.masked_fill(~allowed, -torch.inf).masked_fill(empty[:, None], 0.0)
    index_lse = torch.logsumexp(logits, -1)
    log_student = torch.where(allowed, logits - index_lse[:, None], 0.0)
    positive = allowed & (teacher > 0)
    log_teacher = torch.log(torch.where(positive, teacher, 1.0))
    loss = torch.where(positive, teacher * (log_teacher - log_student), 0.0).sum(-1)
    loss = loss.masked_fill(empty, 0.0)
    if lse is None:
        head_lse = head_lse.masked_fill(empty[None], -torch.inf)
    return loss, head_lse, index_lse.masked_fill(empty, -torch.inf)


def indexer_kl(q, k, qi, ki, w, *, scale=None, lse=None, causal=True, cu_seqlens=None, cu_seqlens_k=None,
               topk_indices=None, return_lse=False):
    """The DSA indexer loss of SPEC section 8 per query row, in float64, by materializing every
    (row, key) matrix of each sequence; differentiable in qi, ki, w.

    Takes `streamkl.indexer_kl`'s layouts (dense `(B, N, ...)`, or packed `(T, ...)` with
    `cu_seqlens`); returns the loss rows `(B, Nq)` / `(T,)`, and with `return_lse` also the teacher's
    per-head lse `(B, H, Nq)` / `(H, T)` (the given `lse` when one is passed) and the indexer's lse
    `(B, Nq)` / `(T,)`, -inf on empty rows. No argument checks: feed it inputs `streamkl.indexer_kl`
    accepts."""
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        parts = [
            _sequence_indexer_kl(q[b], k[b], qi[b], ki[b], w[b], None if lse is None else lse[b],
                                 None if topk_indices is None else topk_indices[b], scale, causal)
            for b in range(q.shape[0])
        ]  # fmt: skip
        if parts:
            loss, head_lse, index_lse = (torch.stack([p[n] for p in parts]) for n in range(3))
        else:
            loss = index_lse = q.new_zeros((0, q.shape[1]), dtype=torch.float64)
            head_lse = q.new_zeros((0, q.shape[2], q.shape[1]), dtype=torch.float64)
    else:
        starts_q = cu_seqlens.tolist()
        starts_k = starts_q if cu_seqlens_k is None else cu_seqlens_k.tolist()
        heads, total = q.shape[1], q.shape[0]
        loss = q.new_zeros(total, dtype=torch.float64)
        index_lse = torch.full((total,), -torch.inf, dtype=torch.float64, device=q.device)
        head_lse = torch.full((heads, total), -torch.inf, dtype=torch.float64, device=q.device)
        if lse is not None:
            head_lse = lse.double().clone()
        loss_parts, head_parts, index_parts = [], [], []
        for seq in range(len(starts_q) - 1):
            qa, qb, ka, kb = starts_q[seq], starts_q[seq + 1], starts_k[seq], starts_k[seq + 1]
            part = _sequence_indexer_kl(
                q[qa:qb], k[ka:kb], qi[qa:qb], ki[ka:kb], w[qa:qb], None if lse is None else lse[:, qa:qb],
                None if topk_indices is None else topk_indices[qa:qb], scale, causal,
            )  # fmt: skip
            loss_parts.append(part[0])
            head_parts.append(part[1])
            index_parts.append(part[2])
        tail = total - starts_q[-1]  # rows past cu_seqlens[-1]: loss 0, empty
        loss = torch.cat([*loss_parts, loss[total - tail :]])
        index_lse = torch.cat([*index_parts, index_lse[total - tail :]])
        head_lse = torch.cat([*head_parts, head_lse[:, total - tail :]], dim=1)
    if return_lse:
        return loss, head_lse, index_lse
    return loss
