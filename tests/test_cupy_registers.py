"""The tensor-core kernels as users run them, built by NVRTC the way CuPy builds them (no GPU): no
spilled bytes in the backward and, where nvcc and ptxas are on PATH, registers within a few of
what nvcc gives the same source. NVRTC once gave shared-memory pointers 64 bits where nvcc gives
32, which took the D=128 fused dk kernel from nvcc's 168 registers to 253 (docs/cupy.md).

Needs libnvrtc (the `nvidia-cuda-nvrtc` wheel, or a CUDA toolkit's); skipped without it. The
comparison with nvcc is skipped without nvcc and ptxas. tools/cupy_registers.py prints the whole
table.
"""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path

import pytest

from streamkl.backends.cupy.launch import MmaBackward, forward_shape

_TOOL = Path(__file__).resolve().parents[1] / "tools" / "cupy_registers.py"
_spec = importlib.util.spec_from_file_location("cupy_registers", _TOOL)
registers = sys.modules.setdefault("cupy_registers", importlib.util.module_from_spec(_spec))
_spec.loader.exec_module(registers)

try:
    registers._nvrtc_library()
    _NVRTC = None
except SystemExit as exc:
    _NVRTC = str(exc)
needs_nvrtc = pytest.mark.skipif(_NVRTC is not None, reason=_NVRTC or "")
HAS_NVCC = shutil.which("nvcc") is not None and shutil.which("ptxas") is not None

# the default paths at D = 64 and 128: forward, the student's fused dk (dq by atomics), the
# all-four launch of side 1, the deterministic two-sided dq and dk
KEY_BACKWARD = [
    MmaBackward("dk", 128, 128, 2, 0, 1, 1), MmaBackward("dk", 128, 128, 2, 1, 0, 1),
    MmaBackward("dk", 64, 64, 2, 1, 1, 1), MmaBackward("dq", 128, 128, 2, 1, 1),
    MmaBackward("dk", 128, 128, 2, 1, 1, 0),
]
KEY_FORWARD = [forward_shape(64, 64), forward_shape(128, 128)]
MARGIN = 8  # registers NVRTC may take past nvcc (the two front ends schedule a little differently)


@needs_nvrtc
@pytest.mark.parametrize("arch", [90])
def test_nvrtc_build_matches_nvcc(arch):
    variants = KEY_FORWARD + KEY_BACKWARD
    built = registers.measure(2, arch, variants, ["nvrtc", "nvcc"] if HAS_NVCC else ["nvrtc"])
    nvrtc = built["nvrtc"]
    for variant in KEY_BACKWARD:
        usage = nvrtc[variant.name]
        assert usage.spill_stores == 0 and usage.spill_loads == 0, (variant.name, usage)
        if variant.dim1 + variant.dim2 <= 128 or (variant.side1 + variant.side2 == 1):  # one side of 128, or 64s
            assert usage.registers <= 176, (variant.name, usage)
    if HAS_NVCC:
        for variant in variants:
            ours, theirs = nvrtc[variant.name], built["nvcc"][variant.name]
            assert ours.registers <= theirs.registers + MARGIN, (variant.name, ours, theirs)
            assert ours.spill_stores <= theirs.spill_stores, (variant.name, ours, theirs)
