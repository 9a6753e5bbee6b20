"""Hopper (sm_90) backward in Gluon: the key-major pass of backward.py (dk2 in registers, dq2
added into a float32 buffer), warp-specialized like gluon_forward.py. The Triton backend's
DEFAULT student backward on sm_90 where it was measured faster than backward.py (`chosen`): head
dim 128 or (since the eleventh session) 64, dense (causal or not, since the ninth session
non-causal too), with block masks, or with a window (since the tenth session); elsewhere it runs
when forced (`STREAMKL_GLUON=1` or `gluon_forward.USE_GLUON = True`). With BOTH (eleventh
session, `applies_both`) the same kernel returns all four gradients: dS1 next to dS2, dk1 next
to dk2, dq1 by TMA reductions after dq2's. History (H200, N=16K, D=128, student backward;
`benchmarks/results/tune_h200.md`, rounds 11-22):
- as first written (fifth session, each warpgroup adding its own [64, D] dq2 tile): correct on the
  GPU, 23.6 ms non-causal / 9.9 ms causal against backward.py's 14.8 / 7.8;
- dq2 over all 128 keys of a tile (half the atomics; commit c0f362d): 15.6 / 6.8 ms;
- the rows' statistics loaded one element a thread and spread by gl.convert_layout, the dq2 tile's
  base a stepped 64-bit scalar (ptxas spills 1.5 KB -> 0.1 KB): 15.7 / 7.0 ms (round 13: no
  faster; causal 7.0 against backward.py's 7.8 ms, 0.80x SDPA; block masks at 90 % sparsity 1.71
  against 1.85 ms); dk2's and dq2's products in flight together (one wait) measured slower (17.2 /
  7.3 ms) and was reverted;
- the float32 dq2 buffer in head chunks as backward.py's (`backward.atomic_head_chunks`), so the
  extra memory stays under the gradients' size: 16.1 / 7.1 ms;
- written in the seventh session, timed in the eighth (round 14): `DQ_VEC2`, dq2 added by vector
  reductions of column pairs instead of element atomics (backward.py adds dq with TMA bulk
  reductions, which Gluon 3.6 lacks): 16.4 / 7.5 ms, left off; the next step's score products
  issued before this step's exponentials (FA3's intra-warpgroup overlap, commit f47b587; ptxas
  spills 160-180 B dense, 1.5 KB listed): 18.0 / 8.1 ms, correct on the H200, removed;
- the causal / partial-tile masks only on the steps that cross the diagonal, behind a branch
  (eighth session, commit 2952614; correct on the H200, `tune_h200_round16.jsonl`): 7.52 against
  7.02 ms causal, tails 7.45 against 7.17 (the branch costs more than the selects it skips):
  removed;
- partial tiles (TAIL) and side-2 GQA (GQA2), written in the seventh session, ran in the eighth
  and are default within the causal scope: N=16320 causal 7.30 against backward.py's 7.85 ms,
  GQA 16/4 causal 7.15 against 8.02 (non-causal 16.2 against 15.8: outside the default anyway),
  16 packed sequences of 1000-4000 tokens 4.00 against 4.61; a window (1024, 0) 1.54 against
  1.41 (windows alone stay on backward.py);
- ninth session (rounds 17-20; interleaved A/B timings, `benchmarks/ab_gluon_bwd.py`, since a
  kernel timed twice in one run differed by 4 %): the dq2 atomics' 32 hoisted 32-bit offsets,
  spilled, replaced by a per-step 64-bit base, row offsets and 64-bit columns that ptxas folds into
  immediates (6.87 against 7.05 ms causal, 15.4 against 16.4 non-causal, round 17); the rows'
  statistics loaded straight into the score layout (no layout conversions, 5 instead of 9-10
  warpgroup barriers a step; first a switch, STATS_DIRECT, removed once measured): 6.45 against
  6.82 causal; DQ_VEC2 then wins
  non-causal (13.05 against 13.36; backward.py 14.81), made the default there. Tried and removed
  again, within 1 % or slower when interleaved: the causal steps past the diagonal in a second
  loop without masks (CAUSAL_SPLIT, commit 44ada98), each step's statistics loaded during the
  step before (STATS_AHEAD, 8539394; 9 % slower non-causal), 16-byte dq2 reductions with the
  column pairs traded between lanes by shuffles (DQ_VEC4, 8539394; 7.09 against 6.69 causal);
- tenth session (rounds 21-22): the dq2 tiles by TMA bulk reductions (DQ_TMA): 5.48 against 6.47
  ms causal, 10.73 against 13.12 non-causal (0.62x / 0.60x SDPA's backward), the first change in
  four sessions that moved this kernel by more than 10 %: the per-thread atomics were its bound,
  not the tensor cores' wait on the exponentials (FA3's intra-warpgroup overlap, branch
  wip/gluon-bwd-overlap, measured equal). Programs key tile first for causal launches of few
  waves (KEY_MAJOR_GRID): 1.43 against 1.74 ms at N=8K. Tried, within noise, removed (commit
  78ac1fa): the rows' statistics staged in shared memory by a warp of their own (STATS_SMEM),
  dk2's and dq2's products in flight together (DK_DQ_TOGETHER);
- eleventh session: the score tiles as [rows, keys] (S = q k^T, the rows across the wgmma M
  dimension: two rows' statistics a thread, 12 global loads a step instead of 48; dS stored
  [rows, 128 keys] and read transposed by the dk products): 9.78 against 10.68 ms non-causal,
  5.12 against 5.50 causal (0.56x / 0.58x SDPA); D=64 6.02 / 3.26 against backward.py's 6.32 /
  3.85, so the default at D=64 too; causal steps past the diagonal in a second, unmasked loop
  (`DIAG_LOOPS`; equal for the student, 4 % for BOTH); BOTH (all four gradients) 15.88 / 9.61 ms
  against backward.py's 21.83 / 10.81.
- fifteenth session: each step's statistics loaded a step ahead again (`STATS_AHEAD`; two rows a
  thread since the eleventh session, not the ninth's sixteen): D=64 6.00 -> 5.74 ms, causal 3.27 ->
  2.95. With BOTH, causal programs' diagonal steps last (`DIAG_LAST`): the unmasked loop's spills
  gone, all four gradients causal 9.09 -> 8.07 ms. Measured slower and removed: DQ_LAG, PINGPONG
  (D=64 7.33 ms), STATS_AHEAD_BOTH.
- sixteenth session: at D=64, side 1's exponentials while side 2's score product runs (`EARLY_P`,
  non-causal: 5.80 -> 5.64 ms) and each step's dk product waited for in the next step
  (`DK_DEFER`: 5.65 -> 5.51, causal 2.97 -> 2.91; slower at D=128). 128 query rows a step at D=64
  (ROWS_D64, FlashAttention-3's tile there): 6.06 against 5.75 ms, removed.
- seventeenth session, measured and removed (the sixteenth's code, commit df211de has it): p's
  row sums stored to shared memory before the second wait so that ptxas keeps EARLY_P's
  exponentials there (EARLY_P_SINK: D=64 5.56 -> 5.93 ms), and each step's dq product waited for
  in the next step (DQ_DEFER: D=64 5.56 / 5.52, causal 2.87 -> 3.09, D=128 9.44 / 9.31, within its
  spread); three consumer warpgroups over 192 keys at D=64 (THREE_WG, commit c6b2163: at most 3 %
  faster, wrong gradients at N=16K on the H200), reverted.
- eighteenth session: a reduced loss's one g out of dS2 (q - p) and into the output scales (G_ONE)
  and dq2 added unscaled, the flush scaling it (DQ_RAW): the D=64 loop 466 -> 392 SASS
  instructions a step; D=64 5.53 -> 5.37 ms, causal 2.91 -> 2.85, D=128 9.58 -> 9.42. Measured
  slower and removed (commit 38f36ff has it): each step issuing the next step's score products
  before its exponentials (S_AHEAD, FlashAttention-3's intra-warpgroup overlap at D=64; waited for
  before the loop's back edge, since accumulators in flight there are moved between registers and
  ptxas then serializes the wgmma; the moves cost 80 instructions a step): 5.36 -> 5.59 ms, causal
  2.84 -> 2.90; at D=64 each warpgroup adding the dq2 of its own 64 keys every step, no turn and no
  wait for the other's dS half (OWN_DQ64, commit 0370f90): 5.31 -> 7.05 ms, causal 2.81 -> 3.80,
  so the dq2 reductions (their shared-memory staging and the float32 adds in L2) cost more than
  the turn's wait (13 % of a consumer warpgroup's stall samples).
- nineteenth session, measured and removed (commit a81fede has it): 256 keys a program at D=64,
  each consumer warpgroup owning 128 (KEYS256: half the dq2 reductions a key, 667 instructions a
  step of 256 keys against 2 x 392, ptxas spilling 164 / 836 B): 5.31 -> 5.34 ms, causal 2.80 ->
  2.96. Halving the reductions bought nothing, so they are not what bounds the kernel either.
  Both consumer warpgroups at 240 registers (worker registers 240 / 24 instead of 240 / 32; BOTH's
  spills 632 -> 548 B causal): within noise, removed. G_ONE in the BOTH kernel (G_ONE_BOTH): all
  four gradients causal 7.93 -> 7.80 and 8.03 -> 7.88 ms in two runs, non-causal within noise; on.
  Half of q's exponentials (odd columns) by a degree-5 polynomial on the FMA units (POLY,
  FlashAttention-4's offload of the exp unit; commit ef99e2a has it; loop 392 -> 534
  instructions, MUFU.EX2 64 -> 48): 5.38 -> 5.78 ms, causal 2.81 -> 2.98. The exp unit's issue
  interval is not what the D=64 step waits on, as the forward's polynomial found in the fourth.
  The next step's statistics loaded after the step's dS fence (ptxas makes fence_async_shared a
  MEMBAR.ALL.CTA, which waits for global loads in flight) or at the step's end (STATS_LATE, commit
  2d322d1 has it): D=64 5.35 / 5.34 and 5.52 ms, causal 2.84 / 2.85 and 2.93; D=128 9.38 / 9.46
  and 10.25, causal 4.90 / 4.78 and 5.08: the fence's wait moves elsewhere; reverted.
- twentieth session: at D=64 the consumer warpgroups split the query tiles instead of the keys
  (`SPLIT_ROWS`, `_rows_consumer`: each its own 64-row tiles against all 128 keys, no wait for the
  other's dS half, dS2 into the dq2 product from registers, one fence a step): D=64 5.30 -> 4.46 /
  4.53 ms, causal 2.80 -> 2.45. On where it applies (dense or packed whole tiles, no side-2 GQA, no
  block masks or window); elsewhere at D=64 the keys' split below.
Written on a CPU-only machine and checked under triton-viz's Gluon simulator
(`benchmarks/gluon_simulate.py --backward`), each version before its GPU run.

One program = one (128-key tile, sequence, head): a producer warp loads both sides' key tiles
once, then streams the 64-row query tiles that see them (both sides) through an mbarrier ring; two
consumer warpgroups own 64 keys each and, per query tile, take the scores s = q k^T of both sides
against their keys (async wgmma), p and q from the saved row statistics, dS2 = g (q - p), then dk2
+= dS2^T q2 and dq2 += dS2 k2 (dS2 through shared memory, which both products read), each
warpgroup's [64, 64] piece of the dq2 tile added by a TMA bulk reduction from shared memory
(`DQ_TMA`, since the tenth session; built through the Gluon builder, which has the op but no
wrapper for it in Gluon 3.6), else by element atomics or vector reductions of column pairs
(`DQ_VEC2`).

Scope (`applies`): the student's gradients only (dq2, dk2), causal or not (Nk >= Nq), 16-bit
(float16's upstream gradient rescaled by backward.rescaled_upstream), D 64 / 128 on both sides, no
not deterministic; everything else runs backward.py. Dense or packed sequences
(VARLEN, seventh session; lengths known on the host) of at least 64 queries and 128 keys each
(`tile_fit`): no tile reads another sequence's rows, so a NaN there cannot reach this one's
gradients through a 0 x NaN product. Lengths that are whole tiles (64 / 128) ran on the H200;
others (TAIL: each sequence's last partial key tile and query step shifted back to end at its last
key / row, the keys and rows an earlier tile owns masked, dk2 stored for its own keys only) only
by default too (`TAILS_BY_DEFAULT`; run on the H200 in the eighth session). GQA on side 2
(GQA2, seventh session; run on the H200 in the eighth, default in the same scope) where side 1's
groups are multiples of side 2's (so one side-1 key tile serves the whole group; the same
grouping on both sides is the usual case), not with block masks or windows: a program per
(key tile, side-2 key head) takes its group's query heads in turn, dk2 accumulated over all of
them. Block masks (blocks of at least 128)
and windows (LISTED; dense sequences): the key-major view of the 128 x 128 tile schedule, each
listed 128-row query tile in two 64-row steps, partial pairs masked as backward._tile_dscores does
(dS2 kept to side 2's support; rows without keys on a side read lse +inf, so p, q = 0 there); N
multiples of 128, causal with any Nk.
"""

from __future__ import annotations

import functools

import torch

from streamkl.backends.triton.gluon_forward import GLUON_IMPORT_ERROR, enabled, listed, setting  # noqa: F401

if GLUON_IMPORT_ERROR is None:
    from streamkl.backends.triton.gluon_forward import (
        _listed_allowed,
        _load_then_stream,
        compile_sm90,
        flat_descriptor,
        gl_dtype,
    )
from streamkl.problem import Problem

if GLUON_IMPORT_ERROR is None:
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia import hopper
    from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

BLOCK_N = 128  # keys a program: two consumer warpgroups of 64
BLOCK_M = 64  # query rows a step
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453


def stages(dim: int) -> int:
    """Ring slots of both sides' query tiles (two 16 KB tiles a slot at D=128, 8 KB at D=64)."""
    return 3 if dim > 64 else 4


def chosen(problem: Problem, q1, k1, q2, k2, needs, deterministic: bool) -> bool:
    """Whether this backward runs the Gluon kernel: where it applies, by default at head dim 128
    or 64, dense (causal or not; partial tiles, packed sequences and side-2 GQA included), with block
    masks or a window, where it was measured faster than backward.py (H200, N=16K, tenth session,
    dq2 by TMA reductions: 5.48 against 7.84 ms causal, 10.73 against 14.96 non-causal; forced
    scopes, causal / not: partial tiles N=16320 5.72 / 10.39 against 7.81 / 16.34, GQA 16/4 5.65 /
    11.06 against 7.97 / 15.64, 16 packed sequences of 1000-4000 tokens 3.15 / 5.14 against 4.60 /
    7.99, a window (1024, 0) 1.14 against 1.40 (slower before the TMA reductions: 1.48); 1.71
    against 1.85 ms at 90 % block sparsity, seventh session); at head dim 64 since the eleventh
    session's [rows, keys] score tiles (6.02 against 6.32 ms non-causal, 3.26 against 3.85 causal;
    before, 7.18 / 3.82). Everywhere it applies when forced (`gluon_forward.setting()`)."""
    use = setting()
    if use is False:
        return False
    if use is None:
        if not listed(problem) and not TAILS_BY_DEFAULT and tile_fit(problem) != "whole":
            return False
    return applies(problem, q1, k1, q2, k2, needs, deterministic)


#: The dq2 additions as vector reductions of column pairs (`red.global.add.v2.f32`: half the
#: reduction instructions, whole 32-byte sectors per warp; by inline PTX) instead of element
#: atomics, where `DQ_TMA` is off: True, False, or None (the default): where measured faster,
#: dense without causality (H200, ninth session, interleaved A/B: 13.05 against 13.36 ms
#: non-causal; causal slower, 6.86 against 6.45; eighth session, before the statistics were loaded
#: in the score layout: causal 7.47 against 7.14).
DQ_VEC2 = None


def dq_vec(problem: Problem) -> int:
    """How many float32 columns one dq2 reduction adds (`DQ_VEC2`; 1: element atomics)."""
    if DQ_VEC2 is None:
        return 2 if not problem.causal and not listed(problem) else 1
    return 2 if DQ_VEC2 else 1


#: The dq2 tiles added by TMA bulk reductions (`cp.reduce.async.bulk.tensor ... add`: each
#: warpgroup stores its [64, 64] float32 piece to shared memory, two of its warps hand the halves
#: to the TMA unit, as FlashAttention-3 and backward.py do) instead of per-thread atomics (False:
#: element atomics or `DQ_VEC2`'s vector reductions). Gluon 3.6 has no wrapper for it;
#: `_tma_reduce_add` builds the op through the Gluon builder. The default since the tenth session
#: (H200, N=16K, D=128, interleaved A/B: 5.48 against 6.47 ms causal, 10.73 against 13.12
#: non-causal; D=64 3.82 / 7.18 against 4.02 / 8.34).
DQ_TMA = True

#: Programs ordered key tile first, heads second (True), so that with causality the longest
#: programs (the first key tiles) of every head start first and the shortest end the launch; or
#: head first (False: each head's programs in turn, longest first; the last heads' long programs
#: then start late and run alone at the end, but the programs running together share their
#: heads' query tiles in L2). None (the default): key-major for dense causal launches of fewer
#: than 12 waves of programs (`key_major`). H200, D=128, causal, interleaved (tenth session):
#: N=8K 1.43 against 1.74 ms, N=4K 0.44 against 0.49; N=16K (15.5 waves) 5.55 against 5.50 and
#: non-causal 10.91 against 10.69 (equal programs: only the L2 sharing changes).
KEY_MAJOR_GRID = None

#: With block masks or a window (LISTED), programs read their launch id from a table that puts
#: each head's key tiles with the most query tiles first (`schedule.heaviest_first`): the key-major
#: pass's programs differ in length as much as their key tiles' visit counts do (90 % random block
#: sparsity: 3 to 28 query tiles, mean 13), and in launch order the last wave's long programs
#: decide when the launch ends. backward.py's key-major pass (`_kl_bwd_kv_kernel`) reads the
#: same table. False: launch order.
HEAVY_FIRST = True


def key_major(problem: Problem, programs: int) -> bool:
    """Whether a launch of `programs` programs orders them key tile first (`KEY_MAJOR_GRID`)."""
    if KEY_MAJOR_GRID is not None:
        return bool(KEY_MAJOR_GRID)
    if not problem.causal or problem.is_varlen or listed(problem) or problem.device.type != "cuda":
        return False
    from streamkl.backends.triton.common import device_index, sm_count

    return programs < 12 * sm_count(device_index(problem))


#: Lengths that are not whole numbers of tiles (TAIL: a last partial tile or step shifted back to
#: end at the sequence's end) by default too: written in the seventh session, run and timed on the
#: H200 in the eighth (N=16320 causal 7.30 against backward.py's 7.85 ms; 16 packed sequences of
#: 1000-4000 tokens, causal, 4.00 against 4.61 ms). False keeps them on backward.py.
TAILS_BY_DEFAULT = True


def tile_fit(problem: Problem) -> str | None:
    """`_tile_fit`, once per problem: the choice, the scope check and every chunk's launch ask it
    (for packed sequences it reads the host lengths with a few torch ops)."""
    if "gluon_tile_fit" not in problem.extra:
        problem.extra["gluon_tile_fit"] = _tile_fit(problem)
    return problem.extra["gluon_tile_fit"]


def _tile_fit(problem: Problem) -> str | None:
    """How the sequences cut into the kernel's tiles (64 query rows, 128 keys), for the dense (not
    listed) path: "whole", "tail" (some length not a multiple: the last tile or step of a sequence
    is shifted back to end at its last row or key, the rows / keys an earlier one owns masked), or
    None when the kernel cannot serve them: a sequence with 1-63 queries or 1-127 keys (a tile
    would read another sequence's rows, whose NaN or inf could then reach this one's gradients
    through a 0 x NaN product), causal with fewer keys than queries (rows without keys), packed
    lengths not known on the host (the front end's value checks keep CPU copies of cu_seqlens; a
    graph capture or torch.compile may not)."""
    if not problem.is_varlen:  # (plain ints: this runs on every backward call)
        n_q, n_k = problem.seqlen_q, problem.seqlen_k
        if n_q < BLOCK_M or n_k < BLOCK_N or (problem.causal and n_k < n_q):
            return None
        return "whole" if n_q % BLOCK_M == 0 and n_k % BLOCK_N == 0 else "tail"
    host = problem.extra.get("host_cu")
    if host is None:
        return None
    len_q, len_k = (values[1:] - values[:-1] for values in host)
    if bool(((len_q > 0) & (len_q < BLOCK_M)).any()) or bool(((len_k > 0) & (len_k < BLOCK_N)).any()):
        return None
    if problem.causal and bool((len_k < len_q).any()):
        return None
    whole = not bool((len_q % BLOCK_M != 0).any()) and not bool((len_k % BLOCK_N != 0).any())
    return "whole" if whole else "tail"


def applies(problem: Problem, q1, k1, q2, k2, needs, deterministic: bool) -> bool:
    if GLUON_IMPORT_ERROR is not None or problem.device.type != "cuda" or deterministic:
        return False
    if tuple(needs) != (False, False, True, True) or problem.dtype not in (torch.bfloat16, torch.float16):
        return False
    if problem.dim1 != problem.dim2 or problem.dim1 not in (64, 128):
        return False
    group1, group2 = problem.heads // problem.heads_k1, problem.heads // problem.heads_k2
    if group2 > 1 and (group1 % group2 or listed(problem)):  # side 1's key head: the group's
        return False
    if listed(problem):  # block masks / a window: the key schedule's lists of 128-row query tiles
        if problem.is_varlen:  # (packed sequences with block masks or a window: not written)
            return False
        if problem.seqlen_k % BLOCK_N or problem.seqlen_q % 128 or problem.seqlen_q == 0:
            return False
        for mask in (problem.mask1, problem.mask2):
            if mask is not None and (mask.block_q < 128 or mask.block_k < BLOCK_N):
                return False
    elif tile_fit(problem) is None:
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q1, k1, q2, k2)):
        return False
    from streamkl.backends.triton.common import capability, device_index

    return capability(device_index(problem))[0] == 9


if GLUON_IMPORT_ERROR is None:
    from triton._C.libtriton import ir as _ir
    from triton.experimental.gluon.language._core import builtin as _builtin

    @_builtin
    def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
        """global[coord ...] += src (a shared-memory tile in the descriptor's layout), by one TMA
        bulk reduction (asynchronous: `tma.store_wait` before src is written again)."""
        coord = _semantic._convert_to_ir_values(coord, require_i64=False)
        _semantic.builder.create_async_tma_reduce(_ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord,
                                                  src.handle)

    @gluon.jit
    def _add_dq(ptrs, values, VEC: gl.constexpr):
        """dq2 += values at ptrs (float32, fire and forget). VEC 1: element atomics. VEC 2: each
        thread's consecutive register pairs, which the wgmma accumulator layout keeps on adjacent
        columns, added by one 8-byte vector reduction (the pair's first address is 8-byte aligned:
        even columns)."""
        if VEC == 2:
            gl.inline_asm_elementwise(
                "red.global.add.v2.f32 [$2], {$4, $5};\n\tmov.b32 $0, 0;\n\tmov.b32 $1, 0;",
                "=r,=r,l,l,f,f", [ptrs.to(gl.int64, bitcast=True), values], dtype=gl.int32, is_pure=False, pack=2)
        else:
            gl.atomic_add(ptrs, values, sem="relaxed")

    @gluon.jit
    def _reduce_dq(dq_desc, dq_smem, values, row, col):
        """dq2[row:row + 64, col:col + 64] += values through this warpgroup's float32 shared tile:
        the previous reduction must have read it first (`store_wait`, a step later: long done)."""
        tma.store_wait(0)
        dq_smem.store(values)
        hopper.fence_async_shared()
        _tma_reduce_add(dq_desc, [row, col], dq_smem)

    @gluon.jit
    def _dq_out(dq, out_scale2, DQ_RAW: gl.constexpr):
        """A dq2 tile as added to the float32 buffer: times the output scale, or as it is (DQ_RAW: the
        host's flush scales it)."""
        if DQ_RAW:
            return dq
        return dq * out_scale2

    @gluon.jit
    def _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M: gl.constexpr):
        """DIAG: how many of a causal program's steps, from its first, meet the diagonal (masked)."""
        x = gl.maximum(k0 + 2 * 64 - 1 - offset, 0)  # steps from row 0 below x: on the diagonal
        return gl.minimum(gl.maximum((x + BLOCK_M - 1) // BLOCK_M - first_tile, 0), n_tiles)

    @gluon.jit
    def _step_rows(i, index, first_tile, n_per, len_q, BLOCK_M: gl.constexpr, LISTED: gl.constexpr,
                   TAIL: gl.constexpr, GQA2: gl.constexpr):
        """Step i's first query row (sequence-local), the first row it owns (TAIL: earlier ones
        belong to the step before) and its query head within the group (GQA2)."""
        h_in = 0
        if LISTED:  # step i: half i % 2 of the (i // 2)-th listed 128-row query tile
            tile_row0 = gl.load(index + i // 2) * 128 + (i % 2) * BLOCK_M
        else:
            t = i
            if GQA2:  # step i: tile t of the group's query head h_in (n_per tiles a head)
                h_in = i // n_per
                t = i - h_in * n_per
            tile_row0 = (first_tile + t) * BLOCK_M
        fresh_row0 = tile_row0
        if TAIL:  # a last partial step shifted back to end at the sequence's last row
            tile_row0 = gl.minimum(tile_row0, len_q - BLOCK_M)
        return tile_row0, fresh_row0, h_in

    @gluon.jit
    def _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH: gl.constexpr, p_in=None):
        """(p, q, t) of a step's unmasked scores: with BOTH, t = log2(p / q) first, so that p, q and t
        are all that stay live (registers); else t is p (unused)."""
        if BOTH:
            u2 = st2 * scale2 - lse2[:, None]
            t = st1 * scale1 - lse1[:, None] - u2
            p = gl.exp2(u2 + t)
            q = gl.exp2(u2)
        else:
            if p_in is None:
                p = gl.exp2(st1 * scale1 - lse1[:, None])
            else:  # (EARLY_P: computed while side 2's product ran)
                p = p_in
            q = gl.exp2(st2 * scale2 - lse2[:, None])
            t = p
        return p, q, t

    @gluon.jit
    def _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2: gl.constexpr):
        """The statistics' and g's offsets of query head h_in of the group (GQA2), else as given."""
        if GQA2:
            return o_stat + h_in * stride_sh, o_grad + h_in * stride_gh
        return o_stat, o_grad

    @gluon.jit
    def _step_ahead(j, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
                    stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M: gl.constexpr, LISTED: gl.constexpr,
                    TAIL: gl.constexpr, GQA2: gl.constexpr, BOTH: gl.constexpr, layout: gl.constexpr,
                    G_ONE: gl.constexpr = False):
        """STATS_AHEAD: step j's rows (`_step_rows`) and raw statistics (lse1, lse2, g and with BOTH
        E), loaded a step before they are used; j == n_tiles (past the last step) loads nothing (the
        rows clamped to a listed step, the statistics masked: such a row may be past the sequence).
        G_ONE: g is not loaded (lse1 in its place)."""
        j_in = gl.maximum(gl.minimum(j, n_tiles - 1), 0)
        tile_row0, fresh_row0, h_in = _step_rows(j_in, index, first_tile, n_per, len_q, BLOCK_M, LISTED, TAIL,
                                                 GQA2)
        o_stat_j, o_grad_j = _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2)
        o_r = gl.arange(0, BLOCK_M, layout=layout).to(gl.int64)
        stats = o_stat_j + (o_stat_j * 0 + tile_row0) * stride_sn + o_r * stride_sn
        mask = (o_r * 0 + j) < n_tiles
        lse1 = gl.load(LSE1 + stats, mask=mask, other=0.0)
        lse2 = gl.load(LSE2 + stats, mask=mask, other=0.0)
        if G_ONE:
            g = lse1  # (unused)
        else:
            g = gl.load(GRAD + o_grad_j + (o_grad_j * 0 + tile_row0) * stride_gn + o_r * stride_gn, mask=mask,
                        other=0.0)
        if BOTH:
            e_raw = gl.load(EXPECT + stats, mask=mask, other=0.0)
        else:
            e_raw = lse1  # (unused)
        return tile_row0, fresh_row0, h_in, lse1, lse2, g, e_raw

    @gluon.jit
    def _times_g(g, x, G_ONE: gl.constexpr):
        """g x, g a row's upstream gradient; G_ONE (one g for every row): x, g in the output scales."""
        if G_ONE:
            return x
        return g[:, None] * x

    @gluon.jit
    def _ds1(g, p, t, e_row, G_ONE: gl.constexpr):
        """BOTH's dS1 = g p (t ln 2 + E'), t = log2(p / q), E' the row's minus KL; G_ONE: without g."""
        if G_ONE:
            return p * (t * 0.6931471805599453 + e_row[:, None])
        return g[:, None] * p * (t * 0.6931471805599453 + e_row[:, None])

    @gluon.jit
    def _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH: gl.constexpr, p_in=None,
                   G_ONE: gl.constexpr = False):
        """LISTED: (dS2, dS1) of a step of a full pair (every row has keys on both sides); dS1 is
        dS2 without BOTH."""
        p, q, t = _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH, p_in)
        ds = _times_g(g, q - p, G_ONE)
        ds1 = ds
        if BOTH:
            ds1 = _ds1(g, p, t, e_row, G_ONE)
        return ds, ds1

    @gluon.jit
    def _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j, flag_ptr, len_q, len_k,
                      window_left, window_right, BOTH: gl.constexpr, G_ONE: gl.constexpr = False):
        """LISTED: (dS2, dS1) of a step of a partial pair: backward._tile_dscores's masks, transposed."""
        tile_flags = gl.load(flag_ptr).to(gl.int32)
        a1, a2 = _listed_allowed(o_i[:, None], o_j[None, :], tile_flags, len_q, len_k, window_left, window_right)
        p = gl.exp2(gl.where(a1, st1 * scale1, float("-inf")) - lse1[:, None])
        q = gl.exp2(gl.where(a2, st2 * scale2, float("-inf")) - lse2[:, None])
        ds = gl.where(a2, _times_g(g, q - p, G_ONE), 0.0)  # dS2 kept to side 2's support
        ds1 = ds
        if BOTH:  # (side 2 allows every key side 1 does: `applies_both`); selected, as t and E are NaN
            # on rows without keys (lse +inf, E -inf - -inf)
            t = (st1 * scale1 - lse1[:, None]) - (st2 * scale2 - lse2[:, None])
            ds1 = gl.where(a1, _ds1(g, p, t, e_row, G_ONE), 0.0)
        return ds, ds1

    @gluon.jit
    def _step_stats(tile_row0, h_in, LSE1, LSE2, GRAD, o_stat, o_grad, stride_sn, stride_gn, stride_sh, stride_gh,
                    BLOCK_M: gl.constexpr, GQA2: gl.constexpr, layout: gl.constexpr):
        """A step's rows' statistics (lse1, lse2, g) in `layout`: 64-bit bases from the step's first
        row, then the rows' offsets (64-bit too, so that with a row stride of 1 their constant parts
        become the loads' immediate offsets rather than a pointer each)."""
        o_stat_i, o_grad_i = _head_bases(h_in, o_stat, o_grad, stride_sh, stride_gh, GQA2)
        o_r = gl.arange(0, BLOCK_M, layout=layout).to(gl.int64)
        stats = o_stat_i + (o_stat_i * 0 + tile_row0) * stride_sn
        grads = o_grad_i + (o_grad_i * 0 + tile_row0) * stride_gn
        lse1 = gl.load(LSE1 + stats + o_r * stride_sn)
        lse2 = gl.load(LSE2 + stats + o_r * stride_sn)
        g = gl.load(GRAD + grads + o_r * stride_gn)
        return lse1, lse2, g

    @gluon.jit
    def _bwd_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                      LSE1, LSE2, GRAD, DQ2, DK2, o_stat, o_grad, o_dq, o_dk,
                      stride_sn, stride_gn, stride_dqn, stride_dkn,
                      k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                      n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                      n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                      WG: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                      CAUSAL: gl.constexpr, LISTED: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr,
                      VEC: gl.constexpr, DQ_TMA: gl.constexpr, BOTH: gl.constexpr,
                      DIAG: gl.constexpr, DQ_COLS: gl.constexpr, AHEAD: gl.constexpr, ROT: gl.constexpr,
                      LSPLIT: gl.constexpr, EARLY_P: gl.constexpr, DK_DEFER: gl.constexpr, G_ONE: gl.constexpr,
                      DQ_RAW: gl.constexpr):
        """One warpgroup, 64 keys (k0 + 64 * WG ...): dk2 of its keys; per query tile, its half of the
        tile's dS2 into shared memory (two buffers, alternating), then, once both warpgroups' halves
        are there (`ds_bar`), the tile's dq2 = dS2 k2 over all 128 keys, added by a TMA reduction:
        each warpgroup its DQ_COLS columns every tile (D=128: 64; D=64 with DQ_SPLIT64: 32), or at
        D=64 with DQ_COLS 64 one warpgroup all 64 (turns by tile parity)."""
        HALF: gl.constexpr = 64
        # the score tiles [rows, keys] (S = q k^T: the rows across the wgmma M dimension, each thread
        # two rows' statistics; as S^T = k q^T, before the eleventh session, sixteen rows' a thread)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 64, 16])
        d_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])  # [keys or rows, D]
        key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        o_j = k0 + WG * HALF + gl.arange(0, HALF, layout=key_layout)  # sequence-local keys
        ka1 = k1_smem.slice(WG * HALF, HALF)
        ka2 = k2_smem.slice(WG * HALF, HALF)
        gl.static_assert(BLOCK_M == HALF)  # (the layout above: both dims of a score tile 64)
        zero_s = gl.zeros([BLOCK_M, HALF], gl.float32, s_layout)
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, DQ_COLS, 16])  # [rows, DQ_COLS of D]
        zero_q = gl.zeros([BLOCK_M, DQ_COLS], gl.float32, q_layout)
        if D > DQ_COLS:  # this warpgroup's DQ_COLS columns of dq2, k2[:, cols], every tile
            kb2 = k2_smem.slice(WG * DQ_COLS, DQ_COLS, dim=1)
        else:  # D = 64: all of dq2's columns, every other tile (turns by parity)
            kb2 = k2_smem
        dk = gl.zeros([HALF, D], gl.float32, d_layout)
        ds1_smem, DK1, EXPECT, dq1_desc, out_scale1 = both
        if BOTH:  # side 1's gradients too: dk1 in registers, dq1 by TMA reductions
            dk1 = gl.zeros([HALF, D], gl.float32, d_layout)
            kb1 = k1_smem.slice(WG * 64, 64, dim=1)
        else:
            kb1 = kb2  # (unused)
        o_qd = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, q_layout))
        o_dq_col = gl.arange(0, DQ_COLS, layout=gl.SliceLayout(0, q_layout)).to(gl.int64)
        o_d = gl.arange(0, D, layout=gl.SliceLayout(0, d_layout))
        mbarrier.wait(k_bar, 0)
        # DIAG (causal, dense whole tiles, no GQA): two loops, the steps on the diagonal (masked) then
        # the rest (no mask: with BOTH the masks' registers made ptxas spill in every step)
        if DIAG:
            n_diag = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
        elif LSPLIT:  # LISTED_LOOPS: the full pairs' steps (listed first), then the partial pairs'
            n_diag = gl.minimum(2 * n_full_listed, n_tiles)
        else:
            n_diag = n_tiles
        if AHEAD:  # the first step's rows and statistics (then each step loads the next one's)
            a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
                n_tiles * 0, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
                stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, LISTED, TAIL, GQA2, BOTH, row_layout, G_ONE)
            if BOTH:  # (E is carried from step to step with BOTH only)
                a_e = e_next
        # (ROT: the same two loops in the other order, the unmasked steps first: the producer streams
        # the query tiles from the diagonal's end around to its start; `i` counts the stream, `r`
        # is the step's query tile, the diagonal's last)
        # DK_DEFER (student): a step's dk product is waited for with the next step's score products,
        # which the tensor cores run after it anyway; `held` is the query slot it still reads (-1: none)
        DEFER: gl.constexpr = DK_DEFER and not BOTH
        held = n_tiles * 0 - 1
        if DEFER:  # (the loops carry dk as an accumulator in flight)
            dk = hopper.warpgroup_mma_init(dk)
        for phase in gl.static_range(2 if DIAG or LSPLIT else 1):
            if ROT:
                if phase == 0:
                    i_lo = n_diag * 0
                    i_hi = n_tiles - n_diag
                    shift = n_diag
                else:
                    i_lo = n_tiles - n_diag
                    i_hi = n_tiles
                    shift = n_diag - n_tiles
            elif phase == 0:
                i_lo = n_diag * 0
                i_hi = n_diag
            else:
                i_lo = n_diag
                i_hi = n_tiles
            for i in range(i_lo, i_hi):
                if ROT:
                    r = i + shift
                else:
                    r = i
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                t1 = hopper.warpgroup_mma(q1_smem.index(slot), ka1.permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                t2 = hopper.warpgroup_mma(q2_smem.index(slot), ka2.permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                if AHEAD:  # this step's, loaded a step ago; then the next step's (used there)
                    tile_row0 = a_row0
                    fresh_row0 = a_fresh
                    h_in = a_h
                    lse1 = a_lse1
                    lse2 = a_lse2
                    g = a_g
                    if BOTH:
                        e_row = a_e
                    a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
                        i + 1, n_tiles, index, first_tile, n_per, len_q, LSE1, LSE2, GRAD, EXPECT, o_stat, o_grad,
                        stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, LISTED, TAIL, GQA2, BOTH, row_layout,
                        G_ONE)
                    if BOTH:
                        a_e = e_next
                else:
                    tile_row0, fresh_row0, h_in = _step_rows(r, index, first_tile, n_per, len_q, BLOCK_M,
                                                             LISTED, TAIL, GQA2)
                o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)  # sequence-local rows
                if not AHEAD:
                    # the rows' statistics straight into the score layout (two rows a thread from one 64-bit
                    # base; before the ninth session one a thread, spread by three layout conversions)
                    lse1, lse2, g = _step_stats(tile_row0, h_in, LSE1, LSE2, GRAD, o_stat, o_grad, stride_sn,
                                                stride_gn, stride_sh, stride_gh, BLOCK_M, GQA2, row_layout)
                lse1 = lse1 * 1.4426950408889634
                lse2 = lse2 * 1.4426950408889634
                if BOTH:  # minus the row's KL: (lse1 - lse2) - E in natural units (E as backward._row_stats;
                    # lse1, lse2 are in log2 units here)
                    if not AHEAD:
                        e_row = gl.load(EXPECT + o_stat + (o_stat * 0 + tile_row0) * stride_sn
                                        + gl.arange(0, BLOCK_M, layout=row_layout).to(gl.int64) * stride_sn)
                    e_row = (lse1 - lse2) * 0.6931471805599453 - e_row
                if G_ONE:  # an empty row's gradient is 0: its p and q made 0 by +inf statistics (no g to zero)
                    lse2 = gl.where(lse1 == float("-inf"), float("inf"), lse2)
                    lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
                else:
                    g = gl.where(lse1 == float("-inf"), 0.0, g)  # an empty row's gradient is 0 whatever g is
                if LISTED:  # rows without keys on a side (lse -inf): +inf makes their p, q exactly 0
                    lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
                    lse2 = gl.where(lse2 == float("-inf"), float("inf"), lse2)
                if EARLY_P and not BOTH and not TAIL and (not LISTED or (LSPLIT and phase == 0)):
                    # side 1's exponentials while the tensor cores run side 2's product
                    st1 = hopper.warpgroup_mma_wait(1, deps=[t1])
                    p_early = gl.exp2(st1 * scale1 - lse1[:, None])
                    if DEFER:
                        st2, dk = hopper.warpgroup_mma_wait(0, deps=[t2, dk])
                    else:
                        st2 = hopper.warpgroup_mma_wait(0, deps=[t2])
                else:
                    p_early = None
                    if DEFER:
                        st1, st2, dk = hopper.warpgroup_mma_wait(0, deps=[t1, t2, dk])
                    else:
                        st1, st2 = hopper.warpgroup_mma_wait(0, deps=[t1, t2])
                if DEFER:  # the step before's dk product, waited for with these: its query slot is read
                    if held >= 0:
                        mbarrier.arrive(empty.index(held), count=1)
                if LISTED:
                    visit = r // 2
                    if not BOTH:
                        e_row = g  # (unused)
                    if LSPLIT and phase == 0:  # LISTED_LOOPS: the full pairs' loop
                        ds, ds1 = _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH, p_early, G_ONE)
                    elif LSPLIT:  # the partial pairs' loop
                        ds, ds1 = _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j,
                                                flags_list + visit, len_q, len_k, window_left, window_right, BOTH,
                                                G_ONE)
                    elif visit < n_full_listed:  # (every row of a full pair has keys on both sides)
                        ds, ds1 = _full_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, BOTH, None, G_ONE)
                    else:
                        ds, ds1 = _partial_pair(st1, st2, scale1, scale2, lse1, lse2, g, e_row, o_i, o_j,
                                                flags_list + visit, len_q, len_k, window_left, window_right, BOTH,
                                                G_ONE)
                else:
                    p, q, t = _step_probs(st1, st2, scale1, scale2, lse1, lse2, BOTH, p_early)
                    if TAIL:  # keys / rows that an earlier tile / step owns (shifted back): dS2 0 here
                        allowed = (o_j >= k_fresh)[None, :] & (o_i >= fresh_row0)[:, None]
                        if CAUSAL:
                            allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
                        p = gl.where(allowed, p, 0.0)
                        q = gl.where(allowed, q, 0.0)
                    elif CAUSAL and (phase == (1 if ROT else 0) or not DIAG):  # DIAG: only the diagonal's masked
                        allowed = o_j[None, :] <= (o_i + offset)[:, None]
                        p = gl.where(allowed, p, 0.0)
                        q = gl.where(allowed, q, 0.0)
                    ds = _times_g(g, q - p, G_ONE)
                    if BOTH:  # dS1 = g p (ln(p / q) - KL) = g p ((s1 - s2) ln 2 - E); 0 where p is
                        ds1 = _ds1(g, p, t, e_row, G_ONE)
                ds_t = ds.to(ds_smem.dtype)  # this warpgroup's [rows, keys] of dS2, in the input dtype
                # dS2 through shared memory, the tile's [rows, 128 keys] (the warpgroups' halves side
                # by side): dk2 += dS2^T q2 reads this warpgroup's half transposed, dq2 = dS2 k2 both.
                # Buffer i % 2: its previous readers (tile i - 2) are done, since the other
                # warpgroup arrived on tile i - 1's barrier after its dq2 product of tile i - 2
                ds_all = ds_smem.index(i % 2)
                ds_own = ds_all.slice(WG * HALF, HALF, dim=1)
                ds_own.store(ds_t)
                if BOTH:
                    ds1_all = ds1_smem.index(i % 2)
                    ds1_own = ds1_all.slice(WG * HALF, HALF, dim=1)
                    ds1_own.store(ds1.to(ds_smem.dtype))
                hopper.fence_async_shared()
                mbarrier.arrive(ds_bar.index(i % 2), count=1)
                # dS^T as a transposed (MN-major) shared operand
                ds_own = ds_own.permute((1, 0))
                if BOTH:
                    ds1_own = ds1_own.permute((1, 0))
                dk = hopper.warpgroup_mma(ds_own, q2_smem.index(slot), dk, is_async=True)
                if BOTH:
                    dk1 = hopper.warpgroup_mma(ds1_own, q1_smem.index(slot), dk1, is_async=True)
                    dk, dk1 = hopper.warpgroup_mma_wait(0, deps=[dk, dk1])
                    mbarrier.arrive(empty.index(slot), count=1)  # this slot's query tiles are read
                elif DEFER:  # (waited for with the next step's score products, or after the loops)
                    held = slot
                else:
                    dk = hopper.warpgroup_mma_wait(0, deps=[dk])
                    mbarrier.arrive(empty.index(slot), count=1)  # this slot's query tiles are read
                o_step = o_dq
                if GQA2:
                    o_step = o_dq + h_in * stride_dqh
                # the dq2 tile's addresses: a 64-bit base from this step's first row, 32-bit row
                # offsets inside the tile, then the columns added in 64 bits, which ptxas folds into
                # immediate offsets of each thread's two row addresses (32-bit row + column offsets,
                # as before the ninth session, were 32 values hoisted out of the loop and spilled)
                p_tile = DQ2 + o_step + (o_dq * 0 + tile_row0) * stride_dqn  # (o_dq * 0: 64-bit)
                p_rows = p_tile + (o_qd * stride_dqn)[:, None]
                if D > DQ_COLS:
                    mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)  # both halves of dS2^T stored
                    dq = hopper.warpgroup_mma(ds_all, kb2, zero_q, use_acc=False)
                    if DQ_TMA:  # this warpgroup's [64, DQ_COLS] piece by one TMA bulk reduction
                        _reduce_dq(dq_desc, dq_smem, _dq_out(dq, out_scale2, DQ_RAW), q_row + tile_row0,
                                   dq_col + h_in * D + WG * DQ_COLS)
                        if BOTH:  # dq1 through the same shared tile, once the TMA unit has read dq2's
                            dq1 = hopper.warpgroup_mma(ds1_all, kb1, zero_q, use_acc=False)
                            _reduce_dq(dq1_desc, dq_smem, dq1 * out_scale1, q_row + tile_row0,
                                       dq_col + h_in * D + WG * 64)
                    else:
                        _add_dq(p_rows + (WG * DQ_COLS + o_dq_col)[None, :], _dq_out(dq, out_scale2, DQ_RAW), VEC)
                elif i % 2 == WG:  # (each warpgroup waits on every phase of its own buffer's barrier)
                    mbarrier.wait(ds_bar.index(i % 2), (i // 2) & 1)
                    dq = hopper.warpgroup_mma(ds_all, kb2, zero_q, use_acc=False)
                    if DQ_TMA:
                        _reduce_dq(dq_desc, dq_smem, _dq_out(dq, out_scale2, DQ_RAW), q_row + tile_row0,
                                   dq_col + h_in * D)
                    else:
                        _add_dq(p_rows + o_dq_col[None, :], _dq_out(dq, out_scale2, DQ_RAW), VEC)
        if DEFER:  # the last step's dk product
            dk = hopper.warpgroup_mma_wait(0, deps=[dk])
            if held >= 0:
                mbarrier.arrive(empty.index(held), count=1)
        if DQ_TMA:  # the last reduction has read its shared tile before the program's memory goes
            tma.store_wait(0)
        keys = (k0 + WG * HALF + gl.arange(0, HALF, layout=gl.SliceLayout(1, d_layout))).to(gl.int64)
        p_dk = DK2 + o_dk + keys[:, None] * stride_dkn + o_d[None, :]
        if TAIL:  # keys before k_fresh are the previous tile's (this one shifted back)
            own = (keys >= k_fresh)[:, None] & (o_d < D)[None, :]
            gl.store(p_dk, (dk * out_scale2).to(DK2.dtype.element_ty), mask=own)
        else:
            gl.store(p_dk, (dk * out_scale2).to(DK2.dtype.element_ty))
        if BOTH:  # (whole tiles only: `applies_both`)
            p_dk1 = DK1 + o_dk + keys[:, None] * stride_dkn + o_d[None, :]
            gl.store(p_dk1, (dk1 * out_scale1).to(DK1.dtype.element_ty))

    @gluon.jit
    def _bwd_consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                        LSE1, LSE2, GRAD, DQ2, DK2, o_stat, o_grad, o_dq, o_dk,
                        stride_sn, stride_gn, stride_dqn, stride_dkn,
                        k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                        n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                        n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                        D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
                        LISTED: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr, VEC: gl.constexpr,
                        DQ_TMA: gl.constexpr, BOTH: gl.constexpr, DIAG: gl.constexpr, DQ_COLS: gl.constexpr,
                        AHEAD: gl.constexpr, ROT: gl.constexpr, LSPLIT: gl.constexpr, EARLY_P: gl.constexpr,
                        DK_DEFER: gl.constexpr, G_ONE: gl.constexpr, DQ_RAW: gl.constexpr):
        _bwd_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                      LSE1, LSE2, GRAD, DQ2, DK2, o_stat, o_grad, o_dq, o_dk,
                      stride_sn, stride_gn, stride_dqn, stride_dkn,
                      k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                      n_full_listed, index, flags_list, len_q, len_k, window_left, window_right, k_fresh,
                      n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem, q_row, dq_col, both,
                      1, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, VEC, DQ_TMA, BOTH, DIAG, DQ_COLS, AHEAD,
                      ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)

    @gluon.jit
    def _rows_stats(lse1, lse2, g, G_ONE: gl.constexpr):
        """SPLIT_ROWS: a step's loaded statistics as its exponentials take them (log2 units; an empty
        row's p and q made 0 by +inf, or its g 0)."""
        lse1 = lse1 * 1.4426950408889634
        lse2 = lse2 * 1.4426950408889634
        if G_ONE:
            lse2 = gl.where(lse1 == float("-inf"), float("inf"), lse2)
            lse1 = gl.where(lse1 == float("-inf"), float("inf"), lse1)
        else:
            g = gl.where(lse1 == float("-inf"), 0.0, g)
        return lse1, lse2, g

    @gluon.jit
    def _rows_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                       LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                       k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                       dq_col, more, WG: gl.constexpr, D: gl.constexpr, BLOCK_M: gl.constexpr,
                       STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIAG: gl.constexpr, EARLY_P: gl.constexpr,
                       G_ONE: gl.constexpr, DQ_RAW: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
        """SPLIT_ROWS (student, D=64): one warpgroup, the stream's query tiles of its parity (tile i
        when i % 2 == WG) against all 128 of the program's keys, so that the two warpgroups never
        wait for each other within a step: the [64 rows, 128 keys] scores of both sides, p and q
        from the rows' statistics (loaded a step ahead), dS2 = g (q - p); dq2 = dS2 k2 with dS2
        from registers, dk2^T += q2^T dS2 with dS2 through this warpgroup's shared tile, left in
        flight until the next step's score products. Each step's dq2 tile goes to one of two shared
        float32 tiles and is handed to the TMA unit after the next step's dS2 fence (one fence a
        step: ptxas makes each a MEMBAR.ALL.CTA, which waits for every load in flight). Each
        warpgroup's dk2^T covers its own rows; warpgroup 1 hands its sum to warpgroup 0 through
        shared memory at the end, which stores dk2. `more`: (n_per, len_q, k_fresh, stride_sh,
        stride_gh) for TAIL (a last partial key tile and query step shifted back, the keys and rows
        an earlier one owns masked) and GQA2 (the group's query heads in turn, n_per steps each)."""
        n_per, len_q, k_fresh, stride_sh, stride_gh = more
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, 128, 16])  # [rows or D, 128 keys]
        q_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                           instr_shape=[16, D, 16])  # dq2 [rows, D]
        a_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=q_layout, k_width=2)
        key_layout: gl.constexpr = gl.SliceLayout(0, s_layout)
        row_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
        gl.static_assert(D == BLOCK_M)  # (dk2^T [D, 128] shares the scores' layout)
        o_j = k0 + gl.arange(0, 128, layout=key_layout)  # sequence-local keys
        zero_s = gl.zeros([BLOCK_M, 128], gl.float32, s_layout)
        zero_q = gl.zeros([BLOCK_M, D], gl.float32, q_layout)
        dkt = hopper.warpgroup_mma_init(gl.zeros([D, 128], gl.float32, s_layout))  # in flight across steps
        ds_own = ds_smem.index(WG)
        held = n_tiles * 0 - 1  # the query slot the dk product in flight still reads (-1: none)
        pend_row = n_tiles * 0 - 1  # the first row of the dq2 tile staged and not yet handed over (-1: none)
        pend_buf = n_tiles * 0  # its shared tile (of this warpgroup's two)
        pend_col = dq_col  # its columns in the accumulator
        mbarrier.wait(k_bar, 0)
        if DIAG:  # the steps on the diagonal (masked) first, then the rest
            n_diag = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
        else:
            n_diag = n_tiles
        a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
            n_tiles * 0 + WG, n_tiles, LSE1, first_tile, n_per, len_q, LSE1, LSE2, GRAD, LSE1, o_stat, o_grad,
            stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, False, TAIL, GQA2, False, row_layout, G_ONE)
        a_lse1, a_lse2, a_g = _rows_stats(a_lse1, a_lse2, a_g, G_ONE)
        for phase in gl.static_range(2 if DIAG else 1):
            if phase == 0:
                i_lo = n_tiles * 0 + WG
                i_hi = n_diag
            else:  # this warpgroup's first tile from n_diag on
                i_lo = n_diag + ((n_diag + WG) & 1)
                i_hi = n_tiles
            for i in range(i_lo, i_hi, 2):
                slot = i % STAGES
                mbarrier.wait(ready.index(slot), (i // STAGES) & 1)
                t1 = hopper.warpgroup_mma(q1_smem.index(slot), k1_smem.permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                t2 = hopper.warpgroup_mma(q2_smem.index(slot), k2_smem.permute((1, 0)), zero_s, use_acc=False,
                                          is_async=True)
                tile_row0 = a_row0
                fresh_row0 = a_fresh
                h_in = a_h
                lse1 = a_lse1
                lse2 = a_lse2
                g = a_g
                a_row0, a_fresh, a_h, a_lse1, a_lse2, a_g, e_next = _step_ahead(
                    i + 2, n_tiles, LSE1, first_tile, n_per, len_q, LSE1, LSE2, GRAD, LSE1, o_stat, o_grad,
                    stride_sn, stride_gn, stride_sh, stride_gh, BLOCK_M, False, TAIL, GQA2, False, row_layout,
                    G_ONE)
                # (the dk product in flight finishes before these: wgmma groups complete in order)
                if EARLY_P:  # side 1's exponentials while the tensor cores run side 2's product
                    st1, dkt = hopper.warpgroup_mma_wait(1, deps=[t1, dkt])
                    if held >= 0:
                        mbarrier.arrive(empty.index(held), count=1)
                    p = gl.exp2(st1 * scale1 - lse1[:, None])
                    st2 = hopper.warpgroup_mma_wait(0, deps=[t2])
                else:
                    st1, st2, dkt = hopper.warpgroup_mma_wait(0, deps=[t1, t2, dkt])
                    if held >= 0:
                        mbarrier.arrive(empty.index(held), count=1)
                    p = gl.exp2(st1 * scale1 - lse1[:, None])
                q = gl.exp2(st2 * scale2 - lse2[:, None])
                if TAIL:  # keys / rows that an earlier tile / step owns (shifted back): dS2 0 here
                    o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)
                    allowed = (o_j >= k_fresh)[None, :] & (o_i >= fresh_row0)[:, None]
                    if CAUSAL:
                        allowed = allowed & (o_j[None, :] <= (o_i + offset)[:, None])
                    p = gl.where(allowed, p, 0.0)
                    q = gl.where(allowed, q, 0.0)
                elif CAUSAL and (phase == 0 or not DIAG):
                    o_i = tile_row0 + gl.arange(0, BLOCK_M, layout=row_layout)
                    allowed = o_j[None, :] <= (o_i + offset)[:, None]
                    p = gl.where(allowed, p, 0.0)
                    q = gl.where(allowed, q, 0.0)
                ds_t = _times_g(g, q - p, G_ONE).to(ds_own.dtype)
                ds_own.store(ds_t)  # (read by the dk product; the previous one's finished above)
                hopper.fence_async_shared()  # (and the step before's dq2 tile, staged at its end)
                gl.thread_barrier()  # every thread's fence before the TMA unit reads (the barrier the compiler
                # places for the stores comes before the fence when the stores were the step before's)
                if pend_row >= 0:
                    _tma_reduce_add(dq_desc, [q_row + pend_row, pend_col], dq_all.index(2 * WG + pend_buf))
                dq = hopper.warpgroup_mma(gl.convert_layout(ds_t, a_layout), k2_smem, zero_q, use_acc=False,
                                          is_async=True)
                dkt = hopper.warpgroup_mma(q2_smem.index(slot).permute((1, 0)), ds_own, dkt, is_async=True)
                held = slot
                dq = hopper.warpgroup_mma_wait(1, deps=[dq])
                tma.store_wait(1)  # the reduction of this tile's buffer (two steps ago) has read it
                pend_buf = (i // 2) % 2
                dq_all.index(2 * WG + pend_buf).store(_dq_out(dq, out_scale2, DQ_RAW))
                pend_row = tile_row0
                pend_col = dq_col + h_in * D  # (GQA2: the step's query head's columns)
                # the next step's statistics, in by now (the fence above waited for them)
                a_lse1, a_lse2, a_g = _rows_stats(a_lse1, a_lse2, a_g, G_ONE)
        if pend_row >= 0:  # the last dq2 tile
            hopper.fence_async_shared()
            _tma_reduce_add(dq_desc, [q_row + pend_row, pend_col], dq_all.index(2 * WG + pend_buf))
        dkt = hopper.warpgroup_mma_wait(0, deps=[dkt])
        if held >= 0:
            mbarrier.arrive(empty.index(held), count=1)
        tma.store_wait(0)  # the last reductions have read their shared tiles
        if WG == 1:  # this warpgroup's rows' dk2^T to warpgroup 0
            dk_smem.store(dkt)
            mbarrier.arrive(dk_bar, count=1)
        else:
            mbarrier.wait(dk_bar, 0)
            dkt = dkt + dk_smem.load(s_layout)
            keys = (k0 + gl.arange(0, 128, layout=key_layout)).to(gl.int64)
            o_d = gl.arange(0, D, layout=row_layout)
            p_dk = DK2 + o_dk + keys[None, :] * stride_dkn + o_d[:, None]
            if TAIL:  # keys before k_fresh are the previous tile's (this one shifted back)
                own = (keys >= k_fresh)[None, :] & (o_d < D)[:, None]
                gl.store(p_dk, (dkt * out_scale2).to(DK2.dtype.element_ty), mask=own)
            else:
                gl.store(p_dk, (dkt * out_scale2).to(DK2.dtype.element_ty))

    @gluon.jit
    def _rows_consumer_1(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                         LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                         k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                         dq_col, more, D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr,
                         CAUSAL: gl.constexpr, DIAG: gl.constexpr, EARLY_P: gl.constexpr, G_ONE: gl.constexpr,
                         DQ_RAW: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
        _rows_consumer(q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                       LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                       k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc, dq_all, q_row,
                       dq_col, more, 1, D, BLOCK_M, STAGES, CAUSAL, DIAG, EARLY_P, G_ONE, DQ_RAW, TAIL, GQA2)

    @gluon.jit
    def _split_rows(q1_desc, k1_desc, q2_desc, k2_desc, LSE1, LSE2, GRAD, DK2, dq_desc, seq, head, row_base,
                    key_base, start_q, start_k, k0, offset, first_tile, n_tiles, stride_sb, stride_sh,
                    stride_sn, stride_gb, stride_gh, stride_gn, stride_dkb, stride_dkh, stride_dkn, head_lo,
                    group1, scale1, scale2, out_scale2, head2, seqlen_q, k_fresh, n_per, D: gl.constexpr,
                    BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr, DIAG: gl.constexpr,
                    EARLY_P: gl.constexpr, G_ONE: gl.constexpr, DQ_RAW: gl.constexpr, DQ_LAYOUT: gl.constexpr,
                    DS_LAYOUT: gl.constexpr, TAIL: gl.constexpr, GQA2: gl.constexpr):
        """SPLIT_ROWS: a program's shared memory, barriers and partitions (`_rows_consumer` twice, the
        producer as the default kernel's: each slot's query tiles read by one warpgroup). head2: side
        2's key head (GQA2: the group's; `head` its first query head)."""
        q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [STAGES, BLOCK_M, D], q1_desc.layout)
        q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, D], q2_desc.layout)
        k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [128, D], k1_desc.layout)
        k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [128, D], k2_desc.layout)
        ds_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)  # a tile a warpgroup
        dq_all = gl.allocate_shared_memory(gl.float32, [4, BLOCK_M, D], DQ_LAYOUT)  # two a warpgroup
        # warpgroup 1's dk2^T at the end: its two dq2 tiles' room (32 KB), once its reductions have read them
        dk_smem = dq_all.index(2)._reinterpret(gl.float32, [D, 128], gl.SwizzledSharedLayout(1, 1, 1, order=[1, 0]))
        dk_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(k_bar, count=1)
        mbarrier.init(dk_bar, count=1)
        for s in gl.static_range(STAGES):
            mbarrier.init(ready.index(s), count=1)
            mbarrier.init(empty.index(s), count=1)  # (one warpgroup reads a slot's tiles)
        hopper.fence_async_shared()
        seq64 = seq.to(gl.int64)
        o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
        o_grad = seq64 * stride_gb + head * stride_gh + row_base * stride_gn
        o_dk = seq64 * stride_dkb + head2 * stride_dkh + key_base * stride_dkn
        q_row = start_q
        dq_col = (head - head_lo) * D
        more = (n_per, seqlen_q, k_fresh, stride_sh, stride_gh)
        gl.warp_specialize(
            [
                (_rows_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready, empty,
                                  LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn, stride_dkn,
                                  k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2, dq_desc,
                                  dq_all, q_row, dq_col, more, 0, D, BLOCK_M, STAGES, CAUSAL, DIAG, EARLY_P,
                                  G_ONE, DQ_RAW, TAIL, GQA2)),
                (_rows_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, dk_smem, dk_bar, k_bar, ready,
                                    empty, LSE1, LSE2, GRAD, DK2, o_stat, o_grad, o_dk, stride_sn, stride_gn,
                                    stride_dkn, k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                    dq_desc, dq_all, q_row, dq_col, more, D, BLOCK_M, STAGES, CAUSAL, DIAG,
                                    EARLY_P, G_ONE, DQ_RAW, TAIL, GQA2)),
                (_load_then_stream, (k1_desc, k2_desc, k1_smem, k2_smem, k_bar, start_k + k0, (head // group1) * D,
                                     head2 * D, q1_desc, q2_desc, q1_smem, q2_smem, ready, empty,
                                     q_row + first_tile * BLOCK_M, head * D, head * D, n_tiles, LSE1, BLOCK_M,
                                     STAGES, False, 2, seqlen_q - BLOCK_M - first_tile * BLOCK_M, TAIL, n_per, D,
                                     GQA2)),
            ],
            [4, 1],
            [240, 24],  # (both consumers at 240: at 232 one spilled in its loop)
        )

    @gluon.jit
    def _kl_bwd_gluon_kernel(
        q1_desc, k1_desc, q2_desc, k2_desc,  # 2-D [B * N, H * D] views, boxes [64, D] / [128, D]
        LSE1, LSE2, GRAD, DQ2, DK2,
        dq_desc,  # DQ_TMA: the float32 dq2 buffer as 2-D [B * N, heads * D], [64, DQ_COLS] boxes; else unused
        DK1, EXPECT, dq1_desc,  # BOTH: side 1's dk, the rows' E, its float32 dq buffer
        G_SCALE,  # NORM_G (float16): what GRAD was divided by
        CU_Q, CU_K,  # VARLEN: cu_seqlens (int32); else unused
        Q_COUNT, Q_FULL, Q_INDEX, Q_FLAGS,  # LISTED: the key-major schedule (128 x 128 tiles); else unused
        ORDER,  # ORDERED: the launch ids in the order to run them (`schedule.heaviest_first`); else unused
        stride_sb, stride_sh, stride_sn,  # lse [B, H, N]
        stride_gb, stride_gn, stride_gh,  # g [B, N, H]
        stride_dqb, stride_dqn, stride_dqh,  # the float32 dq2 buffer [B, N, H, D]
        stride_dkb, stride_dkn, stride_dkh,  # dk2 [B, N, H, D]
        stride_cs, stride_ch, stride_ct,  # the key schedule's counts [S', H', nK] (broadcast strides)
        stride_is, stride_ih, stride_it,  # its lists [S', H', nK, nQ], the last dim contiguous
        window_left, window_right,  # LISTED: causality folded into window_right; -1 unbounded
        seqlen_q, seqlen_k, heads, head_lo, group1, group2,  # heads: programs a sequence (key heads of side 2
        # in this launch's chunk of query heads, from head_lo)
        scale1, scale2, out_scale2, out_scale1, k_programs,
        D: gl.constexpr, BLOCK_M: gl.constexpr, STAGES: gl.constexpr, CAUSAL: gl.constexpr,
        DS_LAYOUT: gl.constexpr,  # shared layout of the [BLOCK_M, 128] dS tiles
        LISTED: gl.constexpr,  # block masks or a window: walk the key schedule's query-tile lists
        NORM_G: gl.constexpr,  # float16: GRAD was divided by G_SCALE (backward.py's reason)
        VARLEN: gl.constexpr,  # packed sequences (lengths known on the host: `tile_fit`)
        TAIL: gl.constexpr,  # some length not a whole number of tiles: last tiles shifted back
        GQA2: gl.constexpr,  # side-2 GQA: a program per key head, its group's query heads in turn
        VEC: gl.constexpr,  # dq2 added by element atomics (1) or vector reductions of column pairs (2)
        DQ_TMA: gl.constexpr,  # dq2 added by TMA bulk reductions of [64, 64] tiles (VEC unused)
        DQ_LAYOUT: gl.constexpr,  # DQ_TMA: dq_desc's shared layout
        KEY_MAJOR: gl.constexpr,  # programs ordered key tile first (KEY_MAJOR_GRID)
        BOTH: gl.constexpr,  # side 1's gradients too (BOTH_SIDES)
        DIAG: gl.constexpr,  # causal, dense whole tiles, no GQA: unmasked steps after the diagonal's (DIAG_LOOPS)
        ORDERED: gl.constexpr,  # LISTED: this program's id read from ORDER (each head's busiest key tiles first)
        DQ_COLS: gl.constexpr,  # dq2's columns a consumer warpgroup computes a step (64; D=64 with DQ_SPLIT64: 32)
        AHEAD: gl.constexpr,  # each step's statistics loaded a step earlier (`STATS_AHEAD`)
        ROT: gl.constexpr,  # DIAG: the unmasked steps first, the diagonal's last (`DIAG_LAST`)
        LSPLIT: gl.constexpr,  # LISTED: the full pairs' steps in one loop, the partial pairs' in a second
        EARLY_P: gl.constexpr,  # student: side 1's exponentials while side 2's score product runs (`EARLY_P`)
        DK_DEFER: gl.constexpr,  # student: each step's dk product waited for in the next step (`DK_DEFER`)
        G_ONE: gl.constexpr = False,  # student: one g for every row (a reduced loss), in the output scales (`G_ONE`)
        DQ_RAW: gl.constexpr = False,  # student: dq2 added unscaled, the host's flush scales it (`DQ_RAW`)
        SPLIT_ROWS: gl.constexpr = False,  # student, D=64: each consumer warpgroup its own query tiles (`SPLIT_ROWS`)
    ):
        pid = gl.program_id(0)
        if ORDERED:
            pid = gl.load(ORDER + pid)
        if KEY_MAJOR:
            n_bh = gl.num_programs(0) // k_programs
            pid_k = pid // n_bh
            pid_bh = pid - pid_k * n_bh
        else:
            pid_bh = pid // k_programs
            pid_k = pid - pid_bh * k_programs
        if NORM_G:  # the products are linear in g: the factor comes back with the softmax scale
            out_scale2 = out_scale2 * gl.load(G_SCALE)
            out_scale1 = out_scale1 * gl.load(G_SCALE)
        if G_ONE:  # dS2 = q - p: g (the one value of a reduced loss's expanded g) comes back with the scale
            g_one = gl.load(GRAD)
            out_scale2 = out_scale2 * g_one
            out_scale1 = out_scale1 * g_one  # (BOTH: dS1 = p (ln(p / q) - KL), G_ONE_BOTH)
        seq = pid_bh // heads
        if GQA2:  # the group's first query head (side 1's key head is the group's: group1 % group2 == 0)
            head = head_lo + (pid_bh % heads) * group2
            head2 = head // group2
        else:
            head = head_lo + pid_bh % heads
            head2 = head
        k_fresh = pid_k * 128  # this program's keys from here (earlier ones: the tile before)
        if VARLEN:  # packed sequences: rows start_q ..., keys start_k ...; grid sized by the longest
            start_q = gl.load(CU_Q + seq)
            seqlen_q = gl.load(CU_Q + seq + 1) - start_q
            start_k = gl.load(CU_K + seq)
            seqlen_k = gl.load(CU_K + seq + 1) - start_k
            row_base = start_q.to(gl.int64)  # the statistics, g and dq2 are packed too
            key_base = start_k.to(gl.int64)
        else:
            start_q = seq * seqlen_q
            start_k = seq * seqlen_k
            row_base = 0
            key_base = 0
        if VARLEN:
            if k_fresh >= seqlen_k:  # past this sequence's keys (the grid is sized by the longest)
                return
        k0 = k_fresh
        if TAIL:  # a last partial key tile shifted back to end at the sequence's last key
            k0 = gl.minimum(k_fresh, seqlen_k - 128)
        offset = seqlen_k - seqlen_q
        first_tile = 0
        if CAUSAL:  # query rows i see key k_fresh once i + offset >= k_fresh
            first_tile = gl.maximum(k_fresh - offset, 0) // BLOCK_M
        if LISTED:  # the query tiles (128 rows, two steps each) visiting this key tile, full ones first
            o_count = seq * stride_cs + head * stride_ch + pid_k * stride_ct
            n_tiles = 2 * gl.load(Q_COUNT + o_count)
            n_full_listed = gl.load(Q_FULL + o_count)
            o_list = seq.to(gl.int64) * stride_is + head * stride_ih + pid_k * stride_it
            index = Q_INDEX + o_list
            flags_list = Q_FLAGS + o_list
            first_tile = 0
        else:
            if TAIL:
                n_tiles = (seqlen_q + BLOCK_M - 1) // BLOCK_M - first_tile
            else:
                n_tiles = seqlen_q // BLOCK_M - first_tile
            n_full_listed = n_tiles
            index = Q_INDEX
            flags_list = Q_FLAGS
        n_per = n_tiles  # (GQA2: steps a query head; the loops run over the group's heads in turn)
        if GQA2:
            n_tiles = n_tiles * group2

        if SPLIT_ROWS:
            _split_rows(q1_desc, k1_desc, q2_desc, k2_desc, LSE1, LSE2, GRAD, DK2, dq_desc, seq, head, row_base,
                        key_base, start_q, start_k, k0, offset, first_tile, n_tiles, stride_sb, stride_sh,
                        stride_sn, stride_gb, stride_gh, stride_gn, stride_dkb, stride_dkh, stride_dkn, head_lo,
                        group1, scale1, scale2, out_scale2, head2, seqlen_q, k_fresh, n_per, D, BLOCK_M, STAGES,
                        CAUSAL, DIAG, EARLY_P, G_ONE, DQ_RAW, DQ_LAYOUT, DS_LAYOUT, TAIL, GQA2)
        else:
            q1_smem = gl.allocate_shared_memory(q1_desc.dtype, [STAGES, BLOCK_M, D], q1_desc.layout)
            q2_smem = gl.allocate_shared_memory(q2_desc.dtype, [STAGES, BLOCK_M, D], q2_desc.layout)
            k1_smem = gl.allocate_shared_memory(k1_desc.dtype, [128, D], k1_desc.layout)
            k2_smem = gl.allocate_shared_memory(k2_desc.dtype, [128, D], k2_desc.layout)
            # two buffers
            ds_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)
            if BOTH:
                ds1_smem = gl.allocate_shared_memory(q1_desc.dtype, [2, BLOCK_M, 128], DS_LAYOUT)
                both = (ds1_smem, DK1, EXPECT, dq1_desc, out_scale1)
            else:
                both = (ds_smem, DK2, LSE1, dq_desc, out_scale2)
            if DQ_TMA:  # each consumer warpgroup's float32 dq2 tile on its way to the TMA unit
                dq_all = gl.allocate_shared_memory(gl.float32, [2, BLOCK_M, DQ_COLS], DQ_LAYOUT)
                dq_smem0 = dq_all.index(0)
                dq_smem1 = dq_all.index(1)
            else:
                dq_smem0 = ds_smem
                dq_smem1 = ds_smem
            ds_bar = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
            k_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
            ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            empty = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
            mbarrier.init(k_bar, count=1)
            for s in gl.static_range(2):
                mbarrier.init(ds_bar.index(s), count=2)  # both consumer warpgroups' halves stored
            for s in gl.static_range(STAGES):
                mbarrier.init(ready.index(s), count=1)
                mbarrier.init(empty.index(s), count=2)
            hopper.fence_async_shared()

            seq64 = seq.to(gl.int64)
            o_stat = seq64 * stride_sb + head * stride_sh + row_base * stride_sn
            o_grad = seq64 * stride_gb + head * stride_gh + row_base * stride_gn
            o_dq = seq64 * stride_dqb + (head - head_lo) * stride_dqh + row_base * stride_dqn  # the chunk's accumulator
            o_dk = seq64 * stride_dkb + head2 * stride_dkh + key_base * stride_dkn
            q_row = start_q
            k_row = start_k + k0
            dq_col = (head - head_lo) * D  # DQ_TMA: the head's first column in the chunk's accumulator
            rot = 0
            if ROT:  # the producer's stream starts past the diagonal's steps
                rot = _diag_steps(k0, offset, first_tile, n_tiles, BLOCK_M)
            gl.warp_specialize(
                [
                    (_bwd_consumer, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                                     LSE1, LSE2, GRAD, DQ2, DK2, o_stat, o_grad, o_dq, o_dk,
                                     stride_sn, stride_gn, stride_dqn, stride_dkn,
                                     k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                     n_full_listed, index, flags_list, seqlen_q, seqlen_k, window_left, window_right,
                                     k_fresh, n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem0, q_row, dq_col,
                                     both, 0, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, VEC, DQ_TMA, BOTH,
                                     DIAG, DQ_COLS, AHEAD, ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)),
                    (_bwd_consumer_1, (q1_smem, q2_smem, k1_smem, k2_smem, ds_smem, ds_bar, k_bar, ready, empty,
                                       LSE1, LSE2, GRAD, DQ2, DK2, o_stat, o_grad, o_dq, o_dk,
                                       stride_sn, stride_gn, stride_dqn, stride_dkn,
                                       k0, offset, first_tile, n_tiles, scale1, scale2, out_scale2,
                                       n_full_listed, index, flags_list, seqlen_q, seqlen_k, window_left, window_right,
                                       k_fresh, n_per, stride_sh, stride_gh, stride_dqh, dq_desc, dq_smem1, q_row,
                                       dq_col, both, D, BLOCK_M, STAGES, CAUSAL, LISTED, TAIL, GQA2, VEC, DQ_TMA, BOTH,
                                       DIAG, DQ_COLS, AHEAD, ROT, LSPLIT, EARLY_P, DK_DEFER, G_ONE, DQ_RAW)),
                    (_load_then_stream, (k1_desc, k2_desc, k1_smem, k2_smem, k_bar, k_row, (head // group1) * D,
                                         head2 * D, q1_desc, q2_desc, q1_smem, q2_smem, ready, empty,
                                         q_row + first_tile * BLOCK_M, head * D, head * D, n_tiles, index, BLOCK_M,
                                         STAGES, LISTED, 2, seqlen_q - BLOCK_M - first_tile * BLOCK_M, TAIL,
                                         n_per, D, GQA2, rot, ROT)),
                ],
                [4, 1],
                [240, 32],  # (the default partition gets the rest of 3 x 168: 232; with 232 / 40 BOTH spilled
                # 40 % more; 240 / 24, both consumers at 240, measured within noise: nineteenth session)
            )


#: Causal dense launches (whole tiles, no GQA) run the steps on the diagonal in one loop and the
#: rest, which need no causal mask, in a second.
DIAG_LOOPS = True

#: With BOTH and DIAG_LOOPS, the unmasked steps' loop first and the diagonal's second (the producer
#: streams the query tiles from the diagonal's end around to its start). With the diagonal's loop
#: first, ptxas spilled 24-28 values (64-bit wgmma descriptors) that the unmasked loop, where a
#: causal program spends all but two of its steps, reloaded every step (sm_90a SASS, fourteenth
#: session); in this order that loop reloads 4-6 (the diagonal's ~45, twice a program), as the
#: non-causal build's one loop does 1-5. Fifteenth session (simulator first: `gluon_simulate.py
#: --backward --both --diag-last`; its GPU tests passed on the H200): all four gradients, N=16K,
#: H=16, D=128, bf16, the backward call alone (interleaved do_bench medians,
#: `results/ab_diag_last_h200.jsonl`) 9.09 -> 8.07 ms causal, non-causal unchanged (15.36 /
#: 15.37); forward + backward, calls interleaved in one process: 12.16 -> 10.66 ms, 16 packed causal
#: sequences of 4096 tokens 13.56 -> 12.65. On. (The student kernel, spill-free causal or not,
#: keeps the diagonal first.)
DIAG_LAST = True

#: Block masks and windows (LISTED): the full pairs' steps, which a key tile's list holds first, in
#: one loop without masks and the partial pairs' in a second (as DIAG_LOOPS for causal launches),
#: instead of one loop that branches on each step. In sm_90a SASS the student's D=128 listed build
#: then has no local memory (one loop: 6 spill stores), BOTH's spills shift (one loop: ~150 spill
#: stores in all). Fifteenth session (simulator first: `gluon_simulate.py --backward [--both]
#: --listed-loops`; both GPU tests passed on the H200): 90 % block sparsity, N=16K, H=16, D=128,
#: bf16, forward + backward, calls interleaved in one process (`results/ab_listed_loops_h200.jsonl`):
#: student 2.068 against 2.090 ms (on: LISTED_LOOPS), all four gradients 3.080 against 3.086
#: (within noise: LISTED_LOOPS_BOTH stays off).
LISTED_LOOPS = True
LISTED_LOOPS_BOTH = False

#: The student kernel waits for side 1's score product alone, computes p = exp2(s1 - lse1) while
#: the tensor cores still run side 2's, then waits for that. In the D=64 kernel a consumer
#: warpgroup's products and exponentials follow one another within a step (Nsight Compute,
#: fifteenth session: 26 % of its stall samples on the exponentials, 16 % on wgmma waits); in the
#: sm_90a SASS ptxas keeps only 5 of p's 32 MUFU.EX2 a thread between the two waits (it sinks the
#: rest past the second, interleaved with q's). Written in the fifteenth session (simulated:
#: `gluon_simulate.py --backward --early-p`), run on the H200 in the sixteenth (its GPU test
#: passed; N=16K, H=16, bf16, the backward call alone, interleaved do_bench medians,
#: `results/ab_early_p_h200.jsonl`): D=64 5.80 -> 5.64 ms (5.75 -> 5.59 in a second run), causal
#: 2.96 -> 2.99 (2.97 -> 2.99 in the second: slower), D=128 9.60 / 9.67 and causal 5.03 / 4.94
#: (within the rounds' spread); forward + backward in one process (`ab_early_p_trees_h200.jsonl`):
#: D=64 9.74 -> 9.58, 90 % block sparsity 2.14 -> 2.21 (host-bound, within its noise). On where it
#: won: the student kernel at D=64 without a causal mask or a block mask / window (`early_p_on`);
#: `EARLY_P_EVERYWHERE` (tests) takes it to every student launch but TAIL ones (dense steps, a
#: block mask's full pairs).
EARLY_P = True
EARLY_P_EVERYWHERE = False


def early_p_on(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a launch with these constexprs waits for side 1's product alone (`EARLY_P`, or
    `switch` if given): the student kernel at D=64, not causal, not listed; with
    `EARLY_P_EVERYWHERE` every student launch."""
    on = bool(EARLY_P if switch is None else switch) and not constexprs["BOTH"]
    if EARLY_P_EVERYWHERE:
        return on
    return on and constexprs["D"] == 64 and not constexprs["CAUSAL"] and not constexprs["LISTED"]


#: The student kernel leaves each step's dk product (dk += dS2^T q2) in flight and waits for it
#: with the next step's score products (the tensor cores run them in order anyway), releasing the
#: step's query slot then, instead of waiting for it before the step's dq product and the next
#: step. Sixteenth session: simulated (`gluon_simulate.py --backward --dk-defer`; a mutation that
#: never releases the slot hangs it), its GPU test passed on the H200 (every student launch), then
#: timed there (N=16K, H=16, bf16, the backward call alone, interleaved do_bench medians of 5
#: rounds, `results/ab_dk_defer_h200.jsonl`; EARLY_P as on): D=64 5.65 -> 5.51 ms, causal 2.97 ->
#: 2.91; D=128 9.44 -> 9.73 (slower in every round), causal 5.02 -> 4.96. On at D=64
#: (`dk_defer_on`); `DK_DEFER_EVERYWHERE` (tests) takes it to every student launch.
DK_DEFER = True
DK_DEFER_EVERYWHERE = False


def dk_defer_on(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a launch with these constexprs waits for each step's dk product in the next step
    (`DK_DEFER`, or `switch` if given): the student kernel at D=64; with `DK_DEFER_EVERYWHERE`
    every student launch."""
    on = bool(DK_DEFER if switch is None else switch) and not constexprs["BOTH"]
    return on and (bool(DK_DEFER_EVERYWHERE) or constexprs["D"] == 64)


#: Student kernel, a reduced loss (one g for every row: the rows' upstream gradient expanded from
#: a scalar, strides 0): dS2 = q - p, g multiplied in with the output scales (dk2's in the kernel,
#: dq2's by the flush: `DQ_RAW`), instead of g (q - p) per score (one float32 multiply a score
#: fewer, g's loads gone). bfloat16 only (float16 rescales g: `backward.rescaled_upstream`).
#: Eighteenth session, H200, N=16K, H=16, backward alone with DQ_RAW (`ab_g_one_h200.jsonl`): D=64
#: 5.53 -> 5.37 ms, causal 2.91 -> 2.85; D=128 9.58 -> 9.42, causal 5.08 -> 4.93. On.
G_ONE = True

#: Student kernel: dq2's tiles added to the float32 buffer as the products leave them, the output
#: scale (the softmax scale, g with G_ONE, float16's g scale) applied once by the flush into the
#: 16-bit gradient instead of to every tile (a float32 multiply per dq2 element and step fewer).
#: Alone within noise (D=64 5.53 / 5.59 ms), with G_ONE the fastest of the four (see G_ONE). On.
DQ_RAW = True


#: G_ONE in the BOTH kernel too (dS1 = p (ln(p / q) - KL), g in dk1's and dq1's scales as in dk2's
#: and dq2's: two float32 multiplies a score fewer; sm_90a loop 823 -> 756 instructions causal).
#: Nineteenth session, all four gradients (two A/B runs, 5 and 9 rounds): causal 7.93 -> 7.80 and
#: 8.03 -> 7.88 ms, non-causal 15.12 / 15.28 and 15.37 / 15.33 (spreads 0.5-1.3 ms). On.
G_ONE_BOTH = True


#: Student kernel at D=64 (dense or packed whole tiles, no side-2 GQA, no block masks or window):
#: the two consumer warpgroups split the query tiles instead of the keys (`_rows_consumer`:
#: each its own 64-row tiles against all 128 keys, dq2 from dS2 in registers, its own dk2^T
#: summed at the end), so neither waits for the other's dS half within a step, as the keys'
#: split does before every dq2 product (13 % of a consumer warp's stall samples at D=64,
#: `results/ncu_source_d64_g_one_h200.txt`); the score products are [64, 128] wgmma tiles and
#: dS2 feeds the dq2 product from registers (a 64 x 128 step: 537 SASS instructions against the
#: keys' split's 2 x 392). Twentieth session, H200, N=16K, H=16, bf16, the backward call alone
#: (interleaved do_bench medians of 5-7 rounds, `results/ab_split_rows_h200.jsonl`): as first
#: written 5.30 -> 5.54 ms, causal 2.81 -> 2.49; with one fence a step and the statistics scaled
#: after it (Nsight Compute: those two had 21 % of the stall samples) 5.30 -> 4.46 and 5.34 ->
#: 4.53 ms, causal 2.80 -> 2.45 with six ring slots. On.
SPLIT_ROWS = True

#: SPLIT_ROWS's ring slots (each warpgroup holds two: the step's and, until the next step's score
#: products are in, the one its dk product reads), or None: 4 without causality, 6 causal (6 x 16
#: KB fit with two float32 dq2 tiles a warpgroup, warpgroup 1's dk2^T at the end taking its pair's
#: room). Measured in the same runs: non-causal 4.44 / 4.53 ms with 4 slots, 5.06 with 5, 4.86 /
#: 4.87 with 6; causal 2.59 / 2.65 with 4, 2.47 with 5, 2.45 / 2.45 with 6.
SPLIT_ROWS_STAGES = None


def split_rows_stages(causal: bool) -> int:
    """SPLIT_ROWS's ring slots (`SPLIT_ROWS_STAGES`)."""
    if SPLIT_ROWS_STAGES is not None:
        return int(SPLIT_ROWS_STAGES)
    return 6 if causal else 4


#: SPLIT_ROWS for partial tiles (TAIL) and side-2 GQA (GQA2) too, without causality. Twentieth
#: session: written, simulated (`gluon_simulate.py --backward --split-rows`), its GPU test passed on
#: the H200 (`test_gluon_student_backward_split_rows_wide`, causal and not), then timed there (N=16K,
#: H=16, bf16, the backward call alone, interleaved, 3 rounds, `results/ab_split_rows_wide_h200.jsonl`):
#: N=16320 5.76 -> 5.25 ms, causal 3.12 -> 3.86; GQA 16/4 5.48 -> 4.78, causal 2.98 -> 3.72 (causal
#: launches of these mask every step: no diagonal loop; their builds spill ~0.5 KB), hence the scope
#: without causality. Twenty-first session: the whole GPU set ran with it on (582 passed, 1 skipped; the
#: one failure, the scope test, asserted the old default). On.
SPLIT_ROWS_WIDE = True
#: ... and causal ones too (measured slower, above; for tests).
SPLIT_ROWS_WIDE_CAUSAL = False


def split_rows_on(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a launch with these constexprs splits the query tiles between the consumer
    warpgroups (`SPLIT_ROWS`, or `switch` if given): the student kernel at D=64, dq2 by TMA
    reductions of whole [64, 64] tiles, not listed; partial tiles and side-2 GQA with
    `SPLIT_ROWS_WIDE` only, and without causality unless `SPLIT_ROWS_WIDE_CAUSAL`."""
    on = bool(SPLIT_ROWS if switch is None else switch) and not constexprs["BOTH"] and constexprs["D"] == 64
    wide = bool(SPLIT_ROWS_WIDE)
    return on and constexprs["DQ_TMA"] and constexprs["DQ_COLS"] == 64 and not constexprs["LISTED"] and (
        (wide and (bool(SPLIT_ROWS_WIDE_CAUSAL) or not constexprs["CAUSAL"]))
        or not (constexprs["TAIL"] or constexprs["GQA2"]))


def g_one_on(both: bool, grad_rows: torch.Tensor, unscaled: bool, switch: bool | None = None) -> bool:
    """Whether a launch reads one g for every row (`G_ONE`, or `switch` if given): the student
    kernel (with `G_ONE_BOTH` the BOTH kernel too), g expanded from one value (strides 0), not
    rescaled (bfloat16)."""
    on = bool(G_ONE if switch is None else switch) and (not both or bool(G_ONE_BOTH))
    return on and unscaled and not any(grad_rows.stride())


def dq_raw_on(both: bool, switch: bool | None = None) -> bool:
    """Whether a launch adds dq2 unscaled (`DQ_RAW`, or `switch` if given): the student kernel."""
    return bool(DQ_RAW if switch is None else switch) and not both


@functools.lru_cache(maxsize=4)
def ds_shared_layout(dtype: torch.dtype):
    """The shared layout of a step's dS tile, [64 rows, 128 keys] (cached, as every layout built
    on the host a call: `get_default_for` is a constexpr function, ~10 us a call on the H200's host)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, BLOCK_N], gl_dtype(dtype))


@functools.lru_cache(maxsize=4)
def dq_layout(cols: int = 64):
    """The shared layout of a [64, cols] float32 dq tile (DQ_TMA)."""
    return gl.NVMMASharedLayout.get_default_for([BLOCK_M, cols], gl.float32)


def dq_descriptor(accum: torch.Tensor, cols: int = 64):
    """The float32 dq accumulator [..., heads, D] as a 2-D [tokens, heads * D] TMA target in
    [64, cols] boxes (DQ_TMA; allocated by `_backward`: contiguous, aligned, non-empty)."""
    from streamkl.backends.triton.common import fast_descriptor

    return fast_descriptor(TensorDescriptor, accum, accum.shape[-2] * accum.shape[-1], [BLOCK_M, cols],
                           dq_layout(cols))


#: At head dim 64 each consumer warpgroup computes and adds 32 of dq2's 64 columns every step
#: (DQ_COLS 32: [64, 32] wgmma tiles and TMA reductions; DQ_TMA only) instead of one warpgroup all
#: 64 every other step by parity. Written in the thirteenth session (its branch was lost) and again
#: in the fourteenth; its GPU tests passed there, and it was slower (H200, N=16K, H=16, bf16, forward
#: + student backward, calls interleaved in one process): 10.84 against 9.76 ms, causal 5.91
#: against 5.46 (results/ab_dq_split64_h200.jsonl). Twice the wgmma instructions of half the N, two
#: TMA reductions a step instead of one, and both warpgroups waiting on every dS barrier phase
#: cost more than the parity's imbalance. Off.
DQ_SPLIT64 = False


#: Tried in the fourteenth and fifteenth sessions and removed (commit 390d813 has them): DQ_LAG,
#: each step's dq tiles computed at the top of the next step, so that a warpgroup no longer waited
#: for the other's dS half of its current step (student D=64, forward + backward, calls interleaved
#: in one process: 10.60 against 9.83 ms; all four gradients causal 12.51 against 12.00,
#: `results/ab_dq_lag_h200.jsonl`); PINGPONG, the student's two consumer warpgroups taking turns to
#: issue their products (two mbarriers, FlashAttention-3's ping-pong), each step's dq tiles two
#: steps later from three dS buffers (the backward call alone at D=64: 7.33 against 6.00 ms, causal
#: 3.75 against 3.27; at D=128 within the spread, `results/ab_stats_ahead_h200.jsonl`). Both
#: passed their GPU tests. Nsight Compute puts the D=64 kernel's consumer stalls on the
#: exponentials' MUFU queue (26 %), the statistics' loads (27 %, before STATS_AHEAD) and the wgmma
#: waits (14 %): the turns add waits without freeing the MUFU, which both warpgroups share.


#: Each step's rows and statistics (lse1, lse2, g; with BOTH also E) loaded one step ahead, at the
#: top of the step before, so that their global loads' latency runs under that step's work rather
#: than between its score products and its exponentials. Nsight Compute of the D=64 student kernel
#: without it (fifteenth session, `results/ncu_source_d64_h200.txt`) put 27 % of a consumer
#: warp's stall samples on long-scoreboard waits, most at the first use of lse1 right after the
#: score products. With it (H200, N=16K, H=16, bf16, the backward call alone, interleaved do_bench
#: medians, `results/ab_stats_ahead_h200.jsonl`): D=64 6.00 -> 5.74 ms, causal 3.27 -> 2.95; D=128
#: 9.60 -> 9.41, causal 4.96 / 5.00 (within its spread); 90 % block sparsity (forward + student
#: backward) 2.28 -> 2.23. For BOTH (STATS_AHEAD_BOTH: eight more live registers where it has none
#: spare, spills 130 -> 183 stores causal) slower: 9.10 -> 10.46 causal, 15.11 -> 15.66: off.
STATS_AHEAD = True
STATS_AHEAD_BOTH = False


def stats_ahead(both: bool) -> bool:
    """Whether a launch loads its statistics a step ahead (`STATS_AHEAD`)."""
    return bool(STATS_AHEAD_BOTH) if both else bool(STATS_AHEAD)


def diag_last(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a launch with these constexprs runs its diagonal's steps last (`DIAG_LAST`, or
    `switch` if given: BOTH with DIAG; not with the switches that index steps across the two loops)."""
    return bool(DIAG_LAST if switch is None else switch) and constexprs["BOTH"] and constexprs["DIAG"] and not (
        constexprs["AHEAD"])


def listed_loops(constexprs: dict, switch: bool | None = None) -> bool:
    """Whether a listed launch runs its full pairs' and partial pairs' steps in two loops
    (`LISTED_LOOPS` / `LISTED_LOOPS_BOTH`, or `switch` if given)."""
    default = LISTED_LOOPS_BOTH if constexprs["BOTH"] else LISTED_LOOPS
    return bool(default if switch is None else switch) and constexprs["LISTED"]


def dq_cols(dim: int) -> int:
    """dq2's columns one consumer warpgroup computes a step (`DQ_SPLIT64`)."""
    return 32 if dim == 64 and DQ_SPLIT64 and DQ_TMA else 64


def launch_args(problem: Problem, q1, k1, q2, k2, lse1, lse2, grad_rows, dq2, dk2, schedule=None, g_scale=None,
                head_lo: int = 0, heads: int | None = None, both=None):
    """(grid, positional arguments, constexprs) of one launch over `heads` heads from `head_lo`
    (default all of them); `dq2` is the float32 accumulator of those heads [B, N, heads, D]. Block
    masks or a window (`listed`): `schedule` (query-major, 128 x 128 tiles) is walked through its
    key-major view. `both`: BOTH's (dk1, expect, dq1 accumulator)."""
    grid, fixed, constexprs = launch_plan(problem, lse1, grad_rows, dq2, dk2, schedule, g_scale is None, head_lo,
                                          heads, both is not None)
    args = call_args(q1, k1, q2, k2, lse1, lse2, grad_rows, dq2, dk2, g_scale, both)
    return grid, (*args, *(lse1 if t is None else t for t in fixed)), constexprs


def call_args(q1, k1, q2, k2, lse1, lse2, grad_rows, dq2, dk2, g_scale=None, both=None) -> tuple:
    """The launch's leading arguments, those each call's tensors make: the inputs' descriptors
    (key tiles of `keys` rows), the statistics, g, the accumulators and gradients (and their
    descriptors), g's scale."""
    descs = [flat_descriptor(t, box) for t, box in ((q1, BLOCK_M), (k1, BLOCK_N), (q2, BLOCK_M), (k2, BLOCK_N))]
    return (
        *descs, lse1, lse2, grad_rows, dq2, dk2, dq_descriptor(dq2, dq_cols(dq2.shape[-1])) if DQ_TMA else descs[0],
        *((both[0], both[1], dq_descriptor(both[2])) if both is not None else (dk2, lse1, descs[0])),  # BOTH
        lse1 if g_scale is None else g_scale,
    )  # fmt: skip


def launch_plan(problem: Problem, lse1, grad_rows, dq2, dk2, schedule=None, unscaled: bool = True,
                head_lo: int = 0, heads: int | None = None, both: bool = False):
    """What a launch takes beyond `call_args`: (grid, the arguments after them, constexprs), the
    same for every call of the problem whose tensors have these strides (`unscaled`: no g_scale).
    None among the arguments marks a placeholder pointer the kernel does not read (the call's
    lse1 takes its place: `launch_args`)."""
    from streamkl.backends.triton.common import (
        broadcast_strides,
        group_sizes,
        log2_scales,
        row_strides,
        stat_strides,
        window_bounds,
    )
    from streamkl.backends.triton.gluon_forward import listed
    from streamkl.sparse.schedule import get_key_schedule, heaviest_first

    group1, group2 = group_sizes(problem)
    scale1, scale2 = log2_scales(problem)
    k_programs = -(-problem.seqlen_k // BLOCK_N)
    heads = problem.heads if heads is None else heads
    varlen = problem.is_varlen
    cu_q, cu_k = (problem.cu_seqlens_q, problem.cu_seqlens_k) if varlen else (None, None)
    is_listed = listed(problem)
    if is_listed:
        assert schedule is not None and (schedule.block_q, schedule.block_k) == (128, BLOCK_N)
        keys = get_key_schedule(schedule)
        lists = (keys.q_count, keys.q_full, keys.q_index, keys.q_partial)
        list_strides = (*broadcast_strides(keys.q_count), *broadcast_strides(keys.q_index)[:3])
        window = window_bounds(problem)
    else:
        lists, list_strides, window = (None,) * 4, (0,) * 6, (-1, -1)
    programs = k_programs * problem.batch * (heads // group2)
    grid_key_major = key_major(problem, programs)
    ordered = is_listed and bool(HEAVY_FIRST) and not grid_key_major  # (the table holds head-major ids)
    order = heaviest_first(keys.q_count, problem.batch, head_lo, heads // group2, group2, k_programs) if ordered \
        else None
    fixed = (
        cu_q, cu_k, *lists, order,
        *stat_strides(lse1, varlen), *row_strides(grad_rows, varlen), *row_strides(dq2, varlen),
        *row_strides(dk2, varlen),
        *list_strides, *window,
        problem.seqlen_q, problem.seqlen_k, heads // group2, head_lo, group1, group2,
        scale1, scale2, scale2 * LN2, scale1 * LN2, k_programs,
    )  # fmt: skip
    use_tma = bool(DQ_TMA)
    ds_layout = ds_shared_layout(problem.dtype)
    constexprs = dict(D=problem.dim2, BLOCK_M=BLOCK_M, STAGES=stages(problem.dim2), CAUSAL=problem.causal,
                      DS_LAYOUT=ds_layout, LISTED=is_listed, NORM_G=not unscaled, VARLEN=varlen,
                      TAIL=not is_listed and tile_fit(problem) == "tail", GQA2=group2 > 1, VEC=dq_vec(problem),
                      DQ_TMA=use_tma, DQ_LAYOUT=dq_layout(dq_cols(problem.dim2)), BOTH=both,
                      DQ_COLS=dq_cols(problem.dim2), AHEAD=stats_ahead(both))
    constexprs["DIAG"] = bool(DIAG_LOOPS) and problem.causal and not is_listed and not constexprs["TAIL"] \
        and group2 == 1
    constexprs["ROT"] = diag_last(constexprs)
    constexprs["LSPLIT"] = listed_loops(constexprs)
    constexprs["EARLY_P"] = early_p_on(constexprs)
    constexprs["DK_DEFER"] = dk_defer_on(constexprs)
    constexprs["G_ONE"] = g_one_on(both, grad_rows, unscaled)
    constexprs["DQ_RAW"] = dq_raw_on(both)
    constexprs["SPLIT_ROWS"] = split_rows_on(constexprs)
    if constexprs["SPLIT_ROWS"]:
        constexprs["STAGES"] = split_rows_stages(problem.causal)
    if both:  # two query stages: the second dS^T pair takes the third's room
        constexprs["STAGES"] = 2
    constexprs["KEY_MAJOR"] = grid_key_major
    constexprs["ORDERED"] = ordered
    return (programs,), fixed, constexprs


#: Both sides' gradients by the same kernel where `applies_both` holds (BOTH: dS1 = g p (ln(p / q)
#: - KL) next to dS2, dk1 in registers next to dk2, dq1 by TMA reductions after dq2's; 6 products a
#: step against backward.py's two kernels' 8). Written in the tenth session, first run in the
#: eleventh (H200, N=16K, D=128, bf16, all four gradients): 15.88 against 21.83 ms non-causal,
#: 9.61 against 10.81 causal. ptxas spills ~0.1 KB non-causal (loop-invariant scalars: a few local
#: loads a step); dk1 + dk2 take 128 of the consumer's 232 registers.
BOTH_SIDES = True


def applies_both(problem: Problem, q1, k1, q2, k2, needs, deterministic: bool) -> bool:
    """Whether all four gradients come from the Gluon kernel with BOTH: 16-bit inputs, D=128 on
    both sides, no GQA, dense sequences (packed ones too with BOTH_VARLEN) of whole tiles (causal or
    not), or with block masks / a window (LISTED: whole 128-row tiles, mask blocks of at least 128,
    side 2 masked as side 1 or not at all); sm_90; not deterministic; STREAMKL_GLUON not 0; dq by
    TMA reductions (`DQ_TMA`)."""
    if not BOTH_SIDES or GLUON_IMPORT_ERROR is not None or problem.device.type != "cuda" or deterministic:
        return False
    if not DQ_TMA:  # dq1 is added by TMA reductions only
        return False
    if setting() is False:  # STREAMKL_GLUON=0 / USE_GLUON = False
        return False
    if tuple(needs) != (True, True, True, True) or problem.dtype not in (torch.bfloat16, torch.float16):
        return False
    if (problem.dim1, problem.dim2) != (128, 128) or problem.heads_k1 != problem.heads:
        return False
    if problem.heads_k2 != problem.heads:
        return False
    if problem.is_varlen and (not BOTH_VARLEN or listed(problem) or tile_fit(problem) != "whole"):
        return False  # (packed sequences: whole tiles, no masks or window; BOTH_VARLEN)
    if listed(problem):  # block masks / a window (BOTH_LISTED), as the student's `applies` takes them
        if not BOTH_LISTED or problem.seqlen_k % BLOCK_N or problem.seqlen_q % 128 or problem.seqlen_q == 0:
            return False
        for mask in (problem.mask1, problem.mask2):
            if mask is not None and (mask.block_q < 128 or mask.block_k < BLOCK_N):
                return False
        # side 2 allows every key side 1 does (no side-2 mask, or the same pattern): no row's KL is
        # +inf, and dS1 needs no case for keys that side 1 takes and side 2 masks
        mask1, mask2 = problem.mask1, problem.mask2
        if mask2 is not None and (mask1 is None or mask1.pattern is not mask2.pattern
                                  or (mask1.block_q, mask1.block_k) != (mask2.block_q, mask2.block_k)):
            return False
    elif tile_fit(problem) != "whole":
        return False
    if not all(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in (q1, k1, q2, k2)):
        return False
    from streamkl.backends.triton.common import capability, device_index

    return capability(device_index(problem))[0] == 9


#: BOTH with block masks or a window (LISTED), where `applies_both` allows it. Written in the twelfth
#: session for the 90 % block-sparse target and off by default: measured on the H200 (N=16K, H=16,
#: bf16, the same 90 % mask both sides, all four gradients, torch.profiler) its kernel took 2.14 ms
#: against backward.py's two (dq 1.01 + dk 1.28 ms), but its float32 dq accumulators' zero fill and
#: casts 0.24 ms more, which backward.py's query-major dq pass writes directly: 2.94 against 2.84 ms
#: forward + backward back to back (benchmarks/results/ab_both_listed_h200.json), so it was off.
#: With HEAVY_FIRST and G_AS_IS (thirteenth session) it wins: 2.785 against 2.822 ms back to back,
#: 3.234 against 3.312 synchronized (results/ab_both_listed_heavy.jsonl), hence on.
BOTH_LISTED = True

#: BOTH over packed sequences of whole tiles (no masks or window), where `applies_both` allows it.
#: Written in the thirteenth session (the Gluon simulator's varlen cases: an empty sequence,
#: Nk > Nq, 64-row steps, two head chunks); its GPU test passed on the H200 in the fourteenth, and
#: there 16 packed causal sequences of 4096 tokens (H=16, D=128, bf16, all four gradients, calls
#: interleaved in one process) took 13.11 ms with it against 14.83 without, their batched call
#: 13.15-13.25 (results/ab_both_varlen_h200.jsonl): on.
BOTH_VARLEN = True

#: With BOTH, a reduced loss's upstream gradient (one value expanded over the rows: strides 0) read
#: as it is instead of copied head-major (one launch fewer). Measured on the H200 (thirteenth
#: session, N=16K, H=16, bf16, calls interleaved in one process, back to back): all four gradients
#: 11.80 against 12.35 ms causal, 20.66 against 21.22 non-causal; the student kernel the other way
#: (15.30 against 14.99 ms, 7.64 against 7.58 causal: its code without the unit row stride is
#: slower), so the student's g stays head-major (results/ab_g_as_is.jsonl).
G_AS_IS = True


def kl_backward_both(problem: Problem, q1, k1, q2, k2, lse1, lse2, expect, grad_rows, schedule=None):
    """(dq1, dk1, dq2, dk2) through the kernel with BOTH; `applies_both()` must hold (and, with
    block masks or a window, a schedule of 128 x 128 tiles be given). Two float32 dq accumulators,
    head-chunked as the student's (two chunks: together the size of one 16-bit dq pair, under the
    four gradients returned)."""
    return _backward(problem, q1, k1, q2, k2, lse1, lse2, grad_rows, schedule, expect)


def kl_backward(problem: Problem, q1, k1, q2, k2, lse1, lse2, grad_rows, schedule=None):
    """(None, None, dq2, dk2) through the Gluon kernel; `applies()` must hold (and, with block
    masks or a window, a schedule of 128 x 128 tiles be given). The float32 dq2 accumulator holds
    one chunk of the heads at a time, chunked as backward.py's atomic pass is
    (`backward.atomic_head_chunks`: two where each launch still fills the GPU three times over), so
    the extra memory stays under the size of the gradients returned."""
    return _backward(problem, q1, k1, q2, k2, lse1, lse2, grad_rows, schedule, None)


def backward_launcher(problem: Problem, schedule, needs: tuple):
    """`Backend.backward_launcher` where a Gluon kernel served this problem's last backward with
    this schedule and these needs (`backward.kl_backward` keeps which): straight to `_backward`,
    past `backward.kl_backward`'s choice, which for a call of the same metadata reads only what
    the function checks: the inputs' 16-byte alignment, deterministic algorithms off, the inputs'
    device current (the other conditions are the metadata, switches and environment its plan is
    keyed by); else it returns None. None where no Gluon kernel served."""
    served = problem.extra.get("gluon_backward_served")
    if served is None or served[0] is not schedule or served[1] != needs:
        return None
    both, index = served[2], problem.device.index

    def launch(q1, k1, q2, k2, lse1, lse2, expect, grad_rows):
        if (q1.data_ptr() | k1.data_ptr() | q2.data_ptr() | k2.data_ptr()) & 15:
            return None
        if torch.are_deterministic_algorithms_enabled():
            return None
        if index is not None and torch.cuda.current_device() != index:
            return None
        # (as `autograd.run_backward` gives it: this backend zeroes empty rows itself)
        return _backward(problem, q1, k1, q2, k2, lse1, lse2, grad_rows.float(), schedule, expect if both else None)

    return launch


def _plans(problem: Problem, lse1, g, accum2, dk2, schedule, g_scale, both: bool, chunks: int) -> list:
    """The launch plans of `_backward`'s head chunks, kept with the problem (`problem.extra`, as the
    forward's: the front end hands a call with a validated call's metadata that call's Problem), one
    set for each combination of what they are made from: the schedule, BOTH, the strides of g (a
    reduced loss's expanded g or a head-major copy) and lse, g_scale or not, the head chunks, the
    module switches `launch_plan` reads. A plan: [grid, the arguments after `call_args`,
    constexprs, the compiled kernel once launched]."""
    key = (id(schedule), both, g.stride(), g.data_ptr() % 16 == 0, lse1.stride(), g_scale is None, chunks, DQ_TMA,
           HEAVY_FIRST, DIAG_LOOPS, KEY_MAJOR_GRID, DQ_VEC2, DQ_SPLIT64, STATS_AHEAD,
           STATS_AHEAD_BOTH, DIAG_LAST, LISTED_LOOPS, LISTED_LOOPS_BOTH, EARLY_P, EARLY_P_EVERYWHERE,
           DK_DEFER, DK_DEFER_EVERYWHERE, G_ONE, G_ONE_BOTH, DQ_RAW, SPLIT_ROWS, SPLIT_ROWS_STAGES, SPLIT_ROWS_WIDE,
           SPLIT_ROWS_WIDE_CAUSAL)
    kept = problem.extra.get("gluon_backward_plans")
    if kept is None:
        kept = problem.extra["gluon_backward_plans"] = {}
    hit = kept.get(key)
    if hit is not None and hit[0] is schedule:  # (the entry holds its schedule: the id is not reused)
        return hit[1]
    per_chunk = problem.heads // chunks
    plans = [[*launch_plan(problem, lse1, g, accum2, dk2, schedule, g_scale is None, chunk * per_chunk, per_chunk,
                           both), None] for chunk in range(chunks)]
    if len(kept) >= 8:  # (a few combinations a problem in practice: the oldest goes)
        del kept[next(iter(kept))]
    kept[key] = (schedule, plans)
    return plans


def _launch(plan: list, args: tuple, lse1) -> None:
    """One launch of a kept plan with the call's leading arguments: through the compiled kernel's
    own launcher once the plan has one (every argument's specialization is the plan's: the call's
    tensors are new or checked by `applies` and the plan's key), else `direct_launch`, whose compiled
    kernel the plan then keeps."""
    from streamkl.backends.triton.common import compiled_entry, direct_launch, launch_hooks_active, run_compiled

    grid, fixed, constexprs, entry = plan
    args = (*args, *(lse1 if t is None else t for t in fixed))
    if entry is not None and not launch_hooks_active():
        run_compiled(entry, grid, args)
        return
    compiled = direct_launch(_kl_bwd_gluon_kernel, grid, args, constexprs, 4)
    plan[3] = compiled_entry(_kl_bwd_gluon_kernel, compiled, len(args), constexprs)


def _backward(problem: Problem, q1, k1, q2, k2, lse1, lse2, grad_rows, schedule, expect):
    """`kl_backward`'s launches, and with `expect` (BOTH) side 1's gradients too: (dq1, dk1, dq2,
    dk2), None where not computed."""
    from streamkl.backends.triton.backward import atomic_head_chunks, flush_dq, rescaled_upstream
    from streamkl.backends.triton.common import group_sizes, log2_scales

    both = expect is not None
    # packed keys past cu_seqlens_k[-1] belong to no sequence: their gradient is 0, not written
    dk2 = torch.zeros_like(k2) if problem.is_varlen else torch.empty_like(k2)
    dk1 = (torch.zeros_like(k1) if problem.is_varlen else torch.empty_like(k1)) if both else None
    g, g_scale = rescaled_upstream(problem, grad_rows, lse1)
    # g head-major (a row stride of 1, as lse's): each thread's rows are one base's immediate offsets;
    # with BOTH a reduced loss's g (one value expanded over the rows, strides 0) is read as it is
    # (G_AS_IS), without BOTH it is the one value of G_ONE
    uniform = not any(g.stride())
    if not (uniform and ((both and G_AS_IS) or g_one_on(both, g, g_scale is None))):
        g = g.transpose(-1, -2).contiguous().transpose(-1, -2)
    chunks = atomic_head_chunks(problem, -(-problem.seqlen_k // BLOCK_N), group_sizes(problem)[1])
    per_chunk = problem.heads // chunks
    shape = (*q2.shape[:-2], per_chunk, q2.shape[-1])
    # the float32 accumulators (BOTH: dq2's and dq1's in one allocation, one zero fill); after each
    # chunk `flush_dq` writes them into the 16-bit gradients in one launch
    pair = torch.zeros((2 if both else 1, *shape), dtype=torch.float32, device=q2.device)
    accums = pair.unbind(0)
    accum2 = accums[0]
    accum1 = accums[1] if both else None
    raw = dq_raw_on(both)  # DQ_RAW: the flush scales dq2 (the softmax scale; g's one value; float16's g scale)
    flushed = chunks > 1 or both or raw
    dq_scale = None
    if raw:
        scale_t = g if g_one_on(both, g, g_scale is None) else g_scale
        dq_scale = (log2_scales(problem)[1] * LN2, scale_t)
    dq2 = torch.empty_like(q2) if flushed else None
    dq1 = torch.empty_like(q1) if both else None
    outs = (dq2, dq1) if both else (dq2,)
    plans = _plans(problem, lse1, g, accum2, dk2, schedule, g_scale, both, chunks)
    # every chunk: the same tensors (the accumulators flushed and zeroed between them)
    args = call_args(q1, k1, q2, k2, lse1, lse2, g, accum2, dk2, g_scale, (dk1, expect, accum1) if both else None)
    for chunk, plan in enumerate(plans):
        lo = chunk * per_chunk
        _launch(plan, args, lse1)
        if flushed and not flush_dq(accums, outs, lo, dq_scale):
            for out, accum in zip(outs, accums):  # (not contiguous: as flush_dq would)
                if dq_scale is not None:
                    factor, factor_t = dq_scale
                    accum = accum * factor if factor_t is None else accum * factor * factor_t[(0,) * factor_t.dim()]
                out[..., lo:lo + per_chunk, :].copy_(accum)
        if chunk + 1 < chunks:
            pair.zero_()
    if not flushed:
        dq2 = accum2.to(q2.dtype)
    return dq1, dk1, dq2, dk2


def compile_for_hopper(dtype=torch.bfloat16, dim: int = 128, causal: bool = False, listed: bool = False,
                       varlen: bool = False, tail: bool = False, gqa2: bool = False, vec2: bool = False,
                       tma_dq: bool | None = None, both: bool = False, dq_split: bool | None = None,
                       ahead: bool | None = None, last_diag: bool | None = None, split_listed: bool | None = None,
                       early_p: bool | None = None, dk_defer: bool | None = None, g_one: bool = False,
                       dq_raw: bool | None = None, split_rows: bool | None = None):
    """The student backward compiled for sm_90a (`gluon_forward.compile_sm90`) at one configuration
    (`tma_dq`: dq2 by TMA reductions; `dq_split`: D=64's dq2 columns split between the warpgroups;
    `ahead`: the statistics a step ahead; `last_diag`: BOTH's diagonal steps last; `split_listed`:
    a loop for the full pairs, one for the partial; `early_p`: side 1's exponentials under side 2's
    product; `dk_defer`: each step's dk product waited for in the next step; `g_one`: one g for
    every row, as `G_ONE` would take a reduced loss's; `dq_raw`: dq2 unscaled; `split_rows`: the
    query tiles split between the warpgroups; None: as `DQ_TMA` / `DQ_SPLIT64` / `STATS_AHEAD` /
    `DIAG_LAST` / `LISTED_LOOPS` / `EARLY_P` / `DK_DEFER` / `DQ_RAW` / `SPLIT_ROWS`)."""
    tma_dq = bool(DQ_TMA) if tma_dq is None else tma_dq
    dq_split = bool(DQ_SPLIT64) if dq_split is None else dq_split
    ahead = stats_ahead(both) if ahead is None else ahead
    cols = 32 if dim == 64 and dq_split and tma_dq else 64
    t = torch.empty(2, BLOCK_N, 4, dim, dtype=dtype)
    descs = [flat_descriptor(t, rows) for rows in (BLOCK_M, BLOCK_N, BLOCK_M, BLOCK_N)]
    stats = torch.empty(4, dtype=torch.float32)
    cu = torch.zeros(3, dtype=torch.int32)
    names = ("stride_sb", "stride_sh", "stride_sn", "stride_gb", "stride_gn", "stride_gh", "stride_dqb",
             "stride_dqn", "stride_dqh", "stride_dkb", "stride_dkn", "stride_dkh")
    list_names = ("stride_cs", "stride_ch", "stride_ct", "stride_is", "stride_ih", "stride_it", "window_left",
                  "window_right")
    examples = dict(zip(("q1_desc", "k1_desc", "q2_desc", "k2_desc"), descs))
    examples.update(LSE1=stats, LSE2=stats, GRAD=stats, DQ2=stats, DK2=t,
                    dq_desc=dq_descriptor(torch.empty(2, BLOCK_N, 4, dim), cols) if tma_dq else descs[0],
                    DK1=t, EXPECT=stats, dq1_desc=dq_descriptor(torch.empty(2, BLOCK_N, 4, dim)),
                    G_SCALE=stats, CU_Q=cu, CU_K=cu)
    examples.update(Q_COUNT=cu, Q_FULL=cu, Q_INDEX=cu, Q_FLAGS=torch.zeros(3, dtype=torch.int8), ORDER=cu)
    examples.update(**dict.fromkeys(names, 1024), **dict.fromkeys(list_names, 7))
    examples.update(stride_sn=1, stride_gn=1)  # as launched (Triton specializes 1s)
    examples.update(**dict.fromkeys(("seqlen_q", "seqlen_k", "heads", "head_lo", "group1", "group2"), 1024))
    examples.update(scale1=0.5, scale2=0.5, out_scale2=0.5, out_scale1=0.5, k_programs=1024)
    constexprs = dict(D=dim, BLOCK_M=BLOCK_M, STAGES=stages(dim), CAUSAL=causal,
                      DS_LAYOUT=ds_shared_layout(dtype), LISTED=listed,
                      NORM_G=dtype == torch.float16, VARLEN=varlen, TAIL=tail, GQA2=gqa2, VEC=2 if vec2 else 1,
                      DQ_TMA=tma_dq, DQ_LAYOUT=dq_layout(cols), KEY_MAJOR=bool(KEY_MAJOR_GRID), BOTH=both,
                      DQ_COLS=cols, AHEAD=ahead,
                      ORDERED=listed and bool(HEAVY_FIRST) and not KEY_MAJOR_GRID,
                      DIAG=bool(DIAG_LOOPS) and causal and not (listed or tail or gqa2))
    if both:
        constexprs["STAGES"] = 2
    constexprs["ROT"] = diag_last(constexprs, last_diag)
    constexprs["LSPLIT"] = listed_loops(constexprs, split_listed)
    constexprs["EARLY_P"] = early_p_on(constexprs, early_p)
    constexprs["DK_DEFER"] = dk_defer_on(constexprs, dk_defer)
    constexprs["G_ONE"] = g_one and dtype != torch.float16
    constexprs["DQ_RAW"] = dq_raw_on(both, dq_raw)
    constexprs["SPLIT_ROWS"] = split_rows_on(constexprs, split_rows)
    if constexprs["SPLIT_ROWS"]:
        constexprs["STAGES"] = split_rows_stages(causal)
    return compile_sm90(_kl_bwd_gluon_kernel, examples, constexprs)
