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
from types import SimpleNamespace

import pytest
import torch

from streamkl.backends.cupy.launch import MmaBackward, backward_variants, forward_shape

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

def _launched(dim: int, needs, deterministic=False) -> list[MmaBackward]:
    problem = SimpleNamespace(dtype=torch.bfloat16, dim1=dim, dim2=dim, deterministic=deterministic,
                              heads_k1=2, heads_k2=2)
    return backward_variants(problem, needs)


STUDENT = (False, False, True, True)
# the student's dk kernel (side 2, dq by atomics) at D = 128 and 64, as launched
STUDENT_DK = [*_launched(128, STUDENT), *_launched(64, STUDENT)]
# the default paths at D = 64 and 128: forward, the student's fused dk, the all-four launches (one
# per side at 128, both sides at 64), the deterministic two-sided dq and dk
KEY_BACKWARD = list({variant.name: variant for variant in (
    *STUDENT_DK, *_launched(128, (True,) * 4), *_launched(64, (True,) * 4),
    *_launched(128, (True,) * 4, deterministic=True),
)}.values())
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
            assert usage.registers <= 168, (variant.name, usage)  # three 4-warp blocks per SM
    if HAS_NVCC:
        for variant in variants:
            ours, theirs = nvrtc[variant.name], built["nvcc"][variant.name]
            assert ours.registers <= theirs.registers + MARGIN, (variant.name, ours, theirs)
            assert ours.spill_stores <= theirs.spill_stores, (variant.name, ours, theirs)


@needs_nvrtc
def test_student_dk_occupancy_on_hopper():
    """The student's dk kernel as NVRTC builds it for sm_90: no spills, and registers and shared
    memory together let three 4-warp blocks share an SM at D = 128 (at most 168 registers: 12
    warps of 168 x 32 fill 64512 of the 65536), four at D = 64 (at most 128) -- the occupancy
    launch.dk_ring_rows chooses half-tile ring slots for."""
    usage = registers.measure(2, 90, STUDENT_DK, ["nvrtc"])["nvrtc"]
    for variant, blocks in zip(STUDENT_DK, (3, 4)):
        found = usage[variant.name]
        assert found.spill_stores == 0 and found.spill_loads == 0, (variant.name, found)
        assert registers.register_blocks_per_sm(found.registers, variant.threads) >= blocks, (variant.name, found)
        assert registers.hopper_blocks(variant, found) >= blocks, (variant.name, found, variant.shared_bytes)
