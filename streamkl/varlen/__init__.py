"""Helpers around packed (varlen) sequences: padded <-> packed, in FlashAttention's convention."""

from __future__ import annotations

import torch

__all__ = ["pack", "unpack", "cu_seqlens_from_lengths"]


def _check_keep(keep: torch.Tensor, name: str = "keep") -> None:
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.dim() != 2:
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"streamkl.varlen: `{name}` must be a 2-D bool tensor (B, N); got {got}.")


def pack(keep: torch.Tensor, *tensors: torch.Tensor, max_seqlen: int | None = None) -> tuple:
    """Pack padded tensors (B, N, ...) into (T, ...), keeping the tokens where `keep` (B, N) is True.

    Args:
        keep: bool (B, N), True on real tokens. Tokens keep their order within each sequence.
        *tensors: one or more tensors of shape (B, N, ...) on `keep`'s device (e.g. q1, k1, q2, k2),
            all packed with the same index.
        max_seqlen: the longest sequence's length, if known. Given, `pack` reads nothing on the host
            beyond the packed length; omitted, it is computed with one host sync.

    Returns:
        `(*packed, cu_seqlens, max_seqlen)`: each packed tensor (T, ...), `cu_seqlens` int32 (B+1,)
        on `keep`'s device, `max_seqlen` an int. `pack(x, keep)`, the one-tensor form of
        streamkl 0.1, is still accepted and returns `(packed, cu_seqlens, max_seqlen)`.
    """
    if (len(tensors) == 1 and isinstance(keep, torch.Tensor) and keep.dtype != torch.bool
            and isinstance(tensors[0], torch.Tensor) and tensors[0].dtype == torch.bool and tensors[0].dim() == 2):
        keep, tensors = tensors[0], (keep,)  # the 0.1 argument order: pack(x, keep)
    _check_keep(keep)
    if not tensors:
        raise TypeError("streamkl.varlen.pack: give at least one tensor to pack after `keep`.")
    for i, t in enumerate(tensors):
        if not isinstance(t, torch.Tensor) or t.dim() < 2 or tuple(t.shape[:2]) != tuple(keep.shape):
            got = tuple(t.shape) if isinstance(t, torch.Tensor) else type(t).__name__
            raise ValueError(
                f"streamkl.varlen.pack: tensor {i} must have shape (B, N, ...) = {tuple(keep.shape)} + ...; got {got}."
            )
        if t.device != keep.device:
            raise ValueError(f"streamkl.varlen.pack: tensor {i} is on {t.device}, `keep` on {keep.device}.")
    if max_seqlen is not None and (isinstance(max_seqlen, bool) or not isinstance(max_seqlen, int) or max_seqlen < 0):
        raise ValueError(f"streamkl.varlen.pack: `max_seqlen` must be a non-negative int or None; got {max_seqlen!r}.")
    lengths = keep.sum(1, dtype=torch.int32)
    cu_seqlens = torch.nn.functional.pad(torch.cumsum(lengths, 0, dtype=torch.int32), (1, 0))
    if max_seqlen is None:
        max_seqlen = int(lengths.max()) if lengths.numel() else 0  # the one host sync
    # one index for every tensor: the packed length is read once, whatever the number of tensors
    batch_index, token_index = keep.nonzero(as_tuple=True)
    packed = tuple(t[batch_index, token_index] for t in tensors)
    return (*packed, cu_seqlens, max_seqlen)


def unpack(packed: torch.Tensor, keep: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Inverse of `pack` for per-token results: (T, ...) -> (B, N, ...), `fill` at padding."""
    _check_keep(keep)
    out = packed.new_full((*keep.shape, *packed.shape[1:]), fill)
    out[keep] = packed
    return out


def cu_seqlens_from_lengths(lengths, device: torch.device | str | None = None) -> torch.Tensor:
    """int32 cumulative lengths (S+1,) from a list or tensor of sequence lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return cu_seqlens
