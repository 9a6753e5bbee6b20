"""The CuPy backend's own tests: its CUDA sources compile (nvcc, when on PATH), its argument record
matches the C struct, and on a GPU every SPEC feature matches the float64 reference.

The GPU tests run with CuPy and a CUDA device; with STREAMKL_CUPY_EMULATE=1 and no GPU the
smaller ones run the same kernels on the CPU emulator. The shared suite (test_kl.py,
test_varlen.py, test_block_mask.py) covers the backend too: `pytest -k cupy`.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from conftest import DEVICE
from helpers import check_against_reference, make_inputs, rel_l2

import streamkl
from streamkl import BlockMask
from streamkl.backends.cupy import CupyBackend, emulate
from streamkl.backends.cupy.launch import (
    SOURCE,
    MmaBackward,
    MmaForward,
    backward_variants,
    forward_shape,
    forward_tiles,
    forward_variant,
    forward_with,
    mma_options,
    params_dtype,
    shared_bytes,
    source_text,
)
from streamkl.problem import build_problem
from streamkl.reference import reference_kl
from streamkl.sparse.schedule import get_schedule
from streamkl.varlen import cu_seqlens_from_lengths

_REASONS = CupyBackend().environment_reasons()
ON_GPU = not _REASONS and DEVICE == "cuda" and not emulate.emulating()
EMULATED = not _REASONS and DEVICE == "cpu" and emulate.emulating()
needs_backend = pytest.mark.skipif(not (ON_GPU or EMULATED), reason="; ".join(_REASONS) or "no CUDA GPU")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CuPy and a CUDA GPU (too slow on the CPU emulator)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
DTYPE_IDS = ["fp32", "fp16", "bf16"]


# ---------------------------------------------------------------------------------- no GPU needed
# tensor-core forward variants the nvcc test instantiates: the shapes forward_shape chooses (64-key
# tiles of 8 warps, q in registers, the widest heads), D1 != D2
MMA_VARIANTS = [forward_shape(64, 32), forward_shape(128, 128), forward_shape(256, 256)]
# tensor-core backward variants: every side combination of both kernels at 128 + 128, the widest
# (one stage, one side per launch), small and unequal head dims
MMA_BACKWARD = [
    *(MmaBackward(kernel, 128, 128, 2, side1, side2)
      for kernel in ("dq", "dk") for side1, side2 in ((1, 0), (0, 1), (1, 1))),
    MmaBackward("dq", 256, 256, 1, 1, 0), MmaBackward("dk", 256, 256, 1, 0, 1), MmaBackward("dk", 16, 48, 2, 1, 1),
    MmaBackward("dk", 128, 128, 2, 0, 1, 1), MmaBackward("dk", 64, 64, 2, 1, 1, 1),
    MmaBackward("dk", 16, 48, 2, 1, 1, 1), MmaBackward("dk", 128, 80, 2, 1, 0, 1),
]


def _nvcc(arch: int, code: int, names, tmp_path, defines=()):
    """Compile the NVRTC text with `names` instantiated; return nvcc's (returncode, output)."""
    unit = tmp_path / "unit.cu"  # the text NVRTC compiles (local includes inlined)
    lines = [source_text(), *(f"template __global__ void {name}(const KLParams);" for name in names)]
    unit.write_text("\n".join(lines) + "\n")
    command = ["nvcc", f"-arch=sm_{arch}", "-std=c++17", f"-DSTREAMKL_INPUT={code}", *defines, "-c", str(unit),
               "-o", str(tmp_path / "kernels.o")]
    result = subprocess.run(command, capture_output=True, text=True)
    return result.returncode, result.stdout + result.stderr


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize(
    "arch,code,tensor_core_only",
    [(80, 0, False), (80, 1, False), (80, 2, False), (90, 1, False), (90, 2, True)],
    ids=["sm80-fp32", "sm80-fp16", "sm80-bf16", "sm90-fp16", "sm90-bf16-tensor-core-module"],
)
def test_kernels_compile_with_nvcc(arch, code, tensor_core_only, tmp_path):
    """The NVRTC text with the tensor-core templates instantiated as they are launched; one case
    compiles it as a tensor-core module is (launch.mma_options: the FMA kernels left out)."""
    names = [v.name for v in MMA_VARIANTS + MMA_BACKWARD] if code != 0 else []
    defines = [option for option in mma_options(code) if option.startswith("-D")] if tensor_core_only else []
    returncode, output = _nvcc(arch, code, names, tmp_path, defines)
    assert returncode == 0, output
    assert "warning" not in output.lower(), output


def test_nvrtc_source_inlines_the_local_includes():
    text = source_text()
    assert '#include "' not in text
    assert "kl_forward_mma" in text and "sk_mma_16816" in text and "#pragma once" not in text


@pytest.mark.parametrize(
    "dtype,dims,expected",
    [
        (torch.float32, (128, 128), None),
        (torch.bfloat16, (128, 128), MmaForward(128, 128, block_k=32, m_tiles=2, warps=4, q_regs=1)),
        (torch.float16, (64, 80), MmaForward(64, 80, block_k=32, m_tiles=2, warps=4, q_regs=1)),
        (torch.bfloat16, (64, 64), MmaForward(64, 64, block_k=64, m_tiles=1, warps=8)),
        (torch.float16, (80, 24), MmaForward(80, 32, block_k=64, m_tiles=1, warps=8)),
        (torch.bfloat16, (1, 7), MmaForward(16, 16, block_k=64, m_tiles=1, warps=8)),
        (torch.bfloat16, (200, 130), MmaForward(208, 144, block_k=32, m_tiles=1, warps=4)),
        (torch.float16, (256, 256), MmaForward(256, 256, block_k=32, m_tiles=1, warps=4)),
    ],
    ids=["fp32-fma", "bf16-128", "fp16-64x80", "bf16-64", "fp16-80x24", "bf16-1x7", "bf16-200x130", "fp16-256"],
)
def test_forward_variant_follows_the_problem(dtype, dims, expected):
    q1 = torch.randn(1, 70, 2, dims[0]).to(dtype)
    q2 = torch.randn(1, 70, 2, dims[1]).to(dtype)
    problem = build_problem(q1, q1, q2, q2)
    assert forward_variant(problem) == expected
    assert forward_tiles(problem) == ((64, 32) if expected is None else (expected.block_q, expected.block_k))


@pytest.mark.parametrize(
    "dtype,dims,heads_k,needs,deterministic,expected",
    [
        (torch.float32, (128, 128), (2, 2), (1, 1, 1, 1), False, None),
        (torch.bfloat16, (128, 128), (2, 2), (0, 0, 1, 1), False, ["dk<128, 128, 2, 0, 1, 1>"]),
        (torch.bfloat16, (128, 128), (2, 2), (0, 0, 1, 1), True, ["dq<128, 128, 2, 0, 1>", "dk<128, 128, 2, 0, 1, 0>"]),
        (torch.bfloat16, (128, 128), (2, 2), (1, 1, 1, 1), False,
         ["dk<128, 128, 2, 1, 0, 1>", "dk<128, 128, 2, 0, 1, 1>"]),
        (torch.bfloat16, (128, 128), (2, 2), (1, 1, 1, 1), True, ["dq<128, 128, 2, 1, 1>", "dk<128, 128, 2, 1, 1, 0>"]),
        (torch.bfloat16, (64, 64), (2, 2), (1, 1, 1, 1), False, ["dk<64, 64, 2, 1, 1, 1>"]),
        (torch.float16, (64, 40), (2, 1), (1, 1, 1, 1), True,
         ["dq<64, 48, 2, 1, 1>", "dk<64, 48, 2, 1, 0, 0>", "dk<64, 48, 2, 0, 1, 0>"]),
        (torch.float16, (64, 40), (2, 1), (1, 0, 1, 1), False, ["dq<64, 48, 2, 1, 0>", "dk<64, 48, 2, 0, 1, 1>"]),
        (torch.float16, (200, 130), (2, 2), (1, 0, 1, 1), False,
         ["dq<208, 144, 1, 1, 0>", "dq<208, 144, 1, 0, 1>", "dk<208, 144, 1, 0, 1, 0>"]),
        (torch.bfloat16, (32, 32), (2, 2), (0, 1, 0, 0), False, ["dk<32, 32, 2, 1, 0, 0>"]),
    ],
    ids=["fp32-fma", "bf16-student", "bf16-student-det", "bf16-all4", "bf16-all4-det", "bf16-64-all4",
         "fp16-gqa-differs-det", "fp16-gqa-differs", "fp16-wide", "bf16-k1-only"],
)
def test_backward_variants_follow_the_problem(dtype, dims, heads_k, needs, deterministic, expected):
    from streamkl.problem import build_problem

    q1, q2 = torch.randn(1, 70, 2, dims[0]).to(dtype), torch.randn(1, 70, 2, dims[1]).to(dtype)
    k1, k2 = torch.randn(1, 50, heads_k[0], dims[0]).to(dtype), torch.randn(1, 50, heads_k[1], dims[1]).to(dtype)
    variants = backward_variants(build_problem(q1, k1, q2, k2, deterministic=deterministic), needs)
    names = None if variants is None else [v.name.removeprefix("kl_backward_").replace("_mma", "") for v in variants]
    assert names == expected


def test_tensor_core_backward_fits_shared_memory():
    for dim1 in range(16, 257, 16):
        for dim2 in range(16, 257, 16):
            stages = 2 if dim1 + dim2 <= 256 else 1
            for kernel, atomic in (("dq", 0), ("dk", 0), ("dk", 1)):
                need = MmaBackward(kernel, dim1, dim2, stages, 1, 1, atomic).shared_bytes
                assert need <= 163 * 1024  # A100's opt-in limit
                if stages == 2:  # two blocks per SM on Hopper
                    assert 2 * need <= 227 * 1024


def test_tensor_core_forward_fits_shared_memory():
    for dim1 in range(16, 257, 16):  # the chosen shape at every head-dim pair: A100's opt-in limit
        for dim2 in range(16, 257, 16):
            need = forward_shape(dim1, dim2).shared_bytes
            assert need <= 163 * 1024
            if dim1 + dim2 <= 256:  # two blocks per SM on Hopper
                assert 2 * need <= 227 * 1024


def test_params_record_follows_the_struct():
    record = params_dtype()
    text = SOURCE.read_text()
    for name in ("q1", "sched_partial", "mask2_k", "need_dk2", "batch_heads", "scale2"):
        assert name in record.names and name in text
    assert record.itemsize % 8 == 0
    assert record.fields["q1"][1] == 0


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the emulator")
def test_emulator_sees_the_same_record():
    assert emulate._library(0).emu_params_size() == params_dtype().itemsize


def test_shared_memory_fits_hopper_at_the_largest_head_dim():
    assert max(shared_bytes(256, 256).values()) <= 227 * 1024


# ---------------------------------------------------------------------------------- against the reference
@dataclass(frozen=True)
class Case:
    batch: int
    seqlen_q: int
    seqlen_k: int
    heads: int
    heads_k: tuple[int, int]
    dims: tuple[int, int]
    causal: bool = False
    window: tuple[int, int] = (-1, -1)
    gpu_only: bool = False

    @property
    def id(self) -> str:
        text = (
            f"B{self.batch}-Nq{self.seqlen_q}-Nk{self.seqlen_k}-H{self.heads}-Hk{self.heads_k[0]}x"
            f"{self.heads_k[1]}-D{self.dims[0]}x{self.dims[1]}"
        )
        if self.causal:
            text += "-causal"
        if self.window != (-1, -1):
            text += f"-win{self.window[0]}_{self.window[1]}"
        return text

    def inputs(self, dtype, requires_grad=(True,) * 4):
        return make_inputs(
            (self.batch, self.seqlen_q),
            (self.batch, self.seqlen_k),
            self.heads,
            self.heads_k,
            self.dims,
            dtype,
            DEVICE,
            requires_grad,
        )


CASES = [
    Case(2, 100, 300, 4, (2, 4), (64, 32)),
    Case(1, 77, 77, 2, (1, 2), (32, 32), causal=True),
    Case(2, 130, 50, 3, (3, 1), (16, 48), causal=True),  # Nq > Nk: first rows empty
    Case(1, 90, 200, 2, (2, 2), (32, 16), window=(20, 7)),
    Case(1, 120, 120, 4, (1, 2), (80, 96), causal=True, window=(33, -1)),
    Case(1, 45, 170, 2, (2, 1), (96, 40), window=(-1, 30)),
    Case(1, 33, 65, 1, (1, 1), (1, 7)),  # tiny head dims
    Case(2, 300, 257, 4, (4, 2), (128, 64), causal=True, gpu_only=True),
    Case(1, 200, 190, 2, (1, 2), (256, 256), gpu_only=True),  # the largest head dim
    Case(1, 150, 150, 2, (2, 1), (200, 130), window=(40, 40), gpu_only=True),
    Case(2, 1000, 1000, 4, (2, 2), (128, 64), causal=True, gpu_only=True),  # medium
]


def _case_params():
    for case in CASES:
        marks = [gpu_only] if case.gpu_only else []
        yield pytest.param(case, id=case.id, marks=marks)


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize("case", list(_case_params()))
def test_dense_against_reference(case, dtype):
    if EMULATED and dtype != torch.float32 and case.seqlen_q > 80:
        pytest.skip("emulator: half precision on the small cases only")
    check_against_reference(case.inputs(dtype), "cupy", causal=case.causal, window=case.window)


@needs_backend
@pytest.mark.parametrize(
    "requires_grad",
    [(False, False, True, True), (True, False, False, False), (False, True, False, True), (False, False, False, True)],
    ids=["student-only", "q1-only", "keys-only", "k2-only"],
)
def test_partial_gradients(requires_grad):
    case = Case(2, 70, 90, 4, (2, 1), (48, 32), causal=True)
    check_against_reference(case.inputs(torch.float32, requires_grad), "cupy", causal=True)


@needs_backend
@pytest.mark.parametrize("dtype", DTYPES, ids=DTYPE_IDS)
@pytest.mark.parametrize(
    "options", [dict(), dict(causal=True), dict(causal=True, window=(20, -1))], ids=["dense", "causal", "causal-win20"]
)
def test_varlen_with_empty_sequences(options, dtype):
    if EMULATED and dtype == torch.float16:
        pytest.skip("emulator: float32 and bfloat16 only")
    len_q, len_k = [37, 0, 100, 5, 64, 0], [50, 3, 0, 20, 77, 9]
    cu_q, cu_k = cu_seqlens_from_lengths(len_q, DEVICE), cu_seqlens_from_lengths(len_k, DEVICE)
    inputs = make_inputs((sum(len_q) + 6,), (sum(len_k) + 2,), 4, (2, 1), (40, 24), dtype, DEVICE)
    out = check_against_reference(inputs, "cupy", cu_seqlens=cu_q, cu_seqlens_k=cu_k, **options)
    end = int(cu_q[-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))


@needs_backend
@pytest.mark.parametrize("sides", ["both", "side1", "side2", "different"])
@pytest.mark.parametrize("blocks", [(16, 64), (128, 32)], ids=["b16x64", "b128x32"])
def test_block_masks(sides, blocks):
    batch, n_q, n_k, heads = 2, 150, 170, 4
    bq, bk = blocks
    shape = (batch, heads, -(-n_q // bq), -(-n_k // bk))
    pattern = torch.rand(shape, device=DEVICE) < 0.5
    pattern[..., 0] = True
    other = pattern | (torch.rand(shape, device=DEVICE) < 0.3)
    mask, wider = BlockMask.from_dense(pattern, blocks), BlockMask.from_dense(other, blocks)
    masks = {
        "both": dict(mask1=mask, mask2=mask),
        "side1": dict(mask1=mask),
        "side2": dict(mask2=mask),
        "different": dict(mask1=mask, mask2=wider),
    }[sides]
    inputs = make_inputs((batch, n_q), (batch, n_k), heads, (2, 4), (32, 48), torch.float32, DEVICE)
    out = check_against_reference(inputs, "cupy", causal=True, **masks)
    if sides == "side2":  # a dense teacher against a sparse student: +inf rows exist
        assert torch.isinf(out).any()


@needs_backend
@pytest.mark.parametrize("blocks", [(16, 64), (128, 32)], ids=["b16x64", "b128x32"])
def test_block_masks_tensor_core_forward(blocks):
    """Different masks per side, mask blocks narrower and wider than the forward's 64-key tiles."""
    batch, n_q, n_k, heads = 1, 75, 140, 2
    bq, bk = blocks
    shape = (batch, heads, -(-n_q // bq), -(-n_k // bk))
    pattern = torch.rand(shape, device=DEVICE) < 0.5
    pattern[..., 0] = True
    wider = pattern | (torch.rand(shape, device=DEVICE) < 0.3)
    masks = dict(mask1=BlockMask.from_dense(pattern, blocks), mask2=BlockMask.from_dense(wider, blocks))
    inputs = make_inputs((batch, n_q), (batch, n_k), heads, (2, 1), (32, 16), torch.bfloat16, DEVICE)
    check_against_reference(inputs, "cupy", check_grads=False, causal=True, **masks)


@needs_backend
def test_widest_heads_tensor_core_forward():
    """Head dims past 256 together take one 16-row block per warp (a 64-row tile)."""
    inputs = make_inputs((1, 70), (1, 50), 2, (1, 2), (160, 136), torch.float16, DEVICE, (False,) * 4)
    check_against_reference(inputs, "cupy", causal=True)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_unaligned_rows_match_aligned(dtype):
    """Rows that do not start on 16 bytes take the element-wise loads: the same bits in shared
    memory, so the same results as the 16-byte cp.async path."""
    aligned = make_inputs((1, 70), (1, 90), 2, (2, 1), (40, 32), dtype, DEVICE, (False,) * 4)
    unaligned = []
    for t in aligned:
        room = torch.zeros(*t.shape[:-1], t.shape[-1] + 1, dtype=dtype, device=DEVICE)
        room[..., 1:] = t
        unaligned.append(room[..., 1:])  # rows start 2 bytes past an alignment, odd strides
    a = streamkl.kl(*aligned, reduction="none", causal=True, backend="cupy")
    b = streamkl.kl(*unaligned, reduction="none", causal=True, backend="cupy")
    assert torch.equal(a, b)


@needs_backend
def test_block_masks_varlen_half():
    len_q = [70, 0, 130]
    cu = cu_seqlens_from_lengths(len_q, DEVICE)
    pattern = torch.rand(3, 1, 3, 5, device=DEVICE) < 0.6
    pattern[..., 0] = True
    mask = BlockMask.from_dense(pattern, (64, 32))
    dtype = torch.float32 if EMULATED else torch.bfloat16
    inputs = make_inputs((sum(len_q) + 3,), (sum(len_q) + 3,), 2, (1, 2), (64, 32), dtype, DEVICE)
    check_against_reference(inputs, "cupy", cu_seqlens=cu, mask1=mask, mask2=mask, causal=True)


# ---------------------------------------------------------------------------------- contract details
@needs_backend
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=["fp16", "fp32"])
def test_deterministic_gradients_are_bitwise_reproducible(dtype):
    """deterministic=True: no atomics (half inputs take the query-major dq kernel); the default
    mode's atomic dq may differ in the last bits between runs, and matches within rounding."""
    # two query and two key tiles of 64, a window, GQA on side 1, unequal head dims (small: the
    # emulator runs it in CI)
    case = Case(1, 80, 90, 4, (2, 1), (80, 24), causal=True, window=(30, -1))
    inputs = case.inputs(dtype)
    grads = []
    for deterministic in (True, True, False):
        for t in inputs:
            t.grad = None
        streamkl.kl(*inputs, deterministic=deterministic, backend="cupy", causal=True, window=(30, -1)).backward()
        grads.append([t.grad.clone() for t in inputs])
    for a, b, default in zip(*grads):
        assert torch.equal(a, b)
        assert rel_l2(default.float(), a.float()) <= 1e-2


@needs_backend
def test_strided_inputs_match_contiguous():
    batch, n, heads, dim = 2, 90, 4, 40
    base = [torch.randn(batch, heads, n, dim, device=DEVICE) for _ in range(4)]
    strided = [b.clone().transpose(1, 2).requires_grad_() for b in base]
    contiguous = [b.transpose(1, 2).contiguous().requires_grad_() for b in base]
    a = streamkl.kl(*strided, reduction="none", causal=True, backend="cupy")
    b = streamkl.kl(*contiguous, reduction="none", causal=True, backend="cupy")
    assert torch.equal(a, b)
    a.sum().backward()
    b.sum().backward()
    for s, c in zip(strided, contiguous):
        assert torch.equal(s.grad, c.grad)


@needs_backend
def test_nearly_identical_distributions():
    q1 = torch.randn(2, 150, 3, 32, device=DEVICE)
    k1 = torch.randn(2, 150, 3, 32, device=DEVICE)
    q2 = q1 + 1e-3 * torch.randn_like(q1)
    for causal in (False, True):
        out = streamkl.kl(q1, k1, q2, k1.clone(), reduction="none", causal=causal, backend="cupy")
        ref, _, _ = reference_kl(q1.double(), k1.double(), q2.double(), k1.double(), causal=causal)
        assert (out.double() - ref).abs().max().item() <= 1e-5


@needs_backend
def test_empty_rows_exact_zero_and_nan_propagates():
    case = Case(1, 96, 40, 2, (1, 2), (32, 16), causal=True)
    q1, k1, q2, k2 = case.inputs(torch.float32)
    out, lse1, lse2 = streamkl.kl(q1, k1, q2, k2, reduction="none", return_lse=True, causal=True, backend="cupy")
    assert torch.equal(out[:, :56], torch.zeros_like(out[:, :56]))
    assert torch.isneginf(lse1[:, :, :56]).all() and torch.isneginf(lse2[:, :, :56]).all()
    out.sum().backward()
    assert torch.equal(q1.grad[:, :56], torch.zeros_like(q1.grad[:, :56]))
    assert all(torch.isfinite(t.grad).all() for t in (q1, k1, q2, k2))
    bad = q1.detach().clone()
    bad[0, 70, 1, 0] = float("nan")
    out = streamkl.kl(bad, k1, q2, k2, reduction="none", causal=True, backend="cupy")
    assert torch.isnan(out[0, 70, 1]) and torch.isfinite(out[0, 71]).all()


@gpu_only
def test_runs_on_the_current_stream():
    case = Case(2, 256, 256, 4, (4, 4), (64, 64), causal=True)
    inputs = case.inputs(torch.float16)
    expected = streamkl.kl(*inputs, reduction="none", causal=True, backend="cupy")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        out = streamkl.kl(*inputs, reduction="none", causal=True, backend="cupy")
        out.sum().backward()
    torch.cuda.current_stream().wait_stream(stream)
    assert torch.equal(out, expected)


def test_refuses_oversized_head_dims():
    reasons = CupyBackend().not_supported_reasons(_problem_with_dim(320))
    assert reasons
    if ON_GPU or EMULATED:  # otherwise the environment's reasons come first
        assert any("at most 256" in r for r in reasons)


def _problem_with_dim(dim):
    from streamkl.problem import build_problem

    q = torch.randn(1, 4, 1, dim, device=DEVICE)
    return build_problem(q, q, q, q)


def test_source_is_a_cu_file():
    assert Path(SOURCE).suffix == ".cu" and Path(SOURCE).exists()


@gpu_only
def test_large_shape_matches_the_torch_backend():
    """Long sequences (many tiles, large offsets): the same numbers as the chunked torch backend."""
    case = Case(2, 3000, 2900, 8, (2, 4), (128, 64), causal=True)
    inputs = case.inputs(torch.bfloat16)
    out = streamkl.kl(*inputs, reduction="none", causal=True, backend="cupy")
    leaves = [t.detach().requires_grad_() for t in inputs]
    expected = streamkl.kl(*leaves, reduction="none", causal=True, backend="torch")
    assert rel_l2(out, expected) <= 1e-4
    upstream = torch.randn_like(out)
    grads = torch.autograd.grad((out * upstream).sum(), inputs)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)
    for g, e in zip(grads, expected_grads):
        assert rel_l2(g.float(), e.float()) <= 1e-2


@gpu_only
def test_more_sequence_heads_than_one_grid_dimension():
    """batch * heads > 65535 spills into grid.z."""
    q1, k1, q2, k2 = make_inputs((1, 3), (1, 5), 70000, (70000, 35000), (4, 8), torch.float32, DEVICE)
    check_against_reference([q1, k1, q2, k2], "cupy")


@gpu_only
def test_cuda_graph_capture():
    case = Case(2, 200, 200, 4, (2, 2), (64, 32), causal=True)
    inputs = case.inputs(torch.float16, (False,) * 4)
    expected = streamkl.kl(*inputs, reduction="none", causal=True, backend="cupy")  # warm-up: compile, schedule
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = streamkl.kl(*inputs, reduction="none", causal=True, backend="cupy")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, expected)


# ---------------------------------------------------------------------------------- the forward's tile shapes
# every shape forward_shape chooses, by its label: k64-m1-w8 (up to 64 + 64), k32-m2-w4-qr (up to
# 128 + 128), k32-m1-w4 (wider)
FORWARD_SHAPES = {shape.label: shape for shape in map(forward_shape, (64, 128, 256), (64, 128, 256))}


def _check_forward(variant, dims, dtype, shape_q, shape_k, heads, heads_k, **options) -> MmaForward:
    """The tensor-core forward `variant` (None: the one forward_variant chooses) against the float64
    reference (outputs poisoned by conftest): KL, lse1, lse2, with their infinities."""
    inputs = make_inputs(shape_q, shape_k, heads, heads_k, dims, dtype, DEVICE, (False,) * 4)
    problem = build_problem(*inputs, **options)
    variant = variant or forward_variant(problem)
    schedule = get_schedule(problem, variant.block_q, variant.block_k)
    kl, lse1, lse2, _ = forward_with(variant, problem, *inputs, schedule)
    ref, ref_lse1, ref_lse2 = reference_kl(*(t.double() for t in inputs), **options)
    for label, a, e in (("kl", kl, ref), ("lse1", lse1, ref_lse1), ("lse2", lse2, ref_lse2)):
        assert not torch.isnan(a).any(), f"{label}: NaN"
        assert torch.equal(torch.isinf(a), torch.isinf(e)), f"{label}: infinities differ"
        finite = torch.isfinite(e)
        assert rel_l2(a[finite], e[finite]) <= 1e-2, label
    return variant


@pytest.mark.skipif(not EMULATED, reason="the emulated shapes (on a GPU: test_forward_shape_on_gpu)")
@pytest.mark.parametrize("label", list(FORWARD_SHAPES))
def test_forward_shape_emulated(label):
    """Each tile shape on small head dims on the CPU emulator: several key tiles with partial ones
    last (bounds, causal window, a side-1 block mask), negative scales (negated q), a zero one, and
    whole query tiles of full key tiles followed by a partial one or by none."""
    shape = FORWARD_SHAPES[label]
    pattern = torch.rand(1, 2, 1, 3, device=DEVICE) < 0.6
    pattern[..., -1] = True
    _check_forward(dataclasses.replace(shape, dim1=32, dim2=32), (32, 24), torch.bfloat16, (1, 40), (1, 150), 2,
                   (1, 2), causal=True, window=(90, -1), mask1=BlockMask.from_dense(pattern, (64, 64)), scale1=-0.2,
                   scale2=0.0)
    cu_q = cu_seqlens_from_lengths([shape.block_q, shape.block_q], DEVICE)
    cu_k = cu_seqlens_from_lengths([150, 128], DEVICE)
    _check_forward(dataclasses.replace(shape, dim1=16, dim2=48), (16, 40), torch.float16, (2 * shape.block_q,),
                   (278,), 2, (2, 1), cu_seqlens=cu_q, cu_seqlens_k=cu_k, scale2=-0.3)


# head dims forward_shape serves with each shape up to 128 + 128: dense GQA, windowed, masked,
# varlen, rows not 16-byte aligned
GPU_SHAPE_DIMS = {
    "k32-m2-w4-qr": [(128, 128), (128, 64), (96, 96), (80, 64), (120, 100)],
    "k64-m1-w8": [(64, 64), (64, 48), (64, 64), (48, 64), (60, 56)],
}


@gpu_only
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("label", list(GPU_SHAPE_DIMS))
def test_forward_shape_on_gpu(label, dtype):
    """The default path of each shape: many query and key tiles (lengths not multiples of the
    tiles), GQA, causal, windows, masks per side, varlen with empty sequences, negative and zero
    scales, rows not 16-byte aligned (element loads)."""
    dense, windowed, masked, varlen, unaligned = GPU_SHAPE_DIMS[label]
    chosen = [_check_forward(None, dense, dtype, (2, 1000), (2, 777), 4, (2, 4), causal=True),
              _check_forward(None, windowed, dtype, (1, 300), (1, 1030), 4, (4, 1), window=(200, 30), scale1=-0.05)]
    pattern = torch.rand(2, 4, 5, 9, device=DEVICE) < 0.5
    pattern[..., 0] = True
    wider = pattern | (torch.rand(pattern.shape, device=DEVICE) < 0.3)
    chosen.append(_check_forward(None, masked, dtype, (2, 260), (2, 520), 4, (2, 4), causal=True,
                                 mask1=BlockMask.from_dense(pattern, (64, 64)),
                                 mask2=BlockMask.from_dense(wider, (64, 64))))
    len_q, len_k = [37, 0, 1000, 5, 64, 0], [50, 3, 0, 20, 777, 9]
    cu_q, cu_k = cu_seqlens_from_lengths(len_q, DEVICE), cu_seqlens_from_lengths(len_k, DEVICE)
    chosen.append(_check_forward(None, varlen, dtype, (sum(len_q) + 6,), (sum(len_k) + 2,), 4, (2, 1),
                                 cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=True, scale2=0.0))
    chosen.append(_check_forward(None, unaligned, dtype, (1, 333), (1, 401), 2, (2, 2), causal=True))
    assert {variant.label for variant in chosen} == {label}


@needs_backend
def test_calls_from_several_threads_match_one_call():
    """Calls on several Python threads at once give each its own result: on the GPU each launch is
    on its stream; the emulator runs one launch at a time (its runtime is one, and a launch
    releases the GIL)."""
    from concurrent.futures import ThreadPoolExecutor

    cases = [Case(1, 70, 90, 2, (2, 1), (32, 16), causal=True), Case(1, 50, 64, 2, (1, 2), (16, 32))]
    inputs = [case.inputs(torch.float16, (False,) * 4) for case in cases]

    def call(i):
        case = cases[i % 2]
        return streamkl.kl(*inputs[i % 2], reduction="none", backend="cupy", causal=case.causal, window=case.window)

    alone = [call(0), call(1)]
    with ThreadPoolExecutor(4) as pool:
        together = list(pool.map(call, range(8)))
    for i, out in enumerate(together):
        assert torch.equal(out, alone[i % 2])
