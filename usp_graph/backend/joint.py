"""Provenance tags on AOTAutograd's joint graph, so the verify pass can read it.

AOTAutograd traces forward and backward into one joint graph before partitioning it. Its nodes
carry ``meta["partitioner_tag"]`` (``"is_forward"`` / ``"is_backward"``) and ``meta["seq_nr"]``:
the autograd sequence number of the forward op a backward node differentiates. `tag_joint`
turns those into the tags the joint pass of `trace_train_step` leaves (``usp_phase``,
``usp_fwd_node``, ``usp_requires_grad``), so `usp_graph.passes.verify` checks a compiled
train step exactly as it checks a traced one (every forward collective has its adjoint, every
attention op its backward op), and the CLI reads both alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from .. import registry
from ..passes.joint import ORIGIN_META, PHASE_META
from ..passes.verify import verify
from ..sites import find_sites

__all__ = ["tag_joint", "verify_joint"]


def _phase(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "backward" if node.name.startswith("tangents") else "forward"
    tag = node.meta.get("partitioner_tag")
    if tag == "is_backward":
        return "backward"
    if tag == "is_forward":
        return "forward"
    return "backward" if node.meta.get("autograd_backward") else "forward"


def tag_joint(joint: fx.GraphModule, requires_grad: Sequence[bool] | None) -> None:
    """Tag each node of AOTAutograd's joint graph with its phase and forward origin.

    requires_grad: per primal input (in order), whether it requires grad; a forward node requires
    grad when it depends on such an input. None (or a count that does not match the primals):
    every forward node is taken to require grad, which only makes verify stricter.
    """
    rules = registry.rules()
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if _phase(n) == "forward"]
    if requires_grad is None or len(requires_grad) != len(primals):
        requires_grad = [True] * len(primals)
    needs: dict[fx.Node, bool] = dict(zip(primals, requires_grad, strict=True))
    # seq_nr -> the forward node backward nodes of that number differentiate: the usp op with a rule
    # when there is one (a multi-output op's getitems share its number), else the first node.
    owner: dict[int, fx.Node] = {}
    for node in joint.graph.nodes:
        phase = _phase(node)
        node.meta[PHASE_META] = phase
        if phase != "forward":
            continue
        if node.op != "placeholder":
            needs[node] = any(needs.get(i, False) for i in node.all_input_nodes)
        node.meta["usp_requires_grad"] = needs.get(node, False)
        node.meta[ORIGIN_META] = node.name
        seq = node.meta.get("seq_nr")
        if seq is not None and (
            seq not in owner or (node.target in rules and owner[seq].target not in rules)
        ):
            owner[seq] = node
    for node in joint.graph.nodes:
        if node.meta[PHASE_META] == "backward":
            fwd = owner.get(node.meta.get("seq_nr"))
            if fwd is not None:
                node.meta[ORIGIN_META] = fwd.name
                if fwd.meta.get("stack_trace") and not node.meta.get("stack_trace"):
                    node.meta["stack_trace"] = fwd.meta["stack_trace"]
            else:
                node.meta.pop(ORIGIN_META, None)


def verify_joint(joint: fx.GraphModule, requires_grad: Sequence[bool] | None) -> None:
    """`tag_joint`, then the verify pass on the joint graph (raises `VerifyError`).

    SDPA kernels still in the joint come only from sites the rewrite reported as kept: the
    rewritten forward graph passed verify before AOTAutograd ran, and AOTAutograd does not add
    attention. So they are marked kept here, and verify checks the rules and the adjoints.
    """
    tag_joint(joint, requires_grad)
    joint.meta["usp_skipped"] = [(s.node.name, s.reason, s.source) for s in find_sites(joint)]
    verify(joint)


def input_requires_grad(inputs: Sequence[object]) -> list[bool]:
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
