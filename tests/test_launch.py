"""The Triton launcher (streamkl/backends/triton/launch.py): a compiled kernel is reused only for
arguments Triton would specialize alike, so no launch ever runs a kernel compiled for other ones."""

from __future__ import annotations

import pytest
import torch
from helpers import make_inputs, rel_l2

import streamkl
from streamkl.backends.triton.launch import Launcher, specialization
from streamkl.reference import reference_kl

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


def test_specialization_tells_apart_what_triton_specializes_on():
    base = torch.zeros(64)
    aligned, unaligned = base[:32], base[1:33]  # 16-byte aligned and not
    assert specialization((aligned,)) != specialization((unaligned,))
    assert specialization((aligned,)) != specialization((aligned.half(),))  # dtype
    assert specialization((1,)) != specialization((2,))  # == 1 becomes a constant
    assert specialization((32,)) != specialization((33,))  # divisible by 16
    assert specialization((17,)) == specialization((33,))  # neither: one compiled kernel serves both
    assert specialization((2**31 + 1,)) != specialization((17,))  # 64-bit
    assert specialization((True,)) != specialization((1,))
    assert specialization((None,)) == specialization((None,))
    assert specialization((0.5,)) == specialization((2.0,))

    class Sub(torch.Tensor):
        pass

    sub = aligned.as_subclass(Sub)  # keyed by dtype and alignment, not by the object (nothing kept alive)
    assert specialization((sub,)) == specialization((aligned,))


def test_specialization_of_descriptors():
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = torch.zeros(64, 32, dtype=torch.float16)
    a = TensorDescriptor(t, [64, 32], [32, 1], [16, 32])
    b = TensorDescriptor(t, [64, 32], [32, 1], [32, 32])  # another box
    c = TensorDescriptor(t[:48], [48, 32], [32, 1], [16, 32])  # another shape
    assert specialization((a,)) != specialization((b,))
    assert specialization((a,)) != specialization((c,))
    assert specialization((a,)) == specialization((TensorDescriptor(t.clone(), [64, 32], [32, 1], [16, 32]),))


@triton.jit
def _axpy(X, Y, n, alpha, BLOCK: tl.constexpr):
    o = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    m = o < n
    tl.store(Y + o, tl.load(X + o, mask=m) * alpha, mask=m)


def test_launcher_places_constexprs_and_runs():
    if not torch.cuda.is_available():
        import os

        if os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs a GPU or the interpreter")
    device = "cuda" if torch.cuda.is_available() else "cpu"
    run = Launcher(_axpy, dict(BLOCK=64), num_warps=4)
    with pytest.raises(TypeError, match="NOPE"):
        Launcher(_axpy, dict(NOPE=1), num_warps=4)
    for n in (100, 1, 64, 37):  # 1 and 64 are other specializations than 100 and 37
        x = torch.randn(n, device=device)
        y = torch.empty(n, device=device)
        run((triton.cdiv(n, 64),), x, y, n, 3.0)
        torch.testing.assert_close(y, 3.0 * x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_alternating_alignment_and_lengths_on_the_gpu():
    """The same problem shape from aligned and misaligned storage, alternately: every call agrees
    with the reference (a kernel compiled for aligned pointers must not serve misaligned ones)."""
    q1, k1, q2, k2 = make_inputs((1, 200), (1, 200), 2, (2, 2), (64, 64), torch.bfloat16, "cuda",
                                 requires_grad=(False,) * 4)
    ref = reference_kl(q1, k1, q2, k2, causal=True)[0].float()
    for _ in range(2):
        for shift in (0, 1):
            moved = []
            for t in (q1, k1, q2, k2):
                storage = torch.empty(t.numel() + shift, device="cuda", dtype=t.dtype)
                view = storage[shift:].view(t.shape)
                view.copy_(t)
                moved.append(view)
            out = streamkl.kl(*moved, causal=True, reduction="none", backend="triton")
            assert rel_l2(out, ref) < 1e-2, shift


def test_checked_descriptor_is_the_descriptor_triton_expects():
    """`flat_descriptor` skips the base class's re-validation; Triton specializes and reads it as
    the TensorDescriptor it is (same signature, same fields)."""
    gluon_common = pytest.importorskip("streamkl.backends.triton.gluon.common")
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    t = torch.zeros(3, 64, 4, 128, dtype=torch.bfloat16)
    fast = gluon_common.flat_descriptor(t, 64)
    checked = TensorDescriptor(t, [192, 512], [512, 1], [64, 128], gluon_common.shared_layout(64, 128, t.dtype))
    assert isinstance(fast, TensorDescriptor)
    assert (fast.base, fast.shape, fast.strides, fast.block_shape, fast.layout, fast.padding) == (
        checked.base, checked.shape, checked.strides, checked.block_shape, checked.layout, checked.padding)
    assert native_specialize_impl(CUDABackend, fast, False, True, True) == native_specialize_impl(
        CUDABackend, checked, False, True, True)
    assert specialization((fast,)) == specialization((checked,))


def _device_or_skip() -> str:
    if torch.cuda.is_available():
        return "cuda"
    import os

    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs a GPU or the interpreter")
    return "cpu"


def test_planned_launches_reuse_the_first_compiled_kernel():
    """`Bound.planned` (a plan that fixes every argument's specialization) compiles on its first
    launch and reuses that kernel for new tensors of the same kind; results stay right."""
    device = _device_or_skip()
    bound = Launcher(_axpy, dict(BLOCK=64), num_warps=4).bind((100, 3.0))
    for _ in range(3):
        x = torch.randn(100, device=device)
        y = torch.empty(100, device=device)
        bound.planned((2,), x, y)
        torch.testing.assert_close(y, 3.0 * x)
    if device == "cuda":
        assert bound._planned is not None and bound._planned[0] == torch.cuda.current_device()
        if triton.__version__.startswith("3.6."):  # the kept kernel launches directly (`_compat.direct_launch`)
            from streamkl.backends.triton._compat import direct_launch

            run = bound._planned[1]
            assert direct_launch(run.compiled) is not None and run.__qualname__.startswith("direct_launch")


@pytest.mark.parametrize("two,scaled,scale_ptr", [(False, True, True), (False, True, False), (True, False, False)])
def test_gluon_backward_flush_plan(two, scaled, scale_ptr):
    """The Gluon backward's dq flush, as its plan binds it: a head chunk's float32 accumulators into
    their heads' columns of the 16-bit gradients, the student's scaled by the softmax scale and g."""
    device = _device_or_skip()
    gluon_backward = pytest.importorskip("streamkl.backends.triton.gluon.backward")
    from streamkl.backends.triton.common import LN2, log2_scales
    from streamkl.problem import build_problem

    problem = build_problem(*(torch.randn(2, 40, 4, 16, device=device) for _ in range(4)))
    grid, run = gluon_backward.flush_plan(problem, 2, 2, two, scaled, scale_ptr)
    a1, a2 = (torch.randn(2, 40, 2, 16, device=device) for _ in range(2))
    o1, o2 = (torch.zeros(2, 40, 4, 16, dtype=torch.bfloat16, device=device) for _ in range(2))
    factor_t = torch.tensor(3.0, device=device)
    run.planned(grid, a1, a2 if two else a1, o1, o2 if two else o1, factor_t)
    factor = (log2_scales(problem)[1] * LN2 if scaled else 1.0) * (3.0 if scale_ptr else 1.0)
    torch.testing.assert_close(o1[..., 2:, :].float(), a1 * factor, rtol=1e-2, atol=1e-2)
    assert (o1[..., :2, :] == 0).all()
    if two:
        torch.testing.assert_close(o2[..., 2:, :].float(), a2, rtol=1e-2, atol=1e-2)



class _CLaunch:
    """Stands for a launcher's C function (a builtin: no closure), recording its arguments."""

    def __init__(self, calls):
        self.calls = calls

    def __call__(self, *args):
        self.calls.append(args)


class _Compiled:
    """A compiled kernel as triton 3.6 makes one, with a recording C function; `compiled[grid]`
    (Triton's runner) records in `runs`."""

    def __init__(self, signature, metas, calls):
        from triton.backends.nvidia import driver as nvidia

        run = object.__new__(nvidia.CudaLauncher)
        run.launch = nvidia.wrap_handle_tensordesc(_CLaunch(calls), signature, metas)
        run.num_ctas = 1
        run.global_scratch_size = run.profile_scratch_size = 0
        run.global_scratch_align = run.profile_scratch_align = 1
        run.launch_cooperative_grid, run.launch_pdl = False, True
        self.run, self.function, self.packed_metadata, self.runs = run, 1234, ("packed",), []

    def __getitem__(self, grid):
        return lambda *args: self.runs.append((grid, args))


def _fake_driver(monkeypatch, fills):
    import types

    def fill(*args):
        fills.append(args)
        return ("tensormap", len(fills))

    driver = types.SimpleNamespace(utils=types.SimpleNamespace(fill_tma_descriptor=fill),
                                   get_current_device=lambda: 0, get_current_stream=lambda device: 77)
    monkeypatch.setattr(triton.runtime.driver, "_active", driver)


_ON_36 = pytest.mark.skipif(not triton.__version__.startswith("3.6."), reason="direct_launch serves triton 3.6 only")
_META = dict(swizzle=128, elem_size=2, elem_type=9, block_size=[128, 64], fp4_padded=False)


@_ON_36
@pytest.mark.parametrize("layout", ["front", "between", "none"])
def test_direct_launch_passes_what_triton_passes(layout, monkeypatch):
    """`_compat.direct_launch` hands the launcher's C function what Triton's own wrapper
    (`CudaLauncher.__call__`, `wrap_handle_tensordesc`) hands it, descriptors filled alike."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    from streamkl.backends.triton._compat import direct_launch

    fills = []
    _fake_driver(monkeypatch, fills)
    x = torch.zeros(256, 4, 64, dtype=torch.bfloat16)
    y = torch.zeros(128, 2, 64, dtype=torch.float32)
    d0 = TensorDescriptor(x, [256, 256], [256, 1], [128, 64])
    d1 = TensorDescriptor(y, [128, 128], [128, 1], [64, 64], padding="nan")
    meta2 = dict(_META, elem_size=4, elem_type=8, block_size=[64, 64])
    out, n, s = torch.zeros(4), 7, 0.5
    if layout == "front":
        signature = dict(a="tensordesc<bf16[128, 64]>", b="tensordesc<fp32[64, 64]>", o="*fp32", n="i32", s="fp32",
                         C="constexpr")
        metas, args = [_META, meta2], (d0, d1, out, n, s, 16)
    elif layout == "between":
        signature = dict(o="*fp32", a="tensordesc<bf16[128, 64]>", n="i32", b="tensordesc<fp32[64, 64]>", s="fp32",
                         C="constexpr")
        metas, args = [_META, dict(meta2, elem_type=10)], (out, d0, n, d1, s, 16)
    else:
        signature = dict(o="*fp32", n="i32", s="fp32", C="constexpr")
        metas, args = [], (out, n, s, 16)
    theirs, ours = [], []
    compiled = _Compiled(signature, metas, theirs)
    compiled.run(3, 2, 1, 77, compiled.function, compiled.packed_metadata, None, None, None, *args)
    their_fills = list(fills)
    fills.clear()
    launch = direct_launch(_Compiled(signature, metas, ours))
    assert launch is not None
    launch((3, 2, 1), args)
    assert len(theirs) == len(ours) == 1 and len(theirs[0]) == len(ours[0])
    for a, b in zip(theirs[0], ours[0], strict=True):
        assert a is b or (not isinstance(a, torch.Tensor) and a == b), (a, b)
    assert fills == their_fills and len(fills) == len(metas)


def test_direct_launch_declines_what_it_does_not_know(monkeypatch):
    """Another triton, scratch memory, descriptors lowered to pointers, another launcher: None, and
    the kept kernel launches through Triton's own runner."""
    import types

    pytest.importorskip("triton.backends.nvidia.driver")
    from streamkl.backends.triton import _compat, launch

    _fake_driver(monkeypatch, [])
    signature = dict(a="tensordesc<bf16[128, 64]>", C="constexpr")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    assert _compat.direct_launch(_Compiled(signature, [_META], [])) is not None
    scratch = _Compiled(signature, [_META], [])
    scratch.run.global_scratch_size = 64
    assert _compat.direct_launch(scratch) is None
    assert _compat.direct_launch(_Compiled(signature, None, [])) is None  # descriptors lowered
    assert _compat.direct_launch(types.SimpleNamespace(run=lambda *a: None)) is None
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    plain = _Compiled(dict(o="*fp32", C="constexpr"), [], [])
    assert _compat.direct_launch(plain) is None
    run = launch._runner(plain)
    run((4, 1, 1), (1, 2))
    assert plain.runs == [((4, 1, 1), (1, 2))] and run.compiled is plain


@_ON_36
def test_direct_launch_leaves_hooked_launches_to_triton(monkeypatch):
    """With a launch hook set (a profiler's), Triton's own path, which calls it."""
    from triton import knobs

    from streamkl.backends.triton._compat import direct_launch

    _fake_driver(monkeypatch, [])
    calls = []
    compiled = _Compiled(dict(o="*fp32", C="constexpr"), [], calls)
    launch = direct_launch(compiled)
    launch((1, 1, 1), (torch.zeros(1), 4))
    assert len(calls) == 1 and not compiled.runs
    hook = lambda metadata: None  # noqa: E731
    knobs.runtime.launch_enter_hook.add(hook)
    try:
        launch((1, 1, 1), (torch.zeros(1), 4))
    finally:
        knobs.runtime.launch_enter_hook.remove(hook)
    assert len(calls) == 1 and len(compiled.runs) == 1
