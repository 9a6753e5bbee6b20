"""`common.raw_launcher` (RAW_LAUNCH): the compiled launcher's C function called with the arguments
Triton's own Python wrapper (`CudaLauncher.__call__`, `wrap_handle_tensordesc`) would pass it, TMA
descriptors filled alike. Checked here without a GPU: a stand-in C function records what each path
hands it, the descriptor fill is a stand-in too. The GPU test (test_triton_gpu.py) runs kernels."""

from __future__ import annotations

import types

import pytest
import torch

triton = pytest.importorskip("triton")
nvidia = pytest.importorskip("triton.backends.nvidia.driver")

from streamkl.backends.triton import common  # noqa: E402


class _CLaunch:
    """Stands for the launcher's C function (a builtin: no closure), recording its arguments."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


def _fake_compiled(signature, metas, calls, pdl=True):
    launch = nvidia.wrap_handle_tensordesc(_CLaunch(calls), signature, metas)
    run = object.__new__(nvidia.CudaLauncher)
    run.launch, run.num_ctas = launch, 1
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch_cooperative_grid, run.launch_pdl = False, pdl
    return types.SimpleNamespace(run=run, function=1234, packed_metadata=("packed",))


def _same(a, b):
    assert len(a) == len(b)
    for x, y in zip(a, b, strict=True):
        assert x is y or (not isinstance(x, torch.Tensor) and x == y), (x, y)


@pytest.mark.parametrize("layout", ["front", "between", "none"])
def test_raw_launcher_passes_what_triton_passes(layout, monkeypatch):
    fills = []

    def fill(*args):
        fills.append(args)
        return ("tensormap", len(fills))

    monkeypatch.setattr(triton.runtime.driver, "_active",
                        types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill)))
    from triton.tools.tensor_descriptor import TensorDescriptor

    x = torch.zeros(256, 4, 64, dtype=torch.bfloat16)
    y = torch.zeros(128, 2, 64, dtype=torch.float32)
    d0 = common.fast_descriptor(TensorDescriptor, x, 256, [128, 64])
    d1 = common.fast_descriptor(TensorDescriptor, y, 128, [64, 64])
    meta = lambda size, kind, block: dict(swizzle=128, elem_size=size, elem_type=kind,  # noqa: E731
                                          block_size=block, fp4_padded=False)
    out, n, s = torch.zeros(4), 7, 0.5
    if layout == "front":
        signature = dict(a="tensordesc<bf16[128, 64]>", b="tensordesc<fp32[64, 64]>", o="*fp32", n="i32", s="fp32",
                         C="constexpr")
        metas, args = [meta(2, 9, [128, 64]), meta(4, 7, [64, 64])], (d0, d1, out, n, s)
    elif layout == "between":
        signature = dict(o="*fp32", a="tensordesc<bf16[128, 64]>", n="i32", b="tensordesc<fp32[64, 64]>", s="fp32",
                         C="constexpr")
        metas, args = [meta(2, 9, [128, 64]), meta(4, 8, [64, 64])], (out, d0, n, d1, s)
    else:
        signature = dict(o="*fp32", n="i32", s="fp32", C="constexpr")
        metas, args = [], (out, n, s)
    tail = (16,)
    theirs, ours = [], []
    compiled = _fake_compiled(signature, metas, theirs)
    compiled.run(3, 2, 1, 77, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)
    their_fills = list(fills)
    fills.clear()
    compiled.run.launch = nvidia.wrap_handle_tensordesc(_CLaunch(ours), signature, metas)
    raw = common.raw_launcher(compiled)
    assert raw is not None
    raw((3, 2, 1), 77, args, tail)
    _same(theirs[0], ours[0])
    assert fills == their_fills and len(fills) == len(metas)
    # the planned call's launcher: descriptors of fixed shapes filled from base pointers
    fills.clear()
    monkeypatch.setattr(common, "current_stream_handle", lambda: 77)
    prefix = common.raw_prefix_launcher((compiled, tail), (3, 2), ((256, 256), (128, 128)))
    if layout != "front":  # (descriptors not the leading arguments: declined)
        assert prefix is None
        return
    prefix((x.data_ptr(), y.data_ptr()), args[2:])
    _same(theirs[0], ours[1])
    assert fills == their_fills


def test_raw_launcher_declines_what_it_does_not_know(monkeypatch):
    calls = []
    monkeypatch.setattr(triton.runtime.driver, "_active",
                        types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=lambda *a: None)))
    signature = dict(a="tensordesc<bf16[128, 64]>", C="constexpr")
    scratch = _fake_compiled(signature, [dict(swizzle=128, elem_size=2, elem_type=9, block_size=[128, 64],
                                              fp4_padded=False)], calls)
    scratch.run.global_scratch_size = 64
    assert common.raw_launcher(scratch) is None
    lowered = _fake_compiled(signature, None, calls)  # descriptors passed as pointers
    assert common.raw_launcher(lowered) is None
    assert common.raw_launcher(types.SimpleNamespace(run=lambda *a: None)) is None
    # another triton's launcher may take other arguments: Triton's own path
    plain = _fake_compiled(dict(o="*fp32", C="constexpr"), [], calls)
    assert common.raw_launcher(plain) is not None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert common.raw_launcher(plain) is None
    assert common.raw_prefix_launcher((plain, ()), (1,), ()) is None


def test_run_compiled_takes_the_raw_launcher(monkeypatch):
    calls, raws = [], []
    compiled = _fake_compiled(dict(o="*fp32", n="i32", C="constexpr"), [], calls)
    monkeypatch.setattr(common, "current_stream_handle", lambda: 5)
    monkeypatch.setattr(common, "raw_launcher", lambda c: lambda *a: raws.append(a))
    out = torch.zeros(2)
    monkeypatch.setattr(common, "RAW_LAUNCH", False)
    common.run_compiled((compiled, (3,)), (4,), (out, 9))
    assert len(calls) == 1 and not raws  # off: Triton's path
    monkeypatch.setattr(common, "RAW_LAUNCH", True)
    common.run_compiled((compiled, (3,)), (4,), (out, 9))
    common.run_compiled((compiled, (3,)), (4,), (out, 9))
    assert len(calls) == 1 and len(raws) == 2 and raws[0] == ((4, 1, 1), 5, (out, 9), (3,))
