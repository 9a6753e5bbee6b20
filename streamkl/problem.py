"""The description of one KL problem: shapes, scales, masks, varlen metadata.

All argument validation of `streamkl.kl` lives here, once. Checks read only metadata (shapes,
dtypes, devices, strides); the few checks that read tensor values (`cu_seqlens` contents) are
skipped when the caller cannot read values (under torch.compile or a CUDA-graph capture).
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass, field

import torch

from streamkl._cache import LRUCache
from streamkl._constants import MAX_INT32

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
REDUCTIONS = ("none", "sum", "mean")
NAMES = ("q1", "k1", "q2", "k2")


@dataclass(frozen=True)
class SideMask:
    """One side's block-sparse pattern, in the form kernels read: a dense block grid."""

    pattern: torch.Tensor  # bool (Bm in {1, S}, Hm in {1, H}, ceil(Nq/bq), ceil(Nk/bk))
    block_q: int
    block_k: int


@dataclass(frozen=True, eq=False)
class Problem:
    """Everything a backend needs to know about the call, apart from the tensors themselves.

    `key` is a hashable tuple of plain values that identifies the problem: every structural field,
    the dtype and device, and `(id, _version)` of the cu_seqlens and mask pattern tensors (the
    Problem holds them, so their ids are not reused while it lives). Backends key their own caches
    by it.
    """

    batch: int  # B for dense inputs, the number of sequences S for varlen
    seqlen_q: int  # Nq, or max_seqlen for varlen
    seqlen_k: int  # Nk, or max_seqlen_k for varlen
    heads: int  # query heads H
    heads_k1: int
    heads_k2: int
    dim1: int
    dim2: int
    scale1: float
    scale2: float
    causal: bool
    window: tuple[int, int]
    dtype: torch.dtype
    device: torch.device
    is_varlen: bool = False
    total_q: int = 0  # T (varlen only)
    total_k: int = 0  # Tk (varlen only)
    cu_seqlens_q: torch.Tensor | None = None
    cu_seqlens_k: torch.Tensor | None = None
    mask1: SideMask | None = None
    mask2: SideMask | None = None
    needs_grad: tuple[bool, bool, bool, bool] = (False, False, False, False)
    deterministic: bool = False
    #: cu_seqlens[-1] when the front end read it on the host (varlen rows from here on belong to no
    #: sequence: `backends.base.write_tail_rows`); None: not known on the host.
    tail_start_q: int | None = None
    #: CPU int64 copies of cu_seqlens_q / cu_seqlens_k when known on the host (no device read).
    host_cu_seqlens_q: torch.Tensor | None = None
    host_cu_seqlens_k: torch.Tensor | None = None
    key: tuple = ()
    #: what was derived from this problem alone (its backend per environment, its tile schedule,
    #: the Triton backend's plans), outside torch.compile. A Problem is immutable and its key names every tensor
    #: version, so a changed tensor makes a new Problem with an empty memo.
    memo: dict = field(default_factory=dict, init=False, compare=False, repr=False)

    @property
    def has_structural_mask(self) -> bool:
        return self.causal or self.window != (-1, -1)

    @property
    def row_shape(self) -> tuple[int, ...]:
        """Shape of the per-row KL output."""
        if self.is_varlen:
            return (self.total_q, self.heads)
        return (self.batch, self.seqlen_q, self.heads)

    @property
    def lse_shape(self) -> tuple[int, ...]:
        if self.is_varlen:
            return (self.heads, self.total_q)
        return (self.batch, self.heads, self.seqlen_q)

    def describe(self) -> str:
        parts = [
            f"B{self.batch}",
            f"Nq{self.seqlen_q}",
            f"Nk{self.seqlen_k}",
            f"H{self.heads}",
            f"Hk{self.heads_k1}/{self.heads_k2}",
            f"D{self.dim1}x{self.dim2}",
            str(self.dtype).replace("torch.", ""),
        ]
        if self.is_varlen:
            parts.append("varlen")
        if self.causal:
            parts.append("causal")
        if self.window != (-1, -1):
            parts.append(f"window{self.window}")
        if self.mask1 is not None or self.mask2 is not None:
            parts.append("blockmask")
        return "-".join(parts)


def _fail(argument: str, expected: str, got: object, cls: type[Exception] = ValueError):
    raise cls(f"streamkl.kl: `{argument}` must be {expected}; got {got}.")


def check_output_options(reduction: object, return_lse: object) -> None:
    """The arguments that shape the output rather than the problem."""
    if not isinstance(reduction, str) or reduction not in REDUCTIONS:
        _fail("reduction", f"one of {REDUCTIONS}", repr(reduction))
    _check_bool("return_lse", return_lse)


def _check_bool(name: str, value: object) -> bool:
    """A Python bool or a numpy bool (`np.bool_`), as a Python bool."""
    if isinstance(value, bool):
        return value
    if type(value).__module__ == "numpy" and type(value).__name__ in ("bool_", "bool"):
        return bool(value)
    _fail(name, "a bool", f"{type(value).__module__}.{type(value).__name__}", TypeError)


def _check_tensor(name: str, t: object, ndim: int, layout: str, dtypes=FLOAT_DTYPES) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"a torch.Tensor of shape {layout}", type(t).__name__, TypeError)
    if t.layout != torch.strided or t.is_nested:
        _fail(name, "a dense strided tensor (not sparse or nested)", f"layout {t.layout}", TypeError)
    if t.device.type == "meta":
        _fail(name, "a tensor with data (on a CPU or GPU device; meta tensors have none)", "a meta tensor")
    if t.dtype not in dtypes:
        _fail(name, "float16, bfloat16 or float32", t.dtype, TypeError)
    shape = t.shape
    if len(shape) != ndim:
        hint = ""
        if ndim == 3 and t.dim() == 4:
            hint = " (varlen inputs are packed: drop the batch dimension, see streamkl.varlen.pack)"
        elif ndim == 4 and t.dim() == 3:
            hint = " (3-D inputs are packed sequences: pass cu_seqlens)"
        _fail(name, f"{ndim}-D {layout}{hint}", f"shape {tuple(shape)}")
    if shape[-1] == 0:
        _fail(name, "a tensor with head dimension >= 1", f"shape {tuple(shape)}")
    if t.stride(-1) != 1:
        _fail(name, "contiguous in its last (head) dimension", f"strides {t.stride()}")
    return t


def _check_scale(name: str, scale: object, dim: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(dim)
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
        _fail(name, "a Python float or None", type(scale).__name__, TypeError)
    try:
        value = float(scale)
    except OverflowError:  # an int beyond float range
        value = math.inf
    if not math.isfinite(value):
        _fail(name, "finite", scale if isinstance(scale, float) else f"an int of {int(scale).bit_length()} bits")
    return value


def _check_window(window: object) -> tuple[int, int]:
    if (
        not isinstance(window, (tuple, list))
        or len(window) != 2
        or not all(isinstance(w, int) and not isinstance(w, bool) for w in window)
    ):
        _fail("window", "a pair of ints (left, right)", repr(window), TypeError)
    left, right = int(window[0]), int(window[1])
    if left < -1 or right < -1:
        _fail("window", "(left, right) with each >= 0, or -1 for unbounded", (left, right))
    if left > MAX_INT32 or right > MAX_INT32:
        _fail("window", "(left, right) with each at most 2**31 - 1 (use -1 for unbounded)", (left, right))
    return left, right


def _check_cu_seqlens_meta(name: str, cu: object, total: int, device: torch.device) -> torch.Tensor:
    if not isinstance(cu, torch.Tensor):
        _fail(name, "an int32 torch.Tensor of shape (num_sequences + 1,)", type(cu).__name__, TypeError)
    if cu.dtype != torch.int32:
        _fail(name, "int32 (use .to(torch.int32))", cu.dtype, TypeError)
    if cu.dim() != 1 or cu.numel() < 1:
        _fail(name, "1-D of shape (num_sequences + 1,)", f"shape {tuple(cu.shape)}")
    if cu.device != device:
        _fail(name, f"on the inputs' device {device}", cu.device)
    if cu.stride(0) != 1 and cu.numel() > 1:  # kernels index it as a flat array
        _fail(name, "contiguous (use .contiguous())", f"stride {cu.stride()}")
    return cu


def check_cu_seqlens_values(name: str, cu: torch.Tensor, total: int) -> int:
    """Value checks on cu_seqlens: start at 0, non-decreasing, last entry <= total. One host sync
    the first time a table is seen (`host_values`).

    Returns the longest sequence length, so that a given `max_seqlen` can be checked against it."""
    return _check_cu_seqlens_host(name, host_values(cu), total)


_HOST_VALUES = LRUCache(32)


def _host_key(cu: torch.Tensor) -> tuple:
    return id(cu), cu._version, cu.data_ptr(), cu.numel()


def host_values(cu: torch.Tensor) -> torch.Tensor:
    """cu_seqlens as a CPU int64 tensor, cached per table (id, version, address; the cache keeps the
    table alive): a training loop that passes the same table again pays no device copy and sync. A
    table changed in place through torch moves its version and is read again."""
    key = _host_key(cu)
    hit = _HOST_VALUES.get(key)
    if hit is not None:
        return hit[0]
    values = cu.detach().to("cpu", torch.int64)
    _HOST_VALUES.put(key, (values, cu))
    return values


def known_host_values(cu: torch.Tensor) -> torch.Tensor | None:
    """The cached host copy of a table seen (and checked) before, or None: no device read. Used where
    values may not be read (CUDA-graph capture), so a captured step and its eager twin take the same
    arithmetic; never while compiling (fake tensors)."""
    if torch.compiler.is_compiling():
        return None
    hit = _HOST_VALUES.get(_host_key(cu))
    return None if hit is None else hit[0]


def _check_cu_seqlens_host(
    name: str, values: torch.Tensor, total: int, what: str = "packed length", note: str = ""
) -> int:
    if int(values[0]) != 0:
        _fail(name, "a cumulative length table starting at 0", f"first entry {int(values[0])}")
    lengths = values[1:] - values[:-1]
    if lengths.numel() > 0 and bool((lengths < 0).any()):
        first = int((lengths < 0).nonzero()[0, 0])
        _fail(
            name,
            "non-decreasing (cumulative sequence lengths)",
            f"{int(values[first + 1])} after {int(values[first])} at index {first + 1}",
        )
    if int(values[-1]) > total:
        _fail(name, f"at most the {what} {total} in its last entry{note}", int(values[-1]))
    return int(lengths.max()) if lengths.numel() > 0 else 0


def max_seqlen_of(cu: torch.Tensor) -> int:
    """Longest sequence in a cu_seqlens table (one host sync)."""
    if cu.numel() < 2:
        return 0
    return int((cu[1:] - cu[:-1]).max().item())


def _check_max_seqlen(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(name, "a Python int or None", type(value).__name__, TypeError)
    if value < 0:
        _fail(name, ">= 0", value)
    return int(value)


def _side_mask(name: str, mask: object, batch: int, heads: int, seqlen_q: int, seqlen_k: int, device, varlen: bool,
               causal: bool, window: tuple[int, int]) -> SideMask | None:
    if mask is None:
        return None
    from streamkl.sparse.block_mask import BlockMask

    if not isinstance(mask, BlockMask):
        _fail(name, "a streamkl.BlockMask or None", type(mask).__name__, TypeError)
    if mask.device != device:
        _fail(name, f"on the inputs' device {device} (use mask.to(device))", mask.device)
    bq, bk = mask.block_size
    mb, mh, nbq, nbk = mask.shape
    want = (math.ceil(seqlen_q / bq), math.ceil(seqlen_k / bk))
    if mb not in (1, batch) or mh not in (1, heads) or (nbq, nbk) != want:
        _fail(
            name,
            f"a BlockMask of shape (1 or {batch}, 1 or {heads}, {want[0]}, {want[1]}) for block size "
            f"{(bq, bk)} and {seqlen_q} queries x {seqlen_k} keys"
            + (" (max_seqlen x max_seqlen_k; blocks count from each sequence's start)" if varlen else ""),
            f"shape {(mb, mh, nbq, nbk)}",
        )
    if mask.element_window is not None:
        _check_element_window(name, mask, seqlen_q, seqlen_k, causal, window)
    try:  # a mask built from compressed parts is checked when first expanded
        pattern = mask.to_dense()
    except ValueError as error:
        _fail(name, "a valid BlockMask", error)
    return SideMask(pattern=pattern, block_q=bq, block_k=bk)


def fold_causal(causal: bool, window: tuple[int, int]) -> tuple[int, int]:
    """The (left, right) window that `causal` and `window` together allow (-1: unbounded)."""
    left, right = window
    if causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def _check_element_window(name, mask, seqlen_q: int, seqlen_k: int, causal: bool, window: tuple[int, int]) -> None:
    """A mask from a FlexAttention mask_mod that masks elements (causal, a window) needs the call to
    apply that element mask: streamkl applies element masks only through `causal` and `window`."""
    left, right = mask.element_window
    if mask.element_seqlens != (seqlen_q, seqlen_k):
        _fail(name, f"used with the lengths its FlexAttention mask_mod was read for {mask.element_seqlens}",
              (seqlen_q, seqlen_k))
    if fold_causal(causal, window) != (left, right):
        if left == -1 and right == 0:
            what = "causal=True (and window=(-1, -1))"
        else:
            what = f"window=({left}, {right}) (and causal=False)"
        _fail(name, f"used with the element mask of its FlexAttention mask_mod: pass {what}",
              f"causal={causal}, window={window}")


_PROBLEMS = LRUCache(32)
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_OPTION_TYPES = (type(None), bool, int, float)


def _call_key(tensors, options: tuple, objects: tuple):
    """The memo key of a call (`build_problem`), or None where one is not taken: every input's
    metadata that validation reads (type, shape, strides, dtype, device, requires_grad), the
    options (the window a tuple of two ints, the others None, bools, ints or floats) with their
    types (True is not 1), and the cu_seqlens and masks by identity and version (the memo keeps
    them alive, so their ids are not reused; a tensor changed in place moves its version)."""
    parts = []
    for t in tensors:
        if t.__class__ not in _TENSOR_TYPES:
            return None
        try:  # (a sparse or nested tensor has no strides: validated each time)
            parts.append((t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
        except RuntimeError:
            return None
    window = options[0]
    if window.__class__ is not tuple or len(window) != 2 or window[0].__class__ is not int \
            or window[1].__class__ is not int:
        return None  # (a list, or not ints: validated each time)
    rest = []
    for o in options[1:]:
        if o.__class__ not in _OPTION_TYPES:
            return None
        rest.append((o.__class__, o))
    states = []
    for o in objects:
        if o is None:
            states.append(None)
        elif o.__class__ in _TENSOR_TYPES:
            states.append((id(o), o._version))
        elif o.__class__ is _block_mask_class():
            states.append((id(o), o._source_state()))
        else:
            return None
    return tuple(parts), window, tuple(rest), tuple(states)


@functools.cache
def _block_mask_class() -> type:
    from streamkl.sparse.block_mask import BlockMask  # (it imports this module)

    return BlockMask


def build_problem(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    *,
    scale1: float | None = None,
    scale2: float | None = None,
    causal: bool = False,
    window: tuple[int, int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen: int | None = None,
    max_seqlen_k: int | None = None,
    mask1=None,
    mask2=None,
    deterministic: bool = False,
    check_values: bool = True,
    allow_float64: bool = False,
) -> Problem:
    """Validate every argument of `streamkl.kl` and describe the call. Reads no tensor data
    except `cu_seqlens` contents when `check_values` (and `max_seqlen*` when omitted).

    A call whose every input has the metadata of a call validated before, with the same options
    and the same cu_seqlens and masks (same objects, unchanged: same versions), takes that call's
    Problem (the validation reads nothing else). Never while compiling (fake tensors)."""
    key = None
    objects = (cu_seqlens, cu_seqlens_k, mask1, mask2)
    if not torch.compiler.is_compiling():
        options = (window, scale1, scale2, causal, max_seqlen, max_seqlen_k, deterministic, check_values,
                   allow_float64)
        key = _call_key((q1, k1, q2, k2), options, objects)
        hit = None if key is None else _PROBLEMS.get(key)
        if hit is not None:
            return hit[0]
    problem = _build_problem(q1, k1, q2, k2, scale1, scale2, causal, window, cu_seqlens, cu_seqlens_k, max_seqlen,
                             max_seqlen_k, mask1, mask2, deterministic, check_values, allow_float64)
    if key is not None:
        _PROBLEMS.put(key, (problem, objects))  # (objects kept alive: their ids stay theirs)
    return problem


def _build_problem(q1, k1, q2, k2, scale1, scale2, causal, window, cu_seqlens, cu_seqlens_k, max_seqlen,
                   max_seqlen_k, mask1, mask2, deterministic, check_values, allow_float64) -> Problem:
    """`build_problem`'s validation and description, every call."""
    if cu_seqlens is None and cu_seqlens_k is not None:
        _fail("cu_seqlens", "given when cu_seqlens_k is (cu_seqlens_k defaults to cu_seqlens, not the reverse)", None)
    is_varlen = cu_seqlens is not None
    ndim, layout = (3, "(T, H, D)") if is_varlen else (4, "(B, N, H, D)")
    dtypes = FLOAT_DTYPES + ((torch.float64,) if allow_float64 else ())  # float64: the reference only
    tensors = [_check_tensor(n, t, ndim, layout, dtypes) for n, t in zip(NAMES, (q1, k1, q2, k2), strict=True)]
    q1, k1, q2, k2 = tensors
    dtype, device = q1.dtype, q1.device
    for n, t in zip(NAMES[1:], tensors[1:], strict=True):
        if t.dtype != dtype:
            _fail(n, f"the same dtype as q1 ({dtype})", t.dtype, TypeError)
        if t.device != device:
            _fail(n, f"on the same device as q1 ({device})", t.device)
    causal = _check_bool("causal", causal)
    deterministic = _check_bool("deterministic", deterministic)
    window = _check_window(window)

    lead = 1 if is_varlen else 2  # leading (batch, length) dims, then heads, dim
    if q2.shape[:lead] != q1.shape[:lead]:
        _fail(
            "q2",
            f"the same {'length' if is_varlen else 'batch and length'} as q1 {tuple(q1.shape[:lead])}",
            tuple(q2.shape[:lead]),
        )
    if q2.shape[-2] != q1.shape[-2]:
        _fail("q2", f"the same number of heads as q1 ({q1.shape[-2]})", q2.shape[-2])
    if k2.shape[:lead] != k1.shape[:lead]:
        _fail(
            "k2",
            f"the same {'length' if is_varlen else 'batch and length'} as k1 {tuple(k1.shape[:lead])}",
            tuple(k2.shape[:lead]),
        )
    if not is_varlen and k1.shape[0] != q1.shape[0]:
        _fail("k1", f"the same batch size as q1 ({q1.shape[0]})", k1.shape[0])
    heads = q1.shape[-2]
    if heads < 1:
        _fail("q1", "at least one head", heads)
    for name, q, k in (("k1", q1, k1), ("k2", q2, k2)):
        if k.shape[-1] != q.shape[-1]:
            _fail(name, f"of head dim {q.shape[-1]}, the head dim of q{name[1]}", k.shape[-1])
        hk = k.shape[-2]
        if hk < 1 or heads % hk != 0:
            _fail(name, f"a number of key heads dividing the {heads} query heads (GQA)", hk)
    dim1, dim2 = q1.shape[-1], q2.shape[-1]
    scale1 = _check_scale("scale1", scale1, dim1)
    scale2 = _check_scale("scale2", scale2, dim2)

    if is_varlen:
        total_q, total_k = q1.shape[0], k1.shape[0]
        cu_q = _check_cu_seqlens_meta("cu_seqlens", cu_seqlens, total_q, device)
        cu_k = cu_q if cu_seqlens_k is None else _check_cu_seqlens_meta("cu_seqlens_k", cu_seqlens_k, total_k, device)
        if cu_k.numel() != cu_q.numel():
            _fail("cu_seqlens_k", f"the same number of sequences as cu_seqlens ({cu_q.numel() - 1})", cu_k.numel() - 1)
        # type checks first: a bad max_seqlen must not cost a host sync
        given_q = None if max_seqlen is None else _check_max_seqlen("max_seqlen", max_seqlen)
        given_k = None if max_seqlen_k is None else _check_max_seqlen("max_seqlen_k", max_seqlen_k)
        # no sequence is longer than the packed length: a larger bound only inflates the tile grid
        if given_q is not None and given_q > total_q:
            _fail("max_seqlen", f"at most the packed length T = {total_q} of q1 (no sequence is longer)", given_q)
        if given_k is not None and given_k > total_k:
            _fail("max_seqlen_k", f"at most the packed length Tk = {total_k} of k1", given_k)
        if given_k is None and cu_seqlens_k is None and given_q is not None and given_q > total_k:
            _fail("max_seqlen", f"at most the packed key length Tk = {total_k} (cu_seqlens also delimits the "
                  "keys)", given_q)
        longest_q = longest_k = tail_start = None
        values_q = values_k = None
        if not check_values:  # no device read; a table checked before is still known on the host
            values_q = known_host_values(cu_q)
            values_k = values_q if cu_k is cu_q else known_host_values(cu_k)
        else:
            values_q = host_values(cu_q)
            values_k = values_q if cu_k is cu_q else host_values(cu_k)
            tail_start = int(values_q[-1])  # rows from here on belong to no sequence
            longest_q = _check_cu_seqlens_host("cu_seqlens", values_q, total_q)
            if cu_k is cu_q:  # cu_seqlens also delimits the keys: it must fit k1's packed length too
                longest_k = _check_cu_seqlens_host(
                    "cu_seqlens", values_q, total_k, "packed key length", " (cu_seqlens_k defaults to cu_seqlens)"
                )
            else:
                longest_k = check_cu_seqlens_values("cu_seqlens_k", cu_k, total_k)
            for name, given, longest, table in (
                ("max_seqlen", given_q, longest_q, "cu_seqlens"),
                ("max_seqlen_k", given_k, longest_k, "cu_seqlens" if cu_k is cu_q else "cu_seqlens_k"),
            ):
                if given is not None and given < longest:
                    _fail(name, f"at least the longest sequence in {table} ({longest})", given)
        if given_q is None:
            given_q = longest_q if longest_q is not None else max_seqlen_of(cu_q)
        if given_k is None:
            if cu_seqlens_k is None:
                given_k = given_q
            else:
                given_k = longest_k if longest_k is not None else max_seqlen_of(cu_k)
        seqlen_q, seqlen_k = given_q, given_k
        batch = cu_q.numel() - 1
    else:
        for name, value in (("max_seqlen", max_seqlen), ("max_seqlen_k", max_seqlen_k)):
            if value is not None:
                _fail(name, "None for dense (4-D) inputs; pass cu_seqlens for packed sequences", type(value).__name__)
        batch, seqlen_q, seqlen_k = q1.shape[0], q1.shape[1], k1.shape[1]
        total_q = total_k = 0
        cu_q = cu_k = tail_start = values_q = values_k = None

    side1 = _side_mask("mask1", mask1, batch, heads, seqlen_q, seqlen_k, device, is_varlen, causal, window)
    side2 = _side_mask("mask2", mask2, batch, heads, seqlen_q, seqlen_k, device, is_varlen, causal, window)
    if values_q is None or values_k is None:
        values_q = values_k = None
    return describe_problem(
        q1, k1, q2, k2, scale1, scale2, causal, window, cu_q, cu_k, seqlen_q, seqlen_k, side1, side2, deterministic,
        tail_start, values_q, values_k,
    )


def structural_row_count(problem: Problem) -> int | None:
    """How many (query row, head) pairs have a non-empty side-1 support, from the structure alone
    (sequence lengths, causality, window), or None where that needs the data: a side-1 block mask,
    or varlen lengths not known on the host (no value check and a table not seen before: torch.compile,
    a CUDA-graph capture of a table never passed eagerly).

    Row i of a sequence (lengths nq, nk, offset nk - nq) sees keys in [i + off - left, i + off +
    right] within [0, nk): non-empty iff nk > 0, i >= -off - right (right bounded) and
    i <= nk - 1 - off + left (left bounded)."""
    if problem.mask1 is not None:
        return None
    if problem.is_varlen:
        if problem.host_cu_seqlens_q is None or problem.host_cu_seqlens_k is None:
            return None
        starts_q = problem.host_cu_seqlens_q.tolist()  # CPU copies: no device read
        starts_k = problem.host_cu_seqlens_k.tolist()
        lengths = [(b - a, d - c) for a, b, c, d in zip(starts_q, starts_q[1:], starts_k, starts_k[1:])]
    else:
        lengths = [(problem.seqlen_q, problem.seqlen_k)] * problem.batch
    left, right = fold_causal(problem.causal, problem.window)
    rows = 0
    for len_q, len_k in lengths:
        if len_k <= 0:
            continue
        offset = len_k - len_q
        first = max(0, -offset - right) if right >= 0 else 0
        last = min(len_q - 1, len_k - 1 - offset + left) if left >= 0 else len_q - 1
        rows += max(0, last - first + 1)
    return rows * problem.heads


def describe_problem(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    scale1: float,
    scale2: float,
    causal: bool,
    window: tuple[int, int],
    cu_q: torch.Tensor | None,
    cu_k: torch.Tensor | None,
    seqlen_q: int,
    seqlen_k: int,
    mask1: SideMask | None,
    mask2: SideMask | None,
    deterministic: bool,
    tail_start_q: int | None = None,
    host_cu_q: torch.Tensor | None = None,
    host_cu_k: torch.Tensor | None = None,
) -> Problem:
    """The `Problem` of arguments already checked by `build_problem`: no validation, no host sync.

    For callers holding the values `build_problem` derived (the custom ops, which get them packed
    from a front end that validated them): `seqlen_q`, `seqlen_k` are `max_seqlen*` for varlen and
    ignored for dense inputs (taken from the shapes)."""
    q1_shape, k1_shape = q1.shape, k1.shape
    is_varlen = cu_q is not None
    if is_varlen:
        batch, total_q, total_k = cu_q.shape[0] - 1, q1_shape[0], k1_shape[0]
    else:
        batch, seqlen_q, seqlen_k = q1_shape[0], q1_shape[1], k1_shape[1]
        total_q = total_k = 0
    heads, heads_k1, heads_k2, dim1, dim2 = q1_shape[-2], k1_shape[-2], k2.shape[-2], q1_shape[-1], q2.shape[-1]
    needs_grad = (q1.requires_grad, k1.requires_grad, q2.requires_grad, k2.requires_grad)
    dtype, device = q1.dtype, q1.device
    key = (batch, seqlen_q, seqlen_k, heads, heads_k1, heads_k2, dim1, dim2, scale1, scale2, causal, window, dtype,
           device, is_varlen, total_q, total_k, needs_grad, deterministic, tail_start_q,
           None if cu_q is None else (id(cu_q), cu_q._version), None if cu_k is None else (id(cu_k), cu_k._version),
           None if mask1 is None else (id(mask1.pattern), mask1.pattern._version, mask1.block_q, mask1.block_k),
           None if mask2 is None else (id(mask2.pattern), mask2.pattern._version, mask2.block_q, mask2.block_k))
    return Problem(
        batch=batch,
        seqlen_q=seqlen_q,
        seqlen_k=seqlen_k,
        heads=heads,
        heads_k1=heads_k1,
        heads_k2=heads_k2,
        dim1=dim1,
        dim2=dim2,
        scale1=scale1,
        scale2=scale2,
        causal=causal,
        window=window,
        dtype=dtype,
        device=device,
        is_varlen=is_varlen,
        total_q=total_q,
        total_k=total_k,
        cu_seqlens_q=cu_q,
        cu_seqlens_k=cu_k,
        mask1=mask1,
        mask2=mask2,
        needs_grad=needs_grad,
        deterministic=deterministic,
        tail_start_q=tail_start_q,
        host_cu_seqlens_q=host_cu_q,
        host_cu_seqlens_k=host_cu_k,
        key=key,
    )
