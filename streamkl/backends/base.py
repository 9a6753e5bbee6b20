"""What a backend is: a name, the reasons it cannot serve a problem, a forward and a backward.

Every backend walks the same `TileSchedule` and returns the same tensors:

    forward(problem, q1, k1, q2, k2, schedule) -> (kl_rows, lse1, lse2, expect)
        kl_rows float32 problem.row_shape; lse1, lse2, expect float32 problem.lse_shape
        (expect is E = sum_j p1 * (s1 - s2), +inf on uncovered rows, 0 on empty rows)
    backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)
        -> (dq1, dk1, dq2, dk2), each in the input dtype, or None where needs[i] is False.
        grad_rows float32 problem.row_shape, already 0 on rows whose side-1 support is empty.
"""

from __future__ import annotations

from typing import ClassVar

import torch

from streamkl.problem import Problem
from streamkl.sparse.schedule import TileSchedule


class Backend:
    name: ClassVar[str] = ""
    #: True when the backend needs a CUDA device; used by `available_backends()`.
    needs_cuda: ClassVar[bool] = False

    def environment_reasons(self) -> list[str]:
        """Why this backend cannot run at all on this machine (missing package, no GPU...)."""
        return []

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        """Why this backend cannot serve this problem; empty when it can."""
        return self.environment_reasons()

    def tile_sizes(self, problem: Problem) -> tuple[int, int]:
        """(block_q, block_k) of the tile schedule this backend walks for `problem`."""
        raise NotImplementedError

    def forward(self, problem: Problem, q1, k1, q2, k2, schedule: TileSchedule):
        raise NotImplementedError

    def backward(self, problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        raise NotImplementedError


def sequence_spans(problem: Problem):
    """Host list of (seq, q_start, len_q, k_start, len_k): one sync for varlen, none for dense."""
    if not problem.is_varlen:
        return [(b, 0, problem.seqlen_q, 0, problem.seqlen_k) for b in range(problem.batch)]
    cu_q = problem.cu_seqlens_q.tolist()
    cu_k = problem.cu_seqlens_k.tolist()
    return [
        (s, cu_q[s], cu_q[s + 1] - cu_q[s], cu_k[s], cu_k[s + 1] - cu_k[s]) for s in range(problem.batch)
    ]


def row_view(problem: Problem, t: torch.Tensor, seq: int, start: int, length: int) -> torch.Tensor:
    """The rows of one sequence, [len, ...] for token-major tensors (inputs, kl_rows)."""
    return t[start : start + length] if problem.is_varlen else t[seq, start : start + length]


def lse_view(problem: Problem, t: torch.Tensor, seq: int, start: int, length: int) -> torch.Tensor:
    """The rows of one sequence of a head-major statistic, [H, len]."""
    return t[:, start : start + length] if problem.is_varlen else t[seq, :, start : start + length]
