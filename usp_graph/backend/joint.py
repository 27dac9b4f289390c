"""Provenance tags on AOTAutograd's joint graph, so the verify pass can read it.

AOTAutograd traces forward and backward into one joint graph before partitioning it. Its nodes
carry ``meta["partitioner_tag"]`` (``"is_forward"`` / ``"is_backward"``) and ``meta["seq_nr"]``:
the autograd sequence number of the forward op a backward node differentiates. `tag_joint`
turns those into the tags the joint pass of `trace_train_step` leaves (``usp_phase``,
``usp_fwd_node``, ``usp_requires_grad``), through the one provenance writer
(`usp_graph.passes.provenance`), so `usp_graph.passes.verify` checks a compiled train step
exactly as it checks a traced one (every forward collective has its adjoint, every attention op
its backward op), and the CLI reads both alike.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.fx as fx

from ..passes.base import PassResult
from ..passes.provenance import tag_aot_joint
from ..passes.verify import verify
from ..sites import find_sites

__all__ = ["tag_joint", "verify_joint", "CHECKPOINTED_META"]

# On a usp op of the forward inside an activation-checkpointed region (AOTAutograd's joint graph
# tags that region's nodes with ``ac_graph_id``): the compile report and inspect count these sites.
CHECKPOINTED_META = "usp_checkpointed"


def tag_joint(joint: fx.GraphModule, requires_grad: Sequence[bool] | None) -> None:
    """Tag each node of AOTAutograd's joint graph with its phase and forward origin
    (`usp_graph.passes.provenance.tag_aot_joint`), and each usp forward op inside a checkpointed
    region with `CHECKPOINTED_META`."""
    tag_aot_joint(joint, requires_grad)
    for node in joint.graph.nodes:
        if (
            node.op == "call_function"
            and "ac_graph_id" in node.meta
            and node.meta.get("usp_phase") == "forward"
            and getattr(node.target, "namespace", None) == "usp"
        ):
            node.meta[CHECKPOINTED_META] = True


def verify_joint(joint: fx.GraphModule) -> PassResult:
    """The verify pass on a joint graph `tag_joint` tagged (raises `VerifyError`).

    SDPA kernels still in the joint come only from sites the rewrite reported as kept: the
    rewritten forward graph passed verify before AOTAutograd ran, and AOTAutograd does not add
    attention. So they are marked kept here, and verify checks the rules and the adjoints.
    """
    joint.meta["usp_skipped"] = [(s.node.name, s.reason, s.source) for s in find_sites(joint)]
    return verify(joint)


def input_requires_grad(inputs: Sequence[object]) -> list[bool]:
    return [isinstance(x, torch.Tensor) and x.requires_grad for x in inputs]
