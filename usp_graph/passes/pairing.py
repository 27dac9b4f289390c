"""Forward -> backward pairing: which forward op's registered backward is in the graph, and which is missing.

One analysis, read by the verify pass (which raises on the first unpaired op) and by
`usp_graph.analysis` (``usp-graph inspect`` and ``usp-graph verify``, which list every pair), so
the two cannot disagree.

The rule. A forward op is every ``call_function`` node tagged ``usp_phase == "forward"`` whose
target has a rule in `usp_graph.registry` (or is a ``usp::`` op, which must have one). It needs
its backward unless its output does not require grad (``usp_requires_grad`` False) or it does
not reach the loss (a train step that names its outputs: autograd runs no backward for dead
code). Its backward is found when a backward node

- of one of the rule's ops (a collective: its ``adjoint``; any other op: one of its
  ``backward_ops``) is attributed to it (``usp_fwd_node`` names the forward node's own
  ``usp_fwd_node``, or its name when it has none: see `usp_graph.passes.provenance`), or
- (not for collectives) of one of those ops reads its output directly.

An issued collective (`usp_graph.passes.overlap`) is read as its collective: the issue node is
the forward op or the adjoint, its ``usp::wait`` is neither.

The backward may be in another graph (a compile dump's ``backward.uspg`` next to its
``forward.uspg``); attribution then links the two, as the backward names the forward's nodes.
"""

from __future__ import annotations

import operator
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from .. import registry
from .provenance import ORIGIN_META, PHASE_META, REQUIRES_GRAD_META

__all__ = ["Pair", "Pairing", "Unpaired", "pair_backward"]


@dataclass(frozen=True)
class Pair:
    """A forward op and the backward nodes its rule emitted for it."""

    forward: fx.Node
    backward: tuple[fx.Node, ...]


@dataclass(frozen=True)
class Unpaired:
    """A forward op whose backward is missing.

    rule: its registry rule, or None when it has none (a ``usp::`` op nobody registered).
    expected: the ops that would have paired it (empty when there is no rule).
    """

    node: fx.Node
    rule: registry.BackwardRule | None
    expected: tuple[Any, ...] = ()

    @property
    def what(self) -> str:
        """``"adjoint collective"`` or ``"backward op"``."""
        return (
            "adjoint collective"
            if self.rule is not None and self.rule.kind == "collective"
            else "backward op"
        )

    @property
    def missing(self) -> str:
        """One line saying what is missing (the inspect tables' wording)."""
        if self.rule is None:
            return "no backward rule in the registry"
        return f"no {', '.join(sorted(str(op) for op in self.expected))} in the backward"


@dataclass(frozen=True)
class Pairing:
    """The result of `pair_backward`, in graph order."""

    pairs: tuple[Pair, ...] = ()
    unpaired: tuple[Unpaired, ...] = ()
    skipped: tuple[fx.Node, ...] = field(default=(), repr=False)

    @property
    def ok(self) -> bool:
        return not self.unpaired


def _is_usp_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == registry.NAMESPACE


def _origin(node: fx.Node) -> str:
    return node.meta.get(ORIGIN_META) or node.name


def _reads_output_of(node: fx.Node, fwd: fx.Node) -> bool:
    """Whether `node` reads `fwd`'s output (directly or through a getitem of a tuple output)."""
    for inp in node.all_input_nodes:
        if inp is fwd or (inp.target is operator.getitem and inp.args[0] is fwd):
            return True
    return False


def _feeds_loss(gm: fx.GraphModule) -> set[fx.Node] | None:
    """Every node the loss output depends on (None when the graph does not name its outputs)."""
    if "usp_outputs" not in gm.meta:
        return None
    (values,) = gm.graph.find_nodes(op="output")[0].args
    seen: set[fx.Node] = set()
    stack = [values[0]] if isinstance(values[0], fx.Node) else []
    while stack:
        node = stack.pop()
        if node not in seen:
            seen.add(node)
            stack.extend(node.all_input_nodes)
    return seen


def _forward_ops(gm: fx.GraphModule, rules: dict[Any, registry.BackwardRule]) -> Iterator[fx.Node]:
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.meta.get(PHASE_META) == "forward":
            target = registry.canonical(node.target)
            if registry.is_wait_op(target):
                continue  # the end of an issued collective: its issue node stands for it
            if target in rules or (_is_usp_op(target) and not registry.is_backward_op(target)):
                yield node


def pair_backward(gm: fx.GraphModule, backward: fx.GraphModule | None = None) -> Pairing:
    """The forward ops of `gm` paired with their backward in `gm` (and in `backward`, when the
    backward is another graph). A graph without phase tags (no joint ran) has nothing to pair."""
    rules = registry.rules()
    graphs = [gm] if backward is None else [gm, backward]
    bwd_nodes = [n for g in graphs for n in g.graph.nodes if n.meta.get(PHASE_META) == "backward"]
    by_origin: dict[str, list[fx.Node]] = {}
    for n in bwd_nodes:
        if n.meta.get(ORIGIN_META):
            by_origin.setdefault(n.meta[ORIGIN_META], []).append(n)
    feeds_loss = _feeds_loss(gm)
    pairs, unpaired, skipped = [], [], []
    for node in _forward_ops(gm, rules):
        rule = rules.get(registry.canonical(node.target))
        if rule is None:
            unpaired.append(Unpaired(node, None))
            continue
        if not node.meta.get(REQUIRES_GRAD_META, True) or (feeds_loss is not None and node not in feeds_loss):
            skipped.append(node)  # no gradient flows through it: autograd rightly runs no backward
            continue
        expected = (rule.adjoint,) if rule.kind == "collective" else rule.backward_ops
        found = [b for b in by_origin.get(_origin(node), ()) if registry.canonical(b.target) in expected]
        if not found and rule.kind != "collective":
            found = [
                b for b in bwd_nodes if registry.canonical(b.target) in expected and _reads_output_of(b, node)
            ]
        if found:
            pairs.append(Pair(node, tuple(found)))
        else:
            unpaired.append(Unpaired(node, rule, tuple(expected)))
    return Pairing(tuple(pairs), tuple(unpaired), tuple(skipped))
