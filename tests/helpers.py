"""Comparison of streamkl.kl against the float64 reference, forward, lse and every gradient."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import streamkl
from streamkl.reference import reference_kl

TOLERANCE = {  # SPEC section 7: (KL and lse, gradients), relative L2
    torch.float32: (1e-4, 1e-4),
    torch.float16: (1e-2, 2e-2),
    torch.bfloat16: (1e-2, 2e-2),
}


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    err = (actual - expected).norm().item()
    return err / denom if denom > 0 else err


def check_infinities(name, actual, expected):
    """Same +-inf pattern (empty rows, uncovered rows), no NaN anywhere."""
    assert not torch.isnan(actual).any(), f"{name}: NaN in output"
    assert torch.equal(torch.isposinf(actual), torch.isposinf(expected)), f"{name}: +inf pattern differs"
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"{name}: -inf pattern differs"


def make_inputs(shape_q, shape_k, heads, heads_k, dims, dtype, device, requires_grad=(True, True, True, True)):
    """Random normal q1, k1, q2, k2: shape_q/shape_k are leading dims ((B, Nq) or (T,))."""
    (h1k, h2k), (d1, d2) = heads_k, dims
    shapes = [(*shape_q, heads, d1), (*shape_k, h1k, d1), (*shape_q, heads, d2), (*shape_k, h2k, d2)]
    return [
        torch.randn(s, device=device, dtype=torch.float32).to(dtype).requires_grad_(g)
        for s, g in zip(shapes, requires_grad)
    ]


def check_against_reference(inputs, backend, check_grads=True, reduction="none", **kwargs):
    """Run streamkl.kl (reduction none, lse) and the float64 reference on the same rounded inputs;
    assert SPEC section 7 tolerances for KL, lse1, lse2 and every gradient that is required.

    With `reduction` "sum" or "mean", the gradients checked are those of that reduced loss (the
    backward of an expanded scalar), and the reduced value is checked too."""
    dtype = inputs[0].dtype
    kl_tol, grad_tol = TOLERANCE[dtype]
    out, lse1, lse2 = streamkl.kl(*inputs, reduction="none", return_lse=True, backend=backend, **kwargs)
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in inputs]
    ref, ref_lse1, ref_lse2 = reference_kl(*leaves, **kwargs)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    for name, a, e in (("kl", out, ref), ("lse1", lse1, ref_lse1), ("lse2", lse2, ref_lse2)):
        check_infinities(name, a, e)
        finite = torch.isfinite(e)
        if finite.any():
            err = rel_l2(a[finite], e[finite])
            assert err <= kl_tol, f"{name}: relative L2 error {err:.3g} > {kl_tol}"
    if reduction != "none":
        return _check_reduced(inputs, leaves, backend, reduction, ref, ref_lse1, check_grads, kwargs)
    if not check_grads or not any(t.requires_grad for t in inputs):
        return out
    finite_rows = torch.isfinite(ref)
    upstream = torch.randn(ref.shape, dtype=torch.float64, device=ref.device) * finite_rows
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    grads = torch.autograd.grad((out.nan_to_num(posinf=0.0) * upstream.float()).sum(), [inputs[i] for i in wanted])
    ref_grads = torch.autograd.grad(
        (ref.nan_to_num(posinf=0.0) * upstream).sum(), [leaves[i] for i in wanted], allow_unused=True
    )
    for i, g, rg in zip(wanted, grads, ref_grads):
        name = ("dq1", "dk1", "dq2", "dk2")[i]
        assert g.dtype == dtype, f"{name}: dtype {g.dtype}, expected {dtype}"
        assert g.shape == inputs[i].shape
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient"
        rg = torch.zeros_like(leaves[i]) if rg is None else rg
        err = rel_l2(g, rg)
        assert err <= grad_tol, f"{name}: relative L2 error {err:.3g} > {grad_tol}"
    return out


def _reference_reduction(ref, ref_lse1, reduction):
    """SPEC's reduction of the reference rows: mean over the (row, head) pairs with a non-empty
    side-1 support (finite lse1; inputs here are random, so no row is empty by value)."""
    total = ref.sum()
    if reduction == "sum":
        return total
    count = int(torch.isfinite(ref_lse1).sum())
    return total / count if count else total * 0


def _check_reduced(inputs, leaves, backend, reduction, ref, ref_lse1, check_grads, kwargs):
    dtype = inputs[0].dtype
    kl_tol, grad_tol = TOLERANCE[dtype]
    out = streamkl.kl(*inputs, reduction=reduction, backend=backend, **kwargs)
    expected = _reference_reduction(ref, ref_lse1, reduction)
    assert out.dtype == torch.float32 and out.shape == ()
    if not torch.isfinite(expected):
        assert torch.equal(torch.isposinf(out), torch.isposinf(expected)), f"{reduction}: {out} vs {expected}"
        return out
    err = rel_l2(out, expected)
    assert err <= kl_tol, f"{reduction}: relative error {err:.3g} > {kl_tol}"
    wanted = [i for i, t in enumerate(inputs) if t.requires_grad]
    if not check_grads or not wanted:
        return out
    scale = 1.0 + torch.rand(()).item()  # a non-unit upstream gradient reaches the kernels as a scalar
    grads = torch.autograd.grad(out * scale, [inputs[i] for i in wanted])
    ref_grads = torch.autograd.grad(expected * scale, [leaves[i] for i in wanted], allow_unused=True)
    for i, g, rg in zip(wanted, grads, ref_grads):
        name = ("dq1", "dk1", "dq2", "dk2")[i]
        assert g.dtype == dtype and g.shape == inputs[i].shape, name
        assert torch.isfinite(g).all(), f"{name}: non-finite gradient ({reduction})"
        rg = torch.zeros_like(leaves[i]) if rg is None else rg
        err = rel_l2(g, rg)
        assert err <= grad_tol, f"{name} of the {reduction}: relative L2 error {err:.3g} > {grad_tol}"
    return out


def front_end_cases(device):
    """(inputs, kwargs) covering the front end's paths on small float32 problems: dense causal; a
    window with a sum and a scale; block masks with per-row output; packed sequences (an empty one)
    with and without max_seqlen."""
    from streamkl.varlen import cu_seqlens_from_lengths

    dense = make_inputs((2, 40), (2, 56), 4, (2, 1), (16, 8), torch.float32, device)
    varlen = make_inputs((70,), (70,), 2, (1, 2), (16, 16), torch.float32, device)
    cu = cu_seqlens_from_lengths([30, 0, 33], device)
    mask = streamkl.BlockMask.from_dense(torch.rand(1, 1, 3, 4, device=device) < 0.6, 16)
    return [
        (dense, dict(causal=True)),
        (dense, dict(window=(7, 3), reduction="sum", scale2=0.3)),
        (dense, dict(mask2=mask, mask1=mask, reduction="none")),
        (varlen, dict(cu_seqlens=cu, max_seqlen=33, max_seqlen_k=33, causal=True)),
        (varlen, dict(cu_seqlens=cu)),
    ]


def compile_in_subprocess(code: str, timeout: int) -> str:
    """stdout of `code` run by a fresh Python without TRITON_INTERPRET (the interpreter cannot
    compile for sm_90a), importing the streamkl package the tests imported (not necessarily the
    one beside them); fails the test on a nonzero exit."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(streamkl.__file__)))
    env = {name: value for name, value in os.environ.items() if name != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([root, env.get("PYTHONPATH", "")])
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout


def indexer_backend_params() -> list:
    """A pytest param per backend for `indexer_kl`, skipped with the backend's reasons where its
    indexer cannot run here."""
    from streamkl import indexer
    from streamkl.dispatch import PRIORITY

    params = []
    for name in PRIORITY:
        reasons = indexer.backend_reasons(name)
        marks = [pytest.mark.skip(reason=f"indexer on {name}: {'; '.join(reasons)}")] if reasons else []
        params.append(pytest.param(name, marks=marks, id=name))
    return params
