"""Which call targets a graph file may name, and how a name becomes a callable.

A node's target is a qualified name string. Loading resolves it against this allowlist only:

- ops: ``<namespace>.<op>.<overload>`` in the closed table of `optable` (the ops traced and
  compiled train steps contain, each with a validator), looked up in the torch op registry (never
  imported, never evaluated);
- Python functions: the explicit PYTHON_TARGETS table (``operator.getitem`` and SymInt
  arithmetic: ``operator.add``, ``operator.floordiv``, ``torch.sym_max``, ...).

Anything else (``builtins.exec``, ``os.system``, ``eval``, a module path) is refused with
`DisallowedTargetError` before any node is built. An allowed op's arguments are then checked
against its schema (count, names, and each value's kind: a node argument by the kind of value its
producer makes, `result_kind`), so a file cannot smuggle in calls that would only fail, or do
something else, at replay.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable
from typing import Any

import torch
import torch.fx as fx

from .errors import DisallowedTargetError, GraphFileSchemaError
from .optable import allowed

__all__ = ["NAMESPACES", "PYTHON_TARGETS", "DENIED", "target_name", "resolve_target", "check_call"]

NAMESPACES = ("aten", "prims", "usp", "_c10d_functional")
# Ops in an allowed namespace that reach outside the tensor world (files, stdout, global settings).
DENIED = frozenset(
    {
        "aten.from_file",
        "aten._print",
        "aten._cufft_set_plan_cache_max_size",
        "aten._cufft_clear_plan_cache",
        "aten.set_",
        "aten.set",
        "aten.set_data",
    }
)

# name -> (callable, min args, max args). Only what traced graphs use: getitem on multi-output ops
# and the arithmetic make_fx / AOTAutograd emit on SymInts.
PYTHON_TARGETS: dict[str, tuple[Any, int, int]] = {
    "operator.getitem": (operator.getitem, 2, 2),
    "operator.add": (operator.add, 2, 2),
    "operator.sub": (operator.sub, 2, 2),
    "operator.mul": (operator.mul, 2, 2),
    "operator.floordiv": (operator.floordiv, 2, 2),
    "operator.truediv": (operator.truediv, 2, 2),
    "operator.mod": (operator.mod, 2, 2),
    "operator.pow": (operator.pow, 2, 2),
    "operator.neg": (operator.neg, 1, 1),
    "operator.eq": (operator.eq, 2, 2),
    "operator.ne": (operator.ne, 2, 2),
    "operator.lt": (operator.lt, 2, 2),
    "operator.le": (operator.le, 2, 2),
    "operator.gt": (operator.gt, 2, 2),
    "operator.ge": (operator.ge, 2, 2),
    "torch.sym_max": (torch.sym_max, 2, 2),
    "torch.sym_min": (torch.sym_min, 2, 2),
    "torch.sym_not": (torch.sym_not, 1, 1),
    "torch.sym_float": (torch.sym_float, 1, 1),
    "torch.sym_int": (torch.sym_int, 1, 1),
    "math.ceil": (math.ceil, 1, 1),
    "math.floor": (math.floor, 1, 1),
}
_PYTHON_NAMES = {id(fn): name for name, (fn, _, _) in PYTHON_TARGETS.items()}
_IDENT = r"[A-Za-z_][A-Za-z0-9_]{0,199}"
_OP_NAME = re.compile(rf"({_IDENT})\.({_IDENT})\.({_IDENT})")


def target_name(target: Any) -> str:
    """The qualified name a graph file stores for a call target; ValueError for one it cannot hold."""
    if isinstance(target, torch._ops.OpOverload):
        ns = target.namespace
        name = f"{ns}.{target._schema.name.split('::', 1)[1]}.{target._overloadname}"
        if ns not in NAMESPACES or name.rsplit(".", 1)[0] in DENIED or not allowed(name):
            raise ValueError(
                f"op {name} is not in the table of ops graph files may call (usp_graph/graphfile/optable.py); "
                "a loader would refuse it"
            )
        return name
    name = _PYTHON_NAMES.get(id(target))
    if name is None:
        raise ValueError(
            f"call target {getattr(target, '__module__', '?')}.{getattr(target, '__name__', repr(target))} is "
            f"not in the graph-file allowlist (ops of {', '.join(NAMESPACES)} and {', '.join(PYTHON_TARGETS)}); "
            "graph files never hold arbitrary Python callables"
        )
    return name


def resolve_target(name: Any, where: str) -> Any:
    """Qualified name -> the op or function, from the allowlist only."""
    if not isinstance(name, str):
        raise GraphFileSchemaError(f"{where}: target must be a string, got {type(name).__name__}")
    if name in PYTHON_TARGETS:
        return PYTHON_TARGETS[name][0]
    m = _OP_NAME.fullmatch(name)
    if m is None or m.group(1) not in NAMESPACES:
        raise DisallowedTargetError(
            f"{where}: call target {name[:80]!r} is not allowed; graph files may call only ops of "
            f"{', '.join(NAMESPACES)} and {', '.join(PYTHON_TARGETS)}. The file was refused and nothing "
            "in it ran; do not load files from untrusted sources expecting other behaviour"
        )
    ns, op, overload = m.groups()
    if f"{ns}.{op}" in DENIED:
        raise DisallowedTargetError(
            f"{where}: op {name} is denied in graph files (it reaches outside tensors: files, printing or "
            "global state); nothing in the file ran"
        )
    if op.startswith("__") or overload.startswith("__"):
        raise DisallowedTargetError(f"{where}: {name[:80]!r} is not an op name; nothing in the file ran")
    if ns == "usp":
        from .. import ops  # noqa: F401  (defines the usp ops)
    try:
        packet = getattr(getattr(torch.ops, ns), op)
    except (AttributeError, RuntimeError):
        packet = None
    if not isinstance(packet, torch._ops.OpOverloadPacket) or packet._qualified_op_name != f"{ns}::{op}":
        raise GraphFileSchemaError(
            f"{where}: op {ns}.{op} does not exist in this torch {torch.__version__} (was the file written "
            "by another torch version or with another extension loaded?)"
        )
    if overload not in packet.overloads():
        raise GraphFileSchemaError(
            f"{where}: op {ns}.{op} has no overload {overload!r} in torch {torch.__version__} (it has "
            f"{', '.join(packet.overloads())})"
        )
    target = getattr(packet, overload)
    if not isinstance(target, torch._ops.OpOverload):
        raise GraphFileSchemaError(f"{where}: {name} is not an op overload")
    if not allowed(name):
        raise DisallowedTargetError(
            f"{where}: op {name} is not in the table of ops graph files may call "
            "(usp_graph/graphfile/optable.py: the ops traced train steps and compiled graphs contain, each "
            "with a validator); the file was refused and nothing in it ran"
        )
    return target


# ---- argument checks ------------------------------------------------------------------------------

_SCALAR_KINDS = {"ScalarType": torch.dtype, "Layout": torch.layout, "MemoryFormat": torch.memory_format}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# Static kinds of what a node produces: "T" tensor, "TL" list of tensors, "I" int/SymInt, "F" float,
# "B" bool, "S" any number, "N" None, "?" unknown (an input of kind any), or a tuple of kinds.
Kind = Any
_RET_KINDS = {"Tensor": "T", "int": "I", "SymInt": "I", "float": "F", "SymFloat": "F", "bool": "B",
              "SymBool": "B", "Scalar": "S", "number": "S"}  # fmt: skip
_INT_FNS = {"operator.floordiv", "operator.mod", "torch.sym_int", "math.ceil", "math.floor"}
_BOOL_FNS = {"operator.eq", "operator.ne", "operator.lt", "operator.le", "operator.gt", "operator.ge",
             "torch.sym_not"}  # fmt: skip


def _type_kind(t: Any) -> Kind:
    name = str(t)
    if name in _RET_KINDS:
        return _RET_KINDS[name]
    if t.kind() == "ListType" and str(t.getElementType()) == "Tensor":
        return "TL"
    return "?"


def result_kind(target: Any, args: tuple[Any, ...], kind_of: Callable[[fx.Node], Kind], where: str) -> Kind:
    """What a call produces, from the op's schema (or the Python function), without running it."""
    if isinstance(target, torch._ops.OpOverload):
        rets = target._schema.returns
        if not rets:
            return "N"
        kinds = tuple(_type_kind(r.type) for r in rets)
        return kinds[0] if len(kinds) == 1 else kinds
    name = _PYTHON_NAMES[id(target)]
    if name == "operator.getitem":
        container, index = args
        kind = kind_of(container)
        if isinstance(kind, tuple):
            if not _is_int(index) or not -len(kind) <= index < len(kind):
                raise GraphFileSchemaError(
                    f"{where}: getitem index {index!r} of a node that makes {len(kind)} values"
                )
            return kind[index]
        if kind == "TL":
            if not _is_int(index):
                raise GraphFileSchemaError(f"{where}: getitem of a tensor list takes an int index")
            return "T"
        if kind == "?":
            return "?"
        raise GraphFileSchemaError(
            f"{where}: getitem of a node that makes {_describe(kind)}, not several values"
        )
    kinds = [kind_of(a) if isinstance(a, fx.Node) else ("F" if isinstance(a, float) else "I") for a in args]
    if name in _BOOL_FNS:
        return "B"
    if name in _INT_FNS:
        return "I"
    if name in ("operator.truediv", "torch.sym_float"):
        return "F"
    return "F" if "F" in kinds else ("S" if "S" in kinds or "?" in kinds else "I")


def _describe(kind: Kind) -> str:
    if isinstance(kind, tuple):
        return f"a tuple of {len(kind)}"
    return {"T": "a Tensor", "TL": "a list of Tensors", "I": "an int", "F": "a float", "B": "a bool",
            "S": "a number", "N": "None", "?": "an input of any kind"}[kind]  # fmt: skip


def _node_fits(t: Any, kind: Kind, number_ok: bool = False) -> bool:
    if kind == "?":
        return True
    tk = t.kind()
    if tk == "OptionalType":
        return kind == "N" or _node_fits(t.getElementType(), kind, number_ok)
    if tk == "ListType":
        return kind == "TL" and str(t.getElementType()) in ("Tensor", "Optional[Tensor]")
    if tk == "TensorType":
        return kind == "T" or (number_ok and kind in ("I", "F", "S"))
    if tk in ("IntType", "SymIntType"):
        return kind in ("I", "S")
    if tk in ("FloatType", "SymFloatType"):
        return kind in ("I", "F", "S")
    if tk in ("BoolType", "SymBoolType"):
        return kind in ("B",)
    if tk == "NumberType":
        return kind in ("I", "F", "B", "S")
    return False


def _fits(t: Any, v: Any, kind_of: Callable[[fx.Node], Kind], number_ok: bool = False) -> bool:
    """Whether value `v` (decoded from the file) can be passed for schema type `t`. A node fits by
    the kind of value it makes (`result_kind`); a Tensor argument is a node that makes a Tensor,
    or, for a Tensor argument other than an op's first, a number (``mul.Tensor(x, 0.5)``) or a node
    that makes one (``sub.Tensor(x, sym_size)``), which aten wraps."""
    if isinstance(v, fx.Node):
        return _node_fits(t, kind_of(v), number_ok)
    kind = t.kind()
    if kind == "OptionalType":
        return v is None or _fits(t.getElementType(), v, kind_of, number_ok)
    if kind == "ListType":
        elem = t.getElementType()
        if isinstance(v, (list, tuple)):
            return all(_fits(elem, x, kind_of) for x in v)
        return elem.kind() in ("IntType", "SymIntType") and _is_int(v)  # int[1] accepts a bare int
    name = str(t)
    if name in _SCALAR_KINDS:
        return isinstance(v, _SCALAR_KINDS[name])
    if kind == "TensorType":
        return number_ok and isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind in ("IntType", "SymIntType"):
        return _is_int(v)
    if kind in ("FloatType", "SymFloatType"):
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if kind in ("BoolType", "SymBoolType"):
        return isinstance(v, bool)
    if kind == "StringType":
        return isinstance(v, str)
    if kind == "NumberType":
        return isinstance(v, (int, float, bool))
    if kind == "DeviceObjType":
        return isinstance(v, torch.device)
    if kind == "AnyType":  # e.g. _c10d_functional's group_name: a plain name, never an object
        return isinstance(v, (str, int, float, bool)) or v is None
    return False  # Generator, Storage, ...: nothing a file can spell


def check_call(
    target: Any,
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    where: str,
    kind_of: Callable[[fx.Node], Kind] = lambda n: "?",
) -> None:
    """Raise GraphFileSchemaError unless ``target(*args, **kwargs)`` fits the target's signature;
    `kind_of(node)` is what an earlier node makes (`result_kind`)."""
    if not isinstance(target, torch._ops.OpOverload):
        name = _PYTHON_NAMES[id(target)]
        _, lo, hi = PYTHON_TARGETS[name]
        if kwargs or not lo <= len(args) <= hi:
            raise GraphFileSchemaError(
                f"{where}: {name} takes {lo} positional argument(s), got {len(args)} and {len(kwargs)} keyword(s)"
            )
        for i, a in enumerate(args):
            if name == "operator.getitem":
                ok = isinstance(a, fx.Node) if i == 0 else _is_int(a)
            elif isinstance(a, fx.Node):
                ok = kind_of(a) in ("I", "F", "B", "S", "?")
            else:
                ok = isinstance(a, (int, float))
            if not ok:
                raise GraphFileSchemaError(f"{where}: {name} argument {i} cannot be {type(a).__name__}")
        return
    schema = target._schema
    params = list(schema.arguments)
    positional = [a for a in params if not a.kwarg_only]
    if len(args) > len(positional):
        raise GraphFileSchemaError(
            f"{where}: {target} takes at most {len(positional)} positional arguments, got {len(args)}"
        )
    bound = {a.name: v for a, v in zip(positional, args, strict=False)}
    known = {a.name for a in params}
    for k, v in kwargs.items():
        if k not in known:
            raise GraphFileSchemaError(f"{where}: {target} has no argument {k[:40]!r} (schema: {schema})")
        if k in bound:
            raise GraphFileSchemaError(f"{where}: {target} got argument {k!r} twice")
        bound[k] = v
    for a in params:
        if a.name not in bound:
            if not a.has_default_value():
                raise GraphFileSchemaError(
                    f"{where}: {target} is missing its argument {a.name!r} (schema: {schema})"
                )
            continue
        if not _fits(a.real_type, bound[a.name], kind_of, number_ok=a is not params[0]):
            v = bound[a.name]
            got = f"a node that makes {_describe(kind_of(v))}" if isinstance(v, fx.Node) else type(v).__name__
            raise GraphFileSchemaError(
                f"{where}: {target} argument {a.name!r} must be {a.real_type}, got {got}"
            )
