"""Which call targets a graph file may name, and how a name becomes a callable.

A node's target is a qualified name string. Loading resolves it against this allowlist only:

- ops: ``<namespace>.<op>.<overload>`` in one of NAMESPACES (``aten``, ``prims``, ``usp``,
  ``_c10d_functional``), looked up in the torch op registry (never imported, never evaluated),
  minus DENIED ops that touch files or process state (``aten.from_file``, ``aten._print``, ...);
- Python functions: the explicit PYTHON_TARGETS table (``operator.getitem`` and SymInt
  arithmetic: ``operator.add``, ``operator.floordiv``, ``torch.sym_max``, ...).

Anything else (``builtins.exec``, ``os.system``, ``eval``, a module path) is refused with
`DisallowedTargetError` before any node is built. An allowed op's arguments are then checked
against its schema (count, names, and each value's kind), so a file cannot smuggle in calls that
would only fail, or do something else, at replay.
"""

from __future__ import annotations

import math
import operator
import re
from typing import Any

import torch
import torch.fx as fx

from .errors import DisallowedTargetError, GraphFileSchemaError

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
        if ns not in NAMESPACES or name.rsplit(".", 1)[0] in DENIED:
            raise ValueError(
                f"op {name} is outside the graph-file allowlist (namespaces {', '.join(NAMESPACES)}, minus "
                f"{', '.join(sorted(DENIED))}); a loader would refuse it"
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
    return target


# ---- argument checks ------------------------------------------------------------------------------

_SCALAR_KINDS = {"ScalarType": torch.dtype, "Layout": torch.layout, "MemoryFormat": torch.memory_format}


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _fits(t: Any, v: Any) -> bool:
    """Whether value `v` (decoded from the file) can be passed for schema type `t`."""
    if isinstance(v, fx.Node):
        return True  # a node's value is only known at replay; its producer was checked
    kind = t.kind()
    if kind == "OptionalType":
        return v is None or _fits(t.getElementType(), v)
    if kind == "ListType":
        elem = t.getElementType()
        if isinstance(v, (list, tuple)):
            return all(_fits(elem, x) for x in v)
        return elem.kind() in ("IntType", "SymIntType") and _is_int(v)  # int[1] accepts a bare int
    name = str(t)
    if name in _SCALAR_KINDS:
        return isinstance(v, _SCALAR_KINDS[name])
    if kind == "TensorType":
        return isinstance(v, (int, float, bool))  # a node, or a Python number aten wraps (mul.Tensor(x, 0.5))
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


def check_call(target: Any, args: tuple[Any, ...], kwargs: dict[str, Any], where: str) -> None:
    """Raise GraphFileSchemaError unless ``target(*args, **kwargs)`` fits the target's signature."""
    if not isinstance(target, torch._ops.OpOverload):
        name = _PYTHON_NAMES[id(target)]
        _, lo, hi = PYTHON_TARGETS[name]
        if kwargs or not lo <= len(args) <= hi:
            raise GraphFileSchemaError(
                f"{where}: {name} takes {lo} positional argument(s), got {len(args)} and {len(kwargs)} keyword(s)"
            )
        for i, a in enumerate(args):
            if name == "operator.getitem" and i == 0:
                ok = isinstance(a, fx.Node)
            else:
                ok = isinstance(a, (fx.Node, int, float))
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
        if not _fits(a.real_type, bound[a.name]):
            raise GraphFileSchemaError(
                f"{where}: {target} argument {a.name!r} must be {a.real_type}, got {type(bound[a.name]).__name__}"
            )
