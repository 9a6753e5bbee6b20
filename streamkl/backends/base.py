"""What a backend is: a name, the reasons it cannot serve a problem, a forward and a backward.

Every backend walks the same `TileSchedule` and returns the same tensors:

    forward(problem, q1, k1, q2, k2, schedule) -> (kl_rows, lse1, lse2, expect)
        kl_rows float32 problem.row_shape; lse1, lse2, expect float32 problem.lse_shape
        (expect is E = sum_j p1 * (s1 - s2) over keys allowed on both sides, 0 on empty rows;
        kl_rows is +inf on uncovered rows, where a key is allowed on side 1 but not on side 2.
        E stays finite there, so the backward gives finite gradients: side 2's are the true
        g * (q - p), side 1's treat the infinite part as a constant.)
    backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)
        -> (dq1, dk1, dq2, dk2), each in the input dtype, or None where needs[i] is False.
        grad_rows float32 problem.row_shape, already 0 on rows whose side-1 support is empty.
"""

from __future__ import annotations

import os
from typing import ClassVar

import torch

from streamkl.problem import Problem
from streamkl.sparse.schedule import TileSchedule


class Backend:
    name: ClassVar[str] = ""
    #: True when the backend needs a CUDA device; used by `available_backends()`.
    needs_cuda: ClassVar[bool] = False
    #: True when `backward` itself gives rows whose side-1 support is empty (lse1 = -inf) a zero
    #: gradient, whatever their upstream gradient; otherwise the front end masks `grad_rows` first.
    zeroes_empty_rows: ClassVar[bool] = False

    def environment_reasons(self) -> list[str]:
        """Why this backend cannot run at all on this machine (missing package, no GPU...)."""
        return []

    def environment_key(self) -> tuple:
        """What `not_supported_reasons` reads besides the problem (the environment variables it
        checks): the front end keeps its backend choice per problem and these values."""
        return ()

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


def empty_rows_to_zero(grad_rows: torch.Tensor, lse1: torch.Tensor, varlen: bool) -> torch.Tensor:
    """grad_rows (float32, [B, N, H] or [T, H]) with the rows whose side-1 support is empty
    (lse1 = -inf; lse layout [B, H, N] or [H, T]) set to 0."""
    rows = lse1.transpose(0, 1) if varlen else lse1.transpose(1, 2)
    return torch.where(rows == float("-inf"), 0.0, grad_rows.float())


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


#: Set to "1", fresh outputs start as NaN, so a row a backend never writes shows as NaN: a debugging
#: aid for backend authors (docs/backends.md); the tests set it.
POISON_ENV = "STREAMKL_POISON_OUTPUTS"


def poison_outputs() -> bool:
    """Whether fresh outputs start as NaN (`$STREAMKL_POISON_OUTPUTS` is "1"), read at each call."""
    return os.environ.get(POISON_ENV) == "1"


def new_float32(shape, device) -> torch.Tensor:
    """An output buffer the kernels write in full: uninitialized, or NaN under `poison_outputs()`."""
    if poison_outputs():
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def new_outputs(problem: Problem):
    """Uninitialized (kl_rows, lse1, lse2, expect), float32; NaN-filled under `poison_outputs()`.

    Backends must write every row, including rows no tile visits and varlen rows past
    cu_seqlens[-1] (see `tail_rows`)."""
    device, rows, stats = problem.device, problem.row_shape, problem.lse_shape
    if poison_outputs():
        make = lambda shape: torch.full(shape, float("nan"), dtype=torch.float32, device=device)  # noqa: E731
        return make(rows), make(stats), make(stats), make(stats)
    # (written out, not through a helper: this runs on every call)
    empty, f32 = torch.empty, torch.float32
    return (empty(rows, dtype=f32, device=device), empty(stats, dtype=f32, device=device),
            empty(stats, dtype=f32, device=device), empty(stats, dtype=f32, device=device))


def write_tail_rows(problem: Problem, kl_rows, lse1, lse2, expect) -> None:
    """Varlen rows past cu_seqlens[-1] belong to no sequence: KL 0, lse -inf, E 0. No host sync."""
    if not problem.is_varlen or problem.total_q == 0:
        return
    start = problem.tail_start_q
    if start is not None:  # cu_seqlens[-1], read on the host by the front end's value checks
        if start < problem.total_q:
            kl_rows[start:].fill_(0.0)
            lse1[:, start:].fill_(float("-inf"))
            lse2[:, start:].fill_(float("-inf"))
            expect[:, start:].fill_(0.0)
        return
    rows = torch.arange(problem.total_q, device=problem.device)
    tail = rows >= problem.cu_seqlens_q[-1]
    kl_rows.masked_fill_(tail[:, None], 0.0)
    lse1.masked_fill_(tail[None, :], float("-inf"))
    lse2.masked_fill_(tail[None, :], float("-inf"))
    expect.masked_fill_(tail[None, :], 0.0)


def finalize_rows(m1, l1, m2, l2, acc, uncovered, empty1):
    """From the five running statistics (natural-log units) to (KL, lse1, lse2, E), with the SPEC's
    edge rules: the torch backend's rows and the Triton split-K merge.

    `uncovered` and `empty1` come from the structure (masks, causality, window, lengths). A row whose
    allowed scores on a side are all -inf by value (an infinite input) has l == 0 without being
    empty: its KL and E read NaN, as softmax does, and its lse is -inf, as torch.logsumexp gives
    (every backend's kernels write the same)."""
    lse1 = m1 + torch.log(l1)  # -inf on empty rows and on rows whose scores are all -inf
    lse2 = m2 + torch.log(l2)
    expect = torch.where(empty1, 0.0, acc / torch.where(empty1, 1.0, l1))
    # KL = E - lse1 + lse2, with the large terms cancelled first: m2 - m1 and log(l2 / l1)
    kl = expect - (m1 - m2) - torch.log(l1) + torch.log(l2)
    kl = torch.where((l1 == 0) | (l2 == 0), float("nan"), kl)
    kl = torch.where(uncovered, float("inf"), kl)
    kl = torch.where(empty1, 0.0, kl)
    return kl, lse1, lse2, expect
