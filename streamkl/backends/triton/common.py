"""Pieces the Triton kernels share: element masks, row loads, and the host-side argument packing.

Kernels work in base 2: scores are multiplied by `scale * log2(e)` so that `exp2` replaces `exp`;
statistics are turned back into natural logs once, when they are written.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from streamkl.problem import Problem
from streamkl.sparse.schedule import OFF1, OFF2

LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_K = tl.constexpr(LOG2E)  # the same, readable inside kernels
LN2_K = tl.constexpr(LN2)
OFF1_K = tl.constexpr(OFF1)
OFF2_K = tl.constexpr(OFF2)


@functools.lru_cache(maxsize=16)
def capability(index: int) -> tuple[int, int]:
    """The GPU's compute capability, cached: torch.cuda.get_device_capability reads the device
    properties, ~0.1 ms a call on the H200's host (cProfile), otherwise paid on every call."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    """The GPU's number of streaming multiprocessors, cached as `capability`."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(problem: Problem) -> int:
    """The CUDA device index of a problem's tensors (the current device for a bare "cuda")."""
    return problem.device.index if problem.device.index is not None else torch.cuda.current_device()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (CI, tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def _patch_interpreter_index() -> None:
    """Triton 3.x's interpreter turns a scalar into a Python int with `int(array)`, which NumPy >= 2.3
    refuses for the size-1 arrays it keeps scalars in, so `range(n)` over a runtime bound fails.
    Index through the array's single element instead. Interpreter only; idempotent."""
    try:
        from triton.runtime import interpreter
    except ImportError:  # pragma: no cover
        return
    original = interpreter._patch_lang_tensor
    if getattr(original, "_streamkl_patched", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    patched._streamkl_patched = True
    interpreter._patch_lang_tensor = patched


if interpreting():
    _patch_interpreter_index()
# the interpreter multiplies bfloat16 blocks wrongly in tl.dot (triton 3.6): upcast there; the
# float32 product of two 16-bit floats is exact, so results match the GPU's fp32 accumulation
_INTERPRET = tl.constexpr(interpreting())


# ---------------------------------------------------------------------------------- device side
@triton.jit
def _sequence_span(CU_Q, CU_K, seq, seqlen_q, seqlen_k, USE_VARLEN: tl.constexpr):
    """(first query row, query length, first key row, key length) of sequence `seq`: from the
    cu_seqlens tables for packed (varlen) inputs, else 0 and the padded lengths."""
    if USE_VARLEN:
        q_start = tl.load(CU_Q + seq)
        len_q = tl.load(CU_Q + seq + 1) - q_start
        k_start = tl.load(CU_K + seq)
        len_k = tl.load(CU_K + seq + 1) - k_start
    else:
        q_start = 0
        len_q = seqlen_q
        k_start = 0
        len_k = seqlen_k
    return q_start, len_q, k_start, len_k


@triton.jit
def _structural_allowed(o_i, o_j, len_q, len_k, window_left, window_right):
    """[BQ, BK] bool: sequence bounds, causality and window (bottom-right aligned, per sequence).

    Causality is folded into `window_right` on the host; -1 means unbounded on that side."""
    offset = len_k - len_q
    b_i = o_i[:, None]
    b_j = o_j[None, :]
    allowed = (b_i < len_q) & (b_j < len_k)
    allowed = allowed & ((window_left < 0) | (b_j >= b_i + offset - window_left))
    allowed = allowed & ((window_right < 0) | (b_j <= b_i + offset + window_right))
    return allowed


@triton.jit
def _partial_allowed(flags, o_i, o_j, len_q, len_k, window_left, window_right):
    """(allowed1, allowed2) [BQ, BK] of a partial tile: the structural mask, less the sides whose
    block pattern the schedule flags as off for the whole tile (Triton tiles never straddle a mask
    block, so a pattern is uniform over a tile and no pattern load is needed)."""
    m_struct = _structural_allowed(o_i, o_j, len_q, len_k, window_left, window_right)
    return m_struct & ((flags & OFF1_K) == 0), m_struct & ((flags & OFF2_K) == 0)


@triton.jit
def _dot(b_a, b_b, IEEE: tl.constexpr):
    """a @ b with float32 accumulation; full float32 (no TF32) for float32 inputs."""
    if _INTERPRET:
        return tl.dot(b_a.to(tl.float32), b_b.to(tl.float32), input_precision="ieee")
    elif IEEE:
        return tl.dot(b_a, b_b, input_precision="ieee")
    else:
        return tl.dot(b_a, b_b)


# ---------------------------------------------------------------------------------- host side
def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def next_pow2(n: int) -> int:
    # plain Python: triton.next_power_of_2 is a constexpr function, ~5 us per host call
    return max(16, 1 << max(n - 1, 0).bit_length())


def window_bounds(problem: Problem) -> tuple[int, int]:
    """(left, right) with causality folded into right; -1 is unbounded."""
    left, right = problem.window
    if problem.causal:
        right = 0 if right < 0 else min(right, 0)
    return left, right


def head_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of an input; batch stride 0 for packed (varlen) inputs."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def row_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, token, head) strides of a row-major output kl_rows [B, N, H] / [T, H]."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def stat_strides(t: torch.Tensor, varlen: bool) -> tuple[int, int, int]:
    """(batch, head, token) strides of a head-major statistic lse [B, H, N] / [H, T]."""
    if varlen:
        return 0, t.stride(0), t.stride(1)
    return t.stride(0), t.stride(1), t.stride(2)


def broadcast_strides(t: torch.Tensor) -> tuple[int, ...]:
    """Strides with 0 on size-1 dims, so a kernel indexes every (sequence, head) the same way."""
    return tuple(0 if size == 1 else stride for size, stride in zip(t.shape, t.stride()))


def check_tiles(problem: Problem, block_q: int, block_k: int) -> None:
    """The kernels read block patterns only through the schedule's flags: tiles must not straddle
    mask blocks (tile sizes and mask blocks are powers of two, tiles no larger)."""
    for mask in (problem.mask1, problem.mask2):
        if mask is not None and (mask.block_q % block_q or mask.block_k % block_k):
            raise RuntimeError(
                f"streamkl triton: tiles ({block_q}, {block_k}) straddle mask blocks ({mask.block_q}, {mask.block_k})"
            )


def even_dims(problem: Problem) -> bool:
    """Head dims equal to their power-of-two blocks: no column masks on loads."""
    block_d1, block_d2 = dim_blocks(problem)
    return block_d1 == problem.dim1 and block_d2 == problem.dim2


def varlen_args(problem: Problem, dummy: torch.Tensor):
    if problem.is_varlen:
        return problem.cu_seqlens_q, problem.cu_seqlens_k
    return dummy, dummy


def group_sizes(problem: Problem) -> tuple[int, int]:
    """Query heads per key head on each side (GQA)."""
    return problem.heads // problem.heads_k1, problem.heads // problem.heads_k2


def dim_blocks(problem: Problem) -> tuple[int, int]:
    return next_pow2(problem.dim1), next_pow2(problem.dim2)


def log2_scales(problem: Problem) -> tuple[float, float]:
    return problem.scale1 * LOG2E, problem.scale2 * LOG2E


def num_q_tiles(problem: Problem, block_q: int) -> int:
    return max(math.ceil(problem.seqlen_q / block_q), 1)


def num_k_tiles(problem: Problem, block_k: int) -> int:
    return max(math.ceil(problem.seqlen_k / block_k), 1)


def pipeline_stages(step_bytes: int, resident_bytes: int, most: int = 3, budget: int = 160 * 1024) -> int:
    """Software-pipelining depth: buffered loads of `step_bytes` each, next to the tile kept for the
    whole loop (`resident_bytes`), within a shared-memory budget under the H100/H200's 227 KB."""
    if interpreting():
        return 1
    return max(1, min(most, (budget - resident_bytes) // max(step_bytes, 1)))


_STAGES_THAT_FIT: dict = {}


def launch(kernel, grid, args: tuple, config_key: tuple, num_warps: int, num_stages: int, **constexprs):
    """Launch a kernel; if its shared memory does not fit, retry with a shallower pipeline, and
    remember the depth that fits for this configuration. Once one fits, later launches of the
    configuration go through `direct_launch` (on a GPU)."""
    key = (kernel.fn.__name__, config_key, num_warps, num_stages)
    stages = _STAGES_THAT_FIT.get(key)
    if stages is not None and not interpreting():
        return direct_launch(kernel, grid, args, constexprs, num_warps, stages)
    stages = num_stages if stages is None else stages
    while True:
        try:
            result = kernel[grid](*args, num_warps=num_warps, num_stages=stages, **constexprs)
            _STAGES_THAT_FIT[key] = stages
            return result
        except triton.runtime.errors.OutOfResources:
            if stages <= 1:
                raise
            stages -= 1


# ------------------------------------------------------------------------------ direct launches
_COMPILED: dict = {}


class _Unkeyed(Exception):
    """An argument `_arg_keys` has no rule for: launch through Triton's own path."""


def _arg_keys(args) -> tuple:
    """What Triton's launch specializes each runtime argument on (triton 3.6,
    `native_specialize_impl`; `test_direct_launch_key_follows_triton` holds the two together): an
    int's value if 1, else its width and divisibility by 16; a tensor's dtype and 16-byte
    alignment; a TMA descriptor's dtype, box and layout; the type of a float or bool. One loop, no
    call per argument: this runs on every launch (~40 arguments)."""
    keys = []
    append = keys.append
    for arg in args:
        kind = arg.__class__
        if kind is int:  # 1: the constant 1; else bit 0: divisible by 16, bit 1: fits 32 bits
            append(-1 if arg == 1 else (arg & 15 == 0) + 2 * (-2147483648 <= arg < 2147483648))
        elif kind is torch.Tensor:
            append((arg.dtype, arg.data_ptr() & 15 == 0))
        elif kind is float or kind is bool:
            append(kind)
        elif arg is None:
            append(None)
        elif kind.__name__ == "TensorDescriptor":
            append((kind, arg.base.dtype, tuple(arg.block_shape), getattr(arg, "layout", None)))
        else:
            raise _Unkeyed(kind)
    return tuple(keys)


def fast_descriptor(cls, t: torch.Tensor, width: int, block_shape: list, layout=None):
    """A host TMA descriptor (`cls`: Triton's or Gluon's TensorDescriptor) of contiguous `t` seen
    as 2-D [t.numel() // width, width], built without the dataclass's `__init__` checks and without
    a view (~4 us a descriptor on the H200's host, eight a student backward): the callers'
    conditions guarantee what those checks assert (a contiguous, non-empty tensor on a 16-byte
    aligned base, rows of a multiple of 16 bytes, a power-of-two box; `fast_descriptor_checked`
    runs them in the tests). The launcher reads the base's data_ptr and dtype only."""
    desc = object.__new__(cls)
    desc.base = t
    desc.shape = [t.numel() // width, width]
    desc.strides = [width, 1]
    desc.block_shape = block_shape
    if layout is not None:
        desc.layout = layout
    desc.padding = "zero"
    return desc


def fast_descriptor_checked(cls, t: torch.Tensor, width: int, block_shape: list, layout=None):
    """`fast_descriptor` after the checks it skips, by the dataclass's own constructor (tests)."""
    flat = t.view(-1, width)
    extra = () if layout is None else (layout,)
    reference = cls(flat, list(flat.shape), list(flat.stride()), block_shape, *extra)
    desc = fast_descriptor(cls, t, width, block_shape, layout)
    assert (desc.base.data_ptr(), desc.base.dtype) == (reference.base.data_ptr(), reference.base.dtype)
    assert (desc.shape, desc.strides, desc.block_shape) == (reference.shape, reference.strides, reference.block_shape)
    assert getattr(desc, "layout", None) == getattr(reference, "layout", None) and desc.padding == reference.padding
    return desc


def launch_hooks_active() -> bool:
    """Whether a launch hook is set (a profiler's, e.g. proton): triton 3.6 keeps them in chains
    (`knobs.HookChain`), never None, so an empty chain counts as none."""
    from triton import knobs

    for hook in (knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook):
        if hook is not None and getattr(hook, "calls", True):
            return True
    return False


def direct_launch(kernel, grid: tuple, args: tuple, constexprs: dict, num_warps: int, num_stages: int | None = None):
    """`kernel[grid](*args, **constexprs, num_warps=num_warps)`, but from the second call of a
    configuration on through the compiled kernel's own launcher: Triton's launch path binds and
    specializes every argument in Python first (~30 us a launch on the H200's host, measured by
    benchmarks/host_timeline.py: 46 against 16 us). The configuration is the kernel, the device,
    the constexprs and each runtime argument's specialization (`_arg_keys`). Launch hooks (a
    profiler's) take Triton's path."""
    options = dict(num_warps=num_warps) if num_stages is None else dict(num_warps=num_warps, num_stages=num_stages)
    try:
        key = (kernel, torch.cuda.current_device(), num_warps, num_stages, *constexprs.items(), _arg_keys(args))
        entry = _COMPILED.get(key)
    except (_Unkeyed, TypeError):  # (TypeError: an unhashable constexpr)
        return kernel[grid](*args, **constexprs, **options)
    if entry is None or launch_hooks_active():
        compiled = kernel[grid](*args, **constexprs, **options)
        made = compiled_entry(kernel, compiled, len(args), constexprs) if entry is None else None
        if made is not None:
            _COMPILED[key] = made
        return compiled
    return run_compiled(entry, grid, args)


def compiled_entry(kernel, compiled, n_args: int, constexprs: dict):
    """`run_compiled`'s entry for `compiled` (what a launch of `kernel` with `n_args` runtime
    arguments and these constexprs returned): (compiled, the constexprs' values in parameter
    order), or None where it cannot be launched that way (the interpreter's launch returns no
    compiled kernel; a constexpr left to its default)."""
    names = kernel.arg_names[n_args:]
    if not hasattr(compiled, "packed_metadata") or set(names) != set(constexprs):
        return None
    return compiled, tuple(constexprs[name] for name in names)


#: Launch kept compiled kernels through their launcher's C function with the arguments already
#: expanded (`raw_launcher`; a planned Gluon forward: `raw_prefix_launcher`, no descriptor objects),
#: past Triton's Python wrapper: triton 3.6's `CudaLauncher.__call__` and `wrap_handle_tensordesc`,
#: whose loop walks every argument and, per TMA descriptor, looks up its metadata and the driver
#: before filling it. On an idle GPU that host time delays the kernel's start (`benchmarks/
#: sync_gap.py`: 0.02-0.06 ms of the H200's host a launch). Checked against Triton's own expansion on
#: the CPU (tests/test_raw_launch.py) and bitwise on the H200 (`test_raw_launch_on_the_gpu`,
#: twenty-second session); False: Triton's launch path.
RAW_LAUNCH = True

_RAW: dict = {}  # id(compiled kernel) -> (the kernel, its raw launcher or None)


def _raw_parts(compiled):
    """(the launcher's C function, the arguments before the kernel's, the TMA descriptors'
    positions among the kernel's arguments, each one's fill parameters (swizzle, element size, TMA
    dtype, box), the fill function) of `compiled`, or None (`raw_launcher` says where)."""
    if not triton.__version__.startswith("3.6."):  # the launcher's C signature this was checked against
        return None
    try:
        from triton.backends.nvidia import driver as nvidia
    except Exception:  # pragma: no cover - triton without its NVIDIA backend
        return None
    run = getattr(compiled, "run", None)
    if not isinstance(run, nvidia.CudaLauncher) or run.global_scratch_size or run.profile_scratch_size:
        return None
    launch = run.launch
    if getattr(launch, "__closure__", None):  # wrap_handle_tensordesc's `inner`
        cells = dict(zip(launch.__code__.co_freevars, (cell.cell_contents for cell in launch.__closure__)))
        if set(cells) != {"launcher", "tensordesc_indices", "tensordesc_meta"}:
            return None
        c_launch, positions, metas = cells["launcher"], sorted(cells["tensordesc_indices"]), cells["tensordesc_meta"]
    else:
        c_launch, positions, metas = launch, [], []
    if len(positions) != len(metas) or any(m is None or m["fp4_padded"] for m in metas):
        return None
    fill = triton.runtime.driver.active.utils.fill_tma_descriptor
    specs = [(m["swizzle"], m["elem_size"], nvidia.TMA_DTYPE_DEVICE_TO_HOST[m["elem_type"]], m["block_size"])
             for m in metas]
    head = (compiled.function, run.launch_cooperative_grid, run.launch_pdl, None, None, compiled.packed_metadata,
            None, None, None)
    return c_launch, head, positions, specs, fill


def raw_launcher(compiled):
    """A function (grid, stream, args, tail) launching `compiled` as `compiled.run` would, but
    calling its launcher's C function directly with the expanded arguments; None where the launcher
    is not triton 3.6's `CudaLauncher` as expected (then `compiled.run` serves): scratch memory,
    descriptors lowered to pointers, fp4 padding, or another structure."""
    parts = _raw_parts(compiled)
    if parts is None:
        return None
    c_launch, head, positions, specs, fill = parts
    # the arguments between descriptors: (start, end) slices of the call's arguments
    spans = list(zip([0] + [p + 1 for p in positions], positions + [None]))

    def raw(grid, stream, args, tail):
        values = (*args, *tail)
        out = [grid[0], grid[1], grid[2], stream, *head, *values[spans[0][0]:spans[0][1]]]
        for (swizzle, size, dtype, block), (_, end), position in zip(specs, spans[1:], positions):
            desc = values[position]
            shape, strides = desc.shape, desc.strides
            out.append(fill(desc.base.data_ptr(), swizzle, size, dtype, block, shape, strides,
                            1 if desc.padding == "nan" else 0))
            out += shape
            out += strides
            out += values[position + 1:end]
        c_launch(*out)

    return raw


def raw_prefix_launcher(entry, grid: tuple, widths: tuple):
    """For a kept kernel (`run_compiled`'s entry) whose first runtime arguments are `fast_descriptor`
    TMA descriptors of fixed shapes (`widths`: (rows, width) of each, contiguous): a function
    (pointers, rest) launching it on `grid` with those descriptors filled from the base `pointers`
    and `rest` the arguments after them, without descriptor objects (a planned call's launch,
    `gluon_forward.launcher`); None where `raw_launcher` would decline or the descriptors are not
    the leading arguments. Same arguments to the C function as `raw_launcher`'s."""
    compiled, tail = entry
    parts = _raw_parts(compiled)
    if parts is None or parts[2] != list(range(len(widths))):
        return None
    c_launch, head, _, specs, fill = parts
    grid = (*grid, 1, 1)[:3]
    fixed = [(swizzle, size, dtype, block, [rows, width], [width, 1], rows, width, width, 1)
             for (swizzle, size, dtype, block), (rows, width) in zip(specs, widths)]

    def launch(pointers, rest):
        out = [*grid, current_stream_handle(), *head]
        for pointer, (swizzle, size, dtype, block, shape, strides, *expanded) in zip(pointers, fixed):
            out.append(fill(pointer, swizzle, size, dtype, block, shape, strides, 0))
            out += expanded
        c_launch(*out, *rest, *tail)

    return launch


def current_device_index() -> int:
    """The current CUDA device's index: `torch.cuda.current_device()` without its lazy-init check
    (callers have launched on it before)."""
    return torch._C._cuda_getDevice()


def current_stream_handle() -> int:
    """The current device's current CUDA stream as an integer handle: `torch.cuda.current_stream()
    .cuda_stream` without building the Stream object (two C calls, as Triton's own launcher gets it)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if raw is None:  # pragma: no cover - a torch without it
        return torch.cuda.current_stream().cuda_stream
    return raw(torch._C._cuda_getDevice())


def run_compiled(entry, grid: tuple, args: tuple):
    """Launch `entry` = (a compiled kernel, its constexprs' values in parameter order) on the
    current stream through its own launcher (`direct_launch`'s second path; with `RAW_LAUNCH`,
    through `raw_launcher`'s)."""
    compiled, tail = entry
    stream = current_stream_handle()
    grid = (*grid, 1, 1)
    if RAW_LAUNCH:
        kept = _RAW.get(id(compiled))
        if kept is None or kept[0] is not compiled:
            kept = _RAW[id(compiled)] = (compiled, raw_launcher(compiled))
        if kept[1] is not None:
            kept[1](grid, stream, args, tail)
            return compiled
    compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata, None, None, None,
                 *args, *tail)
    return compiled
