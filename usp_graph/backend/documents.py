"""`documents(metadata)`: packed-document boundaries for the calls of ``backend="usp"`` functions.

    compiled = torch.compile(model, backend="usp")
    with usp_graph.documents(AttentionMetadata.from_position_ids(batch["position_ids"])):
        logits = compiled(batch["input_ids"], batch["position_ids"])

The compiled graphs take the metadata as graph inputs (``cu_seqlens_N1``, a tensor, and
``max_seqlen``, a SymInt); each call reads them from here. They are never seen by Dynamo, so new
boundaries (or a new bound, or a new capacity) reuse the compiled code. Outside any
``documents(...)`` block every batch row is one document: SDPA's own semantics.

The block must enclose the call of the compiled function, not sit inside it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from contextvars import ContextVar

from ..metadata import AttentionMetadata

__all__ = ["documents", "current_documents", "current_kv_documents"]

# A ContextVar, not a global: threads and asyncio tasks each see their own block.
_CURRENT: ContextVar[tuple[AttentionMetadata | None, AttentionMetadata | None]] = ContextVar(
    "usp_graph_documents", default=(None, None)
)


@contextlib.contextmanager
def documents(
    metadata: AttentionMetadata | None, *, kv: AttentionMetadata | None = None
) -> Iterator[AttentionMetadata | None]:
    """Within the block, calls of ``backend="usp"`` functions attend within `metadata`'s documents.

    `metadata` describes the packed token stream of each attention call (under context
    parallelism: the GLOBAL stream of all ranks, the same on every rank); None restores one
    document per batch row for a nested block. Blocks nest; the innermost wins.

    `kv`: the documents of a conditioning stream that cross-attention reads (e.g. per-sample text
    tokens packed next to each other): document i of `metadata` attends document i of `kv`, so
    both need the same capacity (``max_docs``). Which calls are cross-attention is decided from the
    graph's data flow (keys not computed from the queries' inputs), never from lengths.
    """
    for name, value in (("metadata", metadata), ("kv", kv)):
        if value is not None and not isinstance(value, AttentionMetadata):
            raise TypeError(
                f"documents() takes a usp_graph.AttentionMetadata or None as {name}, got {type(value).__name__}; "
                "build one with AttentionMetadata.from_lengths / from_position_ids / from_document_ids"
            )
    if kv is not None:
        if metadata is None:
            raise ValueError("documents(None, kv=...): key/value documents need query documents too")
        if kv.cu_seqlens.shape != metadata.cu_seqlens.shape:
            raise ValueError(
                f"documents(metadata, kv=...): metadata has {metadata.cu_seqlens.numel() - 1} document slots and kv "
                f"{kv.cu_seqlens.numel() - 1}; build both with the same max_docs"
            )
    token = _CURRENT.set((metadata, kv))
    try:
        yield metadata
    finally:
        _CURRENT.reset(token)


def current_documents() -> AttentionMetadata | None:
    """The metadata of the innermost `documents` block, or None outside any."""
    return _CURRENT.get()[0]


def current_kv_documents() -> AttentionMetadata | None:
    """The key/value (cross-attention) metadata of the innermost `documents` block, or None."""
    return _CURRENT.get()[1]
