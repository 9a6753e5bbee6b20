"""streamkl.distributed against single-process streamkl.kl on the whole sequence.

Each world size runs in one group of spawned gloo processes (CPU, torch backend): every rank
builds the same full inputs, runs `streamkl.kl` on the whole sequence, runs the context-parallel
call on its shard, and compares its rows, statistics and gradients with its slice of the whole.
The processes run every case once and report per case; each test reads its case's report.
"""

from __future__ import annotations

import datetime
import json
import os
import traceback
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import streamkl
from streamkl import distributed as cp
from streamkl.autograd import run_forward
from streamkl.dispatch import get_backend
from streamkl.distributed.merge import RowStats
from streamkl.problem import build_problem
from streamkl.reference import reference_kl

WORLDS = (2, 3)
BATCH, HEADS = 2, 4
TOLERANCE = 2e-5  # relative L2 against the single-process float32 result (summation order differs)
JOIN_TIMEOUT_S = 180


# ------------------------------------------------------------------------------------ comparisons
def _same_specials(name: str, actual: torch.Tensor, expected: torch.Tensor) -> None:
    for what, test in (("NaN", torch.isnan), ("+inf", torch.isposinf), ("-inf", torch.isneginf)):
        assert torch.equal(test(actual), test(expected)), f"{name}: {what} pattern differs"


def _close(name: str, actual: torch.Tensor, expected: torch.Tensor, tolerance: float = TOLERANCE) -> None:
    """Same shape and dtype, same NaN / inf pattern, relative L2 error of the finite values."""
    assert actual.shape == expected.shape, f"{name}: shape {tuple(actual.shape)}, expected {tuple(expected.shape)}"
    assert actual.dtype == expected.dtype, f"{name}: dtype {actual.dtype}, expected {expected.dtype}"
    _same_specials(name, actual, expected)
    finite = torch.isfinite(expected)
    a, e = actual[finite].double(), expected[finite].double()
    denom = e.norm().item()
    err = (a - e).norm().item() / (denom if denom > 0 else 1.0)
    assert err <= tolerance, f"{name}: relative L2 error {err:.3g} > {tolerance}"


@dataclass(frozen=True)
class Setting:
    causal: bool = False
    reduction: str = "none"
    seqlen: int | None = None  # None: 13 (dense: uneven shards), 2P * 5 (causal)
    heads_k: tuple[int, int] = (2, 1)
    dims: tuple[int, int] = (16, 8)
    requires: tuple[bool, bool, bool, bool] = (True, True, True, True)
    balanced_layout: bool | None = None  # None: the layout `causal` needs
    dtype: torch.dtype = torch.float32


def _inputs(world: int, setting: Setting, edit=None) -> list[torch.Tensor]:
    """The same full inputs on every rank (seeded by the caller), edited before they require grad."""
    seqlen = setting.seqlen or (2 * world * 5 if setting.causal else 13)
    (h1k, h2k), (d1, d2) = setting.heads_k, setting.dims
    shapes = [(BATCH, seqlen, HEADS, d1), (BATCH, seqlen, h1k, d1), (BATCH, seqlen, HEADS, d2),
              (BATCH, seqlen, h2k, d2)]
    full = [torch.randn(shape).to(_STATE["device"], setting.dtype) for shape in shapes]
    if edit is not None:
        edit(full)
    return [t.requires_grad_(r) for t, r in zip(full, setting.requires)]


def _compare(group, world: int, setting: Setting, edit=None) -> None:
    full = _inputs(world, setting, edit)
    layout = setting.causal if setting.balanced_layout is None else setting.balanced_layout
    upstream = torch.randn(full[0].shape[:2] + (HEADS,)).to(_STATE["device"])
    wanted = [i for i, t in enumerate(full) if t.requires_grad]

    out_ref, lse1_ref, lse2_ref = streamkl.kl(*full, causal=setting.causal, reduction=setting.reduction,
                                              return_lse=True, backend=_STATE["backend"])
    loss_ref = (out_ref * upstream).sum() if setting.reduction == "none" else out_ref
    grads_ref = torch.autograd.grad(loss_ref, [full[i] for i in wanted]) if wanted else ()

    shards = [cp.shard(t.detach(), group, causal=layout).requires_grad_(t.requires_grad) for t in full]
    out, lse1, lse2 = cp.kl(*shards, group=group, causal=setting.causal, reduction=setting.reduction,
                            return_lse=True, backend=_STATE["backend"])
    loss = (out * cp.shard(upstream, group, causal=layout)).sum() if setting.reduction == "none" else out
    grads = torch.autograd.grad(loss, [shards[i] for i in wanted]) if wanted else ()

    expected_out = out_ref if setting.reduction != "none" else cp.shard(out_ref, group, causal=layout)
    _close("kl", out, expected_out.detach())
    _close("lse1", lse1, cp.shard(lse1_ref, group, dim=2, causal=layout))
    _close("lse2", lse2, cp.shard(lse2_ref, group, dim=2, causal=layout))
    for i, grad, grad_ref in zip(wanted, grads, grads_ref):
        _close(("dq1", "dk1", "dq2", "dk2")[i], grad, cp.shard(grad_ref, group, causal=layout))


# ------------------------------------------------------------------------------------------ cases
def _settings() -> dict:
    cases = {}
    for causal in (False, True):
        for reduction in ("none", "sum", "mean"):
            cases[f"{'causal' if causal else 'dense'}-{reduction}-H4-Hk2x1-D16x8"] = Setting(causal, reduction)
    cases["dense-mean-balanced-layout"] = Setting(False, "mean", seqlen=24, balanced_layout=True)
    cases["dense-mean-MHA-D8x8-long"] = Setting(False, "mean", seqlen=61, heads_k=(4, 4), dims=(8, 8))
    cases["causal-sum-MQA-D8x16"] = Setting(True, "sum", heads_k=(1, 1), dims=(8, 16))
    cases["dense-mean-a-rank-without-tokens"] = Setting(False, "mean", seqlen=2)  # P3: shards 1, 1, 0
    cases["dense-none-teacher-detached"] = Setting(False, "none", requires=(False, False, True, True))
    cases["causal-mean-queries-only"] = Setting(True, "mean", requires=(True, False, True, False))
    cases["causal-none-keys-only"] = Setting(True, "none", requires=(False, True, False, True))
    cases["causal-none-no-grad"] = Setting(True, "none", requires=(False, False, False, False))
    return {name: (lambda group, world, s=setting: _compare(group, world, s)) for name, setting in cases.items()}


def _positive_component(full, side: int) -> None:
    """Component 0 of side `side`'s queries and keys made positive: one -inf in a key (or query)
    then makes that key's (or row's) scores -inf by value."""
    q, k = full[2 * side], full[2 * side + 1]
    q[..., 0] = q[..., 0].abs() + 0.1
    k[..., 0] = k[..., 0].abs() + 0.1


def _teacher_row_neginf(full) -> None:  # one row's teacher scores all -inf: KL NaN, lse1 -inf
    _positive_component(full, 0)
    full[0][1, 5, 2, 0] = -float("inf")


def _teacher_key_neginf(full) -> None:
    """One key's teacher score -inf: NaN on the rows that see it. (Which gradient entries turn NaN
    then depends on the tiling, 0 * inf in masked products, and is not compared.)"""
    _positive_component(full, 0)
    full[1][0, -3, 1, 0] = -float("inf")


def _student_shard_neginf(full) -> None:  # a whole shard's student scores -inf for one head: KL +inf
    _positive_component(full, 1)
    full[3][0, :7, 0, 0] = -float("inf")  # the first shard of the contiguous layout (7 of 13, 5 of 13)
    full[3][0, :4, 0, 0] = -float("inf")


def _near_identical(group, world: int) -> None:
    """q2 = q1 + 1e-3 noise, same keys: each row's KL within 1e-5 of the float64 reference (SPEC 7)."""
    setting = Setting(True, "none", heads_k=(2, 2), dims=(16, 16), requires=(False,) * 4)
    full = _inputs(world, setting)
    full[2], full[3] = full[0] + 1e-3 * torch.randn_like(full[0]), full[1].clone()
    ref = reference_kl(*(t.double() for t in full), causal=True)[0]
    out = cp.kl(*(cp.shard(t, group, causal=True) for t in full), group=group, causal=True, reduction="none",
                backend=_STATE["backend"])
    err = (out.double() - cp.shard(ref, group, causal=True)).abs().max().item()
    assert err <= 1e-5, f"absolute error {err:.3g} > 1e-5"


def _bfloat16_against_reference(group, world: int) -> None:
    """bfloat16 inputs: SPEC 7's tolerances against the float64 reference, forward and gradients."""
    setting = Setting(True, "none", dtype=torch.bfloat16)
    full = _inputs(world, setting)
    leaves = [t.detach().double().requires_grad_() for t in full]
    ref = reference_kl(*leaves, causal=True)[0]
    upstream = torch.randn(ref.shape, dtype=torch.float64).to(_STATE["device"])
    ref_grads = torch.autograd.grad((ref * upstream).sum(), leaves)
    shards = [cp.shard(t.detach(), group, causal=True).requires_grad_() for t in full]
    out = cp.kl(*shards, group=group, causal=True, reduction="none", backend=_STATE["backend"])
    grads = torch.autograd.grad((out * cp.shard(upstream.float(), group, causal=True)).sum(), shards)
    _close("kl", out.double(), cp.shard(ref.detach(), group, causal=True), 1e-2)
    for name, grad, ref_grad in zip(("dq1", "dk1", "dq2", "dk2"), grads, ref_grads):
        assert grad.dtype == torch.bfloat16
        _close(name, grad.double(), cp.shard(ref_grad, group, causal=True), 2e-2)


def _deterministic(group, world: int) -> None:
    setting = Setting(True, "mean")
    shards = [cp.shard(t.detach(), group, causal=True).requires_grad_() for t in _inputs(world, setting)]
    runs = []
    for _ in range(2):
        out = cp.kl(*shards, group=group, causal=True, deterministic=True, backend=_STATE["backend"])
        runs.append((out, *torch.autograd.grad(out, shards)))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _no_second_derivative(group, world: int) -> None:
    """create_graph=True gives the gradients; differentiating them again raises, never drops terms."""
    shards = [cp.shard(t.detach(), group).requires_grad_() for t in _inputs(world, Setting(False, "sum"))]
    out = cp.kl(*shards, group=group, reduction="sum", backend=_STATE["backend"])
    grads = torch.autograd.grad(out, shards, create_graph=True)
    _raises(RuntimeError, "no second derivative", lambda: torch.autograd.grad(grads[0].sum(), shards[0]))


def _world_of_one(group, world: int) -> None:
    """A group of one rank is streamkl.kl, bit for bit (the merge starts from the rank's own shard)."""
    alone = _STATE["alone"]
    setting = Setting(True, "none")
    full = _inputs(world, setting)
    options = dict(causal=True, reduction="none", return_lse=True, backend=_STATE["backend"])
    out, lse1, lse2 = cp.kl(*full, group=alone, **options)
    out_ref, lse1_ref, lse2_ref = streamkl.kl(*full, **options)
    assert torch.equal(out, out_ref) and torch.equal(lse1, lse1_ref) and torch.equal(lse2, lse2_ref)
    grads = torch.autograd.grad((out * out.detach()).sum(), full)
    grads_ref = torch.autograd.grad((out_ref * out_ref.detach()).sum(), full)
    for name, grad, grad_ref in zip(("dq1", "dk1", "dq2", "dk2"), grads, grads_ref):
        _close(name, grad, grad_ref, 1e-6)


def _subgroup(group, world: int) -> None:
    """A group of the last two ranks: peers are global ranks; the other ranks are not involved."""
    if world >= 2 and dist.get_rank() in _STATE["last_two_ranks"]:
        _compare(_STATE["last_two"], 2, Setting(True, "mean"))


def _shard_gather_round_trip(group, world: int) -> None:
    for causal, seqlen in ((False, 11), (True, 4 * world)):
        x = torch.randn(BATCH, seqlen, 3, 5).to(_STATE["device"])
        piece = cp.shard(x, group, causal=causal)
        assert torch.equal(cp.gather(piece, group, causal=causal), x)
        positions = cp.shard_indices(seqlen, group, causal=causal, device=_STATE["device"])
        assert torch.equal(piece, x[:, positions])
        lse = torch.randn(BATCH, 3, seqlen).to(_STATE["device"])
        assert torch.equal(cp.gather(cp.shard(lse, group, dim=2, causal=causal), group, dim=2, causal=causal), lse)


def _raises(error: type[Exception], match: str, call) -> None:
    with pytest.raises(error, match=match):
        call()


def _refusals(group, world: int) -> None:
    """Every refusal raises on every rank, and the group is still usable afterwards."""
    rank = dist.get_rank(group)
    full = _inputs(world, Setting(True, "mean"))
    shards = [cp.shard(t.detach(), group, causal=True) for t in full]
    call = lambda *ts, **kw: cp.kl(*ts, group=group, **{"backend": "torch", **kw})  # noqa: E731
    # options context parallel does not take: before any communication
    _raises(ValueError, "window", lambda: call(*shards, window=(4, 0)))
    cu_seqlens = torch.zeros(2, dtype=torch.int32, device=_STATE["device"])
    _raises(ValueError, "cu_seqlens", lambda: call(*shards, cu_seqlens=cu_seqlens))
    mask = streamkl.BlockMask.from_dense(torch.ones(1, 1, 1, 1, dtype=torch.bool), block_size=(16, 16))
    _raises(ValueError, "block masks", lambda: call(*shards, mask2=mask))
    _raises(ValueError, "reduction", lambda: call(*shards, reduction="batchmean"))
    _raises(TypeError, "group", lambda: cp.kl(*shards, group="world"))
    _raises(ValueError, "backend", lambda: call(*shards, backend="flash"))
    odd_sequence = torch.randn(1, 2 * world + 1, 1, 4, device=_STATE["device"])
    _raises(ValueError, "divisible by 2", lambda: cp.shard(odd_sequence, group, causal=True))
    odd = [t[:, :5] for t in shards]
    _raises(ValueError, "two chunks", lambda: call(*odd, causal=True))
    if world >= 2:
        # one rank's own inputs wrong: it names the argument, the others name the rank
        bad = list(shards)
        if rank == 1:
            bad[1] = bad[1][..., :8].contiguous()  # k1's head dim no longer q1's
        _raises(ValueError, "k1" if rank == 1 else r"rank\(s\) \[1\]", lambda: call(*bad, causal=True))
        # valid on each rank, but the ranks disagree
        other = list(shards)
        if rank == 1:
            other = [t[..., :8].contiguous() if i < 2 else t for i, t in enumerate(shards)]
        _raises(ValueError, "same dim1", lambda: call(*other, causal=True))
        _raises(ValueError, "same causal", lambda: call(*shards, causal=rank == 0))
        uneven = [t[:, : 4 if rank == 0 else 6] for t in shards]
        _raises(ValueError, "one shard length", lambda: call(*uneven, causal=True))
    # the group still works
    _compare(group, world, Setting(False, "sum"))


def _edge(edit, setting: Setting):
    return lambda group, world: _compare(group, world, setting, edit)


CASES = {
    **_settings(),
    "edge-teacher-row-all-neginf": _edge(_teacher_row_neginf, Setting(False, "none")),
    "edge-teacher-key-neginf-causal": _edge(_teacher_key_neginf, Setting(True, "none", requires=(False,) * 4)),
    "edge-student-shard-neginf": _edge(_student_shard_neginf, Setting(False, "none", requires=(False,) * 4)),
    "near-identical-abs-1e-5": _near_identical,
    "bfloat16-vs-reference": _bfloat16_against_reference,
    "deterministic-bitwise": _deterministic,
    "world-of-one-bitwise": _world_of_one,
    "no-second-derivative": _no_second_derivative,
    "subgroup-of-two": _subgroup,
    "shard-gather-round-trip": _shard_gather_round_trip,
    "refusals": _refusals,
}

#: set in each process by `_worker`: where the inputs live, which streamkl backend runs, extra groups
_STATE: dict = {"device": "cpu", "backend": "torch"}
#: the cases of the NCCL run (each new shape costs Triton compilations there)
GPU_CASES = ("dense-mean-H4-Hk2x1-D16x8", "causal-none-H4-Hk2x1-D16x8", "causal-sum-MQA-D8x16",
             "dense-none-teacher-detached", "bfloat16-vs-reference", "world-of-one-bitwise", "subgroup-of-two",
             "shard-gather-round-trip", "refusals")


def _worker(rank: int, world: int, init_file: str, report_dir: str, communication: str = "gloo") -> None:
    torch.set_num_threads(1)
    os.environ["STREAMKL_POISON_OUTPUTS"] = "1"  # fresh outputs start as NaN: a row never written fails
    names = list(CASES)
    if communication == "nccl":
        torch.cuda.set_device(rank)
        _STATE.update(device=f"cuda:{rank}", backend=None)  # backend None: auto, the fastest here
        names = list(GPU_CASES)
    dist.init_process_group(communication, init_method=f"file://{init_file}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=60))
    singles = [dist.new_group([r]) for r in range(world)]  # every rank takes part in creating each group
    _STATE["alone"] = singles[rank]
    if world >= 2:
        _STATE["last_two_ranks"] = (world - 2, world - 1)
        _STATE["last_two"] = dist.new_group(list(_STATE["last_two_ranks"]))
    report = {}
    path = Path(report_dir) / f"rank{rank}.json"
    for name in names:
        torch.manual_seed(1000 * world + list(CASES).index(name))  # the same inputs on every rank
        try:
            CASES[name](dist.group.WORLD, world)
            report[name] = None
        except Exception:  # reported per case; the group stays in step (refusals raise on every rank)
            report[name] = traceback.format_exc()
        path.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def _spawn(directory: Path, world: int, communication: str, names) -> dict:
    """{case: [each rank's error or None]} of one group of `world` processes."""
    context = mp.get_context("spawn")
    processes = [context.Process(target=_worker, args=(rank, world, str(directory / "store"), str(directory),
                                                       communication)) for rank in range(world)]
    for process in processes:
        process.start()
    for process in processes:
        process.join(JOIN_TIMEOUT_S)
    for process in processes:
        if process.is_alive():
            process.kill()
    by_rank = []
    for rank in range(world):
        path = directory / f"rank{rank}.json"
        by_rank.append(json.loads(path.read_text()) if path.exists() else {})
    return {name: [r.get(name, "no report (the process died or hung)") for r in by_rank] for name in names}


@pytest.fixture(scope="module")
def reports(tmp_path_factory):
    """world size -> {case: [each rank's error or None]}, the gloo processes started on first use."""
    runs = {}

    def run(world: int) -> dict:
        if world not in runs:
            runs[world] = _spawn(tmp_path_factory.mktemp(f"cp{world}"), world, "gloo", CASES)
        return runs[world]

    return run


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("world", WORLDS, ids=[f"P{w}" for w in WORLDS])
def test_context_parallel(reports, world, case):
    errors = [(rank, error) for rank, error in enumerate(reports(world)[case]) if error is not None]
    assert not errors, "\n".join(f"rank {rank}:\n{error}" for rank, error in errors)


@pytest.mark.parametrize("edit", [None, _teacher_row_neginf, _teacher_key_neginf, _student_shard_neginf],
                         ids=["random", "teacher-row-neginf", "teacher-key-neginf", "student-shard-neginf"])
@pytest.mark.parametrize("cuts", [(0, 13), (0, 5, 13), (0, 1, 4, 9, 13)], ids=["1-shard", "2-shards", "4-shards"])
def test_merge_of_key_shards_is_one_pass(cuts, edit):
    """Without communication: the statistics of uneven key pieces, merged, are the one-pass rows."""
    full = _inputs(1, Setting(False, "none", requires=(False,) * 4), edit)
    q1, k1, q2, k2 = full
    expected, lse1, lse2 = streamkl.kl(*full, reduction="none", return_lse=True, backend="torch")
    impl = get_backend("torch")
    stats = None
    for start, stop in zip(cuts, cuts[1:]):
        part = (q1, k1[:, start:stop], q2, k2[:, start:stop])
        shard_stats = RowStats.of_shard(*run_forward(build_problem(*part), impl, *part))
        stats = shard_stats if stats is None else (stats.merge_(shard_stats) or stats)
    _close("kl", stats.rows(), expected)
    _close("lse1", stats.lse1, lse1)
    _close("lse2", stats.lse2, lse2)
    if len(cuts) == 2:  # one shard: the backend's rows, bit for bit
        assert torch.equal(stats.rows().nan_to_num(), expected.nan_to_num())


def test_shard_scores_all_neginf_by_value_carry_nan():
    """A shard whose side-1 scores are all -inf by value poisons its rows' E, as a -inf score does
    in one pass, whatever E the backend wrote for it."""
    lse1 = torch.tensor([[[-float("inf"), 0.5]]])
    stats = RowStats.of_shard(torch.zeros(1, 2, 1), lse1, torch.zeros(1, 1, 2), torch.zeros(1, 1, 2))
    assert torch.isnan(stats.expect[..., 0]).all() and stats.expect[..., 1].eq(0).all()


def test_refusals_without_a_process_group():
    assert not dist.is_initialized()
    x = torch.randn(1, 4, 2, 8)
    with pytest.raises(ValueError, match="init_process_group"):
        cp.kl(x, x, x, x)
    with pytest.raises(ValueError, match="init_process_group"):
        cp.shard(x)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (NCCL)")
def test_context_parallel_nccl(tmp_path):
    """NCCL on CUDA, the default backend: one rank per GPU, two when there are two GPUs (NCCL takes
    one GPU per rank, so one GPU checks the CUDA path and the agreement, not the ring)."""
    world = min(torch.cuda.device_count(), 2)
    report = _spawn(tmp_path, world, "nccl", GPU_CASES)
    errors = [(name, rank, error) for name, by_rank in report.items() for rank, error in enumerate(by_rank)
              if error is not None]
    assert not errors, "\n".join(f"{name} rank {rank}:\n{error}" for name, rank, error in errors)
