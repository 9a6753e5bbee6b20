"""`indexer_kl` on random problems against the float64 reference (SPEC 8): the combinations the
parametrized tests name one by one (varlen with empty sequences and a tail, Nq != Nk, GQA, top-k
with unused slots and repeats, the teacher's lse given, each reduction with an upstream gradient),
drawn together from a seed. Every backend (on the CPU, the Triton interpreter and the CuPy emulator)."""

from __future__ import annotations

import itertools
import random

import pytest
import torch
from helpers import indexer_backend_params

import streamkl
from streamkl import reference

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SEEDS = range(24)


@pytest.fixture(params=indexer_backend_params())
def backend(request):
    return request.param


def random_problem(seed: int):
    """(inputs, keyword arguments, reduction) of one random problem, float32 on DEVICE."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    heads = rng.choice([1, 2, 4])
    heads_k = rng.choice([h for h in (1, 2, 4) if heads % h == 0])
    dim, index_heads, index_dim = rng.choice([8, 16, 24, 40]), rng.choice([1, 2, 3]), rng.choice([8, 16, 20])
    causal = rng.random() < 0.7
    kwargs = {"causal": causal}
    count = rng.randint(1, 12)  # top-k slots

    def selection(rows: int, keys: int) -> torch.Tensor:
        picks = torch.randint(0, max(keys, 1), (rows, count), generator=gen)
        unused = (torch.rand(rows, count, generator=gen) < 0.2) | (keys == 0)
        return torch.where(unused, -1, picks).int()

    use_topk = rng.random() < 0.5
    if rng.random() < 0.4:  # packed sequences, some empty, rows past the last one
        lens_q = [rng.randint(0, 40) for _ in range(rng.randint(1, 3))]
        lens_k = lens_q if causal or rng.random() < 0.5 else [rng.randint(0, 40) for _ in lens_q]
        cu_q = torch.tensor([0, *itertools.accumulate(lens_q)], dtype=torch.int32)
        cu_k = torch.tensor([0, *itertools.accumulate(lens_k)], dtype=torch.int32)
        lead_q, lead_k = (int(cu_q[-1]) + rng.choice([0, 3]),), (int(cu_k[-1]) + rng.choice([0, 2]),)
        kwargs.update(cu_seqlens=cu_q.to(DEVICE), cu_seqlens_k=None if lens_k is lens_q else cu_k.to(DEVICE))
        if use_topk:
            topk = torch.full((lead_q[0], count), -1, dtype=torch.int32)
            for s, (len_q, len_k) in enumerate(zip(lens_q, lens_k)):
                topk[int(cu_q[s]):int(cu_q[s]) + len_q] = selection(len_q, len_k)
            kwargs["topk_indices"] = topk.to(DEVICE)
    else:
        batch, len_q = rng.randint(1, 2), rng.randint(1, 50)
        len_k = len_q if rng.random() < 0.6 else rng.randint(1, 50)
        lead_q, lead_k = (batch, len_q), (batch, len_k)
        if use_topk:
            kwargs["topk_indices"] = selection(batch * len_q, len_k).view(batch, len_q, count).to(DEVICE)
    shapes = [(*lead_q, heads, dim), (*lead_k, heads_k, dim), (*lead_q, index_heads, index_dim),
              (*lead_k, index_dim), (*lead_q, index_heads)]
    inputs = [torch.randn(shape, generator=gen).to(DEVICE) for shape in shapes]
    return inputs, kwargs, rng.choice(["none", "mean", "sum"]), rng.random() < 0.4


def reference_loss(inputs, kwargs, reduction):
    """The float64 reference reduced as `reduction` ("mean": over the rows whose teacher support is
    not empty), its gradients' leaves, and the teacher's per-head lse."""
    leaves = [t.double().requires_grad_(i >= 2) for i, t in enumerate(inputs)]
    rows, head_lse, _ = reference.indexer_kl(*leaves, return_lse=True, **kwargs)
    if reduction == "none":
        return rows, leaves, head_lse
    total = rows.sum()
    if reduction == "mean":
        nonempty = int(torch.isfinite(head_lse.select(-2, 0)).sum())  # (B, Nq) or (T,)
        total = total / nonempty if nonempty else total * 0
    return total, leaves, head_lse


@pytest.mark.parametrize("seed", SEEDS)
def test_random_problem_against_reference(backend, seed):
    inputs, kwargs, reduction, give_lse = random_problem(seed)
    expected, leaves, head_lse = reference_loss(inputs, kwargs, reduction)
    upstream = torch.randn(expected.shape, dtype=torch.float64, device=DEVICE) if reduction == "none" else \
        torch.tensor(0.7, dtype=torch.float64, device=DEVICE)
    expected_grads = torch.autograd.grad((expected * upstream).sum(), leaves[2:])
    if give_lse:
        kwargs = dict(kwargs, lse=head_lse.detach().float())
    x = [t.clone().requires_grad_(i >= 2) for i, t in enumerate(inputs)]
    loss = streamkl.indexer_kl(*x, reduction=reduction, backend=backend, **kwargs)
    grads = torch.autograd.grad((loss * upstream.float()).sum(), x[2:])
    assert loss.dtype == torch.float32 and loss.shape == expected.shape
    torch.testing.assert_close(loss.double(), expected.detach(), rtol=1e-4, atol=1e-4)
    for grad, ref in zip(grads, expected_grads):
        torch.testing.assert_close(grad.double(), ref, rtol=1e-4, atol=1e-4 * max(1.0, ref.abs().max().item()))
