"""The CuPy backend's DSA indexer loss (SPEC 8): indexer.cu compiles with nvcc, its argument record
matches the C struct, and forward and the three gradients match a float64 reference, dense and
top-k stages, causal or not, packed sequences with empty ones, GQA, given or computed teacher lse.

Without a GPU the kernels run on the CPU emulator (STREAMKL_CUPY_EMULATE=1, set by conftest) at
tiny shapes; the tests marked gpu run larger shapes on a CUDA device.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass

import pytest
import torch
from conftest import DEVICE

from streamkl.backends.cupy import CupyBackend, emulate
from streamkl.backends.cupy import indexer as cupy_indexer
from streamkl.backends.cupy.source import inline_includes
from streamkl.indexer import IndexerProblem

_REASONS = CupyBackend().environment_reasons()
ON_GPU = not _REASONS and DEVICE == "cuda" and not emulate.emulating()
EMULATED = not _REASONS and DEVICE == "cpu" and emulate.emulating()
needs_backend = pytest.mark.skipif(not (ON_GPU or EMULATED), reason="; ".join(_REASONS) or "no CUDA GPU")
gpu_only = pytest.mark.skipif(not ON_GPU, reason="needs CuPy and a CUDA GPU (too slow on the CPU emulator)")
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 2e-2), torch.bfloat16: (1e-2, 2e-2)}  # SPEC 7


# ------------------------------------------------------------------------ the float64 oracle
def indexer_kl_reference(q, k, qi, ki, w, scale=None, causal=True, topk_indices=None):
    """Dense layout only (B, N, ...): float64 per-row loss (B, Nq). Materializes everything."""
    q, k, qi, ki, w = (t.double() for t in (q, k, qi, ki, w))
    B, Nq, H, D = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    scale = D**-0.5 if scale is None else scale
    kk = k.repeat_interleave(H // Hk, dim=2)
    s = torch.einsum("bihd,bjhd->bhij", q, kk) * scale
    allowed = torch.ones(B, Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        i = torch.arange(Nq, device=q.device)[:, None]
        j = torch.arange(Nk, device=q.device)[None, :]
        allowed &= j <= i + Nk - Nq
    if topk_indices is not None:
        sel = torch.zeros(B, Nq, Nk + 1, dtype=torch.bool, device=q.device)
        idx = topk_indices.long().clone()
        idx[idx < 0] = Nk  # -1 -> a spare column
        sel.scatter_(2, idx, True)
        allowed &= sel[..., :Nk]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    empty = ~allowed.any(-1)  # (B, Nq)
    p = torch.softmax(s, -1).nan_to_num(0.0)  # empty rows -> 0
    t = p.mean(1)  # (B, Nq, Nk)
    z = (w[..., None] * torch.einsum("bitd,bjd->bitj", qi, ki).relu()).sum(2)
    log_s = torch.log_softmax(z.masked_fill(~allowed, float("-inf")), -1)
    loss = torch.where(t > 0, t * (torch.log(t) - log_s), 0.0).sum(-1)
    return loss.masked_fill(empty, 0.0)


def head_lse_reference(q, k, scale, causal, topk_indices=None):
    """The teacher's per-head lse (B, H, Nq), float64, -inf on empty rows (dense layout)."""
    q, k = q.double(), k.double()
    B, Nq, H, D = q.shape
    Nk, Hk = k.shape[1], k.shape[2]
    s = torch.einsum("bihd,bjhd->bhij", q, k.repeat_interleave(H // Hk, dim=2)) * scale
    allowed = torch.ones(B, Nq, Nk, dtype=torch.bool, device=q.device)
    if causal:
        allowed &= torch.arange(Nk, device=q.device)[None, :] <= torch.arange(Nq, device=q.device)[:, None] + Nk - Nq
    if topk_indices is not None:
        sel = torch.zeros(B, Nq, Nk + 1, dtype=torch.bool, device=q.device)
        idx = topk_indices.long().clone()
        idx[idx < 0] = Nk
        sel.scatter_(2, idx, True)
        allowed &= sel[..., :Nk]
    return torch.logsumexp(s.masked_fill(~allowed[:, None], float("-inf")), -1)


def rel_l2(actual: torch.Tensor, expected: torch.Tensor) -> float:
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    err = (actual - expected).norm().item()
    return err / denom if denom > 0 else err


# ---------------------------------------------------------------------------------- cases
@dataclass(frozen=True)
class Case:
    lengths_q: tuple[int, ...]  # one per sequence; dense when `varlen` is False (all equal)
    lengths_k: tuple[int, ...]
    heads: int
    heads_k: int
    dim: int
    index_heads: int
    index_dim: int
    causal: bool = True
    topk: int = 0
    varlen: bool = False

    @property
    def id(self) -> str:
        lengths = f"Nq{'_'.join(map(str, self.lengths_q))}-Nk{'_'.join(map(str, self.lengths_k))}"
        text = (
            f"{'varlen' if self.varlen else f'B{len(self.lengths_q)}'}-{lengths}-H{self.heads}-Hk{self.heads_k}"
            f"-D{self.dim}-Hi{self.index_heads}-Di{self.index_dim}"
        )
        text += "-causal" if self.causal else "-full"
        return text + (f"-top{self.topk}" if self.topk else "-dense")


def make_inputs(case: Case, dtype: torch.dtype, device: str):
    """Random normal (q, k, qi, ki, w) in the dense or packed layout, and top-k indices (or None)
    with -1 slots, repeats and causally masked picks."""
    rand = lambda *shape: torch.randn(shape, device=device).to(dtype)
    if case.varlen:
        lead_q, lead_k = (sum(case.lengths_q) + 3,), (sum(case.lengths_k) + 2,)  # + rows past cu_seqlens[-1]
    else:
        lead_q, lead_k = (len(case.lengths_q), case.lengths_q[0]), (len(case.lengths_k), case.lengths_k[0])
    q = rand(*lead_q, case.heads, case.dim)
    k = rand(*lead_k, case.heads_k, case.dim)
    qi = rand(*lead_q, case.index_heads, case.index_dim)
    ki = rand(*lead_k, case.index_dim)
    w = rand(*lead_q, case.index_heads)
    topk = None
    if case.topk:
        width = max(max(case.lengths_k), 1)
        topk = torch.randint(-1, width, (*lead_q, case.topk), dtype=torch.int32, device=device)
        if case.varlen:  # positions within each row's own sequence
            start = 0
            for n_q, n_k in zip(case.lengths_q, case.lengths_k):
                rows = topk[start : start + n_q]
                rows.copy_(torch.randint(-1, n_k, rows.shape, dtype=torch.int32)) if n_k else rows.fill_(-1)
                start += n_q
            topk[start:] = -1
        topk[..., 1] = topk[..., 0]  # a repeated selection counts once
    return q, k, qi, ki, w, topk


def make_problem(case: Case, q, k, qi, ki, topk, lse_given: bool):
    dtype, device = q.dtype, q.device
    common = dict(
        heads=case.heads,
        heads_k=case.heads_k,
        dim=case.dim,
        index_heads=case.index_heads,
        index_dim=case.index_dim,
        scale=case.dim**-0.5,
        causal=case.causal,
        topk=0 if topk is None else topk.shape[-1],
        dtype=dtype,
        device=device,
        lse_given=lse_given,
    )
    if not case.varlen:
        return IndexerProblem(batch=q.shape[0], seqlen_q=q.shape[1], seqlen_k=k.shape[1], **common)
    cu = lambda lengths: torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
    return IndexerProblem(
        batch=len(case.lengths_q),
        seqlen_q=max(case.lengths_q),
        seqlen_k=max(case.lengths_k),
        is_varlen=True,
        total_q=q.shape[0],
        total_k=k.shape[0],
        cu_seqlens_q=cu(case.lengths_q),
        cu_seqlens_k=cu(case.lengths_k),
        **common,
    )


def reference(case: Case, q, k, qi, ki, w, topk):
    """(loss, head_lse) float64 in the inputs' layout, each packed sequence on its own; rows past
    cu_seqlens[-1] get loss 0 and lse -inf."""
    scale = case.dim**-0.5
    if not case.varlen:
        loss = indexer_kl_reference(q, k, qi, ki, w, scale, case.causal, topk)
        return loss, head_lse_reference(q, k, scale, case.causal, topk)
    losses, lses = [], []
    start_q = start_k = 0
    for n_q, n_k in zip(case.lengths_q, case.lengths_k):
        sq, sk = slice(start_q, start_q + n_q), slice(start_k, start_k + n_k)
        part = (q[sq], k[sk], qi[sq], ki[sk], w[sq])
        sel = None if topk is None else topk[sq][None]
        losses.append(indexer_kl_reference(*(t[None] for t in part), scale, case.causal, sel)[0])
        lses.append(head_lse_reference(q[sq][None], k[sk][None], scale, case.causal, sel)[0])
        start_q, start_k = start_q + n_q, start_k + n_k
    tail = q.shape[0] - start_q
    losses.append(torch.zeros(tail, dtype=torch.float64, device=q.device))
    lses.append(torch.full((case.heads, tail), float("-inf"), dtype=torch.float64, device=q.device))
    return torch.cat(losses), torch.cat(lses, dim=1)


def check_case(case: Case, dtype: torch.dtype, lse_given: bool = False) -> None:
    """Forward (loss, head lse, index lse) and the three gradients against the float64 reference."""
    loss_tol, grad_tol = TOLERANCE[dtype]
    q, k, qi, ki, w, topk = make_inputs(case, dtype, DEVICE)
    problem = make_problem(case, q, k, qi, ki, topk, lse_given)
    assert cupy_indexer.not_supported_reasons(problem) == []
    leaves = [t.detach().double().requires_grad_(True) for t in (qi, ki, w)]
    ref_loss, ref_lse = reference(case, q.double(), k.double(), *leaves, topk)
    given = ref_lse.float() if lse_given else None
    loss, head_lse, index_lse = cupy_indexer.forward(problem, q, k, qi, ki, w, given, topk)

    assert loss.dtype == torch.float32 and loss.shape == ref_loss.shape
    assert torch.isfinite(loss).all(), "loss: a row was not written or is not finite"
    err = rel_l2(loss, ref_loss)
    assert err <= loss_tol, f"loss: relative L2 error {err:.3g} > {loss_tol}"
    empty = torch.isneginf(ref_lse[..., 0, :] if case.varlen else ref_lse[:, 0])
    assert torch.equal(torch.isneginf(index_lse), empty), "index_lse: -inf exactly on the empty rows"
    assert (loss[empty] == 0).all()
    if lse_given:
        assert head_lse is given
    else:
        assert torch.equal(torch.isneginf(head_lse), torch.isneginf(ref_lse))
        finite = torch.isfinite(ref_lse)
        assert not torch.isnan(head_lse).any()
        assert rel_l2(head_lse[finite], ref_lse[finite]) <= loss_tol

    grad_rows = torch.randn(ref_loss.shape, dtype=torch.float64, device=DEVICE).masked_fill(empty, 0.0)
    ref_grads = torch.autograd.grad((ref_loss * grad_rows).sum(), leaves)
    grads = cupy_indexer.backward(problem, q, k, qi, ki, w, topk, head_lse, index_lse, grad_rows.float())
    for name, g, rg, x in zip(("dqi", "dki", "dw"), grads, ref_grads, (qi, ki, w)):
        assert g.dtype == dtype and g.shape == x.shape, name
        assert torch.isfinite(g).all(), f"{name}: a row was not written or is not finite"
        err = rel_l2(g, rg)
        assert err <= grad_tol, f"{name}: relative L2 error {err:.3g} > {grad_tol}"


# ---------------------------------------------------------------------------------- no GPU needed
@pytest.mark.skipif(shutil.which("nvcc") is None, reason="nvcc is not on PATH")
@pytest.mark.parametrize("arch,code", [(80, 0), (80, 1), (90, 2)], ids=["sm80-fp32", "sm80-fp16", "sm90-bf16"])
def test_indexer_kernels_compile_with_nvcc(arch, code, tmp_path):
    unit = tmp_path / "indexer.cu"  # the text NVRTC compiles: input.cuh inlined
    unit.write_text(inline_includes(cupy_indexer.SOURCE))
    result = subprocess.run(
        [
            "nvcc",
            f"-arch=sm_{arch}",
            "-std=c++17",
            f"-DSTREAMKL_INPUT={code}",
            "-c",
            str(unit),
            "-o",
            str(tmp_path / "indexer.o"),
        ],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr
    assert "warning" not in result.stderr.lower(), result.stderr


def test_indexer_params_record_follows_the_struct():
    record = cupy_indexer.params_dtype()
    text = cupy_indexer.SOURCE.read_text()
    for name in ("q", "key_rows", "topk_s", "dw_h", "lse_given", "scale"):
        assert name in record.names and name in text
    assert record.itemsize % 8 == 0
    assert record.fields["q"][1] == 0


@pytest.mark.skipif(emulate.compiler() is None, reason="no C++ compiler for the emulator")
def test_indexer_emulator_sees_the_same_record():
    assert cupy_indexer._emulator(0).emu_params_size() == cupy_indexer.params_dtype().itemsize


def test_indexer_shared_memory_fits_at_the_largest_shapes():
    assert cupy_indexer.shared_bytes(128, 64, 128) <= 99 * 1024  # Ampere's opt-in limit is 163 KiB
    assert cupy_indexer.shared_bytes(64, 64, 128) <= 48 * 1024  # no opt-in at DeepSeek's shape


def test_indexer_reasons_name_the_limits():
    problem = IndexerProblem(
        batch=1,
        seqlen_q=2**20,
        seqlen_k=2**20,
        heads=2,
        heads_k=1,
        dim=300,
        index_heads=80,
        index_dim=200,
        scale=1.0,
        causal=True,
        topk=2**12,
        dtype=torch.float32,
        device=torch.device(DEVICE),
    )
    text = " ".join(cupy_indexer.not_supported_reasons(problem))
    if _REASONS:
        assert text
    else:
        for expected in ("head dim is 300", "indexer head dim is 200", "indexer heads are 80", "top-4096"):
            assert expected in text


# ---------------------------------------------------------------------------------- against the reference
CASES = [
    Case((37, 37), (70, 70), 4, 2, 16, 3, 16),  # Nk > Nq causal, two key chunks
    Case((45,), (30,), 3, 1, 8, 2, 8),  # Nq > Nk causal: the first rows are empty
    Case((20, 20), (67, 67), 2, 2, 8, 2, 12, causal=False),
    Case((33,), (70,), 4, 2, 16, 3, 16, topk=70),  # top-k over two chunks, -1 and repeats
    Case((40,), (40,), 2, 1, 8, 2, 8, causal=False, topk=9),
    Case((17, 0, 30, 5), (17, 4, 30, 0), 2, 1, 8, 2, 8, varlen=True),  # empty sequences, tail rows
    Case((17, 0, 30, 5), (17, 4, 30, 0), 2, 1, 8, 2, 8, topk=12, varlen=True),
]


@needs_backend
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_indexer_matches_reference(case):
    check_case(case, torch.float32)


@needs_backend
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", [CASES[0], CASES[6]], ids=[CASES[0].id, CASES[6].id])
def test_indexer_half_inputs(case, dtype):
    check_case(case, dtype)


@needs_backend
@pytest.mark.parametrize("case", [CASES[1], CASES[3], CASES[6]], ids=[CASES[1].id, CASES[3].id, CASES[6].id])
def test_indexer_given_lse(case):
    check_case(case, torch.float32, lse_given=True)


@needs_backend
def test_indexer_strided_inputs():
    """(B, H, N, D) tensors transposed to the layout, and a strided w: read in place, no copies."""
    case = CASES[0]
    q, k, qi, ki, w, topk = make_inputs(case, torch.float32, DEVICE)
    q2 = q.transpose(1, 2).contiguous().transpose(1, 2)
    w2 = torch.cat([w, w], dim=-1)[..., : case.index_heads]
    problem = make_problem(case, q, k, qi, ki, topk, False)
    expected = cupy_indexer.forward(problem, q, k, qi, ki, w, None, topk)
    actual = cupy_indexer.forward(problem, q2, k, qi, ki, w2, None, topk)
    for a, e in zip(actual, expected):
        assert torch.equal(a, e)


@needs_backend
def test_indexer_nan_propagates():
    case = CASES[1]
    q, k, qi, ki, w, topk = make_inputs(case, torch.float32, DEVICE)
    qi[0, 40, 0, 0] = float("nan")
    problem = make_problem(case, q, k, qi, ki, topk, False)
    loss, _, _ = cupy_indexer.forward(problem, q, k, qi, ki, w, None, topk)
    assert torch.isnan(loss[0, 40])
    assert torch.isfinite(loss[0, :40]).all()


# ---------------------------------------------------------------------------------- GPU only
GPU_CASES = [
    Case((300, 300), (1000, 1000), 8, 2, 128, 16, 64),
    Case((257,), (513,), 16, 16, 192, 64, 128, topk=128),
    Case((200,), (200,), 4, 1, 256, 8, 128, causal=False, topk=300),
    Case((129, 0, 700, 33), (129, 5, 700, 0), 8, 4, 64, 64, 128, varlen=True),
    Case((129, 0, 700, 33), (129, 5, 700, 0), 8, 4, 64, 32, 64, topk=96, varlen=True),
]


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("case", GPU_CASES, ids=[c.id for c in GPU_CASES])
def test_indexer_matches_reference_on_gpu(case, dtype):
    check_case(case, dtype)


@pytest.mark.gpu
@gpu_only
@pytest.mark.parametrize("case", GPU_CASES[1:2] + GPU_CASES[4:], ids=[GPU_CASES[1].id, GPU_CASES[4].id])
def test_indexer_given_lse_on_gpu(case):
    check_case(case, torch.bfloat16, lse_given=True)


@pytest.mark.gpu
@gpu_only
def test_indexer_backward_is_reproducible_on_gpu():
    case = GPU_CASES[1]
    q, k, qi, ki, w, topk = make_inputs(case, torch.bfloat16, DEVICE)
    problem = make_problem(case, q, k, qi, ki, topk, False)
    loss, head_lse, index_lse = cupy_indexer.forward(problem, q, k, qi, ki, w, None, topk)
    grad_rows = torch.randn_like(loss)
    first = cupy_indexer.backward(problem, q, k, qi, ki, w, topk, head_lse, index_lse, grad_rows)
    second = cupy_indexer.backward(problem, q, k, qi, ki, w, topk, head_lse, index_lse, grad_rows)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
