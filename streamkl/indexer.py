"""`streamkl.indexer_kl`: the DSA indexer loss (SPEC section 8), its problem description, validation,
backend choice and autograd.

The teacher is the mean over the main attention's heads of each head's softmax, the student the
softmax over keys of the lightning indexer's logits `z = sum_t w_t * relu(<qi_t, ki>)`; the loss is
KL(teacher || student) per query row, dense or over each row's top-k selected keys.

Backends live in `INDEXER_MODULES` (one module each, imported on first use) and expose
`not_supported_reasons(problem)`, `forward(...)` and `backward(...)` (docs/indexer.md).
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass

import torch

from streamkl import dispatch
from streamkl.backends import base
from streamkl.problem import FLOAT_DTYPES, REDUCTIONS, host_values, known_host_values

MAX_DIM = 256  # teacher head dim (DeepSeek's MLA query/key head is 192)
MAX_INDEX_DIM = 128
MAX_INDEX_HEADS = 64
NEG_INF = float("-inf")

INDEXER_MODULES = {
    "triton": "streamkl.backends.triton.indexer",
    "cupy": "streamkl.backends.cupy.indexer",
    "torch": "streamkl.backends.torch_indexer",
}


@dataclass(frozen=True, eq=False)
class IndexerProblem:
    """Everything an indexer backend needs to know about the call, apart from the tensors."""

    batch: int  # B, or the number of sequences S for varlen
    seqlen_q: int  # Nq, or max_seqlen for varlen
    seqlen_k: int  # Nk, or max_seqlen_k
    heads: int  # teacher query heads H
    heads_k: int  # teacher key heads Hk (H % Hk == 0)
    dim: int  # teacher head dim D
    index_heads: int  # indexer heads Hi
    index_dim: int  # indexer head dim Di
    scale: float  # teacher score scale
    causal: bool  # bottom-right aligned, as SPEC 3
    topk: int  # K, or 0 for the dense stage
    dtype: torch.dtype  # q, k, qi, ki, w share it
    device: torch.device
    is_varlen: bool = False
    total_q: int = 0
    total_k: int = 0
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    lse_given: bool = False
    key: tuple = ()  # hashable: the fields above as plain values + (id, _version) of cu_seqlens
    #: per-sequence (len_q, len_k) known on the host (from the value checks), else () (no device read)
    host_lengths: tuple = ()

    @property
    def row_shape(self) -> tuple[int, ...]:
        return (self.total_q,) if self.is_varlen else (self.batch, self.seqlen_q)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        return (self.heads, self.total_q) if self.is_varlen else (self.batch, self.heads, self.seqlen_q)

    def describe(self) -> str:
        parts = [
            f"B{self.batch}",
            f"Nq{self.seqlen_q}",
            f"Nk{self.seqlen_k}",
            f"H{self.heads}",
            f"Hk{self.heads_k}",
            f"D{self.dim}",
            f"Hi{self.index_heads}",
            f"Di{self.index_dim}",
            str(self.dtype).replace("torch.", ""),
        ]
        if self.topk:
            parts.append(f"top{self.topk}")
        if self.is_varlen:
            parts.append("varlen")
        if self.causal:
            parts.append("causal")
        if self.lse_given:
            parts.append("lse")
        return "-".join(parts)


def make_problem(q, k, qi, ki, w, lse, topk_indices, cu_q, cu_k, scale, causal, seqlen_q, seqlen_k,
                 host_lengths: tuple = ()) -> IndexerProblem:
    """The problem of arguments already validated: no checks, no host sync (the custom ops use it).
    `seqlen_q`, `seqlen_k` are the max_seqlen* for varlen and ignored for dense inputs."""
    is_varlen = cu_q is not None
    if is_varlen:
        batch, total_q, total_k = cu_q.shape[0] - 1, q.shape[0], k.shape[0]
    else:
        batch, seqlen_q, seqlen_k = q.shape[0], q.shape[1], k.shape[1]
        total_q = total_k = 0
    topk = 0 if topk_indices is None else topk_indices.shape[-1]
    fields = (batch, seqlen_q, seqlen_k, q.shape[-2], k.shape[-2], q.shape[-1], qi.shape[-2], qi.shape[-1],
              float(scale), bool(causal), topk, q.dtype, q.device, is_varlen, total_q, total_k)
    tables = tuple(None if t is None else (id(t), t._version) for t in (cu_q, cu_k))
    return IndexerProblem(*fields, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, lse_given=lse is not None,
                          key=fields + tables + (lse is not None,), host_lengths=host_lengths)


# ------------------------------------------------------------------------------ validation (SPEC 6)
def _fail(argument: str, expected: str, got: object, cls: type[Exception] = ValueError):
    raise cls(f"streamkl.indexer_kl: `{argument}` must be {expected}; got {got}.")


def _check_float(name: str, t: object, layout: tuple[str, ...]) -> torch.Tensor:
    text = f"({', '.join(layout)})"
    if not isinstance(t, torch.Tensor):
        _fail(name, f"a torch.Tensor of shape {text}", type(t).__name__, TypeError)
    if t.layout != torch.strided or t.is_nested:
        _fail(name, "a dense strided tensor (not sparse or nested)", f"layout {t.layout}", TypeError)
    if t.dtype not in FLOAT_DTYPES:
        _fail(name, "float16, bfloat16 or float32", t.dtype, TypeError)
    if t.dim() != len(layout):
        hint = ""
        if layout[0] == "T" and t.dim() == len(layout) + 1:
            hint = " (varlen inputs are packed: drop the batch dimension)"
        elif layout[0] == "B" and t.dim() == len(layout) - 1:
            hint = " (inputs without a batch dimension are packed sequences: pass cu_seqlens)"
        _fail(name, f"{len(layout)}-D {text}{hint}", f"shape {tuple(t.shape)}")
    if t.shape[-1] == 0:
        _fail(name, "a tensor with a last dimension >= 1", f"shape {tuple(t.shape)}")
    if t.stride(-1) != 1 and t.numel() > 1:
        _fail(name, "contiguous in its last dimension", f"strides {t.stride()}")
    return t


def _check_cu(name: str, cu: object, device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        _fail(name, "an int32 torch.Tensor of shape (num_sequences + 1,)", type(cu).__name__, TypeError)
    if cu.dtype != torch.int32:
        _fail(name, "int32 (use .int())", cu.dtype, TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(name, "1-D of shape (num_sequences + 1,)", f"shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(name, f"on the inputs' device {device}", cu.device)
    if cu.stride(0) != 1 and cu.numel() > 1:
        _fail(name, "contiguous (use .contiguous())", f"stride {cu.stride()}")
    return cu


def _check_cu_values(name: str, values: torch.Tensor, total: int, what: str) -> list[int]:
    starts = values.tolist()
    if starts[0] != 0:
        _fail(name, "a cumulative length table starting at 0", f"first entry {starts[0]}")
    for index in range(1, len(starts)):
        if starts[index] < starts[index - 1]:
            _fail(name, "non-decreasing (cumulative sequence lengths)",
                  f"{starts[index]} after {starts[index - 1]} at index {index}")
    if starts[-1] > total:
        _fail(name, f"at most the {what} {total} in its last entry", starts[-1])
    return [b - a for a, b in zip(starts, starts[1:])]


def _check_int(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "a Python int or None", type(value).__name__, TypeError)
    if value < 0:
        _fail(name, ">= 0", value)
    return int(value)


def _may_sync() -> bool:
    """Value checks read the device: skip them while compiling or capturing a CUDA graph."""
    if torch.compiler.is_compiling():
        return False
    return not (torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def build_indexer_problem(q, k, qi, ki, w, *, scale=None, lse=None, causal=True, cu_seqlens=None,
                          cu_seqlens_k=None, max_seqlen=None, max_seqlen_k=None, topk_indices=None,
                          check_values=True) -> IndexerProblem:
    """Validate every argument of `indexer_kl` and describe the call. Reads tensor values only for
    `cu_seqlens` and `topk_indices` when `check_values` (one host sync each)."""
    if cu_seqlens is None and cu_seqlens_k is not None:
        _fail("cu_seqlens", "given when cu_seqlens_k is (cu_seqlens_k defaults to cu_seqlens)", None)
    is_varlen = cu_seqlens is not None
    lead_q, lead_k = (("T",), ("Tk",)) if is_varlen else (("B", "Nq"), ("B", "Nk"))
    layouts = {
        "q": (*lead_q, "H", "D"),
        "k": (*lead_k, "Hk", "D"),
        "qi": (*lead_q, "Hi", "Di"),
        "ki": (*lead_k, "Di"),
        "w": (*lead_q, "Hi"),
    }
    tensors = {name: _check_float(name, t, layouts[name]) for name, t in zip(layouts, (q, k, qi, ki, w))}
    dtype, device = q.dtype, q.device
    for name, t in tensors.items():
        if t.dtype != dtype:
            _fail(name, f"the same dtype as q ({dtype})", t.dtype, TypeError)
        if t.device != device:
            _fail(name, f"on the same device as q ({device})", t.device)
    if not isinstance(causal, bool):
        _fail("causal", "a bool", type(causal).__name__, TypeError)

    n_lead = len(lead_q)
    rows, keys = tuple(q.shape[:n_lead]), tuple(k.shape[:n_lead])
    if not is_varlen and k.shape[0] != q.shape[0]:
        _fail("k", f"the same batch size as q ({q.shape[0]})", k.shape[0])
    heads, heads_k, dim = q.shape[-2], k.shape[-2], q.shape[-1]
    if heads < 1:
        _fail("q", "at least one head", heads)
    if k.shape[-1] != dim:
        _fail("k", f"of head dim {dim}, the head dim of q", k.shape[-1])
    if heads_k < 1 or heads % heads_k != 0:
        _fail("k", f"a number of key heads dividing the {heads} query heads (GQA)", heads_k)
    if dim > MAX_DIM:
        _fail("q", f"of head dim at most {MAX_DIM}", dim)
    index_heads, index_dim = qi.shape[-2], qi.shape[-1]
    if tuple(qi.shape[:n_lead]) != rows:
        _fail("qi", f"of leading shape {rows}, as q", tuple(qi.shape[:n_lead]))
    if not 1 <= index_heads <= MAX_INDEX_HEADS:
        _fail("qi", f"1 to {MAX_INDEX_HEADS} indexer heads", index_heads)
    if index_dim > MAX_INDEX_DIM:
        _fail("qi", f"of head dim at most {MAX_INDEX_DIM}", index_dim)
    if tuple(ki.shape) != (*keys, index_dim):
        _fail("ki", f"of shape {(*keys, index_dim)} (one indexer key per key token, qi's head dim)",
              tuple(ki.shape))
    if tuple(w.shape) != (*rows, index_heads):
        _fail("w", f"of shape {(*rows, index_heads)} (one weight per query row and indexer head)", tuple(w.shape))

    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        _fail("scale", "a Python float or None", type(scale).__name__, TypeError)
    elif not math.isfinite(float(scale)):
        _fail("scale", "finite", scale)

    host_lengths: tuple = ()
    if is_varlen:
        total_q, total_k = q.shape[0], k.shape[0]
        cu_q = _check_cu("cu_seqlens", cu_seqlens, device)
        cu_k = cu_q if cu_seqlens_k is None else _check_cu("cu_seqlens_k", cu_seqlens_k, device)
        if cu_k.numel() != cu_q.numel():
            _fail("cu_seqlens_k", f"the same number of sequences as cu_seqlens ({cu_q.numel() - 1})",
                  cu_k.numel() - 1)
        given_q = None if max_seqlen is None else _check_int("max_seqlen", max_seqlen)
        given_k = None if max_seqlen_k is None else _check_int("max_seqlen_k", max_seqlen_k)
        if check_values:
            lengths_q = _check_cu_values("cu_seqlens", host_values(cu_q), total_q, "packed length")
            note = "packed key length" + (" (cu_seqlens_k defaults to cu_seqlens)" if cu_k is cu_q else "")
            lengths_k = _check_cu_values("cu_seqlens_k" if cu_k is not cu_q else "cu_seqlens",
                                         host_values(cu_k), total_k, note)
            for name, given, lengths in (("max_seqlen", given_q, lengths_q), ("max_seqlen_k", given_k, lengths_k)):
                if given is not None and lengths and given < max(lengths):
                    _fail(name, f"at least the longest sequence ({max(lengths)})", given)
            host_lengths = tuple(zip(lengths_q, lengths_k))
        else:
            known_q, known_k = known_host_values(cu_q), known_host_values(cu_k)
            if known_q is not None and known_k is not None:
                host_lengths = tuple(zip((known_q[1:] - known_q[:-1]).tolist(), (known_k[1:] - known_k[:-1]).tolist()))
        if given_q is None:
            given_q = max((a for a, _ in host_lengths), default=0) if host_lengths else _device_max_len(cu_q)
        if given_k is None:
            given_k = max((b for _, b in host_lengths), default=0) if host_lengths else _device_max_len(cu_k)
        seqlen_q, seqlen_k = given_q, given_k
    else:
        for name, value in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                _fail(name, "None for dense inputs; pass cu_seqlens for packed sequences", type(value).__name__)
        cu_q = cu_k = None
        seqlen_q, seqlen_k = q.shape[1], k.shape[1]
        host_lengths = ((seqlen_q, seqlen_k),) * q.shape[0]

    lse_shape = (heads, q.shape[0]) if is_varlen else (q.shape[0], heads, q.shape[1])
    if lse is not None:
        if not isinstance(lse, torch.Tensor):
            _fail("lse", f"a float32 torch.Tensor of shape {lse_shape} or None", type(lse).__name__, TypeError)
        if lse.dtype != torch.float32:
            _fail("lse", "float32 (the teacher's per-head logsumexp, natural log)", lse.dtype, TypeError)
        if tuple(lse.shape) != lse_shape:
            layout = "(H, T)" if is_varlen else "(B, H, Nq)"
            _fail("lse", f"of shape {layout} = {lse_shape}", f"shape {tuple(lse.shape)}")
        if lse.device != device:
            _fail("lse", f"on the inputs' device {device}", lse.device)
        if lse.stride(-1) != 1 and lse.numel() > 1:
            _fail("lse", "contiguous in its last dimension", f"strides {lse.stride()}")
    if topk_indices is not None:
        _check_topk(topk_indices, rows, device, is_varlen)
        if check_values:
            _check_topk_values(topk_indices, cu_q, cu_k, seqlen_k, device)
    problem = make_problem(q, k, qi, ki, w, lse, topk_indices, cu_q, cu_k, scale, causal, seqlen_q, seqlen_k,
                           host_lengths)
    return problem


def _device_max_len(cu: torch.Tensor) -> int:
    return int((cu[1:] - cu[:-1]).max().item()) if cu.numel() > 1 else 0


def _check_topk(topk: object, rows: tuple, device, is_varlen: bool) -> None:
    layout = "(T, K)" if is_varlen else "(B, Nq, K)"
    if not isinstance(topk, torch.Tensor):
        _fail("topk_indices", f"an int32 torch.Tensor of shape {layout} or None", type(topk).__name__, TypeError)
    if topk.dtype != torch.int32:
        _fail("topk_indices", "int32 (convert with .int())", topk.dtype, TypeError)
    if topk.dim() != len(rows) + 1 or tuple(topk.shape[:-1]) != rows:
        _fail("topk_indices", f"of shape {layout} with leading shape {rows}", f"shape {tuple(topk.shape)}")
    if topk.shape[-1] < 1:
        _fail("topk_indices", "at least one column (pass None for the dense stage)", f"shape {tuple(topk.shape)}")
    if topk.device != device:
        _fail("topk_indices", f"on the inputs' device {device}", topk.device)
    if topk.stride(-1) != 1 and topk.numel() > 1:
        _fail("topk_indices", "contiguous in its last dimension", f"strides {topk.stride()}")


def _check_topk_values(topk: torch.Tensor, cu_q, cu_k, seqlen_k: int, device) -> None:
    """Every index in [-1, the row's sequence's key length): one host sync."""
    if topk.numel() == 0:
        return
    low, high = topk.amin(-1), topk.amax(-1)
    if cu_q is None:
        limit = seqlen_k
    else:
        limit = row_key_lengths(cu_q, cu_k, topk.shape[0], device).clamp(min=0)
    bad = (low < -1) | (high >= limit)
    if cu_q is not None:  # rows past cu_seqlens[-1] belong to no sequence: their indices are never read
        bad &= torch.arange(topk.shape[0], device=device) < cu_q[-1]
    if bool(bad.any()):
        where = bad.nonzero()[0].tolist()
        row = topk[tuple(where)]
        lim = limit if isinstance(limit, int) else int(limit[where[0]])
        _fail("topk_indices", f"key positions in [-1, {lim}) (-1: unused slot; positions within the row's own "
              f"sequence) at row {tuple(where)}", f"values from {int(row.min())} to {int(row.max())}")


def row_key_lengths(cu_q: torch.Tensor, cu_k: torch.Tensor, total_q: int, device) -> torch.Tensor:
    """int64 (T,): the key length of each packed row's sequence (-1 past cu_seqlens[-1]). No sync."""
    rows = torch.arange(total_q, device=device)
    seq = torch.searchsorted(cu_q, rows.to(cu_q.dtype), right=True) - 1
    seq = seq.clamp(max=cu_q.numel() - 2)
    lengths_k = (cu_k[1:] - cu_k[:-1]).long()
    if lengths_k.numel() == 0:
        return torch.full((total_q,), -1, dtype=torch.long, device=device)
    return torch.where(rows < cu_q[-1], lengths_k[seq.clamp(min=0)], -1)


def row_key_limits(problem: IndexerProblem) -> torch.Tensor:
    """int64 problem.row_shape: the last key position each row may see by structure (causality,
    lengths), -1 for a structurally empty row. Device ops, no sync."""
    device = problem.device
    if not problem.is_varlen:
        i = torch.arange(problem.seqlen_q, device=device)
        last = torch.full_like(i, problem.seqlen_k - 1)
        if problem.causal:
            last = torch.minimum(last, i + problem.seqlen_k - problem.seqlen_q)
        return last.clamp(min=-1).expand(problem.batch, -1)
    cu_q, cu_k, total = problem.cu_seqlens_q, problem.cu_seqlens_k, problem.total_q
    rows = torch.arange(total, device=device)
    seq = (torch.searchsorted(cu_q, rows.to(cu_q.dtype), right=True) - 1).clamp(min=0, max=max(cu_q.numel() - 2, 0))
    len_k = row_key_lengths(cu_q, cu_k, total, device)
    last = len_k - 1
    if problem.causal and cu_q.numel() > 1:
        len_q = (cu_q[1:] - cu_q[:-1]).long()[seq]
        local = rows - cu_q[:-1].long()[seq]
        last = torch.minimum(last, local + len_k - len_q)
    return torch.where(len_k > 0, last, -1).clamp(min=-1)


def nonempty_row_count(problem: IndexerProblem, topk_indices: torch.Tensor | None):
    """What "mean" divides by: the rows with a non-empty allowed set, at least 1, from the structure
    (lengths, causality, the selected indices), never from loss values. A host int for the dense
    stage when the lengths are known on the host, else a device tensor (no sync)."""
    if topk_indices is None and problem.host_lengths:
        rows = 0
        for len_q, len_k in problem.host_lengths:
            if len_k > 0:
                rows += min(len_q, len_k) if problem.causal else len_q  # causal row i sees keys iff i >= len_q - len_k
        return max(rows, 1)
    last = row_key_limits(problem)
    if topk_indices is None:
        return torch.count_nonzero(last >= 0).clamp(min=1)
    selected = (topk_indices >= 0) & (topk_indices <= last[..., None])
    return torch.count_nonzero(selected.any(-1)).clamp(min=1)


def new_outputs(problem: IndexerProblem):
    """Uninitialized (loss_rows, head_lse, index_lse) float32 (`base.new_float32`: NaN-filled under
    `base.poison_outputs()`, so that a row a backend never writes shows). head_lse is None when the
    caller gave `lse`."""
    head_lse = None if problem.lse_given else base.new_float32(problem.lse_shape, problem.device)
    return base.new_float32(problem.row_shape, problem.device), head_lse, base.new_float32(problem.row_shape,
                                                                                            problem.device)


# ------------------------------------------------------------------------------ backends
#: name -> module, or the reason it has none. No lock: imports are serialized by Python's import lock,
#: and two threads racing here store the same module (or the same reason).
_MODULES: dict[str, object] = {}


def backend_module(name: str):
    """The indexer module of backend `name`, or a str saying why there is none."""
    found = _MODULES.get(name)
    if found is not None:
        return found
    module_name = INDEXER_MODULES[name]
    try:
        found = importlib.import_module(module_name)
    except ModuleNotFoundError as error:
        if error.name == module_name:
            found = f"the indexer loss is not implemented in this backend (no module {module_name})"
        else:
            found = f"{module_name} cannot be imported ({error})"
    except ImportError as error:
        found = f"{module_name} cannot be imported ({error})"
    _MODULES[name] = found
    return found


def backend_reasons(name: str, problem: IndexerProblem | None = None) -> list[str]:
    """Why backend `name` cannot serve `problem` (or run at all here, when problem is None)."""
    module = backend_module(name)
    if isinstance(module, str):
        return [module]
    reasons = list(dispatch.get_backend(name).environment_reasons())
    if problem is not None:
        reasons += [r for r in module.not_supported_reasons(problem) if r not in reasons]
    return reasons


def _requested(backend: str | None) -> str:
    try:
        return dispatch.requested_backend(backend)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("streamkl.kl:", "streamkl.indexer_kl:")) from None


def choose_backend(problem: IndexerProblem, backend: str | None) -> str:
    """The backend name to run: `backend` > $STREAMKL_BACKEND > auto (SPEC 5)."""
    name = _requested(backend)
    if name != "auto":
        reasons = backend_reasons(name, problem)
        if reasons:
            raise ValueError(f"streamkl.indexer_kl: backend {name!r} cannot serve these inputs "
                             f"({problem.describe()}): " + "; ".join(reasons))
        return name
    on_cuda = problem.device.type == "cuda"
    refusals = []
    for candidate in dispatch.PRIORITY:
        needs_cuda = dispatch.get_backend(candidate).needs_cuda
        reasons = backend_reasons(candidate, problem)
        if not reasons and needs_cuda and not on_cuda:
            reasons = ["inputs are not on a CUDA device (auto never picks an interpreted GPU kernel)"]
        if not reasons:
            return candidate
        refusals.append(f"{candidate}: " + "; ".join(reasons))
    raise ValueError("streamkl.indexer_kl: no backend can serve these inputs: " + " | ".join(refusals))


# ------------------------------------------------------------------------------ custom ops
def _unpack(q, k, qi, ki, w, lse, topk, cu_q, cu_k, ints, floats) -> IndexerProblem:
    return make_problem(q, k, qi, ki, w, lse, topk, cu_q, cu_k, floats[0], bool(ints[0]), ints[1], ints[2])


def _op_backend(problem: IndexerProblem, backend: str):
    """The module serving an op: `backend` as the eager front end chose it, or "auto" under
    torch.compile (the choice imports modules, which traced code cannot; it is made here, at run time,
    the same way for the forward and the backward)."""
    return backend_module(backend if backend in INDEXER_MODULES else choose_backend(problem, backend))


@torch.library.custom_op("streamkl::indexer_forward", mutates_args=())
def indexer_forward_op(
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    ints: list[int],
    floats: list[float],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_rows, head_lse, index_lse); head_lse is an empty tensor when `lse` is given (an op's
    output may not alias its input: the caller keeps `lse` itself)."""
    problem = _unpack(q, k, qi, ki, w, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, ints, floats)
    loss_rows, head_lse, index_lse = _op_backend(problem, backend).forward(problem, q, k, qi, ki, w, lse, topk_indices)
    if lse is not None:
        head_lse = lse.new_empty(0)
    return loss_rows, head_lse, index_lse


@indexer_forward_op.register_fake
def _(q, k, qi, ki, w, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, ints, floats, backend):
    varlen = cu_seqlens_q is not None
    rows = (q.shape[0],) if varlen else (q.shape[0], q.shape[1])
    lse_shape = (q.shape[-2], q.shape[0]) if varlen else (q.shape[0], q.shape[2], q.shape[1])
    if lse is not None:
        lse_shape = (0,)
    new = lambda shape: q.new_empty(shape, dtype=torch.float32)  # noqa: E731
    return new(rows), new(lse_shape), new(rows)


@torch.library.custom_op("streamkl::indexer_backward", mutates_args=())
def indexer_backward_op(
    grad_rows: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    topk_indices: torch.Tensor | None,
    head_lse: torch.Tensor,
    index_lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    ints: list[int],
    floats: list[float],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dqi, dki, dw) in the input dtype. grad_rows float32, 0 on empty rows."""
    problem = _unpack(q, k, qi, ki, w, None, topk_indices, cu_seqlens_q, cu_seqlens_k, ints, floats)
    return tuple(_op_backend(problem, backend).backward(problem, q, k, qi, ki, w, topk_indices, head_lse, index_lse,
                                                  grad_rows))


@indexer_backward_op.register_fake
def _(grad_rows, q, k, qi, ki, w, topk_indices, head_lse, index_lse, cu_q, cu_k, ints, floats, backend):
    return torch.empty_like(qi), torch.empty_like(ki), torch.empty_like(w)


def _setup_context(ctx, inputs, output):
    q, k, qi, ki, w, lse, topk, cu_q, cu_k, ints, floats, backend = inputs
    _, head_lse, index_lse = output
    ctx.save_for_backward(q, k, qi, ki, w, topk, lse if lse is not None else head_lse, index_lse, cu_q, cu_k)
    ctx.ints, ctx.floats, ctx.backend = ints, floats, backend


def _backward(ctx, grad_rows, grad_head_lse, grad_index_lse):
    q, k, qi, ki, w, topk, head_lse, index_lse, cu_q, cu_k = ctx.saved_tensors
    needs = ctx.needs_input_grad[2:5]
    if grad_rows is None or not any(needs):
        return (None,) * 12
    # an empty row's loss is 0 whatever its scores: its gradient is exactly 0 (index_lse = -inf there)
    grad_rows = torch.where(index_lse == NEG_INF, 0.0, grad_rows.float())
    dqi, dki, dw = torch.ops.streamkl.indexer_backward(
        grad_rows, q, k, qi, ki, w, topk, head_lse, index_lse, cu_q, cu_k, ctx.ints, ctx.floats, ctx.backend
    )
    grads = [g if need else None for g, need in zip((dqi, dki, dw), needs)]
    return (None, None, *grads) + (None,) * 7


torch.library.register_autograd("streamkl::indexer_forward", _backward, setup_context=_setup_context)


@torch.library.custom_op("streamkl::indexer_loss_and_gradients", mutates_args=())
def indexer_loss_and_gradients_op(
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    lse: torch.Tensor | None,
    topk_indices: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    weights: torch.Tensor,
    ints: list[int],
    floats: list[float],
    backend: str,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sum_i weights_i loss_i, and its gradients dqi, dki, dw in the input dtype): a mean's or a
    sum's loss with its gradients formed in the forward, for a call whose backward will come. A
    backend's `forward_with_gradients` does it in fewer passes; otherwise its forward, then its
    backward."""
    problem = _unpack(q, k, qi, ki, w, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, ints, floats)
    module = _op_backend(problem, backend)
    fused = getattr(module, "forward_with_gradients", None)
    if fused is not None:
        loss_rows, _, _, dqi, dki, dw = fused(problem, q, k, qi, ki, w, lse, topk_indices, weights)
    else:
        loss_rows, head_lse, index_lse = module.forward(problem, q, k, qi, ki, w, lse, topk_indices)
        grad_rows = torch.where(index_lse == NEG_INF, 0.0, weights)
        dqi, dki, dw = module.backward(problem, q, k, qi, ki, w, topk_indices,
                                       head_lse if lse is None else lse, index_lse, grad_rows)
    return (loss_rows * weights).sum(), dqi, dki, dw


@indexer_loss_and_gradients_op.register_fake
def _(q, k, qi, ki, w, lse, topk_indices, cu_seqlens_q, cu_seqlens_k, weights, ints, floats, backend):
    return q.new_empty((), dtype=torch.float32), torch.empty_like(qi), torch.empty_like(ki), torch.empty_like(w)


def _setup_gradients_context(ctx, inputs, output):
    ctx.save_for_backward(*output[1:])
    # the gradient outputs are the op's own (nothing upstream uses them): no zeros for their gradients
    ctx.set_materialize_grads(False)
    ctx.spent = False


def _gradients_backward(ctx, grad_loss, *unused):
    """The saved gradients times the upstream scalar, scaled in place: no second copy of
    the gradients. The graph is therefore good for one backward."""
    needs = ctx.needs_input_grad[2:5]
    if grad_loss is None or not any(needs):
        return (None,) * 13
    if ctx.spent:
        raise RuntimeError(
            "streamkl.indexer_kl: this loss was already backpropagated. With reduction 'mean' or 'sum' its "
            "gradients are formed in the forward and scaled in place by the backward, so its graph serves one "
            "backward (retain_graph=True does not keep them). For several backwards through one graph, take "
            "reduction='none' and reduce the rows yourself."
        )
    ctx.spent = True
    dqi, dki, dw = ctx.saved_tensors
    grads = [g.mul_(grad_loss) if need else None for g, need in zip((dqi, dki, dw), needs)]
    return (None, None, *grads) + (None,) * 8


torch.library.register_autograd("streamkl::indexer_loss_and_gradients", _gradients_backward,
                                setup_context=_setup_gradients_context)


# ------------------------------------------------------------------------------ the public call
def indexer_kl(
    q: torch.Tensor,
    k: torch.Tensor,
    qi: torch.Tensor,
    ki: torch.Tensor,
    w: torch.Tensor,
    *,
    scale: float | None = None,
    lse: torch.Tensor | None = None,
    causal: bool = True,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    max_seqlen_k: int | None = None,
    topk_indices: torch.Tensor | None = None,
    reduction: str = "mean",
    backend: str | None = None,
) -> torch.Tensor:
    """The DSA indexer loss KL(T || S) per query row (SPEC section 8), reduced by `reduction`.

    T is the mean over the teacher's H heads of softmax(scale * q_h k_g(h)^T) (GQA keys), S the
    softmax of the indexer logits z = sum_t w_t * relu(qi_t ki^T); both over the keys each row may
    see (causal bottom-right, varlen sequences, and with `topk_indices` only the row's selected
    keys, -1 for an unused slot, repeats counted once). Dense layout `q (B, Nq, H, D)`,
    `k (B, Nk, Hk, D)`, `qi (B, Nq, Hi, Di)`, `ki (B, Nk, Di)`, `w (B, Nq, Hi)`,
    `topk_indices (B, Nq, K)` int32; varlen drops B and passes `cu_seqlens`.

    `lse`: the teacher's per-head logsumexp (float32, (B, H, Nq) or (H, T)), used as is; in the
    top-k stage it must be the lse over the selected keys (what the sparse attention computes).

    Gradients flow to `qi`, `ki` and `w` only: the teacher (`q`, `k`, `lse`) is a constant, and no
    gradient reaches it even when it requires grad. An empty row has loss 0 and gradient 0;
    "mean" divides by the rows whose allowed set is non-empty. Returns float32: a scalar, or
    (B, Nq) / (T,) with `reduction="none"`.
    """
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        _fail("reduction", f"one of {REDUCTIONS}", repr(reduction))
    problem = build_indexer_problem(
        q, k, qi, ki, w, scale=scale, lse=lse, causal=causal, cu_seqlens=cu_seqlens, cu_seqlens_k=cu_seqlens_k,
        max_seqlen=max_seqlen, max_seqlen_k=max_seqlen_k, topk_indices=topk_indices, check_values=_may_sync(),
    )  # fmt: skip
    # under torch.compile the ops choose at run time (`_op_backend`): tracing cannot import modules
    name = _requested(backend) if torch.compiler.is_compiling() else choose_backend(problem, backend)
    ints = [int(problem.causal), problem.seqlen_q, problem.seqlen_k]
    if reduction != "none" and torch.is_grad_enabled() and (qi.requires_grad or ki.requires_grad or w.requires_grad):
        # the upstream gradient is one scalar: the gradients are formed with the loss, and the
        # backward scales them
        rows = qi.shape[:-2]
        weights = torch.ones(rows, dtype=torch.float32, device=qi.device)
        if reduction == "mean":
            weights = weights / nonempty_row_count(problem, topk_indices)
        loss, _, _, _ = torch.ops.streamkl.indexer_loss_and_gradients(
            q.detach(), k.detach(), qi, ki, w, None if lse is None else lse.detach(), topk_indices,
            problem.cu_seqlens_q, problem.cu_seqlens_k, weights, ints, [problem.scale], name,
        )  # fmt: skip
        return loss
    # the teacher is a constant: detached, so autograd neither tracks it nor asks for its gradient
    loss_rows, _, _ = torch.ops.streamkl.indexer_forward(
        q.detach(), k.detach(), qi, ki, w, None if lse is None else lse.detach(), topk_indices,
        problem.cu_seqlens_q, problem.cu_seqlens_k, ints, [problem.scale], name,
    )  # fmt: skip
    if reduction == "none":
        return loss_rows
    if reduction == "sum":
        return loss_rows.sum()
    return loss_rows.sum() / nonempty_row_count(problem, topk_indices)
