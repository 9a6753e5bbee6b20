"""Shared test setup: every backend runs the same suite, outputs are poisoned before each run.

Without a CUDA GPU the Triton kernels run under TRITON_INTERPRET=1 (set here, before Triton is
imported) and the CuPy kernels' CUDA C++ under a host emulator (STREAMKL_CUPY_EMULATE=1), on the
small shapes of this suite; on the GPU they run for real.
"""

from __future__ import annotations

import os
import zlib

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
    # the CuPy backend's CUDA C++ kernels run on a host emulator (streamkl/backends/cupy/emulate.py)
    os.environ.setdefault("STREAMKL_CUPY_EMULATE", "1")

import streamkl  # noqa: E402
from streamkl.backends import base  # noqa: E402
from streamkl.dispatch import PRIORITY, get_backend  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _backend_params():
    params = []
    for name in PRIORITY:
        reasons = get_backend(name).environment_reasons()
        marks = [pytest.mark.skip(reason=f"{name}: {'; '.join(reasons)}")] if reasons else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params


BACKEND_PARAMS = _backend_params()


@pytest.fixture(params=BACKEND_PARAMS)
def backend(request):
    return request.param


@pytest.fixture(autouse=True)
def poison_outputs(monkeypatch):
    monkeypatch.setenv(base.POISON_ENV, "1")  # fresh outputs start as NaN: a row never written fails
    yield


@pytest.fixture(autouse=True)
def fresh_seed(request):
    # fresh random inputs per test, reproducible from the test's id
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
    yield


__all__ = ["DEVICE", "streamkl"]
