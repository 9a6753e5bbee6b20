"""Bad input (SPEC section 6, the varlen rules of section 2, BlockMask fit): every wrong argument raises
`ValueError` or `TypeError` naming the argument, before any kernel runs, leaving the inputs untouched.
Valid edge inputs (a transposed (B, H, N, D) tensor, zero-length sequences, a 2-D pattern) are accepted."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import pytest
import torch

import streamkl
from streamkl import BlockMask
from streamkl.dispatch import ENV_VAR, PRIORITY, get_backend
from streamkl.reference import reference_kl

NAMES = ("q1", "k1", "q2", "k2")

# Load every backend now, under the session's TRITON_INTERPRET (tests/conftest.py): the tests below remove
# the variable, and a kernel module first imported then would stay compiled for the GPU in this process.
for _name in PRIORITY:
    get_backend(_name).environment_reasons()
# dense: B=2, Nq=40, Nk=70, H=4, Hk1=2, Hk2=1, D1=16, D2=8; a 16x16 block grid is 3 x 5
B, NQ, NK, H, HK1, HK2, D1, D2 = 2, 40, 70, 4, 2, 1, 16, 8
# varlen: 2 sequences packed into T=9 queries, Tk=11 keys
CU, CU_K, T, TK = (0, 4, 9), (0, 5, 11), 9, 11


def randn(*shape, dtype=torch.float32, device="cpu", grad=False) -> torch.Tensor:
    return torch.randn(*shape, dtype=dtype, device=device).requires_grad_(grad)


def dense(**shapes) -> dict:
    """Fresh dense inputs; any of q1, k1, q2, k2 may be overridden by a shape tuple or any value."""
    default = {"q1": (B, NQ, H, D1), "k1": (B, NK, HK1, D1), "q2": (B, NQ, H, D2), "k2": (B, NK, HK2, D2)}
    args = {}
    for name in NAMES:
        value = shapes.pop(name, default[name])
        # the student side requires grad: an error must leave `.grad` untouched too
        args[name] = randn(*value, grad=name.endswith("2")) if isinstance(value, tuple) else value
    assert not shapes, shapes
    return args


def varlen(**overrides) -> dict:
    """Fresh packed inputs with cu_seqlens (and cu_seqlens_k) tables; overrides replace any argument."""
    args = dense(q1=(T, H, D1), k1=(TK, HK1, D1), q2=(T, H, D2), k2=(TK, HK2, D2))
    args["cu_seqlens"] = torch.tensor(CU, dtype=torch.int32)
    args["cu_seqlens_k"] = torch.tensor(CU_K, dtype=torch.int32)
    args.update(overrides)
    return args


def cu(*values, dtype=torch.int32) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def mask(b=1, h=1, n_q=3, n_k=5, block=16, device="cpu") -> BlockMask:
    """A BlockMask of the given pattern shape (the right one for the dense inputs is 1|2, 1|4, 3, 5)."""
    return BlockMask.from_dense(torch.ones(b, h, n_q, n_k, dtype=torch.bool, device=device), block)


@dataclass
class Bad:
    id: str
    args: Callable[[], dict]  # positional q1, k1, q2, k2 and keyword arguments of streamkl.kl
    error: type[Exception]
    match: str  # a regex the message must match: at least the argument's name
    env: dict = field(default_factory=dict)


def with_kwargs(base: Callable[[], dict], **kwargs) -> Callable[[], dict]:
    return lambda: {**base(), **kwargs}


def non_contiguous_last(*shape) -> torch.Tensor:
    return randn(*shape[:-1], 2 * shape[-1])[..., ::2]


def dense_then(**kwargs) -> Callable[[], dict]:
    return with_kwargs(dense, **kwargs)


def varlen_then(**kwargs) -> Callable[[], dict]:
    return lambda: varlen(**{k: (v() if callable(v) else v) for k, v in kwargs.items()})


BAD_INPUTS = [
    # ---- shapes of q1, k1, q2, k2
    Bad("q2-batch", lambda: dense(q2=(B + 1, NQ, H, D2)), ValueError, r"`q2`.*batch"),
    Bad("q2-length", lambda: dense(q2=(B, NQ + 1, H, D2)), ValueError, r"`q2`.*length"),
    Bad("q2-heads", lambda: dense(q2=(B, NQ, 2 * H, D2)), ValueError, r"`q2`.*heads"),
    Bad("k1-batch", lambda: dense(k1=(B + 1, NK, HK1, D1), k2=(B + 1, NK, HK2, D2)), ValueError, r"`k1`.*batch"),
    Bad("k2-batch", lambda: dense(k2=(B + 1, NK, HK2, D2)), ValueError, r"`k2`.*batch"),
    Bad("k2-length", lambda: dense(k2=(B, NK + 1, HK2, D2)), ValueError, r"`k2`.*length"),
    Bad("k1-Hk3-not-dividing-H4", lambda: dense(k1=(B, NK, 3, D1)), ValueError, r"`k1`.*key heads"),
    Bad("k2-Hk3-not-dividing-H4", lambda: dense(k2=(B, NK, 3, D2)), ValueError, r"`k2`.*key heads"),
    Bad("k1-Hk0", lambda: dense(k1=(B, NK, 0, D1)), ValueError, r"`k1`.*key heads"),
    Bad("q-H0", lambda: dense(q1=(B, NQ, 0, D1), q2=(B, NQ, 0, D2)), ValueError, r"`q1`.*head"),
    Bad("k1-headdim-D8-vs-q1-D16", lambda: dense(k1=(B, NK, HK1, D2)), ValueError, r"`k1`.*head dim"),
    Bad("k2-headdim-D16-vs-q2-D8", lambda: dense(k2=(B, NK, HK2, D1)), ValueError, r"`k2`.*head dim"),
    Bad("q1-headdim-0", lambda: dense(q1=(B, NQ, H, 0), k1=(B, NK, HK1, 0)), ValueError, r"`q1`.*head dim"),
    # ---- dtypes, devices, layouts
    Bad("k1-fp16-vs-fp32", lambda: dense(k1=randn(B, NK, HK1, D1, dtype=torch.float16)), TypeError, r"`k1`.*dtype"),
    Bad("q2-bf16-vs-fp32", lambda: dense(q2=randn(B, NQ, H, D2, dtype=torch.bfloat16)), TypeError, r"`q2`.*dtype"),
    Bad("k2-meta-device", lambda: dense(k2=randn(B, NK, HK2, D2, device="meta")), ValueError, r"`k2`.*device"),
    Bad(
        "q1-int32",
        lambda: dense(q1=torch.ones(B, NQ, H, D1, dtype=torch.int32)),
        TypeError,
        r"`q1`.*float16, bfloat16 or float32.*int32",
    ),
    Bad(
        "all-float64",
        lambda: {n: t.double().detach() for n, t in dense().items()},
        TypeError,
        r"`q1`.*float64",
    ),
    Bad("q1-complex64", lambda: dense(q1=randn(B, NQ, H, D1).to(torch.complex64)), TypeError, r"`q1`"),
    Bad(
        "k1-noncontiguous-last-dim", lambda: dense(k1=non_contiguous_last(B, NK, HK1, D1)), ValueError, r"`k1`.*contig"
    ),
    Bad("q2-noncontiguous-last-dim", lambda: dense(q2=non_contiguous_last(B, NQ, H, D2)), ValueError, r"`q2`.*contig"),
    Bad("q1-sparse-layout", lambda: dense(q1=randn(B, NQ, H, D1).to_sparse()), TypeError, r"`q1`.*layout"),
    Bad("q1-not-a-tensor", lambda: dense(q1=[[1.0]]), TypeError, r"`q1`.*torch.Tensor.*list"),
    Bad("k2-None", lambda: dense(k2=None), TypeError, r"`k2`.*torch.Tensor"),
    Bad(
        "dense-3D-without-cu_seqlens",
        lambda: varlen(cu_seqlens=None, cu_seqlens_k=None),
        ValueError,
        r"`q1`.*4-D.*cu_seqlens",
    ),
    Bad("varlen-4D-with-cu_seqlens", dense_then(cu_seqlens=cu(0, 20, 40)), ValueError, r"`q1`.*3-D.*batch dimension"),
    Bad("varlen-k1-4D", varlen_then(k1=lambda: randn(1, TK, HK1, D1)), ValueError, r"`k1`.*3-D"),
    Bad("varlen-q2-length", varlen_then(q2=lambda: randn(T + 1, H, D2)), ValueError, r"`q2`.*length"),
    Bad("varlen-k2-length", varlen_then(k2=lambda: randn(TK - 1, HK2, D2)), ValueError, r"`k2`.*length"),
    # ---- cu_seqlens
    Bad(
        "cu_seqlens-int64", varlen_then(cu_seqlens=cu(*CU, dtype=torch.int64)), TypeError, r"`cu_seqlens`.*int32.*int64"
    ),
    Bad("cu_seqlens-float", varlen_then(cu_seqlens=cu(*CU, dtype=torch.float32)), TypeError, r"`cu_seqlens`.*int32"),
    Bad("cu_seqlens-list", varlen_then(cu_seqlens=list(CU)), TypeError, r"`cu_seqlens`.*torch.Tensor.*list"),
    Bad("cu_seqlens-2D", varlen_then(cu_seqlens=cu(*CU)[None]), ValueError, r"`cu_seqlens`.*1-D.*\(1, 3\)"),
    Bad("cu_seqlens-empty", varlen_then(cu_seqlens=cu()), ValueError, r"`cu_seqlens`.*1-D.*\(0,\)"),
    Bad(
        "cu_seqlens-meta-device",
        varlen_then(cu_seqlens=lambda: cu(*CU).to("meta")),
        ValueError,
        r"`cu_seqlens`.*device.*meta",
    ),
    Bad(
        "cu_seqlens-noncontiguous",
        varlen_then(cu_seqlens=lambda: cu(0, 0, 4, 0, 9, 0)[::2]),
        ValueError,
        r"`cu_seqlens`.*contiguous",
    ),
    Bad("cu_seqlens-start-1", varlen_then(cu_seqlens=cu(1, 4, 9)), ValueError, r"`cu_seqlens`.*starting at 0.*1"),
    Bad("cu_seqlens-decreasing", varlen_then(cu_seqlens=cu(0, 6, 4)), ValueError, r"`cu_seqlens`.*non-decreasing"),
    Bad("cu_seqlens-past-T", varlen_then(cu_seqlens=cu(0, 4, T + 1)), ValueError, r"`cu_seqlens`.*at most.*9.*10"),
    Bad(
        "cu_seqlens-past-Tk-when-shared",
        varlen_then(cu_seqlens_k=None, k1=lambda: randn(5, HK1, D1), k2=lambda: randn(5, HK2, D2)),
        ValueError,
        r"`cu_seqlens`.*key length 5 .*defaults.*9",
    ),
    Bad("cu_seqlens_k-int64", varlen_then(cu_seqlens_k=cu(*CU_K, dtype=torch.int64)), TypeError, r"`cu_seqlens_k`"),
    Bad("cu_seqlens_k-2D", varlen_then(cu_seqlens_k=cu(*CU_K)[:, None]), ValueError, r"`cu_seqlens_k`.*1-D"),
    Bad("cu_seqlens_k-start-2", varlen_then(cu_seqlens_k=cu(2, 5, 11)), ValueError, r"`cu_seqlens_k`.*starting at 0"),
    Bad(
        "cu_seqlens_k-decreasing", varlen_then(cu_seqlens_k=cu(0, 7, 5)), ValueError, r"`cu_seqlens_k`.*non-decreasing"
    ),
    Bad("cu_seqlens_k-past-Tk", varlen_then(cu_seqlens_k=cu(0, 5, TK + 1)), ValueError, r"`cu_seqlens_k`.*at most.*11"),
    Bad(
        "cu_seqlens_k-3-seqs-vs-2",
        varlen_then(cu_seqlens_k=cu(0, 2, 5, 11)),
        ValueError,
        r"`cu_seqlens_k`.*same number of sequences.*\(2\).*3",
    ),
    Bad("cu_seqlens_k-without-cu_seqlens", varlen_then(cu_seqlens=None), ValueError, r"`cu_seqlens`.*given"),
    Bad("cu_seqlens_k-without-cu_seqlens-4D", dense_then(cu_seqlens_k=cu(0, 40)), ValueError, r"`cu_seqlens`.*given"),
    # ---- max_seqlen
    Bad("max_seqlen-dense", dense_then(max_seqlen=NQ), ValueError, r"`max_seqlen`.*None for dense"),
    Bad("max_seqlen_k-dense", dense_then(max_seqlen_k=NK), ValueError, r"`max_seqlen_k`.*None for dense"),
    Bad("max_seqlen-negative", varlen_then(max_seqlen=-1), ValueError, r"`max_seqlen`.*>= 0.*-1"),
    Bad("max_seqlen_k-negative", varlen_then(max_seqlen_k=-3), ValueError, r"`max_seqlen_k`.*>= 0"),
    Bad("max_seqlen-float", varlen_then(max_seqlen=5.0), TypeError, r"`max_seqlen`.*int.*float"),
    Bad("max_seqlen-tensor", varlen_then(max_seqlen=lambda: torch.tensor(5)), TypeError, r"`max_seqlen`.*Tensor"),
    Bad("max_seqlen-bool", varlen_then(max_seqlen=True), TypeError, r"`max_seqlen`.*bool"),
    Bad("max_seqlen-below-longest", varlen_then(max_seqlen=4), ValueError, r"`max_seqlen`.*longest.*\(5\).*4"),
    Bad("max_seqlen_k-below-longest", varlen_then(max_seqlen_k=5), ValueError, r"`max_seqlen_k`.*longest.*\(6\)"),
    # ---- block masks
    Bad(
        "mask1-not-a-BlockMask",
        dense_then(mask1=torch.ones(1, 1, 3, 5, dtype=torch.bool)),
        TypeError,
        r"`mask1`.*BlockMask",
    ),
    Bad("mask2-num-q-blocks", dense_then(mask2=mask(n_q=4)), ValueError, r"`mask2`.*\(1 or 2, 1 or 4, 3, 5\).*4, 5"),
    Bad("mask1-num-kv-blocks", dense_then(mask1=mask(n_k=4)), ValueError, r"`mask1`.*shape"),
    Bad("mask1-batch-3", dense_then(mask1=mask(b=3)), ValueError, r"`mask1`.*1 or 2"),
    Bad("mask2-heads-2-vs-4", dense_then(mask2=mask(h=2)), ValueError, r"`mask2`.*1 or 4"),
    Bad("mask1-block-size-32-vs-grid-16", dense_then(mask1=mask(block=32)), ValueError, r"`mask1`.*\(32, 32\)"),
    Bad("mask1-meta-device", dense_then(mask1=mask(device="meta")), ValueError, r"`mask1`.*device"),
    Bad("varlen-mask1-3-seqs-vs-2", varlen_then(mask1=mask(b=3, n_q=1, n_k=1)), ValueError, r"`mask1`.*max_seqlen"),
    Bad(
        "mask1-kv_indices-out-of-range",
        dense_then(mask1=BlockMask(torch.ones(1, 1, 3, dtype=torch.int32), torch.full((1, 1, 3, 5), 7), 16)),
        ValueError,
        r"`mask1` must be a valid BlockMask.*`kv_indices`.*\[0, 4\]",
    ),
    # ---- other keyword arguments
    Bad("reduction-avg", dense_then(reduction="avg"), ValueError, r"`reduction`.*'none', 'sum', 'mean'.*'avg'"),
    Bad("reduction-None", dense_then(reduction=None), ValueError, r"`reduction`"),
    Bad("window-int", dense_then(window=4), TypeError, r"`window`.*pair"),
    Bad("window-triple", dense_then(window=(1, 2, 3)), TypeError, r"`window`.*pair"),
    Bad("window-float", dense_then(window=(0.5, -1)), TypeError, r"`window`.*ints"),
    Bad("window-bool", dense_then(window=(True, -1)), TypeError, r"`window`"),
    Bad("window-left-below-minus-1", dense_then(window=(-2, 0)), ValueError, r"`window`.*-1.*\(-2, 0\)"),
    Bad("window-right-below-minus-1", dense_then(window=(3, -5)), ValueError, r"`window`"),
    Bad("causal-int", dense_then(causal=1), TypeError, r"`causal`.*bool.*int"),
    Bad("causal-str", dense_then(causal="yes"), TypeError, r"`causal`"),
    Bad("scale1-nan", dense_then(scale1=float("nan")), ValueError, r"`scale1`.*finite.*nan"),
    Bad("scale2-inf", dense_then(scale2=float("inf")), ValueError, r"`scale2`.*finite.*inf"),
    Bad("scale1-str", dense_then(scale1="0.1"), TypeError, r"`scale1`.*float.*str"),
    Bad("scale2-tensor", dense_then(scale2=torch.tensor(0.1)), TypeError, r"`scale2`.*Tensor"),
    Bad("deterministic-int", dense_then(deterministic=1), TypeError, r"`deterministic`"),
    Bad("return_lse-str", dense_then(return_lse="yes"), TypeError, r"`return_lse`"),
    # ---- backends
    Bad("backend-unknown", dense_then(backend="cuda"), ValueError, r"`backend`.*'triton'.*'cupy'.*'torch'.*'cuda'"),
    Bad("backend-int", dense_then(backend=1), TypeError, r"`backend`.*str"),
    Bad("env-backend-unknown", dense, ValueError, r"STREAMKL_BACKEND.*'torch'.*'flash'", env={ENV_VAR: "flash"}),
    Bad("backend-triton-on-cpu", dense_then(backend="triton"), ValueError, r"backend 'triton' cannot serve"),
    Bad("backend-cupy-on-cpu", dense_then(backend="cupy"), ValueError, r"backend 'cupy' cannot serve"),
    Bad("env-backend-triton-on-cpu", dense, ValueError, r"backend 'triton' cannot serve", env={ENV_VAR: "triton"}),
]


def _snapshot(value):
    """What "untouched" means for one argument: same version counter, strides, values and no grad."""
    if not isinstance(value, torch.Tensor):
        return value
    data = None if value.device.type == "meta" or value.layout != torch.strided else value.detach().clone()
    return (value._version, value.shape, value.stride() if value.layout == torch.strided else None, data)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    monkeypatch.delenv(ENV_VAR, raising=False)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.delenv("STREAMKL_CUPY_EMULATE", raising=False)


@pytest.fixture
def no_kernels(monkeypatch):
    """Any backend's forward or backward running is a failure: errors must come before."""

    def ran(*args, **kwargs):
        raise AssertionError("a kernel ran before the bad input was reported")

    for name in PRIORITY:
        try:
            impl = get_backend(name)
        except Exception:  # a backend that cannot even be imported here cannot run either
            continue
        monkeypatch.setattr(impl, "forward", ran)
        monkeypatch.setattr(impl, "backward", ran)


@pytest.mark.parametrize("case", BAD_INPUTS, ids=[case.id for case in BAD_INPUTS])
def test_bad_input_raises_naming_the_argument(case: Bad, monkeypatch, no_kernels):
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    args = case.args()
    before = {name: _snapshot(value) for name, value in args.items()}
    positional = [args.pop(name) for name in NAMES]
    with pytest.raises(case.error, match=case.match) as raised:
        streamkl.kl(*positional, **args)
    assert type(raised.value) is case.error  # not a subclass that happens to match
    assert str(raised.value).startswith("streamkl.kl")
    args.update(zip(NAMES, positional, strict=True))
    for name, value in args.items():
        snap = _snapshot(value)
        if isinstance(value, torch.Tensor):
            assert snap[:3] == before[name][:3], f"{name} was modified"
            if snap[3] is not None:
                assert torch.equal(snap[3], before[name][3]), f"{name} changed values"
            assert value.grad is None, f"{name} got a gradient"


# ---------------------------------------------------------------- BlockMask constructors


BAD_MASKS = [
    ("from_dense-block-48-not-pow2", lambda: mask(block=48), ValueError, r"`block_size`.*power of two.*48"),
    ("from_dense-block-8-below-16", lambda: mask(block=8), ValueError, r"`block_size`.*16 to 256"),
    ("from_dense-block-512-above-256", lambda: mask(block=512), ValueError, r"`block_size`.*16 to 256"),
    ("from_dense-block-16x24", lambda: mask(block=(16, 24)), ValueError, r"`block_size`.*\(16, 24\)"),
    ("from_dense-block-0", lambda: mask(block=0), ValueError, r"`block_size`"),
    ("from_dense-block-str", lambda: mask(block="64"), TypeError, r"`block_size`"),
    ("from_dense-block-float", lambda: mask(block=64.0), TypeError, r"`block_size`"),
    ("from_dense-block-triple", lambda: mask(block=(16, 16, 16)), TypeError, r"`block_size`"),
    ("from_dense-block-bool", lambda: mask(block=True), TypeError, r"`block_size`"),
    ("from_dense-pattern-list", lambda: BlockMask.from_dense([[True]]), TypeError, r"`pattern`.*list"),
    ("from_dense-pattern-float", lambda: BlockMask.from_dense(torch.ones(1, 1, 2, 2)), TypeError, r"`pattern`.*bool"),
    (
        "from_dense-pattern-3D",
        lambda: BlockMask.from_dense(torch.ones(1, 2, 2).bool()),
        ValueError,
        r"`pattern`.*\(1, 2, 2\)",
    ),
    ("from_topk-block-24", lambda: BlockMask.from_topk(randn(1, 1, 2, 2), 1, 24), ValueError, r"`block_size`"),
    ("from_topk-scores-3D", lambda: BlockMask.from_topk(randn(1, 2, 2), 1), ValueError, r"`block_scores`.*4-D"),
    ("from_topk-scores-list", lambda: BlockMask.from_topk([1.0], 1), ValueError, r"`block_scores`.*list"),
    ("from_topk-topk-negative", lambda: BlockMask.from_topk(randn(1, 1, 2, 2), -1), ValueError, r"`topk`.*-1"),
    ("from_topk-topk-float", lambda: BlockMask.from_topk(randn(1, 1, 2, 2), 1.5), ValueError, r"`topk`"),
    (
        "from_topk-seqlen-mismatch",
        lambda: BlockMask.from_topk(randn(1, 1, 2, 2), 1, 16, seqlen_q=100),
        ValueError,
        r"`block_scores`.*7x2.*2x2",
    ),
    (
        "from_topk-seqlen-negative",
        lambda: BlockMask.from_topk(randn(1, 1, 2, 2), 1, seqlen_k=-1),
        ValueError,
        r"`seqlen_k`",
    ),
    ("from_topk-causal-int", lambda: BlockMask.from_topk(randn(1, 1, 2, 2), 1, causal=1), TypeError, r"`causal`"),
    ("from_flex-not-flex", lambda: BlockMask.from_flex(torch.ones(2, 2)), TypeError, r"`flex_block_mask`"),
    (
        "init-float-counts",
        lambda: BlockMask(torch.ones(1, 1, 2), torch.zeros(1, 1, 2, 2, dtype=torch.int32), 16),
        TypeError,
        r"`kv_num_blocks`.*integer",
    ),
    (
        "init-indices-shape",
        lambda: BlockMask(torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 3, 2, dtype=torch.int32), 16),
        ValueError,
        r"kv_indices.*\(1, 1, 3, 2\)",
    ),
    (
        "init-num_kv_blocks-negative",
        lambda: BlockMask(torch.ones(1, 1, 2, dtype=torch.int32), torch.zeros(1, 1, 2, 2, dtype=torch.int32), 16, -1),
        ValueError,
        r"`num_kv_blocks`",
    ),
    (
        "to_dense-counts-over-slots",
        lambda: BlockMask(torch.full((1, 1, 2), 3), torch.zeros(1, 1, 2, 2, dtype=torch.int32), 16).to_dense(),
        ValueError,
        r"`kv_num_blocks`.*\[0, 2\]",
    ),
]


@pytest.mark.parametrize(("build", "error", "match"), [c[1:] for c in BAD_MASKS], ids=[c[0] for c in BAD_MASKS])
def test_bad_block_mask_raises_naming_the_argument(build, error, match):
    with pytest.raises(error, match=match):
        build()


# ---------------------------------------------------------------- valid edge inputs


def _close(a: torch.Tensor, b: torch.Tensor, tol: float = 1e-4) -> bool:
    a, b = a.double(), b.double()
    return bool((a - b).norm() <= tol * max(b.norm().item(), 1e-6) + 1e-7)


def test_transposed_bhnd_inputs_are_accepted_without_copy():
    q1 = randn(B, H, NQ, D1).transpose(1, 2)  # (B, N, H, D) view of a (B, H, N, D) tensor
    k1 = randn(B, HK1, NK, D1).transpose(1, 2)
    q2 = randn(B, H, NQ, D2).transpose(1, 2)
    k2 = randn(B, HK2, NK, D2).transpose(1, 2)
    assert not q1.is_contiguous() and q1.stride(-1) == 1
    strides = [t.stride() for t in (q1, k1, q2, k2)]
    problem = streamkl.problem.build_problem(q1, k1, q2, k2)
    assert (problem.batch, problem.seqlen_q, problem.seqlen_k, problem.heads) == (B, NQ, NK, H)
    out = streamkl.kl(q1, k1, q2, k2, reduction="none", backend="torch")
    expected, _, _ = reference_kl(*(t.contiguous() for t in (q1, k1, q2, k2)))
    assert out.shape == (B, NQ, H)
    assert _close(out, expected)
    assert [t.stride() for t in (q1, k1, q2, k2)] == strides


def test_zero_length_sequences_and_tail_rows_are_accepted():
    # sequences of lengths 0, 3, 0, 4 queries (0, 5, 2, 0 keys); rows 7, 8 lie past cu_seqlens[-1]
    cu_q, cu_k = cu(0, 0, 3, 3, 7), cu(0, 0, 5, 7, 7)
    q1, k1, q2, k2 = randn(T, H, D1), randn(TK, HK1, D1), randn(T, H, D2), randn(TK, HK2, D2)
    out = streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu_q, cu_seqlens_k=cu_k, reduction="none", backend="torch")
    expected, _, _ = reference_kl(q1, k1, q2, k2, cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    assert out.shape == (T, H)
    assert torch.isfinite(out[:3]).all()
    assert (out[3:] == 0).all()  # a query with no keys (sequence 4) and rows past the table: KL 0
    assert _close(out, expected)


def test_empty_cu_seqlens_table_of_no_sequences_is_accepted():
    q1, k1, q2, k2 = randn(T, H, D1), randn(TK, HK1, D1), randn(T, H, D2), randn(TK, HK2, D2)
    out = streamkl.kl(q1, k1, q2, k2, cu_seqlens=cu(0), reduction="none", backend="torch")
    assert (out == 0).all() and out.shape == (T, H)


def test_generous_max_seqlen_is_accepted():
    """Any bound from the longest sequence up to the packed length (none is longer) is taken."""
    args = varlen()
    out = streamkl.kl(*[args.pop(n) for n in NAMES], **args, max_seqlen=T, max_seqlen_k=TK, backend="torch")
    assert torch.isfinite(out)


@pytest.mark.parametrize("block", [16, 256, (16, 256), [32, 64]], ids=["16", "256", "16x256", "list-32x64"])
def test_valid_block_sizes_are_accepted(block):
    m = mask(block=block)
    assert m.block_size == ((block, block) if isinstance(block, int) else tuple(block))


def test_2d_bool_pattern_is_accepted_and_broadcasts():
    pattern = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 0, 0, 1], [0, 1, 1, 1, 1]], dtype=torch.bool)
    m = BlockMask.from_dense(pattern, 16)
    assert m.shape == (1, 1, 3, 5)
    assert torch.equal(m.to_dense()[0, 0], pattern)
    args = dense()
    q1, k1, q2, k2 = (args[n] for n in NAMES)
    out = streamkl.kl(q1, k1, q2, k2, mask1=m, mask2=m, reduction="none", backend="torch")
    expected, _, _ = reference_kl(q1, k1, q2, k2, mask1=m, mask2=m)
    assert _close(out, expected)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": [2, -1]},
        {"window": (0, 0), "causal": True},
        {"scale1": 1, "scale2": 0.0},
        {"backend": " Torch "},
        {"reduction": "sum", "deterministic": True},
    ],
    ids=["window-list", "window-0-0-causal", "scale-int-and-zero", "backend-case-and-spaces", "sum-deterministic"],
)
def test_valid_keyword_variants_are_accepted(kwargs):
    args = dense()
    out = streamkl.kl(*(args[n] for n in NAMES), **kwargs)
    assert torch.isfinite(out).all()


def test_empty_env_backend_means_auto(monkeypatch):
    monkeypatch.setenv(ENV_VAR, "")
    args = dense()
    assert torch.isfinite(streamkl.kl(*(args[n] for n in NAMES)))


def test_validated_calls_are_remembered_by_metadata_only():
    """`build_problem` gives a call with the metadata, options, cu_seqlens (same version) and masks
    of a validated call that call's Problem, and validates anything else again: other metadata,
    an option of another type (1 for True), a table changed in place."""
    from streamkl.problem import build_problem

    x = [torch.randn(1, 32, 2, 8) for _ in range(4)]
    first = build_problem(*x, causal=True)
    assert build_problem(*[t.clone() for t in x], causal=True) is first
    assert build_problem(*x, causal=False) is not first
    with pytest.raises(TypeError, match="causal"):
        build_problem(*x, causal=1)
    assert build_problem(x[0].requires_grad_(True), *x[1:], causal=True) is not first
    transposed = x[1].transpose(1, 2).contiguous().transpose(1, 2)  # same shape, other strides
    assert build_problem(x[0], transposed, *x[2:], causal=True) is not first
    with pytest.raises(TypeError, match="q2"):
        build_problem(x[0], x[1], x[2].double(), x[3], causal=True)
    packed = [torch.randn(40, 2, 8) for _ in range(4)]
    cu = torch.tensor([0, 10, 40], dtype=torch.int32)
    assert build_problem(*packed, cu_seqlens=cu) is build_problem(*packed, cu_seqlens=cu)
    cu[1] = 50  # in place: a new version, validated again
    with pytest.raises(ValueError, match="cu_seqlens"):
        build_problem(*packed, cu_seqlens=cu)
    assert build_problem(*x, window=[4, 4]) is not build_problem(*x, window=[4, 4])  # a list: each time


@pytest.mark.skipif(torch.cuda.is_available(), reason="with a GPU the kernels were compiled at import, not interpreted")
def test_backend_choice_follows_the_environment_between_calls(monkeypatch):
    """The front end keeps its backend choice per problem, keyed by the environment the backends'
    checks read: switching TRITON_INTERPRET between two identical calls changes what serves them."""
    args = dense()
    inputs = [args[n] for n in NAMES]
    with pytest.raises(ValueError, match="backend 'triton' cannot serve"):
        streamkl.kl(*inputs, backend="triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    served = streamkl.kl(*inputs, backend="triton")  # the interpreter takes CPU tensors
    reference = streamkl.kl(*inputs, backend="torch")
    torch.testing.assert_close(served, reference, rtol=1e-4, atol=1e-5)
    monkeypatch.delenv("TRITON_INTERPRET")
    with pytest.raises(ValueError, match="backend 'triton' cannot serve"):
        streamkl.kl(*inputs, backend="triton")


def test_triton_refuses_a_gpu_older_than_ampere(monkeypatch):
    """The current GPU's and the inputs' GPU's capability go through one check."""
    from streamkl.backends import triton as triton_backend
    from streamkl.backends.triton import common

    monkeypatch.setattr(common, "capability", lambda index: (7, 5))
    reason = triton_backend._capability_reason(1, "the inputs' GPU")
    assert reason == "the inputs' GPU has compute capability 7.5; the Triton kernels need 8.0 (Ampere) or newer"
    monkeypatch.setattr(common, "capability", lambda index: (8, 0))
    assert triton_backend._capability_reason(1, "the GPU") is None
