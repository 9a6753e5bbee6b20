"""Triton backend (NVIDIA Ampere and Hopper): fused kernels walking the tile schedule.

- select.py: which kernel serves a problem and with which configuration (one place).
- forward.py, backward.py: the portable kernels (tl.*), which also run on the CPU interpreter
  (TRITON_INTERPRET=1: tests, CI).
- gluon/: the Hopper kernels (warp-specialized, TMA, wgmma), where measured faster.
- launch.py: launching through Triton's public API with little host time (`Launcher`).
- common.py: masks, products, strides and device queries the kernels share; _compat.py: the
  private Triton APIs used, version-gated.
"""

from __future__ import annotations

import functools
import os

import torch

from streamkl._cache import LRUCache
from streamkl.backends.base import Backend
from streamkl.problem import Problem


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
    else:  # measured on the H200 (docs/performance.md)
        block_q, block_k = (64, 32) if dim > 128 else (128, 128)
    # the kernels read block patterns only through the schedule flags: no tile straddles a block
    for mask_q, mask_k in mask_blocks:
        block_q, block_k = min(block_q, mask_q), min(block_k, mask_k)
    return block_q, block_k


class TritonBackend(Backend):
    name = "triton"
    needs_cuda = True
    zeroes_empty_rows = True  # backward._row_stats

    def __init__(self) -> None:
        self._plans = LRUCache(128)  # per-problem selections and launch plans

    def environment_reasons(self) -> list[str]:
        reason = _import_reason()
        if reason is not None:
            return [reason]
        from streamkl.backends.triton.common import interpreting

        if interpreting():
            return []
        if not torch.cuda.is_available():
            return ["no CUDA GPU is visible (set TRITON_INTERPRET=1 to run the kernels on the CPU interpreter)"]
        reason = _capability_reason(torch.cuda.current_device(), "the GPU")
        return [] if reason is None else [reason]

    def environment_key(self) -> tuple:
        return (os.environ.get("TRITON_INTERPRET"),)

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = self.environment_reasons()
        if reasons:
            return reasons
        from streamkl.backends.triton.common import MAX_HEAD_DIM, interpreting

        if problem.device.type != "cuda" and not interpreting():
            reasons.append(f"inputs are on {problem.device}, not on a CUDA device")
        elif problem.device.type == "cuda" and not interpreting() and problem.device.index is not None:
            reason = _capability_reason(problem.device.index, "the inputs' GPU")  # (the current GPU's: above)
            if reason is not None:
                reasons.append(reason)
        for side, dim in ((1, problem.dim1), (2, problem.dim2)):
            if dim > MAX_HEAD_DIM:
                reasons.append(f"head dim of side {side} is {dim}; the Triton kernels take at most {MAX_HEAD_DIM}")
        return reasons

    def tile_sizes(self, problem: Problem) -> tuple[int, int]:
        from streamkl.backends.triton.common import interpreting

        mask1, mask2 = problem.mask1, problem.mask2
        masks = () if mask1 is None and mask2 is None else tuple(
            (m.block_q, m.block_k) for m in (mask1, mask2) if m is not None)
        return _tile_sizes(problem.dim1, problem.dim2, problem.dtype.itemsize, masks, interpreting())

    def forward(self, problem: Problem, q1, k1, q2, k2, schedule):
        device = _other_device(problem)
        if device is not None:
            with device:
                return self._forward(problem, q1, k1, q2, k2, schedule)
        return self._forward(problem, q1, k1, q2, k2, schedule)

    def _forward(self, problem: Problem, q1, k1, q2, k2, schedule):
        forward, select = _kernels()

        def make():
            choice = select.select_forward(problem, schedule.block_q, schedule.block_k)
            gluon_plan = None
            if choice.gluon:
                gluon_plan = _gluon_kernels()[0].plan(problem, schedule)
            return problem, choice, forward.plan(problem, choice, schedule), gluon_plan

        tiles = (schedule.block_q, schedule.block_k)
        memo = problem.memo.get("triton.forward")  # this problem's last plan: no hashing of its key
        if memo is not None and memo[0] == tiles:
            choice, plan, gluon_plan = memo[1]
        else:  # (the memo leaves out the entry's problem: no reference cycle)
            _, choice, plan, gluon_plan = self._plans.get_or_make(("forward", problem.key, *tiles), make)
            problem.memo["triton.forward"] = (tiles, (choice, plan, gluon_plan))
        if gluon_plan is not None and select.tma_inputs(q1, k1, q2, k2):
            return _gluon_kernels()[0].kl_forward(problem, gluon_plan, q1, k1, q2, k2)
        return forward.kl_forward(problem, choice, plan, q1, k1, q2, k2)

    def backward(self, problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        if q1.numel() == 0 or k1.numel() == 0 or not any(needs):
            return tuple(None if not need else torch.zeros_like(t) for t, need in zip((q1, k1, q2, k2), needs))
        device = _other_device(problem)
        if device is not None:
            with device:
                return self._backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)
        return self._backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)

    def _backward(self, problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        select = _kernels()[1]
        deterministic = problem.deterministic or torch.are_deterministic_algorithms_enabled()
        variant = (schedule.block_q, schedule.block_k, tuple(needs), deterministic)
        memo = problem.memo.get("triton.backward")  # this problem's last choice: no hashing of its key
        if memo is not None and memo[0] == variant:
            choice = memo[1]
        else:
            _, choice = self._plans.get_or_make(("backward", problem.key, *variant), lambda: (
                problem, select.select_backward(problem, schedule.block_q, schedule.block_k, tuple(needs),
                                                deterministic)))
            problem.memo["triton.backward"] = (variant, choice)
        if choice.kind.startswith("gluon"):
            if select.tma_inputs(q1, k1, q2, k2):
                return _gluon_kernels()[1].kl_backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows.float(),
                                                       schedule, choice.kind == "gluon-both", choice.chunks)
            choice = _portable(problem, schedule, needs, deterministic)  # inputs the descriptors cannot read
        from streamkl.backends.triton import backward

        return backward.kl_backward(problem, choice, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule,
                                    tuple(needs))


def _capability_reason(index: int, which: str) -> str | None:
    """Why GPU `index` cannot run the kernels (older than Ampere), or None."""
    from streamkl.backends.triton.common import capability

    major, minor = capability(index)
    if major < 8:
        return f"{which} has compute capability {major}.{minor}; the Triton kernels need 8.0 (Ampere) or newer"
    return None


def _portable(problem: Problem, schedule, needs, deterministic: bool):
    """The portable kernels' choice where a Gluon kernel was chosen but the call's inputs are not
    contiguous or aligned."""
    from streamkl.backends.triton import select

    return select.select_backward(problem, schedule.block_q, schedule.block_k, tuple(needs), deterministic,
                                  gluon=False)


def _other_device(problem: Problem):
    """A context making the inputs' GPU the current device while launching, or None where they are
    on the current one: Triton launches on the current device's current stream, so inputs on
    another GPU (cuda:1 while cuda:0 is current) would be read from the wrong device."""
    device = problem.device
    if device.type == "cuda" and device.index is not None and device.index != torch.cuda.current_device():
        return torch.cuda.device(device)
    return None


@functools.cache
def _kernels():
    """The portable forward and the selection modules, imported on first use (importing them
    imports Triton); kept, so that a call pays no import statement."""
    from streamkl.backends.triton import forward, select

    return forward, select


@functools.cache
def _gluon_kernels():
    """The Gluon forward and backward modules (only where `select` chose them: they need Gluon)."""
    from streamkl.backends.triton.gluon import backward, forward

    return forward, backward
