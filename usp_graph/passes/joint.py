"""The joint pass: differentiate the rewritten forward graph into one train-step graph.

The forward graph runs as an `fx.Interpreter` under make_fx (symbolic, post-dispatch), and
`torch.autograd.grad` of its loss is traced with it. So the forward part holds exactly the
kernels eager autograd runs for each forward op, and the backward part is whatever each op's
registered autograd rule emits (``usp::varlen_bwd`` for ``usp::varlen_fwd``, adjoint collectives
for collectives): the graph cannot hold a backward that eager would not run.

Provenance: each joint node records the forward node it came from (``meta["usp_fwd_node"]``), its
phase (``meta["usp_phase"]``: ``"forward"`` or ``"backward"``) and the forward node's stack trace,
so verify can name a source location for a backward op too. Backward nodes are attributed with
a pre-hook on each forward op's autograd node: what the engine runs after that hook fires, until
the next one, is that op's backward.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import get_proxy_mode, make_fx
from torch.utils import _pytree as pytree

from ..sites import node_value
from .base import PASS_META, PassContext, PassResult
from .rewrite import INPUT_META

__all__ = ["build_joint", "PASS_NAME", "PHASE_META", "ORIGIN_META"]

PASS_NAME = "joint"
PHASE_META = "usp_phase"
ORIGIN_META = "usp_fwd_node"


class _Recorder:
    """Tags nodes appended to the graph being traced with the forward node they belong to."""

    def __init__(self) -> None:
        self.graph: fx.Graph | None = None
        self.mark = 0
        self.owner: fx.Node | None = None
        # Holding the grad_fn objects keeps their ids (and Python wrappers) from being reused.
        self.seen: dict[Any, fx.Node] = {}
        self.requires_grad = False

    def start(self) -> None:
        mode = get_proxy_mode()
        assert mode is not None, "the joint pass must run under make_fx"
        self.graph = mode.tracer.graph
        self.mark = self.graph._len

    def flush(self, phase: str) -> None:
        """Tag the nodes appended since the last flush as `phase` nodes of `self.owner`."""
        graph = self.graph
        new = graph._len - self.mark
        node = graph._root.prev
        owner = self.owner
        for _ in range(new):
            meta = node.meta
            if owner is not None:
                meta[ORIGIN_META] = owner.name
                meta[PASS_META] = owner.meta.get(PASS_META, "trace") if phase == "forward" else PASS_NAME
                if owner.meta.get("stack_trace"):
                    meta["stack_trace"] = owner.meta["stack_trace"]
                if "usp_site" in owner.meta:
                    meta["usp_site"] = owner.meta["usp_site"]
            else:
                meta[PASS_META] = PASS_NAME
            meta[PHASE_META] = phase
            if phase == "forward":
                meta["usp_requires_grad"] = self.requires_grad
            node = node.prev
        self.mark = graph._len

    def backward_hook(self, owner: fx.Node):
        def hook(grad_outputs: Any) -> None:
            self.flush("backward")
            self.owner = owner

        return hook


class _Interpreter(fx.Interpreter):
    def __init__(self, gm: fx.GraphModule, recorder: _Recorder) -> None:
        super().__init__(gm)
        self.recorder = recorder

    def run_node(self, n: fx.Node) -> Any:
        rec = self.recorder
        rec.owner = n
        result = super().run_node(n)
        rec.requires_grad = False
        for t in pytree.tree_leaves(result):
            if isinstance(t, torch.Tensor) and t.grad_fn is not None:
                rec.requires_grad = True
                grad_fn = t.grad_fn
                if grad_fn not in rec.seen:  # a multi-output op's outputs share one grad_fn
                    rec.seen[grad_fn] = n
                    grad_fn.register_prehook(rec.backward_hook(n))
        rec.flush("forward")
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
    recorder = _Recorder()

    def joint(*args: Any) -> tuple[Any, ...]:
        recorder.start()
        loss = _Interpreter(gm, recorder).run(*args)
        if not (isinstance(loss, torch.Tensor) and loss.dim() == 0 and loss.is_floating_point()):
            raise ValueError(f"step_fn must return a scalar floating-point loss, got {loss!r}")
        if not loss.requires_grad:
            raise ValueError("the loss does not depend on any trainable parameter")
        recorder.owner = None
        grads = torch.autograd.grad(loss, [args[i] for i in trainable], allow_unused=True)
        recorder.flush("backward")
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
