"""The Triton DSA indexer-loss kernels (SPEC 8) against a float64 materializing reference.

The kernels are called directly through the backend interface (forward / backward of
`streamkl.backends.triton.indexer`) with a local stand-in of the front end's `IndexerProblem`.
On CPU they run under TRITON_INTERPRET=1 at small shapes; the `gpu` tests run realistic shapes.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers import compile_in_subprocess

import streamkl
from streamkl.backends.triton import indexer as triton_indexer
from streamkl.indexer import IndexerProblem

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: (1e-4, 1e-4), torch.float16: (1e-2, 2e-2), torch.bfloat16: (1e-2, 2e-2)}


def indexer_kl_reference(q, k, qi, ki, w, scale=None, causal=True, topk_indices=None):
    """Dense layout (B, N, ...): float64 (loss (B, Nq), head_lse (B, H, Nq), index_lse (B, Nq))."""
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
        idx[idx < 0] = Nk
        sel.scatter_(2, idx, True)
        allowed &= sel[..., :Nk]
    s = s.masked_fill(~allowed[:, None], float("-inf"))
    empty = ~allowed.any(-1)
    head_lse = torch.logsumexp(s, -1)
    p = torch.softmax(s, -1).nan_to_num(0.0)
    t = p.mean(1)
    z = (w[..., None] * torch.einsum("bitd,bjd->bitj", qi, ki).relu()).sum(2)
    z = z.masked_fill(~allowed, float("-inf"))
    index_lse = torch.logsumexp(z, -1)
    log_s = torch.log_softmax(z, -1)
    loss = torch.where(t > 0, t * (torch.log(t) - log_s), 0.0).sum(-1)
    return loss.masked_fill(empty, 0.0), head_lse, index_lse


def rel_l2(actual, expected) -> float:
    actual, expected = actual.double(), expected.double()
    denom = expected.norm().item()
    return (actual - expected).norm().item() / (denom if denom > 0 else 1.0)


def make_problem(q, k, qi, ki, topk_indices, causal, cu_q=None, cu_k=None, lse_given=False):
    varlen = cu_q is not None
    lead = 0 if varlen else 1
    if varlen:
        lens_q, lens_k = (cu_q[1:] - cu_q[:-1]).tolist(), (cu_k[1:] - cu_k[:-1]).tolist()
        batch, seqlen_q, seqlen_k = len(lens_q), max(lens_q + [0]), max(lens_k + [0])
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
    return IndexerProblem(
        batch=batch, seqlen_q=seqlen_q, seqlen_k=seqlen_k, heads=q.shape[lead + 1], heads_k=k.shape[lead + 1],
        dim=q.shape[-1], index_heads=qi.shape[lead + 1], index_dim=qi.shape[-1], scale=q.shape[-1] ** -0.5,
        causal=causal, topk=0 if topk_indices is None else topk_indices.shape[-1], dtype=q.dtype,
        device=q.device, is_varlen=varlen, total_q=q.shape[0] if varlen else 0, total_k=k.shape[0] if varlen else 0,
        cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, lse_given=lse_given,
    )


def random_topk(rows: int, seqlen_k: int, topk: int, device) -> torch.Tensor:
    """Random in-range indices with repeats and -1 padding (positions within the row's sequence)."""
    idx = torch.randint(0, max(seqlen_k, 1), (rows, topk), device=device, dtype=torch.int32)
    idx[:, topk // 2] = idx[:, 0]  # a repeated index counts once
    idx[torch.rand(rows, topk, device=device) < 0.15] = -1
    return idx


def inputs(lead_q, lead_k, heads, heads_k, dim, index_heads, index_dim, dtype):
    shapes = [(*lead_q, heads, dim), (*lead_k, heads_k, dim), (*lead_q, index_heads, index_dim),
              (*lead_k, index_dim), (*lead_q, index_heads)]
    return [torch.randn(s, device=DEVICE).to(dtype) for s in shapes]


def reference_with_grads(q, k, qi, ki, w, causal, topk_indices, grad_rows):
    leaves = [t.detach().double().requires_grad_(True) for t in (qi, ki, w)]
    loss, head_lse, index_lse = indexer_kl_reference(q, k, *leaves, causal=causal, topk_indices=topk_indices)
    torch.autograd.backward(loss, grad_rows.double())
    return loss.detach(), head_lse.detach(), index_lse.detach(), [t.grad for t in leaves]


def check(name, actual, expected, tol):
    assert torch.equal(torch.isneginf(actual), torch.isneginf(expected)), f"{name}: -inf pattern differs"
    assert not torch.isnan(actual).any(), f"{name}: NaN (a row never written?)"
    finite = torch.isfinite(expected)
    err = rel_l2(actual[finite], expected[finite])
    assert err <= tol, f"{name}: relative L2 error {err:.3g} > {tol}"


DENSE_CASES = [
    # (B, Nq, Nk, H, Hk, D, Hi, Di, causal, topk, dtype)
    pytest.param(2, 70, 70, 4, 2, 32, 4, 16, True, 0, torch.float32, id="B2-N70-H4-Hk2-D32-Hi4x16-causal-fp32"),
    pytest.param(1, 150, 150, 2, 2, 16, 2, 16, True, 0, torch.float32, id="B1-N150-H2-D16-Hi2x16-causal-fp32"),
    pytest.param(1, 50, 90, 3, 1, 24, 3, 20, False, 0, torch.float32, id="B1-Nq50-Nk90-H3-Hk1-D24-Hi3x20-fp32"),
    pytest.param(1, 60, 40, 2, 2, 16, 2, 16, True, 0, torch.float32, id="B1-Nq60-Nk40-causal-empty-rows-fp32"),
    pytest.param(2, 80, 80, 4, 2, 32, 4, 16, True, 24, torch.float32, id="B2-N80-H4-Hk2-D32-Hi4x16-causal-top24-fp32"),
    pytest.param(1, 150, 150, 2, 1, 16, 2, 16, False, 40, torch.float32, id="B1-N150-H2-Hk1-D16-top40-fp32"),
    pytest.param(1, 70, 70, 4, 4, 32, 4, 32, True, 0, torch.bfloat16, id="B1-N70-H4-D32-Hi4x32-causal-bf16"),
    # 8 teacher heads: the forward splits the keys (2 splits of 2 key tiles here)
    pytest.param(2, 200, 200, 8, 2, 16, 2, 16, True, 0, torch.float32, id="B2-N200-H8-Hk2-D16-Hi2x16-causal-fp32"),
    pytest.param(1, 230, 250, 8, 8, 16, 2, 16, False, 30, torch.bfloat16,
                 id="B1-Nq230-Nk250-H8-D16-Hi2x16-top30-bf16"),
    pytest.param(1, 70, 70, 2, 2, 48, 2, 16, True, 20, torch.float16, id="B1-N70-H2-D48-Hi2x16-causal-top20-fp16"),
    # the lse pass's whole key tiles (no mask) before its masked ones: bottom-right causal with
    # more keys than rows (row 0 sees keys 0..126 of the first 128: a tile one key short of whole),
    # and a partial last key tile
    pytest.param(1, 100, 226, 2, 1, 16, 2, 16, True, 0, torch.float32, id="B1-Nq100-Nk226-causal-fp32"),
    pytest.param(1, 90, 290, 2, 2, 16, 2, 16, False, 0, torch.float32, id="B1-Nq90-Nk290-fp32"),
    # the top-k lse pass's blocks of heads: two blocks of 16 over GQA groups of 4; three blocks of 4
    pytest.param(1, 40, 40, 32, 8, 16, 2, 16, True, 12, torch.float32, id="B1-N40-H32-Hk8-D16-causal-top12-fp32"),
    pytest.param(1, 40, 60, 12, 3, 16, 2, 8, False, 10, torch.float32, id="B1-Nq40-Nk60-H12-Hk3-D16-top10-fp32"),
]


@pytest.mark.parametrize("B, Nq, Nk, H, Hk, D, Hi, Di, causal, topk, dtype", DENSE_CASES)
def test_dense_layout(B, Nq, Nk, H, Hk, D, Hi, Di, causal, topk, dtype):
    q, k, qi, ki, w = inputs((B, Nq), (B, Nk), H, Hk, D, Hi, Di, dtype)
    top = random_topk(B * Nq, Nk, topk, DEVICE).view(B, Nq, topk) if topk else None
    problem = make_problem(q, k, qi, ki, top, causal)
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    ref_loss, ref_head, ref_index = indexer_kl_reference(q, k, qi, ki, w, causal=causal, topk_indices=top)
    grad_rows = torch.randn(B, Nq, device=DEVICE).masked_fill(torch.isneginf(ref_index), 0.0)
    ref_loss, ref_head, ref_index, ref_grads = reference_with_grads(q, k, qi, ki, w, causal, top, grad_rows)
    tol, grad_tol = TOLERANCE[dtype]
    check("loss", loss, ref_loss, tol)
    check("head_lse", head_lse, ref_head, tol)
    check("index_lse", index_lse, ref_index, tol)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, grad_rows)
    for name, grad, ref, like in zip(("dqi", "dki", "dw"), grads, ref_grads, (qi, ki, w)):
        assert grad.dtype == like.dtype and grad.shape == like.shape, name
        check(name, grad.float(), ref, grad_tol)


def test_local_selection_skips_tiles():
    """A sliding-window selection leaves most (query tile, key tile) pairs unselected: the skipped
    tiles must be exactly the ones no row needs; near the diagonal whole tiles are selected."""
    N, K = 140, 40  # (small: the interpreter runs it in CI)
    q, k, qi, ki, w = inputs((1, N), (1, N), 2, 1, 16, 2, 16, torch.float32)
    rows = torch.arange(N, device=DEVICE)[:, None]
    top = (rows - torch.arange(K, device=DEVICE)[None, :]).clamp(min=-1).to(torch.int32).view(1, N, K)
    problem = make_problem(q, k, qi, ki, top, False)
    cfg = triton_indexer.config(problem, "forward")
    tiles = -(-N // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
    sel = torch.empty((N, K), dtype=torch.int32, device=DEVICE)
    table = torch.zeros(tiles, dtype=torch.uint8, device=DEVICE)
    triton_indexer.select(problem, top, sel, ((0, N), (0, 0)), table, (cfg["BLOCK_M"], cfg["BLOCK_N"]))
    assert 0 < int(table.sum()) < table.numel()
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    ref_loss, ref_head, ref_index = indexer_kl_reference(q, k, qi, ki, w, causal=False, topk_indices=top)
    grad_rows = torch.randn(1, N, device=DEVICE)
    ref_grads = reference_with_grads(q, k, qi, ki, w, False, top, grad_rows)[3]
    check("loss", loss, ref_loss, 1e-4)
    check("head_lse", head_lse, ref_head, 1e-4)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, grad_rows)
    for name, grad, ref in zip(("dqi", "dki", "dw"), grads, ref_grads):
        check(name, grad, ref, 1e-4)


def banded_topk(N: int, device) -> torch.Tensor:
    """[N, 48]: each row's first 16 keys and its last 32 (-1 where before key 0), with a repeat and
    two keys past the row (causal: ignored); rows 3..9 and 128..191 select nothing. Key tiles
    between the bands hold no selected key, and a row's last 32 keys fill whole chunks of slots."""
    rows = torch.arange(N, device=device)[:, None]
    top = torch.cat([torch.arange(16, device=device).expand(N, 16), rows - torch.arange(32, device=device)], 1)
    top = torch.where(top > rows, -1, top)  # the first band of rows 0..14 reaches past them
    top[:, 40] = top[:, 17]
    top[::7, 45] = (rows[::7, 0] + 5).clamp(max=N - 1)
    top[::5, 46] = (rows[::5, 0] + 1).clamp(max=N - 1)
    top[3:10] = -1
    top[128:192] = -1
    return top.to(torch.int32)


def test_banded_selection_with_empty_rows_and_tiles():
    """Rows that select nothing, tiles no row selects, keys past the causal limit, repeats and rows
    with more selected keys in a tile than one load reads: the walk over each row's selection
    visits exactly the selected keys."""
    N, H, causal = 200, 8, True  # 8 heads: the forward splits the keys, the second split starts mid-selection
    q, k, qi, ki, w = inputs((1, N), (1, N), H, 2, 16, 2, 16, torch.float32)
    top = banded_topk(N, DEVICE).view(1, N, -1)
    problem = make_problem(q, k, qi, ki, top, causal)
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    grad_rows = torch.randn(1, N, device=DEVICE)
    ref_loss, ref_head, ref_index, ref_grads = reference_with_grads(q, k, qi, ki, w, causal, top, grad_rows)
    assert torch.isneginf(ref_index[0, 128:192]).all() and (ref_loss[0, 128:192] == 0).all()
    check("loss", loss, ref_loss, 1e-4)
    check("head_lse", head_lse, ref_head, 1e-4)
    check("index_lse", index_lse, ref_index, 1e-4)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, grad_rows)
    for name, grad, ref in zip(("dqi", "dki", "dw"), grads, ref_grads):
        check(name, grad, ref, 1e-4)


def test_given_lse_is_used_as_is():
    """A passed-in teacher lse is returned unchanged and gives the computed lse's loss."""
    q, k, qi, ki, w = inputs((1, 45), (1, 45), 2, 2, 16, 2, 16, torch.float32)
    top = random_topk(45, 45, 12, DEVICE).view(1, 45, 12)
    problem = make_problem(q, k, qi, ki, top, True)
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    given = head_lse.clone()
    loss2, head_lse2, index_lse2 = triton_indexer.forward(problem, q, k, qi, ki, w, given, top)
    assert head_lse2.data_ptr() == given.data_ptr()
    torch.testing.assert_close(loss2, loss)
    torch.testing.assert_close(index_lse2, index_lse)


VARLEN_CASES = [
    pytest.param([0, 37, 70, 5], 6, True, 0, torch.float32, id="lens0-37-70-5-tail6-causal-fp32"),
    pytest.param([20, 0, 53], 3, False, 0, torch.float32, id="lens20-0-53-tail3-fp32"),
    pytest.param([33, 0, 60], 4, True, 16, torch.float32, id="lens33-0-60-tail4-causal-top16-fp32"),
    # the backward's row ranges (128 rows here) cut the third sequence
    pytest.param([90, 0, 75, 60], 5, True, 0, torch.bfloat16, id="lens90-0-75-60-tail5-causal-bf16"),
]


@pytest.mark.parametrize("lens, tail, causal, topk, dtype", VARLEN_CASES)
def test_varlen(lens, tail, causal, topk, dtype):
    H, Hk, D, Hi, Di = 8 if max(lens) > 64 else 4, 2, 16, 3, 16  # 8 heads: the forward splits the keys
    total = sum(lens) + tail
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    q, k, qi, ki, w = inputs((total,), (total,), H, Hk, D, Hi, Di, dtype)
    # rows past cu_seqlens[-1] belong to no sequence: nothing they hold reaches an output
    for t in (q, k, qi, ki, w):
        t[sum(lens):] = float("inf")
    top = None
    if topk:
        top = torch.full((total, topk), -1, dtype=torch.int32, device=DEVICE)
        for s, n in enumerate(lens):
            start = cu[s].item()
            top[start : start + n] = random_topk(n, n, topk, DEVICE)
    problem = make_problem(q, k, qi, ki, top, causal, cu, cu)
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    grad_rows = torch.randn(total, device=DEVICE)
    ref_loss = torch.zeros(total, dtype=torch.float64, device=DEVICE)
    ref_index = torch.full((total,), float("-inf"), dtype=torch.float64, device=DEVICE)
    ref_head = torch.full((H, total), float("-inf"), dtype=torch.float64, device=DEVICE)
    ref_grads = [torch.zeros(t.shape, dtype=torch.float64, device=DEVICE) for t in (qi, ki, w)]
    for s, n in enumerate(lens):
        a = cu[s].item()
        rows = slice(a, a + n)
        part = [t[rows][None] for t in (q, k, qi, ki, w)]
        sel = top[rows][None] if top is not None else None
        _, _, index_part = indexer_kl_reference(*part, causal=causal, topk_indices=sel)
        grad_rows[rows] = grad_rows[rows].masked_fill(torch.isneginf(index_part[0]), 0.0)
        out = reference_with_grads(*part, causal, sel, grad_rows[rows][None])
        ref_loss[rows], ref_head[:, rows], ref_index[rows] = out[0][0], out[1][0], out[2][0]
        for total_grad, part_grad in zip(ref_grads, out[3]):
            total_grad[rows] = part_grad[0]
    grad_rows[sum(lens):] = 0.0
    tol, grad_tol = TOLERANCE[dtype]
    check("loss", loss, ref_loss, tol)
    check("head_lse", head_lse, ref_head, tol)
    check("index_lse", index_lse, ref_index, tol)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, grad_rows)
    for name, grad, ref in zip(("dqi", "dki", "dw"), grads, ref_grads):
        check(name, grad.float(), ref, grad_tol)


@pytest.mark.parametrize("by_sort", [False, True], ids=["kernel", "torch-sort"])
def test_select_sorts_and_marks_tiles(by_sort):
    """`select` on packed sequences (an empty one, rows of no sequence at the end), for two row
    windows that cut sequences: each window row's keys ascending, the unusable ones (-1, past the
    causal limit, rows of no sequence) BIG_INDEX; the table marks exactly the selected tiles. Both
    ways: the sorting kernel, and torch's sort (what serves K past MAX_TOPK)."""
    lens, tail, K, tile = [5, 0, 40, 17], 3, 12, (16, 8)
    cu = torch.tensor([0, 5, 5, 45, 62], dtype=torch.int32, device=DEVICE)
    total = sum(lens) + tail
    q, k, qi, ki, _ = inputs((total,), (total,), 2, 2, 16, 2, 16, torch.float32)
    top = torch.randint(-1, 45, (total, K), dtype=torch.int32, device=DEVICE)
    problem = make_problem(q, k, qi, ki, top, True, cu, cu)
    pair = ((3, 30), (44, total))
    sel = torch.full((total, K), 7, dtype=torch.int32, device=DEVICE)
    table = torch.zeros(4 * 3 * 5, dtype=torch.uint8, device=DEVICE)  # 4 sequences, 3 x 5 tiles of 16 x 8
    if by_sort:
        triton_indexer._select_by_sort(problem, top, sel, pair, table, tile)
    else:
        triton_indexer.select(problem, top, sel, pair, table, tile)
    expected_table = torch.zeros_like(table)
    rows = [*range(3, 30), *range(44, total)]
    for slot, row in enumerate(rows):
        seq = int(torch.searchsorted(cu, torch.tensor(row, dtype=torch.int32, device=DEVICE), right=True)) - 1
        inside = seq < len(lens)
        pos = row - int(cu[min(seq, len(lens) - 1)])
        keys = top[row].tolist()
        usable = [key for key in keys if inside and 0 <= key <= pos]
        want = sorted(usable) + [triton_indexer.BIG_INDEX] * (K - len(usable))
        assert sel[slot].tolist() == want, row
        for key in usable:
            expected_table[(seq * 3 + pos // tile[0]) * 5 + key // tile[1]] = 1
    assert (sel[len(rows):] == 7).all()
    assert torch.equal(table, expected_table)


WINDOW_CASES = [
    # (batch and length, or packed lengths, K, causal, window rows)
    pytest.param((2, 100), None, 24, True, 40, id="B2-N100-top24-causal-window40"),
    pytest.param((1, 160), None, 30, False, 48, id="N160-top30-window48"),
    pytest.param(None, [70, 0, 53], 16, True, 48, id="lens70-0-53-tail3-top16-causal-window48"),
]


@pytest.mark.parametrize("shape, lens, K, causal, window", WINDOW_CASES)
def test_topk_row_windows(shape, lens, K, causal, window):
    """The top-k forward in launches of two row windows, each launch holding its rows' sorted
    selections only: windows that cut query tiles and sequences give the one-window result bit for
    bit (a row's statistics depend on its own row only) and the reference's."""
    H, Hk, D, Hi, Di = 8, 2, 16, 2, 16  # 8 heads: the forward splits the keys
    cu = None
    if lens is None:
        q, k, qi, ki, w = inputs(shape, shape, H, Hk, D, Hi, Di, torch.float32)
        top = random_topk(shape[0] * shape[1], shape[1], K, DEVICE).view(*shape, K)
    else:
        total = sum(lens) + 3
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
        q, k, qi, ki, w = inputs((total,), (total,), H, Hk, D, Hi, Di, torch.float32)
        top = torch.full((total, K), -1, dtype=torch.int32, device=DEVICE)
        for s, n in enumerate(lens):
            top[cu[s] : cu[s] + n] = random_topk(n, n, K, DEVICE)
    problem = make_problem(q, k, qi, ki, top, causal, cu, cu)
    whole = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    rows = top.numel() // K
    assert window < rows <= triton_indexer.window_rows(problem, rows, 1)  # the default: one launch here
    windowed = triton_indexer.forward(problem, q, k, qi, ki, w, None, top, window=window)
    for name, a, b in zip(("loss", "head_lse", "index_lse"), windowed, whole):
        assert torch.equal(a, b), name
    if lens is None:
        ref_loss, ref_head, _ = indexer_kl_reference(q, k, qi, ki, w, causal=causal, topk_indices=top)
        check("loss", windowed[0], ref_loss, 1e-4)
        check("head_lse", windowed[1], ref_head, 1e-4)


@pytest.mark.parametrize("total, size", [(300, 128), (256, 128), (100, 128), (1000, 64)],
                         ids=["T300-r128", "T256-r128", "T100-r128", "T1000-r64"])
def test_backward_row_ranges_cover_rows_once(total, size):
    """The backward's launches: every row in exactly one range, first paired with last."""
    launches = triton_indexer.row_ranges(total, size)
    covered = torch.zeros(total, dtype=torch.int32)
    for pair in launches:
        for lo, hi in pair:
            assert 0 <= lo <= hi <= total and hi - lo <= size
            covered[lo:hi] += 1
    assert torch.equal(covered, torch.ones(total, dtype=torch.int32))
    assert launches[0][0][0] == 0 and (len(launches) == 1 or launches[0][1][1] == total)


def test_nan_input_propagates():
    q, k, qi, ki, w = inputs((1, 40), (1, 40), 2, 2, 16, 2, 16, torch.float32)
    qi[0, 30, 1, 3] = float("nan")
    problem = make_problem(q, k, qi, ki, None, True)
    loss, _, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, None)
    assert torch.isnan(loss[0, 30]) and torch.isnan(index_lse[0, 30])
    assert torch.isfinite(loss[0, :30]).all()


def test_reasons():
    q, k, qi, ki, w = inputs((1, 8), (1, 8), 2, 2, 16, 2, 16, torch.float32)
    problem = make_problem(q, k, qi, ki, None, True)
    wide = IndexerProblem(**{**problem.__dict__, "dim": 320, "index_dim": 256, "index_heads": 65, "topk": 40000})
    reasons = triton_indexer.not_supported_reasons(wide)
    assert any("320" in r for r in reasons) and any("256" in r for r in reasons) and any("65" in r for r in reasons)
    assert not any("40000" in r or "top-k" in r for r in reasons)  # any K (past MAX_TOPK, torch's sort)


# ------------------------------------------------------------------------------------------ shared memory
BUDGETS = {"H100": 232448, "A100": 166912}  # shared memory a block may opt into (bytes)


@pytest.mark.parametrize("budget", list(BUDGETS), ids=list(BUDGETS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_config_fits_shared_memory(budget, dtype):
    """Every supported shape gets tiles and a pipeline depth whose shared memory fits the device;
    16-bit inputs at D <= 128 keep the largest tiles and the measured pipeline depths."""
    for dim in (16, 64, 128, 192, 256):
        for index_dim in (16, 64, 128):
            for n, topk in ((40, 0), (1 << 15, 0), (1 << 15, 2048)):
                q, k, qi, ki, _ = inputs((1, 1), (1, 1), 1, 1, dim, 1, index_dim, dtype)
                problem = IndexerProblem(**{**make_problem(q, k, qi, ki, None, True).__dict__,
                                            "seqlen_q": n, "seqlen_k": n, "topk": topk})
                for kernel in ("lse", "forward", "backward"):
                    cfg = triton_indexer.config(problem, kernel, BUDGETS[budget])
                    need = triton_indexer.shared_need(problem, kernel, cfg["BLOCK_M"], cfg["BLOCK_N"],
                                                      cfg["num_stages"])
                    assert need <= BUDGETS[budget], (kernel, dim, index_dim, n, topk, cfg, need)
                    if budget == "H100" and dtype != torch.float32 and dim <= 128 and n > 128:
                        tiles = {"lse": (64, 128, 4, 3), "forward": (64, 128, 4, 2), "backward": (64, 64, 4, 3)}
                        wanted = dict(zip(("BLOCK_M", "BLOCK_N", "num_warps", "num_stages"), tiles[kernel]))
                        assert cfg == wanted, (kernel, cfg)


@pytest.mark.slow
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_largest_kernels_fit_hopper(kernel):
    """fp32 at D = 256, Di = 128 (the largest tiles per element) compiled for sm_90a: the shared
    memory Triton allocates stays within `shared_need` and the H100's limit; the indexer's relu and
    running maxima keep NaN (PTX max.NaN). In a subprocess: the interpreter cannot compile."""
    code = ("import torch\n"
            "from streamkl.backends.triton import indexer as ix\n"
            f"kernel = ix.compile_for_hopper({kernel!r}, torch.float32, 256, 128)\n"
            "print(kernel.metadata.shared, 'max.NaN.f32' in kernel.asm['ptx'])\n")
    shared, keeps_nan = compile_in_subprocess(code, timeout=600).split()[-2:]
    q, k, qi, ki, _ = inputs((1, 1), (1, 1), 1, 1, 256, 1, 128, torch.float32)
    problem = IndexerProblem(**{**make_problem(q, k, qi, ki, None, True).__dict__, "seqlen_q": 1 << 15,
                                "seqlen_k": 1 << 15, "device": torch.device("cpu")})
    cfg = triton_indexer.config(problem, kernel, BUDGETS["H100"])
    need = triton_indexer.shared_need(problem, kernel, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"])
    assert int(shared) <= min(need, BUDGETS["H100"]), (shared, need, cfg)
    assert keeps_nan == "True"


@pytest.mark.slow
def test_all_kernels_compile_for_hopper_topk_varlen():
    """Every kernel (teacher lse, forward, backward, finishing) compiles for sm_90a at bf16, D = 128,
    Di = 128 with a top-k selection on packed sequences, within the H100's shared memory and, but
    the finishing kernel, within `shared_need`."""
    code = ("import torch\n"
            "from streamkl.backends.triton import indexer as ix\n"
            "for name in ('lse', 'forward', 'backward', 'finish'):\n"
            "    kernel = ix.compile_for_hopper(name, torch.bfloat16, 128, 128, topk=2048, varlen=True)\n"
            "    print(name, kernel.metadata.shared)\n")
    shared = dict(line.split() for line in compile_in_subprocess(code, timeout=900).split("\n") if line)
    assert set(shared) == {"lse", "forward", "backward", "finish"}
    assert all(int(value) <= BUDGETS["H100"] for value in shared.values()), shared
    q, k, qi, ki, _ = inputs((1, 1), (1, 1), 1, 1, 128, 1, 128, torch.bfloat16)
    problem = IndexerProblem(**{**make_problem(q, k, qi, ki, None, True).__dict__, "seqlen_q": 1 << 15,
                                "seqlen_k": 1 << 15, "topk": 2048, "device": torch.device("cpu")})
    for name in ("lse", "forward", "backward"):
        cfg = triton_indexer.config(problem, name, BUDGETS["H100"])
        need = triton_indexer.shared_need(problem, name, cfg["BLOCK_M"], cfg["BLOCK_N"], cfg["num_stages"])
        assert int(shared[name]) <= need, (name, shared[name], need, cfg)


# ------------------------------------------------------------------------------------------ GPU
GPU_CASES = [
    pytest.param(1, 2048, 16, 8, 128, 64, 128, True, 0, torch.bfloat16, id="N2048-H16-Hk8-D128-Hi64x128-causal-bf16"),
    pytest.param(1, 1500, 8, 8, 192, 16, 64, True, 0, torch.bfloat16, id="N1500-H8-D192-Hi16x64-causal-bf16"),
    pytest.param(2, 1000, 8, 2, 128, 32, 128, False, 0, torch.float16, id="B2-N1000-H8-Hk2-D128-Hi32x128-fp16"),
    # backward row ranges of 128 rows, 24 of them: the first-position range [1024, 1152) starts inside
    # a query tile of the second sequence (rows 1000-1063), whose reductions start 24 rows into the
    # spare tile before the workspace's ranges
    pytest.param(3, 1000, 8, 2, 128, 32, 128, True, 0, torch.bfloat16, id="B3-N1000-H8-Hk2-D128-Hi32x128-causal-bf16"),
    pytest.param(1, 1200, 8, 8, 64, 8, 64, True, 0, torch.float32, id="N1200-H8-D64-Hi8x64-causal-fp32"),
    pytest.param(1, 2048, 16, 16, 128, 64, 128, True, 256, torch.bfloat16,
                 id="N2048-H16-D128-Hi64x128-causal-top256-bf16"),
    pytest.param(1, 1100, 8, 1, 256, 16, 128, True, 300, torch.float32,
                 id="N1100-H8-Hk1-D256-Hi16x128-causal-top300-fp32"),
]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("B, N, H, Hk, D, Hi, Di, causal, topk, dtype", GPU_CASES)
def test_gpu_against_reference(B, N, H, Hk, D, Hi, Di, causal, topk, dtype):
    test_dense_layout(B, N, N, H, Hk, D, Hi, Di, causal, topk, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_non_finite_key_stays_in_its_rows():
    """A non-finite indexer key reaches only the rows that see it. N = 560 in backward ranges of 128
    rows: the first launch pairs rows [0, 128) with the short [512, 560), whose last query tile's
    rows past the sequence add 0 * inf = NaN to workspace rows no range finishes; the second
    launch's range [384, 512) takes those rows. Rows before the key's query tile [512, 576) (causal:
    they never see it) must get finite gradients, those of a finite key up to rounding."""
    N, H, D, Hi, Di = 560, 4, 64, 4, 64
    q, k, qi, ki, w = inputs((1, N), (1, N), H, H, D, Hi, Di, torch.bfloat16)
    problem = make_problem(q, k, qi, ki, None, True)
    assert triton_indexer.slab_rows(problem, triton_indexer.config(problem, "backward")["BLOCK_M"]) == 128
    grad_rows = torch.randn(1, N, device=DEVICE)
    results = []
    for bad in (False, True):
        keys = ki.clone()
        if bad:
            keys[0, 550] = float("inf")
        _, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, keys, w, None, None)
        results.append(triton_indexer.backward(problem, q, k, qi, keys, w, None, head_lse, index_lse, grad_rows))
    (dqi, _, dw), (dqi_bad, _, dw_bad) = results
    # G's rows are summed with reductions in no fixed order: equal up to float32 rounding
    assert torch.isfinite(dqi_bad[0, :512]).all() and torch.isfinite(dw_bad[0, :512]).all()
    torch.testing.assert_close(dqi_bad[0, :512], dqi[0, :512], rtol=2e-2, atol=1e-4)
    torch.testing.assert_close(dw_bad[0, :512], dw[0, :512], rtol=2e-2, atol=1e-4)


def _peak_beyond_inputs(q, k, qi, ki, w, top):
    """One causal forward and backward on the GPU: (loss rows, the peak bytes allocated beyond the
    inputs, the gradients' bytes with dki counted as its float32 accumulator)."""
    problem = make_problem(q, k, qi, ki, top, True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, torch.ones_like(loss))
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    return loss, extra, sum(g.numel() * g.element_size() for g in grads) + ki.numel() * 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_topk_memory_is_linear():
    """N = 32K, H = 64, top-2048: the forward and backward allocate at most 16 bytes per (row,
    teacher head) beyond the inputs (the selection included) and the gradients, dki counted as its
    float32 accumulator, plus the forward's smallest windows (a fixed size, so that a launch fills
    the GPU): the rows' sorted selections (8 KiB a row) exist a window of rows at a time."""
    N, H, D, Hi, Di, K = 32768, 64, 128, 64, 128, 2048
    q, k, qi, ki, w = inputs((1, N), (1, N), H, H, D, Hi, Di, torch.bfloat16)
    rows = torch.arange(N, device=DEVICE)[:, None]
    top = (torch.rand(N, K, device=DEVICE) * (rows + 1)).to(torch.int32).view(1, N, K)  # causal positions
    loss, extra, gradient_bytes = _peak_beyond_inputs(q, k, qi, ki, w, top)
    print(f"top-k extra besides gradients: {(extra - gradient_bytes) / (N * H):.2f} B per (row, head)")
    smallest_windows = 2 * triton_indexer.MIN_WINDOW_ROWS * (4 * K + 16 * 16)  # 16 splits at most
    assert extra <= gradient_bytes + 16 * N * H + smallest_windows, (extra - gradient_bytes) / (N * H)
    assert math.isfinite(loss.sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_dense_memory_is_linear():
    """N = 32K, H = 64: the forward and backward allocate at most 16 bytes per (row, teacher head)
    beyond the inputs and the gradients (dki counted as its float32 accumulator)."""
    N, H, D, Hi, Di = 32768, 64, 128, 64, 128
    q, k, qi, ki, w = inputs((1, N), (1, N), H, H, D, Hi, Di, torch.bfloat16)
    loss, extra, gradient_bytes = _peak_beyond_inputs(q, k, qi, ki, w, None)
    assert extra <= gradient_bytes + 16 * N * H, (extra - gradient_bytes) / (N * H)
    assert math.isfinite(loss.sum().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("stage", ["dense", "topk"])
def test_gpu_mean_with_grad_memory_is_linear(stage):
    """The user's call, `indexer_kl(...)` (a mean with grad: two passes, the gradients formed in the
    forward) then `.backward()`, at N = 32K, H = 64: at most 16 bytes per (row, teacher head)
    beyond the inputs and the gradients (dki counted as its float32 accumulator), plus the top-k
    forward's smallest windows: the backward scales the gradients in place, and no zeros are made
    for the op's gradient outputs."""
    N, H, D, Hi, Di, K = 32768, 64, 128, 64, 128, 2048
    q, k, qi, ki, w = inputs((1, N), (1, N), H, H, D, Hi, Di, torch.bfloat16)
    qi, ki, w = (t.requires_grad_() for t in (qi, ki, w))
    top, windows = None, 0
    if stage == "topk":
        rows = torch.arange(N, device=DEVICE)[:, None]
        top = (torch.rand(N, K, device=DEVICE) * (rows + 1)).to(torch.int32).view(1, N, K)
        windows = 2 * triton_indexer.MIN_WINDOW_ROWS * (4 * K + 16 * 16)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    loss = streamkl.indexer_kl(q, k, qi, ki, w, topk_indices=top, backend="triton")
    loss.backward()
    torch.cuda.synchronize()
    extra = torch.cuda.max_memory_allocated() - base
    gradient_bytes = sum(t.numel() * t.element_size() for t in (qi, ki, w)) + ki.numel() * 4
    print(f"{stage}: extra besides gradients {(extra - gradient_bytes) / (N * H):.2f} B per (row, head)")
    assert extra <= gradient_bytes + 16 * N * H + windows, (extra - gradient_bytes) / (N * H)
    assert math.isfinite(loss.item())


@pytest.mark.parametrize("case", ["dense-causal", "dense", "topk-banded", "varlen-topk"])
def test_forward_with_gradients_equals_forward_then_backward(case):
    """The loss and gradients formed in two passes (indexer lse, then the backward's pass summing
    each row's T log T and T z) equal the forward's loss and the backward's gradients for the same
    per-row upstream gradient: rows that select nothing, split keys, packed sequences with a tail."""
    causal, top, cu = case != "dense", None, None
    if case.startswith("varlen"):
        lens, tail = [33, 0, 60], 4
        total = sum(lens) + tail
        cu = torch.tensor([0, 33, 33, 93], dtype=torch.int32, device=DEVICE)
        q, k, qi, ki, w = inputs((total,), (total,), 4, 2, 16, 3, 16, torch.float32)
        top = torch.full((total, 16), -1, dtype=torch.int32, device=DEVICE)
        top[0:33], top[33:93] = random_topk(33, 33, 16, DEVICE), random_topk(60, 60, 16, DEVICE)
        grad_rows = torch.randn(total, device=DEVICE)
    else:
        N = 200
        q, k, qi, ki, w = inputs((1, N), (1, N), 8, 2, 16, 2, 16, torch.float32)  # 8 heads: split keys
        if case == "topk-banded":
            top = banded_topk(N, DEVICE).view(1, N, -1)
        grad_rows = torch.randn(1, N, device=DEVICE)
    problem = make_problem(q, k, qi, ki, top, causal, cu, cu)
    loss, head_lse, index_lse = triton_indexer.forward(problem, q, k, qi, ki, w, None, top)
    grads = triton_indexer.backward(problem, q, k, qi, ki, w, top, head_lse, index_lse, grad_rows)
    *fused, = triton_indexer.forward_with_gradients(problem, q, k, qi, ki, w, None, top, grad_rows)
    for name, actual, expected in zip(("loss", "head_lse", "index_lse", "dqi", "dki", "dw"), fused,
                                      (loss, head_lse, index_lse, *grads)):
        # the gradients are float32 sums whose order the GPU's atomics change from run to run (about
        # 1e-6 of their largest entry here, as far from float64): the same tolerance for both passes
        scale = expected.abs().max().item() if name.startswith("d") else 1.0
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-5 * max(scale, 1.0), equal_nan=True,
                                   msg=lambda message, name=name: f"{name}: {message}")
