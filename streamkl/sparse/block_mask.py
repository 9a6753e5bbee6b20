"""`streamkl.BlockMask`: a per-side block-sparse pattern, stored compressed as FlexAttention does."""

from __future__ import annotations

import math
from typing import Any

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
        self._kv_num_blocks = kv_num_blocks.to(torch.int32)
        self._kv_indices = kv_indices.to(torch.int32)
        self.num_kv_blocks = kv_indices.shape[-1] if num_kv_blocks is None else int(num_kv_blocks)
        # The source of truth is either the compressed parts (this constructor) or the dense pattern
        # (`from_dense`); the other form is derived and rebuilt when the source's versions move, so a
        # tensor changed in place is never served stale.
        self._dense: torch.Tensor | None = None
        self._dense_is_source = False
        self._derived_from: tuple | None = None  # `_source_state()` when the derived form was built
        #: (left, right) of the element mask a Flex `mask_mod` applies on partial blocks, as the
        #: call's `causal` / `window` must give it, and the (Nq, Nk) it was read for; None: none.
        self.element_window: tuple[int, int] | None = None
        self.element_seqlens: tuple[int, int] | None = None

    def _source_state(self) -> tuple:
        """(id, version) of each tensor the mask's pattern comes from: a key for caches."""
        if self._dense_is_source:
            return ((id(self._dense), self._dense._version),)
        return ((id(self._kv_num_blocks), self._kv_num_blocks._version),
                (id(self._kv_indices), self._kv_indices._version))

    @property
    def kv_num_blocks(self) -> torch.Tensor:
        """int32 (B, H, num_q_blocks): how many key blocks each query block may attend to."""
        self._compress()
        return self._kv_num_blocks

    @property
    def kv_indices(self) -> torch.Tensor:
        """int32 (B, H, num_q_blocks, slots): the allowed key blocks, first `kv_num_blocks` of each row."""
        self._compress()
        return self._kv_indices

    def _compress(self) -> None:
        if self._dense_is_source and self._derived_from != self._source_state():
            pattern = self._dense
            self._kv_num_blocks = pattern.sum(-1, dtype=torch.int32)
            self._kv_indices = torch.argsort((~pattern).to(torch.int8), dim=-1, stable=True).to(torch.int32)
            self._derived_from = self._source_state()

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
        pattern = pattern.bool()  # (a bool pattern is kept as is: changing it in place changes the mask)
        kv_num_blocks = pattern.sum(-1, dtype=torch.int32)
        kv_indices = torch.argsort((~pattern).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        mask = cls(kv_num_blocks, kv_indices, block_size, pattern.shape[-1])
        mask._dense, mask._dense_is_source = pattern, True
        mask._derived_from = mask._source_state()
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
    def from_flex(cls, flex_block_mask: Any) -> BlockMask:
        """From a PyTorch FlexAttention `BlockMask` (torch.nn.attention.flex_attention).

        Every block FlexAttention visits (full or partial) is allowed. Its `mask_mod` is read on the
        partial blocks: where it is a causal or sliding-window mask (bottom-right aligned as
        `streamkl.kl` reads `causal` and `window`; Flex's `q_idx >= kv_idx` is causal for equal
        lengths), the mask records it (`element_window`) and `streamkl.kl` requires the matching
        `causal` / `window` argument; any other element mask is refused. Blocks larger than 256
        (powers of two) are split into 256-blocks.

        Raises:
            TypeError: not a FlexAttention BlockMask.
            ValueError: a `mask_mod` that `causal` / `window` cannot express, or a block size
                that is not a power of two from 16.
        """
        if not hasattr(flex_block_mask, "to_dense") or not hasattr(flex_block_mask, "BLOCK_SIZE"):
            raise TypeError(
                "BlockMask.from_flex: `flex_block_mask` must be a torch.nn.attention.flex_attention.BlockMask; "
                f"got {type(flex_block_mask).__name__}."
            )
        bq, bk = (int(b) for b in flex_block_mask.BLOCK_SIZE)
        pattern = flex_block_mask.to_dense().bool()
        seq_lengths = getattr(flex_block_mask, "seq_lengths", None)
        if seq_lengths is None:
            seq_lengths = (pattern.shape[-2] * bq, pattern.shape[-1] * bk)
        seqlen_q, seqlen_k = int(seq_lengths[0]), int(seq_lengths[1])
        n_q, n_k = math.ceil(seqlen_q / bq), math.ceil(seqlen_k / bk)
        pattern = pattern[..., :n_q, :n_k]
        window = _flex_element_window(flex_block_mask, pattern, (bq, bk), seqlen_q, seqlen_k)
        split = []
        for block in (bq, bk):
            if block > _VALID_BLOCKS[-1] and block & (block - 1) == 0:
                split.append((block // _VALID_BLOCKS[-1], _VALID_BLOCKS[-1]))
            else:
                split.append((1, block))
        (repeat_q, bq), (repeat_k, bk) = split
        if repeat_q > 1:
            pattern = pattern.repeat_interleave(repeat_q, dim=-2)[..., : math.ceil(seqlen_q / bq), :]
        if repeat_k > 1:
            pattern = pattern.repeat_interleave(repeat_k, dim=-1)[..., : math.ceil(seqlen_k / bk)]
        mask = cls.from_dense(pattern.contiguous(), (bq, bk))
        if window is not None:
            mask.element_window, mask.element_seqlens = window, (seqlen_q, seqlen_k)
        return mask

    # ---------------------------------------------------------------- views
    @property
    def shape(self) -> tuple[int, int, int, int]:
        b, h, n_q = self._kv_num_blocks.shape
        return (b, h, n_q, self.num_kv_blocks)

    @property
    def device(self) -> torch.device:
        return self._kv_num_blocks.device

    def to_dense(self) -> torch.Tensor:
        """The boolean block pattern (B or 1, H or 1, num_q_blocks, num_kv_blocks)."""
        if self._dense_is_source:
            return self._dense
        if self._dense is None or self._derived_from != self._source_state():
            self._check_compressed_values()
            b, h, n_q, n_k = self.shape
            slots = torch.arange(self.kv_indices.shape[-1], device=self.device)
            used = slots < self.kv_num_blocks[..., None]
            counts = torch.zeros((b, h, n_q, n_k), dtype=torch.int32, device=self.device)
            index = torch.where(used, self.kv_indices, 0).long()
            dense = counts.scatter_add_(-1, index, used.to(torch.int32)) > 0  # unused slots add 0
            self._dense, self._derived_from = dense, self._source_state()
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

    def to(self, device: torch.device | str) -> BlockMask:
        """The same mask on another device."""
        if self._dense_is_source:
            mask = BlockMask.from_dense(self._dense.to(device), self.block_size)
        else:
            mask = BlockMask(self._kv_num_blocks.to(device), self._kv_indices.to(device), self.block_size,
                             self.num_kv_blocks)
        mask.element_window, mask.element_seqlens = self.element_window, self.element_seqlens
        return mask

    def __repr__(self) -> str:
        b, h, n_q, n_k = self.shape
        return (
            f"BlockMask(shape=(B={b}, H={h}, q_blocks={n_q}, kv_blocks={n_k}), block_size={self.block_size}, "
            f"sparsity={self.sparsity():.2f}%)"
        )


def _compressed_pattern(num_blocks: torch.Tensor | None, indices: torch.Tensor | None, shape) -> torch.Tensor:
    """Dense bool (B, H, nQ, nK) of FlexAttention's compressed (num_blocks, indices); all False if None."""
    dense = torch.zeros(shape, dtype=torch.bool, device=None if num_blocks is None else num_blocks.device)
    if num_blocks is None or indices is None:
        return dense
    slots = torch.arange(indices.shape[-1], device=indices.device)
    used = slots < num_blocks[..., None].long()
    index = torch.where(used, indices.long(), 0).clamp_(max=shape[-1] - 1)
    counts = torch.zeros(shape, dtype=torch.int32, device=indices.device)
    return counts.scatter_add_(-1, index, used.to(torch.int32)) > 0


def _flex_element_window(flex, pattern: torch.Tensor, blocks: tuple[int, int], seqlen_q: int, seqlen_k: int):
    """The (left, right) window (-1 unbounded) that the Flex mask's `mask_mod` applies on its partial
    blocks, bottom-right aligned, or None where it allows every element of them (block-aligned).

    Raises ValueError where no window does: the mask_mod is not causal / sliding-window."""
    mask_mod = getattr(flex, "mask_mod", None)
    bq, bk = blocks
    n_q, n_k = pattern.shape[-2:]
    slots = flex.kv_indices.shape[-1]
    shape = (*flex.kv_num_blocks.shape, max(slots, n_k))
    partial = _compressed_pattern(flex.kv_num_blocks, flex.kv_indices, shape)[..., :n_q, :n_k]
    full_num = getattr(flex, "full_kv_num_blocks", None)
    full_idx = getattr(flex, "full_kv_indices", None)
    full_shape = shape if full_idx is None else (*full_num.shape, max(full_idx.shape[-1], n_k))
    full = _compressed_pattern(full_num, full_idx, full_shape)[..., :n_q, :n_k]
    partial = partial & ~full
    if mask_mod is None or not bool(partial.any()):
        return None
    offset = seqlen_k - seqlen_q
    where = partial.nonzero()  # [P, 4]: b, h, query block, key block
    rows = torch.arange(bq, device=where.device)
    cols = torch.arange(bk, device=where.device)
    allowed_d, refused_d = [], []
    for chunk in where.split(256):
        b, h = chunk[:, 0, None, None], chunk[:, 1, None, None]
        i = chunk[:, 2, None, None] * bq + rows[None, :, None]  # [P, bq, 1]
        j = chunk[:, 3, None, None] * bk + cols[None, None, :]  # [P, 1, bk]
        inside = (i < seqlen_q) & (j < seqlen_k)
        value = mask_mod(b, h, i.clamp(max=seqlen_q - 1), j.clamp(max=seqlen_k - 1))
        value = torch.as_tensor(value, device=where.device).bool().expand(inside.shape) & inside
        d = (j - i - offset).expand(inside.shape)  # key's distance from the query's diagonal
        allowed_d.append(d[value])
        refused_d.append(d[inside & ~value])
    allowed, refused = torch.cat(allowed_d), torch.cat(refused_d)
    if refused.numel() == 0:
        return None
    if allowed.numel() == 0:
        raise ValueError("BlockMask.from_flex: the FlexAttention mask_mod allows no element of its partial blocks; "
                         "give a block-aligned mask (drop those blocks).")
    high, low = int(allowed.max()), int(allowed.min())
    right = high if bool((refused > high).any()) else -1  # -1: nothing refused past the allowed keys
    left = -low if bool((refused < low).any()) else -1
    fits = (right == -1 or right >= 0) and (left == -1 or left >= 0)
    inside = torch.ones_like(refused, dtype=torch.bool)
    if right >= 0:
        inside &= refused <= right
    if left >= 0:
        inside &= refused >= -left
    fits = fits and not bool(inside.any())  # every refused element lies outside the window
    blocks_full = full.nonzero()
    if fits and blocks_full.numel() > 0:  # and every element of a full block inside it
        qb, kb = blocks_full[:, 2], blocks_full[:, 3]
        first_i, last_i = qb * bq, torch.clamp((qb + 1) * bq, max=seqlen_q) - 1
        first_j, last_j = kb * bk, torch.clamp((kb + 1) * bk, max=seqlen_k) - 1
        if right >= 0:
            fits = bool((last_j - first_i - offset <= right).all())
        if left >= 0:
            fits = fits and bool((first_j - last_i - offset >= -left).all())
    if not fits:
        raise ValueError(
            "BlockMask.from_flex: the FlexAttention mask_mod masks elements of its partial blocks in a way "
            "`causal` / `window` cannot express (streamkl applies block masks per block and element masks "
            "only as causal or a sliding window, bottom-right aligned); give a block-aligned mask_mod."
        )
    return left, right
