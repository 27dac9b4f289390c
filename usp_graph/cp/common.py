"""What the context-parallel strategies share with the modules that plan, price and run them.

# H query heads, G key/value heads, U Ulysses degree (or P CP ranks)

One home for the facts more than one module reads: how Ulysses splits heads (the strategies run
it, the cost model prices it), how far a halo reaches (the strategies exchange it, the cost model
counts its bytes), how chunks are reordered after a gather, and what a strategy reads of its plan
(`RankPlan`, which `ContextParallel` satisfies). This module imports nothing of `usp_graph.cp`, so
`context`, `table`, `strategies` and `cost` all depend on it and none on another through it (the
import circle of issue 30).
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from ..ops.window import bounds
from .layout import ChunkLayout

__all__ = ["RankPlan", "halo_widths", "kv_heads_after_split", "reorder_chunks", "split_sizes", "ulysses_head_split"]  # fmt: skip


class RankPlan(Protocol):
    """What a strategy reads of its CP plan (`usp_graph.cp.context.ContextParallel`)."""

    world: int
    rank: int
    group_name: str
    layout: ChunkLayout
    head_groups: int
    ulysses_degree: int
    ulysses_group_name: str
    ring_size: int
    ring_group_name: str
    across: str | None
    max_document_len: int | None


def reorder_chunks(x: Tensor, dim: int, order: list[int]) -> Tensor:
    """Permute the len(order) equal chunks of `x` along `dim` (identity orders cost nothing)."""
    if order == list(range(len(order))):
        return x
    chunks = x.chunk(len(order), dim)
    return torch.cat([chunks[i] for i in order], dim)


def split_sizes(n: int, parts: int, what: str) -> list[int]:
    """`n` heads over `parts` ranks, the first `n % parts` ranks one more."""
    if n < parts:
        raise ValueError(
            f"{what}: {n} heads cannot be split over a Ulysses degree of {parts}; lower the degree"
        )
    return [n // parts + (1 if i < n % parts else 0) for i in range(parts)]


def ulysses_head_split(h: int, g: int, degree: int) -> tuple[list[int], list[int], bool]:
    """(query head sizes, key/value head sizes, repeat) of Ulysses' all-to-all over `degree` ranks.

    `repeat`: the G key/value heads do not split compatibly with the H query heads, so they are
    repeated to H first (the repeat's backward sums the replicas)."""
    q_sizes = split_sizes(h, degree, "query")
    if g == h:
        return q_sizes, q_sizes, False
    if h % degree == 0 and g % degree == 0:
        return q_sizes, [g // degree] * degree, False
    return q_sizes, q_sizes, True


def kv_heads_after_split(h: int, g: int, degree: int) -> int:
    """Key/value heads that travel in Ulysses' all-to-all (G, or H when they are repeated)."""
    return h if ulysses_head_split(h, g, degree)[2] else g


def halo_widths(max_document_len: int, is_causal: bool, window: tuple[int, int]) -> tuple[int, int, bool]:
    """(before, after, must_fit): each side's halo is the longest reach a document allows
    (max_document_len - 1) or, shorter, the window's bound on that side; documents must fit the
    halo (max_seqlen <= max_document_len) unless the window bounds both sides within it."""
    w = max_document_len - 1
    left, right = bounds(window, is_causal)
    before = w if left == -1 else min(w, left)
    after = w if right == -1 else min(w, right)
    return before, after, left == -1 or left > w or right == -1 or right > w
