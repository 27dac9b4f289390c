"""Activation checkpointing of a model's blocks, full or selective, for usp's attention.

    checkpoint_blocks(model)                           # every block recomputed in backward
    checkpoint_blocks(model, policy="save_attention")  # attention (and its collectives) kept, the rest recomputed
    checkpoint_blocks(model, policy="recompute_attention")  # matmuls kept, attention recomputed

Each block's forward runs under non-reentrant `torch.utils.checkpoint` (torchtitan's layout: one
region per decoder block). The recompute runs the same usp ops as the forward, eager and compiled
and under context parallelism, with nothing for the user to add: `attention_mode` re-enters itself
for recomputes started inside it (`usp_graph.mode`), and ``backend="usp"`` rewrites the attention
inside checkpointed regions. A selective policy is a `create_selective_checkpoint_contexts`
`context_fn`: ``save_attention`` saves the outputs of usp's attention ops and collectives (the
recompute skips attention and communication, at the memory of the attention outputs);
``recompute_attention`` saves matmul outputs and recomputes attention and its collectives (every
rank recomputes them in the same order, so the collectives pair up).

Whatever checkpoints a region (these policies, transformers' checkpointing, `torch.utils.checkpoint`
by hand), its recompute runs under the `usp_graph.documents` state its forward saw
(`recompute_under`): backward after the block, or inside the next micro-batch's, is exact.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "POLICIES",
    "attention_ops",
    "checkpoint_blocks",
    "graph_break_summary",
    "note_eager_attention",
    "recompute_under",
    "selective_context_fn",
    "side_effect_breaks",
    "warn_side_effect_breaks",
]

POLICIES = (None, "full", "save_attention", "recompute_attention")

_ATTENTION = ("varlen_fwd", "ring_attn_fwd", "all_to_all", "all_gather", "reduce_scatter", "halo_exchange")
_MATMULS = ("mm", "addmm", "bmm", "linear")


def attention_ops() -> tuple[torch._ops.OpOverloadPacket, ...]:
    """usp's forward attention and collective ops (what ``save_attention`` saves)."""
    from . import ops  # noqa: F401  (registers the usp ops)

    return tuple(getattr(torch.ops.usp, name) for name in _ATTENTION if hasattr(torch.ops.usp, name))


def _policy(save: frozenset, ctx, op, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    packet = getattr(op, "overloadpacket", op)
    return CheckpointPolicy.MUST_SAVE if packet in save else CheckpointPolicy.PREFER_RECOMPUTE


def selective_context_fn(policy: str):
    """The `context_fn` of `torch.utils.checkpoint.checkpoint` for a selective `policy`
    (``"save_attention"`` or ``"recompute_attention"``)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    if policy == "save_attention":
        save = frozenset(attention_ops())
    elif policy == "recompute_attention":
        save = frozenset(getattr(torch.ops.aten, name) for name in _MATMULS)
    else:
        raise ValueError(f"policy must be 'save_attention' or 'recompute_attention', got {policy!r}")
    return functools.partial(create_selective_checkpoint_contexts, functools.partial(_policy, save))


def checkpoint_blocks(
    model: nn.Module, blocks: Sequence[nn.Module] | None = None, *, policy: str | None = "full"
) -> list[nn.Module]:
    """Run each block's forward under non-reentrant activation checkpointing; returns the blocks.

    `blocks` defaults to the items of the model's module lists (its decoder blocks). `policy`:
    ``"full"`` (or None) recomputes the whole block; ``"save_attention"`` and
    ``"recompute_attention"`` are selective (see the module docstring). Parameters and their
    names are unchanged (the block's `forward` is wrapped in place), so optimizers, FSDP2 and
    state dicts see the same model; apply it before or after `fully_shard`."""
    from torch.utils.checkpoint import checkpoint

    from .fsdp import blocks_of

    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    context = {} if policy in (None, "full") else {"context_fn": selective_context_fn(policy)}
    chosen = blocks_of(model) if blocks is None else list(blocks)
    if not chosen:
        raise ValueError("the model has no blocks (no nn.ModuleList); pass blocks= explicitly")
    for block in chosen:
        if getattr(block.forward, "_usp_checkpointed", False):
            raise ValueError(f"{type(block).__name__} is already checkpointed (checkpoint_blocks ran twice)")
        inner = block.forward

        def forward(*args, _inner=inner, **kwargs):
            return checkpoint(_inner, *args, use_reentrant=False, **context, **kwargs)

        forward._usp_checkpointed = True  # type: ignore[attr-defined]
        block.forward = forward
    return chosen


# -- checkpointed regions Dynamo could not compile -------------------------------------------------
#
# Dynamo compiles a checkpointed region as one higher-order op, and refuses (a graph break) a region
# whose forward mutates Python state from outside it: eager checkpointing replays the mutation in the
# recompute, a compiled graph cannot. The region then runs eagerly: no usp backend ever sees its
# attention (transformers' "usp" attention still attends the block's documents in eager, and its
# recompute too: `recompute_under` below). transformers >= 5.25 hits this at every checkpointed
# decoder layer: the `kernels` package it depends on wraps each attention module's forward
# (``use_kernelized_func``) in a set and reset of a module-level context variable, which under
# compilation is an attribute store on a global object. The reset restores the value the set
# replaced, so the region's net effect is nil and skipping its replay in the recompute changes
# nothing: Dynamo's ``skip_fwd_side_effects_in_bwd_under_checkpoint`` then compiles the region whole.
_SIDE_EFFECT_BREAK = "HOP: Unsafe side effect"

SIDE_EFFECT_FIX = (
    "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True before the first compiled call "
    "(exact when the region's side effect needs no replay in the recompute, as for the set-and-restore of the "
    "`kernels` package's attention wrapper that transformers >= 5.25 installs)"
)


def side_effect_breaks() -> int:
    """Graph breaks so far in this process at a checkpointed region whose forward mutates state
    from outside it (Dynamo's graph-break counter, which ``torch._dynamo.reset()`` keeps)."""
    from torch._dynamo.utils import counters

    return sum(
        n
        for reason, n in counters["graph_break"].items()
        if _SIDE_EFFECT_BREAK in reason and "checkpoint" in reason
    )


def graph_break_summary(limit: int = 3) -> str:
    """Dynamo's graph breaks in this process, the most recent first (those since the last
    ``torch._dynamo.reset()`` that made Dynamo cut a graph, then the rest by count): each reason's
    first line and Dynamo's explanation, with its count ("" without any, or before Dynamo loaded).
    What a message shows where code it expected compiled ran eagerly: the breaks of the model at
    hand, not those of whatever ran in the process before it."""
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:
        return ""
    counts = utils.counters["graph_break"]
    recent = [r.reason for r in reversed(getattr(utils, "graph_break_reasons", None) or [])]
    order = list(dict.fromkeys(recent))
    listed = set(order)
    order += [
        reason for reason, _ in sorted(counts.items(), key=lambda item: -item[1]) if reason not in listed
    ]
    found = [(reason, counts.get(reason) or recent.count(reason)) for reason in order]
    parts = []
    for reason, n in found[:limit]:
        lines = [line.strip() for line in str(reason).splitlines() if line.strip()]
        why = [
            line.removeprefix("Explanation:").strip() for line in lines[1:] if line.startswith("Explanation:")
        ]
        text = ": ".join(lines[:1] + why[:1])
        parts.append(f"'{text[:240]}' ({n}x)")
    if len(found) > limit:
        parts.append(f"{len(found) - limit} more (TORCH_LOGS=graph_breaks shows each)")
    return "; ".join(parts)


_seen_breaks = 0  # such breaks when last looked (Dynamo's counters are never cleared)
_seen_total = 0  # Dynamo's graph breaks when an eager attention call last looked


def warn_side_effect_breaks() -> bool:
    """Warn when Dynamo broke the graph at checkpointed regions since the last look (backend usp
    looks at every compile, transformers' "usp" attention at an eager call after new breaks): those
    regions run outside any compiled graph, so their attention is not usp's compiled attention.
    Returns whether it warned."""
    global _seen_breaks
    count = side_effect_breaks()
    new, _seen_breaks = count > _seen_breaks, count
    if not new:
        return False
    import warnings

    warnings.warn(
        "usp: Dynamo broke the graph at a checkpointed region (graph break 'HOP: Unsafe side effect': the "
        "region's forward mutates Python state from outside it), so those regions run eagerly, outside every "
        'compiled graph: attn_implementation="usp" attends their documents in eager (correct, slower), backend '
        "usp rewrites none of their attention, plain SDPA inside usp_graph.documents(...) is refused, and "
        "outside it attends with the model's own (T, T) mask. To compile them, set " + SIDE_EFFECT_FIX,
        UserWarning,
        stacklevel=3,
    )
    return True


def note_eager_attention() -> None:
    """An attention call ran outside any compiled graph. Where Dynamo has recorded new graph breaks
    since the last call and some are at checkpointed regions, the model was meant compiled and those
    regions were left out: `warn_side_effect_breaks`. Costs a sum over the distinct break reasons
    (a handful) per call once Dynamo is loaded, nothing before."""
    global _seen_total
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is None:  # Dynamo never loaded: nothing was compiled
        return
    total = utils.counters["graph_break"].total()
    if total != _seen_total:
        _seen_total = total
        warn_side_effect_breaks()


# -- the recompute runs under the state of its forward ---------------------------------------------
#
# A checkpointed region's recompute runs in backward, usually after the block that gave its forward
# its documents has closed (`usp_graph.documents`), and under gradient accumulation inside another
# block: it would attend other documents than its forward did (a CheckpointError when the saved
# metadata's shapes differ, other documents' gradients when they match). torch.utils.checkpoint
# restores RNG and autocast state for the recompute, nothing of usp's; so its entry points are
# wrapped to run the region's function under a context captured at the region's forward.

_Restorer = Callable[[], contextlib.AbstractContextManager]
_CAPTURES: list[Callable[[], _Restorer]] = []


def _under_forward_state(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` run under the state each capture of `recompute_under` sees now (at the region's forward)."""
    restorers = [capture() for capture in _CAPTURES]

    def run(*args: Any, **kwargs: Any) -> Any:
        with contextlib.ExitStack() as stack:
            for restore in restorers:
                stack.enter_context(restore())
            return fn(*args, **kwargs)

    return run


def recompute_under(capture: Callable[[], _Restorer]) -> None:
    """Run every activation checkpoint's recompute under the state ``capture()`` saw at its forward.

    `capture` returns a function that makes a context manager restoring the state it saw (made and
    entered at every recompute, a second backward's too, and for reentrant checkpoints around the
    forward as well, where it changes nothing). Covers `torch.utils.checkpoint.checkpoint`
    (reentrant and non-reentrant, and so transformers' checkpointing and `checkpoint_blocks`) and
    the composable ``torch.distributed._composable.checkpoint``; regions Dynamo compiles whole
    recompute inside the compiled backward, from the graph's own inputs."""
    import torch.utils.checkpoint as ckpt

    if capture not in _CAPTURES:
        _CAPTURES.append(capture)
    # Module globals `checkpoint` looks up at every call; another torch layout: left alone.
    generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    if generator is not None and not getattr(generator, "_usp_recompute", False):

        def nonreentrant(fn, *args, **kwargs):
            return generator(_under_forward_state(fn), *args, **kwargs)

        nonreentrant._usp_recompute = True  # type: ignore[attr-defined]
        ckpt._checkpoint_without_reentrant_generator = nonreentrant
        # The composable API binds the generator at its import: rebind it if it came first.
        composable = sys.modules.get("torch.distributed._composable.checkpoint_activation")
        if getattr(composable, "_checkpoint_without_reentrant_generator", None) is generator:
            composable._checkpoint_without_reentrant_generator = nonreentrant
    function = getattr(ckpt, "CheckpointFunction", None)
    if isinstance(function, type) and not getattr(function, "_usp_recompute", False):
        ckpt.CheckpointFunction = _reentrant(function)


def _reentrant(function: type) -> type:
    """A subclass of reentrant checkpoint's autograd function (same name, same backward) whose
    `run_function` runs under the forward's state."""

    class CheckpointFunction(function):  # type: ignore[misc, valid-type]
        _usp_recompute = True

        @classmethod
        def apply(cls, run_function, preserve_rng_state, *args):  # type: ignore[override]
            return super().apply(_under_forward_state(run_function), preserve_rng_state, *args)

    CheckpointFunction.__qualname__ = function.__qualname__
    CheckpointFunction.__module__ = function.__module__
    return CheckpointFunction
