"""CuPy `RawKernel` CUDA C++ backend: not written yet; the dispatcher reports it as unavailable."""

from __future__ import annotations

from streamkl.backends.base import Backend


class CupyBackend(Backend):
    name = "cupy"
    needs_cuda = True

    def environment_reasons(self) -> list[str]:
        return ["the CuPy backend is not implemented yet in this version of streamkl"]
