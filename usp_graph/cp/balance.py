"""Document order for packing: equal attention work per rank under contiguous sharding.

# P CP ranks, N documents, T packed tokens

Contiguous sharding gives every rank T/P tokens, but attention work grows with the square of a
document's length: one long document on a rank makes every other rank wait. Documents in a packed
row are independent (positions restart, attention stays inside each), so a data loader may pack
them in any order. `balance_documents` picks an order whose contiguous shards carry nearly equal
work: longest-processing-time-first into P bins of T/P tokens, the largest documents in the middle
of each bin so that the ones a shard boundary cuts are short. It is plain host arithmetic on the
lengths, done once per batch where the loader packs it.

`shard_work` gives each rank's share of the work for an order (the tests and benchmarks use it to
report the balance: mean over max).
"""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["balance_documents", "shard_work"]


def _work(n: int, is_causal: bool) -> int:
    return n * (n + 1) // 2 if is_causal else n * n


def _check(lengths: Sequence[int], world: int) -> list[int]:
    if isinstance(world, bool) or not isinstance(world, int) or world < 1:
        raise ValueError(f"world must be a positive int, got {world!r}")
    lens = list(lengths)
    for i, n in enumerate(lens):
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"lengths[{i}] must be a non-negative int, got {n!r}")
    return lens


def shard_work(lengths: Sequence[int], world: int, *, is_causal: bool = True) -> list[int]:
    """Attention work (query-key pairs) of each rank when the documents, in this order, are packed
    into one row and cut into `world` contiguous shards of equal length (documents may cross)."""
    lens = _check(lengths, world)
    total = sum(lens)
    if total % world:
        raise ValueError(f"{total} tokens do not split into {world} equal shards")
    tl = total // world
    work = [0] * world
    start = 0
    for n in lens:
        # Rows [a, b) of a document starting at `start`: row p sees p - start + 1 keys (causal) or n.
        for r in range(start // tl if tl else 0, world):
            a, b = max(start, r * tl), min(start + n, (r + 1) * tl)
            if a >= b:
                break
            if is_causal:
                lo, hi = a - start + 1, b - start
                work[r] += (lo + hi) * (hi - lo + 1) // 2
            else:
                work[r] += (b - a) * n
        start += n
    return work


def balance_documents(lengths: Sequence[int], world: int, *, is_causal: bool = True) -> list[int]:
    """A permutation of document indices: pack ``[lengths[i] for i in order]`` so that each of the
    `world` contiguous shards holds about the same attention work. Deterministic (ties by index).
    Never worse than the given order (returned unchanged when it balances as well or better).
    A document whose own work exceeds 1/world of the total caps every order: split heads
    (Ulysses) for such steps."""
    lens = _check(lengths, world)
    cap = sum(lens) / world
    bins: list[list[int]] = [[] for _ in range(world)]
    load = [0] * world
    tokens = [0] * world
    for i in sorted(range(len(lens)), key=lambda i: (-lens[i], i)):
        n = lens[i]
        fits = [r for r in range(world) if tokens[r] + n <= cap]
        # The least loaded bin with room; when none has room, the one with the most room left (its
        # overflow crosses into the next shard).
        r = (
            min(fits, key=lambda r: (load[r], r))
            if fits
            else max(range(world), key=lambda r: (cap - tokens[r], -r))
        )
        bins[r].append(i)
        load[r] += _work(n, is_causal)
        tokens[r] += n
    order: list[int] = []
    for b in bins:
        ascending = sorted(b, key=lambda i: (lens[i], i))
        order += ascending[0::2] + ascending[1::2][::-1]  # short documents at both edges
    identity = list(range(len(lens)))
    if sum(lens) % world:
        return order
    if max(shard_work([lens[i] for i in order], world, is_causal=is_causal)) >= max(
        shard_work(lens, world, is_causal=is_causal)
    ):
        return identity
    return order
