"""What both Gluon kernels share: the producer warp, the partial-tile mask rule, host-side TMA
descriptors and layouts, and an ahead-of-time compile for sm_90a (no GPU needed)."""

from __future__ import annotations

import dataclasses
import functools

import torch
import triton
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor


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
    tile i is the ((i + rot) % n_tiles)-th (the backward's ROT: the diagonal's tiles last)."""
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


def gl_dtype(dtype: torch.dtype):
    return gl.bfloat16 if dtype == torch.bfloat16 else gl.float16


@functools.lru_cache(maxsize=32)
def shared_layout(rows: int, dim: int, dtype: torch.dtype):
    """The swizzled shared-memory layout of a [rows, dim] tile (cached: a constexpr function)."""
    return gl.NVMMASharedLayout.get_default_for([rows, dim], gl_dtype(dtype))


@dataclasses.dataclass(init=False)
class CheckedDescriptor(TensorDescriptor):
    """A TMA descriptor whose fields the caller made valid: a tensor `select.tma_inputs` accepted
    (non-empty, contiguous, 16-byte aligned) or allocated here, a box and layout of this module.
    The base class re-validates every field on each construction, a few microseconds per launch
    argument; this one does not (its own `__init__` sets the fields, without `__post_init__`).
    Triton takes it as the TensorDescriptor it is."""

    def __init__(self, base, shape, strides, block_shape, layout, padding: str = "zero") -> None:
        self.base, self.shape, self.strides, self.block_shape = base, shape, strides, block_shape
        self.layout, self.padding = layout, padding


def flat_descriptor(t: torch.Tensor, rows: int, layout=None) -> TensorDescriptor:
    """A TMA descriptor of a contiguous, 16-byte aligned [..., heads, dim] tensor seen as 2-D
    [tokens, heads * dim], in [rows, dim] boxes (one box: one head's dim columns of `rows` tokens)."""
    dim = t.shape[-1]
    width = t.shape[-2] * dim
    if layout is None:
        layout = shared_layout(rows, dim, t.dtype)
    return CheckedDescriptor(t, [t.numel() // width, width], [width, 1], [rows, dim], layout)


def compile_sm90(kernel, examples: dict, constexprs: dict, num_warps: int = 4):
    """Compile a Gluon kernel for sm_90a without a GPU (the code stays valid Gluon for this triton,
    ptxas included), from example values of its runtime arguments (CPU tensors, host descriptors,
    ints, floats). Returns the compiled kernel (.asm: ttgir, ptx, cubin)."""
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import GPUTarget
    from triton.backends.nvidia.compiler import CUDABackend
    from triton.experimental.gluon._runtime import GluonASTSource

    # specialized as a launch would be: ints equal to 1 become constants, pointers and ints
    # divisible by 16 are marked so
    specs = {name: native_specialize_impl(CUDABackend, value, False, True, True) for name, value in examples.items()}
    names = list(kernel.arg_names)
    missing = [name for name in names if name not in specs and name not in constexprs]
    assert not missing, f"no example or constexpr for {missing}"
    signature = {name: "constexpr" if name in constexprs else specs[name][0] for name in names}
    positions = {(names.index(name),): value for name, value in constexprs.items()}
    positions.update({(names.index(name),): examples[name] for name, spec in specs.items() if spec[0] == "constexpr"})
    attrs = {(names.index(name),): CUDABackend.parse_attr(spec[1]) for name, spec in specs.items()
             if isinstance(spec[1], str) and spec[0] != "constexpr"}
    source = GluonASTSource(kernel, signature, positions, attrs)
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
