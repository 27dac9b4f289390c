"""Joint-graph provenance: which forward node each node of a forward + backward graph belongs to.

Every node of a joint graph carries, in ``node.meta``:

- ``usp_phase``: ``"forward"`` or ``"backward"`` (``"input"`` for a traced train step's inputs);
- ``usp_fwd_node``: the forward node it belongs to; for a backward node, the forward node whose
  registered rule emitted it (absent when no forward node can be named);
- ``usp_requires_grad`` (forward nodes): whether its output requires grad;
- the forward node's ``stack_trace`` (and ``usp_site``), so an error about a backward op names
  the model line it differentiates.

Verify, inspect and the graph files read these tags (`usp_graph.passes.pairing` pairs forward ops
with their backward by them). They are written by `stamp` alone, for both joints usp_graph makes:

- the tracer's (`usp_graph.passes.joint`): make_fx traces an `fx.Interpreter` over the forward
  graph and `torch.autograd.grad`; `TraceProvenance` knows which forward node is running while
  the forward is traced, and a pre-hook on each forward op's autograd node says whose backward
  the engine runs next;
- AOTAutograd's (the ``usp`` compile backend): its nodes carry AOTAutograd's phase
  (``partitioner_tag``) and autograd sequence number (``seq_nr``, shared by a forward op and the
  backward nodes that differentiate it); `tag_aot_joint` reads those.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode
from torch.utils import _pytree as pytree

from .. import registry
from .base import PASS_META

__all__ = [
    "ORIGIN_META",
    "PHASE_META",
    "REQUIRES_GRAD_META",
    "TraceProvenance",
    "stamp",
    "tag_aot_joint",
]

PHASE_META = "usp_phase"
ORIGIN_META = "usp_fwd_node"
REQUIRES_GRAD_META = "usp_requires_grad"


def stamp(
    node: fx.Node,
    phase: str,
    owner: fx.Node | None,
    *,
    requires_grad: bool | None = None,
    pass_name: str | None = None,
) -> None:
    """Tag `node` as a `phase` node of forward node `owner` (None: no forward node is known).

    requires_grad: for forward nodes. pass_name: the ``usp_pass`` tag to give it (None: leave it).
    A node without a stack trace gets its owner's.
    """
    meta = node.meta
    if owner is None:
        meta.pop(ORIGIN_META, None)
    else:
        meta[ORIGIN_META] = owner.name
    if pass_name is not None:
        meta[PASS_META] = pass_name
    if owner is not None and owner is not node:
        if owner.meta.get("stack_trace") and not meta.get("stack_trace"):
            meta["stack_trace"] = owner.meta["stack_trace"]
        if "usp_site" in owner.meta:
            meta["usp_site"] = owner.meta["usp_site"]
    meta[PHASE_META] = phase
    if requires_grad is not None:
        meta[REQUIRES_GRAD_META] = requires_grad


# -- the tracer's joint ----------------------------------------------------------------------------


class TraceProvenance:
    """Stamps the nodes make_fx appends to the graph it is tracing with the forward node they belong to.

    Use: `start` once under make_fx; set `owner` to the forward node about to run and call
    `forward_done` after it ran (its result tells whether it requires grad); call
    `backward_done` once ``torch.autograd.grad`` returns. Nodes are found as those appended since
    the last call (``len(graph.nodes)``), so nothing else may insert into the traced graph meanwhile.

    pass_name: the ``usp_pass`` tag of backward nodes (forward nodes keep their owner's).
    """

    def __init__(self, pass_name: str) -> None:
        self.pass_name = pass_name
        self.graph: fx.Graph | None = None
        self.mark = 0
        self.owner: fx.Node | None = None
        # Holding the grad_fn objects keeps their ids (and Python wrappers) from being reused.
        self.seen: dict[Any, fx.Node] = {}

    def start(self) -> None:
        mode = get_proxy_mode()
        assert mode is not None, "joint provenance is recorded while make_fx traces"
        self.graph = mode.tracer.graph
        self.mark = len(self.graph.nodes)

    def _appended(self) -> list[fx.Node]:
        graph = self.graph
        assert graph is not None, "call start() first"
        count = len(graph.nodes) - self.mark
        self.mark = len(graph.nodes)
        return list(itertools.islice(reversed(graph.nodes), count))

    def forward_done(self, result: Any) -> None:
        """The nodes appended since the last call ran `owner` (the forward node that produced `result`);
        hooks each new autograd node of `result` so its backward is attributed to `owner` too."""
        owner = self.owner
        requires_grad = False
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                requires_grad = True
                grad_fn = t.grad_fn
                if grad_fn not in self.seen and owner is not None:  # a multi-output op's outputs share one
                    self.seen[grad_fn] = owner
                    grad_fn.register_prehook(self._backward_hook(owner))
        for node in self._appended():
            tag = self.pass_name if owner is None else owner.meta.get(PASS_META, "trace")
            stamp(node, "forward", owner, requires_grad=requires_grad, pass_name=tag)

    def backward_done(self) -> None:
        """The nodes appended since the last call are the backward of `owner`."""
        for node in self._appended():
            stamp(node, "backward", self.owner, pass_name=self.pass_name)

    def _backward_hook(self, owner: fx.Node) -> Callable[[Any], None]:
        def hook(grad_outputs: Any) -> None:
            self.backward_done()
            self.owner = owner

        return hook


# -- AOTAutograd's joint ---------------------------------------------------------------------------


def _aot_phase(node: fx.Node) -> str:
    if node.op == "placeholder":
        return "backward" if node.name.startswith("tangents") else "forward"
    tag = node.meta.get("partitioner_tag")
    if tag == "is_backward":
        return "backward"
    if tag == "is_forward":
        return "forward"
    return "backward" if node.meta.get("autograd_backward") else "forward"


def tag_aot_joint(joint: fx.GraphModule, requires_grad: Sequence[bool] | None) -> None:
    """Tag each node of AOTAutograd's joint graph with its phase and forward origin.

    requires_grad: per primal input (in order), whether it requires grad; a forward node requires
    grad when it depends on such an input. None (or a count that does not match the primals):
    every forward node is taken to require grad, which only makes verify stricter.
    """
    rules = registry.rules()
    primals = [n for n in joint.graph.find_nodes(op="placeholder") if _aot_phase(n) == "forward"]
    if requires_grad is None or len(requires_grad) != len(primals):
        requires_grad = [True] * len(primals)
    needs: dict[fx.Node, bool] = dict(zip(primals, requires_grad, strict=True))
    # seq_nr -> the forward node backward nodes of that number differentiate: the usp op with a rule
    # when there is one (a multi-output op's getitems share its number), else the first node.
    owner: dict[int, fx.Node] = {}
    phases = {node: _aot_phase(node) for node in joint.graph.nodes}
    for node in joint.graph.nodes:
        node.meta[PHASE_META] = phases[node]  # first: graph files list meta keys in insertion order
        if phases[node] != "forward":
            continue
        if node.op != "placeholder":
            needs[node] = any(needs.get(i, False) for i in node.all_input_nodes)
        node.meta[REQUIRES_GRAD_META] = needs.get(node, False)
        stamp(node, "forward", node, requires_grad=needs.get(node, False))
        seq = node.meta.get("seq_nr")
        if seq is not None and (
            seq not in owner or (node.target in rules and owner[seq].target not in rules)
        ):
            owner[seq] = node
    for node in joint.graph.nodes:
        if phases[node] == "backward":
            stamp(node, "backward", owner.get(node.meta.get("seq_nr")))
