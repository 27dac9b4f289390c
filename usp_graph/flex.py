"""A flex_attention `BlockMask` for packed documents, built on the device from `cu_seqlens`.

# T packed tokens, N document slots, S block size, Nb = ceil(T / S) blocks

`torch.nn.attention.flex_attention.create_block_mask` evaluates the mask function on every
(query, key) pair to find which blocks to visit: seconds at tens of thousands of tokens, for every
new set of document boundaries. Documents are contiguous, so the block structure follows from the
boundaries alone: block i holds documents first[i]..last[i]; a query block and a key block share a
document exactly when those ranges overlap (and, causal, the key block is not after the query
block), and every pair in them attends when both hold one and the same document (causal: with the
key block strictly before). `document_block_mask` computes that in a few tensor ops on the
device that holds the boundaries (no host sync, shapes fixed by T), and attaches the token-level
mask ``doc[q] == doc[kv]`` (and ``q >= kv``) for the partial blocks.

The result is the same mask `create_block_mask` builds for that mask function (the tests compare
them block by block and compare flex_attention's output with usp's varlen attention).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from .metadata import AttentionMetadata

__all__ = ["document_ids", "document_block_mask"]


def document_ids(cu_seqlens: Tensor, total_tokens: int) -> Tensor:
    """The document slot of every packed token, ``(T,)`` int32 (empty documents hold no token)."""
    pos = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32)


def _sorted_blocks(keep: Tensor) -> tuple[Tensor, Tensor]:
    """(count per row, column indices with the kept ones first) of a (Nb, Nb) bool matrix."""
    counts = keep.sum(-1, dtype=torch.int32)
    order = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def document_block_mask(
    metadata: AttentionMetadata | Tensor,
    total_tokens: int | None = None,
    *,
    is_causal: bool,
    block_size: int = 128,
) -> Any:
    """The flex_attention `BlockMask` of attention within documents (causal: within documents and
    to earlier keys) for one packed row of `total_tokens` tokens, broadcast over batch and heads.

    metadata: an `AttentionMetadata` (its `cu_seqlens` and `total_tokens`) or a `cu_seqlens`
    tensor with `total_tokens` given. The mask lives on `cu_seqlens`' device.
    """
    from torch.nn.attention.flex_attention import BlockMask

    if isinstance(metadata, AttentionMetadata):
        cu, total = metadata.cu_seqlens, metadata.total_tokens if total_tokens is None else total_tokens
    else:
        if total_tokens is None:
            raise ValueError("pass total_tokens with a cu_seqlens tensor (or pass an AttentionMetadata)")
        cu, total = metadata, total_tokens
    if not isinstance(cu, Tensor) or cu.dim() != 1 or cu.numel() < 2:
        raise ValueError(f"cu_seqlens must be a 1-D tensor with >= 2 entries, got {cu!r}")
    if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
        raise ValueError(f"block_size must be a positive int, got {block_size!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < 1:
        raise ValueError(f"total_tokens must be a positive int, got {total!r}")
    doc = document_ids(cu, total)
    nb = -(-total // block_size)
    starts = torch.arange(nb, device=cu.device) * block_size
    ends = (starts + block_size).clamp(max=total) - 1
    first, last = doc[starts], doc[ends]
    overlap = (first[:, None] <= last[None, :]) & (first[None, :] <= last[:, None])
    single = first == last
    # A block cut short by the end of the row is never "full": flex masks its missing tokens.
    whole = (ends - starts + 1) == block_size
    same = (
        single[:, None]
        & single[None, :]
        & (first[:, None] == first[None, :])
        & whole[:, None]
        & whole[None, :]
    )
    if is_causal:
        idx = torch.arange(nb, device=cu.device)
        overlap &= idx[None, :] <= idx[:, None]
        full = same & (idx[None, :] < idx[:, None])
    else:
        full = same
    partial = overlap & ~full
    kv_num, kv_idx = _sorted_blocks(partial)
    full_num, full_idx = _sorted_blocks(full)

    if is_causal:

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return (doc[q] == doc[kv]) & (q >= kv)

    else:

        def mask_mod(b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
            return doc[q] == doc[kv]

    return BlockMask.from_kv_blocks(
        kv_num,
        kv_idx,
        full_num,
        full_idx,
        BLOCK_SIZE=block_size,
        mask_mod=mask_mod,
        seq_lengths=(total, total),
    )
