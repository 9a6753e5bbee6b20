"""CuPy `RawKernel` backend: CUDA C++ kernels (kernels.cu) compiled by NVRTC through CuPy, launched
on torch's current stream with torch tensors passed by address (no copies).

- forward: one block per (query tile, sequence * head), the SPEC's five running statistics; on
  tensor cores (mma.sync, FlashAttention-2 structure) for float16 / bfloat16, exact float32 FMAs
  for float32 (`launch.forward_variant` decides);
- backward: a query-major dq kernel and a key-major dk kernel over the transposed schedule, each
  owning its outputs; for float16 / bfloat16 on tensor cores, where unless `deterministic` the
  key-major kernel also adds dq by atomics (`launch.backward_variants` decides). float32 takes
  FMA kernels, bitwise reproducible in every mode.

With STREAMKL_CUPY_EMULATE=1 the same kernels run on CPU tensors through a host emulator (see
emulate.py): for tests without a GPU.
"""

from __future__ import annotations

import functools

from streamkl.backends.base import Backend
from streamkl.backends.cupy import emulate
from streamkl.problem import Problem

MAX_HEAD_DIM = 256


@functools.lru_cache(maxsize=1)
def _gpu_reasons() -> tuple[str, ...]:
    try:
        import cupy  # noqa: F401
    except Exception as exc:  # pragma: no cover - depends on the environment
        return (f"CuPy is not importable ({type(exc).__name__}: {exc}); pip install cupy-cuda12x or cupy-cuda13x",)
    import torch

    if not torch.cuda.is_available():
        return (f"no CUDA GPU is visible (set {emulate.ENV_VAR}=1 to run the kernels on the CPU emulator)",)
    return ()


class CupyBackend(Backend):
    name = "cupy"
    needs_cuda = True

    def environment_reasons(self) -> list[str]:
        if emulate.emulating():
            return emulate.reasons()
        return list(_gpu_reasons())

    def environment_key(self) -> tuple:
        return emulate.environment_key()

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        reasons = self.environment_reasons()
        if reasons:
            return reasons
        from streamkl.backends.cupy import launch

        if emulate.emulating():
            if problem.device.type != "cpu":
                reasons.append(
                    f"inputs are on {problem.device}; the CPU emulator ({emulate.ENV_VAR}=1) takes CPU tensors"
                )
        elif problem.device.type != "cuda":
            reasons.append(f"inputs are on {problem.device}, not on a CUDA device")
        for side, dim in ((1, problem.dim1), (2, problem.dim2)):
            if dim > MAX_HEAD_DIM:
                reasons.append(f"head dim of side {side} is {dim}; the CuPy kernels take at most {MAX_HEAD_DIM}")
        if not reasons and problem.device.type == "cuda":
            need = max(launch.shared_bytes(problem.dim1, problem.dim2).values())
            variant = launch.forward_variant(problem)
            if variant is not None:
                need = max(need, variant.shared_bytes)
            for backward in launch.backward_variants(problem, (True,) * 4) or ():
                need = max(need, backward.shared_bytes)
            limit = launch.shared_memory_limit(problem.device)
            if need > limit:
                reasons.append(
                    f"head dims {problem.dim1} + {problem.dim2} need {need} bytes of shared memory per block; "
                    f"this GPU allows {limit}"
                )
        return reasons

    def tile_sizes(self, problem: Problem) -> tuple[int, int]:
        from streamkl.backends.cupy.launch import forward_tiles

        return forward_tiles(problem)

    def forward(self, problem: Problem, q1, k1, q2, k2, schedule):
        from streamkl.backends.cupy.launch import kl_forward

        return kl_forward(problem, q1, k1, q2, k2, schedule)

    def backward(self, problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs):
        from streamkl.backends.cupy.launch import kl_backward

        return kl_backward(problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule, needs)
