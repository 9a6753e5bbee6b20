"""Helpers around packed (varlen) sequences: padded <-> packed, in FlashAttention's convention."""

from __future__ import annotations

import torch


def pack(x: torch.Tensor, keep: torch.Tensor):
    """Pack padded `x` (B, N, ...) into (T, ...) keeping the tokens where `keep` (B, N) is True.

    Returns `(packed, cu_seqlens, max_seqlen)`: `cu_seqlens` int32 (B+1,) on x's device,
    `max_seqlen` a Python int (one host sync). Tokens keep their order within each sequence.
    """
    if keep.dtype != torch.bool or keep.shape != x.shape[:2]:
        raise ValueError(
            f"streamkl.varlen.pack: `keep` must be a bool tensor of shape {tuple(x.shape[:2])}; "
            f"got {keep.dtype} {tuple(keep.shape)}."
        )
    lengths = keep.sum(1, dtype=torch.int32)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=x.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    max_seqlen = int(lengths.max().item()) if lengths.numel() else 0
    return x[keep], cu_seqlens, max_seqlen


def unpack(packed: torch.Tensor, keep: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Inverse of `pack` for per-token results: (T, ...) -> (B, N, ...), `fill` at padding."""
    out = packed.new_full((*keep.shape, *packed.shape[1:]), fill)
    out[keep] = packed
    return out


def cu_seqlens_from_lengths(lengths, device=None) -> torch.Tensor:
    """int32 cumulative lengths (S+1,) from a list or tensor of sequence lengths."""
    lengths = torch.as_tensor(lengths, dtype=torch.int32, device=device)
    cu_seqlens = torch.zeros(lengths.numel() + 1, dtype=torch.int32, device=lengths.device)
    cu_seqlens[1:] = torch.cumsum(lengths, 0)
    return cu_seqlens
