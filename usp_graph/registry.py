"""The one table of backward rules.

Every forward op that usp_graph emits has exactly one entry here: the function that computes its
input gradients (from which `torch.library.register_autograd` is wired), the ops that backward
emits, and, for collectives, the adjoint collective that must appear in the backward graph. Verify
and inspect read this table; nothing else decides how an op is differentiated.

An op in the ``usp`` namespace that is neither a registered forward op nor listed as some rule's
backward op is an error (`check_complete`), never a silent ``None`` gradient.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

__all__ = ["BackwardRule", "register_rule", "rule_for", "rules", "check_complete", "is_backward_op"]

NAMESPACE = "usp"


@dataclass(frozen=True)
class BackwardRule:
    """How one forward op is differentiated.

    op: the forward custom op (``torch.ops.usp.<name>.default``).
    kind: ``"attention"`` or ``"collective"``; inspect groups sites by it.
    setup_context / backward: the autograd pair given to `torch.library.register_autograd`.
    backward_ops: the ops the backward rule emits (backward-only ops: they have no rule of their own).
    adjoint: for a collective, the collective that must appear in the backward graph.
    """

    op: torch._ops.OpOverload
    kind: str
    setup_context: Callable[..., None]
    backward: Callable[..., Any]
    backward_ops: tuple[torch._ops.OpOverload, ...] = ()
    adjoint: torch._ops.OpOverload | None = None
    doc: str = field(default="", compare=False)


_RULES: dict[torch._ops.OpOverload, BackwardRule] = {}


def _overload(op: Any) -> torch._ops.OpOverload:
    # custom_op returns a CustomOpDef; graphs hold OpOverloads. Key the table by the latter.
    if isinstance(op, torch._ops.OpOverload):
        return op
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    name = getattr(op, "_qualname", None)
    if name is not None:
        ns, opname = name.split("::")
        return getattr(getattr(torch.ops, ns), opname).default
    raise TypeError(f"expected a custom op or OpOverload, got {op!r}")


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
    """Add `op`'s backward rule to the table and wire it into autograd."""
    if kind not in ("attention", "collective"):
        raise ValueError(f"kind must be 'attention' or 'collective', got {kind!r}")
    overload = _overload(op)
    if overload in _RULES:
        raise ValueError(f"{overload} already has a backward rule")
    if kind == "collective" and adjoint is None:
        raise ValueError(f"collective {overload} needs an adjoint collective")
    rule = BackwardRule(
        op=overload,
        kind=kind,
        setup_context=setup_context,
        backward=backward,
        backward_ops=tuple(_overload(b) for b in backward_ops),
        adjoint=None if adjoint is None else _overload(adjoint),
        doc=doc,
    )
    torch.library.register_autograd(overload._schema.name, backward, setup_context=setup_context)
    _RULES[overload] = rule
    return rule


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
    """A copy of the whole table (forward op -> rule)."""
    return dict(_RULES)


def is_backward_op(op: Any) -> bool:
    overload = _overload(op)
    return any(overload in r.backward_ops for r in _RULES.values())


def check_complete(namespace: str = NAMESPACE) -> None:
    """Raise `NotImplementedError` for any op in `namespace` that no rule covers.

    Called once the package's ops are defined: an op added without a rule fails at import, before
    any graph could silently drop its gradient.
    """
    covered = {str(op._schema.name) for op in _RULES}
    for r in _RULES.values():
        covered.update(str(b._schema.name) for b in r.backward_ops)
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
