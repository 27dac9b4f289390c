"""Bytes each rank sends per attention call, per strategy (what the ops send, and a lower bound).

# T global tokens, H query heads, G key/value heads, K head dim, P CP ranks, U Ulysses degree

`bytes_sent` is what usp's ops send (the test suite checks it against `count_bytes_sent`); the
inspect CLI and the benchmarks use it. `document_lower_bound` is the K/V traffic an exact
attention needs at least when only documents that span ranks force communication.
"""

from __future__ import annotations

import torch

from ..ops.window import check_window
from .common import halo_widths, kv_heads_after_split
from .table import STRATEGY_TABLE

__all__ = ["bytes_sent", "document_lower_bound"]


def bytes_sent(
    strategy: str,
    *,
    tokens: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    world: int,
    element_size: int,
    ulysses_degree: int = 1,
    backward: bool = True,
    max_document_len: int | None = None,
    is_causal: bool = True,
    rank: int | None = None,
    batch: int = 1,
    across: str = "ring",
    window: tuple[int, int] | None = None,
) -> int:
    """Bytes one rank sends for one attention call (forward, plus backward when `backward`).

    ``"halo"`` needs `max_document_len` and depends on `is_causal`, on the rank (the first and
    last ranks have one neighbour; with `batch` > 1 rows every rank has two) and on `batch`;
    `rank` None gives the mean over ranks, rounded down. ``"usp"`` with ``across="halo"`` likewise
    (its halos travel between Ulysses groups, with G/U heads). A sliding `window` (left, right)
    narrows the halos to its bounds; the other strategies send the same bytes with or without one."""
    if strategy not in STRATEGY_TABLE:
        raise ValueError(f"unknown strategy {strategy!r}")
    p, k, e = world, head_dim, element_size
    tl = tokens // p
    acc = 8 if e == 8 else 4  # ring dK/dV buffers accumulate in fp32 (fp64 for fp64)
    passes = 2 if backward else 1
    if strategy == "allgather_kv":  # all-gather K, V; backward reduce-scatters dK, dV
        return passes * 2 * (p - 1) * tl * kv_heads * k * e
    if strategy == "ulysses":
        g = kv_heads_after_split(heads, kv_heads, p)
        return passes * (p - 1) * tl * (2 * heads + 2 * g) * k * e // p
    if strategy == "ring":
        return _ring(p, tl, kv_heads, k, e, acc, backward)
    if strategy == "usp":
        u = ulysses_degree
        g = kv_heads_after_split(heads, kv_heads, u)
        uly = passes * (u - 1) * tl * (2 * heads + 2 * g) * k * e // u
        if across == "halo":  # halos between the P/U Ulysses groups, G/U heads each
            member = None if rank is None else rank // u
            halo = _halo(
                member, p // u, max_document_len, is_causal, batch, backward, "usp with across='halo'", window
            )
            return uly + halo * 2 * (g // u) * k * e
        return uly + _ring(p // u, tl * u, g // u, k, e, acc, backward)
    if strategy == "halo":
        halo = _halo(rank, p, max_document_len, is_causal, batch, backward, "strategy 'halo'", window)
        return halo * 2 * kv_heads * k * e  # K and V (dK and dV)
    raise AssertionError(f"usp_graph.cp.table has strategy {strategy!r}, the cost model no formula for it")


def _halo(
    rank: int | None,
    p: int,
    max_document_len: int | None,
    is_causal: bool,
    batch: int,
    backward: bool,
    what: str,
    window: tuple[int, int] | None = None,
) -> int:
    """Tokens of one K/V tensor that `rank` of `p` sends (summed over rows; the mean over ranks,
    rounded down, when `rank` is None): its tail to the next rank and, bidirectional, its head to
    the previous one; backward sends the halo gradients the other way."""
    if max_document_len is None:
        raise ValueError(f"{what} needs max_document_len")
    if p == 1:
        return 0
    before, after, _ = halo_widths(max_document_len, is_causal, check_window(window))
    ranks = range(p) if rank is None else [rank]
    total = 0
    for r in ranks:
        has_prev, has_next = (True, True) if batch > 1 else (r > 0, r < p - 1)
        fwd = before * has_next + after * has_prev
        bwd = before * has_prev + after * has_next
        total += batch * (fwd + (bwd if backward else 0))
    return total // len(ranks)


def _ring(r: int, tl: int, g: int, k: int, e: int, acc: int, backward: bool) -> int:
    if r == 1:
        return 0
    fwd = (r - 1) * 2 * tl * g * k * e  # K, V hop R-1 times
    if not backward:
        return fwd
    return 2 * fwd + r * 2 * tl * g * k * acc  # K, V again, and dK, dV R hops (the last one home)


def document_lower_bound(
    cu_seqlens: torch.Tensor,
    *,
    world: int,
    kv_heads: int,
    head_dim: int,
    element_size: int,
    is_causal: bool,
    backward: bool = True,
) -> int:
    """Mean over ranks of the K/V bytes a rank must receive (contiguous shards): keys of its
    queries' documents held by other ranks (earlier keys only, when causal). Backward returns as
    many dK/dV bytes. Documents inside one shard need no communication at all."""
    cu = cu_seqlens.tolist()
    total = cu[-1]
    tl = total // world
    need = 0
    for r in range(world):
        qa, qb = r * tl, (r + 1) * tl
        for s, e in zip(cu[:-1], cu[1:], strict=True):
            lo, hi = max(s, qa), min(e, qb)
            if lo >= hi:
                continue  # no query of this rank in the document
            key_end = hi if is_causal else e
            need += (key_end - s) - (min(key_end, qb) - max(s, qa))  # keys outside this shard
    per_rank = need * 2 * kv_heads * head_dim * element_size / world
    return int(per_rank * (2 if backward else 1))
