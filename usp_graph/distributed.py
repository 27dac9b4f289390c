"""Process groups by name, collective error reporting, and a deterministic gradient all-reduce.

Ops take their process group as a ``str`` name (a ProcessGroup object cannot be a custom-op argument
or live in a serialized graph); `group_name` turns a group into that name and `resolve_group` turns
it back, with `ValueError`s that say what to do when torch.distributed is not initialized or the
name is unknown.

Faults. A rank whose peer raised, exited or never entered a collective does not hang: gloo gives up
after the process group's timeout and raises, and usp ops re-raise that as `CollectiveError` naming
the op, the group, the rank and the timeout. The timeout is the one the group was created with:
``init_process_group(timeout=...)`` for the default group and ``new_group(timeout=...)`` for a
subgroup. A subgroup does NOT inherit the default group's timeout (torch 2.13 gives it the backend
default, 30 min); pass ``timeout=`` to ``new_group`` too. A peer that exits is usually noticed at
once (gloo sees the closed connection); a peer that is alive but absent costs the full timeout.
After such an error the group is unusable: tear the job down.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveError",
    "all_gather_into",
    "all_reduce_sum_ordered",
    "group_name",
    "group_timeout",
    "ordered_sum",
    "resolve_group",
    "run_collective",
]

_T = TypeVar("_T")


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer raised, exited, or timed out); the group is unusable."""


def _require_initialized() -> None:
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build; collectives need it")
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group(...) "
            "(e.g. backend='gloo' on CPU) before using a process group"
        )


def _known_group_names() -> list[str]:
    try:
        return sorted(str(n) for n in dist.distributed_c10d._world.pg_names.values())
    except Exception:  # private bookkeeping; only used to improve an error message
        return []


def resolve_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under `name` (see `group_name`)."""
    if not isinstance(name, str):
        raise TypeError(
            f"group name must be a str (see usp_graph.distributed.group_name), got {type(name).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        _require_initialized()
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except RuntimeError:
        raise ValueError(
            f"unknown process group name {name!r}; known groups: {_known_group_names()}. Pass "
            "group_name(group) of a live group (a destroyed group's name is no longer registered)"
        ) from None


def group_name(group: dist.ProcessGroup | str | None = None) -> str:
    """The name under which ops find `group` (None: the default world group; a str is checked)."""
    if isinstance(group, str):
        resolve_group(group)
        return group
    _require_initialized()
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a group name or None, got {type(group).__name__}")
    return group.group_name


def _as_group(group: dist.ProcessGroup | str | None) -> dist.ProcessGroup:
    return resolve_group(group_name(group))


def group_timeout(group: dist.ProcessGroup | str | None = None) -> datetime.timedelta | None:
    """The timeout after which `group`'s collectives give up (None where it cannot be read)."""
    pg = _as_group(group)
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private accessor; gloo has it, other backends may not
        return None


def run_collective(op_name: str, pg: dist.ProcessGroup, call: Callable[[], _T]) -> _T:
    """Run `call` (a blocking torch.distributed collective on `pg`), turning a backend failure into a
    `CollectiveError` that says which op, group and rank failed and which timeout applied."""
    try:
        return call()
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        timeout = group_timeout(pg)
        raise CollectiveError(
            f"{op_name} on process group {pg.group_name!r} failed on rank {pg.rank()} of {pg.size()}: "
            f"{e}\nA peer rank raised, exited, passed mismatched sizes, or did not enter this collective "
            f"within the group's timeout ({timeout}). The timeout is the one the group was created "
            "with: init_process_group(timeout=...) for the default group, new_group(timeout=...) for a "
            "subgroup (subgroups do not inherit it). Check the other ranks' errors; this group is now "
            "unusable."
        ) from e


def all_gather_into(output: Tensor, input: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """All-gather of `input` into `output` (rank-ordered concatenation along dim 0); blocking, or
    started (`async_op`: returns the work to wait on).

    ``all_gather_single`` where this torch has it (``all_gather_into_tensor`` now warns that it is
    deprecated), ``all_gather_into_tensor`` on older releases (torch 2.11 has no ``all_gather_single``).
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def ordered_sum(parts: Sequence[Tensor]) -> Tensor:
    """((parts[0] + parts[1]) + parts[2]) + ...: a fixed left fold, so the bits depend only on the
    values and their order (a tree or backend-chosen reduction order would not be reproducible)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc


@torch.no_grad()
def all_reduce_sum_ordered(
    tensors: Sequence[Tensor], group: dist.ProcessGroup | str | None = None
) -> list[Tensor]:
    """Sum each tensor over the ranks of `group`, adding in rank order 0..P-1; returns new tensors.

    Bitwise reproducible and identical on every rank (gloo's all_reduce picks its own reduction order).
    Tensors are packed into one all_gather per (device, dtype), so it costs P times their memory;
    every rank must pass tensors of the same shapes, dtypes and order. Inputs are not modified.
    """
    if isinstance(tensors, Tensor):
        raise TypeError("tensors must be a sequence of tensors; wrap a single tensor in a list")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors[{i}] must be a Tensor, got {type(t).__name__}")
    pg = _as_group(group)
    world = pg.size()
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for idx in buckets.values():  # insertion order: the same on every rank
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        gathered_PN = flat.new_empty(world * flat.numel())
        run_collective(
            "all_reduce_sum_ordered",
            pg,
            lambda g=gathered_PN, f=flat: all_gather_into(g, f, pg),
        )
        total = ordered_sum(gathered_PN.view(world, -1).unbind(0))
        for i, piece in zip(idx, total.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out


# ---- communication accounting ---------------------------------------------------------------------

_BYTE_COUNTERS: list[dict[str, int]] = []


@contextlib.contextmanager
def count_bytes_sent() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends to other ranks inside the block, per usp op.

    Filled by the ops themselves (all-to-all: the pieces for other ranks; all-gather: the shard to
    each of the P-1 others; reduce-scatter: the P-1 chunks for others; ring: every hop's tensors)."""
    counts: dict[str, int] = {}
    _BYTE_COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _BYTE_COUNTERS.remove(counts)


def record_sent(op_name: str, nbytes: int) -> None:
    for counts in _BYTE_COUNTERS:
        counts[op_name] = counts.get(op_name, 0) + int(nbytes)
