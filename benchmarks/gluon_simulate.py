"""The Gluon kernels (streamkl/backends/triton/gluon_forward.py, gluon_backward.py) run on the CPU, under the
Gluon simulator of triton-viz (NumPy: partitions as threads, mbarriers, TMA, wgmma), against the
float64 reference. A check of the kernel's arithmetic, indexing, masks and barrier protocol before
GPU time is spent on it; not timing, not the hardware's memory model (async-proxy fences, register
hazards of in-flight wgmma), and not part of CI (the simulator is not on PyPI in this form).

Setup, once (a virtual environment that sees this one's torch and triton 3.6):

    python -m venv --system-site-packages /tmp/tvenv
    git clone https://github.com/Deep-Learning-Profiling-Tools/triton-viz /tmp/triton-viz   # tested at 203b0c7
    /tmp/tvenv/bin/pip install --no-deps -e /tmp/triton-viz
    /tmp/tvenv/bin/pip install ml_dtypes anytree z3-solver==4.15.3.0 pyarrow tqdm flask
    /tmp/tvenv/bin/python benchmarks/gluon_simulate.py        # ~15 s: eight problems
    ... --early-side1  # the forward taking side 1's terms under side 2's product (EARLY_SIDE1)
    ... --early-side1-listed --new  # that on block-mask / window launches too (EARLY_SIDE1_LISTED)
    /tmp/tvenv/bin/python benchmarks/gluon_simulate.py --backward    # the student backward (gluon_backward.py)
    ... --backward --atomics    # with dq2 added by atomics (DQ_TMA off);  --backward --both: all four gradients
    ... --backward [--both] --ahead  # each step's statistics loaded a step ahead (STATS_AHEAD)
    ... --backward --both --diag-last  # causal: the diagonal's steps last (DIAG_LAST)
    ... --backward [--both] --listed-loops  # masks: the full pairs' loop, then the partial's
    ... --backward --early-p  # side 1's exponentials while side 2's product runs, every launch (EARLY_P)
    ... --backward --dk-defer  # each step's dk product waited for in the next step, every launch (DK_DEFER)
    ... --backward --dq-raw  # dq2 added unscaled, the flush scales it (DQ_RAW)
    ... --backward --g-one [--dq-raw]  # one g for every row, in the output scales (G_ONE)
    ... --backward --both --g-one  # the same in the BOTH kernel (G_ONE_BOTH)
    ... --backward --split-rows [--g-one]  # D=64: the warpgroups split the query tiles (SPLIT_ROWS)

That simulator is written against a newer triton and misses a few things this kernel uses; the
adjustments below are made at run time, in this process only (`_adjust_simulator`):
- triton 3.6 lacks some AMD gfx1250 Gluon modules it imports: empty stand-ins;
- the kernel's constexpr parameters are annotated `gl.constexpr` under `from __future__ import
  annotations` (strings); nested @gluon.jit functions (partitions, helpers, gl.zeros) are called
  as plain Python;
- mbarriers: a phase completes after `count` arrivals (the simulator flipped the phase at every
  arrival), and a partition blocked in a wait passes its turn to the others (its round-robin
  scheduler deadlocked otherwise); numpy >= 2.3 scalar indexing (`streamkl` patches Triton's
  interpreter the same way); `gl.static_range` over plain ints; broadcasts of results whose layout
  the simulator dropped;
- no tracing (a client without callbacks); float16 inputs (its tracer cannot read bfloat16).
- TMA descriptors built by their dataclass, on a 2-D view (the simulator reads the base tensor's
  shape; `common.fast_descriptor`, which the GPU launches use, keeps the unflattened tensor);
- a shared view reinterpreted larger than itself (SPLIT_ROWS's dk2^T exchange) reads on into the
  allocation, as on the GPU;
- gluon_backward.py's own builtin `_tma_reduce_add` (the dq2 TMA reduction, DQ_TMA) is patched like
  Gluon's builtins, so the default backward runs as built (tenth session: 22 cases pass with it).
Fifth session (2026-11-30), CPU: all eight problems below agree with float64 to 2e-7 (KL) and
5e-8 (lse), both variants, before the kernel ever ran on a GPU.
"""

from __future__ import annotations

import contextlib
import faulthandler
import sys
import time
import types
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import streamkl.backends.triton.common  # noqa: E402,F401  (numpy >= 2.3 index patch, before the simulator imports it)


def _adjust_simulator():
    """The run-time adjustments listed in the module docstring; returns (triton_viz, quiet client)."""
    import triton.experimental.gluon.language.amd.gfx1250 as gfx1250

    for name in ("async_copy", "cluster", "mbarrier", "tdm"):
        if not hasattr(gfx1250, name):
            setattr(gfx1250, name, types.SimpleNamespace())
    import triton.experimental.gluon.language as gluon_language
    import triton.experimental.gluon.language._semantic as gluon_semantic
    from triton.language.semantic import TritonSemantic
    from triton.runtime.jit import JITFunction

    def static_range(start, end=None, step=1, **_):
        start, end = getattr(start, "value", start), getattr(end, "value", end)
        return range(start) if end is None else range(start, end, step)

    gluon_language.static_range = static_range
    JITFunction.__call__ = lambda self, *args, **kwargs: self.fn(
        *args, **{k: v for k, v in kwargs.items() if k != "_semantic"}
    )
    broadcast = gluon_semantic.GluonSemantic.broadcast_impl_value

    def broadcast_without_layouts(self, lhs, rhs):
        if lhs.type.is_block() and rhs.type.is_block():
            if not (hasattr(lhs.type, "layout") and hasattr(rhs.type, "layout")):
                return TritonSemantic.broadcast_impl_value(self, lhs, rhs)
        return broadcast(self, lhs, rhs)

    gluon_semantic.GluonSemantic.broadcast_impl_value = broadcast_without_layouts

    import triton_viz
    import triton_viz.core.simulation.gluon as simulation
    from triton_viz.clients.tracer.tracer import Tracer
    from triton_viz.core.callbacks import OpCallbacks
    from triton_viz.core.frontend import gluon as gluon_frontend

    for module in (simulation,):
        original = module._patch_lang_tensor

        def patch_lang_tensor(tensor, scope, original=original):
            original(tensor, scope)
            scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

        module._patch_lang_tensor = patch_lang_tensor

    init = simulation.GluonInterpretedFunction.__init__

    def function_init(self, fn, *args, **kwargs):
        init(self, fn, *args, **kwargs)
        self.constexprs |= {n for n, a in getattr(fn, "__annotations__", {}).items() if str(a).endswith("constexpr")}

    simulation.GluonInterpretedFunction.__init__ = function_init

    def barrier_init(self, barrier, *args):
        state = self._barrier_state(barrier)
        with state.condition:
            state.count = max(1, simulation._to_int(args[0])) if args else 1
            state.remaining = state.count
            state.pending_bytes, state.phase, state.ready = 0, 1, True
            state.condition.notify_all()

    def barrier_signal(self, barrier):
        state = self._barrier_state(barrier)
        with state.condition:
            state.remaining = getattr(state, "remaining", 1) - 1
            if state.remaining > 0:
                return
            state.remaining = getattr(state, "count", 1)
            state.pending_bytes, state.ready = 0, True
            state.phase ^= 1
            state.condition.notify_all()

    def pass_turn(scheduler):
        partition = getattr(scheduler._local, "partition_id", None)
        with scheduler._condition:
            if scheduler._active and scheduler._active[scheduler._turn_index] == partition:
                scheduler._turn_index = (scheduler._turn_index + 1) % len(scheduler._active)
                scheduler._condition.notify_all()

    def barrier_wait(self, barrier, phase=None, pred=True, *args):
        if not bool(simulation._to_python_scalar(pred)):
            return None
        parity = None if phase is None else (simulation._to_int(phase) & 1)
        state = self._barrier_state(barrier)
        while True:
            with state.condition:
                if state.ready and (parity is None or state.phase == parity):
                    return None
                state.condition.wait(timeout=0.001)
            scheduler = getattr(gluon_frontend, "_WARP_SPECIALIZE_SCHEDULER", None)
            if scheduler is not None:
                pass_turn(scheduler)

    reinterpret = simulation.Builder.create_memdesc_reinterpret

    def reinterpret_larger(self, ret_ty, mem_desc):
        # a view reinterpreted larger than itself (SPLIT_ROWS: warpgroup 1's dk2^T over its two dq2
        # tiles): the allocation's bytes from the view's start, as on the GPU (the view contiguous)
        import numpy as np

        data = mem_desc.data
        want = int(np.prod(ret_ty.shape)) * np.dtype(simulation._get_np_dtype(ret_ty.element_ty)).itemsize
        if data.nbytes < want:
            assert data.flags.c_contiguous
            data = np.lib.stride_tricks.as_strided(data.reshape(-1), shape=(want // data.itemsize,),
                                                   strides=(data.itemsize,))
            mem_desc = simulation.SharedMemoryHandle(mem_desc.element_ty, list(data.shape), mem_desc.layout, data)
        return reinterpret(self, ret_ty, mem_desc)

    simulation.Builder.create_memdesc_reinterpret = reinterpret_larger
    simulation.Builder.create_mbarrier_init = barrier_init
    simulation.Builder._signal_barrier = barrier_signal
    simulation.Builder.create_mbarrier_wait = barrier_wait
    # gluon_backward's own builtin (`_tma_reduce_add`, the TMA reduction Gluon 3.6 does not wrap)
    # runs through the simulator's builder like Gluon's builtins do
    from streamkl.backends.triton import gluon_backward

    simulation._GLUON_BUILTIN_MODULES = (*simulation._GLUON_BUILTIN_MODULES, gluon_backward)

    class Quiet(Tracer):
        def register_op_callback(self, op_type, *args, **kwargs):
            return OpCallbacks()

    from streamkl.backends.triton import common

    def descriptor(cls, t, width, block_shape, layout=None):  # as the dataclass builds it: a 2-D view
        flat = t.view(-1, width)
        return cls(flat, list(flat.shape), list(flat.stride()), block_shape, *(() if layout is None else (layout,)))

    common.fast_descriptor = descriptor
    return triton_viz, Quiet


def _listed_problem(inputs, causal, kwargs, masks, window, heads, n_q, n_k, g):
    """(problem, schedule): random 128-block masks of the given densities (one per side) and the
    window added to kwargs (in place: the reference takes them too); the 128 x 128 schedule the
    Gluon kernels walk where there are masks or a window, else None."""
    from streamkl.backends.triton.gluon_forward import listed
    from streamkl.problem import build_problem
    from streamkl.sparse.block_mask import BlockMask
    from streamkl.sparse.schedule import get_schedule

    if masks is not None:
        blocks = (-(-n_q // 128), -(-n_k // 128))
        kwargs["mask1"], kwargs["mask2"] = (
            BlockMask.from_dense(torch.rand(1, heads, *blocks, generator=g) < density, 128) for density in masks
        )
    if window != (-1, -1):
        kwargs["window"] = window
    problem = build_problem(*inputs, causal=causal, **kwargs)
    return problem, (get_schedule(problem, 128, 128) if listed(problem) else None)


def simulate(triton_viz, client, batch, n_q, n_k, heads, heads_k, dim, causal, overlap, dtype=torch.float16,
             masks=None, window=(-1, -1)):
    """One forward problem against float64. `batch` an int: dense [B, N, H, D] inputs of n_q / n_k
    tokens; a list of (len_q, len_k): packed sequences (varlen; n_q, n_k unused). masks: block
    densities (side 1, side 2) of random 128-block masks (dense inputs), or None."""
    from streamkl.backends.base import new_outputs, write_tail_rows
    from streamkl.backends.triton import gluon_forward
    from streamkl.reference import reference_kl

    g = torch.Generator().manual_seed(0)
    kwargs = {}
    if isinstance(batch, list):  # varlen: (len_q, len_k) per sequence
        lens_q, lens_k = zip(*batch)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        shape_q, shape_k = (int(cu_q[-1]),), (int(cu_k[-1]),)
        kwargs = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k, max_seqlen=max(lens_q), max_seqlen_k=max(lens_k))
    else:
        shape_q, shape_k = (batch, n_q), (batch, n_k)
    dim1, dim2 = dim if isinstance(dim, tuple) else (dim, dim)  # (teacher, student) head dims
    q1 = torch.randn(*shape_q, heads, dim1, generator=g).to(dtype)
    q2 = torch.randn(*shape_q, heads, dim2, generator=g).to(dtype)
    k1 = torch.randn(*shape_k, heads_k[0], dim1, generator=g).to(dtype)
    k2 = torch.randn(*shape_k, heads_k[1], dim2, generator=g).to(dtype)
    problem, schedule = _listed_problem((q1, k1, q2, k2), causal, kwargs, masks, window, heads, n_q, n_k, g)
    kl_rows, lse1, lse2, expect = new_outputs(problem)
    write_tail_rows(problem, kl_rows, lse1, lse2, expect)
    grid, args, constexprs = gluon_forward.launch_args(problem, q1, k1, q2, k2, kl_rows, lse1, lse2, expect, overlap,
                                                       schedule)
    kernel = triton_viz.trace(client(), frontend="gluon")(gluon_forward._kl_fwd_gluon_kernel)
    start = time.time()
    kernel[grid](*args, **constexprs, num_warps=4)
    ref, ref1, ref2 = reference_kl(*(t.double() for t in (q1, k1, q2, k2)), causal=causal, **kwargs)

    def err(a, e):
        bad = (a.isnan() != e.isnan()) | ((a.double() - e).abs() > 0) & (e.isinf() | a.isinf())
        if bad.any():  # edge rows: NaN or infinite on one side only, or infinities that differ
            return float("inf")
        a, e = a.double().nan_to_num(0.0, 0.0, 0.0), e.nan_to_num(0.0, 0.0, 0.0)
        return ((a - e).norm() / e.norm()).item()

    errors = err(kl_rows, ref), err(lse1, ref1), err(lse2, ref2)
    what = f"varlen {batch}" if isinstance(batch, list) else f"B{batch} Nq{n_q} Nk{n_k}"
    what += f" masks {masks}" if masks is not None else ""
    what += f" window {window}" if window != (-1, -1) else ""
    print(f"{what} H{heads} Hk{heads_k[0]}x{heads_k[1]} D{dim} causal={causal} overlap={overlap} "
          f"TAIL={constexprs['TAIL']}: relative L2 error kl {errors[0]:.1e}, lse1 {errors[1]:.1e}, "
          f"lse2 {errors[2]:.1e} ({time.time() - start:.1f} s)", flush=True)
    return max(errors)


def simulate_backward(triton_viz, client, batch, n_q, n_k, heads, heads_k1, dim, causal, dtype=torch.float16,
                      masks=None, window=(-1, -1), chunks=1, heads_k2=None):
    """The Gluon student backward (dq2, dk2) against the float64 reference's gradients, with the
    saved statistics of the float64 forward and a random upstream gradient per row (0 on rows whose
    KL is infinite, as the GPU tests do). masks: block densities of random 128-block masks.
    chunks: launches over that many head chunks, each into its own float32 dq2 accumulator, as
    gluon_backward.kl_backward does on a large grid. heads_k2: side-2 key heads (GQA; default
    heads)."""
    from streamkl.backends.triton import gluon_backward
    from streamkl.reference import reference_kl

    g = torch.Generator().manual_seed(1)
    kwargs = {}
    if isinstance(batch, list):  # varlen: (len_q, len_k) per sequence, then rows past cu_seqlens[-1]
        lens_q, lens_k = zip(*batch)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        shape_q, shape_k = (int(cu_q[-1]) + 64,), (int(cu_k[-1]) + 128,)
        kwargs = dict(cu_seqlens=cu_q, cu_seqlens_k=cu_k)
    else:
        shape_q, shape_k = (batch, n_q), (batch, n_k)
    q1, q2 = (torch.randn(*shape_q, heads, dim, generator=g).to(dtype) for _ in range(2))
    k1 = torch.randn(*shape_k, heads_k1, dim, generator=g).to(dtype)
    k2 = torch.randn(*shape_k, heads_k2 or heads, dim, generator=g).to(dtype)
    problem, schedule = _listed_problem((q1, k1, q2, k2), causal, kwargs, masks, window, heads, n_q, n_k, g)
    leaves = [t.double().requires_grad_(i >= 2) for i, t in enumerate((q1, k1, q2, k2))]
    ref, lse1, lse2 = reference_kl(*leaves, causal=causal, **kwargs)
    upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64) * ref.isfinite()
    g_in = upstream.float()
    if UNIFORM_G:  # a reduced loss's g: one value expanded over the rows (G_ONE)
        g_in = torch.tensor(-0.37).expand(ref.shape)
        upstream = g_in.double()
    ref = ref.nan_to_num(posinf=0.0)
    ref_dq2, ref_dk2 = torch.autograd.grad((ref * upstream).sum(), leaves[2:])
    kernel = triton_viz.trace(client(), frontend="gluon")(gluon_backward._kl_bwd_gluon_kernel)
    vec2, gluon_backward.DQ_VEC2 = gluon_backward.DQ_VEC2, False  # (inline PTX: not simulated)
    start = time.time()  # (the host wrapper as the backend calls it)
    with _wrapper_launches(kernel, chunks, _traced_flush(triton_viz, client)):
        _, _, dq2, dk2 = gluon_backward.kl_backward(problem, q1, k1, q2, k2, lse1.float().contiguous(),
                                                    lse2.float().contiguous(), g_in, schedule)
    gluon_backward.DQ_VEC2 = vec2

    def err(a, e):
        return ((a.double() - e).norm() / e.norm()).item()

    errors = err(dq2, ref_dq2), err(dk2, ref_dk2)
    extra = (f" masks {masks}" if masks is not None else "") + (f" window {window}" if window != (-1, -1) else "")
    extra += f" in {chunks} head chunks" if chunks > 1 else ""
    extra += f" Hk2 {heads_k2}" if heads_k2 else ""
    what = f"varlen {batch}" if isinstance(batch, list) else f"B{batch} Nq{n_q} Nk{n_k}"
    print(f"backward {what} H{heads} Hk1 {heads_k1} D{dim} causal={causal}{extra}: relative L2 error "
          f"dq2 {errors[0]:.1e}, dk2 {errors[1]:.1e} ({time.time() - start:.1f} s)", flush=True)
    return max(errors)


#: --g-one: the upstream gradient one (negative) value for every row, expanded (G_ONE's input)
UNIFORM_G = False


def _traced_flush(triton_viz, client):
    """backward._flush_dq_kernel (plain Triton: the Gluon backward's accumulators into dq) traced."""
    from streamkl.backends.triton import backward

    return triton_viz.trace(client())(backward._flush_dq_kernel)


@contextlib.contextmanager
def _wrapper_launches(kernel, chunks, flush):
    """Within the block, gluon_backward's host wrappers launch the simulator-traced `kernel` (their
    `common.direct_launch` replaced) over `chunks` head chunks (`backward.CHUNKS_OVERRIDE`), and
    `flush` (the traced `backward._flush_dq_kernel`) for the accumulators."""
    from streamkl.backends.triton import backward, common

    saved = common.direct_launch, backward.CHUNKS_OVERRIDE

    def launch(target, grid, args, constexprs, num_warps):
        return (flush if target is backward._flush_dq_kernel else kernel)[grid](*args, **constexprs,
                                                                               num_warps=num_warps)

    common.direct_launch = launch
    backward.CHUNKS_OVERRIDE = chunks
    try:
        yield
    finally:
        common.direct_launch, backward.CHUNKS_OVERRIDE = saved


def simulate_both(triton_viz, client, batch, n_q, n_k, heads, causal, dtype=torch.float16, chunks=1, mask=None,
                  window=(-1, -1)):
    """The kernel with BOTH, through its host wrapper (`kl_backward_both`): all four gradients against
    the float64 reference, E (and lse) from the float64 chunked-PyTorch forward, D=128, in `chunks`
    head chunks; dense whole tiles, or (LISTED) with `mask` = (density, sides): one random 128-block
    mask on side 1, and the same on side 2 when sides is 2, and / or a window. The upstream gradient
    is 0 on rows without side-1 keys (as the GPU tests), where the reference's gradient is NaN."""
    from streamkl.autograd import run_forward
    from streamkl.backends.torch_chunked import TorchChunkedBackend
    from streamkl.backends.triton import gluon_backward
    from streamkl.backends.triton.gluon_forward import listed
    from streamkl.problem import build_problem
    from streamkl.reference import reference_kl
    from streamkl.sparse.block_mask import BlockMask
    from streamkl.sparse.schedule import get_schedule

    g = torch.Generator().manual_seed(2)
    dim = 128
    kwargs = dict(causal=causal)
    if isinstance(batch, list):  # varlen (thirteenth session): (len_q, len_k) per sequence, whole tiles,
        # then rows / keys past cu_seqlens[-1]
        lens_q, lens_k = zip(*batch)
        cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
        cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
        kwargs.update(cu_seqlens=cu_q, cu_seqlens_k=cu_k)
        shapes = [(int(cu[-1]) + 128,) for cu in (cu_q, cu_k, cu_q, cu_k)]
    else:
        shapes = [(batch, n) for n in (n_q, n_k, n_q, n_k)]
    q1, k1, q2, k2 = (torch.randn(*shape, heads, dim, generator=g).to(dtype) for shape in shapes)
    if mask is not None:
        density, sides = mask
        blocks = torch.rand(1, heads, -(-n_q // 128), -(-n_k // 128), generator=g) < density
        kwargs["mask1"] = BlockMask.from_dense(blocks, 128)
        if sides == 2:
            kwargs["mask2"] = kwargs["mask1"]
    if window != (-1, -1):
        kwargs["window"] = window
    leaves = [t.double().requires_grad_(True) for t in (q1, k1, q2, k2)]
    ref, ref_lse1, _ = reference_kl(*leaves, **kwargs)
    upstream = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    rows = ref_lse1.isfinite().transpose(-1, -2)  # [B, N, H] (varlen [T, H]) as the rows
    upstream = torch.where(rows, upstream, 0.0)
    g_in = upstream.float()
    if UNIFORM_G:  # a reduced loss's g: one value expanded over the rows (G_ONE_BOTH); no case here has
        # rows of infinite KL (side 2's keys hold side 1's), and rows without side-1 keys have KL 0
        g_in = torch.tensor(-0.37).expand(ref.shape)
        upstream = g_in.double()
    refs = torch.autograd.grad((ref.nan_to_num(posinf=0.0) * upstream).sum(), leaves)
    refs = [r.nan_to_num(0.0) for r in refs]
    problem64 = build_problem(*(t.detach() for t in leaves), allow_float64=True, **kwargs)
    (_, lse1, lse2, expect), _ = run_forward(problem64, TorchChunkedBackend(), *(t.detach() for t in leaves))
    problem = build_problem(q1, k1, q2, k2, **kwargs)
    schedule = get_schedule(problem, 128, 128) if listed(problem) else None
    lse1, lse2, expect = (t.float().contiguous() for t in (lse1, lse2, expect))
    kernel = triton_viz.trace(client(), frontend="gluon")(gluon_backward._kl_bwd_gluon_kernel)
    start = time.time()
    with _wrapper_launches(kernel, chunks, _traced_flush(triton_viz, client)):
        got = gluon_backward.kl_backward_both(problem, q1, k1, q2, k2, lse1, lse2, expect, g_in, schedule)
    errors = [((a.double() - e).norm() / e.norm()).item() for a, e in zip(got, refs)]
    finite = all(bool(a.isfinite().all()) for a in got)
    extra = (f" mask {mask}" if mask is not None else "") + (f" window {window}" if window != (-1, -1) else "")
    print(f"both sides B{batch} Nq{n_q} Nk{n_k} H{heads} D128 causal={causal}{extra} chunks={chunks}: relative L2 "
          f"error dq1 {errors[0]:.1e}, dk1 {errors[1]:.1e}, dq2 {errors[2]:.1e}, dk2 {errors[3]:.1e}, all finite "
          f"{finite} ({time.time() - start:.1f} s)", flush=True)
    return max(errors) if finite else float("inf")


def main():
    faulthandler.dump_traceback_later(900, exit=True)  # a deadlocked protocol shows where each partition waits
    triton_viz, client = _adjust_simulator()
    cases = [  # (B, Nq, Nk, H, (Hk1, Hk2), D, causal, overlap): ring wrap-around, GQA, Nk > Nq, both variants
        (1, 128, 128, 1, (1, 1), 64, False, False),
        (1, 128, 128, 1, (1, 1), 64, True, False),
        (1, 128, 128, 1, (1, 1), 64, True, True),
        (2, 256, 384, 4, (2, 4), 128, False, False),
        (2, 256, 384, 4, (2, 4), 128, True, False),
        (2, 256, 384, 4, (4, 1), 128, True, True),
        (1, 384, 512, 2, (1, 2), 64, True, True),
        (1, 384, 512, 2, (2, 2), 64, False, True),
        # tails (sixth session): Nq, Nk not multiples of the tiles, causal with Nk < Nq (empty rows)
        (2, 200, 300, 2, (1, 2), 64, False, False),
        (1, 200, 150, 2, (2, 1), 64, True, False),
        (1, 136, 72, 1, (1, 1), 64, True, True),
        # varlen: (len_q, len_k) per sequence, an empty key sequence, a sequence of one row
        ([(130, 130), (64, 0), (1, 1), (256, 200)], 0, 0, 2, (1, 2), 64, True, False),
        ([(130, 130), (64, 0), (1, 1), (256, 300)], 0, 0, 2, (2, 2), 64, False, False),
        ([(200, 260), (0, 5), (70, 70)], 0, 0, 2, (2, 1), 64, True, True),
        # block masks and windows (the schedule's lists; sixth session): side 2 sparser than side 1
        # (uncovered rows: KL inf), a side with no block in some rows (empty rows), tails, causal
        (2, 384, 512, 2, (1, 2), 64, False, False, torch.float16, (0.6, 0.4)),
        (1, 300, 500, 2, (2, 2), 64, True, False, torch.float16, (0.7, 0.7)),
        (1, 384, 384, 2, (2, 1), 64, False, False, torch.float16, (0.3, 0.9)),
        (1, 256, 320, 2, (2, 2), 64, False, False, torch.float16, None, (100, 30)),
        (1, 256, 256, 2, (2, 2), 64, True, False, torch.float16, None, (64, -1)),
        # different teacher / student head dims
        (1, 256, 384, 2, (1, 2), (128, 64), True, False),
        (1, 200, 256, 2, (2, 2), (64, 128), False, True),
    ]
    if "--backward" not in sys.argv:
        if "--early-side1" in sys.argv:  # side 1's terms under side 2's product (EARLY_SIDE1)
            from streamkl.backends.triton import gluon_forward

            gluon_forward.EARLY_SIDE1 = True
        if "--early-side1-listed" in sys.argv:  # and on block-mask / window launches (EARLY_SIDE1_LISTED)
            from streamkl.backends.triton import gluon_forward

            gluon_forward.EARLY_SIDE1_LISTED = True
        if "--new" in sys.argv:  # only the cases added last
            cases = cases[14:]
        worst = max(simulate(triton_viz, client, *case) for case in cases)
        print(f"worst relative error {worst:.1e}")
        sys.exit(0 if worst < 1e-5 else 1)
    backward_cases = [  # (B, Nq, Nk, H, Hk1, D, causal): float16 rounding of dS sets the floor
        (1, 64, 128, 1, 1, 64, False),
        (1, 128, 128, 1, 1, 64, True),
        (2, 192, 256, 2, 1, 128, True),
        (1, 256, 384, 4, 2, 128, False),
        # causal, whole tiles: the diagonal steps' masked loop, then the unmasked one (ninth session)
        (1, 512, 512, 2, 1, 128, True),
        (1, 192, 512, 2, 2, 64, True),
        # block masks and windows (the key schedule's lists; sixth session): uncovered and empty rows
        (1, 256, 384, 2, 1, 64, False, torch.float16, (0.6, 0.5)),
        (2, 384, 256, 2, 2, 64, True, torch.float16, (0.7, 0.8)),
        (1, 256, 256, 2, 1, 64, False, torch.float16, None, (100, 30)),
        # the float32 dq2 accumulator in head chunks (seventh session), GQA groups on side 1
        (1, 128, 256, 4, 2, 64, True, torch.float16, None, (-1, -1), 2),
        (1, 256, 256, 4, 2, 64, False, torch.float16, (0.7, 0.6), (-1, -1), 2),
        # packed sequences of whole tiles (seventh session): empty ones, rows past cu_seqlens[-1]
        ([(128, 256), (0, 0), (64, 128), (192, 384)], 0, 0, 2, 1, 64, True),
        ([(128, 128), (0, 128), (64, 0), (256, 256)], 0, 0, 2, 2, 64, False),
        ([(128, 256), (192, 256)], 0, 0, 4, 2, 128, True, torch.float16, None, (-1, -1), 2),
        # lengths that are not whole tiles (TAIL: last tiles shifted back; seventh session)
        (1, 200, 300, 2, 1, 64, True),
        (2, 100, 130, 2, 2, 64, False),
        (1, 130, 257, 2, 1, 128, True, torch.float16, None, (-1, -1), 2),
        ([(100, 200), (0, 0), (64, 130), (200, 300)], 0, 0, 2, 1, 64, True),
        ([(70, 129), (0, 128), (64, 0), (150, 255)], 0, 0, 2, 2, 64, False),
        # side-2 GQA (side 1's groups a multiple of side 2's; seventh session)
        (1, 128, 256, 4, 2, 64, True, torch.float16, None, (-1, -1), 1, 2),
        (2, 200, 300, 4, 1, 64, False, torch.float16, None, (-1, -1), 2, 2),
        ([(128, 256), (100, 130)], 0, 0, 4, 2, 128, True, torch.float16, None, (-1, -1), 1, 2),
    ]
    if "--new" in sys.argv:
        backward_cases = backward_cases[19:]
    if "--atomics" in sys.argv:  # dq2 by atomics (DQ_TMA off; DQ_VEC2 as the problem's default)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.DQ_TMA = False
    if "--ahead" in sys.argv:  # each step's statistics loaded a step ahead (STATS_AHEAD, STATS_AHEAD_BOTH)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.STATS_AHEAD = gluon_backward.STATS_AHEAD_BOTH = True
    if "--early-p" in sys.argv:  # side 1's exponentials under side 2's product (EARLY_P, on at D=64 without
        # causality or lists; here every student launch)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.EARLY_P_EVERYWHERE = True
    if "--dk-defer" in sys.argv:  # each step's dk product waited for in the next step (DK_DEFER, on at
        # D=64; here every launch)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.DK_DEFER_EVERYWHERE = True
    if "--dq-raw" in sys.argv:  # dq2 added unscaled, the flush scales it (DQ_RAW)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.DQ_RAW = True
    if "--g-one" in sys.argv:  # one g for every row (G_ONE): float16 here, so its rescaling is skipped (as
        # for bfloat16); the cases without block masks (no rows of infinite KL to zero)
        from streamkl.backends.triton import backward, gluon_backward

        global UNIFORM_G
        UNIFORM_G = gluon_backward.G_ONE = gluon_backward.G_ONE_BOTH = True
        backward.rescaled_upstream = lambda problem, grad_rows, lse1: (grad_rows.float(), None)
        backward_cases = [c for c in backward_cases if len(c) < 9 or c[8] is None]
    if "--listed-loops" in sys.argv:  # block masks / windows: full pairs' and partial pairs' loops (LISTED_LOOPS)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.LISTED_LOOPS = gluon_backward.LISTED_LOOPS_BOTH = True
    if "--split-rows" in sys.argv:  # D=64: the consumer warpgroups split the query tiles (SPLIT_ROWS); the
        # D=64 cases, and more steps than the ring has slots, with and without causality
        from streamkl.backends.triton import gluon_backward

        gluon_backward.SPLIT_ROWS = gluon_backward.SPLIT_ROWS_WIDE = True  # (partial tiles, side-2 GQA too)
        backward_cases = [c for c in backward_cases if c[5] == 64] + [(1, 576, 256, 2, 2, 64, False),
                                                                      (1, 448, 512, 1, 1, 64, True)]
    if "--diag-last" in sys.argv:  # BOTH causal: the unmasked steps first, the diagonal's last (DIAG_LAST)
        from streamkl.backends.triton import gluon_backward

        gluon_backward.DIAG_LAST = True
    if "--both" in sys.argv:  # the kernel with BOTH (all four gradients)
        worst = max(simulate_both(triton_viz, client, *case) for case in
                    ((1, 128, 128, 1, False), (1, 128, 256, 2, True), (2, 256, 256, 2, True, torch.float16, 2),
                     (1, 192, 384, 1, False),
                     # LISTED (twelfth session): a mask on both sides (rows without keys), on side 1 only,
                     # with causality, a window alone
                     (1, 384, 384, 2, False, torch.float16, 1, (0.5, 2)),
                     (1, 256, 384, 2, True, torch.float16, 1, (0.6, 1)),
                     (1, 256, 256, 1, False, torch.float16, 1, None, (100, 30)),
                     # varlen, whole tiles (thirteenth session): an empty sequence, Nk > Nq, in two chunks
                     ([(128, 256), (0, 0), (256, 256)], 0, 0, 2, True, torch.float16, 2),
                     ([(256, 128), (192, 384)], 0, 0, 1, False)))
        print(f"worst relative error {worst:.1e}")
        sys.exit(0 if worst < 2e-2 else 1)
    worst = max(simulate_backward(triton_viz, client, *case) for case in backward_cases)
    print(f"worst relative error {worst:.1e}")
    sys.exit(0 if worst < 2e-2 else 1)


if __name__ == "__main__":
    main()
