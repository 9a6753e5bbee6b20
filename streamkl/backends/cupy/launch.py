"""Host side of the CuPy backend: compile kernels.cu once per input dtype and device (the
tensor-core forward once per template variant), pack the kernels' one argument record (KLParams,
parsed from the .cu so that the two never disagree) and launch on torch's current stream. Tensors
go to the kernels as raw addresses with explicit strides: no copy, any strides with a contiguous
last dimension. No host sync in this path.

Which forward serves a problem is `forward_variant(problem)`: the tensor-core kernel
(forward_mma.cuh) for float16 / bfloat16, the exact float32 FMA kernel for float32.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from streamkl.backends.base import new_outputs, write_tail_rows
from streamkl.backends.cupy import emulate
from streamkl.backends.cupy.source import inline_includes, record_dtype
from streamkl.problem import Problem, SideMask
from streamkl.sparse.schedule import TileSchedule, get_key_schedule, get_schedule

SOURCE = Path(__file__).with_name("kernels.cu")
BLOCK_Q, BLOCK_K = 64, 32  # the schedule tile the kernels walk (SK_BLOCK_Q, SK_BLOCK_K)
THREADS = 256
BWD_ROWS = 32  # rows per backward block (SK_BWD_ROWS)
MAX_HEAD_DIM = 256
MAX_GRID_Y = 65535
INPUT_CODES = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}  # STREAMKL_INPUT
KERNELS = ("kl_forward", "kl_backward_dq", "kl_backward_dk")


# ---------------------------------------------------------------------------------- the record
@functools.lru_cache(maxsize=1)
def params_dtype() -> np.dtype:
    """The NumPy record matching `struct KLParams` of kernels.cu, field for field."""
    return record_dtype(SOURCE, "KLParams")


@functools.lru_cache(maxsize=1)
def source_text() -> str:
    """kernels.cu with its local includes inlined, the text NVRTC compiles."""
    return inline_includes(SOURCE)


@dataclass(frozen=True)
class MmaForward:
    """Template arguments of kl_forward_mma (forward_mma.cuh): head dims rounded up to 16, the key
    tile, 16-row blocks per warp, warps per block, cp.async stages, whether each warp holds its q
    A fragments in registers."""

    dim1: int
    dim2: int
    block_k: int
    m_tiles: int
    warps: int = 4
    stages: int = 2
    q_regs: int = 0

    @property
    def block_q(self) -> int:
        return 16 * self.m_tiles * self.warps

    @property
    def threads(self) -> int:
        return 32 * self.warps

    @property
    def args(self) -> tuple[int, ...]:
        return (self.dim1, self.dim2, self.block_k, self.m_tiles, self.warps, self.stages, self.q_regs)

    @property
    def name(self) -> str:
        return f"kl_forward_mma<{', '.join(map(str, self.args))}>"

    @property
    def label(self) -> str:
        """The tile shape in short: keys per tile, row blocks per warp, warps, `-qr` q in registers."""
        return f"k{self.block_k}-m{self.m_tiles}-w{self.warps}" + ("-qr" if self.q_regs else "")

    @property
    def shared_bytes(self) -> int:
        row_bytes = 2 * (self.dim1 + 8 + self.dim2 + 8)  # rows padded by one 16-byte chunk
        return (self.block_q + self.stages * self.block_k) * row_bytes


def forward_shape(dim1: int, dim2: int) -> MmaForward:
    """The tensor-core forward for head dims `dim1`, `dim2` (multiples of 16). Up to 128 + 128, the
    fastest of the tile shapes timed side by side on an H200 (docs/cupy.md)."""
    if dim1 + dim2 <= 128:
        # cheap products, the exponentials weigh most: 8 warps of one 16-row block share each
        # 64-key tile (half the barriers per key), 128 registers per thread
        return MmaForward(dim1, dim2, block_k=64, m_tiles=1, warps=8)
    if dim1 + dim2 <= 256:
        # two 16-row blocks per warp share every key fragment and q stays in registers: the fewest
        # shared-memory reads per product (255 registers, 16 local bytes at 128 + 128, nvcc alike)
        return MmaForward(dim1, dim2, block_k=32, m_tiles=2, warps=4, q_regs=1)
    return MmaForward(dim1, dim2, block_k=32, m_tiles=1, warps=4)  # wider heads: half the shared memory


def forward_variant(problem: Problem) -> MmaForward | None:
    """The tensor-core forward serving `problem`, or None: the float32 FMA kernel serves it
    (float32 inputs are multiplied in full float32, SPEC section 2)."""
    if problem.dtype == torch.float32:
        return None
    return forward_shape(-(-problem.dim1 // 16) * 16, -(-problem.dim2 // 16) * 16)


@dataclass(frozen=True)
class MmaBackward:
    """Template arguments of kl_backward_dq_mma / kl_backward_dk_mma (backward_mma.cuh): which
    kernel, head dims rounded up to 16, cp.async stages, the sides whose gradients it computes and,
    for dk, whether it also adds those sides' dq by atomics."""

    kernel: str  # "dq" (query-major) or "dk" (key-major)
    dim1: int
    dim2: int
    stages: int
    side1: int
    side2: int
    atomic_dq: int = 0

    threads = 128
    tile = 64  # queries and keys of the schedule's tiles
    sub = 32  # the other side's rows per score step (SK_MMA_BWD_SUB)

    @property
    def name(self) -> str:
        args = [self.dim1, self.dim2, self.stages, self.side1, self.side2]
        if self.kernel == "dk":
            args.append(self.atomic_dq)
        return f"kl_backward_{self.kernel}_mma<{', '.join(map(str, args))}>"

    @property
    def shared_bytes(self) -> int:
        tile_bytes = self.tile * 2 * (self.dim1 + 8 + self.dim2 + 8)  # both sides' rows, padded
        if self.kernel == "dq":  # q1, q2, then a ring of k1, k2 tiles
            return tile_bytes * (1 + self.stages)
        ds_buffer = self.atomic_dq * self.tile * 2 * (self.sub + 8)
        return tile_bytes + self.stages * (tile_bytes + 4 * 4 * self.tile) + ds_buffer  # k; ring of q, stats

    @property
    def emulator_index(self) -> int:
        """Kernel number in the emulator library (emulate.cpp): 4-6 dq, 7-9 dk, 10-12 dk with dq."""
        return 4 + 3 * (self.kernel == "dk") + 3 * self.atomic_dq + self.side1 + 2 * self.side2 - 1


def backward_shape(problem: Problem) -> tuple[int, int, int]:
    """(D1P, D2P, stages) of the tensor-core backward: head dims rounded up to 16; two cp.async
    stages while both sides' rows are at most 256 wide together, one (in half the shared memory,
    so that 256 + 256 fits an A100) past that."""
    dim1, dim2 = -(-problem.dim1 // 16) * 16, -(-problem.dim2 // 16) * 16
    return dim1, dim2, 2 if dim1 + dim2 <= 256 else 1


def backward_variants(problem: Problem, needs) -> list[MmaBackward] | None:
    """The tensor-core backward launches serving `problem` for the gradients `needs` (dq1, dk1,
    dq2, dk2), or None: float32 takes the FMA kernels.

    Unless `deterministic`, a side needing both gradients runs fused: the key-major kernel adds
    its dq by atomics (one recomputation of the scores instead of two). Otherwise dq comes from the
    query-major kernel, dk from the key-major one. Two sides share a launch while their
    accumulators fit the registers (D1P + D2P <= 256; fused, <= 128 as dq's tile adds its own;
    a side fuses only up to D = 128) and, for dk, their query heads group alike."""
    if problem.dtype == torch.float32:
        return None
    dim1, dim2, stages = backward_shape(problem)
    same_groups = problem.heads_k1 == problem.heads_k2
    dq_sides = [side for side in (1, 2) if needs[2 * side - 2]]
    dk_sides = [side for side in (1, 2) if needs[2 * side - 1]]
    # fused: the side's dq tile (16 x D / 2 per warp) fits beside dk's accumulators up to D = 128
    fitting = (dim1 <= 128, dim2 <= 128) if dim1 + dim2 <= 256 else (False, False)
    fused = [] if problem.deterministic else [s for s in dq_sides if s in dk_sides and fitting[s - 1]]
    launches = []
    for kernel, sides, atomic, pair in (
        ("dq", [s for s in dq_sides if s not in fused], 0, dim1 + dim2 <= 256),
        ("dk", [s for s in dk_sides if s not in fused], 0, dim1 + dim2 <= 256 and same_groups),
        ("dk", fused, 1, dim1 + dim2 <= 128 and same_groups),
    ):
        groups = [sides] if len(sides) == 2 and pair else [[side] for side in sides]
        launches += [MmaBackward(kernel, dim1, dim2, stages, int(1 in group), int(2 in group), atomic)
                     for group in groups]
    return launches


def forward_tiles(problem: Problem) -> tuple[int, int]:
    """(block_q, block_k) of the schedule the forward walks."""
    variant = forward_variant(problem)
    return (BLOCK_Q, BLOCK_K) if variant is None else (variant.block_q, variant.block_k)


def smem_stride(dim: int) -> int:
    """Shared-memory row stride in floats: a multiple of 4, an odd number of float4 (no conflicts)."""
    stride = (dim + 3) // 4 * 4
    return stride + 4 if (stride // 4) % 2 == 0 else stride


def shared_bytes(dim1: int, dim2: int) -> dict[str, int]:
    """Dynamic shared memory of each kernel, in bytes (the carve-up at the top of each kernel)."""
    both = smem_stride(dim1) + smem_stride(dim2)
    floats = {
        "kl_forward": (64 + 32) * both + 6 * 4 * 64,
        "kl_backward_dq": 3 * 32 * both + 2 * 32 * 32,
        "kl_backward_dk": 3 * 32 * both + 2 * 32 * 32 + 4 * 32,
    }
    return {name: 4 * count for name, count in floats.items()}


# ---------------------------------------------------------------------------------- compile, launch
@functools.cache
def _functions(input_code: int, device_index: int):
    """The three kernels for one input dtype on one device, compiled once (NVRTC, no headers)."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(code=source_text(), options=("--std=c++17", f"-DSTREAMKL_INPUT={input_code}"))
        try:
            functions = {name: module.get_function(name) for name in KERNELS}
        except Exception as exc:
            raise RuntimeError(f"streamkl cupy backend: compiling {SOURCE.name} failed: {exc}") from exc
        limit = shared_memory_limit(torch.device("cuda", device_index))
        for function in functions.values():
            function.max_dynamic_shared_size_bytes = limit
    return functions


def mma_options(input_code: int) -> tuple[str, ...]:
    """NVRTC options of a tensor-core module: the FMA kernels are left out (they serve float32,
    and compiling them would double a new shape's first-call time)."""
    return ("--std=c++17", f"-DSTREAMKL_INPUT={input_code}", "-DSK_TENSOR_CORE_ONLY")


@functools.cache
def _mma_functions(input_code: int, variants: tuple[MmaForward | MmaBackward, ...], device_index: int):
    """The tensor-core kernels `variants` for one input dtype on one device, compiled together
    (one NVRTC run) and once: {name: function}."""
    import cupy

    with cupy.cuda.Device(device_index):
        module = cupy.RawModule(
            code=source_text(),
            options=mma_options(input_code),
            name_expressions=[variant.name for variant in variants],
        )
        functions = {}
        for variant in variants:
            try:
                function = module.get_function(variant.name)
            except Exception as exc:
                raise RuntimeError(f"streamkl cupy backend: compiling {variant.name} failed: {exc}") from exc
            function.max_dynamic_shared_size_bytes = variant.shared_bytes
            functions[variant.name] = function
    return functions


@functools.cache
def shared_memory_limit(device: torch.device) -> int:
    """Largest dynamic shared memory a block may opt in to on this device."""
    properties = torch.cuda.get_device_properties(device)
    limit = getattr(properties, "shared_memory_per_block_optin", None)
    if limit is None:  # older torch: ask CuPy
        import cupy

        limit = cupy.cuda.Device(device.index or 0).attributes["MaxSharedMemoryPerBlockOptin"]
    return int(limit)


def _launch(kernel: str | MmaForward | MmaBackward, tiles: int, pairs: int, params: np.ndarray,
            problem: Problem, together: tuple[MmaForward | MmaBackward, ...] = ()) -> None:
    """One launch of `kernel`: a name of KERNELS (the FMA kernels) or a tensor-core variant, compiled
    with the variants `together` (the other launches of the same call: one NVRTC run)."""
    if tiles <= 0 or pairs <= 0:  # CuPy would round an empty grid up to one block
        return
    grid_y = min(pairs, MAX_GRID_Y)
    grid = (tiles, grid_y, math.ceil(pairs / grid_y))
    mma = not isinstance(kernel, str)
    smem = kernel.shared_bytes if mma else shared_bytes(problem.dim1, problem.dim2)[kernel]
    threads = kernel.threads if mma else THREADS
    code = INPUT_CODES[problem.dtype]
    if emulate.emulating():
        # one emulator library per (dtype, head dims) serves all of a problem's launches
        forward = forward_variant(problem)
        backward = None if problem.dtype == torch.float32 else backward_shape(problem)
        if isinstance(kernel, MmaForward):
            if kernel != forward:  # a variant the backward never pairs with: no backward kernels to build
                backward = None
            index, forward = 3, kernel
        else:
            index = kernel.emulator_index if mma else KERNELS.index(kernel)
        emulate.launch(index, grid, threads, smem, params, code, None if forward is None else forward.args, backward)
        return
    import cupy

    device = problem.device
    index = device.index if device.index is not None else torch.cuda.current_device()
    if mma:
        function = _mma_functions(code, together or (kernel,), index)[kernel.name]
    else:
        function = _functions(code, index)[kernel]
    stream = _cupy_stream(torch.cuda.current_stream(device).cuda_stream, index)
    with cupy.cuda.Device(index):
        function(grid, (threads,), (params,), shared_mem=smem, stream=stream)


class _StreamHandle:
    """A raw CUDA stream handle seen through the CUDA stream protocol."""

    __slots__ = ("handle",)

    def __init__(self, handle: int):
        self.handle = handle

    def __cuda_stream__(self) -> tuple[int, int]:
        return (0, self.handle)


_STREAMS: dict[tuple[int, int], object] = {}


def _cupy_stream(handle: int, device_index: int):
    """A CuPy view of torch's stream (wrappers only, cached: CuPy never owns the stream)."""
    key = (handle, device_index)
    stream = _STREAMS.get(key)
    if stream is None:
        import cupy

        from_external = getattr(cupy.cuda.Stream, "from_external", None)
        if from_external is not None:
            stream = from_external(_StreamHandle(handle))
        else:  # CuPy < 14
            stream = cupy.cuda.ExternalStream(handle, device_index)
        if len(_STREAMS) > 64:
            _STREAMS.clear()
        _STREAMS[key] = stream
    return stream


# ---------------------------------------------------------------------------------- argument packing
def _token_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of an input or of a row tensor; batch stride 0 when packed."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _stat_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, token) strides of lse1 / lse2 / expect."""
    return (0, t.stride(0), t.stride(1)) if varlen else (t.stride(0), t.stride(1), t.stride(2))


def _broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 on size-1 dims: a kernel indexes every (sequence, head) alike."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def _set(record: np.ndarray, prefix: str, suffixes: str, values) -> None:
    for suffix, value in zip(suffixes, values):
        record[f"{prefix}_{suffix}"] = value


def _base_params(problem: Problem, q1, k1, q2, k2) -> np.ndarray:
    """The fields every kernel reads: inputs, sizes, scales, structural and block masks."""
    record = np.zeros(1, dtype=params_dtype())
    varlen = problem.is_varlen
    for name, t in (("q1", q1), ("k1", k1), ("q2", q2), ("k2", k2)):
        record[name] = t.data_ptr()
        _set(record, name, "bnh", _token_strides(t, varlen))
    if varlen:
        record["cu_q"] = problem.cu_seqlens_q.data_ptr()
        record["cu_k"] = problem.cu_seqlens_k.data_ptr()
    record["heads"] = problem.heads
    record["group1"] = problem.heads // problem.heads_k1
    record["group2"] = problem.heads // problem.heads_k2
    record["dim1"], record["dim2"] = problem.dim1, problem.dim2
    record["stride1"], record["stride2"] = smem_stride(problem.dim1), smem_stride(problem.dim2)
    record["seqlen_q"], record["seqlen_k"] = problem.seqlen_q, problem.seqlen_k
    record["varlen"] = int(varlen)
    left, right = problem.window
    if problem.causal:  # key j <= i + offset
        right = 0 if right < 0 else min(right, 0)
    record["window_left"], record["window_right"] = left, right
    record["scale1"], record["scale2"] = problem.scale1, problem.scale2
    for side, mask in (("1", problem.mask1), ("2", problem.mask2)):
        _set_mask(record, side, mask)
    return record


def _set_mask(record: np.ndarray, side: str, mask: SideMask | None) -> None:
    if mask is None:
        return
    pattern = mask.pattern  # kernels read one byte per block, nonzero = allowed
    if pattern.element_size() != 1:
        raise TypeError(f"streamkl cupy backend: block patterns must be bool; got {pattern.dtype}")
    record[f"mask{side}"] = pattern.data_ptr()
    record[f"has_mask{side}"] = 1
    _set(record, f"mask{side}", "shqk", _broadcast_strides(pattern))
    record[f"mask{side}_bq"], record[f"mask{side}_bk"] = mask.block_q, mask.block_k


def _set_schedule(record: np.ndarray, count: torch.Tensor, index: torch.Tensor, partial: torch.Tensor) -> None:
    record["sched_count"] = count.data_ptr()
    record["sched_index"] = index.data_ptr()
    record["sched_partial"] = partial.data_ptr()
    _set(record, "count", "sht", _broadcast_strides(count))
    index_strides = _broadcast_strides(index)
    if index_strides[:3] != _broadcast_strides(partial)[:3] or index.stride(-1) != 1 or partial.stride(-1) != 1:
        raise RuntimeError("streamkl cupy backend: schedule index and partial flags must share one layout")
    _set(record, "index", "sht", index_strides[:3])


def _check_schedule(schedule: TileSchedule, tiles: tuple[int, int]) -> None:
    if (schedule.block_q, schedule.block_k) != tiles:
        raise ValueError(
            f"streamkl cupy backend: the kernel walks {tiles[0]}x{tiles[1]} tiles; got a schedule of "
            f"{schedule.block_q}x{schedule.block_k}"
        )


def _rows_16_byte_aligned(problem: Problem, tensors) -> bool:
    """Does every row of every input start on a 16-byte boundary, with head dims a multiple of 8
    (the tensor-core forward's 16-byte cp.async chunks)? Strides of size-1 dims never apply."""
    if problem.dim1 % 8 or problem.dim2 % 8:
        return False
    for t in tensors:
        if t.data_ptr() % 16:
            return False
        if any(stride % 8 for stride, size in zip(t.stride()[:-1], t.shape[:-1]) if size > 1):
            return False
    return True


# ---------------------------------------------------------------------------------- forward
def kl_forward(problem: Problem, q1, k1, q2, k2, schedule: TileSchedule):
    """(kl_rows, lse1, lse2, expect) as backends/base.py documents."""
    return forward_with(forward_variant(problem), problem, q1, k1, q2, k2, schedule)


def forward_with(variant: MmaForward | None, problem: Problem, q1, k1, q2, k2, schedule: TileSchedule):
    """`kl_forward` on a named kernel: `variant` of the tensor-core forward (half inputs), or None
    for the float32 FMA kernel; `schedule` of its tiles. Benchmarks compare variants through it."""
    if variant is not None and problem.dtype == torch.float32:
        raise ValueError("streamkl cupy backend: the tensor-core forward takes float16 / bfloat16 inputs")
    _check_schedule(schedule, (BLOCK_Q, BLOCK_K) if variant is None else (variant.block_q, variant.block_k))
    kl_rows, lse1, lse2, expect = new_outputs(problem)
    write_tail_rows(problem, kl_rows, lse1, lse2, expect)  # varlen rows past cu_seqlens[-1]
    if kl_rows.numel() == 0:
        return kl_rows, lse1, lse2, expect
    varlen = problem.is_varlen
    record = _base_params(problem, q1, k1, q2, k2)
    record["kl_rows"] = kl_rows.data_ptr()
    _set(record, "row", "bnh", _token_strides(kl_rows, varlen))
    record["lse1"], record["lse2"], record["expect"] = lse1.data_ptr(), lse2.data_ptr(), expect.data_ptr()
    _set(record, "stat", "bhn", _stat_strides(lse1, varlen))
    _set_schedule(record, schedule.kv_count, schedule.kv_index, schedule.kv_partial)
    pairs = problem.batch * problem.heads
    record["batch_heads"] = pairs
    if variant is None:
        _launch("kl_forward", math.ceil(problem.seqlen_q / BLOCK_Q), pairs, record, problem)
    else:
        record["vector_loads"] = int(_rows_16_byte_aligned(problem, (q1, k1, q2, k2)))
        _launch(variant, math.ceil(problem.seqlen_q / variant.block_q), pairs, record, problem)
    return kl_rows, lse1, lse2, expect


# ---------------------------------------------------------------------------------- backward
def kl_backward(problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule: TileSchedule, needs):
    """(dq1, dk1, dq2, dk2) in the input dtype, None where not needed.

    Query-major kernels write dq, key-major kernels (over the transposed schedule) dk, each owning
    its outputs: gradients are bitwise reproducible in every mode (no atomics). Both score sides
    are always recomputed (dS1 needs s2, dS2 needs p); a side whose gradients are not needed costs
    no gradient product. float16 / bfloat16 run on tensor cores (backward_mma.cuh, 64 x 64 tiles),
    float32 on the FMA kernels (64 x 32 tiles)."""
    variants = backward_variants(problem, needs)
    tiles = (BLOCK_Q, BLOCK_K) if variants is None else (MmaBackward.tile, MmaBackward.tile)
    if (schedule.block_q, schedule.block_k) != tiles:  # the forward's tiles differ
        schedule = get_schedule(problem, *tiles)
    tensors = (q1, k1, q2, k2)
    # float32 accumulators; rows no block owns (never visited, past cu_seqlens[-1]) stay 0
    grads = [
        torch.zeros(t.shape, dtype=torch.float32, device=t.device) if need else None for t, need in zip(tensors, needs)
    ]
    if not any(needs) or q1.numel() == 0 or k1.numel() == 0:
        return tuple(None if g is None else g.to(problem.dtype) for g in grads)
    varlen = problem.is_varlen
    grad_rows = grad_rows.float()
    stats = (lse1, lse2, expect)
    if any(t.stride() != lse1.stride() for t in stats):
        lse1, lse2, expect = (t.contiguous() for t in stats)

    record = _base_params(problem, q1, k1, q2, k2)
    record["lse1"], record["lse2"], record["expect"] = lse1.data_ptr(), lse2.data_ptr(), expect.data_ptr()
    _set(record, "stat", "bhn", _stat_strides(lse1, varlen))
    record["grad_rows"] = grad_rows.data_ptr()
    _set(record, "grad", "bnh", _token_strides(grad_rows, varlen))
    for name, g in zip(("dq1", "dk1", "dq2", "dk2"), grads):
        if g is not None:
            record[name] = g.data_ptr()
            _set(record, name, "bnh", _token_strides(g, varlen))
    if variants is None:
        _backward_fma(problem, record, schedule, needs)
    else:
        grad_max = grad_rows.abs().amax()  # on the device: the kernels read it (no host sync)
        record["grad_max"] = grad_max.data_ptr()
        record["vector_loads"] = int(_rows_16_byte_aligned(problem, tensors))
        _backward_mma(problem, record, schedule, variants)
    return tuple(None if g is None else g.to(problem.dtype) for g in grads)


def _query_launch(problem: Problem, record: np.ndarray, schedule: TileSchedule, need1: int, need2: int) -> np.ndarray:
    query = record.copy()
    query["need_dq1"], query["need_dq2"] = need1, need2
    _set_schedule(query, schedule.kv_count, schedule.kv_index, schedule.kv_partial)
    query["batch_heads"] = problem.batch * problem.heads
    return query


def _key_launch(problem: Problem, record: np.ndarray, schedule: TileSchedule, need1: int, need2: int) -> np.ndarray:
    """The record of a key-major launch driven by side 1 (need1) or else side 2: it loops over the
    query heads of that side's GQA group."""
    keys = get_key_schedule(schedule)
    group = problem.heads // (problem.heads_k1 if need1 else problem.heads_k2)
    key = record.copy()
    key["need_dk1"], key["need_dk2"] = need1, need2
    key["group_drive"], key["heads_drive"] = group, problem.heads // group
    _set_schedule(key, keys.q_count, keys.q_index, keys.q_partial)
    key["batch_heads"] = problem.batch * (problem.heads // group)
    return key


def _backward_fma(problem: Problem, record: np.ndarray, schedule: TileSchedule, needs) -> None:
    if needs[0] or needs[2]:
        query = _query_launch(problem, record, schedule, int(needs[0]), int(needs[2]))
        tiles = math.ceil(problem.seqlen_q / BLOCK_Q) * (BLOCK_Q // BWD_ROWS)
        _launch("kl_backward_dq", tiles, int(query["batch_heads"][0]), query, problem)
    if needs[1] or needs[3]:
        # one launch when both sides group their query heads alike, else one per side
        if needs[1] and needs[3] and problem.heads_k1 != problem.heads_k2:
            launches = [(1, 0), (0, 1)]
        else:
            launches = [(int(needs[1]), int(needs[3]))]
        for need1, need2 in launches:
            key = _key_launch(problem, record, schedule, need1, need2)
            _launch("kl_backward_dk", math.ceil(problem.seqlen_k / BLOCK_K), int(key["batch_heads"][0]), key, problem)


def _backward_mma(problem: Problem, record: np.ndarray, schedule: TileSchedule, variants: list[MmaBackward]) -> None:
    tile, together = MmaBackward.tile, tuple(variants)
    for variant in variants:
        if variant.kernel == "dq":
            query = _query_launch(problem, record, schedule, variant.side1, variant.side2)
            _launch(variant, math.ceil(problem.seqlen_q / tile), int(query["batch_heads"][0]), query, problem,
                    together)
        else:
            key = _key_launch(problem, record, schedule, variant.side1, variant.side2)
            _launch(variant, math.ceil(problem.seqlen_k / tile), int(key["batch_heads"][0]), key, problem, together)
