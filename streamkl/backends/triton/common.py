"""What the Triton kernels share: element masks and products on the device side; strides, tiles,
scales and device queries on the host side.

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

from streamkl.backends.triton._compat import patch_interpreter_index
from streamkl.problem import Problem
from streamkl.sparse.schedule import OFF1, OFF2

MAX_HEAD_DIM = 256  # the portable kernels' largest head dim (registers)
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
LOG2E_K = tl.constexpr(LOG2E)  # the same, readable inside kernels
LN2_K = tl.constexpr(LN2)
OFF1_K = tl.constexpr(OFF1)
OFF2_K = tl.constexpr(OFF2)


@functools.lru_cache(maxsize=16)
def capability(index: int) -> tuple[int, int]:
    """The GPU's compute capability, cached (reading the device properties costs ~0.1 ms)."""
    return torch.cuda.get_device_capability(index)


@functools.lru_cache(maxsize=16)
def sm_count(index: int) -> int:
    """The GPU's number of streaming multiprocessors, cached."""
    return torch.cuda.get_device_properties(index).multi_processor_count


def device_index(problem: Problem) -> int:
    """The CUDA device index of a problem's tensors (the current device for a bare "cuda")."""
    return problem.device.index if problem.device.index is not None else torch.cuda.current_device()


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (CI, tests without a GPU)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


if interpreting():
    patch_interpreter_index()
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
    """Ceiling division of ints."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The block of a head dim: the next power of two, at least 16."""
    return max(16, 1 << max(n - 1, 0).bit_length())


def listed(problem: Problem) -> bool:
    """Block masks or a window: kernels walk the schedule's tile lists rather than ranges."""
    return problem.mask1 is not None or problem.mask2 is not None or problem.window != (-1, -1)


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
