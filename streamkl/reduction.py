"""The row count the `mean` reduction divides by.

Which (row, head) pairs have a non-empty side-1 support is structure: the sequence lengths,
causality, the window and side 1's block pattern. It is counted from those, never from values (a
row whose scores are all -inf by value is not empty: its KL is NaN, and it counts).
"""

from __future__ import annotations

import torch

from streamkl._cache import LRUCache
from streamkl.problem import Problem, fold_causal, structural_row_count

_COUNTS = LRUCache(32)


def mean_count(problem: Problem) -> int | torch.Tensor:
    """How many (row, head) pairs have a non-empty side-1 support, at least 1: a host int where
    the lengths are known on the host and side 1 has no block mask, else a device tensor (no host
    sync), kept per problem (its key holds the masks' and cu_seqlens' versions) outside of
    torch.compile and CUDA-graph capture."""
    count = structural_row_count(problem)
    if count is not None:
        return max(count, 1)
    keep = not torch.compiler.is_compiling() and not (
        problem.device.type == "cuda" and torch.cuda.is_current_stream_capturing())
    if keep:
        hit = _COUNTS.get(problem.key)
        if hit is not None:
            return hit[1]
    count = _rows_with_side1_support(problem).clamp_(min=1)
    if keep:
        _COUNTS.put(problem.key, (problem, count))  # (the problem keeps the keyed tensors alive)
    return count


def _rows_with_side1_support(problem: Problem) -> torch.Tensor:
    """int64 scalar on the problem's device: the (row, head) pairs whose side-1 support is non-empty.

    Row i of a sequence (lengths nq, nk, offset nk - nq) may see keys [lo, hi] = [i + off - left,
    i + off + right] within [0, nk); with a side-1 block mask it needs an allowed key block among
    those its range touches, counted with a prefix sum over each query block's key blocks."""
    device = problem.device
    if problem.is_varlen:
        cu_q, cu_k = problem.cu_seqlens_q.long(), problem.cu_seqlens_k.long()
        tokens = torch.arange(problem.total_q, device=device)
        # the sequence of each packed row; the whole table as boundaries (cu_q[0] = 0 <= every row):
        # inductor's bucketize lowering of torch 2.11 cannot take a sliced one
        seq = torch.searchsorted(cu_q, tokens, right=True) - 1
        valid = seq < problem.batch  # rows past cu_seqlens[-1] belong to none
        seq = seq.clamp(max=max(problem.batch - 1, 0))
        if problem.batch == 0:
            return torch.zeros((), dtype=torch.int64, device=device)
        row = tokens - cu_q[seq]
        len_q = (cu_q[1:] - cu_q[:-1])[seq]
        len_k = (cu_k[1:] - cu_k[:-1])[seq]
    else:
        row = torch.arange(problem.seqlen_q, device=device)
        seq = torch.zeros_like(row)
        valid = torch.ones_like(row, dtype=torch.bool)
        len_q, len_k = problem.seqlen_q, problem.seqlen_k
    offset = len_k - len_q
    left, right = fold_causal(problem.causal, problem.window)
    low = (row + offset - left).clamp(min=0) if left >= 0 else torch.zeros_like(row)
    high = row + offset + right if right >= 0 else torch.full_like(row, 0) + len_k - 1
    high = torch.minimum(high, torch.as_tensor(len_k, device=device) - 1)
    nonempty = valid & (low <= high)  # [R]
    batch_repeat = 1 if problem.is_varlen else problem.batch
    mask = problem.mask1
    if mask is None:
        return nonempty.sum() * (problem.heads * batch_repeat)
    pattern = mask.pattern  # [Bm, Hm, nbq, nbk]
    n_q_blocks, n_k_blocks = pattern.shape[-2:]
    prefix = torch.nn.functional.pad(pattern.to(torch.int32).cumsum(-1), (1, 0))  # [Bm, Hm, nbq, nbk + 1]
    q_block = (row // mask.block_q).clamp(max=n_q_blocks - 1)
    first = (low // mask.block_k).clamp(0, n_k_blocks - 1)
    last = (high.clamp(min=0) // mask.block_k).clamp(0, n_k_blocks - 1)
    if problem.is_varlen:
        b = seq if pattern.shape[0] > 1 else torch.zeros_like(seq)
        allowed = prefix[b, :, q_block, last + 1] - prefix[b, :, q_block, first]  # [R, Hm]
        per_row = (allowed > 0) & nonempty[:, None]
    else:
        allowed = prefix[:, :, q_block, last + 1] - prefix[:, :, q_block, first]  # [Bm, Hm, R]
        per_row = (allowed > 0) & nonempty
        batch_repeat = problem.batch // pattern.shape[0]
    return per_row.sum() * ((problem.heads // pattern.shape[1]) * batch_repeat)
