"""Writing graph files: any FX graph -> the JSON document (`build_document`, `save_graph_module`).

Every symbolic size is named: the caller's dim names first (``T``, ``max_seqlen``), else the
tracer's own symbol prefixed with ``$``; the symbol table keeps each one's example value (hint)
and range. Calls outside the allowlist, module/method calls and non-tensor attributes are refused
here, so nothing is written that a reader would refuse.
"""

from __future__ import annotations

import keyword
import os
import platform
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx

from ..signature import symbol_range
from ..version import __version__ as USP_VERSION
from . import document
from .allowlist import target_name
from .exprs import encode_expr
from .groups import record_groups
from .specs import IDENT, KINDS, META_KEY, OPS, ROLES, SOURCE, InputSpec
from .values import dtype_name, encode_arg, encode_tensor_data

__all__ = ["build_document", "save_graph_module"]


def _symints(v: Any) -> list[torch.SymInt]:
    if isinstance(v, torch.SymInt):
        return [v]
    if isinstance(v, torch.Tensor):
        return [d for d in v.shape if isinstance(d, torch.SymInt)]
    if isinstance(v, (list, tuple)):
        return [s for x in v for s in _symints(x)]
    return []


def _node_val(node: fx.Node) -> Any:
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _hint(env: Any, sym: sympy.Symbol) -> int | None:
    table = getattr(env, "backed_var_to_val", None)
    if table is None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            table = env.var_to_val
    value = table.get(sym)
    try:
        return None if value is None else int(value)
    except (TypeError, ValueError):
        return None


def _range(env: Any, sym: sympy.Symbol) -> tuple[int, int | None]:
    return symbol_range(env, sym) if env is not None else (0, None)


def _plain(v: Any, depth: int = 0) -> Any:
    """A JSON-plain copy of a metadata value, or raise TypeError."""
    if depth > 8:
        raise TypeError("too deep")
    if v is None or isinstance(v, (bool, int, str)):
        return v
    if isinstance(v, float):
        if v != v or v in (float("inf"), float("-inf")):
            raise TypeError("non-finite")
        return v
    if isinstance(v, (list, tuple)):
        return [_plain(x, depth + 1) for x in v]
    if isinstance(v, Mapping) and all(isinstance(k, str) for k in v):
        return {k: _plain(x, depth + 1) for k, x in v.items()}
    raise TypeError(type(v).__name__)


class _Namer:
    """Gives every sympy symbol in the graph a name: the caller's dim names first, else its own
    name prefixed with ``$`` (internal symbols of the tracer)."""

    def __init__(self, symbols: Mapping[str, Any] | None) -> None:
        self.names: dict[sympy.Symbol, str] = {}
        self.env: Any = None
        for name, s in (symbols or {}).items():
            if not isinstance(name, str) or not IDENT.fullmatch(name):
                raise ValueError(f"symbol names must be identifiers, got {name!r}")
            expr = s.node.expr if isinstance(s, torch.SymInt) else s
            if isinstance(s, torch.SymInt):
                self.env = self.env or s.node.shape_env
            if not isinstance(expr, sympy.Symbol):
                raise ValueError(
                    f"symbols[{name!r}] must be a SymInt of one symbol or a sympy.Symbol, got {s!r}"
                )
            self.names[expr] = name

    def see(self, v: Any) -> None:
        for s in _symints(v):
            self.env = self.env or s.node.shape_env
            for sym in s.node.expr.free_symbols:
                if sym not in self.names:
                    self.names[sym] = "$" + str(sym)

    def declare(self, name: str) -> None:
        """Make sure a caller dim name has a symbol (a dim named only in an InputSpec)."""
        if name not in self.names.values():
            self.names[sympy.Symbol(name, integer=True)] = name

    def expr(self, e: Any) -> Any:
        for sym in getattr(e, "free_symbols", ()):
            if sym not in self.names:
                self.names[sym] = "$" + str(sym)
        return encode_expr(e, self.names)


def _encode_dim(d: Any, namer: _Namer, named: bool) -> Any:
    """A dim as JSON. `named`: str dims / sympy symbols are caller dim names (InputSpec)."""
    if isinstance(d, torch.SymInt):
        return namer.expr(d.node.expr)
    if isinstance(d, bool):
        raise ValueError(f"a dim cannot be a bool ({d})")
    if isinstance(d, int):
        return int(d)
    if isinstance(d, str) and named:
        if not IDENT.fullmatch(d):
            raise ValueError(f"dim names must be identifiers, got {d!r}")
        namer.declare(d)
        return d
    if isinstance(d, sympy.Basic) and named:
        for s in d.free_symbols:
            namer.declare(s.name)
        return encode_expr(d, {s: s.name for s in d.free_symbols})
    if isinstance(d, sympy.Basic):
        return namer.expr(d)
    raise ValueError(f"a dim must be an int, a dim name or an expression, got {d!r}")


def _encode_val(v: Any, namer: _Namer) -> Any:
    if isinstance(v, torch.Tensor):
        return {
            "tensor": {
                "dtype": dtype_name(v.dtype),
                "shape": [_encode_dim(d, namer, False) for d in v.shape],
                "device": str(v.device),
            }
        }
    if isinstance(v, torch.SymInt):
        return {"symint": namer.expr(v.node.expr)}
    if isinstance(v, bool):
        return {"bool": v}
    if isinstance(v, int):
        return {"int": int(v)}
    if isinstance(v, (list, tuple)):
        return [_encode_val(x, namer) for x in v]
    return None


def _derive_input(node: fx.Node) -> InputSpec:
    tag = node.meta.get("usp_input") or {}
    kind_role = {"param": "parameter", "buffer": "buffer", "batch": "batch"}
    role = kind_role.get(
        tag.get("kind"), "metadata" if tag.get("kind") in ("cu_seqlens", "max_seqlen") else "input"
    )
    name = tag.get("name", node.name)
    v = _node_val(node)
    trainable = tag.get("trainable") if role == "parameter" else None
    if isinstance(v, torch.Tensor):
        return InputSpec(name, role, "tensor", v.dtype, tuple(v.shape), v.device, trainable=trainable)
    if isinstance(v, torch.SymInt):
        return InputSpec(name, role, "symint", value=v)  # type: ignore[arg-type]
    if isinstance(v, bool):
        return InputSpec(name, role, "bool")
    if isinstance(v, int):
        return InputSpec(name, role, "int")
    if isinstance(v, float):
        return InputSpec(name, role, "float")
    return InputSpec(name, role, "any")


def _encode_input(spec: InputSpec, node: fx.Node, namer: _Namer) -> dict[str, Any]:
    if not isinstance(spec, InputSpec):
        raise TypeError(f"inputs must be InputSpec records, got {type(spec).__name__}")
    if spec.role not in ROLES:
        raise ValueError(f"input {spec.name!r}: role must be one of {ROLES}, got {spec.role!r}")
    if spec.kind not in KINDS:
        raise ValueError(f"input {spec.name!r}: kind must be one of {KINDS}, got {spec.kind!r}")
    out: dict[str, Any] = {"node": node.name, "name": spec.name, "role": spec.role, "kind": spec.kind}
    named = True
    if spec.kind == "tensor":
        if spec.dtype is None or spec.shape is None or spec.device is None:
            raise ValueError(f"input {spec.name!r}: a tensor input needs dtype, shape and device")
        out["dtype"] = dtype_name(spec.dtype)
        out["shape"] = [_encode_dim(d, namer, named and not isinstance(d, torch.SymInt)) for d in spec.shape]
        out["device"] = str(torch.device(spec.device))
    elif spec.kind == "symint" and spec.value is not None:
        out["value"] = _encode_dim(spec.value, namer, not isinstance(spec.value, torch.SymInt))
    if spec.trainable is not None:
        out["trainable"] = bool(spec.trainable)
    return out


def _encode_node(node: fx.Node, namer: _Namer, constants: dict[str, Any], root: Any) -> dict[str, Any]:
    where = f"node {node.name}"
    if node.op not in OPS:
        raise ValueError(
            f"{where} is a {node.op} node; graph files hold placeholder, call_function, get_attr and output "
            "nodes only (inline modules and methods first, e.g. trace with make_fx)"
        )
    out: dict[str, Any] = {"name": node.name, "op": node.op}
    if node.op == "call_function":
        out["target"] = target_name(node.target)
    elif node.op == "get_attr":
        value = _get_attr(root, node.target)
        if not isinstance(value, torch.Tensor):
            raise ValueError(f"{where} reads attribute {node.target!r}, which is not a tensor")
        key = str(node.target).replace(".", "__")
        if not IDENT.fullmatch(key) or keyword.iskeyword(key):
            raise ValueError(f"{where} reads attribute {node.target!r}, whose name is not an identifier")
        try:
            constants[key] = encode_tensor_data(value)
        except ValueError as e:
            raise ValueError(f"{where} reads constant {node.target!r}: {e}") from None
        out["target"] = key
    elif node.op == "placeholder" and node.target != node.name:
        out["target"] = node.target
    if node.args:
        out["args"] = [encode_arg(a, where) for a in node.args]
    if node.kwargs:
        out["kwargs"] = {k: encode_arg(v, where) for k, v in node.kwargs.items()}
    meta: dict[str, Any] = {}
    for k, v in node.meta.items():
        if META_KEY.fullmatch(k):
            try:
                meta[k] = _plain(v)
            except TypeError:
                pass  # not plain data: not worth a format of its own
    from ..sites import source_location

    src = source_location(node) if node.meta.get("stack_trace") else None
    if src and SOURCE.fullmatch(src):
        meta["source"] = src
    val = _node_val(node)
    if val is not None:
        namer.see(val)
        encoded = _encode_val(val, namer)
        if encoded is not None:
            meta["val"] = encoded
    if meta:
        out["meta"] = meta
    return out


def _get_attr(root: Any, target: str) -> Any:
    obj = root
    for part in str(target).split("."):
        obj = getattr(obj, part)
    return obj


def build_document(
    gm: fx.GraphModule,
    *,
    kind: str,
    inputs: Sequence[InputSpec] | None = None,
    symbols: Mapping[str, Any] | None = None,
    guards: Sequence[tuple[Any, str]] | None = None,
    ranges: Mapping[str, tuple[int, int | None]] | None = None,
    meta: Mapping[str, Any] | None = None,
    section: Callable[[Callable[[Any], Any]], dict[str, Any]] | None = None,
) -> dict[str, Any]:
    """The JSON document for `gm` (fingerprint included). `section(encode_expr)` adds the
    kind-specific part, encoding expressions with the same symbol names as the graph."""
    if not isinstance(gm, fx.GraphModule):
        raise TypeError(f"expected a torch.fx.GraphModule, got {type(gm).__name__}")
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    if inputs is None:
        inputs = [_derive_input(p) for p in placeholders]
    inputs = list(inputs)
    if len(inputs) != len(placeholders):
        raise ValueError(f"inputs has {len(inputs)} specs but the graph has {len(placeholders)} placeholders")
    namer = _Namer(symbols)
    for p in placeholders:
        namer.see(_node_val(p))
    constants: dict[str, Any] = {}
    nodes = [_encode_node(n, namer, constants, gm) for n in gm.graph.nodes]
    encoded_inputs = [_encode_input(s, p, namer) for s, p in zip(inputs, placeholders, strict=True)]
    graph_meta = {}
    for k, v in gm.meta.items():
        if META_KEY.fullmatch(str(k)):
            try:
                graph_meta[k] = _plain(v)
            except TypeError:
                pass
    extra = section(namer.expr) if section is not None else None
    env = namer.env
    if guards is None:
        guards = []
        if env is not None:
            for g in env.guards:
                if g.expr.free_symbols <= set(namer.names):
                    guards.append((g.expr, str(getattr(g, "sloc", "") or "")))
    encoded_guards = [[namer.expr(e), str(w)] for e, w in guards]
    by_name = {n: s for s, n in namer.names.items()}
    sym_table: dict[str, Any] = {}
    for name in sorted(by_name, key=lambda n: (n.startswith("$"), n)):
        sym = by_name[name]
        lo, hi = (ranges or {}).get(name) or _range(env, sym)
        sym_table[name] = {"hint": _hint(env, sym) if env is not None else None, "min": lo, "max": hi}
    world = record_groups(gm)
    if meta is not None:
        try:
            user_meta = _plain(dict(meta))
        except TypeError as e:
            raise ValueError(
                f"meta must be JSON-plain data (str keys; str/int/float/bool/None/lists/dicts): {e}"
            ) from None
    else:
        user_meta = {}
    doc: dict[str, Any] = {
        "format": document.FORMAT,
        "format_version": document.FORMAT_VERSION,
        "kind": kind,
        "versions": {
            "torch": torch.__version__,
            "usp_graph": USP_VERSION,
            "python": platform.python_version(),
        },
        "symbols": sym_table,
        "guards": encoded_guards,
        "inputs": encoded_inputs,
        "world": None
        if world is None
        else {
            "size": world.size,
            "rank": world.rank,
            "groups": [{"name": g.name, "ranks": list(g.ranks)} for g in world.groups],
        },
        "graph": {"nodes": nodes, "meta": graph_meta},
        "constants": constants,
        "meta": user_meta,
    }
    if extra is not None:
        doc[kind] = extra
    doc["fingerprint"] = document.fingerprint(doc)
    return doc


def save_graph_module(
    gm: fx.GraphModule,
    path: str | os.PathLike[str],
    *,
    inputs: Sequence[InputSpec] | None = None,
    symbols: Mapping[str, Any] | None = None,
    meta: Mapping[str, Any] | None = None,
) -> str:
    """Write any FX graph (a forward or backward graph from a torch.compile backend, a joint graph,
    ...) to `path` as a graph file; returns its fingerprint.

    inputs: one `InputSpec` per placeholder (default: derived from each placeholder's fake value
    and ``meta["usp_input"]`` tag). symbols: ``{dim name: SymInt or sympy.Symbol}`` to name
    symbolic sizes (default: the tracer's own names, e.g. ``$s27``). meta: JSON-plain data kept
    with the file (e.g. ``{"stage": "backward", "compile_id": "0/1"}``).
    Raises ValueError for a graph a file cannot hold (a call outside the allowlist, a module call).
    """
    doc = build_document(gm, kind="graph_module", inputs=inputs, symbols=symbols, meta=meta)
    document.write_atomic(path, document.dumps(doc))
    return doc["fingerprint"]
