"""The indexer loss (SPEC section 8) in chunked PyTorch, CPU or GPU: the always-available backend.

For each sequence and each chunk of query rows it streams the keys in chunks and keeps per-row
running statistics; the largest temporary is one (heads, rows, keys) block of scores, its size
bounded by `BLOCK_ELEMENTS`, so memory is O(N). The top-k stage marks a chunk's selected keys in a
(rows, Nk) boolean table built by scatter (repeated indices land on the same entry: counted once)
and walks the keys as the dense stage does, the table restricting each row.

Forward, per row, over the allowed keys j (T the teacher's head mean, z the indexer logits):
    pass 1 (when no lse is given): each head's online logsumexp
    pass 2: a = sum T log T,  tsum = sum T,  b = sum T (z - m),  m, l = online max / sum of exp(z)
    loss = a - b + tsum * log l  (= sum_j T (log T - log S), with the running max m cancelled)
"""

from __future__ import annotations

import torch

from streamkl.backends.torch_chunked import _full_float32
from streamkl.indexer import IndexerProblem, new_outputs

NEG_INF = float("-inf")
#: bound on the elements of one (heads, rows, keys) block of float32 temporaries
BLOCK_ELEMENTS = 1 << 21
ROWS_PER_CHUNK = 64


def not_supported_reasons(problem: IndexerProblem) -> list[str]:
    """The chunked PyTorch loss serves every problem the front end accepts, on any device."""
    return []


def _chunk_sizes(problem: IndexerProblem) -> tuple[int, int]:
    width = max(problem.heads, problem.index_heads, problem.index_dim // 4, 1)
    rows = ROWS_PER_CHUNK
    cols = max(16, BLOCK_ELEMENTS // (rows * width))
    return rows, cols


def _spans(problem: IndexerProblem):
    """(seq, q_start, len_q, k_start, len_k) per sequence: no sync for dense or host-known lengths."""
    if not problem.is_varlen:
        return [(b, 0, problem.seqlen_q, 0, problem.seqlen_k) for b in range(problem.batch)]
    if problem.host_lengths:
        spans, q_start, k_start = [], 0, 0
        for seq, (len_q, len_k) in enumerate(problem.host_lengths):
            spans.append((seq, q_start, len_q, k_start, len_k))
            q_start, k_start = q_start + len_q, k_start + len_k
        return spans
    cu_q, cu_k = problem.cu_seqlens_q.tolist(), problem.cu_seqlens_k.tolist()
    return [(s, cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s], cu_k[s + 1] - cu_k[s]) for s in range(problem.batch)]


class _QueryChunk:
    """One chunk of query rows of one sequence: its float32 inputs and which keys it may see."""

    def __init__(self, problem: IndexerProblem, tensors, span, r0: int, r1: int, topk_indices):
        seq, q_start, len_q, k_start, len_k = span
        q, k, qi, ki, w = tensors
        self.problem, self.len_k = problem, len_k
        rows = slice(q_start + r0, q_start + r1)
        pick = (lambda t: t[rows]) if problem.is_varlen else (lambda t: t[seq, rows])
        keys = (lambda t: t[k_start : k_start + len_k]) if problem.is_varlen else (lambda t: t[seq])
        self.rows = rows
        self.seq = seq
        count = r1 - r0
        groups = problem.heads // problem.heads_k
        # [R, Hk, G, D]: each key head's group of query heads, scaled once here
        self.q = (pick(q).float() * problem.scale).reshape(count, problem.heads_k, groups, problem.dim)
        self.qi, self.w = pick(qi).float(), pick(w).float()  # [R, Hi, Di], [R, Hi]
        self.k, self.ki = keys(k), keys(ki)
        device = problem.device
        local = torch.arange(r0, r1, device=device)
        last = torch.full((count,), len_k - 1, device=device, dtype=torch.long)
        if problem.causal:
            last = torch.minimum(last, local + (len_k - len_q))
        self.last = last  # [R]: the last key each row sees by structure (< 0: none)
        self.key_end = len_k if not problem.causal else max(0, min(len_k, r1 - 1 + len_k - len_q + 1))
        self.selected = None
        if topk_indices is not None:
            index = pick(topk_indices).long()  # [R, K]
            index = torch.where((index >= 0) & (index < len_k), index, len_k)  # unused slot -> spare column
            table = torch.zeros(count, len_k + 1, dtype=torch.bool, device=device)
            self.selected = table.scatter_(1, index, True)[:, :len_k]

    def allowed(self, c0: int, c1: int) -> torch.Tensor:
        cols = torch.arange(c0, c1, device=self.problem.device)
        allowed = cols[None, :] <= self.last[:, None]  # [R, C]
        if self.selected is not None:
            allowed = allowed & self.selected[:, c0:c1]
        return allowed

    def head_scores(self, c0: int, c1: int) -> torch.Tensor:
        """[H, R, C] teacher scores (scaled)."""
        keys = self.k[c0:c1].float()  # [C, Hk, D]
        scores = torch.einsum("rkgd,ckd->kgrc", self.q, keys)
        return scores.reshape(self.problem.heads, self.q.shape[0], c1 - c0)

    def index_scores(self, c0: int, c1: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(u [R, Hi, C] = <qi_t, ki>, z [R, C] = sum_t w_t relu(u)), the indexer logits."""
        index_keys = self.ki[c0:c1].float()  # [C, Di]
        dots = torch.einsum("rtd,cd->rtc", self.qi, index_keys)
        return dots, torch.einsum("rt,rtc->rc", self.w, dots.clamp(min=0))

    def teacher(self, scores: torch.Tensor, head_lse: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        """[R, C] T: the heads' mean of exp(s - lse_h), 0 where a key is not allowed."""
        probs = torch.exp(scores - head_lse[:, :, None]).mean(0)
        return torch.where(allowed, probs, 0.0)


def _lse_rows(problem: IndexerProblem, lse: torch.Tensor, chunk: _QueryChunk) -> torch.Tensor:
    """[H, R] view of a (B, H, Nq) / (H, T) statistic for a chunk's rows."""
    return lse[:, chunk.rows] if problem.is_varlen else lse[chunk.seq, :, chunk.rows]


def _row_view(problem: IndexerProblem, t: torch.Tensor, chunk: _QueryChunk) -> torch.Tensor:
    return t[chunk.rows] if problem.is_varlen else t[chunk.seq, chunk.rows]


def _safe_max(m: torch.Tensor) -> torch.Tensor:
    """A running max where -inf (nothing seen yet) reads as 0, so that exp(x - m) stays defined."""
    return torch.where(m == NEG_INF, 0.0, m)


def _head_lse(chunk: _QueryChunk, cols: int) -> torch.Tensor:
    """[H, R] each teacher head's logsumexp over the chunk rows' allowed keys (-inf: none)."""
    heads, count = chunk.problem.heads, chunk.q.shape[0]
    m = torch.full((heads, count), NEG_INF, device=chunk.problem.device)
    total = torch.zeros((heads, count), device=chunk.problem.device)
    for c0 in range(0, chunk.key_end, cols):
        c1 = min(c0 + cols, chunk.key_end)
        allowed = chunk.allowed(c0, c1)
        scores = chunk.head_scores(c0, c1).masked_fill(~allowed[None], NEG_INF)
        m_new = torch.maximum(m, scores.amax(-1))
        ref_old, ref_new = _safe_max(m), _safe_max(m_new)
        total = total * torch.exp(ref_old - ref_new) + torch.exp(scores - ref_new[..., None]).sum(-1)
        m = m_new
    return _safe_max(m) + torch.log(total)


@_full_float32
def forward(problem: IndexerProblem, q, k, qi, ki, w, lse, topk_indices):
    """(loss_rows, head_lse, index_lse), float32; head_lse is `lse` itself when given."""
    loss_rows, head_lse, index_lse = new_outputs(problem)
    if problem.is_varlen:  # rows past cu_seqlens[-1] belong to no sequence; sequences overwrite theirs
        loss_rows.fill_(0.0)
        index_lse.fill_(NEG_INF)
        if head_lse is not None:
            head_lse.fill_(NEG_INF)
    rows_per_chunk, cols = _chunk_sizes(problem)
    tensors = (q, k, qi, ki, w)
    device = problem.device
    for span in _spans(problem):
        len_q = span[2]
        for r0 in range(0, len_q, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, len_q)
            chunk = _QueryChunk(problem, tensors, span, r0, r1, topk_indices)
            if lse is None:
                chunk_lse = _head_lse(chunk, cols)
                _lse_rows(problem, head_lse, chunk).copy_(chunk_lse)
            else:
                chunk_lse = _lse_rows(problem, lse, chunk).float()
            count = r1 - r0
            m = torch.full((count,), NEG_INF, device=device)
            total = torch.zeros(count, device=device)
            t_log_t = torch.zeros(count, device=device)
            t_sum = torch.zeros(count, device=device)
            t_z = torch.zeros(count, device=device)  # sum T (z - ref), ref the running max made safe
            nonempty = torch.zeros(count, dtype=torch.bool, device=device)
            for c0 in range(0, chunk.key_end, cols):
                c1 = min(c0 + cols, chunk.key_end)
                allowed = chunk.allowed(c0, c1)
                teacher = chunk.teacher(chunk.head_scores(c0, c1), chunk_lse, allowed)
                _, logits = chunk.index_scores(c0, c1)
                logits = logits.masked_fill(~allowed, NEG_INF)
                m_new = torch.maximum(m, logits.amax(-1))
                ref_old, ref_new = _safe_max(m), _safe_max(m_new)
                total = total * torch.exp(ref_old - ref_new) + torch.exp(logits - ref_new[:, None]).sum(-1)
                t_z = t_z - (ref_new - ref_old) * t_sum
                t_z = t_z + torch.where(allowed, teacher * (logits - ref_new[:, None]), 0.0).sum(-1)
                # T log T is 0 where T == 0 (disallowed or underflowed); NaN stays NaN
                t_log_t = t_log_t + torch.where(teacher == 0, 0.0, teacher * torch.log(teacher)).sum(-1)
                t_sum = t_sum + teacher.sum(-1)
                nonempty |= allowed.any(-1)
                m = m_new
            loss = t_log_t - t_z + t_sum * torch.log(total)
            _row_view(problem, loss_rows, chunk).copy_(torch.where(nonempty, loss, 0.0))
            row_lse = torch.where(nonempty, _safe_max(m) + torch.log(total), NEG_INF)
            _row_view(problem, index_lse, chunk).copy_(row_lse)
    return loss_rows, (lse if lse is not None else head_lse), index_lse


@_full_float32
def backward(problem: IndexerProblem, q, k, qi, ki, w, topk_indices, head_lse, index_lse, grad_rows):
    """(dqi, dki, dw) in the input dtype: dz = g (S - T) recomputed chunk by chunk."""
    dqi, dw = torch.zeros_like(qi), torch.zeros_like(w)
    dki_acc = torch.zeros(ki.shape, dtype=torch.float32, device=ki.device)
    rows_per_chunk, cols = _chunk_sizes(problem)
    tensors = (q, k, qi, ki, w)
    for span in _spans(problem):
        seq, _, len_q, k_start, _ = span
        dki_seq = dki_acc[k_start : k_start + span[4]] if problem.is_varlen else dki_acc[seq]
        for r0 in range(0, len_q, rows_per_chunk):
            r1 = min(r0 + rows_per_chunk, len_q)
            chunk = _QueryChunk(problem, tensors, span, r0, r1, topk_indices)
            chunk_lse = _lse_rows(problem, head_lse, chunk).float()
            row_lse = _row_view(problem, index_lse, chunk)
            grad = _row_view(problem, grad_rows, chunk).float()
            dqi_chunk = torch.zeros_like(chunk.qi)
            dw_chunk = torch.zeros_like(chunk.w)
            for c0 in range(0, chunk.key_end, cols):
                c1 = min(c0 + cols, chunk.key_end)
                allowed = chunk.allowed(c0, c1)
                teacher = chunk.teacher(chunk.head_scores(c0, c1), chunk_lse, allowed)
                dots, logits = chunk.index_scores(c0, c1)
                student = torch.where(allowed, torch.exp(logits - row_lse[:, None]), 0.0)
                dz = grad[:, None] * (student - teacher)  # [R, C]
                dw_chunk += torch.einsum("rc,rtc->rt", dz, dots.clamp(min=0))
                through = torch.where(dots > 0, dz[:, None, :] * chunk.w[:, :, None], 0.0)  # [R, Hi, C]
                dqi_chunk += torch.einsum("rtc,cd->rtd", through, chunk.ki[c0:c1].float())
                dki_seq[c0:c1] += torch.einsum("rtc,rtd->cd", through, chunk.qi)
            _row_view(problem, dqi, chunk).copy_(dqi_chunk)
            _row_view(problem, dw, chunk).copy_(dw_chunk)
    return dqi, dki_acc.to(ki.dtype), dw
