"""Which kernel serves a problem, and with which configuration: every choice of the Triton backend
in one place, each a function of the problem (head dims, dtype, shape, masks, GPU) and of the
user's `deterministic`. The tile shapes, warps and pipeline depths were measured on the H200
(benchmarks/); where a choice has no measurement behind it, the portable kernel serves.

Forward: the Gluon kernel (gluon/forward.py) on sm_90 for 16-bit inputs at head dims 128 on
both sides, or 64 on both sides without block masks or a window, unless the grid would leave
half the GPU idle (few query tiles against long keys): there the portable kernel (forward.py)
splits the key lists (split-K). Everything else: the portable kernel.

Backward: all four gradients of a 16-bit D=128 problem without GQA, of whole tiles: the Gluon
kernel with BOTH. The student's gradients (dq2, dk2) at D=64 / 128: the Gluon kernel. Otherwise
the portable kernels: one side's gradients in one key-major pass with atomic dq, both sides' or
`deterministic=True` in two atomic-free kernels (bitwise reproducible).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from streamkl.backends.triton.common import (
    capability,
    cdiv,
    device_index,
    dim_blocks,
    even_dims,
    group_sizes,
    interpreting,
    listed,
    pipeline_stages,
    sm_count,
)
from streamkl.problem import Problem

GLUON_BLOCK = 128  # the Gluon kernels' query tile (forward) and key tile (backward)
GLUON_STEP = 64  # the Gluon backward's query rows a step


def _gluon_gpu(problem: Problem) -> bool:
    from streamkl.backends.triton.gluon import IMPORT_ERROR

    return (IMPORT_ERROR is None and problem.device.type == "cuda" and not interpreting()
            and capability(device_index(problem))[0] == 9)


def tma_inputs(*tensors: torch.Tensor) -> bool:
    """Whether tensors can be read through TMA descriptors as [tokens, heads * dim]: non-empty,
    contiguous, 16-byte aligned (checked each call: the problem does not say)."""
    for t in tensors:  # (a loop, not all() over a generator: this runs on every call)
        if t.numel() == 0 or not t.is_contiguous() or t.data_ptr() % 16 != 0:
            return False
    return True


# ------------------------------------------------------------------------------------ forward
@dataclass(frozen=True)
class Forward:
    gluon: bool  # the Gluon kernel, where the call's inputs fit TMA; else the portable one
    rows: int  # the portable kernel's query rows a program
    num_warps: int
    num_stages: int
    splits: int  # key-list slices (split-K), 1: none
    tma_keys: bool  # keys through TMA descriptors, where the call's keys fit
    fold: bool  # scales folded into the exponent arguments (16-bit, positive scales)


def select_forward(problem: Problem, block_q: int, block_k: int) -> Forward:
    """The forward of `problem` over a schedule of (block_q, block_k) tiles."""
    sixteen = problem.dtype.itemsize == 2
    dims = (problem.dim1, problem.dim2)
    gluon = (_gluon_gpu(problem) and sixteen and problem.scale1 > 0 and problem.scale2 > 0
             and problem.batch * problem.heads * problem.seqlen_q > 0
             and (dims == (128, 128) or (dims == (64, 64) and not listed(problem)))
             and _gluon_forward_masks(problem)
             and split_count(problem, cdiv(problem.seqlen_q, GLUON_BLOCK) * problem.batch * problem.heads,
                             cdiv(problem.seqlen_k, GLUON_BLOCK)) == 1)
    if gluon and listed(problem):
        assert (block_q, block_k) == (GLUON_BLOCK, GLUON_BLOCK), (block_q, block_k)
    rows, num_warps, num_stages = _forward_config(problem, block_q, block_k)
    q_programs = cdiv(max(problem.seqlen_q, 1), block_q) * (block_q // rows)
    num_k_tiles = max(cdiv(problem.seqlen_k, block_k), 1)
    splits = split_count(problem, q_programs * problem.batch * problem.heads, num_k_tiles)
    splits = cdiv(num_k_tiles, cdiv(num_k_tiles, splits))  # no slice left without tiles
    tma_keys = (not interpreting() and problem.device.type == "cuda" and max(dim_blocks(problem)) <= 64
                and capability(device_index(problem))[0] >= 9 and even_dims(problem))
    return Forward(gluon, rows, num_warps, num_stages, splits, tma_keys,
                   sixteen and problem.scale1 > 0 and problem.scale2 > 0)


def _gluon_forward_masks(problem: Problem) -> bool:
    """Block masks: dense sequences, blocks of at least the kernel's tiles; a window alone is not
    served (not measured)."""
    if not listed(problem):
        return True
    if problem.is_varlen or (problem.mask1 is None and problem.mask2 is None):
        return False
    return all(m is None or (m.block_q >= GLUON_BLOCK and m.block_k >= GLUON_BLOCK)
               for m in (problem.mask1, problem.mask2))


def _forward_config(problem: Problem, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(rows a program, num_warps, num_stages) of the portable forward."""
    if interpreting():
        return block_q, 4, 1
    block_d1, block_d2 = dim_blocks(problem)
    big = max(block_d1, block_d2) > 128
    # 16-bit, D <= 64: 64-row programs of 4 warps (the exp unit bounds it)
    small = max(block_d1, block_d2) <= 64 and problem.dtype.itemsize == 2
    rows = min(block_q, 64 if big or small else 128)
    row_bytes = (block_d1 + block_d2) * problem.dtype.itemsize  # one query or key row, both sides
    budget = 200 * 1024 if problem.dtype.itemsize == 2 else 160 * 1024
    stages = pipeline_stages(block_k * row_bytes, rows * row_bytes, most=3, budget=budget)
    return rows, 8 if rows >= 128 or big else 4, stages


def split_count(problem: Problem, programs: int, num_k_tiles: int) -> int:
    """Slices of each key-tile list: > 1 only when the grid fills less than half the GPU (few
    query tiles against many keys), never below 4 tiles a slice."""
    if interpreting() or problem.device.type != "cuda":
        return 1
    sms = sm_count(device_index(problem))
    if 2 * programs > sms:
        return 1
    return max(1, min(cdiv(2 * sms, programs), num_k_tiles // 4, 64))


# ------------------------------------------------------------------------------------ backward
@dataclass(frozen=True)
class Backward:
    kind: str  # "gluon-both", "gluon", "atomic" (one key-major pass) or "two-kernels"
    block_q: int = 0  # the portable kernels' schedule tiles
    block_k: int = 0
    kv_warps: int = 0
    kv_stages: int = 0
    dq_block_q: int = 0  # the query-major dq kernel's (two-kernels)
    dq_block_k: int = 0
    dq_rows: int = 0
    dq_warps: int = 0
    dq_stages: int = 0
    chunks: int = 1  # head chunks of the float32 dq accumulator
    dq_tma: bool = False  # atomic dq added by TMA bulk reductions
    ordered: bool = False  # key tiles launched busiest first (block masks, windows)


def select_backward(problem: Problem, block_q: int, block_k: int, needs: tuple, deterministic: bool,
                    gluon: bool = True) -> Backward:
    """The backward of `problem` (schedule tiles (block_q, block_k)) for the gradients `needs`;
    `gluon=False`: the portable kernels' choice (inputs the Gluon kernels' descriptors cannot read)."""
    gluon = gluon and not deterministic
    if gluon and _gluon_backward_serves(problem, needs, both=True):
        return Backward("gluon-both", chunks=_chunks(problem, cdiv(problem.seqlen_k, GLUON_BLOCK), 1))
    if gluon and _gluon_backward_serves(problem, needs, both=False):
        return Backward("gluon", chunks=_chunks(problem, cdiv(problem.seqlen_k, GLUON_BLOCK),
                                                group_sizes(problem)[1]))
    need_dq1, need_dk1, need_dq2, need_dk2 = needs
    two_sides = (need_dq1 or need_dk1) and (need_dq2 or need_dk2)
    atomic = not deterministic and not two_sides
    block_q, block_k = _backward_tiles(problem, block_q, block_k, two_sides)
    num_warps, num_stages = _kv_config(problem, block_q, block_k, two_sides)
    ordered = listed(problem)
    if atomic:
        group1, group2 = group_sizes(problem)
        drive = group1 if (need_dq1 or need_dk1) else group2
        chunks = _chunks(problem, cdiv(problem.seqlen_k, block_k), drive)
        dq_tma = (not interpreting() and problem.device.type == "cuda" and capability(device_index(problem))[0] >= 9
                  and even_dims(problem) and max(problem.dim1, problem.dim2) <= 128)
        return Backward("atomic", block_q, block_k, num_warps, num_stages, chunks=chunks, dq_tma=dq_tma,
                        ordered=ordered)
    dq_q, dq_k = _dq_tiles(problem, block_q, block_k)
    rows, dq_warps, dq_stages = _dq_config(problem, dq_q, dq_k)
    return Backward("two-kernels", block_q, block_k, num_warps, num_stages, dq_q, dq_k, rows, dq_warps, dq_stages,
                    ordered=ordered)


def _gluon_backward_serves(problem: Problem, needs: tuple, both: bool) -> bool:
    """The Gluon backward's scope: all four gradients (`both`: D=128, no GQA, whole tiles, side 2
    masked as side 1 or not at all) or the student's (D=64 / 128, side-2 GQA within side 1's
    groups); 16-bit; dense or packed sequences of at least a tile each; block masks of 128-blocks
    and windows over dense whole tiles."""
    if not _gluon_gpu(problem) or problem.dtype not in (torch.float16, torch.bfloat16):
        return False
    group1, group2 = group_sizes(problem)
    if both:
        if tuple(needs) != (True, True, True, True) or (problem.dim1, problem.dim2) != (128, 128):
            return False
        if group1 != 1 or group2 != 1:
            return False
    else:
        if tuple(needs) != (False, False, True, True) or problem.dim1 != problem.dim2 or problem.dim1 not in (64, 128):
            return False
        if group2 > 1 and (group1 % group2 or listed(problem)):  # side 1's key head: the group's
            return False
    if listed(problem):
        if problem.is_varlen or problem.seqlen_q == 0:
            return False
        if problem.seqlen_k % GLUON_BLOCK or problem.seqlen_q % GLUON_BLOCK:
            return False
        if any(m is not None and (m.block_q < GLUON_BLOCK or m.block_k < GLUON_BLOCK)
               for m in (problem.mask1, problem.mask2)):
            return False
        if both:  # side 2 allows every key side 1 does: no row's KL is +inf, dS1 needs no such case
            mask1, mask2 = problem.mask1, problem.mask2
            return mask2 is None or (mask1 is not None and mask1.pattern is mask2.pattern
                                     and (mask1.block_q, mask1.block_k) == (mask2.block_q, mask2.block_k))
        return True
    fit = tile_fit(problem)
    return fit == "whole" if both else fit is not None


def tile_fit(problem: Problem) -> str | None:
    """How the sequences cut into the Gluon backward's tiles (64 query rows, 128 keys): "whole",
    "tail" (a last partial tile or step shifted back, what an earlier one owns masked), or None:
    a sequence of 1-63 queries or 1-127 keys (a tile would read another sequence's rows, whose
    NaN could reach this one's gradients through 0 x NaN), causal with fewer keys than queries,
    packed lengths not known on the host."""
    if not problem.is_varlen:
        n_q, n_k = problem.seqlen_q, problem.seqlen_k
        if n_q < GLUON_STEP or n_k < GLUON_BLOCK or (problem.causal and n_k < n_q):
            return None
        return "whole" if n_q % GLUON_STEP == 0 and n_k % GLUON_BLOCK == 0 else "tail"
    if problem.host_cu_seqlens_q is None or problem.host_cu_seqlens_k is None:
        return None
    host = (problem.host_cu_seqlens_q, problem.host_cu_seqlens_k)
    len_q, len_k = (values[1:] - values[:-1] for values in host)
    if bool(((len_q > 0) & (len_q < GLUON_STEP)).any()) or bool(((len_k > 0) & (len_k < GLUON_BLOCK)).any()):
        return None
    if problem.causal and bool((len_k < len_q).any()):
        return None
    whole = not bool((len_q % GLUON_STEP != 0).any()) and not bool((len_k % GLUON_BLOCK != 0).any())
    return "whole" if whole else "tail"


def key_major(problem: Problem, programs: int) -> bool:
    """The Gluon backward's programs key tile first for dense causal launches of under 12 waves:
    the longest programs of every head start first."""
    if not problem.causal or problem.is_varlen or listed(problem) or problem.device.type != "cuda":
        return False
    return programs < 12 * sm_count(device_index(problem))


def _chunks(problem: Problem, k_programs: int, group_drive: int) -> int:
    """Head chunks of the float32 dq accumulator: two where each chunk's launch still fills the GPU
    three times over (the backward's extra memory then stays under the gradients' size), whole
    GQA groups of both sides a chunk."""
    if interpreting() or problem.device.type != "cuda" or problem.dtype.itemsize != 2:
        return 1
    chunks = 2
    if k_programs * problem.batch * (problem.heads // chunks) // group_drive < 3 * sm_count(device_index(problem)):
        return 1
    heads_units = problem.heads // math.lcm(*group_sizes(problem))
    while chunks > 1 and heads_units % chunks:
        chunks -= 1
    return max(chunks, 1)


def _two_programs_per_sm(problem: Problem, block_d: int) -> bool:
    """One side's gradients at head dims 65-128 without causality or window: 64-row query tiles, 4
    warps, one stage, so two programs share a multiprocessor."""
    return 64 < block_d <= 128 and not problem.has_structural_mask


def _backward_tiles(problem: Problem, block_q: int, block_k: int, two_sides: bool) -> tuple[int, int]:
    """The portable backward's schedule tiles: the key-major kernel keeps a key tile and streams
    query tiles, 128 keys for one side's gradients, 64 for both (two dk accumulators)."""
    if interpreting():
        return block_q, block_k
    block_d = max(dim_blocks(problem))
    if problem.dtype.itemsize == 2 and block_d <= 128:
        if two_sides:
            block_q, block_k = 128, 64
        else:
            small = block_d <= 64 or _two_programs_per_sm(problem, block_d)
            block_q, block_k = (64, 128) if small else (128, 128)
    for mask in (problem.mask1, problem.mask2):
        if mask is not None:
            block_q, block_k = min(block_q, mask.block_q), min(block_k, mask.block_k)
    return block_q, block_k


def _kv_config(problem: Problem, block_q: int, block_k: int, two_sides: bool) -> tuple[int, int]:
    """(num_warps, num_stages) of the key-major kernel."""
    if interpreting():
        return 4, 1
    block_d1, block_d2 = dim_blocks(problem)
    block_d = max(block_d1, block_d2)
    row_bytes = (block_d1 + block_d2) * problem.dtype.itemsize
    if problem.dtype.itemsize != 2 or block_d > 128:
        return 4 if block_d <= 64 else 8, pipeline_stages(block_q * row_bytes, block_k * row_bytes, most=2)
    if block_q == 64 and not two_sides and _two_programs_per_sm(problem, block_d):
        return 4, 1
    stages = pipeline_stages(block_q * row_bytes, block_k * row_bytes, most=2, budget=200 * 1024)
    return 8 if block_q * block_k * block_d > 64 * 128 * 64 else 4, stages


def _dq_tiles(problem: Problem, block_q: int, block_k: int) -> tuple[int, int]:
    """The query-major dq kernel's schedule tiles: 128 x 64 at 16-bit head dims 65-128."""
    if interpreting() or not (problem.dtype.itemsize == 2 and 64 < max(dim_blocks(problem)) <= 128):
        return block_q, block_k
    dq_q, dq_k = 128, 64
    for mask in (problem.mask1, problem.mask2):
        if mask is not None:
            dq_q, dq_k = min(dq_q, mask.block_q), min(dq_k, mask.block_k)
    return dq_q, dq_k


def _dq_config(problem: Problem, block_q: int, block_k: int) -> tuple[int, int, int]:
    """(rows a program, num_warps, num_stages) of the query-major dq kernel."""
    if interpreting():
        return block_q, 4, 1
    block_d1, block_d2 = dim_blocks(problem)
    block_d = max(block_d1, block_d2)
    big = block_d > 128
    rows = min(block_q, 32 if big else 64)
    row_bytes = (block_d1 + block_d2) * problem.dtype.itemsize
    stages = pipeline_stages(block_k * row_bytes, rows * row_bytes)
    warps = 8 if big else 4
    if problem.dtype.itemsize == 2 and 64 < block_d <= 128:  # 128-row programs of 8 warps, 2 stages
        rows, warps, stages = min(block_q, 128), 8, min(2, pipeline_stages(block_k * row_bytes, 128 * row_bytes))
    return min(rows, block_q), warps, stages
