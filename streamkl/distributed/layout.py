"""How a sequence's tokens are laid out over the ranks, and the helpers that shard and gather.

Two layouts of a length-N sequence over P ranks:

- contiguous (`causal=False`): rank r holds tokens [start_r, start_r + n_r), the split of
  `torch.tensor_split` (the first N % P ranks hold one token more). Without a causal mask the KL
  does not depend on where the keys sit, so the dense `kl` takes any partition of the tokens,
  this one or the load-balanced one.
- load-balanced (`causal=True`): the sequence is cut into 2P chunks of N / (2P) tokens; rank r
  holds chunk r followed by chunk 2P - 1 - r. Every rank then has the same causal work.
"""

from __future__ import annotations

import zlib

import torch
import torch.distributed as dist

from streamkl.distributed.ring import Ring, _fail, device_reasons, resolve_group

_MAX_DIMS = 8


def _check_int(function: str, name: str, value: object, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        _fail(function, name, "a Python int", type(value).__name__, TypeError)
    if value < minimum:
        _fail(function, name, f">= {minimum}", value)
    return value


def _check_causal(function: str, causal: object) -> bool:
    if not isinstance(causal, bool):
        _fail(function, "causal", "a bool", type(causal).__name__, TypeError)
    return causal


def _spans(seqlen: int, rank: int, size: int, causal: bool, function: str) -> list[tuple[int, int]]:
    """(start, length) of each piece of `rank`'s shard, in the shard's order."""
    if causal:
        if seqlen % (2 * size) != 0:
            _fail(function, "x" if function != "shard_indices" else "seqlen",
                  f"of a length divisible by 2 * world size = {2 * size} for the load-balanced causal layout "
                  f"(pad the sequence)", seqlen)
        chunk = seqlen // (2 * size)
        return [(rank * chunk, chunk), ((2 * size - 1 - rank) * chunk, chunk)]
    base, extra = divmod(seqlen, size)
    return [(rank * base + min(rank, extra), base + (1 if rank < extra else 0))]


def shard_indices(
    seqlen: int, group: dist.ProcessGroup | None = None, *, causal: bool = False,
    device: torch.device | str | None = None,
) -> torch.Tensor:
    """The global token positions of this rank's shard, int64 (n,), in the shard's order: the
    positions to give rotary embeddings or position ids. No communication."""
    seqlen = _check_int("shard_indices", "seqlen", seqlen, 0)
    causal = _check_causal("shard_indices", causal)
    group = resolve_group(group, "shard_indices")
    spans = _spans(seqlen, dist.get_rank(group), dist.get_world_size(group), causal, "shard_indices")
    return torch.cat([torch.arange(start, start + length, device=device) for start, length in spans])


def _check_dim(function: str, x: object, dim: object) -> int:
    if not isinstance(x, torch.Tensor):
        _fail(function, "x", "a torch.Tensor", type(x).__name__, TypeError)
    if isinstance(dim, bool) or not isinstance(dim, int):
        _fail(function, "dim", "a Python int", type(dim).__name__, TypeError)
    if not -x.dim() <= dim < x.dim():
        _fail(function, "dim", f"a dimension of x (x has {x.dim()})", dim)
    return dim % x.dim()


def shard(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 1, causal: bool = False
) -> torch.Tensor:
    """This rank's shard of the full sequence `x` along `dim` (every rank passes the same `x`).

    `causal=False`: the contiguous layout (a view); `causal=True`: the load-balanced layout that
    `kl(..., causal=True)` expects (a copy; the length must be divisible by 2 * world size).
    Differentiable. No communication."""
    dim = _check_dim("shard", x, dim)
    causal = _check_causal("shard", causal)
    group = resolve_group(group, "shard")
    spans = _spans(x.shape[dim], dist.get_rank(group), dist.get_world_size(group), causal, "shard")
    pieces = [x.narrow(dim, start, length) for start, length in spans]
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _dtype_code(dtype: torch.dtype) -> int:
    return zlib.crc32(str(dtype).encode())


def gather(
    x: torch.Tensor, group: dist.ProcessGroup | None = None, *, dim: int = 1, causal: bool = False
) -> torch.Tensor:
    """The full sequence from every rank's shard `x` along `dim`: the inverse of `shard`, on every
    rank. Shards may differ in length along `dim` in the contiguous layout; all other dims, the
    dtype and the device kind must agree. Collective (every rank calls it); not differentiable
    (the result carries no autograd history).

    `gather(out, dim=1)` assembles `kl(..., reduction="none")`'s rows, `gather(lse, dim=2)` its lse."""
    dim = _check_dim("gather", x, dim)
    causal = _check_causal("gather", causal)
    group = resolve_group(group, "gather")
    if x.dim() > _MAX_DIMS:
        _fail("gather", "x", f"a tensor of at most {_MAX_DIMS} dimensions", x.dim())
    reasons = device_reasons(group, x.device)
    if reasons:
        _fail("gather", "x", "on a device the group can communicate", "; ".join(reasons))
    ring = Ring.of(group)
    shape = list(x.shape)
    row = [x.dim(), _dtype_code(x.dtype)] + shape + [-1] * (_MAX_DIMS - x.dim())
    rows = ring.all_gather_rows(row, x.device)
    for rank, other in enumerate(rows):
        other_shape = other[2 : 2 + other[0]]
        rest_ok = other[0] == x.dim() and all(a == b for i, (a, b) in enumerate(zip(other_shape, shape)) if i != dim)
        if not rest_ok or other[1] != row[1]:
            _fail("gather", "x", f"of the same dtype and shape (but for dim {dim}) on every rank",
                  f"{tuple(shape)} {x.dtype} here, shape {tuple(other_shape)} on rank {rank}")
    lengths = [other[2 + dim] for other in rows]
    if causal and (len(set(lengths)) != 1 or lengths[0] % 2 != 0):
        _fail("gather", "x", "of one even length along dim on every rank for the load-balanced causal layout",
              f"lengths {lengths}")
    longest = max(lengths)
    padded = x.detach()
    if x.shape[dim] < longest:
        pad_shape = list(shape)
        pad_shape[dim] = longest - x.shape[dim]
        padded = torch.cat([padded, padded.new_zeros(pad_shape)], dim)
    padded = padded.contiguous()
    parts = [torch.empty_like(padded) for _ in range(ring.size)]
    dist.all_gather(parts, padded, group=group)
    parts = [part.narrow(dim, 0, length) for part, length in zip(parts, lengths)]
    if not causal:
        return torch.cat(parts, dim)
    half = lengths[0] // 2
    early = [part.narrow(dim, 0, half) for part in parts]  # chunk r of rank r
    late = [part.narrow(dim, half, half) for part in reversed(parts)]  # chunk 2P - 1 - r, ascending
    return torch.cat(early + late, dim)
