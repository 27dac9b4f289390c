"""What a graph does: attention sites, collectives and their pairing, bytes, metadata paths.

Reads an `fx.GraphModule` (a traced train step, a loaded graph file, or a compile dump) and the
node metadata the passes leave (``usp_pass``, ``usp_phase``, ``usp_fwd_node``, ``usp_site``,
``val``): pairing forward collectives with their adjoints (`usp_graph.passes.pairing`), each
attention op's strategy, paths from metadata inputs to attention ops, and communication on the
critical path. Everything returned is plain JSON-able data; `usp_graph.cli` renders it.

Cost: every walk here is one pass over the nodes in graph (topological) order, so `summarize` is
O((nodes + edges) x k), k the number of distinct collective ops (a handful, fixed by the registry);
`work` counts the visits. (It was cubic: a networkx descendants walk per upstream collective per
attention op; issue 31.) `to_networkx` remains for callers that want the data-flow graph.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence
from typing import Any

import networkx as nx
import torch
from torch import fx

from . import registry
from .cp.table import STRATEGY_TABLE, strategy_of
from .graphfile.collective_args import bound
from .passes.pairing import pair_backward

__all__ = ["summarize", "to_networkx", "to_dot", "diff", "work", "MalformedGraphError"]

# Nodes and edges each of the analysis' graph walks visited, by walk, since the counter was last
# cleared: every walk is one pass in graph order, so a summary costs O(nodes + edges) visits
# (tests read this to check the bound structurally; timing alone is flaky).
work: Counter[str] = Counter()

_SDPA_NAMES = ("scaled_dot_product_attention", "_scaled_dot_product")


def _target_name(node: fx.Node) -> str:
    t = node.target
    if isinstance(t, torch._ops.OpOverload):
        return f"{t.namespace}.{t._schema.name.split('::')[1]}.{t._overloadname}"
    if isinstance(t, str):
        return t
    return f"{getattr(t, '__module__', '')}.{getattr(t, '__qualname__', getattr(t, '__name__', repr(t)))}".lstrip(
        "."
    )


def _op_label(node: fx.Node) -> str:
    """The node's op as pairing rows name it: an issued collective as its collective."""
    canonical = registry.canonical(node.target)
    if canonical is node.target:
        return _target_name(node)
    return f"{canonical.namespace}.{canonical._schema.name.split('::')[1]}.{canonical._overloadname}"


def _usp_name(node: fx.Node) -> str | None:
    """The usp op's name without the namespace; an issued collective's issue node is named as its
    collective (``all_to_all_start`` -> ``all_to_all``), its end is ``wait``."""
    t = node.target
    if isinstance(t, torch._ops.OpOverload) and t.namespace == "usp":
        return registry.canonical(t)._schema.name.split("::")[1]
    return None


def _overlapped(gm: fx.GraphModule) -> dict[str, tuple[str, int]]:
    """{issue node: (its wait node, compute ops scheduled between them)}: what runs while an
    issued collective's data travels (`usp_graph.passes.overlap`). Compute: call_function nodes
    with a tensor value that are not views, issues or waits. O(nodes + edges): the compute ops
    between two nodes are a difference of running counts."""
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    before = [0] * (len(nodes) + 1)  # before[i]: compute ops among nodes[:i]
    for i, m in enumerate(nodes):
        before[i + 1] = before[i] + _is_compute(m)
    work["overlap"] += len(nodes)
    out = {}
    for n in nodes:
        if n.op != "call_function" or registry.canonical(n.target) is n.target or not _usp_name(n):
            continue
        waits = [u for u in n.users if registry.is_wait_op(u.target)]
        work["overlap"] += len(n.users)
        if not waits:
            continue
        w = min(waits, key=at.__getitem__)
        out[n.name] = (w.name, max(0, before[at[w]] - before[at[n] + 1]))
    return out


def _is_compute(m: fx.Node) -> bool:
    t = m.target
    if m.op != "call_function" or not isinstance(m.meta.get("val"), torch.Tensor):
        return False
    if isinstance(t, torch._ops.OpOverload) and (t.is_view or registry.is_wait_op(t)):
        return False
    return registry.canonical(t) is t


def _comm_ops(table: Sequence[Any], strategies: Any) -> tuple[frozenset[str], frozenset[str]]:
    """(collectives, every op that communicates): op names without the namespace, read from the
    tables so a new collective or a new strategy's op is recognised here without an edit.

    Collectives: the registry's collective rows. Communicating: those and the attention ops a CP
    strategy's forward communicates with (ring attention). Each with the ops its row's backward emits.
    """

    def with_backward(ops: set[str]) -> frozenset[str]:
        out = set(ops)
        for row in table:
            if row.op in ops:
                out |= {*row.backward_ops, *([row.adjoint] if row.adjoint else [])}
        return frozenset(name.split("::")[-1] for name in out)

    collectives = with_backward({row.op for row in table if row.kind == "collective"})
    in_strategies = {
        f"{registry.NAMESPACE}::{op}" for s in strategies.values() for ops in s.forward_ops for op in ops
    }
    return collectives, collectives | with_backward(in_strategies)


# usp ops that communicate (the rest compute locally).
_COLLECTIVE_OPS, _COMM_OPS = _comm_ops(registry.TABLE, STRATEGY_TABLE)
_COMM_OPS_SET = _COMM_OPS


def _vals(node: fx.Node) -> list[Any]:
    v = node.meta.get("val")
    if v is None:
        return []
    return list(v) if isinstance(v, (tuple, list)) else [v]


def _shape(x: Any) -> list[Any] | None:
    if isinstance(x, torch.Tensor):
        return [_dim(d) for d in x.shape]
    if isinstance(x, fx.Node):
        vals = _vals(x)
        return _shape(vals[0]) if vals else None
    return None


def _dim(d: Any) -> int | str:
    return int(d) if isinstance(d, int) else str(d)


def _nbytes(x: Any) -> Any:
    """Bytes of a tensor node's value: an int, or a SymInt expression when sizes are symbolic."""
    vals = _vals(x) if isinstance(x, fx.Node) else [x]
    if not vals or not isinstance(vals[0], torch.Tensor):
        return None
    t = vals[0]
    n = t.element_size()
    for d in t.shape:
        n = n * d
    return n


def _fmt(n: Any, names: dict[str, str], values: dict[str, int] | None = None) -> int | str | None:
    """An int, or a symbolic size with readable symbol names; evaluated when `values` gives
    every symbol it uses (keyed by readable name, e.g. {"T": 4096})."""
    if n is None:
        return None
    if isinstance(n, int):
        return n
    if values and isinstance(n, torch.SymInt):
        expr = n.node.expr
        subs = {sym: values[names.get(str(sym), str(sym))] for sym in expr.free_symbols
                if names.get(str(sym), str(sym)) in values}  # fmt: skip
        if len(subs) == len(expr.free_symbols):
            return int(expr.subs(subs))
    s = str(n)
    for sym, name in names.items():
        s = s.replace(sym, name)
    return s


def _scale(n: Any, num: int, den: int = 1) -> Any:
    if n is None:
        return None
    return n * num // den if den != 1 else n * num


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _collective_bytes(node: fx.Node) -> tuple[Any, int | None, str | None]:
    """(bytes this rank sends, group size, group name) for a usp communication node; None where
    the arguments do not say (a symbolic chunk count). The arguments are read by schema name;
    a graph file's were checked at load (`usp_graph.graphfile.collective_args`)."""
    name = _usp_name(node)
    if name is None or name not in _COMM_OPS:
        return None, None, None
    b = bound(node.target, node.args, node.kwargs)
    group = b.get("group_name") if isinstance(b.get("group_name"), str) else None
    if name == "all_to_all":
        p = len(b["scatter_sizes"]) if isinstance(b.get("scatter_sizes"), (list, tuple)) else 0
        return (_scale(_nbytes(b.get("x")), p - 1, p) if p else None), p or None, group
    if name in ("all_gather", "reduce_scatter"):
        p = _int(b.get("group_size"))
        if not p or p < 1:
            return None, None, group
        nb = _nbytes(b.get("x"))
        return (_scale(nb, p - 1) if name == "all_gather" else _scale(nb, p - 1, p)), p, group
    if name in ("halo_exchange", "halo_reduce"):
        # (x, dim, before, after, ...): both halos of every row, what a rank with two neighbours
        # sends (the first and last ranks of a one-row stream send one of them)
        x = b.get("x", b.get("dy"))
        nb, vals = _nbytes(x), _vals(x) if isinstance(x, fx.Node) else []
        dim, before, after = _int(b.get("dim")), _int(b.get("before")), _int(b.get("after"))
        if (
            nb is None
            or dim is None
            or before is None
            or after is None
            or not -vals[0].dim() <= dim < vals[0].dim()
        ):
            return None, None, group
        rows = vals[0].shape[dim]
        if isinstance(rows, int) and rows == 0:
            return 0, None, group  # an empty shard sends nothing
        return nb * (before + after) // rows, None, group
    if name in ("ring_attn_fwd", "ring_attn_bwd"):
        per_rank, chunk_ids = _int(b.get("chunks_per_rank")), b.get("chunk_ids")
        if not per_rank or per_rank < 1 or not isinstance(chunk_ids, (list, tuple)):
            return None, None, group
        r = len(chunk_ids) // per_rank
        k, v = b.get("k"), b.get("v")
        kv = None if _nbytes(k) is None or _nbytes(v) is None else _nbytes(k) + _nbytes(v)
        if kv is None:
            return None, r, group
        if name == "ring_attn_fwd":
            return kv * (r - 1), r, group
        acc = 8 if _vals(k)[0].dtype == torch.float64 else 4
        grads = kv * acc // _vals(k)[0].element_size()
        return kv * (r - 1) + (grads * r if r > 1 else 0), r, group
    return None, None, group


def to_networkx(gm: fx.GraphModule) -> nx.DiGraph:
    """Data-flow graph: one vertex per fx node (attributes: op, target, phase), edges producer -> user."""
    g = nx.DiGraph()
    for node in gm.graph.nodes:
        g.add_node(
            node.name,
            op=node.op,
            target=_target_name(node),
            phase=node.meta.get("usp_phase", ""),
            usp=_usp_name(node) or "",
        )
        for inp in node.all_input_nodes:
            g.add_edge(inp.name, node.name)
    return g


_ATTENTION_FWD = ("varlen_fwd", "ring_attn_fwd")


def _site_strategies(gm: fx.GraphModule) -> dict[fx.Node, frozenset[str]]:
    """For every node: the collectives (op names) that reach it along a path on which no attention
    forward op lies (an attention op stops the collectives before it: they are its site's).

    One pass in graph (topological) order, each node's set the union of its inputs' sets: O((nodes +
    edges) x k) for k the distinct collective ops, which the registry bounds (a handful). It was a
    networkx descendants walk per upstream collective per attention op, cubic in the graph's size
    (issue 31: a 428 KB file took 268 s to verify)."""
    empty: frozenset[str] = frozenset()
    reach: dict[fx.Node, frozenset[str]] = {}
    unions: dict[tuple[frozenset[str], frozenset[str]], frozenset[str]] = {}
    for node in gm.graph.nodes:
        acc = empty
        inputs = node.all_input_nodes
        work["strategy"] += 1 + len(inputs)
        for p in inputs:
            u = _usp_name(p)
            if u in _ATTENTION_FWD:
                continue  # what fed that attention op is its site's, not this one's
            add = reach.get(p, empty)
            if u in _COLLECTIVE_OPS:
                add = add | {u}
            if add and not add <= acc:
                key = (acc, add)
                acc = unions.get(key) or unions.setdefault(key, acc | add)
        reach[node] = acc
    return reach


def _strategy(node: fx.Node, reach: dict[fx.Node, frozenset[str]]) -> str:
    """The CP strategy of an attention op: the row of the strategy table (`usp_graph.cp.table`)
    whose forward communicates with the collectives that feed it (`_site_strategies`), the
    attention op included when it communicates itself (ring attention)."""
    ops = ({_usp_name(node)} & _COMM_OPS_SET) | reach.get(node, frozenset())
    if not ops:
        return "single"
    return strategy_of(set(ops)) or "unknown (" + ", ".join(sorted(ops)) + ")"


def _reached_from(gm: fx.GraphModule, sources: set[str]) -> set[fx.Node]:
    """Every node a node named in `sources` reaches (themselves included): one pass, O(nodes + edges)."""
    out: set[fx.Node] = set()
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        work["reach"] += 1 + len(inputs)
        if node.name in sources or any(p in out for p in inputs):
            out.add(node)
    return out


def _inputs(
    gm: fx.GraphModule, inputs: Sequence[Any] | None, names: dict[str, str], values: dict[str, int] | None
) -> tuple[list[dict[str, Any]], Any, Any]:
    """(one row per placeholder: name, role, shape, dtype; the documents cu_seqlens holds, and that
    capacity in the example the graph was made with)."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    specs = (
        list(inputs)
        if inputs is not None and len(inputs) == len(placeholders)
        else [None] * len(placeholders)
    )
    inputs_out = []
    capacity = capacity_hint = None
    for n, spec in zip(placeholders, specs, strict=True):
        name, role = _input_role(n, spec)
        vals = _vals(n)
        v = vals[0] if vals else None
        inputs_out.append(
            {
                "name": name,
                "node": n.name,
                "role": role,
                "shape": [_fmt(d, names) for d in _shape(v)] if isinstance(v, torch.Tensor) else None,
                "dtype": str(v.dtype).removeprefix("torch.") if isinstance(v, torch.Tensor) else "SymInt",
            }
        )
        if role == "cu_seqlens" and capacity is None and isinstance(v, torch.Tensor) and v.dim() == 1:
            capacity, capacity_hint = _capacity(v.shape[0], names, values)
    return inputs_out, capacity, capacity_hint


def _attention(
    gm: fx.GraphModule, sites: Any, meta_inputs: list[dict[str, Any]], names: dict[str, str]
) -> list[dict[str, Any]]:
    """One row per attention site: the usp attention ops (shapes, causal, window, strategy, whether
    the metadata reaches them), then the sites kept as SDPA (the tracer's records, or SDPA nodes)."""
    attention = []
    strategies = _site_strategies(gm)
    fed = _reached_from(gm, {m["node"] for m in meta_inputs})
    site_sources = _site_sources(sites)
    for n in gm.graph.nodes:
        u = _usp_name(n)
        if u not in _ATTENTION_FWD or n.meta.get("usp_phase") == "backward":
            continue
        b = bound(n.target, n.args, n.kwargs)
        qs, ks = _shape(b.get("q")), _shape(b.get("k"))
        wl, wr = b.get("window_left", -1), b.get("window_right", -1)
        attention.append(
            {
                "node": n.name,
                "op": f"usp.{u}",
                "site": n.meta.get("usp_site", ""),
                "source": _source(n, site_sources),
                "q_shape": [_fmt(d, names) for d in qs] if qs else None,
                "k_shape": [_fmt(d, names) for d in ks] if ks else None,
                "causal": bool(b.get("is_causal")),
                "window": None if (wl, wr) == (-1, -1) else [_fmt(wl, names), _fmt(wr, names)],
                "gqa": bool(qs and ks and len(qs) > 1 and len(ks) > 1 and qs[1] != ks[1]),
                "strategy": _strategy(n, strategies),
                "metadata_reaches": n in fed,
                "rewritten": True,
                "checkpointed": bool(n.meta.get("usp_checkpointed", False)),
            }
        )
    for s in sites or ():
        if not getattr(s, "rewritable", True) or getattr(s, "reason", None):
            q_shape = getattr(s, "q_shape", None)
            attention.append(
                {
                    "node": _site_name(s),
                    "op": "sdpa",
                    "source": s.source or "",
                    "q_shape": [_fmt(d, names) for d in q_shape] if q_shape else None,
                    "causal": getattr(s, "is_causal", None),
                    "rewritten": False,
                    "reason": s.reason,
                }
            )
    listed = {a["node"] for a in attention}
    for n in gm.graph.nodes:  # SDPA left in a graph that came without site records
        if (
            n.op == "call_function"
            and n.name not in listed
            and any(x in _target_name(n) for x in _SDPA_NAMES)
        ):
            attention.append(
                {"node": n.name, "op": _target_name(n), "source": _source(n, {}), "rewritten": False,
                 "reason": "SDPA left in the graph"}
            )  # fmt: skip
    return attention


def _collectives(
    gm: fx.GraphModule, names: dict[str, str], values: dict[str, int] | None
) -> list[dict[str, Any]]:
    """One row per usp collective: phase, group, bytes per rank, its forward op, and (issued ones)
    where it is waited for and the compute in between."""
    collectives = []
    overlapped = _overlapped(gm)
    for n in gm.graph.nodes:
        u = _usp_name(n)
        if u not in _COMM_OPS:
            continue
        nbytes, size, group = _collective_bytes(n)
        row = {
            "node": n.name,
            "op": f"usp.{u}",
            "phase": n.meta.get("usp_phase", ""),
            "group": group,
            "group_size": size,
            "bytes_per_rank": _fmt(nbytes, names, values),
            "forward_node": n.meta.get("usp_fwd_node"),
        }
        if n.name in overlapped:  # issued: where it is waited for, and the compute in between
            row["wait"], row["overlap_ops"] = overlapped[n.name]
        collectives.append(row)
    return collectives


def summarize(
    gm: fx.GraphModule,
    *,
    sites: Any = None,
    symbols: dict[str, Any] | None = None,
    values: dict[str, int] | None = None,
    inputs: Sequence[Any] | None = None,
    backward: fx.GraphModule | None = None,
    forward_only: bool = False,
) -> dict[str, Any]:
    """Everything inspect shows, as JSON-able data.

    sites: the tracer's `AttentionSite`s (for source locations and not-rewritten reasons).
    symbols: {readable name: SymInt} to print symbolic sizes as e.g. ``T`` instead of ``s27``.
    values: {readable name: int} to evaluate symbolic byte counts (e.g. ``{"T": 4096}``).
    inputs: a graph file's `InputSpec`s, one per placeholder: names and roles for placeholders
    without a ``usp_input`` tag (a torch.compile dump's ``primals_N``).
    backward: the graph holding `gm`'s backward when it is another graph (a compile dump's
    backward.uspg next to its forward.uspg): its nodes' ``usp_fwd_node`` tags name `gm`'s nodes,
    and pairing looks there. forward_only: `gm` is a forward graph whose backward is not given;
    pairing is not checked (``pairing_checked`` False) rather than reported missing.
    """
    names = {str(v): k for k, v in (symbols or {}).items()}

    inputs, capacity, capacity_hint = _inputs(gm, inputs, names, values)
    meta_inputs = [i for i in inputs if i["role"] in ("cu_seqlens", "max_seqlen")]

    attention = _attention(gm, sites, meta_inputs, names)
    collectives = _collectives(gm, names, values)
    pairing, unpaired = _pairing(gm, backward) if not (forward_only and backward is None) else ([], [])
    counts = Counter(_target_name(n) for n in gm.graph.nodes if n.op == "call_function")
    passes = Counter(n.meta.get("usp_pass", "?") for n in gm.graph.nodes)
    return {
        "inputs": inputs,
        # capacity: documents cu_seqlens holds (an int, or an expression such as "N1 - 1" when the
        # graph takes any capacity); capacity_hint: its value in the example the graph was made with
        "metadata": {"inputs": meta_inputs, "capacity": capacity, "capacity_hint": capacity_hint},
        "attention": attention,
        "collectives": collectives,
        "pairing": pairing,
        "unpaired": unpaired,
        "pairing_checked": not (forward_only and backward is None),
        "critical_path_comm": _critical_comm(gm),
        "op_counts": dict(sorted(counts.items())),
        "created_by_pass": dict(sorted(passes.items())),
        "nodes": len(gm.graph.nodes),
    }


# usp_input tag kinds (traced train steps) for graph-file input roles (compile dumps)
_ROLE_KIND = {"parameter": "param", "buffer": "buffer", "batch": "batch", "tangent": "tangent"}


def _input_role(node: fx.Node, spec: Any) -> tuple[str, str]:
    """(name, role) of a placeholder: its ``usp_input`` tag, else its graph file `InputSpec`."""
    info = node.meta.get("usp_input")
    if info:
        return info.get("name", node.name), info.get("kind", "input")
    if spec is None:
        return node.name, "input"
    role = _ROLE_KIND.get(spec.role, "input")
    if spec.role == "metadata" and spec.name in ("cu_seqlens", "max_seqlen"):
        role = spec.name
    return spec.name, role


def _capacity(entries: Any, names: dict[str, str], values: dict[str, int] | None) -> tuple[Any, int | None]:
    """(capacity, its example value) from the number of cu_seqlens entries (capacity + 1)."""
    if isinstance(entries, int):
        return entries - 1, entries - 1
    capacity = _fmt(entries - 1, names, values)
    if isinstance(capacity, int):
        return capacity, capacity
    hint = entries.node.hint if isinstance(entries, torch.SymInt) else None
    return capacity, None if hint is None else int(hint) - 1


def _site_name(site: Any) -> str | None:
    """A site record's node name: `AttentionSite.node.name` (traced) or `.name` (loaded)."""
    node = getattr(site, "node", None)
    return getattr(node, "name", None) if node is not None else getattr(site, "name", None)


def _site_sources(sites: Any) -> dict[Any, str]:
    """{site record's node name: its source}, the first record of each name winning."""
    out: dict[Any, str] = {}
    for s in sites or ():
        name = _site_name(s)
        if isinstance(name, str) and name not in out:
            out[name] = s.source or ""
    return out


def _source(node: fx.Node, site_sources: dict[Any, str]) -> str:
    site = node.meta.get("usp_site")
    if isinstance(site, str) and site in site_sources:
        return site_sources[site]
    src = node.meta.get("usp_source") or node.meta.get("source")
    if isinstance(src, str) and src:
        return src
    trace = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in trace.splitlines() if ln.strip().startswith("File ")]
    return lines[-1] if lines else ""


class MalformedGraphError(ValueError):
    """What a graph says of itself contradicts the graph (a graph file's metadata, which anyone
    may have written): the CLI reports it as an unreadable file (exit 2)."""


def _check_outputs(gm: fx.GraphModule) -> None:
    """``usp_outputs`` (pairing skips ops that do not feed the first, the loss) names the outputs
    the graph returns: one name per returned value."""
    names = gm.meta.get("usp_outputs")
    if names is None:
        return
    out = gm.graph.find_nodes(op="output")
    values = out[0].args[0] if out and out[0].args else None
    if not isinstance(values, (tuple, list)) or len(values) != len(names) or not names:
        got = f"{len(values)} values" if isinstance(values, (tuple, list)) else "one value, not a tuple"
        raise MalformedGraphError(
            f"graph.meta.usp_outputs names {len(names)} outputs but the graph returns {got}; the file was "
            "edited or damaged: re-save it"
        )


def _pairing(
    gm: fx.GraphModule, backward: fx.GraphModule | None = None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """`usp_graph.passes.pairing` (the verify pass's analysis) as rows: forward usp ops with a rule
    whose backward op (or adjoint collective) is in the backward, in `gm` itself and in `backward`
    when the backward is another graph; and those whose backward is missing."""
    _check_outputs(gm)
    result = pair_backward(gm, backward)
    pairs = [
        {"forward": p.forward.name, "backward": [b.name for b in p.backward], "op": _op_label(p.forward)}
        for p in result.pairs
    ]
    unpaired = [{"node": u.node.name, "op": _op_label(u.node), "missing": u.missing} for u in result.unpaired]
    return pairs, unpaired


def _critical_comm(gm: fx.GraphModule) -> list[str]:
    """Collectives on the longest dependency chain (by edge count) through the graph: one pass in
    graph order, O(nodes + edges); ties go to the input listed first."""
    depth: dict[fx.Node, int] = {}
    prev: dict[fx.Node, fx.Node | None] = {}
    end = None
    for node in gm.graph.nodes:
        inputs = node.all_input_nodes
        work["critical"] += 1 + len(inputs)
        best = max(inputs, key=depth.__getitem__, default=None)
        depth[node] = depth[best] + 1 if best is not None else 0
        prev[node] = best
        if end is None or depth[node] > depth[end]:
            end = node
    path = []
    while end is not None:
        if _usp_name(end) in _COMM_OPS:
            path.append(end.name)
        end = prev[end]
    return path[::-1]


def to_dot(gm: fx.GraphModule, summary: dict[str, Any] | None = None) -> str:
    """Graphviz DOT of the data flow; attention ops and collectives highlighted."""
    g = to_networkx(gm)
    colors = {"varlen_fwd": "gold", "varlen_bwd": "orange", "ring_attn_fwd": "gold", "ring_attn_bwd": "orange",
              "all_to_all": "lightblue", "all_gather": "lightblue", "reduce_scatter": "lightblue"}  # fmt: skip
    out = ["digraph usp_graph {", "  node [shape=box, fontsize=10];"]
    for v, d in g.nodes(data=True):
        label = f"{v}\\n{d['target']}".replace('"', "'")
        style = f', style=filled, fillcolor="{colors[d["usp"]]}"' if d["usp"] in colors else ""
        out.append(f'  "{v}" [label="{label}"{style}];')
    for a, b in g.edges():
        out.append(f'  "{a}" -> "{b}";')
    out.append("}")
    return "\n".join(out) + "\n"


def diff(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What changed between two summaries: op counts, attention sites, collectives, inputs."""

    def keyed(items, key):
        return {key(i): i for i in items}

    ops = {
        op: (a["op_counts"].get(op, 0), b["op_counts"].get(op, 0))
        for op in sorted(set(a["op_counts"]) | set(b["op_counts"]))
        if a["op_counts"].get(op, 0) != b["op_counts"].get(op, 0)
    }
    ia, ib = keyed(a["inputs"], lambda i: i["name"]), keyed(b["inputs"], lambda i: i["name"])
    inputs = {
        "added": sorted(set(ib) - set(ia)),
        "removed": sorted(set(ia) - set(ib)),
        "changed": sorted(n for n in set(ia) & set(ib) if ia[n] != ib[n]),
    }

    def sig(x):
        return (x.get("op"), x.get("causal"), x.get("strategy"), str(x.get("q_shape")), x.get("rewritten"))

    sites = {"a": Counter(map(sig, a["attention"])), "b": Counter(map(sig, b["attention"]))}
    coll = {
        "a": Counter((c["op"], c["phase"]) for c in a["collectives"]),
        "b": Counter((c["op"], c["phase"]) for c in b["collectives"]),
    }
    return {
        "op_counts": {k: {"a": v[0], "b": v[1]} for k, v in ops.items()},
        "inputs": inputs,
        "attention": {
            "only_a": [list(k) for k in (sites["a"] - sites["b"]).elements()],
            "only_b": [list(k) for k in (sites["b"] - sites["a"]).elements()],
        },
        "collectives": {
            "a": {f"{k[0]} ({k[1]})": v for k, v in coll["a"].items()},
            "b": {f"{k[0]} ({k[1]})": v for k, v in coll["b"].items()},
        },
        "same": not ops and not any(inputs.values()) and sites["a"] == sites["b"] and coll["a"] == coll["b"],
    }


def human_bytes(n: int | str | None) -> str:
    if n is None:
        return "?"
    if isinstance(n, str):
        return f"{n} B"
    if n <= 0:
        return f"{n} B"
    if n >= 1024**5:  # integer arithmetic: a file's sizes can be past what a float holds
        digits = str(n // 1024**4)
        return f"{digits} TiB" if len(digits) <= 12 else f"{digits[0]}.{digits[1:3]}e{len(digits) - 1} TiB"
    exp = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024**exp:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][exp]}"
