"""The joint pass: differentiate the rewritten forward graph into one train-step graph.

The forward graph runs as an `fx.Interpreter` under make_fx (symbolic, post-dispatch), and
`torch.autograd.grad` of its loss is traced with it. So the forward part holds exactly the
kernels eager autograd runs for each forward op, and the backward part is whatever each op's
registered autograd rule emits (``usp::varlen_bwd`` for ``usp::varlen_fwd``, adjoint collectives
for collectives): the graph cannot hold a backward that eager would not run.

Provenance: each joint node records the forward node it came from (``meta["usp_fwd_node"]``), its
phase (``meta["usp_phase"]``: ``"forward"`` or ``"backward"``) and the forward node's stack trace,
so verify can name a source location for a backward op too (`usp_graph.passes.provenance`, which
the compile backend's joint uses as well). Backward nodes are attributed with a pre-hook on each
forward op's autograd node: what the engine runs after that hook fires, until the next one, is
that op's backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from ..sites import node_value
from .base import PASS_META, PassContext, PassResult
from .provenance import ORIGIN_META, PHASE_META, TraceProvenance
from .rewrite import INPUT_META

__all__ = ["build_joint", "PASS_NAME", "PHASE_META", "ORIGIN_META"]

PASS_NAME = "joint"


class _Interpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, provenance: TraceProvenance) -> None:
        super().__init__(gm)
        self.provenance = provenance

    def run_node(self, n: fx.Node) -> Any:
        self.provenance.owner = n
        result = super().run_node(n)
        self.provenance.forward_done(result)
        return result


def _trainable(node: fx.Node) -> bool:
    tag = node.meta.get(INPUT_META, {})
    return tag.get("kind") == "param" and bool(tag.get("trainable", True))


def build_joint(gm: fx.GraphModule) -> PassResult:
    """forward(params, buffers, batch, cu_seqlens_N1, max_seqlen) -> loss
    ==> joint(params, buffers, batch, cu_seqlens_N1, max_seqlen) -> (loss, *grads)

    One grad output per trainable parameter placeholder (tagged ``meta["usp_input"]``), in
    placeholder order; a parameter the loss does not reach gets ``None`` (verify rejects it).
    ``gm.meta["usp_outputs"]`` names the outputs (``"loss"``, ``"grad:<param name>"``).

    Why: the backward must come from the ops' registered rules, traced through the rewritten
    forward, never from a hand-written or pattern-matched backward.

    matches: the number of gradient outputs.
    """
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    vals = [node_value(p) for p in placeholders]
    trainable = [i for i, p in enumerate(placeholders) if _trainable(p)]
    for i in trainable:
        v = vals[i]
        if not isinstance(v, torch.Tensor) or not v.is_floating_point():
            raise ValueError(
                f"trainable parameter input {placeholders[i].name} needs a floating-point fake value in "
                f"meta['val'], got {v!r}"
            )
        # make_fx stores detached copies in meta["val"]; the joint needs leaves that require grad.
        vals[i] = v.detach().requires_grad_(True)
    if not trainable:
        raise ValueError(
            "the graph has no trainable parameter inputs (meta['usp_input']); nothing to differentiate"
        )
    provenance = TraceProvenance(PASS_NAME)

    def joint(*args: Any) -> tuple[Any, ...]:
        provenance.start()
        loss = _Interpreter(gm, provenance).run(*args)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            raise ValueError(f"step_fn must return a scalar floating-point loss, got {loss!r}")
        if not loss.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter")
        provenance.owner = None
        grads = torch.autograd.grad(loss, [args[i] for i in trainable], allow_unused=True)
        provenance.backward_done()
        return (loss, *grads)

    with torch.enable_grad():
        jgm = make_fx(joint, tracing_mode="symbolic")(*vals)
    # Inputs keep the forward graph's names and tags: the calling convention does not change.
    for new, old in zip(jgm.graph.find_nodes(op="placeholder"), placeholders, strict=True):
        new._rename(old.name)
        new.target = old.name
        for key in (INPUT_META, PASS_META):
            if key in old.meta:
                new.meta[key] = old.meta[key]
        new.meta[PHASE_META] = "input"
    jgm.recompile()
    jgm.meta.update({k: v for k, v in gm.meta.items() if k.startswith("usp_")})
    jgm.meta["usp_outputs"] = ["loss"] + [
        "grad:" + placeholders[i].meta[INPUT_META]["name"] for i in trainable
    ]
    return PassResult(PASS_NAME, jgm, len(trainable))


def joint_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return build_joint(gm)
