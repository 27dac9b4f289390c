"""Process groups in graph files: recorded by rank list at save, matched to live groups at replay.

Collective ops take their group as a name (``"0"``, ``"1"``, ...), and those names are only
meaningful inside the process that created the groups: torch numbers groups in creation order.
So a file records, for each group name its nodes use, the group's global ranks in group order,
plus the saving process's world size and global rank.

Binding (first replay, or `bind_groups` explicitly) maps each recorded group to a live group of
the current process, in this order:
1. ``groups={recorded name: ProcessGroup or live name}`` when given;
2. the live group with the recorded name, if its ranks are the recorded ranks;
3. any live group over exactly the recorded ranks, in the recorded order (the first created).
Then every ``group_name`` argument in the graph is rewritten to the live name. Collectives over
the same ranks in the same order compute the same thing whatever the group is called.

So a replaying job must: call ``init_process_group`` with the recorded world size, load on each
rank the file that rank saved, and create its groups before the first replay the way the tracing
job did (e.g. the same ``ContextParallel(strategy, ...)``: new_group is collective, so every rank
creates every subgroup in the same order). A mismatch raises ProcessGroupMismatchError naming the
group, its ranks and the fix, before any collective runs.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from .errors import GraphFileSchemaError, ProcessGroupMismatchError

__all__ = ["GroupSpec", "WorldSpec", "record_groups", "group_args", "resolve_groups", "rename_groups"]


@dataclass(frozen=True)
class GroupSpec:
    """A process group as recorded: its name in the saving process and its global ranks in group order."""

    name: str
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class WorldSpec:
    """The saving process's world size and global rank, and the groups its graph uses."""

    size: int
    rank: int
    groups: tuple[GroupSpec, ...]


def group_args(node: fx.Node) -> list[tuple[int | str, str]]:
    """(position or keyword, group name) of each ``group_name: str`` argument of an op node."""
    target = node.target
    if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
        return []
    out: list[tuple[int | str, str]] = []
    for i, a in enumerate(target._schema.arguments):
        if a.name != "group_name" or str(a.type) != "str":
            continue
        if i < len(node.args) and not a.kwarg_only:
            if isinstance(node.args[i], str):
                out.append((i, node.args[i]))
        elif isinstance(node.kwargs.get(a.name), str):
            out.append((a.name, node.kwargs[a.name]))
    return out


def record_groups(gm: fx.GraphModule) -> WorldSpec | None:
    """The groups `gm`'s collectives name (None when it has none), with their global ranks."""
    names = sorted({name for node in gm.graph.nodes for _, name in group_args(node)})
    if not names:
        return None
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise ValueError(
            f"the graph's collectives use process groups {names}; save it on a rank with torch.distributed "
            "initialized (the file records each group's ranks so a replaying process can find it)"
        )
    from ..distributed import resolve_group

    groups = []
    for name in names:
        pg = resolve_group(name)
        groups.append(GroupSpec(name, tuple(int(r) for r in dist.get_process_group_ranks(pg))))
    return WorldSpec(dist.get_world_size(), dist.get_rank(), tuple(groups))


def _live_groups() -> list[tuple[str, Any, tuple[int, ...]]]:
    import torch.distributed as dist

    out = []
    for pg, name in list(dist.distributed_c10d._world.pg_names.items()):  # creation order
        try:
            ranks = tuple(int(r) for r in dist.get_process_group_ranks(pg))
        except (RuntimeError, ValueError, KeyError):
            continue
        out.append((str(name), pg, ranks))
    return out


def resolve_groups(world: WorldSpec, groups: Mapping[str, Any] | None = None) -> dict[str, str]:
    """recorded group name -> live group name in this process (see the module docstring)."""
    import torch.distributed as dist

    recorded = ", ".join(f"{g.name!r} over ranks {list(g.ranks)}" for g in world.groups)
    if not dist.is_available() or not dist.is_initialized():
        raise ProcessGroupMismatchError(
            f"this graph was saved on rank {world.rank} of {world.size} and its collectives use groups "
            f"{recorded}; call torch.distributed.init_process_group(..., world_size={world.size}) and create "
            "those groups (e.g. the same ContextParallel(...) as when tracing) before replaying it"
        )
    size, rank = dist.get_world_size(), dist.get_rank()
    if size != world.size or rank != world.rank:
        raise ProcessGroupMismatchError(
            f"this graph file was saved by rank {world.rank} of a world of {world.size}, but this process is "
            f"rank {rank} of {size}; CP graphs are per rank: load the file rank {rank} saved, in a world of "
            f"{world.size} ranks"
        )
    groups = dict(groups or {})
    unknown = [k for k in groups if k not in {g.name for g in world.groups}]
    if unknown:
        raise ProcessGroupMismatchError(
            f"groups= names {unknown}, which this graph does not use (it uses {recorded})"
        )
    live = _live_groups()
    mapping: dict[str, str] = {}
    for g in world.groups:
        if g.name in groups:
            given = groups[g.name]
            if isinstance(given, str):
                match = [x for x in live if x[0] == given]
                if not match:
                    raise ProcessGroupMismatchError(
                        f"groups[{g.name!r}] names {given!r}, which is not a live group"
                    )
                name, _, ranks = match[0]
            else:
                name = getattr(given, "group_name", None)
                match = [x for x in live if x[1] is given]
                if not match:
                    raise ProcessGroupMismatchError(
                        f"groups[{g.name!r}] must be a live ProcessGroup this rank belongs to, or its name"
                    )
                name, _, ranks = match[0]
            if ranks != g.ranks:
                raise ProcessGroupMismatchError(
                    f"groups[{g.name!r}] is over ranks {list(ranks)}, but the graph's group {g.name!r} was over "
                    f"ranks {list(g.ranks)} (in that order)"
                )
            mapping[g.name] = name
            continue
        same_name = [x for x in live if x[0] == g.name and x[2] == g.ranks]
        same_ranks = same_name or [x for x in live if x[2] == g.ranks]
        if not same_ranks:
            have = "; ".join(f"{n!r} over {list(r)}" for n, _, r in live) or "none"
            raise ProcessGroupMismatchError(
                f"the graph's process group {g.name!r} spans global ranks {list(g.ranks)} (size {len(g.ranks)}), "
                f"and no group of this process does (live groups: {have}). Create it before replaying: "
                f"torch.distributed.new_group({list(g.ranks)}) on every rank, in the same order as the tracing "
                "job (constructing the same ContextParallel(...) does this), or pass "
                f"groups={{{g.name!r}: group}}"
            )
        mapping[g.name] = same_ranks[0][0]
    return mapping


def rename_groups(gm: fx.GraphModule, mapping: Mapping[str, str]) -> int:
    """Rewrite every group_name argument through `mapping`; returns how many were changed."""
    changed = 0
    for node in gm.graph.nodes:
        for where, name in group_args(node):
            new = mapping.get(name)
            if new is None:
                raise GraphFileSchemaError(
                    f"node {node.name} uses process group {name!r}, which the file does not record"
                )
            if new == name:
                continue
            if isinstance(where, int):
                node.update_arg(where, new)
            else:
                node.update_kwarg(where, new)
            changed += 1
    if changed:
        gm.recompile()
    return changed
