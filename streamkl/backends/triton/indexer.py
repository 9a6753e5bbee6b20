"""The DSA indexer loss (SPEC 8) on Triton: host side of `indexer_kernels.py`.

Three launches, each streaming (query tile, key tile) pairs of one sequence, nothing of size
Nq x Nk ever stored:

- teacher lse (only when `lse` is not given): one program per (query tile, sequence, head), an
  attention forward without the value product;
- forward: one program per (query tile, sequence, key split); per key tile the teacher's head
  mean T (the heads loop inside, each head normalized by its lse, GQA keys per key head) and the
  indexer logits z (the indexer key tile loaded once, the indexer heads loop inside), then per row
  the running max and sum of exp(z), a = sum T log T and b = sum T z over the split's keys. The
  splits of a query tile run side by side, so its queries (all heads: 4 MB for 128 rows at
  H = Hi = 64, D = Di = 128) come from memory once, not once per key tile; a few torch operations
  merge the splits: lse(z), loss = a - b + lse(z). Saves lse(z) (4 B per row) next to the
  teacher's per-head lse (4 B per row and head);
- backward (`indexer_backward.py`): one program per (query tile, key tile) of a launch's rows:
  T and z recomputed, dz = g (S - T), then per indexer head r recomputed, dki accumulated in
  registers (one float32 reduction per program) and G = sum_j dz 1[r > 0] ki added by float32
  reductions into a workspace that holds the launch's rows only. The rows go in launches of two
  ranges (one from each end: equal causal work per launch), each followed by a finishing kernel
  that writes the range's dqi = w G and dw = qi . G (= sum_j dz relu(r)). G's reduction traffic
  is per (query tile, key tile, head), so it falls with the key tile, but 64 x 64 tiles' occupancy
  measures faster than 64 x 128 on the H200. A
  query-major backward would keep dqi in registers but needs Hi x Di float32 per row (32 KB at
  64 x 128): no tile of rows large enough for the teacher's products fits.

Top-k stage: the same kernels with the selection as part of the mask. A launch's rows have their
indices sorted by `select` (one program a row, the sort in registers; keys past the row's causal
limit sort last as unusable) into a buffer of those rows only: the forward and lse kernels run in
launches of two row windows (one from each end, as the backward's ranges) sized so that the
sorted selections (4 K bytes a row) stay within the memory bound, the backward sorts each launch's
ranges. The lse and forward kernels walk each row's sorted selection with a cursor and visit only
the key tiles some row selected; the backward skips the others by a (query tile, key tile) table
that each launch's `select` adds its rows' tiles to. The work is proportional to the selected
tiles: about the dense stage's for scattered selections, far less for local or clustered ones.
"""

from __future__ import annotations

import os

import torch

BIG_INDEX = 1 << 30  # sorts after every key position; marks unusable slots
LOG2E = 1.4426950408889634
LN2 = 0.6931471805599453
DTYPES = (torch.float16, torch.bfloat16, torch.float32)
MAX_DIM, MAX_INDEX_DIM, MAX_INDEX_HEADS, MAX_HEADS = 256, 128, 64, 128
MAX_TOPK = 1 << 15  # `select` sorts a row's selection in one program up to this K; past it, torch's sort


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def _kernels():
    """The kernel module, imported on first use (Triton may be missing where this is imported)."""
    if _interpreting():
        from streamkl.backends.triton._compat import patch_interpreter_index

        patch_interpreter_index()
    from streamkl.backends.triton import indexer_kernels

    return indexer_kernels


def _backward_kernels():
    _kernels()
    from streamkl.backends.triton import indexer_backward

    return indexer_backward


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
    if kernel == "lse" and getattr(problem, "topk", 0) == 0:  # the query tile stays loaded
        return (block_m + stages * block_n) * block_d * size + SHARED_SLACK
    if kernel == "lse":  # top-k: each head's query tile is loaded again for every key tile
        return stages * (block_m + block_n) * block_d * size + SHARED_SLACK
    teacher = stages * (block_m + block_n) * block_d * size
    index = stages * block_m * block_e * size + block_n * block_e * size  # qi tiles, the key tile's ki
    if kernel == "backward":
        teacher += block_n * block_e * size  # the program's ki tile stays loaded throughout
        # G's float32 reduction tile, the two dz operands (dqi's and dki's)
        index += block_m * block_e * 4 + 2 * block_m * block_n * size
    return max(teacher, index) + SHARED_SLACK


# (BLOCK_M, BLOCK_N, warps[, most stages]), largest first; the first tile of each ladder is the
# fastest timed at N = 32K, bf16, H = 64 (docs/indexer.md has the tables):
# - backward 64 x 64 x 4: 137 ms against 160 at 64 x 128 x 8 (H200);
# - top-k lse pass 64 x 128 x 4: 83 ms against 112 at 128 x 128 x 8, its selection walk's registers
#   halving the occupancy (H200);
# - dense forward 64 x 128 x 4 x 2: 49.5 ms against 57.5 at three stages, 59.3 at 128 x 64 x 8 (H200);
# - dense lse pass 64 x 128 x 4 x 3: the forward with it 70.3 ms against 72.6 at 128 x 128 x 8 x 3
#   (H100, mean of six runs);
# - top-k forward 64 x 128 x 4 x 2 (top-2048, lse given): 54.8 / 16.9 ms scattered / local against
#   65.3 / 20.2 at 128 x 64 x 8 x 3 (H100); it spills 464 bytes a thread for sm_90a, and is faster.
_LADDERS = {
    "lse": ((64, 128, 4, 3),) + _TILE_LADDER, "forward": ((64, 128, 4, 2),) + _TILE_LADDER,
    "forward_topk": ((64, 128, 4, 2),) + _TILE_LADDER, "backward": ((64, 64, 4), (32, 64, 4), (32, 32, 4)),
    "lse_topk": ((64, 128, 4), (64, 64, 4), (32, 64, 4), (32, 32, 4)),
}
# teacher head dims over 128 (padded): without their largest tiles
_WIDE_LADDERS = {name: _LADDERS[name][1:] for name in ("lse", "lse_topk", "forward_topk")}
_WIDE_LADDERS["forward"] = _WIDE_LADDERS["forward_topk"] = _TILE_LADDER[1:]


def config(problem, kernel: str, budget: int | None = None) -> dict:
    """Tile sizes and launch shape of one kernel ("lse", "forward", "backward") for `problem`: the
    largest tiles, then the deepest pipeline, whose shared memory fits `budget` bytes (default:
    what the problem's device allows)."""
    budget = shared_budget(problem.device) if budget is None else budget
    topk = getattr(problem, "topk", 0) > 0
    name = f"{kernel}_topk" if topk and kernel in ("lse", "forward") else kernel
    ladder = _WIDE_LADDERS.get(name, _LADDERS[name]) if _pow2(problem.dim) > 128 else _LADDERS[name]
    for block_m, block_n, warps, *most in ladder:
        block_m, block_n = _fit(block_m, problem.seqlen_q), _fit(block_n, problem.seqlen_k)
        for stages in range(most[0] if most else 3, 0, -1):  # deeper pipelines first
            if shared_need(problem, kernel, block_m, block_n, stages) <= budget:
                return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=1)


TOPK_LSE_HEADS = 16  # the top-k lse kernel's heads a program at most (a visited tile's selection read once for them)


def program_heads(heads: int) -> int:
    """The top-k lse kernel's heads a program: the largest power of two up to TOPK_LSE_HEADS that
    divides `heads`."""
    count = TOPK_LSE_HEADS
    while heads % count:
        count //= 2
    return count


def _new(shape, device, fill: float | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    from streamkl.backends import base

    if fill is not None:
        return torch.full(shape, fill, dtype=dtype, device=device)
    if base.poison_outputs():
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


def _last_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _rows_of_sequences(problem, rows: torch.Tensor):
    """(sequence, position in it, its query length, its key length, inside a sequence) of flat row numbers."""
    if not problem.is_varlen:
        seq = rows // problem.seqlen_q
        inside = torch.ones_like(rows, dtype=torch.bool)
        return (seq, rows % problem.seqlen_q, torch.full_like(rows, problem.seqlen_q),
                torch.full_like(rows, problem.seqlen_k), inside)
    cu_q = problem.cu_seqlens_q.long()
    cu_k = problem.cu_seqlens_k.long()
    seq = (torch.searchsorted(cu_q, rows, right=True) - 1).clamp(0, problem.batch - 1)
    inside = rows < cu_q[-1]
    return seq, rows - cu_q[seq], cu_q[seq + 1] - cu_q[seq], cu_k[seq + 1] - cu_k[seq], inside


def select(problem, topk_indices: torch.Tensor, sel: torch.Tensor, pair, table: torch.Tensor | None = None,
           tile: tuple[int, int] = (1, 1)) -> None:
    """Sort a launch's selections into `sel` (int32 [>= its rows, K]): the rows of its two row
    windows `pair` ((lo0, hi0), (lo1, hi1), flat rows), the first's then the second's, each row's
    keys ascending, the slots it cannot use (-1, past its causal limit, a row of no sequence)
    BIG_INDEX (repeats stay: the kernels' bits set them twice). With `table` (uint8
    [S * query tiles * key tiles] of `tile` = (BLOCK_M, BLOCK_N)), also a 1 for every tile a row
    selects a key of; the table is never cleared, so it holds every earlier launch's tiles too.
    One program a row, the sort in registers: no temporaries, no host sync."""
    (lo0, hi0), (lo1, hi1) = pair
    rows = hi0 - lo0 + hi1 - lo1
    if rows == 0:
        return
    top = topk_indices.reshape(-1, problem.topk)
    if problem.topk > MAX_TOPK:  # more keys than one program sorts in registers
        _select_by_sort(problem, top, sel, pair, table, tile)
        return
    cu_q, cu_k = _sequence_args(problem, sel.device)
    block_k = _pow2(problem.topk)
    q_tiles, k_tiles = -(-problem.seqlen_q // tile[0]), -(-problem.seqlen_k // tile[1])
    _kernels()._selection_kernel[(rows,)](
        top, sel, sel if table is None else table, cu_q, cu_k, top.stride(0), lo0, hi0, lo1, problem.batch,
        max(problem.seqlen_q, 1), problem.seqlen_k, problem.topk, q_tiles, k_tiles,
        CAUSAL=problem.causal, VARLEN=problem.is_varlen, TABLE=table is not None, BLOCK_K=block_k,
        TILE_M=tile[0], TILE_N=tile[1], num_warps=min(16, max(4, block_k // 256)))


def _select_by_sort(problem, top: torch.Tensor, sel: torch.Tensor, pair, table: torch.Tensor | None,
                    tile: tuple[int, int]) -> None:
    """`select` by torch ops (a sort of the launch's rows: temporaries of their size), for K past
    MAX_TOPK; `top` is [rows, K]."""
    (lo0, hi0), (lo1, hi1) = pair
    device = sel.device
    rows = torch.cat([torch.arange(lo0, hi0, device=device), torch.arange(lo1, hi1, device=device)])
    seq, pos, len_q, len_k, inside = _rows_of_sequences(problem, rows)
    raw = top[rows].to(torch.int32)
    limit = len_k if not problem.causal else torch.minimum(len_k, pos + len_k - len_q + 1)
    bad = (raw < 0) | (raw >= limit[:, None]) | ~inside[:, None]
    ordered = torch.sort(torch.where(bad, BIG_INDEX, raw), dim=1).values
    sel[: len(rows)] = ordered
    if table is not None:
        q_tiles, k_tiles = -(-problem.seqlen_q // tile[0]), -(-problem.seqlen_k // tile[1])
        flat = ((seq * q_tiles + pos // tile[0]) * k_tiles)[:, None] + ordered // tile[1]
        table[flat[ordered < BIG_INDEX]] = 1


#: a top-k forward launch's smallest windows: enough query tiles to fill the GPU. On an H100 at
#: N = 32K, H = 64, K = 2048 (2026-12-07) the forward took, by window rows (1280 / 2560 / 4096 /
#: 16384), 177 / 153 / 147 / 146 ms for scattered selections and 78 / 54 / 43 / 41 ms for local
#: ones, against 147 and 42 with every row's selection sorted at once
MIN_WINDOW_ROWS = 4096


def window_rows(problem, rows_total: int, splits: int) -> int:
    """Rows of each of a top-k forward launch's two row windows. Their sorted selections (4 K bytes
    a row) and split statistics (16 bytes a row per split) take at most 11 bytes per (row, teacher
    head) of all rows: with the teacher's lse (4) and the outputs (8 bytes a row), at most 16 at
    H >= 8; but a window holds at least MIN_WINDOW_ROWS rows, so that a launch has enough programs:
    below about N = 96K at H = 64, K = 2048 that floor is the larger (a fixed 66 MiB)."""
    per_row = 4 * problem.topk + 16 * splits
    fit = 11 * problem.heads * rows_total // per_row // 2
    return max(MIN_WINDOW_ROWS, fit // 128 * 128)


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


def _heads_major(w: torch.Tensor) -> torch.Tensor:
    """`w` ([..., rows, Hi]) with each head's weights contiguous over the rows (a copy): the kernels
    load one head's weights for a tile of rows at a time, one coalesced run instead of a 2-byte
    read from each row's line."""
    return w.transpose(-1, -2).contiguous().transpose(-1, -2)


def _sequence_args(problem, device):
    spare = _placeholder(device)
    if problem.is_varlen:
        return problem.cu_seqlens_q, problem.cu_seqlens_k
    return spare, spare


def _constants(problem, cfg: dict) -> dict:
    return dict(
        BLOCK_D=_pow2(problem.dim), CAUSAL=problem.causal, VARLEN=problem.is_varlen, TOPK=problem.topk > 0,
        IEEE=problem.dtype == torch.float32, INTERPRET=_interpreting(), STEPS_K=max(problem.topk, 1).bit_length(),
        CHUNK=_chunk(problem.topk), **cfg,
    )


def _chunk(topk: int) -> int:
    """Selection slots the kernels read per row and load: 32 (a 128-byte run), fewer for small K."""
    return min(32, _pow2(topk))


MAX_TOPK_BLOCK_N = 128  # a top-k tile's keys are two 64-bit words of bits per row


def _with_tiles(problem, cfg: dict, tiles: tuple[int, ...] | None) -> dict:
    """`cfg` with (BLOCK_M, BLOCK_N, warps[, stages]) replaced by `tiles` when given."""
    if tiles is None:
        return cfg
    if problem.topk > 0 and tiles[1] > MAX_TOPK_BLOCK_N:
        raise ValueError(f"tiles: BLOCK_N {tiles[1]} > {MAX_TOPK_BLOCK_N} with a top-k selection")
    cfg = dict(cfg, BLOCK_M=tiles[0], BLOCK_N=tiles[1], num_warps=tiles[2])
    return cfg if len(tiles) < 4 else dict(cfg, num_stages=tiles[3])


def _launch(kernel, grid: tuple, args: tuple, constexprs: dict) -> None:
    """`kernel[grid](*args, **constexprs)`, retried with a shallower pipeline if its shared memory
    does not fit after all (`shared_need` is a bound, the compiler has the last word)."""
    from streamkl.backends.triton.launch import launch

    warps, stages = constexprs["num_warps"], constexprs["num_stages"]
    launch(kernel, grid, args, warps, stages, {k: v for k, v in constexprs.items() if k in kernel.arg_names})


def _placeholder(device) -> torch.Tensor:
    return torch.zeros(1, dtype=torch.int32, device=device)


def _tiles(problem, cfg: dict) -> tuple[int, int]:
    return -(-problem.seqlen_q // cfg["BLOCK_M"]), -(-problem.seqlen_k // cfg["BLOCK_N"])


def forward(problem, q, k, qi, ki, w, lse, topk_indices, *, tiles: tuple[int, ...] | None = None,
            lse_tiles: tuple[int, ...] | None = None, window: int | None = None, teacher: bool = True):
    """(loss_rows, head_lse, index_lse) float32 (the backend interface: streamkl/indexer.py).
    `tiles` / `lse_tiles` (BLOCK_M, BLOCK_N, warps[, stages]) replace `config`'s choice for the
    forward / the teacher lse kernel (A/B timing in tools/time_indexer_triton.py); `window`
    replaces `window_rows`'s (tests). `teacher=False`: the forward kernel computes only the
    indexer's lse (loss_rows then hold nothing of use; `forward_with_gradients`)."""
    kernels = _kernels()
    w_heads = _heads_major(w)
    device = q.device
    varlen = problem.is_varlen
    row_shape = (problem.total_q,) if varlen else (problem.batch, problem.seqlen_q)
    lse_shape = (problem.heads, problem.total_q) if varlen else (problem.batch, problem.heads, problem.seqlen_q)
    loss, index_lse = _new(row_shape, device), _new(row_shape, device)
    cfg_lse = _with_tiles(problem, config(problem, "lse"), lse_tiles)
    cfg_fwd = _with_tiles(problem, config(problem, "forward"), tiles)
    head_lse = _last_contiguous(lse) if lse is not None else _new(lse_shape, device)
    rows_total = problem.total_q if varlen else problem.batch * problem.seqlen_q
    q_tiles, k_tiles = _tiles(problem, cfg_fwd)
    splits, split_tiles = key_splits(problem, k_tiles)
    # the rows go in launches of two row windows (one from each end: equal causal work per launch);
    # the dense stage has one window of every row
    launches, size = [((0, rows_total), (0, 0))], rows_total
    sel = _placeholder(device)
    if problem.topk > 0:
        size = window_rows(problem, rows_total, splits) if window is None else window
        launches = row_ranges(rows_total, size)
        sel = torch.empty((min(2 * size, rows_total), problem.topk), dtype=torch.int32, device=device)
    parts = torch.empty((4, splits, min(2 * size, rows_total)), dtype=torch.float32, device=device)  # m, l, a, b
    cu_q, cu_k = _sequence_args(problem, device)
    block_d, block_e = _pow2(problem.dim), _pow2(problem.index_dim)
    common = (problem.seqlen_q, problem.seqlen_k, problem.heads, problem.heads // problem.heads_k)
    windows = 2 if problem.topk > 0 else 1
    span_lse, span_fwd = _span_tiles(problem, cfg_lse["BLOCK_M"], size), _span_tiles(problem, cfg_fwd["BLOCK_M"], size)
    if problem.batch * q_tiles == 0 or rows_total == 0:
        launches = []
    for pair in launches:
        (lo0, hi0), (lo1, hi1) = pair
        bounds = (lo0, hi0, lo1, hi1, windows)
        if problem.topk > 0:
            select(problem, topk_indices, sel, pair)
        if lse is None:
            rows, cols = cfg_lse["BLOCK_M"], cfg_lse["BLOCK_N"]
            descriptors = _descriptor(q, varlen, rows, block_d), _descriptor(k, varlen, cols, block_d)
            strides = 0 if varlen else head_lse.stride(0), head_lse.stride(-2)
            if problem.topk > 0:
                heads = program_heads(problem.heads)
                _launch(kernels._topk_lse_kernel, (span_lse * windows * problem.batch * problem.heads // heads,), (
                    *descriptors, head_lse, sel, cu_q, cu_k, *strides, *bounds, span_lse,
                    *common, problem.scale * LOG2E, problem.topk,
                ), dict(PROGRAM_HEADS=heads, **_constants(problem, cfg_lse)))
            else:
                _launch(kernels._head_lse_kernel, (span_lse * windows * problem.batch * problem.heads,), (
                    *descriptors, head_lse, cu_q, cu_k, *strides, *bounds, span_lse, *common, problem.scale * LOG2E,
                ), _constants(problem, cfg_lse))
        parts[0].fill_(float("-inf"))
        parts[1:].zero_()
        rows, cols = cfg_fwd["BLOCK_M"], cfg_fwd["BLOCK_N"]
        _launch(kernels._forward_kernel, (span_fwd * windows * problem.batch * splits,), (
            _descriptor(q, varlen, rows, block_d), _descriptor(k, varlen, cols, block_d),
            _descriptor(qi, varlen, rows, block_e), _descriptor(ki, varlen, cols, block_e),
            w_heads, head_lse, parts, sel, cu_q, cu_k,
            0 if varlen else w_heads.stride(0), w_heads.stride(-2), w_heads.stride(-1),
            0 if varlen else head_lse.stride(0), head_lse.stride(-2),
            parts.stride(0), parts.stride(1), *bounds, span_fwd,
            *common, problem.index_heads, problem.scale * LOG2E, problem.topk, splits, split_tiles,
        ), dict(BLOCK_E=block_e, TEACHER=teacher, **_constants(problem, cfg_fwd)))
        for (lo, hi), base in (((lo0, hi0), 0), ((lo1, hi1), hi0 - lo0)):
            if hi > lo:
                _merge_splits(parts[:, :, base : base + hi - lo], loss.view(-1)[lo:hi], index_lse.view(-1)[lo:hi])
    if varlen and problem.total_q > 0:
        tail = torch.arange(problem.total_q, device=device) >= problem.cu_seqlens_q[-1]
        loss.masked_fill_(tail, 0.0)
        index_lse.masked_fill_(tail, float("-inf"))
        if lse is None:
            head_lse.masked_fill_(tail[None, :], float("-inf"))
    return loss, head_lse, index_lse


def _span_tiles(problem, block_m: int, size: int) -> int:
    """Query tiles a row window of `size` rows can touch in one sequence."""
    return min(-(-problem.seqlen_q // block_m), -(-size // block_m) + 1)


def key_splits(problem, k_tiles: int) -> tuple[int, int]:
    """(splits, key tiles per split) of the forward. A query tile's programs over the splits run
    side by side and share its queries (H x D + Hi x Di values a row) in the L2 cache instead of
    each query tile reading them once per key tile; the partial statistics cost 16 bytes a row per
    split, at most 4 per (row, teacher head): one split for fewer than 8 teacher heads."""
    splits = max(1, min(16, k_tiles, problem.heads // 4))
    split_tiles = -(-max(k_tiles, 1) // splits)
    return -(-max(k_tiles, 1) // split_tiles), split_tiles


def _merge_splits(parts: torch.Tensor, loss: torch.Tensor, index_lse: torch.Tensor) -> None:
    """loss and lse(z) per row from the splits' (m, l, a, b) (base-2 running max and sum of z's
    exponentials, sum T log T, sum T z); NaN anywhere in a row's statistics makes both NaN."""
    m, l_part, a, b = parts
    top = m.amax(0)
    ref = torch.where(top == float("-inf"), 0.0, top)
    total = (l_part * torch.exp2(m - ref)).sum(0)
    lse = torch.where(total > 0, (top + torch.log2(total)) * LN2, float("-inf"))
    nan = torch.isnan(total)
    index_lse.copy_(torch.where(nan, float("nan"), lse))
    loss.copy_(torch.where(nan, float("nan"), torch.where(total > 0, a.sum(0) - b.sum(0) + lse, 0.0)))


def slab_rows(problem, block_m: int) -> int:
    """Rows of one row range of the backward's launches (two ranges per launch). Memory besides
    the gradients, per (row, teacher head): the saved teacher lse 4 bytes, dki's float32
    accumulator 4 Di / H (8 at H = 64, Di = 128), and this workspace (float32 G, Hi Di words a
    row, and in the top-k stage the rows' sorted selections, 4 K bytes a row) at most 4, never
    below two query tiles a range."""
    rows = problem.total_q if problem.is_varlen else problem.batch * problem.seqlen_q
    per_row = problem.index_heads * _padded_width(problem.index_dim) * 4 + 4 * problem.topk
    fit = 4 * problem.heads * rows // per_row // 2
    return max(2 * block_m, fit // block_m * block_m)


def _padded_width(index_dim: int) -> int:
    """G's row width in float32 words: a multiple of 4, so that its rows start on 16 bytes."""
    return -(-index_dim // 4) * 4


def row_ranges(total: int, size: int) -> list[tuple[tuple[int, int], tuple[int, int]]]:
    """The backward's launches: [0, total) in ranges of `size` rows, paired first with last,
    second with second to last...: causal work grows with the row, so every launch gets about the
    same. An unpaired middle range goes with an empty one."""
    ranges = [(start, min(start + size, total)) for start in range(0, total, size)]
    launches = []
    for first in range((len(ranges) + 1) // 2):
        last = len(ranges) - 1 - first
        launches.append((ranges[first], ranges[last] if last != first else (0, 0)))
    return launches


def backward(problem, q, k, qi, ki, w, topk_indices, head_lse, index_lse, grad_rows, *,
             tiles: tuple[int, ...] | None = None, sums: torch.Tensor | None = None):
    """(dqi, dki, dw) in the input dtype (the backend interface: streamkl/indexer.py). `tiles`
    (BLOCK_M, BLOCK_N, warps[, stages]) replaces `config`'s choice (A/B timing in
    tools/time_indexer_triton.py). `sums`: float32 [2, rows] (flat rows, zeroed by the caller), to
    which the pass adds each row's sum T log T and sum T z (`forward_with_gradients`)."""
    backward_kernels = _backward_kernels()
    w = _last_contiguous(w)
    head_lse, index_lse = _last_contiguous(head_lse), index_lse.contiguous()
    grad_rows = grad_rows.float().contiguous()
    device = q.device
    varlen = problem.is_varlen
    cfg = _with_tiles(problem, config(problem, "backward"), tiles)
    q_tiles, k_tiles = _tiles(problem, cfg)
    block_m, block_n = cfg["BLOCK_M"], cfg["BLOCK_N"]
    rows_total = problem.total_q if varlen else problem.batch * problem.seqlen_q
    hi_, di = problem.index_heads, problem.index_dim
    # every row is in one range, whose finishing kernel writes its dqi and dw
    dqi, dw = _new(qi.shape, device, dtype=qi.dtype), _new(w.shape, device, dtype=w.dtype)
    # float32 accumulators with rows on 16 bytes (tensor-memory reductions)
    dki = torch.zeros((*ki.shape[:-1], _padded_width(di)), dtype=torch.float32, device=device)[..., :di]
    size = slab_rows(problem, block_m)
    # workspace: the two ranges, a tile of spare rows before and after (whole tiles add to them).
    # Without them (tiles reaching before the first range or past the last row clipped by the
    # descriptor's bounds, negative row coordinates included) a backward whose range starts inside
    # a query tile stopped with an illegal instruction on an H100 (triton 3.6, 2026-12-07)
    ws_rows = 2 * size + 2 * block_m
    g = torch.zeros((ws_rows, hi_, _padded_width(di)), dtype=torch.float32, device=device)[..., :di]
    cu_q, cu_k = _sequence_args(problem, device)
    block_d, block_e = _pow2(problem.dim), _pow2(di)
    if k_tiles * problem.batch == 0 or q_tiles == 0 or rows_total == 0:
        return dqi.zero_(), dki.to(ki.dtype).contiguous(), dw.zero_()
    sel = table = _placeholder(device)
    if problem.topk > 0:  # a launch's rows' sorted selections (the workspace's rows), the tiles selected so far
        sel = torch.empty((block_m + min(2 * size, rows_total), problem.topk), dtype=torch.int32, device=device)
        table = torch.zeros(problem.batch * q_tiles * k_tiles, dtype=torch.uint8, device=device)
    descriptors = (_descriptor(q, varlen, block_m, block_d), _descriptor(k, varlen, block_n, block_d),
                   _descriptor(qi, varlen, block_m, block_e), _descriptor(ki, varlen, block_n, block_e))
    # no copies: g's and dki's rows start on 16 bytes
    g_descriptor, dki_descriptor = _descriptor(g, True, block_m, block_e), _descriptor(dki, varlen, block_n, block_e)
    span_tiles = -(-size // block_m) + 1  # query tiles a range of `size` rows can touch
    w_heads = _heads_major(w)
    strides = (0 if varlen else w_heads.stride(0), w_heads.stride(-2), w_heads.stride(-1),
               0 if varlen else head_lse.stride(0), head_lse.stride(-2),
               0 if varlen else problem.seqlen_q, g.stride(0), g.stride(1),
               0 if varlen else dki.stride(0), dki.stride(-2))
    constants = dict(INDEX_DIM=di, BLOCK_E=block_e, LOSS=sums is not None, **_constants(problem, cfg))
    for pair in row_ranges(rows_total, size):
        (lo0, hi0), (lo1, hi1) = pair
        base0, base1 = block_m, block_m + (hi0 - lo0)
        if problem.topk > 0:  # the launch's rows' selections, in its workspace rows
            select(problem, topk_indices, sel[block_m:], pair, table, (block_m, block_n))
        _launch(backward_kernels._backward_kernel, (span_tiles * 2 * k_tiles * problem.batch,), (
            *descriptors, w_heads, head_lse, index_lse, grad_rows, g_descriptor, g, dki_descriptor, dki, sel, table,
            cu_q, cu_k, sel if sums is None else sums,
            *strides, 0 if sums is None else sums.stride(0), lo0, hi0, base0, lo1, hi1, base1,
            problem.seqlen_q, problem.seqlen_k, problem.heads, problem.heads // problem.heads_k,
            hi_, problem.scale * LOG2E, problem.topk, q_tiles, k_tiles, span_tiles,
        ), constants)
        for lo, hi, base in ((lo0, hi0, base0), (lo1, hi1, base1)):
            if hi > lo:
                backward_kernels._finish_rows_kernel[(hi - lo,)](
                    g, qi, w, dqi, dw, lo, base, max(problem.seqlen_q, 1), hi_, g.stride(0), g.stride(1),
                    0 if varlen else qi.stride(0), qi.stride(-3), qi.stride(-2), 0 if varlen else w.stride(0),
                    w.stride(-2),
                    INDEX_DIM=di, BLOCK_H=_pow2(hi_), BLOCK_E=block_e, VARLEN=varlen, num_warps=8)
        if base1 + (hi1 - lo1) < ws_rows:  # a short pair: rows no range finished took a tile's zeros
            g[base1 + (hi1 - lo1):].zero_()  # (NaN where a key is not finite); later ranges read them
    if varlen:  # rows past cu_seqlens[-1] belong to no sequence: gradient 0 whatever qi and w hold
        tail = torch.arange(problem.total_q, device=device) >= problem.cu_seqlens_q[-1]
        dqi.masked_fill_(tail[:, None, None], 0.0)
        dw.masked_fill_(tail[:, None], 0.0)
    return dqi, dki.to(ki.dtype).contiguous(), dw


def forward_with_gradients(problem, q, k, qi, ki, w, lse, topk_indices, grad_rows):
    """(loss_rows, head_lse, index_lse, dqi, dki, dw): the forward and the backward of `grad_rows`
    (the upstream gradient per row, known before the forward: a scalar one spread over the rows by
    a mean or a sum) in two passes over the pairs instead of three: the indexer's lse alone (one
    product per pair), then the backward's pass, which also sums each row's T log T and T z, from
    which the loss follows (KL = sum T log T - sum T z + lse(z) on rows with keys, else 0)."""
    _, head_lse, index_lse = forward(problem, q, k, qi, ki, w, lse, topk_indices, teacher=False)
    rows = problem.total_q if problem.is_varlen else problem.batch * problem.seqlen_q
    sums = torch.zeros((2, rows), dtype=torch.float32, device=q.device)
    dqi, dki, dw = backward(problem, q, k, qi, ki, w, topk_indices, head_lse, index_lse, grad_rows, sums=sums)
    flat_lse = index_lse.reshape(-1)
    loss = torch.where(flat_lse > float("-inf"), sums[0] - sums[1] + flat_lse, 0.0)
    # rows of no sequence (varlen's tail) have index_lse -inf from the forward: loss 0
    loss = torch.where(torch.isnan(flat_lse), float("nan"), loss).view(index_lse.shape)
    return loss, head_lse, index_lse, dqi, dki, dw


def compile_for_hopper(kernel: str, dtype: torch.dtype = torch.bfloat16, dim: int = 128, index_dim: int = 128,
                       causal: bool = True, topk: int = 0, varlen: bool = False, with_gradients: bool = False):
    """One kernel ("lse", "forward", "backward", "finish") compiled for sm_90a without a GPU, at the tile
    sizes `config` picks for a long sequence on an H100 / H200 (`with_gradients`: as
    `forward_with_gradients` runs them); returns the compiled kernel (.asm:
    ptx, cubin; .metadata.shared: its shared memory in bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels, backward_kernels = _kernels(), _backward_kernels()
    fn = {"lse": kernels._topk_lse_kernel if topk else kernels._head_lse_kernel, "forward": kernels._forward_kernel,
          "backward": backward_kernels._backward_kernel, "finish": backward_kernels._finish_rows_kernel}[kernel]

    class _Shape:  # the fields `config` reads
        pass

    shape = _Shape()
    shape.dim, shape.index_dim, shape.dtype, shape.device = dim, index_dim, dtype, torch.device("cpu")
    shape.seqlen_q = shape.seqlen_k = 1 << 15
    shape.topk = topk
    cfg = config(shape, "backward" if kernel == "finish" else kernel)
    element = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    descriptors = {"Q_DESC": (element, "BLOCK_M", "BLOCK_D"), "K_DESC": (element, "BLOCK_N", "BLOCK_D"),
                   "QI_DESC": (element, "BLOCK_M", "BLOCK_E"), "KI_DESC": (element, "BLOCK_N", "BLOCK_E"),
                   "G_DESC": ("fp32", "BLOCK_M", "BLOCK_E"), "DKI_DESC": ("fp32", "BLOCK_N", "BLOCK_E")}
    pointers = {"W": element, "DQI": element, "DW": element, "SEL": "i32", "CU_Q": "i32", "CU_K": "i32",
                "TILES": "u8"}
    constants = dict(BLOCK_D=_pow2(dim), INDEX_DIM=index_dim, BLOCK_E=_pow2(index_dim), BLOCK_H=64, CAUSAL=causal,
                     VARLEN=varlen, TOPK=topk > 0, IEEE=dtype == torch.float32, INTERPRET=False,
                     STEPS_K=max(topk, 1).bit_length(), CHUNK=_chunk(topk), PROGRAM_HEADS=TOPK_LSE_HEADS,
                     BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], TEACHER=not with_gradients, LOSS=with_gradients)
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
    options = {"num_warps": 8 if kernel == "finish" else cfg["num_warps"], "num_stages": cfg["num_stages"]}
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
