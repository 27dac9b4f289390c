"""The verify pass: structural checks a train-step graph must pass before anyone trusts it.

1. No SDPA is left unless the rewrite reported it as kept (with its reason).
2. Every ``usp::`` op in the graph has a rule in `usp_graph.registry` (forward op) or is some
   rule's backward op (an issued collective counts as its collective, ``usp::wait`` as its end).
3. Every forward op with a rule that needs a gradient has its backward in the backward graph:
   an attention op one of its ``backward_ops``, a collective its ``adjoint``, attributed to the
   same forward node (`usp_graph.passes.pairing`: the analysis ``usp-graph inspect`` shows too).
4. Every trainable parameter has a gradient output.

A failure raises `VerifyError` naming the node and its source location.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from .. import registry
from ..sites import find_sites, source_location
from .base import PassContext, PassResult
from .pairing import pair_backward
from .provenance import ORIGIN_META

__all__ = ["VerifyError", "verify", "PASS_NAME"]

PASS_NAME = "verify"


class VerifyError(RuntimeError):
    """A train-step graph failed a structural check; the message names the node and where it comes from."""


def _where(node: fx.Node) -> str:
    loc = source_location(node)
    origin = node.meta.get(ORIGIN_META)
    parts = []
    if origin and origin != node.name:
        parts.append(f"from forward node {origin}")
    parts.append(f"at {loc}" if loc else "(no source location recorded)")
    return " ".join(parts)


def _is_usp_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == registry.NAMESPACE


def verify(gm: fx.GraphModule) -> PassResult:
    """train-step graph -> the same graph, or `VerifyError`.

    Reads the tags the earlier passes left: ``gm.meta["usp_skipped"]`` (sites kept as SDPA),
    ``meta["usp_phase"]`` / ``meta["usp_fwd_node"]`` on nodes and ``gm.meta["usp_outputs"]``. On a
    forward-only graph (no phases) only checks 1 and 2 apply.

    Why: a collective without its adjoint, an op without a backward rule or a parameter without a
    gradient trains silently wrong; this turns each into an error at trace time.

    matches: the number of forward ops with a rule whose backward was found (plus gradients checked).
    """
    kept = {name for name, *_ in gm.meta.get("usp_skipped", [])}
    for site in find_sites(gm, read_masks=False):  # verify never runs the graph it checks
        origin = site.node.meta.get(ORIGIN_META, site.node.name)
        if origin not in kept and site.node.name not in kept:
            raise VerifyError(
                f"SDPA node {site.node.name} ({site.form}) {_where(site.node)} is still in the graph but the "
                "rewrite did not report it as kept; run the rewrite_sdpa pass (or report why it cannot run)"
            )

    rules = registry.rules()
    for node in gm.graph.nodes:
        if node.op == "call_function" and _is_usp_op(node.target):
            target = registry.canonical(node.target)
            if (
                target not in rules
                and not registry.is_backward_op(target)
                and not registry.is_wait_op(target)
            ):
                raise VerifyError(
                    f"node {node.name} ({node.target}) {_where(node)} has no backward rule in "
                    "usp_graph.registry; add its row (backward ops, adjoint collective, implementing module) "
                    "to TABLE in usp_graph/registry.py and implement it there with registry.implement(...)"
                )

    pairing = pair_backward(gm)
    for missing in pairing.unpaired:
        node, rule = missing.node, missing.rule
        assert rule is not None, "check 2 rejects a usp op without a rule before pairing"
        names = ", ".join(str(op) for op in missing.expected) or "(the rule lists none)"
        raise VerifyError(
            f"forward node {node.name} ({node.target}) {_where(node)} has no {missing.what} {names} in the "
            f"backward graph; its registered rule ({rule.doc or rule.kind}) did not run for it"
        )
    matches = len(pairing.pairs)

    out = gm.meta.get("usp_outputs")
    if out is not None:
        (values,) = gm.graph.find_nodes(op="output")[0].args
        for name, value in zip(out, values, strict=True):
            if name.startswith("grad:"):
                if value is None:
                    raise VerifyError(
                        f"trainable parameter {name[5:]!r} has no gradient output: the loss does not depend on "
                        "it; freeze it (requires_grad_(False)) or use it"
                    )
                matches += 1
    return PassResult(PASS_NAME, gm, matches)


def verify_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return verify(gm)
