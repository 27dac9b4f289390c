"""Symbolic size expressions as JSON, over named symbols, in a small fixed vocabulary.

    15                      an integer
    "T"                     the symbol named T (a dim name, ``max_seqlen``, or ``$s12`` for an
                            internal symbol of the tracer that has no name)
    ["Mul", 2, "T"]         a function of expressions: one of VOCABULARY
    true / false            a constant condition

Loading builds sympy objects from this table only (no sympy parsing, no eval); integer literals and
results are bounded so a hostile file cannot make evaluation explode.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

import sympy
from torch.utils._sympy import functions as tfn

from .errors import GraphFileSchemaError

__all__ = ["VOCABULARY", "encode_expr", "decode_expr", "SYMBOL_NAME"]

VOCABULARY: dict[str, type] = {
    "Add": sympy.Add,
    "Mul": sympy.Mul,
    "Pow": sympy.Pow,
    "PowByNatural": tfn.PowByNatural,
    "FloorDiv": tfn.FloorDiv,
    "CeilDiv": tfn.CeilDiv,
    "CleanDiv": tfn.CleanDiv,
    "IntTrueDiv": tfn.IntTrueDiv,
    "Mod": tfn.Mod,
    "PythonMod": tfn.PythonMod,
    "ModularIndexing": tfn.ModularIndexing,
    "Max": tfn.Max,
    "Min": tfn.Min,
    "Eq": sympy.Eq,
    "Ne": sympy.Ne,
    "Lt": sympy.StrictLessThan,
    "Le": sympy.LessThan,
    "Gt": sympy.StrictGreaterThan,
    "Ge": sympy.GreaterThan,
    "And": sympy.And,
    "Or": sympy.Or,
    "Not": sympy.Not,
}
_ARITY: dict[str, tuple[int, int]] = {
    "Add": (2, 10_000),
    "Mul": (2, 10_000),
    "And": (2, 10_000),
    "Or": (2, 10_000),
    "Max": (2, 10_000),
    "Min": (2, 10_000),
    "Not": (1, 1),
    "ModularIndexing": (3, 3),
}
_LOGIC = ("And", "Or", "Not")
_NAMES = {cls: name for name, cls in VOCABULARY.items()}
_NAMES[sympy.Equality] = "Eq"
_NAMES[sympy.Unequality] = "Ne"
SYMBOL_NAME = re.compile(r"\$?[A-Za-z_][A-Za-z0-9_]{0,99}")
_MAX_BITS = 4096  # literals and intermediate results; sizes never come close
_MAX_DEPTH = 64
_MAX_POW = 64


def encode_expr(expr: Any, names: Mapping[sympy.Symbol, str]) -> Any:
    """sympy expression -> JSON. `names` maps each symbol to its name in the file; a symbol not in
    `names` raises ValueError (the caller decides how to name it)."""
    if isinstance(expr, bool):
        return expr
    if isinstance(expr, int):
        return int(expr)
    if expr is sympy.true or expr is sympy.false:
        return bool(expr)
    if isinstance(expr, sympy.Integer):
        return int(expr)
    if isinstance(expr, sympy.Symbol):
        if expr not in names:
            raise ValueError(f"symbol {expr} has no name in this graph file")
        return names[expr]
    if isinstance(expr, sympy.Rational):
        return ["Rational", int(expr.p), int(expr.q)]
    name = _NAMES.get(expr.func)
    if name is None:
        raise ValueError(
            f"size expression {expr} uses {expr.func.__name__}, which graph files cannot hold "
            f"(supported: {', '.join(VOCABULARY)}); keep this size static or report the case"
        )
    return [name, *(encode_expr(a, names) for a in expr.args)]


def _fail(where: str, msg: str) -> GraphFileSchemaError:
    return GraphFileSchemaError(f"{where}: {msg}")


def _check_size(x: Any, where: str) -> None:
    if isinstance(x, sympy.Integer) and abs(int(x)).bit_length() > _MAX_BITS:
        raise _fail(where, f"integer beyond {_MAX_BITS} bits in a size expression")
    if isinstance(x, sympy.Rational) and max(abs(x.p), abs(x.q)).bit_length() > _MAX_BITS:
        raise _fail(where, f"rational beyond {_MAX_BITS} bits in a size expression")


def decode_expr(
    data: Any,
    symbol: Callable[[str], sympy.Basic],
    where: str,
    *,
    depth: int = 0,
) -> sympy.Basic:
    """JSON -> sympy expression, building only VOCABULARY functions. `symbol(name)` returns the
    symbol for a name (raising GraphFileSchemaError for names the file does not declare)."""
    if depth > _MAX_DEPTH:
        raise _fail(where, f"size expression nested deeper than {_MAX_DEPTH}")
    if isinstance(data, bool):
        return sympy.true if data else sympy.false
    if isinstance(data, int):
        if abs(data).bit_length() > _MAX_BITS:
            raise _fail(where, f"integer beyond {_MAX_BITS} bits in a size expression")
        return sympy.Integer(data)
    if isinstance(data, str):
        if not SYMBOL_NAME.fullmatch(data):
            raise _fail(where, f"{data[:40]!r} is not a symbol name")
        return symbol(data)
    if not isinstance(data, list) or not data or not isinstance(data[0], str):
        raise _fail(where, f"expected an int, a symbol name or [function, args...], got {_short(data)}")
    name, raw = data[0], data[1:]
    if name == "Rational":
        if (
            len(raw) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in raw)
            or raw[1] == 0
        ):
            raise _fail(where, "Rational takes two ints, the second non-zero")
        if max(abs(raw[0]), abs(raw[1])).bit_length() > _MAX_BITS:
            raise _fail(where, f"rational beyond {_MAX_BITS} bits in a size expression")
        return sympy.Rational(raw[0], raw[1])
    cls = VOCABULARY.get(name)
    if cls is None:
        raise _fail(where, f"{name[:40]!r} is not a size function graph files know ({', '.join(VOCABULARY)})")
    lo, hi = _ARITY.get(name, (2, 2))
    if not lo <= len(raw) <= hi:
        raise _fail(where, f"{name} takes {lo if lo == hi else f'{lo} to {hi}'} arguments, got {len(raw)}")
    args = [decode_expr(a, symbol, f"{where}[{i + 1}]", depth=depth + 1) for i, a in enumerate(raw)]
    for a in args:
        _check_size(a, where)
    # Conditions combine conditions; everything else (relations included) takes numbers.
    want = sympy.logic.boolalg.Boolean if name in _LOGIC else sympy.Expr
    if not all(isinstance(a, want) for a in args):
        raise _fail(where, f"{name} takes {'conditions' if name in _LOGIC else 'numbers'}, got {_short(raw)}")
    if name in ("Pow", "PowByNatural"):
        exp = args[1]
        if not isinstance(exp, sympy.Integer) or abs(int(exp)) > _MAX_POW:
            raise _fail(where, f"{name} exponents must be integer literals within +-{_MAX_POW}")
    try:
        out = cls(*args)
    except (TypeError, ValueError, ArithmeticError, AttributeError, AssertionError, RecursionError) as e:
        raise _fail(
            where, f"{name}{tuple(args)} is not a valid expression: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(out, sympy.Basic):
        raise _fail(where, f"{name} did not build an expression")
    _check_size(out, where)
    return out


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."
