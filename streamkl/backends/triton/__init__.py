"""Triton backend (NVIDIA Ampere and Hopper)."""

from __future__ import annotations

from streamkl.backends.base import Backend
from streamkl.problem import Problem


class TritonBackend(Backend):
    name = "triton"
    needs_cuda = True

    def environment_reasons(self) -> list[str]:
        return ["the Triton backend is not implemented yet"]

    def not_supported_reasons(self, problem: Problem) -> list[str]:
        return self.environment_reasons()
