"""The Triton backend on a real GPU, at real sizes: against the float64 reference where it fits,
against the torch backend (float32) where it does not. Skipped without CUDA, except the sm_90a
compile tests (ahead of time, no GPU needed); tests/test_triton_split_k.py covers split-K on the CPU.

    python -m pytest -q tests/test_triton_gpu.py            # on the H200, through the device tool
"""

from __future__ import annotations

import pytest
import torch
from helpers import check_against_reference, compile_in_subprocess, make_inputs, rel_l2

import streamkl
from streamkl.reference import reference_kl
from streamkl.sparse.block_mask import BlockMask

DEVICE = "cuda"


def gpu(test):
    """Real-GPU tests: skipped without CUDA (the interpreter runs the shared suite instead)."""
    return pytest.mark.gpu(pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")(test))
DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}

# (B, Nq, Nk, H, (H1k, H2k), (D1, D2), causal, window)
DENSE = {
    "B2-N1000-H4-Hk4x4-D64-causal": (2, 1000, 1000, 4, (4, 4), (64, 64), True, (-1, -1)),
    "B1-N777-H4-Hk1x2-D128x64": (1, 777, 777, 4, (1, 2), (128, 64), False, (-1, -1)),
    "B2-Nq300-Nk1100-H2-Hk2x1-D96x80-causal": (2, 300, 1100, 2, (2, 1), (96, 80), True, (-1, -1)),
    "B1-Nq900-Nk400-H2-Hk2x2-D64-causal": (1, 900, 400, 2, (2, 2), (64, 64), True, (-1, -1)),  # empty rows
    "B1-N1500-H2-Hk1x1-D128-window256_0": (1, 1500, 1500, 2, (1, 1), (128, 128), False, (256, 0)),
    "B1-N600-H2-Hk2x2-D256x192-causal": (1, 600, 600, 2, (2, 2), (256, 192), True, (-1, -1)),
    "B1-N513-H2-Hk2x2-D32x16-window40_9": (1, 513, 513, 2, (2, 2), (32, 16), False, (40, 9)),
}


@gpu
@pytest.mark.parametrize("dtype", list(DTYPES.values()), ids=list(DTYPES))
@pytest.mark.parametrize("case", list(DENSE.values()), ids=list(DENSE))
def test_dense_against_reference(case, dtype):
    batch, nq, nk, heads, heads_k, dims, causal, window = case
    inputs = make_inputs((batch, nq), (batch, nk), heads, heads_k, dims, dtype, DEVICE)
    check_against_reference(inputs, "triton", causal=causal, window=window)


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_varlen_16_sequences_against_reference(dtype):
    lengths = [0, 1, 17, 64, 127, 128, 129, 300, 5, 0, 512, 250, 33, 1000, 2, 700]
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=DEVICE)
    total = int(cu[-1]) + 7  # tail rows past cu_seqlens[-1]
    inputs = make_inputs((total,), (total,), 4, (2, 4), (128, 64), dtype, DEVICE)
    check_against_reference(inputs, "triton", cu_seqlens=cu, causal=True)


@gpu
@pytest.mark.parametrize("block", [(128, 128), (64, 64), (16, 32)], ids=["bm128", "bm64", "bm16x32"])
def test_sparse_block_masks_against_reference(block):
    batch, n, heads = 2, 1024, 4
    bq, bk = block
    shape = (batch, heads, -(-n // bq), -(-n // bk))
    student = torch.rand(shape, device=DEVICE) < 0.1  # 90 % sparse, per head
    teacher = student | (torch.rand(shape[2:], device=DEVICE) < 0.05)  # a wider teacher: some rows uncovered
    inputs = make_inputs((batch, n), (batch, n), heads, (2, 2), (64, 64), torch.bfloat16, DEVICE)
    mask2 = BlockMask.from_dense(student, block)
    # student's mask on both sides (finite KL everywhere), then a wider teacher (some +inf rows)
    check_against_reference(inputs, "triton", mask1=mask2, mask2=mask2, causal=True)
    check_against_reference(inputs, "triton", mask1=BlockMask.from_dense(teacher, block), mask2=mask2)


@gpu
def test_large_against_torch_backend_fp32():
    """N = 16K, causal and GQA, float32: the triton and torch backends run the same algorithm."""
    batch, n, heads = 1, 16384, 2
    inputs = make_inputs((batch, n), (batch, n), heads, (1, 2), (64, 64), torch.float32, DEVICE)
    upstream = torch.randn((batch, n, heads), device=DEVICE)
    results = []
    for backend in ("triton", "torch"):
        leaves = [t.detach().clone().requires_grad_() for t in inputs]
        out = streamkl.kl(*leaves, causal=True, reduction="none", backend=backend)
        (out * upstream).sum().backward()
        results.append((out.detach(), [t.grad for t in leaves]))
    (out_a, grads_a), (out_b, grads_b) = results
    assert rel_l2(out_a, out_b) <= 1e-5
    for a, b in zip(grads_a, grads_b):
        assert rel_l2(a, b) <= 1e-4


@gpu
def test_large_bf16_against_reference_subset_of_heads():
    """N = 8K in bfloat16 against the float64 reference (2 heads: the reference is N x N)."""
    inputs = make_inputs((1, 8192), (1, 8192), 2, (1, 1), (128, 128), torch.bfloat16, DEVICE)
    check_against_reference(inputs, "triton", causal=True)


@gpu
def test_deterministic_gradients_are_bitwise_reproducible_and_match_the_default():
    """deterministic=True: no atomics, identical bits run to run; the default for student-only
    gradients (one pass, atomic dq) agrees with it to float32 summation-order noise."""
    inputs = make_inputs((1, 4096), (1, 4096), 8, (2, 4), (128, 64), torch.bfloat16, DEVICE)
    runs = []
    for _ in range(3):
        for t in inputs:
            t.grad = None
        streamkl.kl(*inputs, causal=True, deterministic=True, backend="triton").backward()
        runs.append([t.grad.clone() for t in inputs])
    for later in runs[1:]:
        for a, b in zip(runs[0], later):
            assert torch.equal(a, b)
    student = [t.detach().clone().requires_grad_(i >= 2) for i, t in enumerate(inputs)]
    grads = {}
    for deterministic in (True, False):
        for t in student:
            t.grad = None
        streamkl.kl(*student, causal=True, deterministic=deterministic, backend="triton").backward()
        grads[deterministic] = [student[2].grad.clone(), student[3].grad.clone()]
    for a, b in zip(grads[True], grads[False]):
        assert rel_l2(b.float(), a.float()) < 1e-2


@gpu
def test_strided_inputs_take_no_copy():
    """(B, H, N, D) tensors transposed to (B, N, H, D) run without a copy (the portable kernels read
    any strides; the Gluon kernels, which read contiguous inputs through TMA, serve the contiguous
    ones on sm_90): the same results up to summation order."""
    bhnd = [torch.randn(2, 4, 700, 64, device=DEVICE, dtype=torch.bfloat16) for _ in range(4)]
    strided = [t.transpose(1, 2).requires_grad_() for t in (x.clone() for x in bhnd)]
    contiguous = [t.detach().contiguous().requires_grad_() for t in strided]
    a = streamkl.kl(*strided, causal=True, reduction="none", backend="triton")
    b = streamkl.kl(*contiguous, causal=True, reduction="none", backend="triton")
    assert rel_l2(a, b) < 1e-5
    a.sum().backward()
    b.sum().backward()
    for s, c in zip(strided, contiguous):
        assert rel_l2(s.grad.float(), c.grad.float()) < 1e-2


@gpu
def test_student_only_backward_leaves_teacher_alone():
    q1, k1, q2, k2 = make_inputs((1, 2048), (1, 2048), 4, (4, 4), (128, 64), torch.bfloat16, DEVICE,
                                 (False, False, True, True))
    streamkl.kl(q1, k1, q2, k2, causal=True, backend="triton").backward()
    assert q1.grad is None and k1.grad is None
    assert torch.isfinite(q2.grad).all() and torch.isfinite(k2.grad).all()


@gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_split_k_forward_few_queries_long_keys(dtype):
    """128 queries against 64K keys: the forward splits each key list (split-K) and merges the
    slices' statistics; checked against the reference."""
    from streamkl.backends.triton import select

    inputs = make_inputs((1, 128), (1, 65536), 2, (1, 2), (128, 64), dtype, DEVICE)
    problem_grid = 1 * 2  # one query tile, two heads: far fewer programs than multiprocessors
    assert select.split_count(_problem(inputs), problem_grid, 1024) > 1
    check_against_reference(inputs, "triton", causal=True)


@gpu
def test_split_k_varlen_and_masks():
    lengths_q, lengths_k = [64, 0, 100], [30000, 500, 20000]
    cu_q = torch.tensor([0, 64, 64, 164], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 30000, 30500, 50500], dtype=torch.int32, device=DEVICE)
    assert sum(lengths_q) == 164 and sum(lengths_k) == 50500
    inputs = make_inputs((170,), (50500,), 4, (2, 4), (64, 64), torch.bfloat16, DEVICE)
    pattern = torch.rand(3, 4, 1, -(-30000 // 128), device=DEVICE) < 0.3
    mask = BlockMask.from_dense(pattern, (128, 128))
    check_against_reference(inputs, "triton", cu_seqlens=cu_q, cu_seqlens_k=cu_k, mask1=mask, mask2=mask, causal=True)


def _problem(inputs):
    from streamkl.problem import build_problem

    return build_problem(*inputs)


@gpu
def test_more_than_65535_sequence_head_pairs():
    """8200 sequences x 8 heads: the grids are flat, so no CUDA 65535 limit on (sequence, head)."""
    batch, n, heads = 8200, 5, 8
    inputs = make_inputs((batch, n), (batch, n), heads, (8, 4), (64, 32), torch.bfloat16, DEVICE)
    dense = streamkl.kl(*inputs, causal=True, reduction="none", backend="triton")
    upstream = torch.randn_like(dense)
    grads = torch.autograd.grad((dense * upstream).sum(), inputs)
    # the same sequences packed (varlen), and a batched float64 reference
    cu = torch.arange(0, batch * n + 1, n, dtype=torch.int32, device=DEVICE)
    packed = [t.detach().reshape(batch * n, *t.shape[2:]).requires_grad_() for t in inputs]
    varlen = streamkl.kl(*packed, cu_seqlens=cu, causal=True, reduction="none", backend="triton")
    assert torch.equal(varlen.reshape(batch, n, heads), dense)
    leaves = [t.detach().double().requires_grad_() for t in inputs]
    q1, k1, q2, k2 = leaves
    future = torch.ones(n, n, dtype=torch.bool, device=DEVICE).triu(1)
    logs = []
    for q, k in ((q1, k1), (q2, k2)):
        k = k.repeat_interleave(heads // k.shape[2], dim=2)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * q.shape[-1] ** -0.5
        log_p = torch.log_softmax(scores.masked_fill(future, float("-inf")), dim=-1)
        logs.append(log_p.masked_fill(future, 0.0))  # finite where masked: no NaN in the gradient
    terms = torch.where(future, 0.0, logs[0].exp() * (logs[0] - logs[1]))
    ref = terms.sum(-1).transpose(1, 2)  # [B, N, H]
    assert rel_l2(dense, ref) <= 1e-2
    ref_grads = torch.autograd.grad((ref * upstream.double()).sum(), leaves)
    for g, rg in zip(grads, ref_grads):
        assert rel_l2(g, rg) <= 2e-2


@pytest.mark.parametrize("deterministic", [False, True], ids=["atomic", "two-kernels"])
def test_float16_mean_gradients_reach_their_rounding_floor(deterministic):
    """float16 with the mean reduction: the upstream gradient ~ 1 / (N * H) makes the gradients
    subnormal in float16, so even the float64 gradient rounded to float16 errs by ~1e-3 here; the
    kernels must add nothing to that (dS is rounded to float16 for its products: unscaled it would
    flush toward 0, see backward.G_PEAK)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = make_inputs((1, 256), (1, 256), 8, (8, 8), (128, 128), torch.float16, device, (False, False, True, True))
    loss = streamkl.kl(*x, backend="triton", causal=True, deterministic=deterministic)
    grads = torch.autograd.grad(loss, x[2:])
    leaves = [t.detach().double().requires_grad_(t.requires_grad) for t in x]
    ref, _, _ = reference_kl(*leaves, causal=True)
    ref_grads = torch.autograd.grad(ref.mean(), leaves[2:])
    for g, rg in zip(grads, ref_grads):
        floor = rel_l2(rg.half().double(), rg)
        assert floor > 2e-4  # the case is the intended one: subnormal gradients
        assert rel_l2(g, rg) <= 1.2 * floor + 1e-4, (rel_l2(g, rg), floor)


@gpu
def test_inputs_on_a_gpu_that_is_not_the_current_one():
    """Inputs on cuda:1 while cuda:0 is the current device: the kernels launch on the inputs' GPU
    (Triton launches on the current device's stream; the backend switches to the inputs' device).
    Needs two GPUs."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two GPUs")
    previous = torch.cuda.current_device()
    torch.cuda.set_device(0)
    try:
        for dims, causal in (((128, 128), True), ((64, 64), False), ((128, 64), True)):
            x = make_inputs((2, 200), (2, 256), 4, (4, 2), dims, torch.bfloat16, "cuda:1")
            check_against_reference(x, "triton", causal=causal)
        assert torch.cuda.current_device() == 0
    finally:
        torch.cuda.set_device(previous)


# ------------------------------------------------------------------ the Gluon kernels, on the GPU and on any machine
GLUON_CASES = {  # name: (dims, causal, needs: student or all four, varlen lengths, block-mask block)
    "D128": ((128, 128), False, "student", None, None),
    "D128-causal": ((128, 128), True, "student", None, None),
    "D128-tail-gqa": ((128, 128), True, "student", None, None),
    "D64": ((64, 64), False, "student", None, None),
    "D64-causal": ((64, 64), True, "student", None, None),
    "D128-both": ((128, 128), False, "both", None, None),
    "D128-both-causal": ((128, 128), True, "both", None, None),
    "D128-varlen": ((128, 128), True, "student", [700, 0, 1300, 2048], None),
    "D128-both-varlen": ((128, 128), True, "both", [512, 1536, 1024], None),
    "D128-bm128": ((128, 128), False, "student", None, 128),
    "D128-both-bm128": ((128, 128), False, "both", None, 128),
}


@gpu
@pytest.mark.parametrize("case", list(GLUON_CASES.values()), ids=list(GLUON_CASES))
@pytest.mark.parametrize("reduction", ["mean", "none"])
def test_gluon_scope_against_reference(case, reduction):
    """The problems the Gluon kernels serve on sm_90 (select.py), forward and gradients against the
    float64 reference (elsewhere the portable kernels serve the same problems)."""
    dims, causal, needs, lengths, block = case
    grads = (False, False, True, True) if needs == "student" else (True, True, True, True)
    heads = (8, (2, 2)) if "gqa" in str(case) else (4, (4, 4))
    n = 1000 if "tail" in str(case) else 1024
    if lengths is not None:
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        x = make_inputs((int(cu[-1]),), (int(cu[-1]),), heads[0], heads[1], dims, torch.bfloat16, DEVICE, grads)
        check_against_reference(x, "triton", causal=causal, cu_seqlens=cu, reduction=reduction)
        return
    masks = {}
    if block is not None:
        pattern = torch.rand(2, heads[0], n // block, n // block, device=DEVICE) < 0.5
        pattern[..., 0] = True
        mask = BlockMask.from_dense(pattern, block)
        masks = dict(mask1=mask, mask2=mask)
    x = make_inputs((2, n), (2, n), heads[0], heads[1], dims, torch.bfloat16, DEVICE, grads)
    check_against_reference(x, "triton", causal=causal, reduction=reduction, **masks)


@gpu
@pytest.mark.parametrize("needs", ["student", "both"])
def test_gluon_backward_bitwise_deterministic_option(needs):
    """deterministic=True takes the atomic-free portable kernels even where a Gluon kernel serves
    the default: gradients bitwise equal run to run, and within float32 noise of the default."""
    grads = (False, False, True, True) if needs == "student" else (True, True, True, True)
    x = make_inputs((2, 1024), (2, 1024), 4, (4, 4), (128, 128), torch.bfloat16, DEVICE, grads)
    runs = []
    for deterministic in (True, True, False):
        loss = streamkl.kl(*x, causal=True, deterministic=deterministic, backend="triton")
        runs.append(torch.autograd.grad(loss, [t for t in x if t.requires_grad]))
    for a, b in zip(runs[0], runs[1]):
        assert torch.equal(a, b)
    for a, b in zip(runs[0], runs[2]):
        assert rel_l2(b.float(), a.float()) < 1e-2


@pytest.mark.parametrize("kernel", ["forward-D128", "forward-D64-causal", "forward-listed", "backward-D128-causal",
                                    "backward-D64", "backward-D64-causal-tail", "backward-both-causal",
                                    "backward-both-listed", "backward-listed"])
def test_gluon_kernels_compile_for_hopper(kernel):
    """The Gluon kernels stay valid Gluon for this triton, ptxas included, on any machine: compiled
    for sm_90a in a subprocess (Gluon cannot compile in a process running the interpreter)."""
    from streamkl.backends.triton.gluon import IMPORT_ERROR

    if IMPORT_ERROR is not None:
        pytest.skip(f"no Gluon kernels with this triton: {IMPORT_ERROR}")
    calls = {
        "forward-D128": "f.compile_for_hopper(bf16, 128)",
        "forward-D64-causal": "f.compile_for_hopper(bf16, 64, causal=True)",
        "forward-listed": "f.compile_for_hopper(bf16, 128, listed=True)",
        "backward-D128-causal": "b.compile_for_hopper(bf16, 128, causal=True)",
        "backward-D64": "b.compile_for_hopper(bf16, 64)",
        "backward-D64-causal-tail": "b.compile_for_hopper(bf16, 64, causal=True, tail=True)",
        "backward-both-causal": "b.compile_for_hopper(bf16, 128, causal=True, both=True)",
        "backward-both-listed": "b.compile_for_hopper(bf16, 128, listed=True, both=True)",
        "backward-listed": "b.compile_for_hopper(bf16, 128, listed=True)",
    }
    code = ("import torch\n"
            "from streamkl.backends.triton.gluon import backward as b, forward as f\n"
            "bf16 = torch.bfloat16\n"
            f"kernel = {calls[kernel]}\n"
            "assert 'wgmma' in kernel.asm['ptx']\n")
    compile_in_subprocess(code, timeout=600)
