"""The literal arguments of a graph file's collectives, checked once at load (issue 31).

A collective's arguments decide how many bytes move and how a receive buffer is cut: an all-to-all
with no sizes, a ring with ``chunks_per_rank=0`` or a halo wider than the rows it reads from can
never run, and inspect divided by them (``ZeroDivisionError``, ``IndexError`` tracebacks). Each rule
here is the op's own argument rule (`usp_graph.ops.collectives`, `ring`, `halo`) applied to what
the file states literally, so such a file is refused when it is read, naming the node and the fix;
anything symbolic (a size that is a node) is left to the op's check at replay.

`bound(target, args, kwargs)`: a call's arguments by schema name (defaults filled in), the one
way inspect and this check read them, so positional and keyword spellings mean the same.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx as fx

from .. import registry
from .errors import GraphFileSchemaError

__all__ = ["bound", "check_collectives"]


def bound(target: torch._ops.OpOverload, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """{argument name: value} of a call of `target`, schema defaults included."""
    params = target._schema.arguments
    out = {a.name: v for a, v in zip([p for p in params if not p.kwarg_only], args, strict=False)}
    out.update(kwargs)
    for p in params:
        if p.name not in out and p.has_default_value():
            out[p.name] = p.default_value
    return out


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _ndim(x: Any) -> int | None:
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    return v.dim() if isinstance(v, torch.Tensor) else None


def _dim_size(x: Any, dim: int) -> int | None:
    """x's size along `dim` when it is a plain int (None when symbolic or unknown)."""
    v = x.meta.get("val") if isinstance(x, fx.Node) else None
    if not isinstance(v, torch.Tensor):
        return None
    size = v.shape[dim]
    return size if _is_int(size) else None


class _Bad(Exception):
    pass


def _dim(b: dict[str, Any], name: str, x: Any, *, not_row: bool = False) -> int | None:
    """The literal dim argument `name`, normalized against x's rank when the file records it."""
    d = b.get(name)
    if not _is_int(d):
        raise _Bad(f"{name} must be an int, got {type(d).__name__}")
    ndim = _ndim(x)
    if ndim is None:
        return None
    if not -ndim <= d < ndim:
        valid = f"{-ndim}..{ndim - 1}" if ndim else "none: the input is 0-dimensional"
        raise _Bad(f"{name}={d} is out of range for an input of {ndim} dims (valid: {valid})")
    if not_row and d % ndim == 0:
        raise _Bad(f"{name}={d} must name a sequence dim of the input, not the row dim 0")
    return d % ndim


def _sizes(b: dict[str, Any], name: str, world: int | None) -> None:
    sizes = b.get(name)
    if not isinstance(sizes, (list, tuple)):
        raise _Bad(f"{name} must be a list of sizes, one per rank, got {type(sizes).__name__}")
    if not sizes or (world is not None and len(sizes) != world):
        want = f"{world}" if world is not None else "one per rank"
        raise _Bad(f"{name} has {len(sizes)} entries; the group has {want} ranks: give one size per rank")
    for i, s in enumerate(sizes):
        if not (isinstance(s, fx.Node) or (_is_int(s) and s >= 0)):
            raise _Bad(f"{name}[{i}] must be a size >= 0 (an int or a node), got {repr(s)[:40]}")


def _all_to_all(b: dict[str, Any], world: int | None) -> None:
    _dim(b, "scatter_dim", b.get("x"))
    _dim(b, "gather_dim", b.get("x"))
    _sizes(b, "scatter_sizes", world)
    _sizes(b, "gather_sizes", world)


def _dim_group(b: dict[str, Any], world: int | None) -> None:
    _dim(b, "dim", b.get("x"))
    size = b.get("group_size")
    if not _is_int(size) or size < 1:
        raise _Bad(f"group_size must be an int >= 1, got {repr(size)[:40]}")


def _halo(b: dict[str, Any], world: int | None) -> None:
    x = b.get("x", b.get("dy"))
    ndim = _ndim(x)
    if ndim is not None and ndim < 2:
        raise _Bad(f"the input must have a row dim 0 and a sequence dim; it has {ndim} dims")
    d = _dim(b, "dim", x, not_row=True)
    for name in ("before", "after"):
        w = b.get(name)
        if not _is_int(w) or w < 0:
            raise _Bad(f"halo width {name} must be an int >= 0, got {repr(w)[:40]}")
    n = _dim_size(x, d) if d is not None else None
    widest = max(b["before"], b["after"])
    if n is not None and widest > n:
        raise _Bad(
            f"a halo of {widest} tokens is wider than the {n} tokens of dim {d} it is cut from; the halo "
            "widths must be at most the local sequence length"
        )


def _ring(b: dict[str, Any], world: int | None) -> None:
    per_rank, ids = b.get("chunks_per_rank"), b.get("chunk_ids")
    if not isinstance(ids, (list, tuple)):
        raise _Bad(f"chunk_ids must be a list, got {type(ids).__name__}")
    if isinstance(per_rank, fx.Node):
        return  # symbolic: the op checks it at replay
    if not _is_int(per_rank) or per_rank < 1:
        raise _Bad(f"chunks_per_rank must be an int >= 1, got {repr(per_rank)[:40]}")
    if world is not None and len(ids) != world * per_rank:
        raise _Bad(
            f"chunk_ids has {len(ids)} entries; the ring has {world} ranks x {per_rank} chunks per rank"
        )
    literal = [c for c in ids if not isinstance(c, fx.Node)]
    if any(not _is_int(c) or not 0 <= c < len(ids) for c in literal) or len(set(literal)) != len(literal):
        raise _Bad(f"chunk_ids must be distinct chunk numbers in [0, {len(ids)}), got {str(ids)[:60]}")


# collective (canonical op name without namespace) -> its rule on the bound arguments
_RULES: dict[str, Callable[[dict[str, Any], int | None], None]] = {
    "all_to_all": _all_to_all,
    "all_gather": _dim_group,
    "reduce_scatter": _dim_group,
    "halo_exchange": _halo,
    "halo_reduce": _halo,
    "ring_attn_fwd": _ring,
    "ring_attn_bwd": _ring,
}


def check_collectives(graph: fx.Graph, groups: Mapping[str, int] | None) -> None:
    """Refuse (GraphFileSchemaError naming the node) a collective whose literal arguments its op
    would refuse. `groups`: the file's process groups, name -> ranks (`check_static` has already
    checked each collective's group name against them). Runs after the nodes' recorded values
    (``meta["val"]``) are rebuilt, so dims are checked against the input's rank where recorded.
    One pass over the nodes."""
    for node in graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        if target.namespace != registry.NAMESPACE:
            continue
        name = registry.canonical(target)._schema.name.split("::")[1]
        rule = _RULES.get(name)
        if rule is None:
            continue
        b = bound(target, node.args, node.kwargs)
        group = b.get("group_name")
        world = groups.get(group) if groups is not None and isinstance(group, str) else None
        try:
            rule(b, world)
        except _Bad as e:
            raise GraphFileSchemaError(f"graph.nodes ({node.name}): {target}: {e}") from None
