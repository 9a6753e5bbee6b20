"""The DSA indexer loss (SPEC 8) on the CuPy backend: host side of indexer.cu.

- forward: one block per query row; the teacher's per-head lse in a first pass unless given, then
  one pass for the loss (online lse of the indexer logits, sum T log T and sum T z);
- backward: a row-major kernel owning dqi and dw, a key-major kernel owning dki (its rows: a range
  for the dense stage, key-major lists built here from topk_indices for the top-k stage), so the
  gradients are bitwise reproducible (no atomics).

Inputs are passed by address with explicit strides (no copies). With STREAMKL_CUPY_EMULATE=1 the
kernels run on CPU tensors through indexer_emulate.cpp (tests without a GPU).
"""

from __future__ import annotations

import ctypes
import functools
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from streamkl.backends import base
from streamkl.backends.cupy import emulate
from streamkl.backends.cupy.source import inline_includes, record_dtype

if TYPE_CHECKING:
    from streamkl.indexer import IndexerProblem

_HERE = Path(__file__).parent
SOURCE = _HERE / "indexer.cu"
_EMULATOR_SOURCES = ("indexer.cu", "input.cuh", "indexer_emulate.cpp", "emulate.h", "emulate_runtime.h")
KERNELS = ("indexer_forward", "indexer_backward_row", "indexer_backward_key")
THREADS = 128  # IX_THREADS
CHUNK = 64  # IX_CHUNK
MAX_DIM = 256
MAX_INDEX_DIM = 128
MAX_INDEX_HEADS = 64
MAX_GRID_Y = 65535
INPUT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # STREAMKL_INPUT


# ---------------------------------------------------------------------------------- the record
@functools.lru_cache(maxsize=1)
def params_dtype() -> np.dtype:
    """The NumPy record matching `struct IndexerParams` of indexer.cu, field for field."""
    return record_dtype(SOURCE, "IndexerParams")


def shared_bytes(heads: int, index_heads: int, index_dim: int) -> int:
    """Dynamic shared memory per block, in bytes: the carve-up of ix_shared in indexer.cu."""
    pitch = CHUNK + 1
    floats = (heads + index_heads) * pitch + 2 * CHUNK + 2 * heads + CHUNK + max(index_heads, index_dim) + 6 * CHUNK
    return 4 * floats


# ---------------------------------------------------------------------------------- support
def not_supported_reasons(problem: IndexerProblem) -> list[str]:
    """Empty when these kernels can serve `problem`; otherwise every reason they cannot."""
    from streamkl.backends.cupy import CupyBackend

    reasons = CupyBackend().environment_reasons()
    if reasons:
        return reasons
    if emulate.emulating():
        reasons += _emulator_reasons()
        if problem.device.type != "cpu":
            reasons.append(f"inputs are on {problem.device}; the CPU emulator ({emulate.ENV_VAR}=1) takes CPU tensors")
    elif problem.device.type != "cuda":
        reasons.append(f"inputs are on {problem.device}, not on a CUDA device")
    if problem.dim > MAX_DIM:
        reasons.append(f"teacher head dim is {problem.dim}; the CuPy indexer kernels take at most {MAX_DIM}")
    if problem.index_dim > MAX_INDEX_DIM:
        reasons.append(
            f"indexer head dim is {problem.index_dim}; the CuPy indexer kernels take at most {MAX_INDEX_DIM}"
        )
    if problem.index_heads > MAX_INDEX_HEADS:
        reasons.append(
            f"indexer heads are {problem.index_heads}; the CuPy indexer kernels take at most {MAX_INDEX_HEADS}"
        )
    if problem.dtype not in INPUT_CODES:
        reasons.append(f"dtype {problem.dtype} is not one of float32, float16, bfloat16")
    if problem.batch > MAX_GRID_Y:
        reasons.append(f"{problem.batch} sequences; the CuPy indexer kernels take at most {MAX_GRID_Y}")
    rows = problem.total_q if problem.is_varlen else problem.batch * problem.seqlen_q
    if rows * problem.topk >= 2**31:  # the top-k backward's key-major lists use int32 offsets
        reasons.append(f"{rows} rows x top-{problem.topk} selections; the CuPy indexer kernels take under 2**31")
    if not reasons and problem.device.type == "cuda":
        from streamkl.backends.cupy.launch import shared_memory_limit

        need = shared_bytes(problem.heads, problem.index_heads, problem.index_dim)
        limit = shared_memory_limit(problem.device)
        if need > limit:
            reasons.append(
                f"{problem.heads} teacher heads need {need} bytes of shared memory per block; this GPU allows {limit}"
            )
    return reasons


# ---------------------------------------------------------------------------------- compile, launch
@functools.cache
def _functions(input_code: int, device_index: int):
    """The three kernels for one input dtype on one device, compiled once (NVRTC, input.cuh
    inlined), each allowed the device's largest dynamic shared memory."""
    import cupy

    from streamkl.backends.cupy.launch import shared_memory_limit

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=inline_includes(SOURCE), options=("--std=c++17", f"-DSTREAMKL_INPUT={input_code}"))
        try:
            functions = {name: module.get_function(name) for name in KERNELS}
        except Exception as exc:
            raise RuntimeError(f"streamkl cupy backend: compiling {SOURCE.name} failed: {exc}") from exc
        limit = shared_memory_limit(torch.device("cuda", device_index))
        for function in functions.values():
            function.max_dynamic_shared_size_bytes = limit
    return functions


def _emulator_reasons() -> list[str]:
    missing = [name for name in _EMULATOR_SOURCES if not (_HERE / name).exists()]
    if missing:
        return [f"{emulate.ENV_VAR}=1 needs {', '.join(missing)} next to {__file__}"]
    return []


_EMULATOR_LOCK = threading.Lock()


@functools.cache
def _emulator(input_code: int) -> ctypes.CDLL:
    library = emulate.build(f"indexer-{input_code}", "indexer_emulate.cpp", _EMULATOR_SOURCES,
                            (f"-DSTREAMKL_INPUT={input_code}",))
    if library.emu_params_size() != params_dtype().itemsize:
        raise RuntimeError("IndexerParams layout differs between indexer.cu and indexer.py")
    return library


def _launch(kernel: str, blocks: int, sequences: int, record: np.ndarray, problem: IndexerProblem) -> None:
    if blocks <= 0 or sequences <= 0:  # CuPy would round an empty grid up to one block
        return
    grid = (blocks, sequences, 1)
    smem = shared_bytes(problem.heads, problem.index_heads, problem.index_dim)
    code = INPUT_CODES[problem.dtype]
    if emulate.emulating():
        record = np.ascontiguousarray(record)
        with _EMULATOR_LOCK:  # the emulator's block state is global to its library
            _emulator(code).emu_launch(KERNELS.index(kernel), *grid, THREADS, smem, record.ctypes.data)
        return
    import cupy

    from streamkl.backends.cupy.launch import _cupy_stream

    device = problem.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    function = _functions(code, index)[kernel]
    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index):
        function(grid, (THREADS,), (record,), shared_mem=smem, stream=stream)


# ---------------------------------------------------------------------------------- argument packing
def _set(record: np.ndarray, prefix: str, suffixes: str, values) -> None:
    for suffix, value in zip(suffixes, values):
        record[f"{prefix}_{suffix}"] = value


def _strides(t: torch.Tensor, varlen: bool, count: int) -> tuple[int, ...]:
    """The first `count` strides as (batch, ...); batch stride 0 for packed (batch-less) tensors."""
    strides = tuple(t.stride())
    return (0, *strides[: count - 1]) if varlen else strides[:count]


def _base_record(problem: IndexerProblem, q, k, qi, ki, w, topk_indices, head_lse) -> np.ndarray:
    record = np.zeros(1, dtype=params_dtype())
    varlen = problem.is_varlen
    for name, t, count in (("q", q, 3), ("k", k, 3), ("qi", qi, 3), ("ki", ki, 2), ("w", w, 3)):
        record[name] = t.data_ptr()
        _set(record, name, "bnh"[:count], _strides(t, varlen, count))
    if topk_indices is not None:
        record["topk"] = topk_indices.data_ptr()
        _set(record, "topk", "bns", _strides(topk_indices, varlen, 3))
        record["topk_count"] = topk_indices.shape[-1]
    record["head_lse"] = head_lse.data_ptr()
    _set(record, "lse", "bhn", _strides(head_lse, varlen, 3))
    if varlen:
        record["cu_q"] = problem.cu_seqlens_q.data_ptr()
        record["cu_k"] = problem.cu_seqlens_k.data_ptr()
    record["heads"] = problem.heads
    record["group"] = problem.heads // problem.heads_k
    record["dim"] = problem.dim
    record["index_heads"], record["index_dim"] = problem.index_heads, problem.index_dim
    record["seqlen_q"], record["seqlen_k"] = problem.seqlen_q, problem.seqlen_k
    record["varlen"], record["causal"] = int(varlen), int(problem.causal)
    record["scale"] = problem.scale
    return record


def _new(shape: tuple[int, ...], device: torch.device, fill: float | None = None) -> torch.Tensor:
    """A float32 output the kernels write in full (`base.new_float32`), or filled with `fill`."""
    if fill is not None:
        return torch.full(shape, fill, dtype=torch.float32, device=device)
    return base.new_float32(shape, device)


def _tail(total: int, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Rows at or past cu_seqlens[-1]: they belong to no sequence (no host sync)."""
    return torch.arange(total, device=cu_seqlens.device) >= cu_seqlens[-1]


def _row_shape(problem: IndexerProblem) -> tuple[int, ...]:
    return (problem.total_q,) if problem.is_varlen else (problem.batch, problem.seqlen_q)


# ---------------------------------------------------------------------------------- forward
def forward(
    problem: IndexerProblem, q, k, qi, ki, w, lse: torch.Tensor | None, topk_indices: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(loss_rows, head_lse, index_lse) as the DSA interface documents; `lse` is returned as is."""
    varlen = problem.is_varlen
    device = problem.device
    loss = _new(_row_shape(problem), device)
    index_lse = _new(_row_shape(problem), device)
    lse_shape = (problem.heads, problem.total_q) if varlen else (problem.batch, problem.heads, problem.seqlen_q)
    head_lse = lse if lse is not None else _new(lse_shape, device)
    if varlen and problem.total_q > 0:
        tail = _tail(problem.total_q, problem.cu_seqlens_q)
        loss.masked_fill_(tail, 0.0)
        index_lse.masked_fill_(tail, float("-inf"))
        if lse is None:
            head_lse.masked_fill_(tail, float("-inf"))
    if loss.numel() == 0:
        return loss, head_lse, index_lse
    record = _base_record(problem, q, k, qi, ki, w, topk_indices, head_lse)
    record["lse_given"] = int(lse is not None)
    record["loss"], record["index_lse"] = loss.data_ptr(), index_lse.data_ptr()
    _set(record, "loss", "bn", _strides(loss, varlen, 2))
    _set(record, "ilse", "bn", _strides(index_lse, varlen, 2))
    _launch("indexer_forward", problem.seqlen_q, problem.batch, record, problem)
    return loss, head_lse, index_lse


# ---------------------------------------------------------------------------------- backward
LIST_CHUNK = 1 << 19  # top-k entries per step of the key-major lists: bounds their temporaries (~60 B each)


def _count(counts: torch.Tensor, key_id: torch.Tensor) -> None:
    """counts[key] += occurrences of key in key_id (torch.bincount would read its size from the device)."""
    counts.index_add_(0, key_id, torch.ones(1, dtype=counts.dtype, device=counts.device).expand(key_id.numel()))


def _selected_keys(problem: IndexerProblem, topk_indices: torch.Tensor, start: int, stop: int):
    """For flat rows start..stop: (global key id of each selection, keys for an unusable slot, int64
    (rows, K); the sequence-local row of each flat row, int64 (rows,))."""
    device = topk_indices.device
    selected = topk_indices.reshape(-1, problem.topk)[start:stop].long()
    flat = torch.arange(start, stop, device=device)
    if problem.is_varlen:
        cu_q, cu_k = problem.cu_seqlens_q.long(), problem.cu_seqlens_k.long()
        sequences = cu_q.numel() - 1
        seq = torch.searchsorted(cu_q[1:], flat, right=True)
        inside = seq < sequences
        seq = seq.clamp(max=max(sequences - 1, 0))
        row = flat - cu_q[seq]
        len_q = cu_q[seq + 1] - cu_q[seq]
        len_k = cu_k[seq + 1] - cu_k[seq]
        key_base = cu_k[seq]
        keys = problem.total_k
    else:
        row = flat % max(problem.seqlen_q, 1)
        len_q = torch.full_like(row, problem.seqlen_q)
        len_k = torch.full_like(row, problem.seqlen_k)
        key_base = flat // max(problem.seqlen_q, 1) * problem.seqlen_k
        inside = torch.ones_like(row, dtype=torch.bool)
        keys = problem.batch * problem.seqlen_k
    valid = (selected >= 0) & (selected < len_k[:, None]) & inside[:, None]
    if problem.causal:
        valid &= selected <= (row + len_k - len_q)[:, None]
    return torch.where(valid, key_base[:, None] + selected, keys), row


def _key_lists(problem: IndexerProblem, topk_indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """For each key (dense: b * Nk + j; packed: its token), the sequence-local rows that select it
    and are allowed to see it, ascending (a repeated selection is adjacent): (offsets int32
    (keys + 1,), rows int32 (rows * K,), entries past offsets[-1] unused). A counting sort in
    row chunks: the lists (4 B per selection) plus bounded temporaries, no host sync."""
    device = topk_indices.device
    keys = problem.total_k if problem.is_varlen else problem.batch * problem.seqlen_k
    rows_total = topk_indices.numel() // problem.topk
    chunk = max(1, LIST_CHUNK // problem.topk)
    counts = torch.zeros(keys + 1, dtype=torch.int64, device=device)
    for start in range(0, rows_total, chunk):
        key_id, _ = _selected_keys(problem, topk_indices, start, min(start + chunk, rows_total))
        _count(counts, key_id.flatten())
    offsets = torch.zeros(keys + 1, dtype=torch.int64, device=device)
    torch.cumsum(counts[:keys], 0, out=offsets[1:])
    rows = torch.empty(rows_total * problem.topk, dtype=torch.int32, device=device)
    filled = offsets.clone()  # next free entry of each key's list
    for start in range(0, rows_total, chunk):
        key_id, row = _selected_keys(problem, topk_indices, start, min(start + chunk, rows_total))
        # stable: within a key, entries stay in row order (flattened row-major). Unusable slots
        # (key id `keys`) fill the entries past offsets[-1]: every entry has a place, no mask needed
        ordered, order = torch.sort(key_id.flatten(), stable=True)
        rank = torch.arange(ordered.numel(), device=device) - torch.searchsorted(ordered, ordered)
        rows[filled[ordered] + rank] = row[order // problem.topk].to(torch.int32)
        _count(filled, ordered)
    return offsets.to(torch.int32), rows


def backward(
    problem: IndexerProblem,
    q,
    k,
    qi,
    ki,
    w,
    topk_indices: torch.Tensor | None,
    head_lse: torch.Tensor,
    index_lse: torch.Tensor,
    grad_rows: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dqi, dki, dw) in the input dtype. Every row and key is written by its owning block; rows
    and keys past cu_seqlens[-1] are zeroed here."""
    varlen = problem.is_varlen
    device = problem.device
    dqi, dki, dw = (_new(tuple(t.shape), device) for t in (qi, ki, w))
    if varlen:
        if problem.total_q > 0:
            tail_q = _tail(problem.total_q, problem.cu_seqlens_q)
            dqi.masked_fill_(tail_q[:, None, None], 0.0)
            dw.masked_fill_(tail_q[:, None], 0.0)
        if problem.total_k > 0:
            dki.masked_fill_(_tail(problem.total_k, problem.cu_seqlens_k)[:, None], 0.0)
    if qi.numel() == 0 or ki.numel() == 0:
        dqi.zero_(), dki.zero_(), dw.zero_()
        return tuple(t.to(problem.dtype) for t in (dqi, dki, dw))
    grad_rows = grad_rows.float()
    record = _base_record(problem, q, k, qi, ki, w, topk_indices, head_lse)
    record["index_lse"], record["grad_rows"] = index_lse.data_ptr(), grad_rows.data_ptr()
    _set(record, "ilse", "bn", _strides(index_lse, varlen, 2))
    _set(record, "grad", "bn", _strides(grad_rows, varlen, 2))
    record["dqi"], record["dki"], record["dw"] = dqi.data_ptr(), dki.data_ptr(), dw.data_ptr()
    _set(record, "dqi", "bnh", _strides(dqi, varlen, 3))
    _set(record, "dki", "bn", _strides(dki, varlen, 2))
    _set(record, "dw", "bnh", _strides(dw, varlen, 3))
    _launch("indexer_backward_row", problem.seqlen_q, problem.batch, record, problem)
    if topk_indices is not None:
        offsets, rows = _key_lists(problem, topk_indices)  # freed after the launch, in stream order
        record["key_offsets"], record["key_rows"] = offsets.data_ptr(), rows.data_ptr()
    _launch("indexer_backward_key", problem.seqlen_k, problem.batch, record, problem)
    return tuple(t.to(problem.dtype) for t in (dqi, dki, dw))
