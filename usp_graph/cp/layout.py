"""Where each token lives under context parallelism.

# B batch rows, L global row length, P CP ranks, m chunks per rank per row (1, or 2 for zigzag)

Each row of L tokens is cut into P*m equal chunks; rank p holds row-chunks `row_chunks(p)`
(contiguous: [p]; zigzag: [p, 2P-1-p], which balances causal work). The packed global stream is
rows back to back, so row b's row-chunk c is global chunk b*P*m + c, covering tokens
[id * Cl, (id + 1) * Cl) with Cl = L / (P*m). A rank's local `(B, ..., L/P, ...)` tensor, packed
row-major, is exactly its chunks in this order.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["ChunkLayout"]


@dataclass(frozen=True)
class ChunkLayout:
    world: int
    zigzag: bool = False

    @property
    def per_rank(self) -> int:
        """Chunks per rank per row (m)."""
        return 2 if self.zigzag else 1

    @property
    def row_chunks_total(self) -> int:
        return self.world * self.per_rank

    def row_chunks(self, rank: int) -> list[int]:
        if self.zigzag:
            return [rank, 2 * self.world - 1 - rank]
        return [rank]

    def global_chunks(self, rank: int, batch: int) -> list[int]:
        """Global chunk ids of `rank`'s packed local stream, in order."""
        n = self.row_chunks_total
        return [b * n + c for b in range(batch) for c in self.row_chunks(rank)]

    def gather_order(self) -> list[int]:
        """Position, in the rank-major concatenation of all ranks' row-chunks, of each global
        row-chunk: `gathered[:, order]` puts an all-gathered row back in global order."""
        cat = [c for r in range(self.world) for c in self.row_chunks(r)]
        return [cat.index(c) for c in range(self.row_chunks_total)]

    def scatter_order(self) -> list[int]:
        """Inverse of `gather_order`: global row-chunk order -> rank-major order."""
        return [c for r in range(self.world) for c in self.row_chunks(r)]
