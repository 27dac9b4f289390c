"""The one table of backward rules.

Every forward op that usp_graph emits has exactly one row in `TABLE`, as data: the ops its backward
emits, for a collective the adjoint collective that must appear in the backward graph, and the
module that defines the op and implements its backward. This file shows every rule; the ops
modules only supply the implementations (`implement`: the autograd pair that
`torch.library.register_autograd` is given), and a module that implements an op differently from
its row, or an op with no row, fails at import. Verify and inspect read this table (`rules`,
`rule_for`); nothing else decides how an op is differentiated.

An op in the ``usp`` namespace that is neither a forward op of the table nor listed as some row's
backward op is an error (`check_complete`), never a silent ``None`` gradient; so is a row whose
module did not implement it.

Issue + wait. A collective's row may name its ``issue`` op: the same collective started
asynchronously, finished by `WAIT` (``usp::wait``). `usp_graph.passes.overlap` lowers a graph's
collectives to these after autograd, so they are never differentiated (their autograd raises,
naming the op to differentiate instead); pairing, verify and inspect read an issue node as its
collective (`canonical`), and a wait as the end of the transfer it waits for.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = [
    "TABLE",
    "Rule",
    "BackwardRule",
    "implement",
    "register_rule",
    "rule_for",
    "rules",
    "check_complete",
    "is_backward_op",
    "WAIT",
    "canonical",
    "issue_of",
    "is_wait_op",
    "implement_issue",
]

NAMESPACE = "usp"


@dataclass(frozen=True)
class Rule:
    """One row of the table: how forward op `op` is differentiated, as data (op names, no code).

    op / backward_ops / adjoint: qualified op names (``"usp::varlen_fwd"``).
    kind: ``"attention"`` or ``"collective"``; inspect groups sites by it.
    backward_ops: the ops the backward rule emits (backward-only ops: they have no row of their own).
    adjoint: for a collective, the collective that must appear in the backward graph.
    module: where the op is defined and its backward implemented.
    issue: for a collective, the op that starts it asynchronously (finished by `WAIT`), or None.
    """

    op: str
    kind: str
    backward_ops: tuple[str, ...]
    adjoint: str | None
    module: str
    doc: str
    issue: str | None = None


_ATTENTION, _COLLECTIVE = "attention", "collective"

TABLE: tuple[Rule, ...] = (
    Rule("usp::varlen_fwd", _ATTENTION, ("usp::varlen_bwd",), None, "usp_graph.ops.varlen",
         "varlen_bwd on the saved out/lse; an lse gradient adds terms computed by varlen_fwd/varlen_bwd"),
    Rule("usp::ring_attn_fwd", _ATTENTION, ("usp::ring_attn_bwd",), None, "usp_graph.ops.ring",
         "reverse ring: recompute each pair against the global out/lse, carry dK/dV home"),
    Rule("usp::all_to_all", _COLLECTIVE, ("usp::all_to_all",), "usp::all_to_all", "usp_graph.ops.collectives",
         "all_to_all with scatter/gather dims and sizes swapped", issue="usp::all_to_all_start"),
    Rule("usp::all_gather", _COLLECTIVE, ("usp::reduce_scatter",), "usp::reduce_scatter",
         "usp_graph.ops.collectives", "reduce_scatter (sum over ranks, in rank order) along the gathered dim",
         issue="usp::all_gather_start"),
    Rule("usp::reduce_scatter", _COLLECTIVE, ("usp::all_gather",), "usp::all_gather", "usp_graph.ops.collectives",
         "all_gather along the scattered dim", issue="usp::reduce_scatter_start"),
    Rule("usp::halo_exchange", _COLLECTIVE, ("usp::halo_reduce",), "usp::halo_reduce", "usp_graph.ops.halo",
         "halo_reduce: halo gradients sent home and added, tail then head"),
    Rule("usp::halo_reduce", _COLLECTIVE, ("usp::halo_exchange",), "usp::halo_exchange", "usp_graph.ops.halo",
         "halo_exchange of the gradient"),
)  # fmt: skip

_TABLE_BY_OP = {r.op: r for r in TABLE}
_TABLE_BY_ISSUE = {r.issue: r for r in TABLE if r.issue is not None}

# Finishes every issued collective (`Rule.issue`).
WAIT = "usp::wait"


@dataclass(frozen=True)
class BackwardRule:
    """How one forward op is differentiated, wired: the table's row with its ops resolved and the
    implementation attached.

    op: the forward custom op (``torch.ops.usp.<name>.default``).
    kind: ``"attention"`` or ``"collective"``; inspect groups sites by it.
    setup_context / backward: the autograd pair given to `torch.library.register_autograd`.
    backward_ops: the ops the backward rule emits (backward-only ops: they have no rule of their own).
    adjoint: for a collective, the collective that must appear in the backward graph.
    module: where the op and its backward are implemented.
    """

    op: torch._ops.OpOverload
    kind: str
    setup_context: Callable[..., None]
    backward: Callable[..., Any]
    backward_ops: tuple[torch._ops.OpOverload, ...] = ()
    adjoint: torch._ops.OpOverload | None = None
    doc: str = field(default="", compare=False)
    module: str = field(default="", compare=False)


_RULES: dict[torch._ops.OpOverload, BackwardRule] = {}


def _overload(op: Any) -> torch._ops.OpOverload:
    # Ops are defined as `usp_graph.ops.define.Op`s (or custom_op's CustomOpDef); graphs hold OpOverloads.
    # Key the table by the latter.
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    name = op if isinstance(op, str) else getattr(op, "_qualname", None)
    if name is not None:
        ns, opname = name.split("::")
        return getattr(getattr(torch.ops, ns), opname).default
    raise TypeError(f"expected a custom op or OpOverload, got {op!r}")


def _qualname(op: torch._ops.OpOverload) -> str:
    return str(op._schema.name)


def implement(op: Any, *, setup_context: Callable[..., None], backward: Callable[..., Any]) -> BackwardRule:
    """Wire `op`'s row of `TABLE` into autograd with its implementation.

    `backward` must come from the module the row names; an op without a row raises
    `NotImplementedError` naming it (add the row to `TABLE` first)."""
    name = _qualname(_overload(op))
    row = _TABLE_BY_OP.get(name)
    if row is None:
        raise NotImplementedError(f"{name} has no row in usp_graph.registry.TABLE; add its rule there first")
    if backward.__module__ != row.module or setup_context.__module__ != row.module:
        raise ValueError(
            f"{name}: usp_graph.registry.TABLE says its rule is implemented in {row.module}, but "
            f"{backward.__module__} implements it"
        )
    return register_rule(
        op,
        kind=row.kind,
        setup_context=setup_context,
        backward=backward,
        backward_ops=row.backward_ops,
        adjoint=row.adjoint,
        doc=row.doc,
    )


def register_rule(
    op: Any,
    *,
    kind: str,
    setup_context: Callable[..., None],
    backward: Callable[..., Any],
    backward_ops: Sequence[Any] = (),
    adjoint: Any | None = None,
    doc: str = "",
) -> BackwardRule:
    """Add `op`'s backward rule to the wired rules and give it to autograd.

    An op of the ``usp`` namespace must say what its row of `TABLE` says (`implement` passes the
    row itself); ops of other namespaces (extensions) are registered as given."""
    if kind not in (_ATTENTION, _COLLECTIVE):
        raise ValueError(f"kind must be 'attention' or 'collective', got {kind!r}")
    overload = _overload(op)
    if overload in _RULES:
        raise ValueError(f"{overload} already has a backward rule")
    if kind == _COLLECTIVE and adjoint is None:
        raise ValueError(f"collective {overload} needs an adjoint collective")
    rule = BackwardRule(
        op=overload,
        kind=kind,
        setup_context=setup_context,
        backward=backward,
        backward_ops=tuple(_overload(b) for b in backward_ops),
        adjoint=None if adjoint is None else _overload(adjoint),
        doc=doc,
        module=getattr(backward, "__module__", "") or "",
    )
    if overload.namespace == NAMESPACE:
        row = _TABLE_BY_OP.get(_qualname(overload))
        given = (
            kind,
            tuple(_qualname(b) for b in rule.backward_ops),
            rule.adjoint and _qualname(rule.adjoint),
        )
        if row is None or given != (row.kind, row.backward_ops, row.adjoint):
            raise ValueError(
                f"{overload}: the rule given ({given}) is not its row of usp_graph.registry.TABLE "
                f"({row and (row.kind, row.backward_ops, row.adjoint)}); the table decides usp ops' rules"
            )
    _register_autograd(overload, backward, setup_context)
    _RULES[overload] = rule
    return rule


def _register_autograd(
    overload: torch._ops.OpOverload, backward: Callable[..., Any], setup_context: Callable[..., None]
) -> None:
    """Give autograd `overload`'s backward: through its `usp_graph.ops.define.Op` when it has one (the
    autograd kernel the op registered reads it), else through `torch.library.register_autograd`."""
    from .ops.define import op_for

    defined = op_for(_qualname(overload))
    if defined is not None:
        defined.register_autograd(backward, setup_context=setup_context)
    else:
        torch.library.register_autograd(_qualname(overload), backward, setup_context=setup_context)


def rule_for(op: Any) -> BackwardRule:
    """The rule of forward op `op`; `NotImplementedError` naming the op when there is none."""
    overload = _overload(op)
    try:
        return _RULES[overload]
    except KeyError:
        raise NotImplementedError(
            f"{overload} has no backward rule in usp_graph.registry; register one with "
            "register_rule(...) before the op is used"
        ) from None


def rules() -> dict[torch._ops.OpOverload, BackwardRule]:
    """A copy of the whole table, wired (forward op -> rule)."""
    return dict(_RULES)


def is_backward_op(op: Any) -> bool:
    overload = _overload(op)
    return any(overload in r.backward_ops for r in _RULES.values())


def canonical(op: Any) -> Any:
    """The row op an issue op starts (``usp::all_to_all_start`` -> ``usp::all_to_all``); any other
    op as it is. Pairing, verify and inspect key rules by it."""
    if isinstance(op, torch._ops.OpOverload) and op.namespace == NAMESPACE:
        row = _TABLE_BY_ISSUE.get(_qualname(op))
        if row is not None:
            return _overload(row.op)
    return op


def issue_of(op: Any) -> torch._ops.OpOverload | None:
    """The issue op of collective `op`'s row (None: the collective has no async form)."""
    if not isinstance(op, torch._ops.OpOverload) or op.namespace != NAMESPACE:
        return None
    row = _TABLE_BY_OP.get(_qualname(op))
    return None if row is None or row.issue is None else _overload(row.issue)


def is_issue_op(op: Any) -> bool:
    """Whether `op` is a row's issue op (``usp::all_to_all_start``, ...)."""
    return (
        isinstance(op, torch._ops.OpOverload)
        and op.namespace == NAMESPACE
        and _qualname(op) in _TABLE_BY_ISSUE
    )


def is_wait_op(op: Any) -> bool:
    return isinstance(op, torch._ops.OpOverload) and _qualname(op) == WAIT


def _lowered_backward(name: str) -> Callable[..., Any]:
    def backward(ctx: Any, *grads: Any) -> Any:
        raise RuntimeError(
            f"{name} is a collective's issue/wait form, which graphs get after autograd ran "
            "(usp_graph.passes.overlap); differentiate the collective itself (its row of usp_graph.registry.TABLE)"
        )

    return backward


def implement_issue(op: Any) -> None:
    """Wire an issue op (a row's ``issue``) or `WAIT`: never differentiated, so its autograd raises
    a clear error instead of dropping the gradient."""
    name = _qualname(_overload(op))
    if name != WAIT and name not in _TABLE_BY_ISSUE:
        raise NotImplementedError(f"{name} is no row's issue op in usp_graph.registry.TABLE, nor {WAIT}")
    _register_autograd(_overload(op), _lowered_backward(name), lambda ctx, inputs, output: None)
    _ISSUE_WIRED.add(name)


_ISSUE_WIRED: set[str] = set()


def check_complete(namespace: str = NAMESPACE) -> None:
    """Raise `NotImplementedError` for any op in `namespace` that no rule covers, and (for the
    package's own namespace) for any row of `TABLE` its module did not implement.

    Called once the package's ops are defined: an op added without a rule fails at import, before
    any graph could silently drop its gradient.
    """
    wired = {_qualname(op) for op in _RULES}
    if namespace == NAMESPACE:
        unimplemented = [f"{r.op} (in {r.module})" for r in TABLE if r.op not in wired]
        unimplemented += [
            f"{r.issue} (in {r.module})" for r in TABLE if r.issue and r.issue not in _ISSUE_WIRED
        ]
        if _TABLE_BY_ISSUE and WAIT not in _ISSUE_WIRED:
            unimplemented.append(WAIT)
        if unimplemented:
            raise NotImplementedError(
                "rules in usp_graph.registry.TABLE that no module implemented: " + ", ".join(unimplemented)
            )
    covered = set(wired) | _ISSUE_WIRED
    for r in _RULES.values():
        covered.update(_qualname(b) for b in r.backward_ops)
    prefix = namespace + "::"
    missing = [
        name
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith(prefix) and name not in covered
    ]
    if missing:
        raise NotImplementedError(
            "ops without a backward rule (register one in usp_graph.registry): " + ", ".join(sorted(missing))
        )
