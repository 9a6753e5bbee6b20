"""`streamkl.distributed.kl`: the KL of one sequence whose tokens are sharded over a process group."""

from __future__ import annotations

import torch
import torch.distributed as dist

from streamkl.dispatch import choose_backend, requested_backend
from streamkl.distributed.ring import Ring, device_reasons, float_bits, metadata_device, resolve_group
from streamkl.distributed.ring_kl import RingKL, RingSetup, ring_forward
from streamkl.problem import REDUCTIONS, build_problem, check_output_options

_PREFIX = "streamkl.distributed.kl:"
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: the agreement row: what every rank must share (`_agree`), after "refused" and "length"
_SHARED = ("batch", "heads", "heads_k1", "heads_k2", "dim1", "dim2", "dtype", "causal", "reduction", "return_lse",
           "q1 requires grad", "k1 requires grad", "q2 requires grad", "k2 requires grad", "deterministic",
           "scale1", "scale2")


def kl(
    q1: torch.Tensor,
    k1: torch.Tensor,
    q2: torch.Tensor,
    k2: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    scale1: float | None = None,
    scale2: float | None = None,
    causal: bool = False,
    reduction: str = "mean",
    return_lse: bool = False,
    deterministic: bool = False,
    backend: str | None = None,
    window: tuple[int, int] = (-1, -1),
    cu_seqlens: torch.Tensor | None = None,
    mask1: object = None,
    mask2: object = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`streamkl.kl` of one sequence whose tokens are sharded over the ranks of `group`.

    Every rank passes its shard of the four inputs (the same token positions on all four) and gets
    what `streamkl.kl` on the whole sequence gives for its rows; gradients reach its shard. The key
    shards travel round the ring; query rows and their statistics stay home. Collective: every
    rank of the group calls it with the same options, and every rank runs the backward.

    Args:
        q1, k1, q2, k2: this rank's shards, (B, n, H, D1), (B, n, H1k, D1), (B, n, H, D2),
            (B, n, H2k, D2), as for `streamkl.kl` with Nq = Nk = n. Dense: any partition of the
            sequence's tokens (shard lengths may differ). Causal: the load-balanced layout of
            `shard(x, causal=True)`: one even length n on every rank, rank r holding chunks r and
            2P - 1 - r of the sequence's 2P chunks.
        group: the process group (None: the default group). gloo for CPU tensors, NCCL for CUDA.
        scale1, scale2, causal, deterministic, backend: as `streamkl.kl`.
        reduction: "none" (this rank's rows, (B, n, H)), "sum" or "mean" over the whole sequence
            (the same scalar on every rank). A rank's backward of the scalar sends the upstream
            gradient to its own rows, so when every rank backpropagates the loss it returns, each
            shard gets the gradient of the global loss (do not sum the losses across ranks).
        return_lse: also return this rank's rows' lse1, lse2, (B, H, n).
        window, cu_seqlens, mask1, mask2: not supported in context parallel; only their defaults
            are taken.

    Raises:
        TypeError, ValueError: a wrong argument (as `streamkl.kl`), an unsupported option, or
            inputs that disagree across ranks. Argument errors raise before any communication;
            errors in one rank's tensors raise on every rank after one small collective, before
            any key moves (no rank is left waiting).
    """
    _refuse_unsupported(window, cu_seqlens, mask1, mask2)
    _rethrow(check_output_options, reduction, return_lse)
    backend_name = _rethrow(requested_backend, backend)
    group = resolve_group(group, "kl")
    ring = Ring.of(group)
    grad_on = torch.is_grad_enabled()
    row, problem, impl, error = _local_checks(q1, k1, q2, k2, group, scale1, scale2, causal, deterministic,
                                               backend_name, reduction, return_lse, grad_on)
    lengths = _agree(ring, group, row, error)
    setup = RingSetup(ring=ring, impl=impl, lengths=tuple(lengths), batch=problem.batch, heads_k1=problem.heads_k1,
                      heads_k2=problem.heads_k2, dim1=problem.dim1, dim2=problem.dim2, dtype=problem.dtype,
                      scale1=problem.scale1, scale2=problem.scale2, causal=problem.causal,
                      deterministic=problem.deterministic)
    if grad_on and any(t.requires_grad for t in (q1, k1, q2, k2)):
        kl_rows, lse1, lse2 = RingKL.apply(setup, q1, k1, q2, k2)
    else:
        with torch.no_grad():
            stats = ring_forward(setup, q1, k1, q2, k2)
        kl_rows, lse1, lse2 = stats.rows(), stats.lse1.contiguous(), stats.lse2.contiguous()
    if reduction == "none":
        out = kl_rows
    else:
        out = _GlobalSum.apply(kl_rows.sum(), ring)
        if reduction == "mean":  # every row of a dense or causal sequence sees at least one key
            out = out / max(problem.batch * problem.heads * sum(lengths), 1)
    if return_lse:
        return out, lse1, lse2
    return out


class _GlobalSum(torch.autograd.Function):
    """The sum over the group of each rank's scalar; the backward sends the upstream gradient to
    this rank's own term only (each rank backpropagates its own rows: see `kl`'s `reduction`)."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, ring: Ring):
        total = value.clone()
        if ring.size > 1:
            dist.all_reduce(total, group=ring.group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _refuse_unsupported(window, cu_seqlens, mask1, mask2) -> None:
    given = []
    if not (isinstance(window, (tuple, list)) and tuple(window) == (-1, -1)):
        given.append(f"window={window!r}")
    for name, value in (("cu_seqlens", cu_seqlens), ("mask1", mask1), ("mask2", mask2)):
        if value is not None:
            given.append(f"{name}={type(value).__name__}")
    if given:
        raise ValueError(f"{_PREFIX} context parallel supports dense and causal attention over one sequence per "
                         f"batch row; window, cu_seqlens (packed sequences) and block masks are not supported; got "
                         f"{', '.join(given)}.")


def _rethrow(function, *args, **kwargs):
    """Call a `streamkl.kl` check, its messages naming this function."""
    try:
        return function(*args, **kwargs)
    except (TypeError, ValueError) as error:
        raise type(error)(str(error).replace("streamkl.kl:", _PREFIX, 1)) from None


def _local_checks(q1, k1, q2, k2, group, scale1, scale2, causal, deterministic, backend_name, reduction,
                  return_lse, grad_on):
    """(agreement row, problem, backend, error): this rank's inputs checked without communicating;
    `error` is the exception to raise (after the agreement step), or None."""
    try:
        problem = _rethrow(build_problem, q1, k1, q2, k2, scale1=scale1, scale2=scale2, causal=causal,
                           deterministic=deterministic, check_values=False)
        if k1.shape[1] != q1.shape[1]:
            raise ValueError(f"{_PREFIX} `k1` must be the key shard of q1's tokens, of the same length "
                             f"{q1.shape[1]}; got length {k1.shape[1]}.")
        if problem.causal and problem.seqlen_q % 2 != 0:
            raise ValueError(f"{_PREFIX} `q1` must hold two chunks of equal length for causal=True (the "
                             f"load-balanced layout of streamkl.distributed.shard); got shard length "
                             f"{problem.seqlen_q}.")
        reasons = device_reasons(group, problem.device)
        if reasons:
            raise ValueError(f"{_PREFIX} `group` must communicate the inputs' device: {'; '.join(reasons)}.")
        impl = _rethrow(choose_backend, problem, backend_name)
    except (TypeError, ValueError) as error:
        return None, None, None, error
    needs = [int(grad_on and t.requires_grad) for t in (q1, k1, q2, k2)]
    row = [0, problem.seqlen_q, problem.batch, problem.heads, problem.heads_k1, problem.heads_k2, problem.dim1,
           problem.dim2, _DTYPES.index(problem.dtype), int(problem.causal), REDUCTIONS.index(reduction),
           int(return_lse), *needs, int(problem.deterministic), float_bits(problem.scale1),
           float_bits(problem.scale2)]
    return row, problem, impl, None


def _agree(ring: Ring, group, row: list[int] | None, error: Exception | None) -> list[int]:
    """Every rank's shard length, once every rank's inputs passed their checks and agree on what
    they must share; otherwise every rank raises (one small collective, one host read)."""
    if ring.size == 1:
        if error is not None:
            raise error
        return [row[1]]
    mine = row if row is not None else [1] + [0] * (len(_SHARED) + 1)
    rows = ring.all_gather_rows(mine, metadata_device(group))
    if error is not None:
        raise error
    refused = [rank for rank, other in enumerate(rows) if other[0]]
    if refused:
        raise ValueError(f"{_PREFIX} rank(s) {refused} of the group refused their inputs (their error says why); "
                         "nothing was computed.")
    for index, name in enumerate(_SHARED):
        values = [other[2 + index] for other in rows]
        if len(set(values)) > 1:
            if name == "dtype":
                values = [_DTYPES[v] for v in values]
            raise ValueError(f"{_PREFIX} every rank must pass the same {name}; got {values} on ranks "
                             f"0..{ring.size - 1}.")
    lengths = [other[1] for other in rows]
    if row[9] and len(set(lengths)) > 1:  # causal
        raise ValueError(f"{_PREFIX} causal=True needs one shard length on every rank (the load-balanced layout "
                         f"of streamkl.distributed.shard); got lengths {lengths}.")
    return lengths
