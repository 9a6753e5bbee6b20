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
