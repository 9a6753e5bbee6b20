"""Regression tests of silent wrong results and crashes of the front end (issue 30)."""

from __future__ import annotations

import math
import sys
import threading

import numpy as np
import pytest
import torch
from conftest import BACKEND_PARAMS, DEVICE
from helpers import rel_l2

import streamkl
from streamkl import BlockMask
from streamkl.reference import reference_kl

INF = float("inf")


def _inputs(batch, seqlen, heads, dim, grad=False):
    return [torch.randn(batch, seqlen, heads, dim, device=DEVICE).requires_grad_(grad) for _ in range(4)]


def _check_rows(inputs, backend, **kwargs):
    out = streamkl.kl(*inputs, reduction="none", backend=backend, **kwargs)
    ref, _, _ = reference_kl(*[t.detach().double() for t in inputs], **kwargs)
    assert rel_l2(out, ref) < 1e-4


# ----------------------------------------------------------------------------------------- (1)
@pytest.mark.parametrize("source", ["dense-pattern", "compressed-parts"])
def test_block_mask_changed_in_place_is_not_served_stale(source):
    """Changing a mask's tensors in place between calls changes the next call's result."""
    inputs = _inputs(1, 70, 2, 16)
    pattern = torch.rand(1, 1, 5, 5, device=DEVICE) < 0.6
    pattern[..., 0] = True
    if source == "dense-pattern":
        mask = BlockMask.from_dense(pattern, 16)
    else:
        parts = BlockMask.from_dense(pattern.clone(), 16)
        mask = BlockMask(parts.kv_num_blocks.clone(), parts.kv_indices.clone(), 16, 5)
    for _ in range(2):  # the second call is served by every memo
        _check_rows(inputs, "torch", mask1=mask, mask2=mask)
    if source == "dense-pattern":
        pattern.logical_not_()
        pattern[..., 0] = True
    else:
        mask.kv_num_blocks.fill_(1)
        mask.kv_indices.zero_()  # each query block: key block 0 only
    assert torch.equal(BlockMask.from_dense(mask.to_dense(), 16).to_dense(), mask.to_dense())
    _check_rows(inputs, "torch", mask1=mask, mask2=mask)
    if source == "compressed-parts":
        assert mask.to_dense()[..., 1:].sum() == 0


# ----------------------------------------------------------------------------------------- (2)
def test_mean_divisor_is_structural_not_read_from_a_poisoned_call():
    """`mean` with mask1 divides by the rows whose side-1 support is non-empty by structure: a call
    whose input makes a row's scores -inf by value changes nothing for later clean calls."""
    batch, seqlen, heads, dim = 1, 64, 2, 16
    pattern = torch.rand(1, 1, 4, 4, device=DEVICE) < 0.5
    pattern[:, :, 1] = False  # query block 1 sees no key on side 1
    pattern[:, :, 0, 0] = True
    mask1 = BlockMask.from_dense(pattern, 16)
    clean = _inputs(batch, seqlen, heads, dim)
    for t in clean[1::2]:
        t[..., 0] = t[..., 0].abs() + 1  # keys positive along dim 0
    poisoned = [t.clone() for t in clean]
    poisoned[0][0, 3, 0, 0] = -INF  # row 3, head 0: every side-1 score is -inf
    streamkl.kl(*poisoned, mask1=mask1, backend="torch")
    leaves = [t.clone().requires_grad_(True) for t in clean]
    loss = streamkl.kl(*leaves, mask1=mask1, backend="torch")
    loss.backward()
    ref_leaves = [t.double().requires_grad_(True) for t in clean]
    rows, lse1, _ = reference_kl(*ref_leaves, mask1=mask1)
    count = int((lse1 != -INF).sum())
    assert 0 < count < rows.numel()
    ref_loss = rows.sum() / count
    ref_loss.backward()
    assert abs(loss.item() - ref_loss.item()) <= 1e-4 * abs(ref_loss.item())
    for leaf, ref in zip(leaves, ref_leaves):
        assert rel_l2(leaf.grad, ref.grad) < 1e-4


def test_mean_count_varlen_causal_window_and_mask():
    """The structural count over varlen lengths, causality, a window and a per-head side-1 mask."""
    cu = torch.tensor([0, 37, 37, 90], dtype=torch.int32, device=DEVICE)
    cu_k = torch.tensor([0, 20, 31, 101], dtype=torch.int32, device=DEVICE)
    q1, q2 = (torch.randn(95, 2, 16, device=DEVICE) for _ in range(2))
    k1, k2 = (torch.randn(101, 2, 16, device=DEVICE) for _ in range(2))
    pattern = torch.rand(3, 2, 4, 5, device=DEVICE) < 0.4
    mask1 = BlockMask.from_dense(pattern, 16)
    for kwargs in (dict(causal=True), dict(window=(9, 3)), dict(causal=True, window=(30, -1))):
        args = dict(cu_seqlens=cu, cu_seqlens_k=cu_k, max_seqlen=53, max_seqlen_k=70, mask1=mask1, **kwargs)
        loss = streamkl.kl(q1, k1, q2, k2, backend="torch", **args)
        rows, lse1, _ = reference_kl(q1.double(), k1.double(), q2.double(), k2.double(), **args)
        finite = rows[torch.isfinite(rows)]
        expected = finite.sum() / max(int((lse1 != -INF).sum()), 1) if finite.numel() == rows.numel() else None
        if expected is not None:
            assert abs(loss.item() - expected.item()) <= 1e-4 * max(abs(expected.item()), 1e-6)


# ----------------------------------------------------------------------------------------- (3)
@pytest.mark.parametrize("backend", BACKEND_PARAMS)
def test_rows_infinite_by_value_read_nan_and_empty_rows_stay_empty(backend):
    """A row whose allowed scores on a side are all -inf by value: KL NaN, that side's lse -inf (as
    torch.logsumexp), the same on every backend; a structurally empty row stays lse -inf, KL 0;
    other rows are untouched."""
    q1, k1, q2, k2 = (torch.randn(1, 40, 2, 16, device=DEVICE) for _ in range(4))
    k1, k2 = k1[:, :30].clone(), k2[:, :30].clone()  # Nq > Nk, causal: rows 0..9 see no key
    for k in (k1, k2):
        k[..., 0] = k[..., 0].abs() + 1
    q1[0, 15, 0, 0] = -INF
    q2[0, 17, 1, 0] = -INF
    out, lse1, lse2 = streamkl.kl(q1, k1, q2, k2, causal=True, reduction="none", return_lse=True, backend=backend)
    assert math.isnan(out[0, 15, 0]) and lse1[0, 0, 15] == -INF and torch.isfinite(lse2[0, 0, 15])
    assert math.isnan(out[0, 17, 1]) and lse2[0, 1, 17] == -INF and torch.isfinite(lse1[0, 1, 17])
    assert (out[0, :10] == 0).all() and (lse1[0, :, :10] == -INF).all() and (lse2[0, :, :10] == -INF).all()
    keep = torch.ones(40, 2, dtype=torch.bool)
    keep[15, 0] = keep[17, 1] = False
    ref, _, _ = reference_kl(*(t.double() for t in (q1, k1, q2, k2)), causal=True)
    assert rel_l2(out[0][keep], ref[0][keep]) < 1e-4


# ----------------------------------------------------------------------------------------- (4)
flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _flex_mask(mask_mod, seqlen, block):
    return flex.create_block_mask(mask_mod, 1, 1, seqlen, seqlen, device=DEVICE, BLOCK_SIZE=block)


def test_flex_causal_mask_mod_needs_causal():
    """A causal Flex mask_mod is recorded: without causal=True the call refuses, with it the
    result is the causal one."""
    mask = BlockMask.from_flex(_flex_mask(lambda b, h, q, k: q >= k, 200, 64))
    assert mask.element_window == (-1, 0)
    inputs = _inputs(1, 200, 2, 16)
    with pytest.raises(ValueError, match=r"mask1.*causal=True"):
        streamkl.kl(*inputs, mask1=mask, backend="torch")
    _check_rows(inputs, "torch", mask1=mask, causal=True)


def test_flex_sliding_window_mask_mod_needs_its_window():
    mask = BlockMask.from_flex(_flex_mask(lambda b, h, q, k: (q >= k) & (q - k <= 40), 150, 32))
    assert mask.element_window == (40, 0)
    inputs = _inputs(1, 150, 1, 16)
    with pytest.raises(ValueError, match=r"window=\(40, 0\)"):
        streamkl.kl(*inputs, mask2=mask, causal=True, backend="torch")
    _check_rows(inputs, "torch", mask2=mask, window=(40, 0))


def test_flex_other_mask_mod_is_refused_and_block_aligned_one_taken():
    with pytest.raises(ValueError, match="mask_mod"):
        BlockMask.from_flex(_flex_mask(lambda b, h, q, k: (q + k) % 3 == 0, 100, 32))
    mask = BlockMask.from_flex(_flex_mask(lambda b, h, q, k: q // 32 >= k // 32, 100, 32))
    assert mask.element_window is None


def test_flex_block_size_512_is_split_into_256_blocks():
    mask = BlockMask.from_flex(_flex_mask(lambda b, h, q, k: q >= k, 600, 512))
    assert mask.block_size == (256, 256) and mask.shape[-2:] == (3, 3)
    _check_rows(_inputs(1, 600, 1, 16), "torch", mask1=mask, causal=True)


# ----------------------------------------------------------------------------------------- (5)
def test_caches_are_thread_safe():
    """Four threads hitting the front end's memos with more keys than they hold: no KeyError."""
    from streamkl.problem import build_problem
    from streamkl.sparse.schedule import get_schedule

    shapes = [_inputs(1, n, 1, 8) for n in range(20, 60)]  # 40 problems: more than a memo keeps
    errors = []

    def work(offset):
        try:
            for i in range(1500):
                problem = build_problem(*shapes[(i * 7 + offset) % len(shapes)])
                get_schedule(problem, 16, 16)
        except Exception as error:  # noqa: BLE001 - reported below
            errors.append(repr(error))

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: races show within a second
    try:
        threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        sys.setswitchinterval(interval)
    assert not errors, errors[:3]


# ----------------------------------------------------------------------------------------- (6)
def test_window_beyond_int32_is_a_value_error():
    with pytest.raises(ValueError, match="window"):
        streamkl.kl(*_inputs(1, 20, 1, 8), window=(2**70, 0), backend="torch")


def test_scale_beyond_float_range_is_a_value_error():
    with pytest.raises(ValueError, match="scale1"):
        streamkl.kl(*_inputs(1, 20, 1, 8), scale1=10**400, backend="torch")


def test_max_seqlen_above_the_packed_length_is_refused():
    q1, k1, q2, k2 = (torch.randn(60, 1, 8, device=DEVICE) for _ in range(4))
    cu = torch.tensor([0, 30, 60], dtype=torch.int32, device=DEVICE)
    for max_seqlen in (2**20, 10**9):
        with pytest.raises(ValueError, match="max_seqlen.*at most the packed length"):
            streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu, max_seqlen=max_seqlen, backend="torch")
    out = streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu, max_seqlen=60, backend="torch")  # T itself is fine
    assert torch.isfinite(out)


def test_numpy_bools_are_accepted():
    inputs = _inputs(1, 20, 1, 8)
    expected = streamkl.kl(*inputs, causal=True, deterministic=True, return_lse=True, backend="torch")
    got = streamkl.kl(*inputs, causal=np.bool_(True), deterministic=np.bool_(True), return_lse=np.bool_(True),
                      backend="torch")
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b)


def test_zero_heads_blames_q1():
    q1, q2 = torch.randn(1, 20, 0, 8), torch.randn(1, 20, 0, 8)
    k1, k2 = torch.randn(1, 20, 0, 8), torch.randn(1, 20, 0, 8)
    with pytest.raises(ValueError, match="`q1`"):
        streamkl.kl(q1, k1, q2, k2, backend="torch")


def test_meta_tensors_are_refused_clearly():
    inputs = [torch.empty(1, 20, 1, 8, device="meta") for _ in range(4)]
    with pytest.raises(ValueError, match="`q1`.*meta"):
        streamkl.kl(*inputs)
