"""Reading graph files: the checked JSON document -> a `GraphFile` (`read_document`,
`load_graph_module`).

Every field is validated before it is used; node targets go through the allowlist and their
arguments through the op's schema; nothing from the file is executed, imported or unpickled.
Names, targets and source locations must be plain identifiers / ``file:line in function``, so no
file content reaches FX's generated code except as data.
"""

from __future__ import annotations

import json
import keyword
import os
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import registry
from ..ops.collectives import wait_args
from ..signature import check_bindings, evaluate_recorded
from ..version import __version__ as USP_VERSION
from . import document
from .allowlist import check_call, resolve_target, result_kind
from .collective_args import check_collectives
from .errors import GraphFileError, GraphFileSchemaError, GraphFileVersionError, GraphFileVersionWarning
from .exprs import SYMBOL_NAME, ExprDecoder
from .groups import GroupSpec, WorldSpec, rename_groups, resolve_groups
from .optable import check_static
from .replay import ReplayGraphModule
from .specs import GRAPH_META, IDENT, KINDS, META_KEY, NODE_META, OPS, ROLES, SOURCE, Dim, InputSpec
from .values import decode_arg, decode_device, decode_dtype, decode_tensor_data, dtype_name

__all__ = ["GraphFile", "read_document", "load_graph_module", "loads_graph_module"]


# Symbolic sizes a file may declare: traced graphs have a handful (T, N1, max_seqlen, one per
# dynamic dim); each costs a ShapeEnv symbol to rebuild.
MAX_SYMBOLS = 256


def _schema(where: str, msg: str) -> GraphFileSchemaError:
    return GraphFileSchemaError(f"{where}: {msg}")


def _field(d: Any, key: str, types: type | tuple[type, ...], where: str, *, optional: bool = False) -> Any:
    if not isinstance(d, dict):
        raise _schema(where, f"expected an object, got {type(d).__name__}")
    if key not in d:
        if optional:
            return None
        raise _schema(where, f"missing field {key!r}")
    v = d[key]
    if isinstance(v, bool) and bool not in (types if isinstance(types, tuple) else (types,)):
        raise _schema(f"{where}.{key}", f"expected {_tname(types)}, got a bool")
    if not isinstance(v, types):
        raise _schema(f"{where}.{key}", f"expected {_tname(types)}, got {type(v).__name__}")
    return v


def _tname(types: type | tuple[type, ...]) -> str:
    ts = types if isinstance(types, tuple) else (types,)
    return " or ".join({dict: "an object", list: "a list", str: "a string", int: "an int", bool: "a bool",
                        float: "a number", type(None): "null"}.get(t, t.__name__) for t in ts)  # fmt: skip


def _only_keys(d: dict[str, Any], allowed: set[str], where: str) -> None:
    extra = sorted(set(d) - allowed)
    if extra:
        raise _schema(where, f"unknown field(s) {[e[:40] for e in extra[:5]]}")


def _evaluate(expr: Any, where: str, fn: Callable[..., Any], *args: Any) -> Any:
    return evaluate_recorded(str(expr), where, fn, *args, error=GraphFileSchemaError)


@dataclass(eq=False)
class GraphFile:
    """A loaded graph file.

    graph_module: the rebuilt graph (node names, targets, args, kwargs, kept metadata, fake values).
    kind: ``"train_step"`` or ``"graph_module"``. inputs: one `InputSpec` per placeholder.
    symbols: ``{name: SymInt}`` of the rebuilt fake values (pass it to
    ``usp_graph.analysis.summarize(gm, symbols=...)``; empty when read with ``values=False``: no fake
    values, no ShapeEnv); dims: ``{name: sympy symbol}`` those SymInts are expressions of (without
    values, plain sympy symbols of those names). hints: ``{name: the traced size or None}``. ranges: ``{name: (lo, hi)}``; guards: ``(condition over dims, where)``.
    world: the process groups of a CP graph (None without collectives). meta: the caller's data.
    versions / fingerprint: who wrote it and its content hash. section: the kind-specific JSON.
    """

    graph_module: fx.GraphModule
    kind: str
    inputs: tuple[InputSpec, ...]
    symbols: dict[str, torch.SymInt]
    dims: dict[str, sympy.Symbol]
    hints: dict[str, int | None]
    ranges: dict[str, tuple[int, int | None]]
    guards: tuple[tuple[sympy.Basic, str], ...]
    world: WorldSpec | None
    meta: dict[str, Any]
    versions: dict[str, str]
    fingerprint: str
    section: Any = None
    path: str | None = None
    _bound: dict[str, str] | None = field(default=None, repr=False)
    _exprs: ExprDecoder | None = field(default=None, repr=False)  # issue 17: one memo and budget a file

    def __repr__(self) -> str:
        where = f" from {self.path}" if self.path else ""
        return (
            f"GraphFile({self.kind}{where}, {len(self.graph_module.graph.nodes)} nodes, "
            f"{len(self.inputs)} inputs, dims {sorted(self.dims)}, {self.fingerprint[:19]}...)"
        )

    def expr(self, data: Any, where: str) -> sympy.Basic:
        """Decode an expression of this file's symbols (for kind-specific sections)."""
        # issue 17: identical expressions decode once; all of a file's together stay within
        # exprs.MAX_FILE_WORK (each one is bounded in size, degree and nesting by decode_expr).
        if self._exprs is None:
            self._exprs = ExprDecoder(self._symbol)
        return self._exprs.decode(data, where)

    def _symbol(self, where: str) -> Callable[[str], sympy.Basic]:
        def get(name: str) -> sympy.Basic:
            if name not in self.dims:
                raise _schema(where, f"symbol {name[:40]!r} is not declared in the file's symbols")
            return self.dims[name]

        return get

    def bind_groups(self, groups: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Map the recorded process groups to this process's (see `usp_graph.graphfile.groups`) and
        rewrite the graph's group names; returns ``{recorded name: live name}``. Runs once; the
        first call to the graph does it implicitly."""
        if self.world is None:
            return {}
        if self._bound is None:
            mapping = resolve_groups(self.world, groups)
            rename_groups(self.graph_module, mapping)
            self._bound = mapping
        elif groups:
            raise GraphFileError("process groups are already bound; pass groups= before the first call")
        return dict(self._bound)

    def check_inputs(self, args: Sequence[Any]) -> None:
        """Validate positional inputs against the specs, symbol ranges and guards (ValueError/TypeError
        naming the input)."""
        if len(args) != len(self.inputs):
            raise TypeError(
                f"the graph takes {len(self.inputs)} inputs ({', '.join(s.name for s in self.inputs)}), got {len(args)}"
            )
        bound: dict[str, tuple[int, str]] = {}
        deferred: list[tuple[sympy.Basic, int, str]] = []

        def bind(dim: Dim, size: int, where: str) -> None:
            if isinstance(dim, int):
                if size != dim:
                    raise ValueError(f"{where} is {size}, the graph was saved for {dim} (a static size)")
            elif isinstance(dim, str):
                if dim in bound and bound[dim][0] != size:
                    raise ValueError(f"{where} is {size} but {dim} is {bound[dim][0]} from {bound[dim][1]}")
                bound.setdefault(dim, (size, where))
            else:
                deferred.append((dim, size, where))

        for spec, a in zip(self.inputs, args, strict=True):
            where = f"input {spec.name!r}"
            if spec.kind == "tensor":
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{where} must be a torch.Tensor, got {type(a).__name__}")
                shape = spec.shape or ()
                if a.dim() != len(shape):
                    raise ValueError(
                        f"{where} has shape {tuple(a.shape)}, expected {len(shape)} dims like {shape}"
                    )
                if a.dtype != spec.dtype:
                    raise ValueError(f"{where} has dtype {a.dtype}, the graph was saved with {spec.dtype}")
                if a.device != spec.device:
                    raise ValueError(f"{where} is on {a.device}, the graph was saved for {spec.device}")
                for d, (size, dim) in enumerate(zip(a.shape, shape, strict=True)):
                    bind(dim, int(size), f"{where} dim {d}")
            elif spec.kind in ("symint", "int"):
                if isinstance(a, bool) or not isinstance(a, int):
                    raise TypeError(f"{where} must be an int, got {type(a).__name__}")
                if spec.value is not None:
                    bind(spec.value, a, where)
            elif spec.kind == "float" and not isinstance(a, (int, float)):
                raise TypeError(f"{where} must be a float, got {type(a).__name__}")
            elif spec.kind == "bool" and not isinstance(a, bool):
                raise TypeError(f"{where} must be a bool, got {type(a).__name__}")
            elif spec.kind == "none" and a is not None:
                raise TypeError(f"{where} must be None, got {type(a).__name__}")
        # Ranges and guards: the one check train steps use too.
        check_bindings(
            bound,
            symbols=self.dims,
            ranges=self.ranges,
            guards=self.guards,
            saved=True,
            error=GraphFileSchemaError,
        )
        named = {sympy.Symbol(n, integer=True): sympy.Integer(v) for n, (v, _) in bound.items()}
        named.update({sympy.Symbol(n): sympy.Integer(v) for n, (v, _) in bound.items()})
        for expr, size, where in deferred:
            value = _evaluate(expr, where, expr.xreplace, named)
            if not value.free_symbols and _evaluate(expr, where, int, value) != size:
                raise ValueError(
                    f"{where} is {size}, but the graph was saved for {expr} = {value} with these inputs"
                )

    def __call__(self, *args: Any) -> Any:
        """Validate `args` against the inputs, bind process groups (first call), run the graph."""
        self.check_inputs(args)
        self.bind_groups()
        with torch.no_grad():
            return self.graph_module(*args)


def _decode_dim(data: Any, f: GraphFile, where: str, named: bool) -> Any:
    """A dim from JSON: int, or (named) a dim name / sympy expr over Symbol(name, integer=True)."""
    if isinstance(data, bool):
        raise _schema(where, "a dim cannot be a bool")
    if isinstance(data, int):
        if data < 0 or data >= 2**62:
            raise _schema(where, f"dim {data} out of range")
        return data
    expr = f.expr(data, where)
    if expr.is_Integer:
        return int(expr)
    if not named:
        return expr
    if isinstance(data, str):
        return data
    return expr.xreplace({sym: sympy.Symbol(n, integer=True) for n, sym in f.dims.items()})


def _decode_input(data: Any, f: GraphFile, where: str) -> InputSpec:
    _field(data, "name", str, where)
    _only_keys(
        data, {"node", "name", "role", "kind", "dtype", "shape", "device", "value", "trainable"}, where
    )
    node = _field(data, "node", str, where)
    role = _field(data, "role", str, where)
    kind = _field(data, "kind", str, where)
    if role not in ROLES:
        raise _schema(f"{where}.role", f"{role[:40]!r} is not one of {ROLES}")
    if kind not in KINDS:
        raise _schema(f"{where}.kind", f"{kind[:40]!r} is not one of {KINDS}")
    spec = InputSpec(data["name"], role, kind, node=node)
    if kind == "tensor":
        shape = _field(data, "shape", list, where)
        spec = replace(
            spec,
            dtype=decode_dtype(_field(data, "dtype", str, where), f"{where}.dtype"),
            shape=tuple(_decode_dim(d, f, f"{where}.shape[{i}]", True) for i, d in enumerate(shape)),
            device=decode_device(_field(data, "device", str, where), f"{where}.device"),
        )
    if "value" in data:
        if kind != "symint":
            raise _schema(where, "only symint inputs have a value")
        spec = replace(spec, value=_decode_dim(data["value"], f, f"{where}.value", True))
    trainable = _field(data, "trainable", bool, where, optional=True)
    if trainable is not None:
        spec = replace(spec, trainable=trainable)
    return spec


class _FakeValues:
    """Rebuilds meta["val"] fake tensors / SymInts over the file's ShapeEnv (cached by description)."""

    def __init__(self, f: GraphFile, env: Any) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.f = f
        self.env = env
        self.mode = FakeTensorMode(shape_env=env, allow_non_fake_inputs=False)
        self.hints = {f.dims[n]: sympy.Integer(h) for n, h in f.hints.items() if h is not None}
        self.cache: dict[str, Any] = {}

    def symint(self, expr: sympy.Basic, where: str) -> Any:
        if expr.is_Integer:
            return int(expr)
        hint = expr.xreplace(self.hints)
        try:
            return self.env.create_symintnode(expr, hint=int(hint) if hint.is_Integer else None)
        except (TypeError, ValueError, AssertionError, RuntimeError) as e:
            raise _schema(where, f"cannot build a symbolic size {expr}: {e}") from None

    def val(self, data: Any, where: str, depth: int = 0) -> Any:
        if depth > 8:
            raise _schema(where, "values nested too deep")
        if data is None:
            return None
        if isinstance(data, list):
            return [self.val(x, f"{where}[{i}]", depth + 1) for i, x in enumerate(data)]
        if not isinstance(data, dict) or len(data) != 1:
            raise _schema(where, "a value is null, a list, or one of {tensor, symint, int, bool}")
        ((tag, v),) = data.items()
        if tag == "int":
            if isinstance(v, bool) or not isinstance(v, int):
                raise _schema(where, "an int value holds an int")
            return v
        if tag == "bool":
            if not isinstance(v, bool):
                raise _schema(where, "a bool value holds a bool")
            return v
        if tag == "symint":
            return self.symint(self.f.expr(v, where), where)
        if tag != "tensor":
            raise _schema(where, f"unknown value tag {tag[:40]!r}")
        key = json.dumps(v, sort_keys=True)
        if key in self.cache:
            return self.cache[key]
        if not isinstance(v, dict):
            raise _schema(where, "a tensor value is an object")
        _only_keys(v, {"dtype", "shape", "device"}, where)
        dtype = decode_dtype(_field(v, "dtype", str, where), f"{where}.dtype")
        device = decode_device(_field(v, "device", str, where), f"{where}.device")
        dims = _field(v, "shape", list, where)
        if len(dims) > 64:
            raise _schema(where, "more than 64 dims")
        shape = []
        for i, d in enumerate(dims):
            e = _decode_dim(d, self.f, f"{where}.shape[{i}]", False)
            shape.append(e if isinstance(e, int) else self.symint(e, f"{where}.shape[{i}]"))
        try:
            with self.mode:
                t = torch.empty(shape, dtype=dtype, device=device)
        except (RuntimeError, TypeError, ValueError, AssertionError) as e:
            raise _schema(
                where, f"cannot rebuild a fake {dtype_name(dtype)} tensor of shape {shape} on {device}: {e}"
            ) from None
        self.cache[key] = t
        return t


def _check_versions(versions: dict[str, Any], strict: bool, source: str) -> None:
    mismatched = [
        f"{what} {versions.get(what)!r} (this process: {mine})"
        for what, mine in (("torch", torch.__version__), ("usp_graph", USP_VERSION))
        if versions.get(what) != mine
    ]
    if not mismatched:
        return
    msg = (
        f"{source} was written with {' and '.join(mismatched)}. Ops are resolved and their arguments checked "
        "against this torch, but bitwise equality with eager is only promised under the versions that wrote "
        "the file: re-trace and re-save with this torch/usp_graph"
    )
    if strict:
        raise GraphFileVersionError(msg + " (refused because strict_versions=True)")
    warnings.warn(
        msg + " (pass strict_versions=True to refuse instead)", GraphFileVersionWarning, stacklevel=4
    )


def read_document(doc: dict[str, Any], *, source: str, values: bool, strict_versions: bool) -> GraphFile:
    """A parsed, fingerprint-checked document -> GraphFile (every field validated): the header, the
    symbols, guards, world, constants and inputs, then the graph built from its nodes."""
    top = {"format", "format_version", "kind", "versions", "symbols", "guards", "inputs", "world", "graph",
           "constants", "meta", "fingerprint", "train_step"}  # fmt: skip
    _only_keys(doc, top, "file")
    kind = _field(doc, "kind", str, "file")
    if kind not in ("train_step", "graph_module"):
        raise _schema("file.kind", f"{kind[:40]!r} is not 'train_step' or 'graph_module'")
    versions = _field(doc, "versions", dict, "file")
    for k, v in versions.items():
        if not isinstance(v, str):
            raise _schema(f"file.versions.{k[:40]}", "versions are strings")
    _check_versions(versions, strict_versions, source)

    declared = _decode_symbols(_field(doc, "symbols", dict, "file"))
    env, symints = _shape_env(declared) if values else (None, {})
    f = GraphFile(
        graph_module=None,  # type: ignore[arg-type]
        kind=kind,
        inputs=(),
        symbols=symints,
        dims={name: s.node.expr for name, s in symints.items()} if values else _plain_symbols(declared),
        hints={name: hint for name, (hint, _) in declared.items()},
        ranges={name: bounds for name, (_, bounds) in declared.items()},
        guards=(),
        world=None,
        meta={},
        versions=dict(versions),
        fingerprint=doc["fingerprint"],
        section=doc.get(kind) if kind != "graph_module" else None,
        path=None,
    )
    if kind == "train_step" and not isinstance(f.section, dict):
        raise _schema("file", "a train_step file has a 'train_step' object")
    if kind == "graph_module" and "train_step" in doc:
        raise _schema("file", "a graph_module file has no 'train_step' section")
    f.guards = _decode_guards(_field(doc, "guards", list, "file"), f)
    f.meta = _field(doc, "meta", dict, "file")
    world = _field(doc, "world", (dict, type(None)), "file")
    f.world = None if world is None else _decode_world(world)

    constants: dict[str, torch.Tensor] = {}
    for name, data in _field(doc, "constants", dict, "file").items():
        _check_name(name, f"constants.{name[:40]}", "constant", attribute=True)
        constants[name] = decode_tensor_data(data, f"constants.{name}")

    raw_inputs = _field(doc, "inputs", list, "file")
    specs = [_decode_input(data, f, f"inputs[{i}]") for i, data in enumerate(raw_inputs)]
    graph_doc = _field(doc, "graph", dict, "file")
    _only_keys(graph_doc, {"nodes", "meta"}, "graph")
    fakes = _FakeValues(f, env) if values else None
    gm = _build_graph(_field(graph_doc, "nodes", list, "graph"), constants, fakes, f, specs)
    for k, v in _field(graph_doc, "meta", dict, "graph").items():
        if not META_KEY.fullmatch(k):
            raise _schema(f"graph.meta.{k[:40]}", "graph metadata keys are usp_*")
        if k in GRAPH_META and not GRAPH_META[k](v):
            raise _schema(f"graph.meta.{k}", f"unexpected value {str(v)[:60]!r}")
        gm.meta[k] = v
    f.graph_module = gm

    f.inputs = tuple(specs)
    return f


def _decode_symbols(declared: dict[str, Any]) -> dict[str, tuple[int | None, tuple[int, int | None]]]:
    """The file's ``symbols`` -> name -> (hint, (min, max)). A symbol without a hint is unbacked."""
    if len(declared) > MAX_SYMBOLS:
        raise _schema("symbols", f"{len(declared)} symbols declared; graph files hold at most {MAX_SYMBOLS}")
    symbols = {}
    for name, info in declared.items():
        where = f"symbols.{name[:40]}"
        if not SYMBOL_NAME.fullmatch(name):
            raise _schema(where, "not a symbol name")
        _only_keys(info if isinstance(info, dict) else {}, {"hint", "min", "max"}, where)
        hint = _field(info, "hint", (int, type(None)), where)
        lo = _field(info, "min", int, where)
        hi = _field(info, "max", (int, type(None)), where)
        if (
            (hint is not None and not 0 <= hint < 2**62)
            or lo < 0
            or lo >= 2**62
            or (hi is not None and not lo <= hi < 2**62)
        ):
            raise _schema(where, f"hint {hint} / range [{lo}, {hi}] out of bounds")
        symbols[name] = (hint, (lo, hi))
    return symbols


def _plain_symbols(declared: Mapping[str, tuple[int | None, Any]]) -> dict[str, sympy.Symbol]:
    """The dims of a file read without values: sympy symbols with the assumptions a ShapeEnv gives
    its own (a backed size is a positive integer, an unbacked one an integer), so an expression
    over them simplifies as it does over the ShapeEnv's and evaluates the same. No ShapeEnv: its
    constructor imports torch._dynamo (torch/fx/experimental/validator.py), and nothing here
    needs one."""
    return {
        name: sympy.Symbol(name, integer=True, positive=True)
        if hint is not None
        else sympy.Symbol(name, integer=True)
        for name, (hint, _) in declared.items()
    }


def _shape_env(declared: Mapping[str, tuple[int | None, Any]]) -> tuple[Any, dict[str, torch.SymInt]]:
    """A ShapeEnv holding one symbol per declared name, and name -> its SymInt: the sizes of the
    rebuilt fake values (a symbolic fake tensor needs one)."""
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    env = ShapeEnv(duck_shape=False)
    # torch's own source of a named constant; ShapeEnv() has just imported torch._dynamo (its
    # validator does), so this import costs nothing more (tests/test_imports.py).
    from torch._dynamo.source import ConstantSource

    symbols = {}
    for name, (hint, _) in declared.items():
        if hint is None:
            symbols[name] = env.create_unbacked_symint()
        else:
            src = ConstantSource(f"dim_{name}")
            sym = env.create_symbol(
                hint, src, dynamic_dim=DimDynamic.DYNAMIC, do_not_specialize_zero_one=True
            )
            symbols[name] = env.create_symintnode(sym, hint=hint, source=src)
    return env, symbols


def _decode_guards(raw: list[Any], f: GraphFile) -> tuple[tuple[Any, str], ...]:
    """The file's ``guards``: [condition over the symbols, where it was recorded] each."""
    guards = []
    for i, g in enumerate(raw):
        if not isinstance(g, list) or len(g) != 2 or not isinstance(g[1], str):
            raise _schema(f"guards[{i}]", "a guard is [condition, where]")
        cond = f.expr(g[0], f"guards[{i}]")
        if not isinstance(cond, (sympy.logic.boolalg.Boolean, sympy.core.relational.Relational)):
            raise _schema(f"guards[{i}]", f"{cond} is not a condition")
        guards.append((cond, g[1]))
    return tuple(guards)


def _decode_world(world: dict[str, Any]) -> WorldSpec:
    """The file's ``world``: the writer's world size and rank and its process groups' global ranks."""
    _only_keys(world, {"size", "rank", "groups"}, "world")
    size = _field(world, "size", int, "world")
    rank = _field(world, "rank", int, "world")
    if not 0 <= rank < size:
        raise _schema("world", f"rank {rank} is not in a world of {size}")
    groups = []
    for i, g in enumerate(_field(world, "groups", list, "world")):
        where = f"world.groups[{i}]"
        _only_keys(g if isinstance(g, dict) else {}, {"name", "ranks"}, where)
        name = _field(g, "name", str, where)
        ranks = _field(g, "ranks", list, where)
        if (
            not ranks
            or not all(isinstance(r, int) and not isinstance(r, bool) and 0 <= r < size for r in ranks)
            or len(set(ranks)) != len(ranks)
        ):
            raise _schema(where, f"ranks must be distinct ints in [0, {size})")
        if rank not in ranks:
            raise _schema(where, f"the saving rank {rank} is not in its own group {ranks}")
        groups.append(GroupSpec(name, tuple(ranks)))
    if len({g.name for g in groups}) != len(groups):
        raise _schema("world.groups", "group names repeat")
    return WorldSpec(size, rank, tuple(groups))


_INPUT_KINDS = {"tensor": "T", "symint": "I", "int": "I", "float": "F", "bool": "B", "none": "N", "any": "?"}
# Attributes every graph module has: a constant with one of these names would replace or break them.
_MODULE_ATTRIBUTES = frozenset(dir(fx.GraphModule(torch.nn.Module(), fx.Graph()))) | {"self"}


def _check_name(name: str, where: str, what: str, *, attribute: bool = False) -> None:
    """Names only ever reach FX's generated code as plain local names / attribute names: an
    identifier, no keyword, no dunder, not ``self`` (the generated forward's first argument), and
    for constants (attributes of the rebuilt module) nothing a module already has."""
    if not isinstance(name, str) or not IDENT.fullmatch(name) or keyword.iskeyword(name):
        raise _schema(where, f"{what} name {str(name)[:40]!r} is not an identifier (names are never code)")
    if name == "self" or (name.startswith("__") and name.endswith("__")):
        raise _schema(where, f"{what} name {name!r} is reserved in generated code; rename it")
    if attribute and name in _MODULE_ATTRIBUTES:
        raise _schema(where, f"{what} name {name!r} is an attribute every graph module has; rename it")


def _alias_roots(graph: fx.Graph) -> dict[fx.Node, frozenset[fx.Node]]:
    """For each node, the nodes whose memory it may share: views and in-place results share their
    input's, getitem shares its container's; anything else is its own."""
    roots: dict[fx.Node, frozenset[fx.Node]] = {}
    for node in graph.nodes:
        shared: set[fx.Node] = set()
        target = node.target
        if node.op == "call_function" and isinstance(target, torch._ops.OpOverload):
            schema = target._schema
            if any(r.alias_info is not None for r in schema.returns):
                for a, v in _bound_args(target, node):
                    if a.alias_info is not None:
                        for n in _nodes_in(v):
                            shared |= roots.get(n, {n})
        elif node.op == "call_function" and node.args and isinstance(node.args[0], fx.Node):
            if getattr(target, "__name__", "") == "getitem":
                shared |= roots.get(node.args[0], {node.args[0]})
        roots[node] = frozenset(shared) if shared else frozenset({node})
    return roots


def _bound_args(target: torch._ops.OpOverload, node: fx.Node) -> list[tuple[Any, Any]]:
    params = target._schema.arguments
    out = list(zip([p for p in params if not p.kwarg_only], node.args, strict=False))
    by_name = {p.name: p for p in params}
    out += [(by_name[k], v) for k, v in node.kwargs.items() if k in by_name]
    return out


def _nodes_in(v: Any) -> list[fx.Node]:
    out: list[fx.Node] = []
    fx.node.map_arg(v, lambda n: out.append(n) or n)
    return out


def _check_writes(graph: fx.Graph) -> None:
    """No op may write to memory a graph input or a constant owns (parameters, batch, metadata,
    buffers): replay must never change what the caller passed in, or the next replay's constants."""
    roots = _alias_roots(graph)
    for node in graph.nodes:
        if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
            continue
        for a, v in _bound_args(node.target, node):
            if a.alias_info is None or not a.alias_info.is_write:
                continue
            for n in _nodes_in(v):
                owners = [r for r in roots.get(n, {n}) if r.op in ("placeholder", "get_attr")]
                if owners:
                    raise _schema(
                        f"graph.nodes ({node.name})",
                        f"{node.target} writes to {owners[0].op} {owners[0].name!r} (argument {a.name!r}); "
                        "a graph file may not modify its inputs or constants",
                    )


def _check_issued(graph: fx.Graph) -> None:
    """Every issued collective is finished by exactly one ``usp::wait`` with the arguments its
    collective implies, and nothing else reads its receive buffer (which the collective is still
    writing); every wait finishes an issue. The same for functional collectives (every
    ``_c10d_functional`` op the table admits is asynchronous): exactly one ``wait_tensor`` reads
    each. A ``wait_tensor`` of anything else is the identity and stays allowed (traced steps wait
    twice: ``funcol.wait_tensor`` of an already waited all_reduce). A file that issued without
    waiting would leave work and buffers in flight past the replay, or read a result before it
    arrived."""
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        where = f"graph.nodes ({node.name})"
        if registry.is_issue_op(node.target):
            users = list(node.users)
            if len(users) != 1 or not registry.is_wait_op(users[0].target):
                raise _schema(
                    where,
                    f"{node.target} is read by {[u.name for u in users]}; an issued collective is read by "
                    "exactly one usp.wait.default and nothing else",
                )
            dim, reduce = wait_args(registry.canonical(node.target), node.args, node.kwargs)
            if tuple(users[0].args) != (node, dim, reduce) or users[0].kwargs:
                raise _schema(
                    f"graph.nodes ({users[0].name})",
                    f"usp.wait.default of {node.name} must be called as (recv, dim={dim}, reduce={reduce})",
                )
        elif registry.is_wait_op(node.target):
            recv = node.args[0] if node.args else node.kwargs.get("recv")
            if not isinstance(recv, fx.Node) or not registry.is_issue_op(recv.target):
                raise _schema(where, "usp.wait.default finishes an issued collective (a *_start node) only")
        elif _is_c10d(node.target) and not _is_c10d_wait(node.target):
            # Functional collectives are issued too: their result is being written until its
            # wait_tensor (an all_reduce read without it gave half the sum; issue 31).
            users = list(node.users)
            if len(users) != 1 or not _is_c10d_wait(users[0].target):
                raise _schema(
                    where,
                    f"{node.target} is read by {[u.name for u in users]}; a functional collective is read "
                    "by exactly one _c10d_functional.wait_tensor.default and nothing else",
                )


def _is_c10d(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "_c10d_functional"


def _is_c10d_wait(target: Any) -> bool:
    return _is_c10d(target) and target._schema.name == "_c10d_functional::wait_tensor"


@dataclass
class _Built:
    """What `_build_graph` has built so far: the graph, its nodes by name and their result kinds, the
    placeholders matched to input specs, the constants read, whether the output came."""

    specs: Sequence[InputSpec]
    constants: dict[str, torch.Tensor]
    groups: dict[str, int] | None
    graph: fx.Graph = field(default_factory=fx.Graph)
    env: dict[str, fx.Node] = field(default_factory=dict)
    kinds: dict[fx.Node, Any] = field(default_factory=dict)
    used_constants: set[str] = field(default_factory=set)
    n_placeholders: int = 0
    seen_output: bool = False

    def ref(self, where: str) -> Callable[[str], fx.Node]:
        def get(name: str) -> fx.Node:
            if name not in self.env:
                raise _schema(where, f"refers to node {name[:40]!r}, which is not defined before it")
            return self.env[name]

        return get


def _build_graph(
    nodes: list[Any],
    constants: dict[str, torch.Tensor],
    fakes: _FakeValues | None,
    f: GraphFile,
    specs: Sequence[InputSpec],
) -> fx.GraphModule:
    """The file's nodes -> a `ReplayGraphModule`: each node decoded and checked in order (name, op,
    arguments, target, metadata), then the whole graph (writes, issued collectives, constants)."""
    groups = {g.name: len(g.ranks) for g in f.world.groups} if f.world is not None else None
    b = _Built(specs, constants, groups)
    if not nodes:
        raise _schema("graph.nodes", "a graph has at least an output node")
    for i, data in enumerate(nodes):
        where = f"graph.nodes[{i}]"
        if not isinstance(data, dict):
            raise _schema(where, "a node is an object")
        _only_keys(data, {"name", "op", "target", "args", "kwargs", "meta"}, where)
        name = _field(data, "name", str, where)
        op = _field(data, "op", str, where)
        _check_name(name, where, "node")
        if name in b.env:
            raise _schema(where, f"node name {name!r} is used twice")
        where = f"graph.nodes[{i}] ({name})"
        if b.seen_output:
            raise _schema(where, "nodes after the output node")
        if op not in OPS:
            raise _schema(
                where, f"op {op[:40]!r} is not one of {OPS}; call_module/call_method are never allowed"
            )
        raw_args = _field(data, "args", list, where, optional=True) or []
        raw_kwargs = _field(data, "kwargs", dict, where, optional=True) or {}
        args = tuple(decode_arg(a, b.ref(where), f"{where}.args[{j}]") for j, a in enumerate(raw_args))
        kwargs = {}
        for k, v in raw_kwargs.items():
            if not IDENT.fullmatch(k):
                raise _schema(where, f"keyword {k[:40]!r} is not an identifier")
            kwargs[k] = decode_arg(v, b.ref(where), f"{where}.kwargs.{k}")
        target, kind = _node_target(b, op, name, data, args, kwargs, where)
        node = b.graph.create_node(op, target, args, kwargs, name=name)
        if node.name != name:
            raise _schema(where, f"node name {name!r} is reserved in FX graphs")
        b.env[name] = node
        b.kinds[node] = kind
        _decode_node_meta(node, _field(data, "meta", dict, where, optional=True) or {}, fakes, where)
    return _finish_graph(b)


def _node_target(
    b: _Built,
    op: str,
    name: str,
    data: dict[str, Any],
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
) -> tuple[Any, Any]:
    """(target, result kind) of one node: a placeholder matches the next input spec, a call resolves
    against the allowlist and the op's schema, a get_attr reads a constant the file holds."""
    if op == "placeholder":
        target = _field(data, "target", str, where, optional=True) or name
        if target != name or args or kwargs:
            raise _schema(where, "a placeholder's target is its name, with no args")
        if len(b.env) != b.n_placeholders:
            raise _schema(where, "placeholders come first")
        if b.n_placeholders >= len(b.specs):
            raise _schema("inputs", f"{len(b.specs)} input specs for more placeholders")
        spec = b.specs[b.n_placeholders]
        if spec.node != name:
            raise _schema(
                f"inputs[{b.n_placeholders}]",
                f"describes node {spec.node[:40]!r} but placeholder {b.n_placeholders} is {name!r}",
            )
        b.n_placeholders += 1
        return target, _INPUT_KINDS[spec.kind]
    if op == "call_function":
        target = resolve_target(data.get("target"), where)
        check_call(target, args, kwargs, where, b.kinds.__getitem__)
        check_static(data["target"], target, args, kwargs, where, b.groups)
        return target, result_kind(target, args, b.kinds.__getitem__, where)
    if op == "get_attr":
        target = _field(data, "target", str, where)
        if target not in b.constants:
            raise _schema(where, f"reads constant {target[:40]!r}, which the file does not hold")
        if args or kwargs:
            raise _schema(where, "get_attr takes no args")
        b.used_constants.add(target)
        return target, "T"
    if _field(data, "target", str, where, optional=True) not in (None, "output") or len(args) != 1 or kwargs:
        raise _schema(where, "the output node has one argument (the outputs) and no target")
    b.seen_output = True
    return "output", "N"


def _decode_node_meta(node: fx.Node, meta: dict[str, Any], fakes: _FakeValues | None, where: str) -> None:
    """A node's kept metadata: its fake value (when values are read), its source location, usp_* keys."""
    for k, v in meta.items():
        if k == "val":
            if fakes is not None:
                node.meta["val"] = fakes.val(v, f"{where}.meta.val")
        elif k == "source":
            m = SOURCE.fullmatch(v) if isinstance(v, str) else None
            if m is None:
                raise _schema(f"{where}.meta.source", "a source location is 'file:line in function'")
            node.meta["stack_trace"] = f'  File "{m["file"]}", line {m["line"]}, in {m["fn"]}\n'
        elif META_KEY.fullmatch(k):
            if k in NODE_META and not NODE_META[k](v):
                raise _schema(f"{where}.meta.{k}", f"unexpected value {str(v)[:60]!r}")
            node.meta[k] = v
        else:
            raise _schema(f"{where}.meta", f"unknown metadata key {k[:40]!r}")


def _finish_graph(b: _Built) -> fx.GraphModule:
    """Whole-graph checks once every node is read, then the module holding the constants."""
    if not b.seen_output:
        raise _schema("graph.nodes", "the graph has no output node (truncated node list?)")
    if b.n_placeholders != len(b.specs):
        raise _schema("inputs", f"{len(b.specs)} input specs for {b.n_placeholders} placeholders")
    _check_writes(b.graph)
    _check_issued(b.graph)
    check_collectives(b.graph, b.groups)
    unused = set(b.constants) - b.used_constants
    if unused:
        raise _schema("constants", f"constants {sorted(unused)[:5]} are not read by any node")
    root = torch.nn.Module()
    for name, t in b.constants.items():
        root.register_buffer(name, t)
    try:
        b.graph.lint()
    except (RuntimeError, AssertionError) as e:  # pragma: no cover - construction above keeps it linted
        raise _schema("graph", f"not a well-formed graph: {e}") from None
    return ReplayGraphModule(root, b.graph)


def loads_graph_module(
    data: bytes, *, values: bool = True, strict_versions: bool = False, source: str = "graph file"
) -> GraphFile:
    """`load_graph_module` from bytes already in memory."""
    doc = document.parse(data, source=source)
    return read_document(doc, source=source, values=values, strict_versions=strict_versions)


def load_graph_module(
    path: str | os.PathLike[str], *, values: bool = True, strict_versions: bool = False
) -> GraphFile:
    """Load any graph file (train steps included) as a `GraphFile` for inspection or calling.

    values: rebuild ``meta["val"]`` fake tensors (shapes, dtypes) so analysis can read them.
    strict_versions: refuse (GraphFileVersionError) instead of warning when the file was written
    by another torch or usp_graph version. Raises a `GraphFileError` subclass for any bad file;
    nothing in the file is executed or unpickled.
    """
    data = document.read_file(path)
    f = loads_graph_module(data, values=values, strict_versions=strict_versions, source=os.fspath(path))
    f.path = os.fspath(path)
    return f
