"""`attention_mode`: route every SDPA call through `sdpa_to_usp`, in eager."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from . import dynamo_marks
from .checkpointing import recompute_under
from .metadata import AttentionMetadata, check_has_values
from .rows import RowTracker
from .rules import refusal
from .sdpa import SDPA_OP, sdpa_to_usp

__all__ = ["attention_mode"]

# F.scaled_dot_product_attention is the C function itself; list both spellings in case a release
# wraps it in Python.
_SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _SDPAToUSP(TorchFunctionMode):
    """Routes SDPA calls through `sdpa_to_usp` with the block's documents; a `RowTracker` follows
    the data flow of every other call (which stream a call's keys come from, and what the rules of
    `usp_graph.rules` refuse under packed documents)."""

    def __init__(self, metadata: AttentionMetadata | None, cp, kv: AttentionMetadata | None = None) -> None:
        super().__init__()
        self.metadata = metadata
        self.kv = kv
        self.cp = cp
        self.calls = 0
        self.refused: ValueError | None = None  # a refusal found while Dynamo traced this mode
        # With documents, whether a call is cross-attention matters (its keys take other
        # documents), and eager has no graph to read it from: follow the data flow op by op.
        self.track = metadata is not None or cp is not None
        self.rows = RowTracker(metadata, cp, kv)
        # Roots of self-attention calls routed with the query documents while key/value documents
        # differ: checked against the keys of each later cross-attention call (see _is_kv_stream).
        self._query_self: list[frozenset[int]] = []
        self._same = kv is None or metadata is None or _same_documents(metadata, kv)  # one check per block

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refused is not None:
            raise self.refused
        if torch.compiler.is_compiling() and func not in _SDPA_FUNCS and func is not SDPA_OP:
            return self._while_compiling(func, args, kwargs)
        if func in _SDPA_FUNCS:
            self.calls += 1
            return self._attention(*args, **kwargs)
        if func is SDPA_OP:  # SDPA with a window (`sdpa.windowed_sdpa`)
            self.calls += 1
            q, k, v, is_causal, scale, gqa, window = _bind_window_sdpa(args, kwargs)
            win = None if tuple(window) == (-1, -1) else tuple(window)
            return self._attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa, window=win)
        if self.track:
            self.rows.before(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.track:
            self.rows.after(func, args, kwargs, out)
        return out

    def _while_compiling(self, func, args, kwargs):
        """Dynamo traces this mode inside a function the model compiles itself (transformers calls
        flex_attention through torch.compile): an error raised here would reach the caller as
        "Unsupported: Observed exception", and the tracking reads values a trace has none of. Flex
        attention under packed documents is refused by a function Dynamo leaves to eager, before
        the inner compiler sees the graph (inductor has no fp64 CPU kernel for it: issue 37), and
        kept for the next call should Dynamo run the mode again."""
        if self.metadata is not None and getattr(func, "__name__", "") == "flex_attention":
            q = args[0] if args else kwargs.get("query")
            length = q.shape[-2] if isinstance(q, torch.Tensor) and q.dim() >= 2 else None
            if not isinstance(length, int) or self.rows.packed(length):
                self.refused = refusal("the model", [("flex_attention", "")], cp=self.cp is not None)
                _raise_in_eager(self.refused)
        return func(*args, **kwargs)

    def _attention(self, query, key, value, *args, **kwargs):
        if not query.is_meta:  # a model on the meta device checks shapes: metadata there holds none either
            check_has_values(self.metadata, "attention_mode(metadata)")
            check_has_values(self.kv, "attention_mode(metadata, kv=kv)")
        if self.track:
            self.rows.attention(query, key)
        extra = {}
        if self.track and self.rows.is_cross(query, key):
            if self.metadata is None:  # under CP: one document per (global) row of both streams
                b = query.shape[0]
                metadata = AttentionMetadata.per_sample(b, query.shape[-2] * self.cp.world)
                kv = AttentionMetadata.per_sample(b, key.shape[-2])
                out = sdpa_to_usp(
                    query, key, value, *args, **kwargs, metadata=metadata, cp=self.cp, kv_metadata=kv
                )
                self.rows.streams.note(out, self.rows.streams.inputs((query, key, value)))
                return out
            if self.kv is None:
                raise ValueError(
                    "attention_mode(metadata): this SDPA call is cross-attention (its keys are not computed from "
                    "everything its queries are), so the query documents cannot apply to its keys; give the "
                    "key/value stream's documents too: attention_mode(metadata, kv=kv_metadata)"
                )
            self._check_kv_stream(key)
            extra["kv_metadata"] = self.kv
        elif self.kv is not None and self.metadata is not None:
            if self._is_kv_stream(query):
                # Self-attention on the key/value stream (an encoder's): its own documents, and under
                # context parallelism that stream is replicated, not sharded.
                out = sdpa_to_usp(query, key, value, *args, **kwargs, metadata=self.kv)
                self.rows.streams.note(out, self.rows.streams.inputs((query, key, value)))
                return out
            if not self._same:
                self._query_self.append(self.rows.streams.inputs((query, key)))
        out = sdpa_to_usp(query, key, value, *args, **kwargs, metadata=self.metadata, cp=self.cp, **extra)
        if self.track:
            self.rows.streams.note(out, self.rows.streams.inputs((query, key, value)))
        return out

    def _is_kv_stream(self, query) -> bool:
        """A self-attention call on the key/value stream: eager cannot see the cross-attention that
        comes later, so it goes by token count, where only the key/value documents fit."""
        world = self.cp.world if self.cp is not None else 1
        tokens = query.shape[0] * query.shape[-2]
        return tokens == self.kv.total_tokens and tokens * world != self.metadata.total_tokens

    def _check_kv_stream(self, key) -> None:
        """Refuse a cross-attention call whose keys come from a stream that an earlier self-attention
        call attended with the query documents (equal token counts made the two look alike)."""
        k_roots = self.rows.streams.inputs((key,))
        if any(r and r <= k_roots for r in self._query_self):
            raise ValueError(
                "attention_mode(metadata, kv=kv): a self-attention call on the key/value stream of this "
                "cross-attention (an encoder's) ran with the query documents, because both streams have the same "
                "token count and eager cannot tell them apart before the cross-attention; use "
                "torch.compile(model, backend='usp') under usp_graph.documents(metadata, kv=kv), which reads the "
                "streams from the graph, or give the two streams different token counts"
            )


@dynamo_marks.disable
def _raise_in_eager(error: ValueError) -> None:
    """Raise `error` as itself from code Dynamo traces: Dynamo breaks the graph here and runs this
    in eager, so the caller gets the ValueError (not "Unsupported"), before any inner compiler."""
    raise error


def _bind_window_sdpa(args, kwargs) -> list:
    schema = SDPA_OP._schema
    bound = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            bound.append(args[i])
        elif arg.name in kwargs:
            bound.append(kwargs[arg.name])
        else:
            bound.append(arg.default_value)
    return bound


def _same_documents(a: AttentionMetadata, b: AttentionMetadata) -> bool:
    return a.cu_seqlens.shape == b.cu_seqlens.shape and bool(
        torch.equal(a.cu_seqlens, b.cu_seqlens.to(a.cu_seqlens.device))
    )


@contextlib.contextmanager
def attention_mode(
    metadata: AttentionMetadata | None = None, *, cp=None, kv: AttentionMetadata | None = None
) -> Iterator[_SDPAToUSP]:
    """Run every `F.scaled_dot_product_attention` call inside through `sdpa_to_usp`.

    `metadata=None`: one document per batch row (SDPA's own semantics). With metadata, each call's
    `B * L` tokens (row-major) are the packed stream it describes and documents are isolated.
    With `cp` (a `usp_graph.ContextParallel`), SDPA inputs are this rank's sequence shards and
    `metadata` describes the global stream of all ranks' tokens.
    `kv`: the documents of the key/value stream of cross-attention calls (document i of the
    queries attends document i of the keys; same capacity). A call is cross-attention when its
    keys are not computed from everything its queries are computed from (followed op by op while
    metadata is given); under metadata, such a call without `kv` raises instead of attending with
    the query documents.
    Under packed documents (`metadata` whose documents are not exactly the rows:
    `rules.one_document_per_row`) or `cp`, what would silently cross documents (or shards) is
    refused with a ValueError, by the rule table every door applies (`usp_graph.rules`, followed op
    by op by `usp_graph.rows.RowTracker`): attention computed without SDPA, positions the model
    counts along the row itself (not the position ids passed in) that it embeds or that reach
    queries or keys, convolutions along the sequence, linear attention (a sum over the sequence).
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
    if kv is not None:
        if not isinstance(kv, AttentionMetadata):
            raise TypeError(f"kv must be a usp_graph.AttentionMetadata or None, got {type(kv).__name__}")
        if metadata is None:
            raise ValueError("attention_mode(None, kv=...): key/value documents need query documents too")
    mode = _SDPAToUSP(metadata, cp, kv)
    with mode, _recompute_checkpoints_in(mode):
        yield mode
    if mode.refused is not None:
        raise mode.refused


def _in_mode(mode: TorchFunctionMode):
    """A context that enters `mode` unless it is already active (a recompute inside the block)."""
    from torch.overrides import _get_current_function_mode_stack

    if any(m is mode for m in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return mode


# The open blocks' modes, innermost last: a checkpointed region started inside a block recomputes
# under the innermost one (`_forward_mode`).
_OPEN_MODES: list[_SDPAToUSP] = []


@contextlib.contextmanager
def _recompute_checkpoints_in(mode: _SDPAToUSP) -> Iterator[None]:
    """Activation checkpoints started inside the block recompute under `mode` in backward.

    `torch.utils.checkpoint` reruns a region's forward when backward needs its activations, after
    the `attention_mode` block has usually closed: the rerun would call plain SDPA, save other
    tensors than the forward did and fail with a CheckpointError (or, worse, attend across
    documents). `usp_graph.checkpointing.recompute_under` runs every region's recompute under what
    `_forward_mode` saw at the region's forward: the mode of the innermost open block. Its wrappers
    of checkpoint's entry points are installed once and hold no block's mode (nor its
    ContextParallel and process group, which would then outlive `destroy_process_group`: issue 37);
    a region's own recompute holds its mode as long as its autograd graph lives."""
    _OPEN_MODES.append(mode)
    try:
        yield
    finally:
        _OPEN_MODES.remove(mode)


def _forward_mode() -> Callable[[], contextlib.AbstractContextManager]:
    """At a checkpointed region's forward: what its recompute enters (the innermost open block's
    mode, unless already active; nothing outside a block)."""
    if not _OPEN_MODES:
        return contextlib.nullcontext
    mode = _OPEN_MODES[-1]
    return lambda: _in_mode(mode)


recompute_under(_forward_mode)
