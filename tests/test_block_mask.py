"""Per-side block-sparse masks, their constructors and the tile schedule."""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import DEVICE
from helpers import check_against_reference, make_inputs

import streamkl
from streamkl import BlockMask
from streamkl.problem import build_problem
from streamkl.reference import allowed_matrix
from streamkl.sparse.schedule import (
    MIXED,
    OFF2,
    STRUCTURAL,
    build_schedule,
    get_schedule,
    heaviest_first,
    transpose_schedule,
)
from streamkl.varlen import cu_seqlens_from_lengths


def _random_pattern(batch, heads, n_q, n_k, density, keep_first=True):
    pattern = torch.rand(batch, heads, n_q, n_k, device=DEVICE) < density
    if keep_first:
        pattern[..., 0] = True  # every query block keeps one key block
    return pattern


def _inputs(batch, seqlen_q, seqlen_k, heads=4, heads_k=(2, 1), dims=(32, 16), dtype=torch.float32):
    return make_inputs((batch, seqlen_q), (batch, seqlen_k), heads, heads_k, dims, dtype, DEVICE)


@pytest.mark.parametrize(
    "blocks,per_head,causal",
    [((16, 32), True, False), ((32, 16), False, True), ((64, 64), True, True)],
    ids=["b16x32-per-head", "b32x16-shared-causal", "b64x64-per-head-causal"],
)
def test_same_mask_both_sides(blocks, per_head, causal, backend):
    """The teacher conditioned on the student's support: both sides get the student's mask."""
    batch, n_q, n_k = 2, 100, 130
    bq, bk = blocks
    pattern = _random_pattern(batch, 4 if per_head else 1, -(-n_q // bq), -(-n_k // bk), 0.4)
    mask = BlockMask.from_dense(pattern, blocks)
    check_against_reference(_inputs(batch, n_q, n_k), backend, mask1=mask, mask2=mask, causal=causal)


def test_reverse_kl_sparse_side1_dense_side2(backend):
    """Reverse KL: the sparse student is side 1, the dense teacher side 2. Every row is finite."""
    batch, n = 1, 96
    mask = BlockMask.from_dense(_random_pattern(batch, 4, 6, 3, 0.5), (16, 32))
    out = check_against_reference(_inputs(batch, n, n), backend, mask1=mask, causal=True)
    assert torch.isfinite(out).all()


#: backward paths: every gradient (Triton: two kernels), deterministic, and one side's gradients
#: (Triton: one key-major pass with atomic dq)
GRAD_MODES = {
    "all": ((True, True, True, True), False),
    "deterministic": ((True, True, True, True), True),
    "student": ((False, False, True, True), False),
    "teacher": ((True, True, False, False), False),
}


@pytest.mark.parametrize("grads,deterministic", list(GRAD_MODES.values()), ids=list(GRAD_MODES))
def test_different_masks_per_side(grads, deterministic, backend):
    """Side 1 a subset of side 2 with other block sizes: finite; the converse: +inf rows."""
    batch, n = 1, 128
    coarse = _random_pattern(1, 1, 2, 2, 0.6)  # 64x64 blocks
    fine = coarse.repeat_interleave(4, 2).repeat_interleave(2, 3) & _random_pattern(1, 1, 8, 4, 0.7)  # 16x32
    mask_coarse = BlockMask.from_dense(coarse, 64)
    mask_fine = BlockMask.from_dense(fine, (16, 32))
    kwargs = dict(deterministic=deterministic)
    inputs = make_inputs((batch, n), (batch, n), 4, (2, 1), (32, 16), torch.float32, DEVICE, grads)
    check_against_reference(inputs, backend, mask1=mask_fine, mask2=mask_coarse, **kwargs)
    inputs = make_inputs((batch, n), (batch, n), 4, (2, 1), (32, 16), torch.float32, DEVICE, grads)
    out = check_against_reference(inputs, backend, mask1=mask_coarse, mask2=mask_fine, **kwargs)
    assert torch.isposinf(out).any(), "expected uncovered rows"


def test_dense_teacher_sparse_student_is_infinite(backend):
    """A key allowed on side 1 but not side 2 makes the row +inf: the SPEC's true value."""
    batch, n = 1, 64
    pattern = torch.zeros(1, 1, 4, 4, dtype=torch.bool, device=DEVICE)
    pattern[..., 0] = True
    mask = BlockMask.from_dense(pattern, 16)
    inputs = _inputs(batch, n, n)
    out = streamkl.kl(*inputs, mask2=mask, reduction="none", backend=backend)
    assert torch.isposinf(out).all()
    # the side-2 gradient stays finite (the true gradient of the cross-entropy part)
    out.nan_to_num(posinf=0.0).sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in inputs)


def test_fully_masked_query_blocks_give_zero(backend):
    batch, n = 1, 80
    pattern = _random_pattern(1, 2, 5, 5, 0.5)
    pattern[:, :, 2] = False  # rows 32..47 see nothing on either side
    mask = BlockMask.from_dense(pattern, 16)
    inputs = _inputs(batch, n, n, heads=2, heads_k=(1, 2))
    out = check_against_reference(inputs, backend, mask1=mask, mask2=mask)
    assert torch.equal(out[:, 32:48], torch.zeros_like(out[:, 32:48]))
    inputs[0].grad = None
    streamkl.kl(*inputs, mask1=mask, mask2=mask, backend=backend).backward()
    assert torch.equal(inputs[0].grad[:, 32:48], torch.zeros_like(inputs[0].grad[:, 32:48]))


def test_all_masked_mean_is_zero(backend):
    mask = BlockMask.from_dense(torch.zeros(1, 1, 3, 3, dtype=torch.bool, device=DEVICE), 32)
    inputs = _inputs(1, 70, 70)
    loss = streamkl.kl(*inputs, mask1=mask, mask2=mask, backend=backend)
    assert loss.item() == 0.0
    loss.backward()
    assert all(torch.equal(t.grad, torch.zeros_like(t.grad)) for t in inputs)


@pytest.mark.parametrize("grads,deterministic", list(GRAD_MODES.values()), ids=list(GRAD_MODES))
def test_varlen_with_block_masks(grads, deterministic, backend):
    """Blocks count from each sequence's start; the batch dim of the mask counts sequences."""
    lengths = [50, 0, 77, 33]
    cu = cu_seqlens_from_lengths(lengths, DEVICE)
    total = sum(lengths) + 3
    pattern = _random_pattern(len(lengths), 4, 5, 3, 0.5)  # 16x32 blocks over max_seqlen 77
    mask = BlockMask.from_dense(pattern, (16, 32))
    inputs = make_inputs((total,), (total,), 4, (2, 1), (32, 24), torch.float32, DEVICE, grads)
    check_against_reference(
        inputs, backend, cu_seqlens=cu, mask1=mask, mask2=mask, causal=True, window=(40, -1),
        deterministic=deterministic,
    )


def test_topk_masks(backend):
    batch, heads, n, block = 1, 2, 160, 32
    n_blocks = n // block
    scores = torch.randn(batch, heads, n_blocks, n_blocks, device=DEVICE)
    mask = BlockMask.from_topk(scores, 2, block, causal=True, keep_diagonal=True)
    dense = mask.to_dense()
    future = torch.ones(n_blocks, n_blocks, dtype=torch.bool, device=DEVICE).triu(1)
    assert not (dense & future).any(), "a future block was selected"
    assert dense.diagonal(dim1=-2, dim2=-1).all(), "the diagonal block is always kept"
    assert (dense.sum(-1) <= 3).all()
    inputs = _inputs(batch, n, n, heads=heads, heads_k=(1, 2))
    check_against_reference(inputs, backend, mask1=mask, mask2=mask, causal=True)


def test_block_mask_views():
    pattern = torch.tensor([[1, 0, 1], [0, 0, 0]], dtype=torch.bool)
    mask = BlockMask.from_dense(pattern, (16, 64))
    assert mask.shape == (1, 1, 2, 3)
    assert mask.kv_num_blocks.tolist() == [[[2, 0]]]
    assert mask.kv_indices[0, 0, 0, :2].tolist() == [0, 2]
    assert torch.equal(mask.to_dense()[0, 0], pattern)
    assert mask.sparsity() == pytest.approx(100 * 4 / 6)
    rebuilt = BlockMask(mask.kv_num_blocks, mask.kv_indices, (16, 64))
    assert torch.equal(rebuilt.to_dense(), mask.to_dense())
    assert "block_size=(16, 64)" in repr(mask) and "sparsity=66.67%" in repr(mask)


def test_flex_attention_interop():
    """A FlexAttention block mask and our BlockMask from it select the same keys: same dense
    pattern, same element mask, and the same teacher log-normalizer as flex_attention's lse."""
    flex = pytest.importorskip("torch.nn.attention.flex_attention")
    n, bq, bk, heads, dim = 256, 128, 64, 2, 16
    table = torch.rand(heads, n // bq, n // bk) < 0.5
    table[..., 0] = True

    def mask_mod(b, h, q_idx, kv_idx):
        return table[h, q_idx // bq, kv_idx // bk]

    flex_mask = flex.create_block_mask(mask_mod, 1, heads, n, n, device="cpu", BLOCK_SIZE=(bq, bk))
    mask = BlockMask.from_flex(flex_mask)
    assert mask.block_size == (bq, bk)
    assert torch.equal(mask.to_dense()[0], table)
    element = flex.create_mask(mask_mod, 1, heads, n, n, device="cpu")[0]  # [H, N, N]
    q = torch.randn(1, n, heads, dim)
    k = torch.randn(1, n, heads, dim)
    problem = build_problem(q, k, q, k, mask1=mask)
    ours = allowed_matrix(problem, n, n, problem.mask1, 0)
    assert torch.equal(ours.expand(heads, -1, -1), element)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _, flex_lse = flex.flex_attention(
            q.transpose(1, 2), k.transpose(1, 2), k.transpose(1, 2), block_mask=flex_mask, return_lse=True
        )
    _, lse1, _ = streamkl.kl(q, k, q, k, mask1=mask, mask2=mask, return_lse=True, backend="torch")
    assert torch.allclose(lse1, flex_lse, rtol=1e-5, atol=1e-5)


def _visits(mask1, mask2, n, tiles):
    q = torch.randn(1, n, 1, 16, device=DEVICE)
    problem = build_problem(q, q, q, q, mask1=mask1, mask2=mask2)
    return build_schedule(problem, *tiles).visited_tiles(1, 1)


def test_schedule_work_follows_sparsity():
    """At 90% block sparsity on both sides the torch backend visits about a tenth of the tiles."""
    n, block = 2048, 64
    n_blocks = n // block
    pattern = torch.rand(1, 1, n_blocks, n_blocks, device=DEVICE) < 0.1
    mask = BlockMask.from_dense(pattern, block)
    backend = streamkl.dispatch.get_backend("torch")
    q = torch.randn(1, n, 1, 16, device=DEVICE)
    tiles = backend.tile_sizes(build_problem(q, q, q, q, mask1=mask, mask2=mask))
    assert tiles == (block, block)
    dense_visits = n_blocks * n_blocks
    sparse_visits = _visits(mask, mask, n, tiles)
    assert sparse_visits == int(pattern.sum())
    assert 0.07 < sparse_visits / dense_visits < 0.13
    # different masks per side: the union is visited, nothing more
    other = BlockMask.from_dense(torch.rand(1, 1, n_blocks, n_blocks, device=DEVICE) < 0.1, block)
    assert _visits(mask, other, n, tiles) == int((pattern | other.to_dense()).sum())


def test_schedule_pooling_and_partial_flags():
    """Kernel tiles larger and smaller than the mask blocks; partial flags exactly where needed."""
    pattern = torch.tensor([[1, 0, 0, 1], [1, 1, 0, 0]], dtype=torch.bool, device=DEVICE)  # 32x16 blocks
    mask = BlockMask.from_dense(pattern, (32, 16))
    q = torch.randn(1, 64, 1, 16, device=DEVICE)
    problem = build_problem(q, q, q, q, mask1=mask, mask2=mask)
    big = build_schedule(problem, 64, 32)  # one query tile, two key tiles
    assert big.kv_count.tolist() == [[[2]]]
    assert big.kv_partial[0, 0, 0, :2].tolist() == [MIXED, MIXED], "pattern boundaries run through both tiles"
    small = build_schedule(problem, 16, 16)
    expected = pattern.repeat_interleave(2, 0).sum(-1).tolist()
    assert small.kv_count[0, 0].tolist() == expected
    assert (small.kv_partial[0, 0] == 0).all(), "tiles inside one mask block need no element mask"
    causal = build_problem(q, q, q, q, causal=True)
    sched = build_schedule(causal, 16, 16)
    assert sched.kv_count[0, 0].tolist() == [1, 2, 3, 4]
    partial = [sched.kv_partial[0, 0, t, : t + 1].tolist() for t in range(4)]
    assert partial == [[1], [0, 1], [0, 0, 1], [0, 0, 0, 1]], "only diagonal tiles are partial"


def test_schedule_lists_full_tiles_first_with_their_flags():
    """Full tiles first, then partial ones, each ascending; flags say why a tile is partial; the
    key-major view agrees."""
    allowed2 = torch.eye(4, dtype=torch.bool, device=DEVICE)
    allowed2[3, 2] = True
    q = torch.randn(1, 64, 1, 16, device=DEVICE)
    problem = build_problem(q, q, q, q, causal=True, mask2=BlockMask.from_dense(allowed2, 16))
    sched = build_schedule(problem, 16, 16)
    assert sched.kv_count[0, 0].tolist() == [1, 2, 3, 4]
    assert sched.kv_full[0, 0].tolist() == [0, 0, 0, 1]
    assert sched.kv_index[0, 0, 3].tolist() == [2, 0, 1, 3]
    assert sched.kv_partial[0, 0, 3].tolist() == [0, OFF2, OFF2, STRUCTURAL]
    assert sched.kv_partial[0, 0, 1, :2].tolist() == [OFF2, STRUCTURAL]
    keys = transpose_schedule(sched)
    assert keys.q_count[0, 0].tolist() == [4, 3, 2, 1]
    assert keys.q_full[0, 0].tolist() == [0, 0, 1, 0]
    assert keys.q_index[0, 0, 2, :2].tolist() == [3, 2]
    assert keys.q_partial[0, 0, 2, :2].tolist() == [0, STRUCTURAL]
    assert keys.q_partial[0, 0, 0].tolist() == [STRUCTURAL, OFF2, OFF2, OFF2]


def test_schedule_is_cached_per_mask_and_shape():
    mask = BlockMask.from_dense(torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE), 32)
    q = torch.randn(1, 64, 1, 16, device=DEVICE)
    problem = build_problem(q, q, q, q, mask1=mask)
    first = get_schedule(problem, 32, 32)
    assert get_schedule(build_problem(q, q, q, q, mask1=mask), 32, 32) is first
    assert get_schedule(problem, 16, 32) is not first
    other = BlockMask.from_dense(torch.ones(1, 1, 2, 2, dtype=torch.bool, device=DEVICE), 32)
    assert get_schedule(build_problem(q, q, q, q, mask1=other), 32, 32) is not first


@pytest.mark.parametrize("shape", [(1, 1), (2, 4)])
def test_heaviest_first_orders_each_heads_tiles_by_visits(shape):
    """The program table of the Gluon backward (`HEAVY_FIRST`): a permutation of one launch's ids
    that keeps each (sequence, head) block in place and lists its tiles by visit count, most first,
    ties in launch order; for a head chunk with a GQA step, and with the forward's reversed ids."""
    g = torch.Generator().manual_seed(3)
    seqs, heads_c = shape
    counts = torch.randint(0, 5, (seqs, heads_c, 6), generator=g, dtype=torch.int32).to(DEVICE)
    batch, heads, programs = 2, 4, 6
    for head_lo, step, reverse in ((0, 1, False), (0, 1, True), (2, 2, False), (1, 2, False)):
        n_heads = (heads - head_lo) // step if heads_c > 1 else 2
        order = heaviest_first(counts, batch, head_lo, n_heads, step, programs, reversed_ids=reverse)
        assert order.dtype == torch.int32
        order = order.cpu().long()
        assert sorted(order.tolist()) == list(range(batch * n_heads * programs))
        expanded = counts.cpu().expand(batch, max(heads_c, head_lo + (n_heads - 1) * step + 1), 6)
        for block, ids in enumerate(order.view(batch * n_heads, programs)):
            seq, j = divmod(block, n_heads)
            assert ((ids // programs) == block).all()  # the block's own ids, in the block's place
            tiles = ids % programs
            if reverse:
                tiles = programs - 1 - tiles
            visits = expanded[seq, head_lo + j * step, tiles]
            assert (visits[:-1] >= visits[1:]).all()
            ties = visits[:-1] == visits[1:]
            assert (ids[:-1][ties] < ids[1:][ties]).all()  # stable: launch order among equals
        again = heaviest_first(counts, batch, head_lo, n_heads, step, programs, reversed_ids=reverse)
        assert again.data_ptr() == heaviest_first(counts, batch, head_lo, n_heads, step, programs,
                                                  reversed_ids=reverse).data_ptr()  # kept


def test_mean_count_follows_heads_and_causality():
    """A side-1 block mask's mean divides by the rows with a non-empty side-1 support, counted from
    the structure per call: calls whose head count differs under a mask broadcast over heads, and
    causal or not, each divide by their own count."""
    pattern = _random_pattern(1, 1, 4, 4, 0.5)
    pattern[:, :, 1] = False  # query block 1 sees no key on side 1
    mask1 = BlockMask.from_dense(pattern, 16)
    for causal in (False, True):
        for heads in (2, 4, 2):
            inputs = _inputs(1, 64, 64, heads=heads, heads_k=(1, 1))
            rows, lse1, _ = streamkl.kl(*inputs, mask1=mask1, causal=causal, reduction="none", return_lse=True,
                                        backend="torch")
            count = int((lse1 != float("-inf")).sum())
            assert 0 < count < rows.numel()
            for _ in range(2):
                loss = streamkl.kl(*inputs, mask1=mask1, causal=causal, backend="torch")
                torch.testing.assert_close(loss, rows.sum() / count)
