"""`attention_mode`: route every SDPA call through `sdpa_to_usp`, in eager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .metadata import AttentionMetadata
from .sdpa import sdpa_to_usp

__all__ = ["attention_mode"]

# F.scaled_dot_product_attention is the C function itself; list both spellings in case a release
# wraps it in Python.
_SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _SDPAToUSP(TorchFunctionMode):
    def __init__(self, metadata: AttentionMetadata | None, cp) -> None:
        super().__init__()
        self.metadata = metadata
        self.cp = cp
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA_FUNCS:
            self.calls += 1
            return sdpa_to_usp(*args, **kwargs, metadata=self.metadata, cp=self.cp)
        return func(*args, **kwargs)


@contextlib.contextmanager
def attention_mode(metadata: AttentionMetadata | None = None, *, cp=None) -> Iterator[_SDPAToUSP]:
    """Run every `F.scaled_dot_product_attention` call inside through `sdpa_to_usp`.

    `metadata=None`: one document per batch row (SDPA's own semantics). With metadata, each call's
    `B * L` tokens (row-major) are the packed stream it describes and documents are isolated.
    With `cp` (a `usp_graph.ContextParallel`), SDPA inputs are this rank's sequence shards and
    `metadata` describes the global stream of all ranks' tokens.
    The yielded object counts the calls it routed (`.calls`).
    """
    if metadata is not None and not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"metadata must be a usp_graph.AttentionMetadata or None, got {type(metadata).__name__}"
        )
    if cp is not None:
        from .cp import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a usp_graph.ContextParallel or None, got {type(cp).__name__}")
    mode = _SDPAToUSP(metadata, cp)
    with mode, _recompute_checkpoints_in(mode):
        yield mode


def _in_mode(mode: TorchFunctionMode):
    """A context that enters `mode` unless it is already active (a recompute inside the block)."""
    from torch.overrides import _get_current_function_mode_stack

    if any(m is mode for m in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return mode


@contextlib.contextmanager
def _recompute_checkpoints_in(mode: _SDPAToUSP) -> Iterator[None]:
    """Activation checkpoints started inside the block recompute under `mode` in backward.

    `torch.utils.checkpoint` reruns a region's forward when backward needs its activations,
    after the `attention_mode` block has usually closed: the rerun would call plain SDPA, save
    other tensors than the forward did and fail with a CheckpointError (or, worse, attend across
    documents). While the block is open, checkpoint's two entry points (module globals it looks up
    at every call) are wrapped so that the rerun enters the same mode: non-reentrant checkpoints
    get it as their recompute context (after the user's own `context_fn`), reentrant ones run the
    region's function inside it. Nothing else about checkpointing changes."""
    import torch.utils.checkpoint as ckpt

    generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    function = getattr(ckpt, "CheckpointFunction", None)
    if generator is None or function is None:  # another torch layout: leave checkpoint alone
        yield
        return

    def nonreentrant(fn, preserve, context_fn, determinism_check, debug, *rest, **kwargs):
        if debug:  # checkpoint's debug mode refuses a context_fn of its own
            return generator(fn, preserve, context_fn, determinism_check, debug, *rest, **kwargs)

        def with_mode():
            forward_ctx, recompute_ctx = context_fn()
            return forward_ctx, _Both(recompute_ctx, lambda: _in_mode(mode))

        return generator(fn, preserve, with_mode, determinism_check, debug, *rest, **kwargs)

    class _Reentrant:
        @staticmethod
        def apply(run_function, preserve_rng_state, *args):
            def run_in_mode(*a):
                with _in_mode(mode):
                    return run_function(*a)

            return function.apply(run_in_mode, preserve_rng_state, *args)

    ckpt._checkpoint_without_reentrant_generator = nonreentrant
    ckpt.CheckpointFunction = _Reentrant
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = generator
        ckpt.CheckpointFunction = function


class _Both:
    """Enter `first`, then the context `second()` makes (at entry, not before)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second())

    def __exit__(self, *exc) -> bool | None:
        return self.stack.__exit__(*exc)
