"""Token layouts: (batch, heads, length, head dim) rows <-> packed (tokens, heads, head dim).

# B batch, H heads, L sequence, K head dim, T packed tokens (B * L)

Below both `sdpa` and `cp`: the SDPA rewrite packs a site's rows, and the context-parallel
strategies pack and unpack around their collectives, with the same two functions.
"""

from __future__ import annotations

from torch import Tensor

__all__ = ["pack", "unpack"]


def pack(x_BHLK: Tensor) -> Tensor:
    """(B, H, L, K) -> (B*L, H, K): tokens of all rows back to back, row-major."""
    b, h, seq, k = x_BHLK.shape
    return x_BHLK.transpose(1, 2).reshape(b * seq, h, k)


def unpack(x_THK: Tensor, batch: int) -> Tensor:
    """(B*L, H, K) -> (B, H, L, K), the inverse of `pack`."""
    t, h, k = x_THK.shape
    return x_THK.reshape(batch, t // batch, h, k).transpose(1, 2)
