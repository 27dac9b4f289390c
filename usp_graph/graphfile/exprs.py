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

import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
from torch.utils._sympy import functions as tfn

from .errors import GraphFileSchemaError

__all__ = [
    "VOCABULARY",
    "encode_expr",
    "decode_expr",
    "SYMBOL_NAME",
    "MAX_NODES",
    "MAX_DEGREE",
    "MAX_VALUE_BITS",
]

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
_MAX_DEPTH = 32
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


# Issue 17: a 2.4 KB file whose guard was Eq(Pow(Pow(Pow(Pow($s75, 64), 64), 64), 64), 7) was still
# loading after 240 s (sympy folds nested powers into one of degree 64**4 and then works on it).
# Before building a node we bound, from its arguments alone, three things that make every later
# step polynomial in the file size: the node count (sympy's work per node), the total degree in the
# symbols, and `bits`, a bound on log2 |value| when every symbol is below 2**SYMBOL_BITS (what
# substituting real sizes into a guard or a shape computes). Traced sizes and guards are products
# of a few dims (degree <= 4 or so, a dozen nodes); the limits are far above any tracer's output.
MAX_NODES = 256
MAX_DEGREE = 64
# sympy evaluates divisions, remainders and Max/Min nested in each other with assumption queries
# over the whole subtree each time: random nests of 200 nodes took seconds to minutes to build.
# The tracer nests them two or three deep (Eq(Mod(FloorDiv(s0, 2), 8), 0)).
MAX_FUNCTION_NESTING = 4
# FloorDiv & co. expand and take polynomial gcds of their arguments (and sympy.simplify the
# quotient): what bounds that work is the number of terms the fully expanded polynomial has, not
# the degree ((a + b + c)**20 has 231 terms). Bounded for every subexpression.
MAX_EXPANDED_TERMS = 256
SYMBOL_BITS = 63  # sizes are int64; the file's symbol ranges stay below 2**62
MAX_VALUE_BITS = 8192
_FUNCTIONS = (
    "FloorDiv",
    "CeilDiv",
    "CleanDiv",
    "IntTrueDiv",
    "Mod",
    "PythonMod",
    "ModularIndexing",
    "Max",
    "Min",
)
_ADDITIVE = ("Add", "Max", "Min", "Mod", "PythonMod", "Eq", "Ne", "Lt", "Le", "Gt", "Ge", *_LOGIC)


# What one file's expressions may cost in all: nodes, plus for each division, remainder or Max/Min
# the size of its subtree (what sympy's evaluation of it walks). Within the bounds above, building
# took at most about 0.6 ms a unit (random search) and 0.25 ms for crafted polynomial remainders,
# so a file's expressions build in a few seconds at most. Traced files spend 0-13 units (identical
# expressions are decoded once).
MAX_FILE_WORK = 8192


@dataclass
class _Budget:
    nodes: int = 0
    work: int = 0


class ExprDecoder:
    """Decodes the expressions of one file: identical ones once (a memo), all of them together
    within MAX_FILE_WORK. `symbol_for(where)` returns the `symbol` function of `decode_expr`."""

    def __init__(self, symbol_for: Callable[[str], Callable[[str], sympy.Basic]]) -> None:
        self.symbol_for = symbol_for
        self.memo: dict[str, sympy.Basic] = {}
        self.work = 0

    def decode(self, data: Any, where: str) -> sympy.Basic:
        try:
            key = json.dumps(data, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError):
            key = None
        if key is not None and key in self.memo:
            return self.memo[key]
        budget = _Budget()
        out = _decode(data, self.symbol_for(where), where, 0, budget)[0]
        self.work += budget.nodes + budget.work
        if self.work > MAX_FILE_WORK:
            raise _fail(
                where,
                f"the file's size expressions together are over the {MAX_FILE_WORK} units of work a graph "
                "file may ask for (nodes, plus the subtree of every division, remainder, Max and Min)",
            )
        if key is not None:
            self.memo[key] = out
        return out


def decode_expr(
    data: Any,
    symbol: Callable[[str], sympy.Basic],
    where: str,
    *,
    depth: int = 0,
) -> sympy.Basic:
    """JSON -> sympy expression, building only VOCABULARY functions. `symbol(name)` returns the
    symbol for a name (raising GraphFileSchemaError for names the file does not declare).

    Refused (GraphFileSchemaError) before sympy sees them: more than MAX_NODES nodes, nesting
    deeper than _MAX_DEPTH, a total degree over MAX_DEGREE, a value that could exceed
    MAX_VALUE_BITS bits for symbol values below 2**SYMBOL_BITS, literals over _MAX_BITS bits."""
    return _decode(data, symbol, where, depth, _Budget())[0]


def _decode(
    data: Any, symbol: Callable[[str], sympy.Basic], where: str, depth: int, budget: _Budget
) -> tuple[sympy.Basic, int, int, int, int]:
    """(expression, degree bound, value-bits bound, nesting of _FUNCTIONS, expanded-terms bound)."""
    if depth > _MAX_DEPTH:
        raise _fail(where, f"size expression nested deeper than {_MAX_DEPTH}")
    budget.nodes += 1
    if budget.nodes > MAX_NODES:
        raise _fail(where, f"size expression has more than {MAX_NODES} terms")
    if isinstance(data, bool):
        return (sympy.true if data else sympy.false), 0, 1, 0, 1
    if isinstance(data, int):
        if abs(data).bit_length() > _MAX_BITS:
            raise _fail(where, f"integer beyond {_MAX_BITS} bits in a size expression")
        return sympy.Integer(data), 0, max(1, abs(data).bit_length()), 0, 1
    if isinstance(data, str):
        if not SYMBOL_NAME.fullmatch(data):
            raise _fail(where, f"{data[:40]!r} is not a symbol name")
        return symbol(data), 1, SYMBOL_BITS, 0, 1
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
        return sympy.Rational(raw[0], raw[1]), 0, abs(raw[0]).bit_length() + abs(raw[1]).bit_length(), 0, 1
    cls = VOCABULARY.get(name)
    if cls is None:
        raise _fail(where, f"{name[:40]!r} is not a size function graph files know ({', '.join(VOCABULARY)})")
    lo, hi = _ARITY.get(name, (2, 2))
    if not lo <= len(raw) <= hi:
        raise _fail(where, f"{name} takes {lo if lo == hi else f'{lo} to {hi}'} arguments, got {len(raw)}")
    if name in ("Pow", "PowByNatural"):
        # The exponent is read from the JSON, before anything is built from the base.
        exp = raw[1]
        if isinstance(exp, bool) or not isinstance(exp, int) or abs(exp) > _MAX_POW:
            raise _fail(where, f"{name} exponents must be integer literals within +-{_MAX_POW}")
    first = budget.nodes
    decoded = [_decode(a, symbol, f"{where}[{i + 1}]", depth + 1, budget) for i, a in enumerate(raw)]
    if name in _FUNCTIONS:
        budget.work += budget.nodes - first + 1
    args = [a for a, *_ in decoded]
    nesting = max(n for _, _, _, n, _ in decoded) + (name in _FUNCTIONS)
    if nesting > MAX_FUNCTION_NESTING:
        raise _fail(
            where,
            f"{', '.join(_FUNCTIONS)} nested more than {MAX_FUNCTION_NESTING} deep in a size expression",
        )
    for a in args:
        _check_size(a, where)
    # Conditions combine conditions; everything else (relations included) takes numbers.
    want = sympy.logic.boolalg.Boolean if name in _LOGIC else sympy.Expr
    if not all(isinstance(a, want) for a in args):
        raise _fail(where, f"{name} takes {'conditions' if name in _LOGIC else 'numbers'}, got {_short(raw)}")
    degree, value_bits, expanded = _bounds(name, args, decoded, where)
    try:
        out = cls(*args)
    except (TypeError, ValueError, ArithmeticError, AttributeError, AssertionError, RecursionError) as e:
        raise _fail(
            where, f"{name}{tuple(args)} is not a valid expression: {type(e).__name__}: {e}"
        ) from None
    if not isinstance(out, sympy.Basic):
        raise _fail(where, f"{name} did not build an expression")
    _check_size(out, where)
    return out, degree, value_bits, nesting, expanded


def _bounds(
    name: str, args: list[sympy.Basic], decoded: list[tuple[sympy.Basic, int, int, int, int]], where: str
) -> tuple[int, int, int]:
    """(degree, value bits, expanded terms) bounds of `name` over its decoded arguments; refused
    over MAX_EXPANDED_TERMS, MAX_DEGREE or MAX_VALUE_BITS."""
    degrees = [d for _, d, *_ in decoded]
    bits = [b for _, _, b, *_ in decoded]
    terms = [t for *_, t in decoded]
    if name in ("Pow", "PowByNatural"):
        exp = int(args[1])
        if not isinstance(args[1], sympy.Integer) or abs(exp) > _MAX_POW:  # pragma: no cover - checked above
            raise _fail(where, f"{name} exponents must be integer literals within +-{_MAX_POW}")
        degree, value_bits = degrees[0] * abs(exp), bits[0] * max(1, abs(exp))
        expanded = terms[0] ** abs(exp) if terms[0] > 1 else 1
    elif name in _ADDITIVE:
        degree, value_bits = max(degrees), max(bits) + len(bits).bit_length()
        expanded = sum(terms) if name == "Add" else 1
    else:  # Mul, and the divisions (numerator and denominator both count, conservatively)
        degree, value_bits = sum(degrees), sum(bits)
        expanded = math.prod(min(t, MAX_EXPANDED_TERMS + 1) for t in terms) if name == "Mul" else 1
    if expanded > MAX_EXPANDED_TERMS:
        raise _fail(
            where,
            f"{name} expands to more than {MAX_EXPANDED_TERMS} terms, more than a size expression may have",
        )
    if degree > MAX_DEGREE:
        raise _fail(
            where,
            f"{name} has degree {degree} in the symbols, over the {MAX_DEGREE} a size expression may have",
        )
    if value_bits > MAX_VALUE_BITS:
        raise _fail(
            where,
            f"{name} could reach {value_bits}-bit values, over the {MAX_VALUE_BITS} bits a size expression may "
            "have (a literal or power too large)",
        )
    return degree, value_bits, expanded


def _short(x: Any) -> str:
    s = repr(x)
    return s if len(s) <= 60 else s[:57] + "..."
