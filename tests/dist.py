"""Run a function on N gloo ranks for a test and bring back what each returned.

    from tests.dist import run_ranks

    def _check(rank, world_size, seed):       # module level: it is pickled by reference
        ...                                   # torch.distributed is initialized (gloo)
        return {"out": tensor}                # anything torch.save can write

    results = run_ranks(_check, 2, seed)      # [rank 0's result, rank 1's result]

The launcher is the package's (`usp_graph.launch`). The suite keeps one `RankPool` per world size
for the whole session: spawning ranks and importing torch and the test modules in them costs
seconds per call, and most tests need only a fresh process group, which every call gets. A failed
or hung call replaces its pool's ranks with fresh ones, so fault tests see exactly what fresh ranks would.
``USP_TEST_FRESH_RANKS=1`` spawns fresh ranks for every call instead (e.g. to rule the pool out).
The timeout is only a guard against hangs (`usp_graph.launch.default_timeout`).
"""

from __future__ import annotations

import atexit
import os
from collections.abc import Callable
from typing import Any

from usp_graph import launch
from usp_graph.launch import RankError, RankPool

__all__ = ["RankError", "close_pools", "run_ranks", "warm"]

_pools: dict[int, RankPool] = {}


def run_ranks(fn: Callable[..., Any], world_size: int, *args: Any, **kwargs: Any) -> list[Any]:
    """`usp_graph.launch.run_ranks` on the session's pool of `world_size` ranks (keywords as there:
    `timeout`, `pg_timeout`, the rest for `fn`)."""
    fresh = os.environ.get("USP_TEST_FRESH_RANKS", "") not in ("", "0")
    return launch.run_ranks(fn, world_size, *args, pool=None if fresh else _pool(world_size), **kwargs)


def _pool(world_size: int) -> RankPool:
    pool = _pools.get(world_size)
    if pool is None:
        pool = _pools[world_size] = RankPool(world_size, respawn=True)
    return pool


def warm(world_size: int) -> None:
    """Spawn the session's pool of `world_size` ranks now, so they import while other tests run."""
    if os.environ.get("USP_TEST_FRESH_RANKS", "") in ("", "0"):
        _pool(world_size).start()


def close_pools() -> None:
    """End every pooled rank (at the end of the session)."""
    while _pools:
        _pools.popitem()[1].close()


atexit.register(close_pools)
