"""The Triton forward's split-K path under the interpreter: each query tile's key-tile list cut into
2 or 3 slices whose raw statistics `combine_splits` merges. `select.split_count` chooses one slice
off the GPU, so these tests build the forward's configuration with the split count set and call
`forward.plan` / `forward.kl_forward` with it, as `TritonBackend.forward` does with its selection;
the outputs (KL, lse1, lse2, E) are compared with the float64 reference (SPEC section 7)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from helpers import TOLERANCE, check_infinities, make_inputs, rel_l2

from streamkl.backends.triton import forward, select
from streamkl.dispatch import get_backend
from streamkl.problem import build_problem
from streamkl.reference import reference_kl
from streamkl.sparse.block_mask import BlockMask
from streamkl.sparse.schedule import get_schedule
from streamkl.varlen import cu_seqlens_from_lengths

pytestmark = pytest.mark.skipif(get_backend("triton").environment_reasons() != [], reason="Triton unavailable")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEADS, HEADS_K, DIMS = 2, (1, 2), (16, 8)  # GQA on side 1, D1 != D2
BLOCK = 64  # the mask blocks: the interpreter's schedule tiles stay 64 x 64


def _dense_case(causal: bool):
    # Nk = 350: six key tiles of 64, the last one partial
    inputs = make_inputs((1, 100), (1, 350), HEADS, HEADS_K, DIMS, torch.float32, DEVICE, (False,) * 4)
    return inputs, dict(causal=causal)


def _mask_case(side: int):
    inputs = make_inputs((1, 100), (1, 350), HEADS, HEADS_K, DIMS, torch.float32, DEVICE, (False,) * 4)
    if side == 1:  # random holes, and query block 1 of head 0 with no key at all: empty rows (KL 0)
        pattern = torch.rand(1, HEADS, 2, 6, device=DEVICE) < 0.6
        pattern[0, 0, 1] = False
    else:  # one block missing on side 2: the rows of query block 1, head 0 are uncovered (KL +inf)
        pattern = torch.ones(1, HEADS, 2, 6, dtype=torch.bool, device=DEVICE)
        pattern[0, 0, 1, 4] = False
    return inputs, {f"mask{side}": BlockMask.from_dense(pattern, BLOCK)}


def _varlen_case():
    # three sequences, the middle one empty on both sides, and 5 rows past cu_seqlens[-1]
    cu_q = cu_seqlens_from_lengths([90, 0, 70], DEVICE)
    cu_k = cu_seqlens_from_lengths([330, 0, 200], DEVICE)
    inputs = make_inputs((165,), (530,), HEADS, HEADS_K, DIMS, torch.float32, DEVICE, (False,) * 4)
    return inputs, dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, causal=True)


CASES = {
    "B1-Nq100-Nk350-H2-Hk1x2-D16x8": lambda: _dense_case(False),
    "B1-Nq100-Nk350-H2-Hk1x2-D16x8-causal": lambda: _dense_case(True),
    "B1-Nq100-Nk350-H2-Hk1x2-D16x8-mask1": lambda: _mask_case(1),
    "B1-Nq100-Nk350-H2-Hk1x2-D16x8-mask2": lambda: _mask_case(2),
    "varlen-Lq90x0x70-Lk330x0x200-T165-H2-Hk1x2-D16x8-causal": _varlen_case,
}


def _split_forward(inputs, splits: int, **kwargs):
    """(kl_rows, lse1, lse2, expect) of the portable forward with its key lists cut into `splits`
    slices, and the launch grid."""
    problem = build_problem(*inputs, **kwargs)
    schedule = get_schedule(problem, *get_backend("triton").tile_sizes(problem))
    selected = select.select_forward(problem, schedule.block_q, schedule.block_k)
    assert not selected.gluon
    choice = dataclasses.replace(selected, splits=splits)
    launch_plan = forward.plan(problem, choice, schedule)
    with torch.no_grad():
        return forward.kl_forward(problem, choice, launch_plan, *inputs), launch_plan.grid


@pytest.mark.parametrize("splits", [2, 3], ids=lambda s: f"splits{s}")
@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_split_k_forward_matches_reference(case, splits, monkeypatch):
    inputs, kwargs = CASES[case]()
    merged = []
    original = forward.combine_splits

    def spy(problem, parts, *outputs):
        merged.append(parts.clone())
        return original(problem, parts, *outputs)

    monkeypatch.setattr(forward, "combine_splits", spy)
    (kl_rows, lse1, lse2, expect), grid = _split_forward(inputs, splits, **kwargs)

    # the split path ran: a second grid axis of `splits` programs, one merge of that many slices,
    # each slice holding side-1 keys of some row (no slice left without tiles)
    assert grid[1:] == (splits,)
    assert len(merged) == 1 and merged[0].shape[:2] == (6, splits)
    m1_per_slice = merged[0][0].reshape(splits, -1)
    assert bool((m1_per_slice > float("-inf")).any(dim=1).all()), "a slice streamed no side-1 key"

    ref, ref_lse1, ref_lse2 = reference_kl(*(t.double() for t in inputs), **kwargs)
    tolerance = TOLERANCE[torch.float32][0]
    for name, actual, expected in (("kl", kl_rows, ref), ("lse1", lse1, ref_lse1), ("lse2", lse2, ref_lse2)):
        assert actual.dtype == torch.float32 and actual.shape == expected.shape, name
        check_infinities(name, actual, expected)
        finite = torch.isfinite(expected)
        assert finite.any(), name
        err = rel_l2(actual[finite], expected[finite])
        assert err <= tolerance, f"{name}: relative L2 error {err:.3g} > {tolerance}"

    # E = KL + lse1 - lse2 where the row is covered and non-empty; 0 where side 1 is empty
    ref_rows = ref.transpose(0, 1) if "cu_seqlens" in kwargs else ref.transpose(1, 2)  # as lse: (.., H, N)
    ref_expect = ref_rows + ref_lse1 - ref_lse2
    assert not torch.isnan(expect).any()
    empty = torch.isneginf(ref_lse1)
    assert torch.equal(expect[empty], torch.zeros_like(expect[empty]))
    finite = torch.isfinite(ref_expect)
    err = rel_l2(expect[finite], ref_expect[finite])
    assert err <= tolerance, f"E: relative L2 error {err:.3g} > {tolerance}"
