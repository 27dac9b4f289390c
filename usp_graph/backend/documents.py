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

__all__ = ["documents", "current_documents"]

# A ContextVar, not a global: threads and asyncio tasks each see their own block.
_CURRENT: ContextVar[AttentionMetadata | None] = ContextVar("usp_graph_documents", default=None)


@contextlib.contextmanager
def documents(metadata: AttentionMetadata | None) -> Iterator[AttentionMetadata | None]:
    """Within the block, calls of ``backend="usp"`` functions attend within `metadata`'s documents.

    `metadata` describes the packed token stream of each attention call (under context
    parallelism: the GLOBAL stream of all ranks, the same on every rank); None restores one
    document per batch row for a nested block. Blocks nest; the innermost wins.
    """
    if metadata is not None and not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"documents() takes a usp_graph.AttentionMetadata or None, got {type(metadata).__name__}; build one "
            "with AttentionMetadata.from_lengths / from_position_ids / from_document_ids"
        )
    token = _CURRENT.set(metadata)
    try:
        yield metadata
    finally:
        _CURRENT.reset(token)


def current_documents() -> AttentionMetadata | None:
    """The metadata of the innermost `documents` block, or None outside any."""
    return _CURRENT.get()
