"""Hopper (sm_90) forward in Gluon, Triton's explicit-layout dialect: the FA3 design,
warp-specialized. The Triton backend's DEFAULT forward on sm_90 where it applies and where it was
measured faster than forward.py (head dim 128 on both sides: 0.77x the SDPA forward non-causal,
0.73x causal at N=16K on the H200, against the Triton kernel's 0.89x; sixth session,
benchmarks/results/tune_h200_round11.jsonl), and with block masks (seventh session: 0.56 against
0.71 ms at 90 % block sparsity, 4.7 against 7.0 ms at 0 %). At head dim 64 it measured slower than
forward.py (1.10x against 0.99x) until the seventeenth session's `EARLY_SIDE1` (3.38 against 3.53
ms back to back): the default there too, without block masks or a window. It runs only when forced
with a window alone, block masks at head dim 64 (not measured) and different head dims.
`STREAMKL_GLUON=0` (or `USE_GLUON = False`) turns it and the Gluon student backward
(gluon_backward.py, default in its own measured scope) off, `STREAMKL_GLUON=1` (or `USE_GLUON =
True`) uses both wherever they apply.

First written and compiled on a CPU-only machine (fifth session) and run under triton-viz's Gluon
simulator there (`benchmarks/gluon_simulate.py`: both variants agree with float64 to 2e-7); first
run on the H200 in the sixth session (`tests/test_triton_gpu.py -k gluon`, the whole GPU suite).

Why: the plain Triton forward (forward.py) runs its products and its softmax in the same warps, one
after the other (Triton 3.6 cannot warp-specialize this loop on Hopper: `tl.range(...,
warp_specialize=True)` crashes the compiler or is silently ignored there), and stays at ~0.92x the
SDPA forward; the issue's target is 0.8x.

One program = one (128-row query tile, sequence, head), three partitions:
- a producer warp loads both sides' query tiles once, then streams the key tiles of both sides
  through a ring of STAGES shared-memory slots with TMA (mbarriers: `ready` when a slot's bytes
  have landed, `empty` when both consumers have read it);
- two consumer warpgroups of 64 rows each issue the two products s1 = q1 k1^T, s2 = q2 k2^T as
  asynchronous wgmma, then keep the SPEC's five running statistics (the Triton kernel's arithmetic:
  log2 units, scales folded on full tiles). While one warpgroup runs its exponentials, the other's
  products occupy the tensor cores.

Gluon has no CPU interpreter, and it cannot compile in a process running TRITON_INTERPRET=1 (the
standard functions it calls, gl.max and others, are interpreted ones there): CI compiles it for
sm_90a in a subprocess (`compile_for_hopper`), the GPU tests run it.

Block masks and windows (`listed`; written in the sixth session under the simulator, first run on
the H200 in the seventh; by default with block masks): the kernel walks the schedule's key-tile lists (128 x 128
tiles; mask blocks of at least 128), the producer loading the listed tiles, the consumers masking
the partial ones as their flags say (forward._fwd_step's rules: uncovered rows read +inf, rows
without a side-1 key are empty); plain variant, dense (not packed) sequences only.

Scope (`applies()`): dense or packed (varlen) sequences of any
lengths (tails: a last partial query tile's rows are not written, a last partial key tile and the
next packed sequence's keys are masked; TMA boxes past the tensor read zeros); causal or not, with
the rows that see no key (causal with Nk < Nq, an empty key sequence) written as the SPEC's empty
rows; GQA on either side; 16-bit inputs; head dims 64 or 128 on each side (different teacher and
student dims: forced only, correct on the H200 since the seventh session, not timed); positive
scales;
contiguous tensors (TMA: 16-byte aligned). Anything else runs the Triton kernel. Both sides share
one structure here, so no row is uncovered; a row whose scores are all -inf by value reads NaN, as
in the Triton kernel.
"""

from __future__ import annotations

import functools
import math
import os

import torch

from streamkl.backends.base import new_outputs, write_tail_rows
from streamkl.problem import Problem

try:  # Gluon is experimental: present in triton 3.6, its API moves between releases
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    GLUON_IMPORT_ERROR = None
except Exception as exc:  # pragma: no cover - depends on the installed triton
    GLUON_IMPORT_ERROR = f"{type(exc).__name__}: {exc}"
else:
    import triton

    if not triton.__version__.startswith("3.6."):  # pragma: no cover - the API this was written against
        GLUON_IMPORT_ERROR = f"written against Gluon of triton 3.6, found triton {triton.__version__}"

#: None: the default choice (`chosen()`, gluon_backward.chosen); True: the Gluon kernels wherever
#: they apply (forward at any supported head dim, the student backward); False: never. The environment
#: variable `STREAMKL_GLUON` (1 / 0) sets it when this is None.
USE_GLUON: bool | None = None

BLOCK_M = 128  # query rows a program: two consumer warpgroups of 64
LN2 = 0.6931471805599453


def setting() -> bool | None:
    """`USE_GLUON`, else `STREAMKL_GLUON` (1: True, 0: False), else None (the default choice)."""
    if USE_GLUON is not None:
        return USE_GLUON
    value = os.environ.get("STREAMKL_GLUON", "").strip()
    return {"1": True, "0": False}.get(value)


def enabled() -> bool:
    """Whether the Gluon kernels are forced on (everywhere they apply)."""
    return setting() is True


def listed(problem: Problem) -> bool:
    """Block masks or a window: the kernel walks the schedule's key-tile lists (LISTED)."""
    return problem.mask1 is not None or problem.mask2 is not None or problem.window != (-1, -1)


def chosen(problem: Problem, q1, k1, q2, k2) -> bool:
    """Whether the forward of this problem runs the Gluon kernel: where it applies, by default at
    head dim 128 on both sides, dense or with block masks (measured faster there: N=16K, 0.77x
    against 0.89x SDPA unmasked; with block masks 0.56 against 0.71 ms at 90 % sparsity, 4.7
    against 7.0 ms at 0 %, seventh session), not with a window alone (not measured); at head dim 64
    on both sides without block masks or a window, with `EARLY_SIDE1` (N=16K: 3.38 against
    forward.py's 3.53 ms, causal 1.77 against 1.96, back to back; without EARLY_SIDE1 the Gluon
    kernel was the slower, 3.94 ms; seventeenth session); everywhere it applies when forced
    (different head dims, block masks at D=64, windows)."""
    use = setting()
    if use is False:
        return False
    if use is None:
        is_listed = listed(problem)
        window_only = is_listed and problem.mask1 is None and problem.mask2 is None
        both64 = problem.dim1 == 64 and problem.dim2 == 64 and not is_listed and EARLY_SIDE1
        if not (problem.dim1 == 128 and problem.dim2 == 128 or both64) or window_only:
            return False
    return applies(problem, q1, k1, q2, k2)


#: Launches without block masks or a window (the plain variant), on their full key tiles (every
#: tile without causality or a partial last tile; else a runtime branch per tile): each warpgroup
#: waits for side 1's score product alone, takes side 1's terms of the tile's statistics (its
#: maxima, exponentials and their sum) while the tensor cores still run side 2's product, then
#: waits for that (the student backward's `EARLY_P` won 3 % at D=64 the same way). At D=128 a
#: side's product and a side's exponentials are ~500 cycles each a tile and warpgroup. The
#: warpgroup stores side 1's row sums to shared memory before the second wait: without that store
#: ptxas sank all 64 exponentials a thread past the wait (keeping only the maxima before it); with
#: it all 64 stay before (sm_90a SASS). Written in the sixteenth session; seventeenth, on the H200
#: (N=16K, H=16, bf16; `ab_trees.py --flip`, back to back, `ab_early_side1_h200.jsonl`): D=128
#: 4.84 -> 4.39 ms, causal 2.44 -> 2.22; at D=64, where it makes the Gluon kernel faster than
#: forward.py's (3.94 -> 3.38 ms against 3.53), the default forward there (`chosen`). On.
#: `test_gluon_forward_matches_reference[plain]` keeps the other path tested.
EARLY_SIDE1 = True


#: EARLY_SIDE1 on block-mask and window launches too (LISTED): the list's full tiles, which it holds
#: first, so, its partial ones masked as before (a runtime branch per tile). Seventeenth session:
#: the dense forward got 9 % faster with EARLY_SIDE1 while the listed one kept the old path (at 0 %
#: sparsity 5.21 against the plain 4.57 ms), which pushed the 90 % sparsity ratio to 0.152x.
#: Simulated (`gluon_simulate.py --early-side1-listed --new`; treating one partial tile as full fails
#: it), spill 52 B against the listed default's 40, not serialized; on the H200 its GPU tests passed
#: and at 90 % (`ab_trees.py --flip`, `ab_early_side1_listed_h200.jsonl`) the forward took 0.536
#: against 0.570 ms back to back (0.715 against 0.756 synchronized), with student gradients 2.19
#: against 2.25 synchronized, all four within noise. On.
EARLY_SIDE1_LISTED = True


def early_side1(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a launch with these constexprs takes side 1's terms under side 2's product on its
    full key tiles (`EARLY_SIDE1`, or `switch` if given): the plain variant (causal or not, packed
    or not), with block masks or a window where `EARLY_SIDE1_LISTED`."""
    on = bool(EARLY_SIDE1 if switch is None else switch)
    return on and not constexprs["OVERLAP"] and (EARLY_SIDE1_LISTED or not constexprs["LISTED"])


#: The variant: False, each warpgroup waits for its tile's products before the statistics (128-key
#: tiles; the two warpgroups overlap each other); True, it issues the next tile's products first
#: and takes this tile's statistics while they run (FA3's intra-warpgroup overlap; 64-key tiles,
#: whose two tiles in flight fit the registers).
OVERLAP = False


def config(dim: int, overlap: bool | None = None) -> tuple[int, int]:
    """(key tile, ring stages): shared memory holds both query tiles and STAGES slots of both key
    tiles (D=128: 64 KB + 2 x 64 KB, or 4 x 32 KB with 64-key tiles; D=64: 32 KB + 3 x 32 KB, or
    6 x 16 KB), under the H200's 227 KB."""
    overlap = OVERLAP if overlap is None else overlap
    if overlap:
        return (64, 4) if dim > 64 else (64, 6)
    return (128, 2) if dim > 64 else (128, 3)


def applies(problem: Problem, q1, k1, q2, k2) -> bool:
    """Whether the Gluon kernel serves this problem (the module docstring's scope), on this GPU."""
    if GLUON_IMPORT_ERROR is not None or problem.device.type != "cuda":
        return False
    if problem.dtype not in (torch.float16, torch.bfloat16):
        return False
    if listed(problem):  # the plain variant's 128-key tiles, which must not straddle a mask block
        if OVERLAP or problem.is_varlen:  # (packed sequences with block masks: not checked yet)
            return False
        for mask in (problem.mask1, problem.mask2):
            if mask is not None and (mask.block_q < BLOCK_M or mask.block_k < 128):
                return False
    if problem.dim1 not in (64, 128) or problem.dim2 not in (64, 128):
        return False
    if not (problem.scale1 > 0 and problem.scale2 > 0):
        return False
    if problem.batch * problem.heads * problem.seqlen_q == 0:
        return False
    for t in (q1, k1, q2, k2):
        if t.numel() == 0:  # (varlen: every key sequence empty) a TMA descriptor needs a non-empty tensor
            return False
        if not t.is_contiguous() or t.data_ptr() % 16:
            return False
    from streamkl.backends.triton.common import capability, device_index

    return capability(device_index(problem))[0] == 9


if GLUON_IMPORT_ERROR is None:

    @gluon.jit
    def _load_then_stream(once1_desc, once2_desc, once1_smem, once2_smem, once_bar, once_row, once1_col, once2_col,
                          ring1_desc, ring2_desc, ring1_smem, ring2_smem, ready, empty, ring_row, ring1_col,
                          ring2_col, n_tiles, index, BLOCK: gl.constexpr, STAGES: gl.constexpr,
                          INDEXED: gl.constexpr, SUB: gl.constexpr, ring_last, CLAMP: gl.constexpr, n_per, col_step,
                          CYCLE: gl.constexpr, rot=0, ROTATE: gl.constexpr = False):
        """The producer warp of both Gluon kernels: one tile of each side loaded once (the forward's
        queries, the backward's keys), then n_tiles tiles of each side, BLOCK rows apart from
        ring_row, streamed through the ring of STAGES slots (`ready` when a slot's bytes have
        landed, `empty` when its consumers have read it). INDEXED: tile i is part i % SUB of the
        index[i // SUB]-th tile of SUB * BLOCK rows (a schedule's tile list), else the i-th; CLAMP:
        no tile starts past ring_last rows from ring_row (a last partial tile shifted back); CYCLE:
        tile i is the (i % n_per)-th of head i // n_per, whose columns are col_step further on; ROTATE:
        tile i is the ((i + rot) % n_tiles)-th (the backward's DIAG_LAST: the diagonal's tiles last)."""
        mbarrier.expect(once_bar, once1_desc.block_type.nbytes + once2_desc.block_type.nbytes)
        tma.async_copy_global_to_shared(once1_desc, [once_row, once1_col], once_bar, once1_smem)
        tma.async_copy_global_to_shared(once2_desc, [once_row, once2_col], once_bar, once2_smem)
        for i in range(n_tiles):
            slot = i % STAGES
            # a slot's first use waits for nothing; its n-th reuse for the consumers' n-th release
            mbarrier.wait(empty.index(slot), ((i // STAGES) & 1) ^ 1, pred=i >= STAGES)
            mbarrier.expect(ready.index(slot), ring1_desc.block_type.nbytes + ring2_desc.block_type.nbytes)
            col1 = ring1_col
            col2 = ring2_col
            if INDEXED:
                row = ring_row + gl.load(index + i // SUB) * (BLOCK * SUB) + (i % SUB) * BLOCK
            else:
                t = i
                if ROTATE:
                    t = i + rot
                    if t >= n_tiles:
                        t = t - n_tiles
                if CYCLE:  # the group's query heads in turn, each over its n_per tiles
                    h_in = i // n_per
                    t = i - h_in * n_per
                    col1 = ring1_col + h_in * col_step
                    col2 = ring2_col + h_in * col_step
                if CLAMP:
                    row = ring_row + gl.minimum(t * BLOCK, ring_last)
                else:
                    row = ring_row + t * BLOCK
            tma.async_copy_global_to_shared(ring1_desc, [row, col1], ready.index(slot), ring1_smem.index(slot))
            tma.async_copy_global_to_shared(ring2_desc, [row, col2], ready.index(slot), ring2_smem.index(slot))

    @gluon.jit
    def _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc):
        """A key tile every key of which is allowed to every row: scales folded, the maxima on the
        raw products, one FMA per exponent argument (forward._fold_stats)."""
        m1_new = gl.maximum(m1, gl.max(r1, axis=1) * scale1)
        m2_new = gl.maximum(m2, gl.max(r2, axis=1) * scale2)
        t1s = r1 * scale1 - m1_new[:, None]
        t2s = r2 * scale2 - m2_new[:, None]
        e1 = gl.exp2(t1s)
        alpha1 = gl.exp2(m1 - m1_new)
        sum1 = gl.sum(e1, axis=1)
        l1 = l1 * alpha1 + sum1
        acc = acc * alpha1 + (gl.sum(e1 * (t1s - t2s), axis=1) + (m1_new - m2_new) * sum1)
        l2 = l2 * gl.exp2(m2 - m2_new) + gl.sum(gl.exp2(t2s), axis=1)
        return m1_new, m2_new, l1, l2, acc

    @gluon.jit
    def _full_tile_side1(r1, scale1, m1):
        """EARLY_SIDE1: `_full_tile`'s side-1 terms, which need side 1's product only: (m1_new, t1s,
        e1, alpha1, sum1), taken while the tensor cores run side 2's product."""
        m1_new = gl.maximum(m1, gl.max(r1, axis=1) * scale1)
        t1s = r1 * scale1 - m1_new[:, None]
        e1 = gl.exp2(t1s)
        alpha1 = gl.exp2(m1 - m1_new)
        return m1_new, t1s, e1, alpha1, gl.sum(e1, axis=1)

    @gluon.jit
    def _full_tile_side2(r2, scale2, side1, m2, l1, l2, acc):
        """EARLY_SIDE1: the rest of `_full_tile` once side 2's product is in (the same arithmetic;
        `_full_tile` does not call the two halves, as that reorders the default build's PTX)."""
        m1_new, t1s, e1, alpha1, sum1 = side1
        m2_new = gl.maximum(m2, gl.max(r2, axis=1) * scale2)
        t2s = r2 * scale2 - m2_new[:, None]
        l1 = l1 * alpha1 + sum1
        acc = acc * alpha1 + (gl.sum(e1 * (t1s - t2s), axis=1) + (m1_new - m2_new) * sum1)
        l2 = l2 * gl.exp2(m2 - m2_new) + gl.sum(gl.exp2(t2s), axis=1)
        return m1_new, m2_new, l1, l2, acc

    @gluon.jit
    def _early_tile(t1, t2, sink, empty_bar, scale1, scale2, m1, m2, l1, l2, acc):
        """EARLY_SIDE1, a full tile: wait for side 1's product alone, take its terms, store their row
        sums to `sink` (a shared store that keeps the exponentials before the next wait in ptxas's
        schedule), wait for side 2's, release the slot, finish the statistics."""
        r1 = hopper.warpgroup_mma_wait(1, deps=[t1])
        side1 = _full_tile_side1(r1, scale1, m1)
        sink.store(side1[4])
        r2 = hopper.warpgroup_mma_wait(0, deps=[t2])
        mbarrier.arrive(empty_bar, count=1)  # both products are in registers
        return _full_tile_side2(r2, scale2, side1, m2, l1, l2, acc)

    @gluon.jit
    def _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc):
        """A key tile with masked scores (log2 units, -inf where not allowed; diff = s1 - s2 where
        both sides allow, else 0): forward._fwd_step's masked branch. Rows without an allowed key
        yet keep max -inf and shift by 0, so no inf - inf appears."""
        m1_new = gl.maximum(m1, gl.max(s1, axis=1))
        m2_new = gl.maximum(m2, gl.max(s2, axis=1))
        shift1 = gl.where(m1_new == float("-inf"), 0.0, m1_new)
        shift2 = gl.where(m2_new == float("-inf"), 0.0, m2_new)
        alpha1 = gl.exp2(m1 - shift1)
        e1 = gl.exp2(s1 - shift1[:, None])
        l1 = l1 * alpha1 + gl.sum(e1, axis=1)
        acc = acc * alpha1 + gl.sum(e1 * diff, axis=1)
        l2 = l2 * gl.exp2(m2 - shift2) + gl.sum(gl.exp2(s2 - shift2[:, None]), axis=1)
        return m1_new, m2_new, l1, l2, acc

    @gluon.jit
    def _listed_allowed(b_i, b_j, tile_flags, len_q, len_k, window_left, window_right):
        """(allowed1, allowed2) of a partial pair of a schedule's list, rows b_i and keys b_j
        broadcast either way round (the forward's [rows, keys], the backward's [keys, rows]):
        common._partial_allowed's rules (sequence bounds, the window with causality folded into
        window_right, -1 unbounded; less the sides flagged OFF1 = 2 / OFF2 = 4 for the tile)."""
        shift = len_k - len_q
        allowed = (b_i < len_q) & (b_j < len_k)
        allowed = allowed & ((window_left < 0) | (b_j >= b_i + shift - window_left))
        allowed = allowed & ((window_right < 0) | (b_j <= b_i + shift + window_right))
        return allowed & ((tile_flags & 2) == 0), allowed & ((tile_flags & 4) == 0)

    @gluon.jit
    def _tile_stats(r1, r2, tile, n_full, o_i, offset, len_k, scale1, scale2, m1, m2, l1, l2, acc,
                    BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr, col_layout: gl.constexpr):
        """The five running statistics after one key tile's raw products r1, r2, in log2 units:
        forward._fold_stats on full tiles and forward._fwd_step's masked branch on the others,
        written again in Gluon (a Gluon kernel cannot call those Triton functions); the three
        change together. Tiles from n_full on are masked: keys past the sequence's len_k keys
        (TAIL: a last partial tile, or the next packed sequence's keys) and, causal, keys
        j > i + offset. Without either, no masked code is compiled."""
        if CAUSAL or TAIL:
            if tile < n_full:
                m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
            else:
                # key j is allowed to row i when j < len_k and, causal, j <= i + offset (both sides)
                o_j = tile * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
                allowed = o_j[None, :] < len_k
                if CAUSAL:
                    allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
                s1 = gl.where(allowed, r1 * scale1, float("-inf"))
                s2 = gl.where(allowed, r2 * scale2, float("-inf"))
                diff = gl.where(allowed, s1 - s2, 0.0)
                m1_new, m2_new, l1, l2, acc = _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc)
        else:
            m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
        return m1_new, m2_new, l1, l2, acc

    @gluon.jit
    def _listed_tile_stats(r1, r2, visit, n_full, index, flags_list, o_i, len_q, len_k, window_left, window_right,
                           scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                           BLOCK_N: gl.constexpr, col_layout: gl.constexpr):
        """`_tile_stats` for a schedule's key-tile list (block masks, windows): the visit-th listed
        tile, full (no masks) before n_full, else masked as its flags say, as forward._fwd_step and
        common._partial_allowed do: sequence bounds, causality and the window (causality folded
        into window_right, -1 unbounded), less the sides whose block pattern is off for the tile
        (OFF1 = 2, OFF2 = 4; the tile never straddles a mask block). row_flags: bit 0 a key
        allowed on side 1 only (uncovered row), bit 1 a key allowed on side 1."""
        if visit < n_full:
            m1_new, m2_new, l1, l2, acc = _full_tile(r1, r2, scale1, scale2, m1, m2, l1, l2, acc)
        else:
            tile_flags = gl.load(flags_list + visit).to(gl.int32)
            o_j = gl.load(index + visit) * BLOCK_N + gl.arange(0, BLOCK_N, layout=col_layout)
            a1, a2 = _listed_allowed(o_i[:, None], o_j[None, :], tile_flags, len_q, len_k, window_left, window_right)
            s1 = gl.where(a1, r1 * scale1, float("-inf"))
            s2 = gl.where(a2, r2 * scale2, float("-inf"))
            diff = gl.where(a1 & a2, s1 - s2, 0.0)
            only1 = gl.max((a1 & ~a2).to(gl.int32), axis=1)
            row_flags = row_flags | only1 | (gl.max(a1.to(gl.int32), axis=1) * 2)
            m1_new, m2_new, l1, l2, acc = _masked_tile(s1, s2, diff, m1, m2, l1, l2, acc)
        return m1_new, m2_new, l1, l2, acc, row_flags

    @gluon.jit
    def _plain_tile(t1, t2, empty_bar, i, n_full, n_full_listed, index, flags_list, o_i, offset, len_q, len_k,
                     window_left, window_right, scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                     BLOCK_N: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr, LISTED: gl.constexpr,
                     col_layout: gl.constexpr):
        """A key tile the plain way: wait for both products, release the slot, then the statistics
        (`_listed_tile_stats` for a schedule's list, else `_tile_stats`); row_flags as it comes
        without a list."""
        r1, r2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
        mbarrier.arrive(empty_bar, count=1)  # both products are in registers
        if LISTED:
            m1, m2, l1, l2, acc, row_flags = _listed_tile_stats(
                r1, r2, i, n_full_listed, index, flags_list, o_i, len_q, len_k, window_left, window_right,
                scale1, scale2, m1, m2, l1, l2, acc, row_flags, BLOCK_N, col_layout)
        else:
            m1, m2, l1, l2, acc = _tile_stats(r1, r2, i, n_full, o_i, offset, len_k, scale1, scale2, m1, m2, l1,
                                              l2, acc, BLOCK_N, CAUSAL, TAIL, col_layout)
        return m1, m2, l1, l2, acc, row_flags

    @gluon.jit
    def _consumer(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
                  KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                  row0, len_q, len_k, n_tiles, scale1, scale2,
                  n_full_listed, index, flags_list, window_left, window_right,
                  WG: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                  TAIL: gl.constexpr, OVERLAP: gl.constexpr, LISTED: gl.constexpr, EARLY1: gl.constexpr):
        """One warpgroup, 64 query rows (row0 + 64 * WG ...) of a sequence of len_q rows against
        len_k keys: the products and the online statistics of every key tile, then the rows'
        (KL, lse1, lse2, E), rows past len_q not written. LISTED: the key tiles are a schedule's
        list (index, flags_list; the first n_full_listed full), with the plain variant only."""
        HALF: gl.constexpr = 64
        acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                             instr_shape=[16, BLOCK_N, 16])
        row_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
        col_layout: gl.constexpr = gl.SliceLayout(0, acc_layout)
        first = row0 + WG * HALF  # sequence-local index of this warpgroup's first row
        o_i = first + gl.arange(0, HALF, layout=row_layout)
        m1 = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        m2 = gl.full([HALF], float("-inf"), gl.float32, row_layout)
        l1 = gl.zeros([HALF], gl.float32, row_layout)
        l2 = gl.zeros([HALF], gl.float32, row_layout)
        acc = gl.zeros([HALF], gl.float32, row_layout)
        row_flags = gl.zeros([HALF], gl.int32, row_layout)  # LISTED: bit 0 uncovered, bit 1 side-1 key
        zero = gl.zeros([HALF, BLOCK_N], gl.float32, acc_layout)
        offset = len_k - len_q  # causal (bottom-right aligned): row i sees keys j <= i + offset
        # key tiles before n_full allow every key to every row of this warpgroup
        n_full = gl.minimum(len_k // BLOCK_N, n_tiles)
        if CAUSAL:
            n_full = gl.minimum(gl.maximum(first + offset + 1, 0) // BLOCK_N, n_full)
        a1 = q1_smem.slice(WG * HALF, HALF)
        a2 = q2_smem.slice(WG * HALF, HALF)
        mbarrier.wait(q_bar, 0)
        if OVERLAP:
            if n_tiles > 0:  # (a row range past every key: no tile)
                # the next tile's products run on the tensor cores while this tile's statistics are taken
                mbarrier.wait(ready.index(0), 0)
                t1 = hopper.warpgroup_mma(a1, k1_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
                t2 = hopper.warpgroup_mma(a2, k2_smem.index(0).permute((1, 0)), zero, use_acc=False, is_async=True)
                r1, r2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
                mbarrier.arrive(empty.index(0), count=1)
                for i in range(1, n_tiles):
                    slot = i % STAGES
                    mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                    t1 = hopper.warpgroup_mma(a1, k1_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                                              is_async=True)
                    t2 = hopper.warpgroup_mma(a2, k2_smem.index(slot).permute((1, 0)), zero, use_acc=False,
                                              is_async=True)
                    m1, m2, l1, l2, acc = _tile_stats(r1, r2, i - 1, n_full, o_i, offset, len_k, scale1, scale2,
                                                      m1, m2, l1, l2, acc, BLOCK_N, CAUSAL, TAIL, col_layout)
                    r1, r2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
                    mbarrier.arrive(empty.index(slot), count=1)
                m1, m2, l1, l2, acc = _tile_stats(r1, r2, n_tiles - 1, n_full, o_i, offset, len_k, scale1, scale2,
                                                  m1, m2, l1, l2, acc, BLOCK_N, CAUSAL, TAIL, col_layout)
        else:
            for i in range(n_tiles):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                t1 = hopper.warpgroup_mma(a1, k1_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
                t2 = hopper.warpgroup_mma(a2, k2_smem.index(slot).permute((1, 0)), zero, use_acc=False, is_async=True)
                if EARLY1 and not (CAUSAL or TAIL or LISTED):  # every tile full: side 1's terms under side 2's
                    m1, m2, l1, l2, acc = _early_tile(t1, t2, sink, empty.index(slot), scale1, scale2, m1, m2, l1,
                                                      l2, acc)
                elif EARLY1:  # the same on the full tiles (a list's first n_full_listed), the others masked
                    if LISTED:
                        n_early = n_full_listed
                    else:
                        n_early = n_full
                    if i < n_early:
                        m1, m2, l1, l2, acc = _early_tile(t1, t2, sink, empty.index(slot), scale1, scale2, m1, m2,
                                                          l1, l2, acc)
                    else:
                        m1, m2, l1, l2, acc, row_flags = _plain_tile(
                            t1, t2, empty.index(slot), i, n_full, n_full_listed, index, flags_list, o_i, offset,
                            len_q, len_k, window_left, window_right, scale1, scale2, m1, m2, l1, l2, acc, row_flags,
                            BLOCK_N, CAUSAL, TAIL, LISTED, col_layout)
                else:
                    m1, m2, l1, l2, acc, row_flags = _plain_tile(
                        t1, t2, empty.index(slot), i, n_full, n_full_listed, index, flags_list, o_i, offset, len_q,
                        len_k, window_left, window_right, scale1, scale2, m1, m2, l1, l2, acc, row_flags, BLOCK_N,
                        CAUSAL, TAIL, LISTED, col_layout)
        # finalize (SPEC 4) as the Triton kernel does, natural logs. Both sides share one structure
        # (no masks here), so no row is uncovered; a row is empty when it sees no key (len_k == 0,
        # or causal with i + offset < 0): KL 0, lse -inf, E 0, whatever its values
        if LISTED:  # from the structure the schedule and the masked tiles saw (full tiles: bit 1)
            row_flags = row_flags | gl.where(n_full_listed > 0, 2, 0)
            empty_row = (row_flags & 2) == 0
        elif CAUSAL:
            empty_row = o_i + offset < 0
        else:
            empty_row = gl.full([HALF], len_k, gl.int32, row_layout) == 0
        lse1 = (m1 + gl.log2(l1)) * 0.6931471805599453
        lse2 = (m2 + gl.log2(l2)) * 0.6931471805599453
        expect = gl.where(empty_row, 0.0, acc / l1 * 0.6931471805599453)
        kl = expect - ((m1 - m2) + gl.log2(l1) - gl.log2(l2)) * 0.6931471805599453
        kl = gl.where((l1 == 0.0) | (l2 == 0.0), float("nan"), kl)
        if LISTED:
            kl = gl.where((row_flags & 1) != 0, float("inf"), kl)  # E stays finite: the backward needs it
        kl = gl.where(empty_row, 0.0, kl)
        rows = o_i.to(gl.int64)
        keep = o_i < len_q
        gl.store(KL + o_kl + rows * stride_kln, kl, mask=keep)
        gl.store(LSE1 + o_stat + rows * stride_sn, lse1, mask=keep)
        gl.store(LSE2 + o_stat + rows * stride_sn, lse2, mask=keep)
        gl.store(EXPECT + o_stat + rows * stride_sn, expect, mask=keep)

    @gluon.jit
    def _consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
                    KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                    row0, len_q, len_k, n_tiles, scale1, scale2,
                    n_full_listed, index, flags_list, window_left, window_right,
                    BLOCK_N: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, TAIL: gl.constexpr,
                    OVERLAP: gl.constexpr, LISTED: gl.constexpr, EARLY1: gl.constexpr):
        _consumer(q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink,
                  KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                  row0, len_q, len_k, n_tiles, scale1, scale2,
                  n_full_listed, index, flags_list, window_left, window_right,
                  1, BLOCK_N, STAGES, CAUSAL, TAIL, OVERLAP, LISTED, EARLY1)

    @gluon.jit
    def _kl_fwd_gluon_kernel(
        q1_desc, k1_desc, q2_desc, k2_desc,  # 2-D [tokens, H * D] views, boxes [128, D] / [BLOCK_N, D]
        KL, LSE1, LSE2, EXPECT,
        CU_Q, CU_K,  # varlen: cu_seqlens (int32); else unused
        KV_COUNT, KV_FULL, KV_INDEX, KV_FLAGS,  # LISTED: the schedule (sparse/schedule.py); else unused
        stride_klb, stride_kln, stride_klh,
        stride_sb, stride_sh, stride_sn,
        stride_cs, stride_ch, stride_ct,  # the schedule's counts [S', H', nQ] (broadcast strides)
        stride_is, stride_ih, stride_it,  # its lists [S', H', nQ, nK], the last dim contiguous
        window_left, window_right,  # LISTED: causality folded into window_right; -1 unbounded
        seqlen_q, seqlen_k, heads, group1, group2,  # varlen: the longest sequences
        scale1, scale2,  # scale * log2(e), both > 0
        q_programs,
        D1: gl.constexpr, D2: gl.constexpr, BLOCK_N: gl.constexpr, STAGES: gl.constexpr,
        CAUSAL: gl.constexpr, OVERLAP: gl.constexpr, VARLEN: gl.constexpr,
        TAIL: gl.constexpr,  # varlen, or Nk not a multiple of BLOCK_N: a last key tile to mask
        LISTED: gl.constexpr,  # block masks or a window: walk the schedule's key-tile lists
        EARLY1: gl.constexpr,  # side 1's terms under side 2's product on full tiles (`EARLY_SIDE1`)
    ):
        # one flat grid axis, query tiles fastest, the last (longest under causality) first
        pid_bh = gl.program_id(0) // q_programs
        pid_q = q_programs - 1 - (gl.program_id(0) - pid_bh * q_programs)
        seq = pid_bh // heads
        head = pid_bh % heads
        row0 = pid_q * 128
        if VARLEN:  # packed sequences: rows start_q ..., keys start_k ...; grid sized by the longest
            start_q = gl.load(CU_Q + seq)
            len_q = gl.load(CU_Q + seq + 1) - start_q
            start_k = gl.load(CU_K + seq)
            len_k = gl.load(CU_K + seq + 1) - start_k
            row_base = start_q.to(gl.int64)  # the outputs' rows are packed too
        else:
            start_q = seq * seqlen_q
            len_q = seqlen_q
            start_k = seq * seqlen_k
            len_k = seqlen_k
            row_base = 0
        if row0 >= len_q:  # past this sequence's rows
            return
        offset = len_k - len_q  # causal: row i sees keys j <= i + offset
        if LISTED:  # this query tile's visited key tiles, full ones first
            o_count = seq * stride_cs + head * stride_ch + pid_q * stride_ct
            n_tiles = gl.load(KV_COUNT + o_count)
            n_full_listed = gl.load(KV_FULL + o_count)
            o_list = seq.to(gl.int64) * stride_is + head * stride_ih + pid_q * stride_it
            index = KV_INDEX + o_list
            flags_list = KV_FLAGS + o_list
        else:
            n_tiles = (len_k + BLOCK_N - 1) // BLOCK_N
            if CAUSAL:
                n_tiles = gl.minimum(gl.maximum(row0 + 128 + offset + BLOCK_N - 1, 0) // BLOCK_N, n_tiles)
            n_full_listed = n_tiles
            index = KV_INDEX
            flags_list = KV_FLAGS

        q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [128, D1], q1_desc.layout)
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [128, D2], q2_desc.layout)
        k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [STAGES, BLOCK_N, D1], k1_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [STAGES, BLOCK_N, D2], k2_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        if EARLY1:  # each consumer warpgroup's side-1 row sums, stored before it waits for side 2's product:
            # ptxas keeps that shared store before the wait, and with it the exponentials the sums need
            # (without it, it sank all 64 a thread past the wait)
            sink0 = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
            sink1 = gl.allocate_shared_memory(gl.float32, [64], gl.SwizzledSharedLayout(1, 1, 1, order=[0]))
        else:
            sink0 = q_bar  # (unused)
            sink1 = q_bar
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=2)  # released by both consumer warpgroups
        hopper.fence_async_shared()

        seq64 = seq.to(gl.int64)
        o_kl = seq64 * stride_klb + head * stride_klh + row_base * stride_kln
        o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
        # TMA boxes may run past the sequence (into the next one: masked) or the tensor (zeros)
        q_row = start_q + row0
        k_row = start_k
        gl.warp_specialize(
            [
                (_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink0,
                             KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                             row0, len_q, len_k, n_tiles, scale1, scale2,
                             n_full_listed, index, flags_list, window_left, window_right,
                             0, BLOCK_N, STAGES, CAUSAL, TAIL, OVERLAP, LISTED, EARLY1)),
                (_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, q_bar, ready, empty, sink1,
                               KL, LSE1, LSE2, EXPECT, o_kl, o_stat, stride_kln, stride_sn,
                               row0, len_q, len_k, n_tiles, scale1, scale2,
                               n_full_listed, index, flags_list, window_left, window_right,
                               BLOCK_N, STAGES, CAUSAL, TAIL, OVERLAP, LISTED, EARLY1)),
                (_load_then_stream, (q1_desc, q2_desc, q1_smem, q2_smem, q_bar, q_row, head * D1, head * D2,
                                     k1_desc, k2_desc, k1_smem, k2_smem, ready, empty, k_row,
                                     (head // group1) * D1, (head // group2) * D2, n_tiles, index, BLOCK_N, STAGES,
                                     LISTED, 1, 0, False, 1, 0, False)),
            ],
            [4, 1],
            [232, 40],
        )


def gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=32)
def shared_layout(rows: int, dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a [rows, dim] tile (cached: ~6 us of host time a call)."""
    return gl.NVMMASharedLayout.get_default_for([rows, dim], gl_dtype(dtype))


_BOXES: dict = {}  # (rows, dim, dtype) -> (common.fast_descriptor, block shape, shared layout)


def flat_descriptor(t: torch.Tensor, rows: int):
    """A host TMA descriptor of an input as 2-D [tokens, heads * dim], in [rows, dim] boxes
    (`common.fast_descriptor`: `applies` checked what the dataclass's constructor would). What the
    box makes is kept by box (~1 us of the CPU host a descriptor, several a call)."""
    shape = t.shape
    dim = shape[-1]
    box = _BOXES.get((rows, dim, t.dtype))
    if box is None:
        from streamkl.backends.triton.common import fast_descriptor

        box = _BOXES[(rows, dim, t.dtype)] = (fast_descriptor, [rows, dim], shared_layout(rows, dim, t.dtype))
    return box[0](TensorDescriptor, t, shape[-2] * dim, box[1], box[2])


def descriptors(problem: Problem, q1, k1, q2, k2, block_n: int):
    """The four inputs' descriptors: queries in [128, D] boxes, keys in [block_n, D] boxes."""
    return [flat_descriptor(t, rows) for t, rows in ((q1, BLOCK_M), (k1, block_n), (q2, BLOCK_M), (k2, block_n))]


def launch_plan(problem: Problem, overlap: bool, schedule=None):
    """What one launch takes that the call's tensors do not change: (grid, constexprs, key tile,
    the six tensors after the outputs (cu_seqlens and the schedule's lists; None: a placeholder, the
    call's kl_rows), the scalar arguments after them). Block masks or a window (`listed`):
    `schedule` must have 128 x 128 tiles."""
    from streamkl.backends.triton.common import (
        broadcast_strides,
        cdiv,
        group_sizes,
        log2_scales,
        row_strides,
        stat_strides,
        window_bounds,
    )

    varlen = problem.is_varlen
    block_n, stages = config(max(problem.dim1, problem.dim2), overlap)
    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    q_programs = cdiv(problem.seqlen_q, BLOCK_M)
    cu = (problem.cu_seqlens_q, problem.cu_seqlens_k) if varlen else (None, None)
    is_listed = listed(problem)
    if is_listed:
        assert schedule is not None and (schedule.block_q, schedule.block_k) == (BLOCK_M, block_n)
        lists = (schedule.kv_count, schedule.kv_full, schedule.kv_index, schedule.kv_partial)
        list_strides = (*broadcast_strides(schedule.kv_count), *broadcast_strides(schedule.kv_index)[:3])
        window = window_bounds(problem)
    else:
        lists, list_strides, window = (None,) * 4, (0,) * 6, (-1, -1)
    rows = torch.empty(problem.row_shape, device="meta")  # the outputs' strides (new_outputs: contiguous)
    stats = torch.empty(problem.lse_shape, device="meta")
    scalars = (
        *row_strides(rows, varlen), *stat_strides(stats, varlen), *list_strides, *window,
        problem.seqlen_q, problem.seqlen_k, problem.heads, group1, group2,
        scale1, scale2, q_programs,
    )  # fmt: skip
    constexprs = dict(D1=problem.dim1, D2=problem.dim2, BLOCK_N=block_n, STAGES=stages, CAUSAL=problem.causal,
                      OVERLAP=overlap, VARLEN=varlen, TAIL=varlen or problem.seqlen_k % block_n != 0,
                      LISTED=is_listed)
    constexprs["EARLY1"] = early_side1(constexprs)
    return (q_programs * problem.batch * problem.heads,), constexprs, block_n, (*cu, *lists), scalars


def launch_args(problem: Problem, q1, k1, q2, k2, kl_rows, lse1, lse2, expect, overlap: bool, schedule=None,
                plan=None):
    """(grid, positional arguments, constexprs) of one launch: one program per (128-row query
    tile, sequence, head), sized by the longest sequence under varlen (the others' extra programs
    return at once); `plan`: `launch_plan`'s, made here if not given."""
    grid, constexprs, block_n, tensors, scalars = plan or launch_plan(problem, overlap, schedule)
    args = (
        *descriptors(problem, q1, k1, q2, k2, block_n),
        kl_rows, lse1, lse2, expect, *(kl_rows if t is None else t for t in tensors), *scalars,
    )  # fmt: skip
    return grid, args, constexprs


def kl_forward(problem: Problem, q1, k1, q2, k2, schedule=None):
    """(kl_rows, lse1, lse2, expect) through the Gluon kernel; `applies()` must hold (and, with
    block masks or a window, a schedule of 128 x 128 tiles be given). The launch plan is kept with
    the problem (`problem.extra`: the front end hands a call with a validated call's metadata that
    call's Problem, `build_problem`), for its schedule and `OVERLAP`."""
    from streamkl.backends.triton.common import compiled_entry, direct_launch, launch_hooks_active, run_compiled

    kl_rows, lse1, lse2, expect = new_outputs(problem)
    write_tail_rows(problem, kl_rows, lse1, lse2, expect)  # varlen rows past cu_seqlens[-1]
    kept = problem.extra.get("gluon_forward_plan")
    switches = (OVERLAP, EARLY_SIDE1, EARLY_SIDE1_LISTED)
    if kept is None or kept[0] is not schedule or kept[1] != switches:
        kept = problem.extra["gluon_forward_plan"] = [schedule, switches, launch_plan(problem, OVERLAP, schedule), None]
    grid, args, constexprs = launch_args(problem, q1, k1, q2, k2, kl_rows, lse1, lse2, expect, OVERLAP, schedule,
                                         kept[2])
    # every argument's specialization is the plan's (the inputs 16-byte aligned: `applies`; the
    # outputs new), so the compiled kernel is too: launched without `direct_launch`'s key
    if kept[3] is not None and not launch_hooks_active():
        run_compiled(kept[3], grid, args)
    else:
        compiled = direct_launch(_kl_fwd_gluon_kernel, grid, args, constexprs, 4)
        kept[3] = compiled_entry(_kl_fwd_gluon_kernel, compiled, len(args), constexprs)
    return kl_rows, lse1, lse2, expect


def launcher(problem: Problem, kept):
    """`Backend.forward_launcher` for a problem `kl_forward` served (`kept`: its launch plan,
    problem.extra["gluon_forward_plan"]), with the current switches and after its kernel was compiled:
    a function (q1, k1, q2, k2) -> (kl_rows, lse1, lse2, expect) doing only what depends on the call's
    tensors (outputs, descriptors, the compiled kernel's launch), or None. The function returns None
    for a call it cannot serve: an input not 16-byte aligned (the other conditions of `applies` are
    the call's metadata), inputs on another device than the current one, a launch hook set."""
    from streamkl.backends import base
    from streamkl.backends.triton import common
    from streamkl.backends.triton.common import (
        current_device_index,
        fast_descriptor,
        launch_hooks_active,
        raw_prefix_launcher,
        run_compiled,
    )

    _, switches, plan, entry = kept
    if entry is None or switches != (OVERLAP, EARLY_SIDE1, EARLY_SIDE1_LISTED):
        return None
    grid, _, block_n, tensors, scalars = plan
    inputs = ((problem.heads, problem.dim1, BLOCK_M), (problem.heads_k1, problem.dim1, block_n),
              (problem.heads, problem.dim2, BLOCK_M), (problem.heads_k2, problem.dim2, block_n))
    # (`flat_descriptor`'s: [tokens, heads * dim] in [rows, dim] boxes)
    boxes = [(heads * dim, [rows, dim], shared_layout(rows, dim, problem.dtype)) for heads, dim, rows in inputs]
    (w1, box1, lay1), (w2, box2, lay2), (w3, box3, lay3), (w4, box4, lay4) = boxes
    placeholders = any(t is None for t in tensors)
    device, index, varlen = problem.device, problem.device.index, problem.is_varlen
    row_shape, lse_shape, stats_shape = problem.row_shape, problem.lse_shape, (2, *problem.lse_shape)
    empty, float32 = torch.empty, torch.float32
    if base.POISON_OUTPUTS:  # (`new_outputs`'s NaN-filled outputs, for the tests)
        def empty(shape, dtype, device):
            return torch.full(shape, float("nan"), dtype=dtype, device=device)

    raw = []  # [`raw_prefix_launcher`'s, or None], made at the first call with RAW_LAUNCH
    # the launch plan's tensors' pointers as ints (the plan keeps them alive; an int skips the C
    # launcher's data_ptr call and driver query an argument), None for kl_rows' placeholders
    list_pointers = tuple(None if t is None else t.data_ptr() for t in tensors)
    row_count = math.prod(row_shape)
    # `rows`: the four outputs in one allocation, its rows 16-byte aligned as the kernel was
    # specialized for (a new tensor's pointer is), viewed only after the launch
    packed = not varlen and row_count % 4 == 0
    row_bytes = 4 * row_count

    def raw_launcher(q1, k1, q2, k2):
        """`raw_prefix_launcher`'s for this plan (RAW_LAUNCH read each call: `common` is not a
        watched module), made at the first call (the plan's inputs' shapes are its key's), or None."""
        if not common.RAW_LAUNCH:
            return None
        if not raw:
            raw.append(raw_prefix_launcher(entry, grid, tuple((t.numel() // width, width) for t, width in (
                (q1, w1), (k1, w2), (q2, w3), (k2, w4)))))
        return raw[0]

    def ready(pointers) -> bool:
        return not ((pointers[0] | pointers[1] | pointers[2] | pointers[3]) & 15 or (
            index is not None and current_device_index() != index) or launch_hooks_active())

    def launch(q1, k1, q2, k2):
        pointers = (q1.data_ptr(), k1.data_ptr(), q2.data_ptr(), k2.data_ptr())
        if not ready(pointers):
            return None
        kl_rows = empty(row_shape, dtype=float32, device=device)
        # lse1 and lse2 as one allocation's rows (~5 us of the H200's host an allocation; eager calls
        # only: a custom op's outputs may not alias each other), E alone (not kept for a student's
        # backward: `autograd._expect_to_save`)
        lse1, lse2 = empty(stats_shape, dtype=float32, device=device).unbind(0)
        expect = empty(lse_shape, dtype=float32, device=device)
        if varlen:
            write_tail_rows(problem, kl_rows, lse1, lse2, expect)
        direct = raw_launcher(q1, k1, q2, k2)
        if direct is not None:
            direct(pointers, (kl_rows, lse1, lse2, expect, *(kl_rows if p is None else p for p in list_pointers),
                              *scalars))
            return kl_rows, lse1, lse2, expect
        lists = tuple(kl_rows if t is None else t for t in tensors) if placeholders else tensors
        desc = TensorDescriptor
        run_compiled(entry, grid, (
            fast_descriptor(desc, q1, w1, box1, lay1), fast_descriptor(desc, k1, w2, box2, lay2),
            fast_descriptor(desc, q2, w3, box3, lay3), fast_descriptor(desc, k2, w4, box4, lay4),
            kl_rows, lse1, lse2, expect, *lists, *scalars))
        return kl_rows, lse1, lse2, expect

    def rows(q1, k1, q2, k2, lse: bool):
        """(kl_rows, lse1 where `lse` else None), for a call that reads nothing else of the forward
        (`plans.CallPlan.rows`: no grad, no return_lse, a reduced result; lse1 for a mean's count
        of rows with side-1 support): the outputs (kl_rows, lse1, lse2, E) as the rows of one
        allocation passed to the kernel as pointers, viewed after the launch, so the host's time
        before the kernel starts is one allocation (on an idle GPU that time is the call's)."""
        direct = raw_launcher(q1, k1, q2, k2) if packed else None
        if direct is None:
            outputs = launch(q1, k1, q2, k2)
            return None if outputs is None else outputs[:2]
        pointers = (q1.data_ptr(), k1.data_ptr(), q2.data_ptr(), k2.data_ptr())
        if not ready(pointers):
            return None
        out = empty((4, *row_shape), dtype=float32, device=device)
        base_pointer = out.data_ptr()
        direct(pointers, (base_pointer, base_pointer + row_bytes, base_pointer + 2 * row_bytes,
                          base_pointer + 3 * row_bytes, *(base_pointer if p is None else p for p in list_pointers),
                          *scalars))
        return out[0], out[1].view(lse_shape) if lse else None

    launch.rows = rows
    return launch


def compile_sm90(kernel, examples: dict, constexprs: dict):
    """Compile a Gluon kernel for sm_90a without a GPU (CI: the code stays valid Gluon for this
    triton, ptxas included), from example values of its runtime arguments (CPU tensors, host
    descriptors, ints, floats) in parameter order. Returns the compiled kernel (.asm: ptx, cubin)."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    # specialized as a launch would be: ints equal to 1 become constants, and pointers, ints and
    # strides divisible by 16 are marked so (alignment: wider loads)
    specs = {name: native_specialize_impl(CUDABackend, value, False, True, True) for name, value in examples.items()}
    # signature and positions follow the kernel's parameters, whatever order the caller's dicts are in
    names = list(kernel.arg_names)
    missing = [name for name in names if name not in specs and name not in constexprs]
    assert not missing, f"no example or constexpr for {missing}"
    signature = {name: "constexpr" if name in constexprs else specs[name][0] for name in names}
    positions = {(names.index(name),): value for name, value in constexprs.items()}
    positions.update({(names.index(name),): examples[name] for name, spec in specs.items() if spec[0] == "constexpr"})
    attrs = {(names.index(name),): CUDABackend.parse_attr(spec[1]) for name, spec in specs.items()
             if isinstance(spec[1], str) and spec[0] != "constexpr"}
    source = GluonASTSource(kernel, signature, positions, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4})


def compile_for_hopper(dtype=torch.bfloat16, dim=128, causal: bool = False, overlap: bool = False,
                       varlen: bool = False, listed: bool = False, early1: bool | None = None):
    """The forward compiled for sm_90a (`compile_sm90`) at one configuration; `dim` one head dim
    or (teacher's, student's); `early1`: side 1's terms under side 2's product (None: as
    `EARLY_SIDE1`)."""
    dim1, dim2 = dim if isinstance(dim, tuple) else (dim, dim)
    block_n, stages = config(max(dim1, dim2), overlap)
    t1, t2 = (torch.empty(2, BLOCK_M, 4, d, dtype=dtype) for d in (dim1, dim2))
    descs = [flat_descriptor(t, rows) for t, rows in ((t1, BLOCK_M), (t1, block_n), (t2, BLOCK_M), (t2, block_n))]
    stats = torch.empty(4, dtype=torch.float32)
    names = ("stride_klb", "stride_kln", "stride_klh", "stride_sb", "stride_sh", "stride_sn", "seqlen_q",
             "seqlen_k", "heads", "group1", "group2")
    examples = dict(zip(("q1_desc", "k1_desc", "q2_desc", "k2_desc"), descs))
    cu = torch.zeros(3, dtype=torch.int32)
    lists = dict(KV_COUNT=cu, KV_FULL=cu, KV_INDEX=cu, KV_FLAGS=torch.zeros(3, dtype=torch.int8))
    examples.update(KL=stats, LSE1=stats, LSE2=stats, EXPECT=stats, CU_Q=cu, CU_K=cu, **lists)
    list_names = ("stride_cs", "stride_ch", "stride_ct", "stride_is", "stride_ih", "stride_it", "window_left",
                  "window_right")
    examples.update(**dict.fromkeys(names[:6], 1024), **dict.fromkeys(list_names, 7), **dict.fromkeys(names[6:], 1024))
    examples.update(scale1=0.5, scale2=0.5, q_programs=1024)
    constexprs = dict(D1=dim1, D2=dim2, BLOCK_N=block_n, STAGES=stages, CAUSAL=causal, OVERLAP=overlap,
                      VARLEN=varlen, TAIL=varlen, LISTED=listed)
    # (early1 given: on or off as said, listed or not; None: as a launch would choose)
    constexprs["EARLY1"] = early_side1(constexprs) if early1 is None else bool(early1) and not overlap
    return compile_sm90(_kl_fwd_gluon_kernel, examples, constexprs)
