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

__all__ = ["document_ids", "document_blocks", "blocks_of_documents", "document_block_mask"]


def document_ids(cu_seqlens: Tensor, total_tokens: int, *, positions: Tensor | None = None) -> Tensor:
    """The document slot of every packed token, ``(T,)`` int32 (empty documents hold no token).
    `positions`: ``arange(T)`` in `cu_seqlens`' dtype and device, if the caller keeps one."""
    pos = positions
    if pos is None:
        pos = torch.arange(total_tokens, device=cu_seqlens.device, dtype=cu_seqlens.dtype)
    return torch.searchsorted(cu_seqlens[1:].contiguous(), pos, right=True).to(torch.int32)


def _sorted_blocks(keep: Tensor) -> tuple[Tensor, Tensor]:
    """(count per row, column indices with the kept ones first) of a (Nb, Nb) bool matrix."""
    counts = keep.sum(-1, dtype=torch.int32)
    order = torch.argsort(keep.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return counts[None, None], order[None, None]


def document_blocks(
    cu_seqlens: Tensor, total_tokens: int, *, is_causal: bool, block_size: int = 128
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """The block structure of attention within documents: ``(doc_T, kv_num, kv_idx, full_num,
    full_idx)`` in `BlockMask.from_kv_blocks`' layout (partial blocks, then full blocks), from
    `cu_seqlens` alone, in tensor ops on its device (traceable: shapes depend on `total_tokens`
    and `block_size` only)."""
    doc = document_ids(cu_seqlens, total_tokens)
    return (doc, *blocks_of_documents(doc, is_causal=is_causal, block_size=block_size))


def _block_matrices(doc: Tensor, is_causal: bool, block_size: int) -> tuple[Tensor, Tensor]:
    """(partial, full): ``(Nb, Nb)`` bool, query block x key block."""
    total = doc.shape[0]
    nb = -(-total // block_size)
    starts = torch.arange(nb, device=doc.device) * block_size
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
        idx = torch.arange(nb, device=doc.device)
        overlap &= idx[None, :] <= idx[:, None]
        full = same & (idx[None, :] < idx[:, None])
    else:
        full = same
    return overlap & ~full, full


def blocks_of_documents(
    doc: Tensor, *, is_causal: bool, block_size: int = 128, with_q_blocks: bool = False
) -> tuple[Tensor, ...]:
    """``(kv_num, kv_idx, full_num, full_idx)`` of `document_blocks` from the document slot of
    every token (`document_ids`); `with_q_blocks` appends the same four for the transposed
    (key block x query block) structure, the layout `BlockMask` keeps for the backward."""
    partial, full = _block_matrices(doc, is_causal, block_size)
    out = (*_sorted_blocks(partial), *_sorted_blocks(full))
    if with_q_blocks:
        out += (*_sorted_blocks(partial.transpose(0, 1)), *_sorted_blocks(full.transpose(0, 1)))
    return out


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
    doc, kv_num, kv_idx, full_num, full_idx = document_blocks(
        cu, total, is_causal=is_causal, block_size=block_size
    )
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
