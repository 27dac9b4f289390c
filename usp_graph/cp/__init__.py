"""Context parallelism: strategies that run SDPA on sequence shards with global document metadata."""

from __future__ import annotations

from .balance import balance_documents, shard_work
from .context import STRATEGIES, ContextParallel
from .layout import ChunkLayout
from .table import STRATEGY_TABLE, Strategy

__all__ = ["ContextParallel", "ChunkLayout", "STRATEGIES", "STRATEGY_TABLE", "Strategy", "balance_documents",
           "shard_work"]  # fmt: skip
