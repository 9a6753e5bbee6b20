"""`streamkl.BlockMask`: a per-side block-sparse pattern, stored compressed as FlexAttention does."""

from __future__ import annotations

import math

import torch

_VALID_BLOCKS = (16, 32, 64, 128, 256)


def _check_block_size(block_size) -> tuple[int, int]:
    if isinstance(block_size, int) and not isinstance(block_size, bool):
        block_size = (block_size, block_size)
    if (
        not isinstance(block_size, (tuple, list))
        or len(block_size) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) for b in block_size)
    ):
        raise TypeError(f"BlockMask: `block_size` must be an int or a pair (bq, bk) of ints; got {block_size!r}.")
    bq, bk = int(block_size[0]), int(block_size[1])
    for b in (bq, bk):
        if b not in _VALID_BLOCKS:
            raise ValueError(
                f"BlockMask: `block_size` (bq, bk) must each be a power of two from 16 to 256; got {(bq, bk)}."
            )
    return bq, bk


class BlockMask:
    """Which (query block, key block) pairs one side of the KL may attend to.

    Stored as FlexAttention stores its masks: for each (batch, head, query block) the number of
    allowed key blocks `kv_num_blocks[b, h, i]` and their indices `kv_indices[b, h, i, :]` (the first
    `kv_num_blocks` entries, ascending). Batch and head dims may be 1 to broadcast; for varlen the
    batch dim counts sequences and blocks count from each sequence's start.

    Build one with `BlockMask.from_dense`, `BlockMask.from_topk` or `BlockMask.from_flex`.
    """

    def __init__(
        self, kv_num_blocks: torch.Tensor, kv_indices: torch.Tensor, block_size, num_kv_blocks: int | None = None
    ):
        self.block_size = _check_block_size(block_size)
        for name, t in (("kv_num_blocks", kv_num_blocks), ("kv_indices", kv_indices)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"BlockMask: `{name}` must be an integer torch.Tensor; got {type(t).__name__}.")
            if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
                raise TypeError(f"BlockMask: `{name}` must be an integer tensor; got {t.dtype}.")
        if kv_num_blocks.dim() != 3 or kv_indices.dim() != 4 or kv_indices.shape[:3] != kv_num_blocks.shape:
            raise ValueError(
                "BlockMask: expected kv_num_blocks (B, H, nQ) and kv_indices (B, H, nQ, nK); got "
                f"{tuple(kv_num_blocks.shape)} and {tuple(kv_indices.shape)}."
            )
        if kv_indices.device != kv_num_blocks.device:
            raise ValueError(
                f"BlockMask: `kv_indices` must be on the device of kv_num_blocks ({kv_num_blocks.device}); "
                f"got {kv_indices.device}."
            )
        if num_kv_blocks is not None and (
            isinstance(num_kv_blocks, bool) or not isinstance(num_kv_blocks, int) or num_kv_blocks < 0
        ):
            raise ValueError(f"BlockMask: `num_kv_blocks` must be an int >= 0 or None; got {num_kv_blocks!r}.")
        self.kv_num_blocks = kv_num_blocks.to(torch.int32)
        self.kv_indices = kv_indices.to(torch.int32)
        self.num_kv_blocks = kv_indices.shape[-1] if num_kv_blocks is None else int(num_kv_blocks)
        self._dense: torch.Tensor | None = None

    # ---------------------------------------------------------------- constructors
    @classmethod
    def from_dense(cls, pattern: torch.Tensor, block_size=128) -> BlockMask:
        """From a boolean block pattern of shape (B or 1, H or 1, num_q_blocks, num_kv_blocks)."""
        if not isinstance(pattern, torch.Tensor):
            raise TypeError(f"BlockMask.from_dense: `pattern` must be a torch.Tensor; got {type(pattern).__name__}.")
        _check_block_size(block_size)  # before any work on the pattern
        if pattern.dim() == 2:
            pattern = pattern[None, None]
        if pattern.dim() != 4:
            raise ValueError(
                "BlockMask.from_dense: `pattern` must be (B or 1, H or 1, num_q_blocks, num_kv_blocks) or "
                f"(num_q_blocks, num_kv_blocks); got shape {tuple(pattern.shape)}."
            )
        if pattern.dtype.is_floating_point or pattern.dtype.is_complex:
            raise TypeError(f"BlockMask.from_dense: `pattern` must be boolean; got {pattern.dtype}.")
        pattern = pattern.bool()
        kv_num_blocks = pattern.sum(-1, dtype=torch.int32)
        kv_indices = torch.argsort((~pattern).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        mask = cls(kv_num_blocks, kv_indices, block_size, pattern.shape[-1])
        mask._dense = pattern
        return mask

    @classmethod
    def from_topk(
        cls,
        block_scores: torch.Tensor,
        topk: int,
        block_size=64,
        *,
        causal: bool = False,
        keep_diagonal: bool = True,
        seqlen_q: int | None = None,
        seqlen_k: int | None = None,
    ) -> BlockMask:
        """Keep the `topk` highest-scoring key blocks of each query block (MoBA / NSA / DSA selection).

        block_scores: float (B, H, num_q_blocks, num_kv_blocks), e.g. pooled queries against pooled keys.
        causal: never select a key block that lies wholly after the query block (bottom-right
            aligned for `seqlen_q != seqlen_k`, which default to the blocks' extents).
        keep_diagonal: always keep the key block holding the query block's last causally visible
            key (the "current" block), on top of the `topk` selected.
        """
        if not isinstance(block_scores, torch.Tensor) or block_scores.dim() != 4:
            is_tensor = isinstance(block_scores, torch.Tensor)
            got = f"shape {tuple(block_scores.shape)}" if is_tensor else type(block_scores).__name__
            raise ValueError(f"BlockMask.from_topk: `block_scores` must be a 4-D tensor (B, H, nQ, nK); got {got}.")
        if block_scores.dtype.is_complex:
            raise TypeError(f"BlockMask.from_topk: `block_scores` must be real; got {block_scores.dtype}.")
        if isinstance(topk, bool) or not isinstance(topk, int) or topk < 0:
            raise ValueError(f"BlockMask.from_topk: `topk` must be an int >= 0; got {topk!r}.")
        for name, flag in (("causal", causal), ("keep_diagonal", keep_diagonal)):
            if not isinstance(flag, bool):
                raise TypeError(f"BlockMask.from_topk: `{name}` must be a bool; got {type(flag).__name__}.")
        for name, length in (("seqlen_q", seqlen_q), ("seqlen_k", seqlen_k)):
            if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 0):
                raise ValueError(f"BlockMask.from_topk: `{name}` must be an int >= 0 or None; got {length!r}.")
        bq, bk = _check_block_size(block_size)
        n_q, n_k = block_scores.shape[-2:]
        seqlen_q = n_q * bq if seqlen_q is None else seqlen_q
        seqlen_k = n_k * bk if seqlen_k is None else seqlen_k
        if math.ceil(seqlen_q / bq) != n_q or math.ceil(seqlen_k / bk) != n_k:
            raise ValueError(
                f"BlockMask.from_topk: `block_scores` must have ceil(seqlen_q / bq) x ceil(seqlen_k / bk) = "
                f"{math.ceil(seqlen_q / bq)}x{math.ceil(seqlen_k / bk)} blocks for {seqlen_q} queries x {seqlen_k} "
                f"keys with blocks {(bq, bk)}; got {n_q}x{n_k}."
            )
        device = block_scores.device
        scores = block_scores.float()
        # last key each query block may see under causality (bottom-right aligned)
        q_last = torch.clamp(torch.arange(1, n_q + 1, device=device) * bq, max=seqlen_q) - 1
        diag = torch.clamp(q_last + seqlen_k - seqlen_q, min=-1) // bk  # [nQ], -1: sees nothing
        k_block = torch.arange(n_k, device=device)
        if causal:
            allowed = k_block[None, :] <= diag[:, None]  # [nQ, nK]
            scores = scores.masked_fill(~allowed, float("-inf"))
        k = min(topk, n_k)
        pattern = torch.zeros(scores.shape, dtype=torch.bool, device=device)
        if k > 0:
            top = scores.topk(k, dim=-1)
            pattern.scatter_(-1, top.indices, top.values > float("-inf"))
        if keep_diagonal:
            has_diag = diag >= 0
            diag_pattern = (k_block[None, :] == diag[:, None]) & has_diag[:, None]
            pattern |= diag_pattern
        return cls.from_dense(pattern, (bq, bk))

    @classmethod
    def from_flex(cls, flex_block_mask) -> BlockMask:
        """From a PyTorch FlexAttention `BlockMask` (torch.nn.attention.flex_attention).

        Every block FlexAttention would visit (full or partial) is allowed; use a block-aligned
        `mask_mod` for the two to select exactly the same keys."""
        if not hasattr(flex_block_mask, "to_dense") or not hasattr(flex_block_mask, "BLOCK_SIZE"):
            raise TypeError(
                "BlockMask.from_flex: `flex_block_mask` must be a torch.nn.attention.flex_attention.BlockMask; "
                f"got {type(flex_block_mask).__name__}."
            )
        pattern = flex_block_mask.to_dense().bool()
        seq_lengths = getattr(flex_block_mask, "seq_lengths", None)
        bq, bk = (int(b) for b in flex_block_mask.BLOCK_SIZE)
        if seq_lengths is not None:
            n_q, n_k = math.ceil(seq_lengths[0] / bq), math.ceil(seq_lengths[1] / bk)
            pattern = pattern[..., :n_q, :n_k]
        return cls.from_dense(pattern, (bq, bk))

    # ---------------------------------------------------------------- views
    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, n_q = self.kv_num_blocks.shape
        return (b, h, n_q, self.num_kv_blocks)

    @property
    def device(self) -> torch.device:
        return self.kv_num_blocks.device

    def to_dense(self) -> torch.Tensor:
        """The boolean block pattern (B or 1, H or 1, num_q_blocks, num_kv_blocks)."""
        if self._dense is None:
            self._check_compressed_values()
            b, h, n_q, n_k = self.shape
            slots = torch.arange(self.kv_indices.shape[-1], device=self.device)
            used = slots < self.kv_num_blocks[..., None]
            counts = torch.zeros((b, h, n_q, n_k), dtype=torch.int32, device=self.device)
            index = torch.where(used, self.kv_indices, 0).long()
            dense = counts.scatter_add_(-1, index, used.to(torch.int32)) > 0  # unused slots add 0
            self._dense = dense
        return self._dense

    def _check_compressed_values(self) -> None:
        """Counts within [0, slots] and used indices within [0, num_kv_blocks): checked once, when the
        dense pattern is first built from parts given to the constructor (one host sync)."""
        slots = self.kv_indices.shape[-1]
        if self.kv_num_blocks.numel() == 0:
            return
        low, high = int(self.kv_num_blocks.min()), int(self.kv_num_blocks.max())
        if low < 0 or high > slots:
            raise ValueError(
                f"BlockMask: `kv_num_blocks` entries must lie in [0, {slots}] (the kv_indices slots); "
                f"got values in [{low}, {high}]."
            )
        used = torch.arange(slots, device=self.device) < self.kv_num_blocks[..., None]
        if bool(used.any()):
            picked = self.kv_indices[used]
            low, high = int(picked.min()), int(picked.max())
            if low < 0 or high >= self.num_kv_blocks:
                raise ValueError(
                    f"BlockMask: used `kv_indices` must lie in [0, {self.num_kv_blocks - 1}] "
                    f"(num_kv_blocks={self.num_kv_blocks}); got values in [{low}, {high}]."
                )

    def sparsity(self) -> float:
        """Percentage of blocks that are masked out, as FlexAttention reports it."""
        total = self.to_dense().numel()
        return 100.0 * (1.0 - self.to_dense().sum().item() / total) if total else 0.0

    def to(self, device) -> BlockMask:
        mask = BlockMask(self.kv_num_blocks.to(device), self.kv_indices.to(device), self.block_size, self.num_kv_blocks)
        if self._dense is not None:
            mask._dense = self._dense.to(device)
        return mask

    def __repr__(self) -> str:
        b, h, n_q, n_k = self.shape
        return (
            f"BlockMask(shape=(B={b}, H={h}, q_blocks={n_q}, kv_blocks={n_k}), block_size={self.block_size}, "
            f"sparsity={self.sparsity():.2f}%)"
        )
