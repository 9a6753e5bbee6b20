"""Run kernels.cu on the CPU: the same source compiled as C++ (emulate.h maps the few CUDA
constructs it uses; emulate_runtime.h runs each CUDA thread as a fiber, barriers between them).

Set STREAMKL_CUPY_EMULATE=1 to make the cupy backend serve CPU tensors this way (tests and CI
without a GPU, like TRITON_INTERPRET=1 for Triton). Needs a C++20 compiler (g++ or $CXX). Slow:
for small shapes only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path

import numpy as np

ENV_VAR = "STREAMKL_CUPY_EMULATE"
_HERE = Path(__file__).parent
_SOURCES = ("kernels.cu", "input.cuh", "forward_mma.cuh", "backward_mma.cuh", "warp_ops.cuh", "emulate.h",
            "emulate_runtime.h", "emulate.cpp")


def emulating() -> bool:
    return os.environ.get(ENV_VAR) == "1"


def environment_key() -> tuple:
    """The environment `CupyBackend.not_supported_reasons` reads: this switch, and under it the
    compiler it finds."""
    if not emulating():
        return (None,)
    return ("1", os.environ.get("CXX"), os.environ.get("PATH"))


def compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++"))


def reasons() -> list[str]:
    missing = [name for name in _SOURCES if not (_HERE / name).exists()]
    if missing:  # the emulator's host files ship with the sources, not with every install
        return [f"{ENV_VAR}=1 needs {', '.join(missing)} next to {__file__}"]
    if compiler() is None:
        return [f"{ENV_VAR}=1 needs a C++20 compiler (g++ or $CXX) to run the kernels on the CPU"]
    return []


def build(stem: str, entry: str, sources: tuple[str, ...], defines: tuple[str, ...]) -> ctypes.CDLL:
    """The emulator library of the host C++ file `entry` (next to this module) compiled with
    `defines`, kept on disk under a digest of `sources` (every file it includes) and the defines;
    its `emu_launch(kernel, grid x, y, z, threads, shared bytes, params)` typed."""
    digest = hashlib.sha256()
    for name in sources:
        digest.update((_HERE / name).read_bytes())
    digest.update("\0".join(defines).encode())
    cache = Path(tempfile.gettempdir()) / "streamkl-cupy-emulate"
    cache.mkdir(parents=True, exist_ok=True)
    target = cache / f"{stem}-{digest.hexdigest()[:16]}.so"
    if not target.exists():  # built by one writer per (process, thread), then renamed into place
        partial = target.with_suffix(f".{os.getpid()}-{threading.get_ident()}.tmp")
        command = [compiler(), "-std=c++20", "-O2", "-shared", "-fPIC", "-pthread", "-fno-strict-aliasing",
                   "-Wno-unknown-pragmas", *defines, str(_HERE / entry), "-o", str(partial)]
        subprocess.run(command, check=True, capture_output=True, text=True)
        partial.replace(target)
    library = ctypes.CDLL(str(target))
    library.emu_launch.argtypes = [ctypes.c_int] * 5 + [ctypes.c_longlong, ctypes.c_void_p]
    library.emu_launch.restype = None
    return library


@functools.cache
def _library(input_code: int, variant: tuple[int, ...] | None = None,
             backward: tuple[int, ...] | None = None) -> ctypes.CDLL:
    """The kernels for one input dtype; with `variant`, also the tensor-core forward
    kl_forward_mma<variant> (launched as kernel 3); with `backward` (D1P, D2P, STAGES), the
    tensor-core backward kernels of those head dims (kernels 4-9)."""
    defines = (f"-DSTREAMKL_INPUT={input_code}",
               *([f"-DSK_MMA_VARIANT={','.join(map(str, variant))}"] if variant else []),
               *([f"-DSK_MMA_BACKWARD={','.join(map(str, backward))}"] if backward else []))
    return build(f"kernels-{input_code}", "emulate.cpp", _SOURCES, defines)


def launch(
    kernel: int,
    grid: tuple[int, int, int],
    threads: int,
    smem: int,
    params: np.ndarray,
    code: int,
    variant: tuple[int, ...] | None = None,
    backward: tuple[int, ...] | None = None,
) -> None:
    """Run one launch to completion on the CPU; `params` is the one-element KLParams record,
    `variant` the template arguments of kernel 3 (the tensor-core forward), `backward` the head
    dims and stages of kernels 4-9 (the tensor-core backward)."""
    library = _library(code, variant, backward)
    if library.emu_params_size() != params.dtype.itemsize:
        raise RuntimeError("KLParams layout differs between kernels.cu and launch.py")
    record = np.ascontiguousarray(params)
    library.emu_launch(kernel, *grid, threads, smem, record.ctypes.data)
