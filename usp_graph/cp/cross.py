"""Cross-attention under context parallelism: sharded queries over a replicated key/value stream.

# B batch rows, H query heads, G key/value heads, Ll local query length, S key/value length,
# K head dim, T packed tokens

The queries' stream (video latents, an LLM's tokens) is sharded over the CP ranks like any other;
the conditioning stream that cross-attention reads (text states) is replicated: every rank holds
all of it, as video diffusion CP setups keep it. So no collective runs: each local query chunk
attends the whole key/value stream, with its document view of the GLOBAL query boundaries clamped
to the chunk and the key boundaries as given. The gradients of the keys and values are this
rank's share; the replicated parameters that made them are summed over ranks by
`ContextParallel.reduce_grads`, like every other parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import Tensor

from ..ops import varlen
from ..packing import pack

if TYPE_CHECKING:
    from .context import ContextParallel

__all__ = ["cross_attention"]


def cross_attention(
    cp: ContextParallel,
    q_BHLK: Tensor,
    k_BGSK: Tensor,
    v_BGSK: Tensor,
    *,
    cu_seqlens_q: Tensor,
    max_seqlen_q: int,
    cu_seqlens_k: Tensor,
    max_seqlen_k: int,
    scale: float,
) -> Tensor:
    """This rank's query shard over the whole (replicated) key/value stream; bidirectional."""
    b, h, ll, dim = q_BHLK.shape
    per_rank = cp.layout.per_rank
    if isinstance(ll, int) and ll % per_rank:
        raise ValueError(f"local sequence length {ll} must be even with zigzag load balancing")
    chunk = ll // per_rank
    q_T, k_T, v_T = pack(q_BHLK), pack(k_BGSK), pack(v_BGSK)
    outs = []
    for i, cid in enumerate(cp.layout.global_chunks(cp.rank, b)):
        start, end = cid * chunk, (cid + 1) * chunk
        outs.append(
            varlen.varlen_attn(
                q_T[i * chunk : (i + 1) * chunk],
                k_T,
                v_T,
                cu_seqlens_q.clamp(start, end) - start,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                scale=scale,
                enable_gqa=True,
            )
        )
    out_T = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return out_T.reshape(b, ll, h, -1).transpose(1, 2)
