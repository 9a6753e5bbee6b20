"""Triton backend (NVIDIA Ampere and Hopper): fused kernels walking the tile schedule.

- forward.py: one program per (query tile, sequence, head) streams its key tiles once, keeping the
  SPEC's five statistics per row: a branch-free loop over the schedule's full tiles, then a masked
  loop over its partial ones (flags, no block-pattern loads); keys through TMA descriptors at
  D <= 64 on Hopper. With few query tiles against long key lists (a small grid) the lists are cut
  into slices (split-K) whose statistics are merged exactly afterwards.
- backward.py: one side's gradients in one key-major pass (dk in registers, dq added into a
  float32 buffer with atomics); both sides' gradients, or deterministic=True, in two atomic-free
  kernels (query-major dq, key-major dk), bitwise reproducible. GQA sums stay inside programs.
- common.py: element masks from the schedule flags, host-side argument packing, the launch helper.

Under TRITON_INTERPRET=1 the same kernels run on CPU tensors (tests, CI).
"""

from __future__ import annotations

import functools

from streamkl.backends.base import Backend
from streamkl.problem import Problem

MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _import_reason() -> str | None:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return f"Triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
    return None


@functools.lru_cache(maxsize=64)
def _tile_sizes(dim1: int, dim2: int, itemsize: int, mask_blocks: tuple, interpret: bool) -> tuple[int, int]:
    """(block_q, block_k) of the schedule. Under the interpreter, larger tiles run faster (fewer
    Python-level steps over bigger NumPy blocks). Tiles follow the block masks' granularity (no
    larger than a mask block), so the work stays proportional to the visited blocks."""
    dim = max(dim1, dim2)
    if interpret:
        block_q, block_k = 64, 64
    elif itemsize == 4:  # full-float32 products run on the FMA units; smaller tiles fit shared memory
        block_q, block_k = (32, 32) if dim > 128 else (64, 32) if dim > 64 else (64, 64)
    else:  # measured on the H200 (benchmarks/results/tune_h200.*)
        block_q, block_k = (64, 32) if dim > 128 else (128, 128)
    # the kernels read block patterns only through the schedule flags: no tile straddles a block
    for mask_q, mask_k in mask_blocks:
        block_q, block_k = min(block_q, mask_q), min(block_k, mask_k)
    return block_q, block_k


class TritonBackend(Backend):
    name = "triton"
    needs_cuda = True
    zeroes_empty_rows = True  # backward._row_stats

    def environment_reasons(self) -> list[str]:
        reason = _import_reason()
        if reason is not None:
            return [reason]
        from streamkl.backends.triton.common import interpreting

        if interpreting():
            return []
        import torch

        if not torch.cuda.is_available():
            return ["no CUDA GPU is visible (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"]
        from streamkl.backends.triton.common import capability

        major, minor = capability(torch.cuda.current_device())
        if major < 8:
            return [f"the GPU has compute capability {major}.{minor}; the Triton kernels need 8.0 (Ampere) or newer"]
        return []

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = self.environment_reasons()
        if reasons:
            return reasons
        from streamkl.backends.triton.common import interpreting

        if problem.device.type != "cuda" and not interpreting():
            reasons.append(f"inputs are on {problem.device}, not on a CUDA device")
        for side, dim in ((1, problem.dim1), (2, problem.dim2)):
            if dim > MAX_HEAD_DIM:
                reasons.append(f"head dim of side {side} is {dim}; the Triton kernels take at most {MAX_HEAD_DIM}")
        return reasons

    def tile_sizes(self, problem: Problem) -> tuple[int, int]:
        from streamkl.backends.triton.common import interpreting

        masks = tuple((m.block_q, m.block_k) for m in (problem.mask1, problem.mask2) if m is not None)
        return _tile_sizes(problem.dim1, problem.dim2, problem.dtype.itemsize, masks, interpreting())

    def forward(self, problem: Problem, q1, k1, q2, k2, schedule):
        from streamkl.backends.triton.forward import kl_forward

        with _inputs_device(problem):
            return kl_forward(problem, q1, k1, q2, k2, schedule)

    def forward_launcher(self, problem: Problem, schedule):
        from streamkl.backends.triton.forward import forward_launcher

        return forward_launcher(problem, schedule) or super().forward_launcher(problem, schedule)

    def backward_launcher(self, problem: Problem, schedule, needs):
        from streamkl.backends.triton.gluon_backward import backward_launcher

        return backward_launcher(problem, schedule, needs)

    def backward(self, problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        from streamkl.backends.triton.backward import kl_backward

        with _inputs_device(problem):
            return kl_backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)


def _inputs_device(problem: Problem):
    """The inputs' GPU as the current device while launching: Triton launches on the current
    device's current stream, so inputs on another GPU (cuda:1 while cuda:0 is current) would be
    read from the wrong device. A no-op (no context switch) when they are on the current one."""
    import contextlib

    import torch

    device = problem.device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return contextlib.nullcontext()
