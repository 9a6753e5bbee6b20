"""The DSA indexer loss (SPEC 8) on Triton: host side of `indexer_kernels.py`.

Three launches, each streaming (query tile, key tile) pairs of one sequence, nothing of size
Nq x Nk ever stored:

- teacher lse (only when `lse` is not given): one program per (query tile, sequence, head), an
  attention forward without the value product;
- forward: one program per (query tile, sequence); per key tile the teacher's head mean T (the
  heads loop inside, each head normalized by its lse, GQA keys per key head) and the indexer
  logits z (the indexer key tile loaded once, the indexer heads loop inside), then per row the
  online lse of z, a = sum T log T and b = sum T z; loss = a - b + lse(z). Saves lse(z) (4 B per
  row) next to the teacher's per-head lse (4 B per row and head);
- backward: one program per (key tile, sequence) over the query tiles that see it: T and z
  recomputed, dz = g (S - T), then per indexer head its products recomputed, dki accumulated in
  registers (it is shared by the heads, so the key side is the one kept local), dqi and dw added
  atomically into float32 buffers. A second, query-major kernel for dqi would be deterministic but
  would recompute T and z once more (two of the backward's five products); dqi's atomics are the
  same traffic per product as FlashAttention 2's dq.

Top-k stage: the same kernels with the selection as part of the mask. Each row's indices are
sorted and deduplicated once per call (O(N K), a buffer the size of `topk_indices`); a
(query tile, key tile) table marks the tiles some row selected, and the kernels skip the others.
The work is proportional to the selected tiles: about the dense stage's for scattered selections,
far less for local or clustered ones.
"""

from __future__ import annotations

import os

import torch

BIG_INDEX = 1 << 30  # sorts after every key position; also marks unused and repeated slots
LOG2E = 1.4426950408889634
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIM, MAX_INDEX_DIM, MAX_INDEX_HEADS, MAX_HEADS = 256, 128, 64, 128


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    """The kernel module, imported on first use (Triton may be missing where this is imported)."""
    if _interpreting():
        from streamkl.backends.triton._compat import patch_interpreter_index

        patch_interpreter_index()
    from streamkl.backends.triton import indexer_kernels

    return indexer_kernels


def not_supported_reasons(problem) -> list[str]:
    """Why the Triton kernels cannot serve `problem`; empty when they can."""
    reasons = []
    try:
        import triton  # noqa: F401
    except ImportError:
        return ["triton is not installed"]
    if problem.device.type != "cuda" and not _interpreting():
        reasons.append(f"inputs on {problem.device}, not on a CUDA GPU")
    if problem.dtype not in DTYPES:
        reasons.append(f"dtype {problem.dtype} (float16, bfloat16 or float32)")
    if problem.dim > MAX_DIM:
        reasons.append(f"teacher head dim {problem.dim} > {MAX_DIM}")
    if problem.index_dim > MAX_INDEX_DIM:
        reasons.append(f"indexer head dim {problem.index_dim} > {MAX_INDEX_DIM}")
    if problem.index_heads > MAX_INDEX_HEADS:
        reasons.append(f"indexer heads {problem.index_heads} > {MAX_INDEX_HEADS}")
    if problem.heads > MAX_HEADS:
        reasons.append(f"teacher heads {problem.heads} > {MAX_HEADS}")
    return reasons


def _pow2(n: int) -> int:
    return max(16, 1 << max(n - 1, 0).bit_length())


def _fit(block: int, length: int) -> int:
    """A tile size no larger than the (power-of-two padded) length: small problems get small tiles."""
    return min(block, _pow2(length))


HOPPER_SHARED = 232448  # bytes of shared memory a block may opt into on H100 / H200
SHARED_SLACK = 2048  # barriers and reduction scratch beside the tiles (sm_90a builds: at most ~600 B)
_TILE_LADDER = ((128, 64, 8), (64, 64, 4), (64, 32, 4), (32, 32, 4))  # (BLOCK_M, BLOCK_N, warps), largest first


def shared_budget(device) -> int:
    """Shared memory per block the kernels may use on `device` (Hopper's when not on a GPU)."""
    if getattr(device, "type", None) == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).shared_memory_per_block_optin
    return HOPPER_SHARED


def shared_need(problem, kernel: str, block_m: int, block_n: int, stages: int) -> int:
    """An upper bound of one kernel's shared memory at these tiles: every TMA-loaded tile of a
    pipelined loop `stages` times (sm_90a builds measured at or below it). The teacher's head loop
    and the indexer's head loop do not overlap in time: their maximum."""
    size = 4 if problem.dtype == torch.float32 else 2
    block_d, block_e = _pow2(problem.dim), _pow2(problem.index_dim)
    if kernel == "lse":
        return (block_m + stages * block_n) * block_d * size + SHARED_SLACK
    teacher = stages * (block_m + block_n) * block_d * size
    index = stages * block_m * block_e * size + block_n * block_e * size  # qi tiles, the key tile's ki
    if kernel == "backward":
        teacher += block_n * block_e * size  # the program's ki tile stays loaded throughout
        index += block_m * block_e * 4 + block_m * block_n * size  # dqi's float32 reduction tile, dz's operand
    return max(teacher, index) + SHARED_SLACK


def config(problem, kernel: str, budget: int | None = None) -> dict:
    """Tile sizes and launch shape of one kernel ("lse", "forward", "backward") for `problem`: the
    largest tiles, then the deepest pipeline, whose shared memory fits `budget` bytes (default:
    what the problem's device allows)."""
    budget = shared_budget(problem.device) if budget is None else budget
    wide = _pow2(problem.dim) > 128
    ladder = _TILE_LADDER[1:] if wide else _TILE_LADDER
    # (sm_90a builds: none spills in the forward and lse kernels; the backward's 255 registers spill 32-60 B)
    for block_m, block_n, warps in ladder:
        block_m, block_n = _fit(block_m, problem.seqlen_q), _fit(block_n, problem.seqlen_k)
        for stages in (2, 1):
            if shared_need(problem, kernel, block_m, block_n, stages) <= budget:
                return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=1)


def _new(shape, device, fill: float | None = None) -> torch.Tensor:
    from streamkl.backends import base

    if fill is not None:
        return torch.full(shape, fill, dtype=torch.float32, device=device)
    if getattr(base, "POISON_OUTPUTS", False):
        return torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    return torch.empty(shape, dtype=torch.float32, device=device)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows_of_sequences(problem, rows: torch.Tensor):
    """(sequence, position in it, its key length, inside a sequence) of flat row numbers."""
    if not problem.is_varlen:
        seq = rows // problem.seqlen_q
        inside = torch.ones_like(rows, dtype=torch.bool)
        return seq, rows % problem.seqlen_q, torch.full_like(rows, problem.seqlen_k), inside
    cu_q = problem.cu_seqlens_q.long()
    cu_k = problem.cu_seqlens_k.long()
    seq = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp(0, problem.batch - 1)
    inside = rows < cu_q[-1]
    return seq, rows - cu_q[seq], cu_k[seq + 1] - cu_k[seq], inside


def selection(problem, topk_indices: torch.Tensor, shapes: list[tuple[int, int]]):
    """Each row's selected keys sorted ascending, repeats and unusable slots (-1, outside the row's
    sequence) replaced by BIG_INDEX: int32 [rows, K]; and per (BLOCK_M, BLOCK_N) in `shapes`, the
    uint8 table [S, query tiles, key tiles] of the tiles some row selected a key of. No host sync."""
    device = topk_indices.device
    top = topk_indices.reshape(-1, problem.topk)
    rows_total = top.shape[0]
    sel = torch.empty((rows_total, problem.topk), dtype=torch.int32, device=device)
    tables = []
    for block_m, block_n in shapes:
        q_tiles, k_tiles = -(-problem.seqlen_q // block_m), -(-problem.seqlen_k // block_n)
        tables.append(torch.zeros(problem.batch * q_tiles * k_tiles + 1, dtype=torch.uint8, device=device))
    chunk = max(1, (1 << 22) // max(problem.topk, 1))
    for start in range(0, rows_total, chunk):
        rows = torch.arange(start, min(start + chunk, rows_total), device=device)
        seq, pos, len_k, inside = _rows_of_sequences(problem, rows)
        raw = top[start : start + len(rows)].long()
        bad = (raw < 0) | (raw >= len_k[:, None]) | ~inside[:, None]
        ordered = torch.sort(torch.where(bad, BIG_INDEX, raw), dim=1).values
        repeat = torch.zeros_like(ordered, dtype=torch.bool)
        repeat[:, 1:] = ordered[:, 1:] == ordered[:, :-1]
        ordered = torch.sort(torch.where(repeat, BIG_INDEX, ordered), dim=1).values
        sel[start : start + len(rows)] = ordered.to(torch.int32)
        usable = ordered < BIG_INDEX
        for (block_m, block_n), table in zip(shapes, tables):
            q_tiles, k_tiles = -(-problem.seqlen_q // block_m), -(-problem.seqlen_k // block_n)
            flat = ((seq * q_tiles + pos // block_m) * k_tiles)[:, None] + ordered // block_n
            table.scatter_(0, torch.where(usable, flat, table.numel() - 1).reshape(-1), 1)
    return sel, [table[:-1] for table in tables]


def _tma_ready(t: torch.Tensor) -> torch.Tensor:
    """`t`, or a copy whose rows start on 16-byte boundaries (zero-padded last dim) when its strides
    or base do not allow tensor-memory-accelerator loads (odd head dims, unaligned views)."""
    size = t.element_size()
    if t.data_ptr() % 16 == 0 and t.stride(-1) == 1 and all(st * size % 16 == 0 for st in t.stride()[:-1]):
        return t
    width = -(-t.shape[-1] * size // 16) * 16 // size
    padded = t.new_zeros((*t.shape[:-1], width))
    padded[..., : t.shape[-1]] = t
    return padded[..., : t.shape[-1]]


def _descriptor(t: torch.Tensor, varlen: bool, rows: int, cols: int):
    """A 4-D descriptor [B, N, heads, dim] of an input (packed: [1, T, ...]; indexer keys and w-less
    tensors without a head dim get heads 1), loading [1, rows, 1, cols] boxes, zero past the ends."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    t = _tma_ready(t)
    shape, strides = list(t.shape), list(t.stride())
    if len(shape) == (2 if varlen else 3):  # one row per token (ki): a head dim of 1
        shape.insert(-1, 1)
        strides.insert(-1, strides[-2])
    if varlen:
        shape.insert(0, 1)
        strides.insert(0, strides[0] * max(shape[1], 1))
    return TensorDescriptor(t, shape, strides, [1, rows, 1, cols])


def _sequence_args(problem, device):
    spare = _placeholder(device)
    if problem.is_varlen:
        return problem.cu_seqlens_q, problem.cu_seqlens_k
    return spare, spare


def _constants(problem, cfg: dict) -> dict:
    return dict(
        BLOCK_D=_pow2(problem.dim), CAUSAL=problem.causal, VARLEN=problem.is_varlen, TOPK=problem.topk > 0,
        IEEE=problem.dtype == torch.float32, INTERPRET=_interpreting(), STEPS_K=max(problem.topk, 1).bit_length(),
        STEPS_N=cfg["BLOCK_N"].bit_length(), **cfg,
    )


def _launch(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    """`kernel[grid](*args, **constexprs)`, retried with a shallower pipeline if its shared memory
    does not fit after all (`shared_need` is a bound, the compiler has the last word)."""
    from streamkl.backends.triton.launch import launch

    constexprs = dict(constexprs)
    warps, stages = constexprs.pop("num_warps"), constexprs.pop("num_stages")
    launch(kernel, grid, args, warps, stages, constexprs)


def _placeholder(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _tiles(problem, cfg: dict) -> tuple[int, int]:
    return -(-problem.seqlen_q // cfg["BLOCK_M"]), -(-problem.seqlen_k // cfg["BLOCK_N"])


def forward(problem, q, k, qi, ki, w, lse, topk_indices):
    """(loss_rows, head_lse, index_lse) float32; see DSA_INTERFACE.md."""
    kernels = _kernels()
    w = _last_contiguous(w)
    device = q.device
    varlen = problem.is_varlen
    row_shape = (problem.total_q,) if varlen else (problem.batch, problem.seqlen_q)
    lse_shape = (problem.heads, problem.total_q) if varlen else (problem.batch, problem.heads, problem.seqlen_q)
    loss, index_lse = _new(row_shape, device), _new(row_shape, device)
    cfg_lse, cfg_fwd = config(problem, "lse"), config(problem, "forward")
    spare = _placeholder(device)
    sel, tables = spare, [spare, spare]
    if problem.topk > 0:
        shapes = [(cfg_lse["BLOCK_M"], cfg_lse["BLOCK_N"]), (cfg_fwd["BLOCK_M"], cfg_fwd["BLOCK_N"])]
        sel, tables = selection(problem, topk_indices, shapes[:1] if shapes[0] == shapes[1] else shapes)
        tables = tables * (3 - len(tables))  # one table serves both kernels when their tiles agree
    sel_stride = 0 if varlen or problem.topk == 0 else problem.seqlen_q * problem.topk
    cu_q, cu_k = _sequence_args(problem, device)
    block_d, block_e = _pow2(problem.dim), _pow2(problem.index_dim)
    common = (problem.seqlen_q, problem.seqlen_k, problem.heads, problem.heads // problem.heads_k)
    if lse is not None:
        head_lse = _last_contiguous(lse)
    else:
        head_lse = _new(lse_shape, device)
        q_tiles, k_tiles = _tiles(problem, cfg_lse)
        if q_tiles * problem.batch > 0:
            _launch(kernels._head_lse_kernel, (q_tiles * problem.batch * problem.heads,), (
                _descriptor(q, varlen, cfg_lse["BLOCK_M"], block_d),
                _descriptor(k, varlen, cfg_lse["BLOCK_N"], block_d),
                head_lse, sel, tables[0], cu_q, cu_k,
                0 if varlen else head_lse.stride(0), head_lse.stride(-2), sel_stride,
                *common, problem.scale * LOG2E, problem.topk, q_tiles, k_tiles,
            ), _constants(problem, cfg_lse))
    q_tiles, k_tiles = _tiles(problem, cfg_fwd)
    if q_tiles * problem.batch > 0:
        rows, cols = cfg_fwd["BLOCK_M"], cfg_fwd["BLOCK_N"]
        _launch(kernels._forward_kernel, (q_tiles * problem.batch,), (
            _descriptor(q, varlen, rows, block_d), _descriptor(k, varlen, cols, block_d),
            _descriptor(qi, varlen, rows, block_e), _descriptor(ki, varlen, cols, block_e),
            w, head_lse, loss, index_lse, sel, tables[1], cu_q, cu_k,
            0 if varlen else w.stride(0), w.stride(-2), 0 if varlen else head_lse.stride(0), head_lse.stride(-2),
            0 if varlen else problem.seqlen_q, sel_stride,
            *common, problem.index_heads, problem.scale * LOG2E, problem.topk, q_tiles, k_tiles,
        ), dict(BLOCK_E=block_e, **_constants(problem, cfg_fwd)))
    if varlen and problem.total_q > 0:
        tail = torch.arange(problem.total_q, device=device) >= problem.cu_seqlens_q[-1]
        loss.masked_fill_(tail, 0.0)
        index_lse.masked_fill_(tail, float("-inf"))
        if lse is None:
            head_lse.masked_fill_(tail[None, :], float("-inf"))
    return loss, head_lse, index_lse


def backward(problem, q, k, qi, ki, w, topk_indices, head_lse, index_lse, grad_rows):
    """(dqi, dki, dw) in the input dtype; see DSA_INTERFACE.md."""
    kernels = _kernels()
    w = _last_contiguous(w)
    head_lse, index_lse = _last_contiguous(head_lse), index_lse.contiguous()
    grad_rows = grad_rows.float().contiguous()
    device = q.device
    varlen = problem.is_varlen
    cfg = config(problem, "backward")
    q_tiles, k_tiles = _tiles(problem, cfg)
    spare = _placeholder(device)
    sel, table = spare, spare
    if problem.topk > 0:
        sel, (table,) = selection(problem, topk_indices, [(cfg["BLOCK_M"], cfg["BLOCK_N"])])
    sel_stride = 0 if varlen or problem.topk == 0 else problem.seqlen_q * problem.topk
    # float32 accumulation buffer of dqi's atomics, rows padded to 16 bytes for the reductions
    width = -(-problem.index_dim // 4) * 4
    dqi = torch.zeros((*qi.shape[:-1], width), dtype=torch.float32, device=device)[..., : problem.index_dim]
    dw = torch.zeros(w.shape, dtype=torch.float32, device=device)
    dki = torch.zeros(ki.shape, dtype=ki.dtype, device=device)
    if varlen:
        grad_strides = [0, dqi.stride(0), dqi.stride(1), 0, dki.stride(0), 0, dw.stride(0)]
    else:
        grad_strides = [dqi.stride(0), dqi.stride(1), dqi.stride(2), dki.stride(0), dki.stride(1), dw.stride(0),
                        dw.stride(1)]
    cu_q, cu_k = _sequence_args(problem, device)
    block_d, block_e = _pow2(problem.dim), _pow2(problem.index_dim)
    if k_tiles * problem.batch > 0 and q_tiles > 0:
        rows, cols = cfg["BLOCK_M"], cfg["BLOCK_N"]
        _launch(kernels._backward_kernel, (k_tiles * problem.batch,), (
            _descriptor(q, varlen, rows, block_d), _descriptor(k, varlen, cols, block_d),
            _descriptor(qi, varlen, rows, block_e), _descriptor(ki, varlen, cols, block_e),
            w, head_lse, index_lse, grad_rows, _descriptor(dqi, varlen, rows, block_e), dqi, dki, dw,
            sel, table, cu_q, cu_k,
            0 if varlen else w.stride(0), w.stride(-2), 0 if varlen else head_lse.stride(0), head_lse.stride(-2),
            0 if varlen else problem.seqlen_q, sel_stride, *grad_strides,
            problem.seqlen_q, problem.seqlen_k, problem.heads, problem.heads // problem.heads_k,
            problem.index_heads, problem.scale * LOG2E, problem.topk, q_tiles, k_tiles,
        ), dict(INDEX_DIM=problem.index_dim, BLOCK_E=block_e, **_constants(problem, cfg)))
    return dqi.to(qi.dtype).contiguous(), dki, dw.to(w.dtype)


def compile_for_hopper(kernel: str, dtype: torch.dtype = torch.bfloat16, dim: int = 128, index_dim: int = 128,
                       causal: bool = True, topk: int = 0, varlen: bool = False):
    """One kernel ("lse", "forward", "backward") compiled for sm_90a without a GPU, at the tile
    sizes `config` picks for a long sequence on an H100 / H200; returns the compiled kernel (.asm:
    ptx, cubin; .metadata.shared: its shared memory in bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = _kernels()
    fn = {"lse": kernels._head_lse_kernel, "forward": kernels._forward_kernel,
          "backward": kernels._backward_kernel}[kernel]

    class _Shape:  # the fields `config` reads
        pass

    shape = _Shape()
    shape.dim, shape.index_dim, shape.dtype, shape.device = dim, index_dim, dtype, torch.device("cpu")
    shape.seqlen_q = shape.seqlen_k = 1 << 15
    cfg = config(shape, kernel)
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    descriptors = {"Q_DESC": (element, "BLOCK_M", "BLOCK_D"), "K_DESC": (element, "BLOCK_N", "BLOCK_D"),
                   "QI_DESC": (element, "BLOCK_M", "BLOCK_E"), "KI_DESC": (element, "BLOCK_N", "BLOCK_E"),
                   "DQI_DESC": ("fp32", "BLOCK_M", "BLOCK_E")}
    pointers = {"W": element, "DKI": element, "SEL": "i32", "CU_Q": "i32", "CU_K": "i32", "TILES": "u8"}
    constants = dict(BLOCK_D=_pow2(dim), INDEX_DIM=index_dim, BLOCK_E=_pow2(index_dim), CAUSAL=causal,
                     VARLEN=varlen, TOPK=topk > 0, IEEE=dtype == torch.float32, INTERPRET=False,
                     STEPS_K=max(topk, 1).bit_length(), STEPS_N=cfg["BLOCK_N"].bit_length(),
                     BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"])
    signature = {}
    for name in fn.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in descriptors:
            kind, rows, cols = descriptors[name]
            signature[name] = f"tensordesc<{kind}[1, {constants[rows]}, 1, {constants[cols]}]>"
        elif name.isupper():
            signature[name] = "*" + pointers.get(name, "fp32")
        elif name == "qk_scale":
            signature[name] = "fp32"
        else:
            signature[name] = "i32"
    used = {name: value for name, value in constants.items() if name in fn.arg_names}
    # pointers 16-byte aligned, as a launch with fresh allocations specializes them
    aligned = [[i] for i, name in enumerate(fn.arg_names) if name.isupper() and name not in used
               and name not in descriptors]
    source = ASTSource(fn, signature, constexprs={(fn.arg_names.index(n),): v for n, v in used.items()},
                       attrs={tuple(i): [["tt.divisibility", 16]] for i in aligned})
    options = {"num_warps": cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
