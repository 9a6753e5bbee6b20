"""Dense features of the SPEC against the float64 reference, on every backend."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from conftest import DEVICE
from helpers import check_against_reference, make_inputs, rel_l2

import streamkl
from streamkl.reference import reference_kl


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

    @property
    def id(self) -> str:
        parts = [
            f"B{self.batch}-Nq{self.seqlen_q}-Nk{self.seqlen_k}-H{self.heads}-Hk{self.heads_k[0]}x{self.heads_k[1]}",
            f"D{self.dims[0]}x{self.dims[1]}",
        ]
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"win{self.window[0]}_{self.window[1]}")
        return "-".join(parts)

    def inputs(self, dtype, requires_grad=(True, True, True, True)):
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

    @property
    def kwargs(self):
        return dict(causal=self.causal, window=self.window)


CASES = [
    # Nq != Nk, GQA on side 1, D1 != D2; one batch: the largest case, which CI runs on every backend's
    # CPU emulator (the third and sixth cases have two)
    Case(1, 100, 300, 4, (2, 4), (64, 32)),
    Case(1, 77, 77, 2, (1, 2), (32, 32), causal=True),  # MQA teacher
    Case(2, 130, 50, 3, (3, 1), (16, 48), causal=True),  # Nq > Nk: the first rows see nothing
    Case(1, 90, 200, 2, (2, 2), (32, 16), window=(20, 7)),
    Case(1, 120, 120, 4, (1, 2), (80, 24), causal=True, window=(33, -1)),  # sliding window, D not pow2
    Case(2, 64, 64, 2, (2, 2), (32, 32), window=(0, 0)),  # diagonal only: every row has one key
    Case(1, 45, 170, 2, (2, 1), (96, 40), window=(-1, 30)),  # right-only window
]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "fp16", "bf16"])
def test_against_reference(case, dtype, backend):
    check_against_reference(case.inputs(dtype), backend, **case.kwargs)


@pytest.mark.parametrize("scales", [(0.5, 2.0), (None, 0.05)], ids=["s0.5x2", "default-x0.05"])
def test_scales_and_temperature(scales, backend):
    case = CASES[1]
    check_against_reference(case.inputs(torch.float32), backend, scale1=scales[0], scale2=scales[1], **case.kwargs)


@pytest.mark.parametrize(
    "requires_grad", [(False, False, True, True), (True, False, False, False), (False, True, False, True)],
    ids=["student-only", "q1-only", "keys-only"],
)
def test_partial_gradients(requires_grad, backend):
    case = CASES[0]
    inputs = case.inputs(torch.float32, requires_grad)
    check_against_reference(inputs, backend, **case.kwargs)


def test_detached_teacher_costs_no_teacher_matmul(monkeypatch):
    """The torch backend's backward must not form side-1 gradient products for a detached teacher."""
    from streamkl.backends import torch_chunked

    calls = []
    real_matmul = torch.matmul

    def counting_matmul(a, b):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return real_matmul(a, b)

    case = Case(1, 64, 64, 2, (2, 2), (48, 16))
    q1, k1, q2, k2 = case.inputs(torch.float32, (False, False, True, True))
    loss = streamkl.kl(q1, k1, q2, k2, backend="torch")
    monkeypatch.setattr(torch_chunked.torch, "matmul", counting_matmul)
    loss.backward()
    # per chunk: two score recomputations, plus dq2 and dk2; no product yields a side-1 (D=48) gradient
    assert calls, "backward did not run"
    grad_products = [c for c in calls if c[1][-1] == 48 and c[0][-1] != 48]
    assert not grad_products, f"side-1 gradient products were computed: {grad_products}"


@pytest.mark.parametrize("reduction", ["none", "sum", "mean"])
def test_reductions(reduction, backend):
    case = CASES[2]  # has empty rows: mean divides by the non-empty ones only
    inputs = case.inputs(torch.float32)
    out = streamkl.kl(*inputs, reduction=reduction, backend=backend, **case.kwargs)
    leaves = [t.detach().double() for t in inputs]
    rows, lse1, _ = reference_kl(*leaves, **case.kwargs)
    if reduction == "none":
        expected = rows
    elif reduction == "sum":
        expected = rows.sum()
    else:
        expected = rows.sum() / torch.isfinite(lse1).sum()
    assert out.dtype == torch.float32
    assert out.shape == expected.shape
    assert rel_l2(out, expected) <= 1e-5
    out.sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)


@pytest.mark.parametrize("reduction", ["sum", "mean"])
@pytest.mark.parametrize("needs", ["student", "both"])
def test_reduced_loss_gradients_against_reference(reduction, needs, backend):
    """The gradient of a reduced loss (an expanded scalar upstream) against the reference's, on
    rows some of which see nothing (mean divides by the others)."""
    grads = (False, False, True, True) if needs == "student" else (True, True, True, True)
    inputs = make_inputs((1, 70), (1, 40), 2, (2, 1), (16, 32), torch.float32, DEVICE, grads)
    check_against_reference(inputs, backend, causal=True, reduction=reduction)


def test_mean_counts_rows_of_each_structure(backend):
    """The mean divides by the rows with a non-empty side-1 support, counted from the structure
    (lengths, causality, window) without a device op, or from lse1 under a side-1 block mask:
    alternating structures on the same inputs each divide by their own count (empty rows from
    Nq > Nk causal, windows on either side, block masks, varlen with an empty key sequence, the
    same cu_seqlens changed in place)."""
    from streamkl.sparse.block_mask import BlockMask

    inputs = make_inputs((1, 40), (1, 24), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    pattern = torch.ones(1, 2, 3, 2, dtype=torch.bool, device=DEVICE)
    pattern[0, 1, 0] = False  # head 1's first 16 rows see no key on side 1
    mask = BlockMask.from_dense(pattern, 16)
    pattern[0, 0, 1] = False
    other = BlockMask.from_dense(pattern, 16)  # head 0 loses rows 16-31 too

    def check(x, **kwargs):
        rows, lse1, _ = reference_kl(*(t.double() for t in x), **kwargs)
        expected = rows.sum() / max(int(torch.isfinite(lse1).sum()), 1)
        assert rel_l2(streamkl.kl(*x, backend=backend, **kwargs), expected) <= 1e-5, kwargs

    structures = (dict(causal=True), dict(), dict(window=(3, 0)), dict(window=(0, 2)), dict(window=(2, -1)),
                  dict(window=(-1, 0)), dict(causal=True, window=(4, 9)), dict(mask1=mask), dict(mask1=other),
                  dict(causal=True, mask1=mask, mask2=mask))
    for kwargs in structures:
        check(inputs, **kwargs)
    short_q = [t[:, :10] if i % 2 == 0 else t for i, t in enumerate(inputs)]  # Nq < Nk
    for kwargs in (dict(causal=True), dict(window=(0, 0)), dict(window=(1, -1))):
        check(short_q, **kwargs)
    packed = [t[0].detach() for t in inputs]  # (T, H, D)
    cu_q = torch.tensor([0, 30, 40], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 4, 24], dtype=torch.int32, device=DEVICE)
    for _ in range(2):
        for kwargs in (dict(causal=True), dict(window=(2, 1))):
            check(packed, cu_seqlens=cu_q, cu_seqlens_k=cu_k, **kwargs)
        cu_k[1] = 0  # in place: sequence 0 loses its keys, all its rows become empty


def test_nearly_identical_distributions(backend):
    """q2 = q1 + 1e-3 noise, same keys: per-row KL ~1e-7, absolute error <= 1e-5."""
    batch, n, heads, dim = 2, 150, 3, 32
    q1 = torch.randn(batch, n, heads, dim, device=DEVICE)
    k1 = torch.randn(batch, n, heads, dim, device=DEVICE)
    q2 = q1 + 1e-3 * torch.randn_like(q1)
    k2 = k1.clone()
    for causal in (False, True):
        out = streamkl.kl(q1, k1, q2, k2, reduction="none", causal=causal, backend=backend)
        ref, _, _ = reference_kl(q1.double(), k1.double(), q2.double(), k2.double(), causal=causal)
        assert (out.double() - ref).abs().max().item() <= 1e-5
        assert ref.max().item() < 1e-3  # the case is the intended one


def test_fully_masked_rows_are_exactly_zero(backend):
    """Nq > Nk causal: rows i < Nq - Nk see no key. KL 0 exactly, lse -inf, zero gradients."""
    case = Case(2, 96, 40, 2, (1, 2), (32, 16), causal=True)
    inputs = case.inputs(torch.float32)
    out, lse1, lse2 = streamkl.kl(*inputs, reduction="none", return_lse=True, backend=backend, causal=True)
    empty = case.seqlen_q - case.seqlen_k
    assert torch.equal(out[:, :empty], torch.zeros_like(out[:, :empty]))
    assert torch.isneginf(lse1[:, :, :empty]).all() and torch.isneginf(lse2[:, :, :empty]).all()
    assert torch.isfinite(out[:, empty:]).all()
    out.sum().backward()
    q1, _, q2, _ = inputs
    assert torch.equal(q1.grad[:, :empty], torch.zeros_like(q1.grad[:, :empty]))
    assert torch.equal(q2.grad[:, :empty], torch.zeros_like(q2.grad[:, :empty]))
    assert all(torch.isfinite(t.grad).all() for t in inputs)


def test_empty_rows_ignore_their_upstream_gradient(backend):
    """A row whose side-1 support is empty has KL 0 whatever the inputs: its upstream gradient, NaN
    or inf included, reaches no input gradient (the Triton kernels drop it as they load the row,
    the other backends' front end masks it first). Both backward paths, float32 and float16 (whose
    upstream gradient is rescaled by its peak: taken over the non-empty rows only)."""
    case = Case(2, 96, 40, 2, (1, 2), (32, 16), causal=True)
    empty = case.seqlen_q - case.seqlen_k
    for dtype in (torch.float32, torch.float16):
        for grads in ((True, True, True, True), (False, False, True, True)):
            inputs = case.inputs(dtype, grads)
            wanted = [t for t in inputs if t.requires_grad]
            out = streamkl.kl(*inputs, reduction="none", backend=backend, causal=True)
            upstream = torch.rand_like(out) + 0.5
            clean = torch.autograd.grad(out, wanted, upstream, retain_graph=True)
            upstream[:, :empty, 0] = float("nan")
            upstream[:, : empty // 2, 1] = float("inf")
            upstream[:, empty // 2 : empty, 1] = 1e30
            dirty = torch.autograd.grad(out, wanted, upstream)
            for a, b in zip(clean, dirty):
                assert torch.isfinite(a).all() and torch.equal(a, b)


def test_strided_inputs_need_no_copy(backend):
    """(B, H, N, D) tensors transposed to (B, N, H, D) are valid inputs and give the same result."""
    batch, n, heads, dim = 1, 70, 4, 32
    base = [torch.randn(batch, heads, n, dim, device=DEVICE) for _ in range(4)]
    strided = [t.transpose(1, 2).requires_grad_() for t in (b.clone() for b in base)]
    contiguous = [t.detach().transpose(1, 2).contiguous().requires_grad_() for t in base]
    a = streamkl.kl(*strided, reduction="none", causal=True, backend=backend)
    b = streamkl.kl(*contiguous, reduction="none", causal=True, backend=backend)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)
    a.sum().backward()
    b.sum().backward()
    for s, c in zip(strided, contiguous):
        assert torch.allclose(s.grad, c.grad, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("case", [CASES[0], CASES[2], CASES[4]], ids=[CASES[i].id for i in (0, 2, 4)])
def test_deterministic_against_reference(case, backend):
    """`deterministic=True` takes other kernels on some backends (no atomics): same accuracy."""
    check_against_reference(case.inputs(torch.float32), backend, deterministic=True, **case.kwargs)
    check_against_reference(case.inputs(torch.bfloat16), backend, deterministic=True, **case.kwargs)


def test_deterministic_gradients_are_bitwise_identical(backend):
    case = CASES[4]
    inputs = case.inputs(torch.float32)
    grads = []
    for _ in range(2):
        for t in inputs:
            t.grad = None
        streamkl.kl(*inputs, deterministic=True, backend=backend, **case.kwargs).backward()
        grads.append([t.grad.clone() for t in inputs])
    for a, b in zip(*grads):
        assert torch.equal(a, b)


def test_nan_inputs_propagate(backend):
    case = CASES[0]
    q1, k1, q2, k2 = case.inputs(torch.float32, (False,) * 4)
    q1 = q1.clone()
    q1[0, 3, 1, 0] = float("nan")
    out = streamkl.kl(q1, k1, q2, k2, reduction="none", backend=backend)
    assert torch.isnan(out[0, 3, 1])
    others = torch.ones_like(out, dtype=torch.bool)
    others[0, 3, 1] = False
    assert torch.isfinite(out[others]).all()  # the NaN stays in its (row, head)


def test_rows_of_all_minus_inf_scores_read_nan(backend):
    """A row whose allowed scores are all -inf by value (an infinite input: softmax undefined) reads
    NaN, on either side, as in PyTorch and the float64 reference; not KL 0 (an empty row) nor +inf
    (an uncovered one), which stay decided by the structure. Partial tiles only (causal, short)
    and with full tiles (non-causal, longer: the interpreter's tiles are 64 rows)."""
    for n, causal in ((40, True), (300, False)):
        q1, k1, q2, k2 = (torch.randn(1, n, 2, 16, device=DEVICE) for _ in range(4))
        k1[..., 0] = k1[..., 0].abs() + 0.1  # every key's first coordinate positive
        k2[..., 0] = k2[..., 0].abs() + 0.1
        q1[0, 5, 1, 0] = float("-inf")  # row 5, head 1: every side-1 score -inf
        q2[0, 7, 0, 0] = float("-inf")  # row 7, head 0: every side-2 score -inf
        out = streamkl.kl(q1, k1, q2, k2, reduction="none", causal=causal, backend=backend)
        ref, _, _ = reference_kl(q1.double(), k1.double(), q2.double(), k2.double(), causal=causal)
        bad = torch.zeros_like(out, dtype=torch.bool)
        bad[0, 5, 1] = bad[0, 7, 0] = True
        assert torch.isnan(ref[bad]).all() and torch.isnan(out[bad]).all(), (n, out[bad])
        assert torch.isfinite(out[~bad]).all()


def test_backend_from_environment(monkeypatch):
    case = CASES[1]
    inputs = case.inputs(torch.float32, (False,) * 4)
    monkeypatch.setenv("STREAMKL_BACKEND", "torch")
    out = streamkl.kl(*inputs, **case.kwargs)
    monkeypatch.setenv("STREAMKL_BACKEND", "no-such-backend")
    with pytest.raises(ValueError, match="STREAMKL_BACKEND"):
        streamkl.kl(*inputs, **case.kwargs)
    monkeypatch.delenv("STREAMKL_BACKEND")
    assert torch.equal(streamkl.kl(*inputs, backend="torch", **case.kwargs), out)


def test_available_backends_and_info():
    import subprocess
    import sys

    assert "torch" in streamkl.available_backends()
    report = subprocess.run([sys.executable, "-m", "streamkl", "info"], capture_output=True, text=True, check=True)
    for name in ("triton", "cupy", "torch"):
        assert name in report.stdout
    assert "Gluon kernels" in report.stdout  # and why they cannot run here, or how they are chosen


def test_torch_compile_fullgraph_matches_eager():
    """The custom ops compile without graph breaks and match eager, forward and backward."""
    case = Case(1, 40, 56, 2, (1, 2), (16, 8), causal=True)
    inputs = case.inputs(torch.float32)

    def loss_fn(q1, k1, q2, k2):
        return streamkl.kl(q1, k1, q2, k2, causal=True, backend="torch") * 3.0

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(*inputs)
    out.backward()
    compiled_grads = [t.grad.clone() for t in inputs]
    for t in inputs:
        t.grad = None
    eager = loss_fn(*inputs)
    eager.backward()
    assert torch.allclose(out, eager)
    for a, t in zip(compiled_grads, inputs):
        assert torch.allclose(a, t.grad)


def test_custom_ops_pass_opcheck():
    """torch.library's own checks of the registered ops: schema and fake tensors (their autograd is
    `autograd._KL`, checked against the reference by every gradient test)."""
    case = Case(1, 24, 40, 2, (1, 2), (16, 8), causal=True)
    inputs = [t.detach() for t in case.inputs(torch.float32)]
    from streamkl.dispatch import PRIORITY

    ints = [1, -1, -1, 24, 40, 0, 0, 0, 0, 0, -1, PRIORITY.index("torch")]
    torch.library.opcheck(
        torch.ops.streamkl.kl_forward.default, (*inputs, None, None, None, None, ints, [0.25, 0.35]),
        test_utils=("test_schema", "test_faketensor"),
    )


class _OpLog(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the ops that reach the dispatcher."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("stack_query", ["torch", "missing"])
def test_dispatch_modes_see_the_ops(monkeypatch, stack_query):
    """Under a dispatch mode (make_fx, FlopCounterMode, ...) the forward and the backward run as
    streamkl's ops, so the mode sees them; plain eager calls run the same implementations
    directly. Without torch's private stack query every call takes the ops. Results agree."""
    from streamkl import _compat

    if stack_query == "missing":
        monkeypatch.setattr(_compat, "_stack_length", None)
    inputs = make_inputs((1, 33), (1, 33), 2, (2, 1), (16, 8), torch.float32, "cpu", (False, False, True, True))
    plain = streamkl.kl(*inputs, causal=True, backend="torch")
    plain.backward()
    expected = [t.grad.clone() for t in inputs[2:]]
    for t in inputs:
        t.grad = None
    with _OpLog() as log:
        loss = streamkl.kl(*inputs, causal=True, backend="torch")
        loss.backward()
    assert "streamkl.kl_forward.default" in log.ops and "streamkl.kl_backward.default" in log.ops
    assert torch.equal(loss, plain)
    assert all(torch.equal(t.grad, e) for t, e in zip(inputs[2:], expected))


@pytest.mark.parametrize("reduction", ["sum", "mean"])
def test_reduced_loss_is_one_graph_node(reduction):
    """The reduction happens inside the autograd node: a reduced loss's graph is the KL node and
    the inputs' accumulators, nothing per reduction op."""
    inputs = make_inputs((1, 20), (1, 20), 2, (1, 1), (8, 8), torch.float32, "cpu", (False, False, True, True))
    loss = streamkl.kl(*inputs, reduction=reduction, backend="torch")
    assert type(loss.grad_fn).__name__ == "_KLBackward"
    assert {type(f).__name__ for f, _ in loss.grad_fn.next_functions if f is not None} == {"AccumulateGrad"}


def test_float32_stays_full_precision_under_tf32_setting(backend):
    """A global "allow TF32" setting must not lower float32 products (SPEC 2: no TF32)."""
    previous = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("medium")
    try:
        case = CASES[0]
        check_against_reference(case.inputs(torch.float32), backend, **case.kwargs)
        assert torch.get_float32_matmul_precision() == "medium", "the caller's setting was not restored"
    finally:
        torch.set_float32_matmul_precision(previous)


def test_detached_teacher_saves_no_expectation(backend):
    """With a detached teacher the forward keeps only lse1 and lse2 for the backward (E is not
    needed for the student's gradients); with teacher gradients it keeps E too. Gradients match the
    reference either way (the shared tests cover every subset)."""
    student = make_inputs((1, 40), (1, 50), 2, (1, 2), (16, 16), torch.float32, DEVICE, (False, False, True, True))
    out, lse1, _ = streamkl.kl(*student, reduction="none", return_lse=True, backend=backend, causal=True)
    saved = out.grad_fn.saved_tensors
    assert saved[6].data_ptr() == saved[4].data_ptr()  # lse1 in E's place
    check_against_reference(student, backend, causal=True)
    both = make_inputs((1, 40), (1, 50), 2, (1, 2), (16, 16), torch.float32, DEVICE, (True, False, True, False))
    out, _, _ = streamkl.kl(*both, reduction="none", return_lse=True, backend=backend, causal=True)
    saved = out.grad_fn.saved_tensors
    assert saved[6].data_ptr() != saved[4].data_ptr()
    check_against_reference(both, backend, causal=True)
