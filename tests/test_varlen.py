"""Packed sequences (cu_seqlens) against the float64 reference, on every backend."""

from __future__ import annotations

import pytest
import torch
from conftest import DEVICE
from helpers import check_against_reference, make_inputs

import streamkl
from streamkl.varlen import cu_seqlens_from_lengths, pack, unpack

# (query lengths, key lengths or None for self-attention, padding rows after the last sequence)
LAYOUTS = {
    "uneven-with-empty": ([37, 0, 100, 5, 64], None, 7),
    "cross-attention": ([37, 1, 100, 0, 64], [50, 3, 0, 20, 77], 0),
    "one-long": ([211], None, 3),
    "all-empty": ([0, 0], [0, 0], 5),
}


def _varlen_inputs(layout, heads, heads_k, dims, dtype, requires_grad=(True,) * 4):
    len_q, len_k, tail = LAYOUTS[layout]
    cu_q = cu_seqlens_from_lengths(len_q, DEVICE)
    kwargs = dict(cu_seqlens=cu_q)
    total_q = sum(len_q) + tail
    total_k = total_q
    if len_k is not None:
        kwargs["cu_seqlens_k"] = cu_seqlens_from_lengths(len_k, DEVICE)
        total_k = sum(len_k) + 2
    inputs = make_inputs((total_q,), (total_k,), heads, heads_k, dims, dtype, DEVICE, requires_grad)
    return inputs, kwargs


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize(
    "options",
    [dict(), dict(causal=True), dict(causal=True, window=(9, -1)), dict(window=(5, 12))],
    ids=["dense", "causal", "causal-win9", "win5_12"],
)
def test_varlen_against_reference(layout, options, backend):
    inputs, kwargs = _varlen_inputs(layout, 4, (2, 1), (32, 24), torch.float32)
    check_against_reference(inputs, backend, **kwargs, **options)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_varlen_half_precision(dtype, backend):
    inputs, kwargs = _varlen_inputs("uneven-with-empty", 2, (1, 2), (64, 16), dtype)
    check_against_reference(inputs, backend, causal=True, **kwargs)


def test_rows_past_last_sequence_are_zero(backend):
    inputs, kwargs = _varlen_inputs("uneven-with-empty", 2, (2, 2), (16, 16), torch.float32)
    out, lse1, _ = streamkl.kl(*inputs, reduction="none", return_lse=True, backend=backend, **kwargs)
    end = int(kwargs["cu_seqlens"][-1])
    assert torch.equal(out[end:], torch.zeros_like(out[end:]))
    assert torch.isneginf(lse1[:, end:]).all()
    out.sum().backward()
    assert torch.equal(inputs[0].grad[end:], torch.zeros_like(inputs[0].grad[end:]))


def test_all_empty_gives_mean_zero(backend):
    inputs, kwargs = _varlen_inputs("all-empty", 2, (2, 2), (16, 16), torch.float32)
    loss = streamkl.kl(*inputs, backend=backend, **kwargs)
    assert loss.item() == 0.0
    loss.backward()
    for t in inputs:
        assert torch.equal(t.grad, torch.zeros_like(t.grad))


def test_given_max_seqlen_matches_computed(backend):
    inputs, kwargs = _varlen_inputs("cross-attention", 2, (2, 2), (16, 16), torch.float32, (False,) * 4)
    computed = streamkl.kl(*inputs, reduction="none", causal=True, backend=backend, **kwargs)
    given = streamkl.kl(
        *inputs, reduction="none", causal=True, backend=backend, max_seqlen=100, max_seqlen_k=77, **kwargs
    )
    assert torch.equal(computed, given)


def test_varlen_matches_batched_dense(backend):
    """Equal-length packed sequences give what the (B, N, H, D) call gives."""
    batch, n, heads, dim = 3, 40, 2, 16
    dense = [torch.randn(batch, n, heads, dim, device=DEVICE) for _ in range(4)]
    keep = torch.ones(batch, n, dtype=torch.bool, device=DEVICE)
    packed = []
    for t in dense:
        p, cu, max_len = pack(t, keep)
        packed.append(p)
    a = streamkl.kl(*dense, reduction="none", causal=True, backend=backend)
    b = streamkl.kl(*packed, reduction="none", causal=True, cu_seqlens=cu, max_seqlen=max_len, backend=backend)
    assert torch.allclose(unpack(b, keep), a, rtol=1e-5, atol=1e-6)


def test_pack_unpack_roundtrip():
    x = torch.randn(3, 7, 2, 4)
    keep = torch.tensor([[1] * 7, [1] * 3 + [0] * 4, [0] * 7], dtype=torch.bool)
    packed, cu, max_len = pack(x, keep)
    assert packed.shape == (10, 2, 4)
    assert cu.tolist() == [0, 7, 10, 10] and cu.dtype == torch.int32
    assert max_len == 7
    back = unpack(packed, keep)
    assert torch.equal(back[keep], x[keep])
    assert torch.equal(back[~keep], torch.zeros_like(back[~keep]))


def test_cu_seqlens_checked_again_after_an_in_place_change():
    """cu_seqlens values are read to the host once per table (cached), but a table changed in
    place is read and checked again: a now-invalid table still raises before any kernel runs."""
    inputs = make_inputs((40,), (40,), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    cu = torch.tensor([0, 15, 40], dtype=torch.int32, device=DEVICE)
    first = streamkl.kl(*inputs, cu_seqlens=cu, backend="torch")
    assert torch.equal(streamkl.kl(*inputs, cu_seqlens=cu, backend="torch"), first)
    cu[1] = 30
    moved = streamkl.kl(*inputs, cu_seqlens=cu, backend="torch")
    assert not torch.equal(moved, first)
    cu[1] = 50  # past the packed length of 40... and decreasing
    with pytest.raises(ValueError, match="cu_seqlens"):
        streamkl.kl(*inputs, cu_seqlens=cu, backend="torch")


def test_mean_without_value_reads_uses_a_table_seen_before(monkeypatch):
    """Where cu_seqlens may not be read (CUDA-graph capture; faked here), a table checked by an
    earlier eager call keeps its host copy: the mean divides by the same structural row count, so a
    captured step equals its eager twin bit for bit. A table never seen falls back to counting the
    non-empty rows on the device (same value)."""
    from streamkl import api, reduction

    inputs = make_inputs((70,), (70,), 2, (2, 2), (16, 16), torch.float32, DEVICE, (False,) * 4)
    counted = []
    original = reduction._rows_with_side1_support
    monkeypatch.setattr(reduction, "_rows_with_side1_support", lambda p: counted.append(1) or original(p))
    cu = torch.tensor([0, 0, 30, 64], dtype=torch.int32, device=DEVICE)
    kwargs = dict(cu_seqlens=cu, max_seqlen=34, causal=True, backend="torch")
    monkeypatch.setattr(api, "_may_read_values", lambda: False)
    unseen = streamkl.kl(*inputs, **kwargs)
    assert counted  # no host copy of this table yet: rows counted on the device
    monkeypatch.setattr(api, "_may_read_values", lambda: True)
    eager = streamkl.kl(*inputs, **kwargs)  # reads and checks the table once
    torch.testing.assert_close(unseen, eager, rtol=1e-6, atol=0)
    counted.clear()
    monkeypatch.setattr(api, "_may_read_values", lambda: False)
    assert torch.equal(streamkl.kl(*inputs, **kwargs), eager)
    assert not counted


@pytest.mark.parametrize("structure", ["varlen-causal", "shared-blockmask", "repeated-input"])
def test_torch_compile_fullgraph_shared_tables(structure):
    """One cu_seqlens table for queries and keys, one BlockMask on both sides, or one tensor as
    q1, k1 and q2, under
    torch.compile(fullgraph=True) (a tensor reaches the autograd Function once): the mean's count is
    computed in the graph; loss and student gradients match eager."""
    if structure == "varlen-causal":
        lengths = [30, 0, 51, 6]
        cu = cu_seqlens_from_lengths(lengths, DEVICE)
        student = (False, False, True, True)
        q1, k1, q2, k2 = make_inputs((92,), (92,), 4, (4, 2), (16, 8), torch.float32, DEVICE, student)
        options = dict(cu_seqlens=cu, max_seqlen=max(lengths), causal=True)
    else:
        q1, k1, q2, k2 = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 8), torch.float32, DEVICE,
                                     (False, False, True, True))
        pattern = torch.rand(1, 1, 3, 3, device=DEVICE) < 0.6
        pattern[..., 1:, 0] = False  # some rows see nothing on side 1: the mean's count is not the numel
        pattern[..., 0, 0] = True
        mask = streamkl.BlockMask.from_dense(pattern, 16)
        options = dict(mask1=mask, mask2=mask)
    if structure == "repeated-input":
        q2 = make_inputs((1, 40), (1, 40), 2, (2, 2), (16, 16), torch.float32, DEVICE)[2]
        q1 = k1 = q2
        k2 = q2.detach() * 0.5
        options = dict(causal=True)

    def loss_fn(q1, k1, q2, k2):
        return 2.0 * streamkl.kl(q1, k1, q2, k2, backend="torch", **options)

    compiled = torch.compile(loss_fn, fullgraph=True, backend="aot_eager")
    out = compiled(q1, k1, q2, k2)
    wanted = [t for t in (q2, k2) if t.requires_grad]
    grads = torch.autograd.grad(out, wanted)
    eager = loss_fn(q1, k1, q2, k2)
    eager_grads = torch.autograd.grad(eager, wanted)
    assert torch.allclose(out, eager, rtol=1e-5, atol=0)
    for a, b in zip(grads, eager_grads):
        assert torch.allclose(a, b, rtol=1e-5, atol=1e-7)
