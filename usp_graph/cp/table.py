"""The context-parallel strategies, one row each: the one list of their names.

`ContextParallel` runs a row's `attention`, the CLI offers the rows' names, the cost model
(`cost.bytes_sent`) refuses a name without a row, and graph analysis can tell a strategy by the
usp ops that communicate in its forward (`strategy_of`). A new strategy is a function in
`strategies` and a row here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from torch import Tensor

from . import strategies

__all__ = ["Strategy", "STRATEGY_TABLE", "STRATEGIES", "strategy_of"]


@dataclass(frozen=True)
class Strategy:
    """One context-parallel strategy.

    attention: ``fn(cp, q_BHLK, k_BGLK, v_BGLK, *, cu_seqlens, max_seqlen, is_causal, scale,
    window)`` -> this rank's output shard (`usp_graph.cp.strategies`).
    forward_ops: for each of its variants, the usp ops (names in the ``usp`` namespace) that
    communicate in its forward, the attention op included when it communicates itself
    (``ring_attn_fwd``); no two strategies share a set.
    """

    name: str
    attention: Callable[..., Tensor]
    forward_ops: tuple[frozenset[str], ...]
    doc: str


STRATEGY_TABLE: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("allgather_kv", strategies.allgather_kv, (frozenset({"all_gather"}),),
                 "Q sharded, K/V all-gathered"),
        Strategy("ulysses", strategies.ulysses, (frozenset({"all_to_all"}),),
                 "sequence <-> heads all-to-all"),
        Strategy("ring", strategies.ring, (frozenset({"ring_attn_fwd"}),),
                 "K/V rotate around the ring, partial outputs merged by LSE"),
        Strategy("usp", strategies.usp,
                 (frozenset({"all_to_all", "ring_attn_fwd"}), frozenset({"all_to_all", "halo_exchange"})),
                 "Ulysses inside groups of ulysses_degree ranks, ring (or halo exchange) across them"),
        Strategy("halo", strategies.halo, (frozenset({"halo_exchange"}),),
                 "Q and K/V sharded; neighbours send the K/V that documents crossing a shard need"),
    )
}  # fmt: skip

STRATEGIES: tuple[str, ...] = tuple(STRATEGY_TABLE)


def strategy_of(ops: Iterable[str]) -> str | None:
    """The strategy whose forward communicates with exactly the usp ops `ops` (names such as
    ``"all_to_all"``), or None when no row's set matches."""
    found = frozenset(ops)
    for s in STRATEGY_TABLE.values():
        if found in s.forward_ops:
            return s.name
    return None
