"""`documents(metadata)`: packed-document boundaries for the calls of ``backend="usp"`` functions.

    compiled = torch.compile(model, backend="usp")
    with usp_graph.documents(AttentionMetadata.from_position_ids(batch["position_ids"])):
        logits = compiled(batch["input_ids"], batch["position_ids"])

The compiled graphs take the metadata as graph inputs (``cu_seqlens_N1``, a tensor, and
``max_seqlen``, a SymInt); each call reads them from here. They are never seen by Dynamo, so new
boundaries (or a new bound, or a new capacity) reuse the compiled code. Outside any
``documents(...)`` block every batch row is one document: SDPA's own semantics.

The block must enclose the call of the compiled function, not sit inside it.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import weakref
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from typing import Any

import torch
import torch.nn.functional as F

from .. import resolve
from ..checkpointing import recompute_under
from ..metadata import AttentionMetadata, check_has_values
from ..resolve import attention_mode_active, refuse_unhonoured

__all__ = ["documents", "current_documents", "current_kv_documents", "packed_documents_active"]

# A ContextVar, not a global: threads and asyncio tasks each see their own block.
_CURRENT: ContextVar[tuple[AttentionMetadata | None, AttentionMetadata | None]] = ContextVar(
    "usp_graph_documents", default=(None, None)
)


@contextlib.contextmanager
def documents(
    metadata: AttentionMetadata | None, *, kv: AttentionMetadata | None = None
) -> Iterator[AttentionMetadata | None]:
    """Within the block, calls of ``backend="usp"`` functions attend within `metadata`'s documents.

    `metadata` describes the packed token stream of each attention call (under context
    parallelism: the GLOBAL stream of all ranks, the same on every rank); None restores one
    document per batch row for a nested block. Blocks nest; the innermost wins.

    `kv`: the documents of a conditioning stream that cross-attention reads (e.g. per-sample text
    tokens packed next to each other): document i of `metadata` attends document i of `kv`, so
    both need the same capacity (``max_docs``). Which calls are cross-attention is decided from the
    graph's data flow (keys not computed from the queries' inputs), never from lengths.
    """
    for name, value in (("metadata", metadata), ("kv", kv)):
        if value is not None and not isinstance(value, AttentionMetadata):
            raise TypeError(
                f"documents() takes a usp_graph.AttentionMetadata or None as {name}, got {type(value).__name__}; "
                "build one with AttentionMetadata.from_lengths / from_position_ids / from_document_ids"
            )
    if kv is not None:
        if metadata is None:
            raise ValueError("documents(None, kv=...): key/value documents need query documents too")
        if kv.cu_seqlens.shape != metadata.cu_seqlens.shape:
            raise ValueError(
                f"documents(metadata, kv=...): metadata has {metadata.cu_seqlens.numel() - 1} document slots and kv "
                f"{kv.cu_seqlens.numel() - 1}; build both with the same max_docs"
            )
        if kv.cu_seqlens.device != metadata.cu_seqlens.device:
            raise ValueError(
                f"documents(metadata, kv=...): metadata is on {metadata.cu_seqlens.device} and kv on "
                f"{kv.cu_seqlens.device}; build both for the same device (AttentionMetadata.to(device))"
            )
    check_has_values(metadata, "documents(metadata)")
    check_has_values(kv, "documents(metadata, kv=kv)")
    global _PACKED
    if metadata is not None:
        _guard_eager_sdpa()
    token = _CURRENT.set((metadata, kv))
    packed, _PACKED = _PACKED, metadata is not None
    try:
        yield metadata
    finally:
        _CURRENT.reset(token)
        _PACKED = packed


# Whether the innermost block has documents, as a plain module global: code that Dynamo traces
# (transformers' attention implementation "usp", `usp_graph.hf`) reads it through
# `packed_documents_active`, and Dynamo guards on its value (a ContextVar it cannot read), so code
# compiled inside a block is not reused outside one.
_PACKED = False


def packed_documents_active() -> bool:
    """Whether the innermost `documents` block gives documents (readable by compiled code)."""
    return _PACKED


@contextlib.contextmanager
def _restored(
    state: tuple[tuple[AttentionMetadata | None, AttentionMetadata | None], bool],
) -> Iterator[None]:
    global _PACKED
    token = _CURRENT.set(state[0])
    packed, _PACKED = _PACKED, state[1]
    try:
        yield
    finally:
        _CURRENT.reset(token)
        _PACKED = packed


def _forward_documents() -> Callable[[], contextlib.AbstractContextManager]:
    """What restores the documents state of now (an activation checkpoint's forward) for the
    region's recompute: it attends the documents its forward did, wherever backward runs (after the
    block, inside the next micro-batch's block, on autograd's device thread)."""
    return functools.partial(_restored, (_CURRENT.get(), _PACKED))


def current_documents() -> AttentionMetadata | None:
    """The metadata of the innermost `documents` block, or None outside any."""
    return _CURRENT.get()[0]


def current_kv_documents() -> AttentionMetadata | None:
    """The key/value (cross-attention) metadata of the innermost `documents` block, or None."""
    return _CURRENT.get()[1]


# ------------------------------------------------------------------------------------------------
# SDPA that runs outside compiled code while documents are active.

_PLAIN_SDPA = torch._C._nn.scaled_dot_product_attention


class EagerAttentionError(RuntimeError):
    """An SDPA call ran eagerly (outside any graph of backend "usp") inside `documents(...)`."""


def _traced(args: tuple[Any, ...]) -> bool:
    """The call is being traced (make_fx, export): fake or functional tensors, not a run."""
    from ..metadata import _is_real

    query = args[0] if args else None
    return isinstance(query, torch.Tensor) and not _is_real(query)


@functools.wraps(_PLAIN_SDPA)
def _checked_sdpa(*args: Any, **kwargs: Any) -> Any:
    # Dynamo folds is_compiling() to True and traces the plain call: compiled graphs are unchanged,
    # but for an active block the compiler would ignore (`refuse_unhonoured`).
    if torch.compiler.is_compiling():
        query = args[0] if args else kwargs.get("query")
        if isinstance(query, torch.Tensor):
            refuse_unhonoured(query)
        return _PLAIN_SDPA(*args, **kwargs)
    outside = _CURRENT.get()[0] is None
    if outside or attention_mode_active() or _traced(args):
        if outside and _GRAPH_MASKS and not _eager_mask_warned:
            _warn_if_graph_mask(args[3] if len(args) > 3 else kwargs.get("attn_mask"))
        return _PLAIN_SDPA(*args, **kwargs)
    raise EagerAttentionError(
        "scaled_dot_product_attention ran eagerly, outside every graph of backend 'usp', while "
        "usp_graph.documents(...) is active: it would attend across the documents. Dynamo runs a frame "
        "eagerly past its recompile limit (all transformers models share one forward code object: raise "
        "torch._dynamo.config.recompile_limit), under torch.compiler.disable, or when the call is not in "
        "compiled code at all; for eager code use usp_graph.attention_mode(metadata)" + _dynamo_breaks()
    )


def refuse_left_out_region(block: AttentionMetadata, tokens: int) -> None:
    """An eager attention call inside the block (transformers' "usp") whose token count is not the
    block's, in a process where Dynamo broke its graphs: a layer left out of them (a checkpointed one
    it cannot compile, say) runs eagerly, outside backend usp and its context parallelism (each rank's
    call sees its shard of the block's global tokens). Refused with Dynamo's breaks and, where one is
    known, the setting that compiles the layer, not with the token count alone."""
    if tokens == block.total_tokens or not _dynamo_breaks():
        return
    raise resolve.refuse(
        f"this attention call runs eagerly with {tokens} tokens, and the active usp_graph.documents(metadata) "
        f"describes {block.total_tokens}: a layer Dynamo left out of its graph runs outside "
        "backend usp (and its context parallelism, where each rank sees its shard)" + _dynamo_breaks(),
        "or give metadata for this call's tokens",
    )


def _dynamo_breaks() -> str:
    """Why code ran eagerly, as far as Dynamo says: its graph breaks in this process, and the fix
    where they include checkpointed regions it refused for a side effect (transformers >= 5.25's
    checkpointed layers)."""
    from ..checkpointing import SIDE_EFFECT_FIX, graph_break_summary, side_effect_breaks

    summary = graph_break_summary()
    if not summary:
        return ""
    text = ". Dynamo's graph breaks in this process: " + summary
    if side_effect_breaks():
        text += (
            ". Where it broke at checkpointed regions ('HOP: Unsafe side effect'), they run eagerly: to compile "
            "them, set " + SIDE_EFFECT_FIX
        )
    return text


# -- SDPA run eagerly on a mask a backend-usp graph built ------------------------------------------
#
# Outside a documents block, backend usp keeps a model's own semantics: it rewrites the SDPA calls
# it compiles, reading the model's mask. An SDPA call that Dynamo leaves out of its graphs (a
# checkpointed layer it cannot compile, such as transformers' checkpointing with offload=True, whose
# `save_on_cpu` Dynamo will not trace; a region under torch.compiler.disable; a frame past the
# recompile limit) still runs, eagerly, on the (T, T) mask a compiled graph built: right numbers,
# quadratic memory and no varlen kernel. Graphs mark the masks they return, so that call is named.

_GRAPH_MASKS: dict[int, weakref.ref] = {}  # id -> the mask-like outputs of usp graphs still alive
_eager_mask_warned = False


def mask_like(value: Any) -> bool:
    """A graph output that may be an attention mask: boolean of two or more dims, or a (B, 1, Tq, Tk)
    float mask (transformers' additive masks)."""
    if not isinstance(value, torch.Tensor) or value.dim() < 2:
        return False
    return value.dtype == torch.bool or (
        value.dim() == 4 and value.shape[1] == 1 and value.is_floating_point()
    )


def note_graph_masks(outputs: Any, indices: tuple[int, ...]) -> None:
    """Mark `outputs[i]` for each of `indices` (a usp graph's mask-like outputs) as built by usp."""
    for i in indices:
        mask = outputs[i]
        if isinstance(mask, torch.Tensor):
            key = id(mask)
            _GRAPH_MASKS[key] = weakref.ref(mask, functools.partial(_forget_mask, key))


def _forget_mask(key: int, ref: weakref.ref) -> None:
    if _GRAPH_MASKS.get(key) is ref:
        del _GRAPH_MASKS[key]


def _from_graph(mask: torch.Tensor) -> bool:
    for t in (mask, mask._base):  # transformers slices the mask to the keys: a view of the output
        ref = _GRAPH_MASKS.get(id(t)) if t is not None else None
        if ref is not None and ref() is t:
            return True
    return False


def _warn_if_graph_mask(mask: Any) -> None:
    global _eager_mask_warned
    if not isinstance(mask, torch.Tensor) or not _from_graph(mask) or attention_mode_active():
        return
    _eager_mask_warned = True
    import warnings

    warnings.warn(
        f"usp backend: scaled_dot_product_attention ran eagerly on the {tuple(mask.shape)} mask a backend-usp "
        "graph built: Dynamo left this attention call out of its graphs, so the backend never rewrote it and it "
        "attends with the model's own mask (correct, but (T, T) memory and time, and no varlen kernel). Keep the "
        "call in the compiled graph (TORCH_LOGS=graph_breaks shows where Dynamo broke), or use "
        'attn_implementation="usp", whose eager calls attend packed documents without a mask'
        + _dynamo_breaks()
        + " (warned once per process)",
        UserWarning,
        stacklevel=3,
    )


def _guard_eager_sdpa() -> None:
    """`F.scaled_dot_product_attention` refuses to run eagerly inside a `documents` block, instead of
    silently attending across documents.

    Dynamo runs a frame eagerly when it hits its recompile limit or `torch.compiler.disable`; the
    backend then never sees its attention. Installed when the backend is imported (by
    ``backend="usp"`` through the entry point, or with usp_graph), before dynamo traces a frame for
    it, and kept: a compiled function guards on the function it calls, so installing it later (at
    the first block) recompiled every frame compiled before. Outside blocks, while compiling and
    under `attention_mode` it is the plain SDPA. Code that bound SDPA under another name before
    usp_graph was imported is not covered."""
    if F.scaled_dot_product_attention is not _checked_sdpa:
        F.scaled_dot_product_attention = _checked_sdpa


_guard_eager_sdpa()
recompute_under(_forward_documents)

resolve._BLOCKS = sys.modules[__name__]  # the resolver reads the blocks from here
