"""Context parallelism: strategies that run SDPA on sequence shards with global document metadata."""

from __future__ import annotations

from .balance import balance_documents, shard_work
from .context import STRATEGIES, ContextParallel
from .layout import ChunkLayout

__all__ = ["ContextParallel", "ChunkLayout", "STRATEGIES", "balance_documents", "shard_work"]
