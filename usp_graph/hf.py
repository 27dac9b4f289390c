"""transformers attention implementation ``"usp"``: varlen attention within packed documents, and
no mask built for it.

# B batch, H query heads, G key/value heads, L sequence, K head dim, T packed tokens (B * L)

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="usp")   # or from_config,
    model.set_attn_implementation("usp")                                           # or later

Registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (when
transformers' modeling code is imported, or at ``import usp_graph`` if it already was), so
transformers builds no (T, T) mask: the mask builder of ``"usp"`` returns None after checking that
nothing would be lost (`usp_mask`). Each attention call then takes its documents from, in order:

1. an active `usp_graph.attention_mode(metadata, cp=...)` (eager; context parallelism too),
2. an active `usp_graph.documents(metadata)` (under ``torch.compile(backend="usp")``, which
   rewrites the call as an attention site; in eager code, directly),
3. the ``position_ids`` transformers passes to attention, in the padding-free convention
   (``DataCollatorWithFlattening``, flash-attention's): a document starts where a position is 0
   and at each row start. Eager reads them once per forward (one host sync, shared by every
   layer); compiled code derives the boundaries inside the graph (capacity T + 1; on CUDA the
   kernels cut them to the documents with one host read per step),
4. otherwise one document per batch row (SDPA's own semantics).

Causal or bidirectional from the module (``module.is_causal``, or the ``is_causal`` transformers
passes), a sliding window from the layer (the ``sliding_window`` transformers passes, else
``module.sliding_window``; flash-attention's reading: ``window - 1`` keys back, and forward too
when bidirectional), grouped-query attention without repeating K/V. Refused with the reason: a
padding mask or a 4-D mask (pack the documents instead), a mask function beyond documents, causal
and windows (multimodal blocks, chunked attention), a KV cache (query and key lengths differ),
logit softcapping, attention sinks, a position bias, dropout inside attention.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import weakref
from typing import Any

import torch
from torch import Tensor

from .masks import check_positions_match, cu_seqlens_from_starts, document_starts
from .metadata import AttentionMetadata
from .ops.boundaries import device_assert
from .sdpa import _is_tracing, sdpa_to_usp, windowed_sdpa

__all__ = ["ATTENTION", "register", "usp_attention_forward", "usp_mask"]

ATTENTION = "usp"


class UnsupportedAttention(ValueError):
    """A call of attention implementation "usp" that it would not compute exactly."""


def _refuse(what: str, fix: str) -> UnsupportedAttention:
    return UnsupportedAttention(f'attn_implementation="usp": {what}; {fix}')


# ------------------------------------------------------------------------------------------------
# The attention function.


def usp_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: (B, H, L, K) query, (B, G, L, K) key/value ->
    ((B, L, H, K) output, None)."""
    mask_starts = None
    if isinstance(attention_mask, DocumentStarts):
        mask_starts, attention_mask = attention_mask.starts, None
    if attention_mask is not None:
        raise _refuse(
            f"an attention mask of shape {tuple(attention_mask.shape)} reached attention (a 4-D mask passed to the "
            "model, or a mask another implementation built)",
            "pack the documents into rows and pass position_ids (e.g. DataCollatorWithFlattening) or use "
            "usp_graph.documents(...), and pass no attention_mask",
        )
    for name, what in (
        ("softcap", "logit softcapping"),
        ("s_aux", "attention sinks"),
        ("sinks", "attention sinks"),
        ("position_bias", "an additive position bias"),
    ):
        if kwargs.get(name) is not None:
            raise _refuse(
                f"{what} ({name}=...) is not supported",
                'use attn_implementation="eager" (or "sdpa" where the model offers it)',
            )
    if dropout and module.training:
        raise _refuse(
            f"dropout inside attention ({dropout}) is not supported",
            "set the model's attention_dropout to 0.0 for training",
        )
    b, h, lq, _ = query.shape
    g, lk = key.shape[1], key.shape[2]
    if lq != lk:
        raise _refuse(
            f"query length {lq} != key length {lk}: a KV cache from earlier steps (generation)",
            'usp attends within the packed documents of one forward pass; generate with model.set_attn_implementation("sdpa")',
        )
    is_causal = kwargs.get("is_causal")
    if is_causal is None:
        is_causal = getattr(module, "is_causal", True)
    is_causal = bool(is_causal)
    window = _window(module, kwargs, is_causal)
    gqa = g != h
    if torch.compiler.is_compiling():
        from .backend.documents import packed_documents_active

        if packed_documents_active():  # backend "usp" rewrites this site with the block's documents
            _refuse_chunks_in_block(module)
            out = windowed_sdpa(
                query, key, value, is_causal=is_causal, scale=scaling, enable_gqa=gqa, window=window
            )
        else:
            _refuse_encoder_decoder_kwargs(module, kwargs)
            metadata = _flash_in_graph(kwargs, b, lq)
            if metadata is None:
                metadata = _positions_in_graph(kwargs.get("position_ids"), b, lq, mask_starts)
            out = sdpa_to_usp(
                query, key, value, is_causal=is_causal, scale=scaling, enable_gqa=gqa, metadata=metadata,
                window=window,
            )  # fmt: skip
    elif _is_tracing(query) or _in_attention_mode():
        # Traced (usp_graph's own tracer rewrites the site) or routed by attention_mode.
        out = windowed_sdpa(
            query, key, value, is_causal=is_causal, scale=scaling, enable_gqa=gqa, window=window
        )
    else:
        from .backend.documents import current_documents, current_kv_documents

        if current_kv_documents() is not None:
            raise _refuse(
                "documents(..., kv=...) in eager code: eager attention cannot tell cross-attention calls from "
                "self-attention ones",
                'compile the model with backend="usp" inside the block (it reads which calls are cross-attention '
                "from the graph)",
            )
        metadata = current_documents()
        if metadata is not None:
            # Also here: a refusal raised while Dynamo traces the call above reruns it in eager.
            _refuse_chunks_in_block(module)
        else:
            _refuse_encoder_decoder_kwargs(module, kwargs)
            metadata = _flash_eager(kwargs, b, lq)
        if metadata is None:
            metadata = _positions_eager(kwargs.get("position_ids"), b, lq, mask_starts)
        out = sdpa_to_usp(
            query,
            key,
            value,
            is_causal=is_causal,
            scale=scaling,
            enable_gqa=gqa,
            metadata=metadata,
            window=window,
        )
    return out.transpose(1, 2).contiguous(), None


def _refuse_chunks_in_block(module: torch.nn.Module) -> None:
    """Chunked attention (Llama 4) inside a `documents` block: the block's documents would replace
    the chunks, which compiled code cannot read from the mask function (without the block the
    documents are cut at the chunks, `DocumentStarts`)."""
    if getattr(getattr(module, "config", None), "attention_chunk_size", None):
        raise _refuse(
            "chunked attention (attention_chunk_size) inside usp_graph.documents(...)",
            "compile without the block: documents then come from the position ids, cut at the chunks",
        )


def _refuse_encoder_decoder_kwargs(module: torch.nn.Module, kwargs: dict[str, Any]) -> None:
    """An encoder-decoder model hands every attention call (encoder, decoder, cross) the same
    position ids or flash-attention kwargs, of one of its streams: usp cannot tell which call they
    describe (BART's decoder was attended with the source's documents)."""
    if not getattr(getattr(module, "config", None), "is_encoder_decoder", False):
        return
    if any(kwargs.get(n) is not None for n in ("position_ids", "cu_seq_lens_q", "cu_seq_lens_k")):
        raise _refuse(
            f"{type(module).__name__} is part of an encoder-decoder model, whose attention calls all get the same "
            "position ids (or flash-attention kwargs) of one stream",
            'compile the model with backend="usp" under usp_graph.documents(target_meta, kv=source_meta), which '
            "tells cross-attention from the graph's data flow",
        )


def _window(module: torch.nn.Module, kwargs: dict[str, Any], is_causal: bool) -> tuple[int, int] | None:
    """flash-attention's window of the layer: transformers' ``sliding_window`` w keeps keys fewer
    than w tokens back (and, bidirectional, fewer than w ahead): ``(w - 1, w - 1)``."""
    sw = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if sw is None:
        return None
    if isinstance(sw, bool) or not isinstance(sw, int) or sw < 1:
        raise _refuse(f"sliding_window={sw!r} is not a positive int", "fix the model config's sliding_window")
    return (sw - 1, -1) if is_causal else (sw - 1, sw - 1)


def _in_attention_mode() -> bool:
    from torch.overrides import _get_current_function_mode_stack

    from .mode import _SDPAToUSP

    return any(isinstance(m, _SDPAToUSP) for m in _get_current_function_mode_stack())


def _rows(position_ids: Any, b: int, length: int) -> Tensor | None:
    if position_ids is None:
        return None
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise _refuse(
            f"position_ids must be a 2-D integer tensor, got {getattr(position_ids, 'shape', type(position_ids))}",
            "pass (batch, length) position ids that restart at 0 at each packed document",
        )
    if position_ids.shape[-1] != length or position_ids.shape[0] not in (1, b):
        raise _refuse(
            f"position_ids of shape {tuple(position_ids.shape)} do not describe the ({b}, {length}) tokens of this call",
            "pass position ids for exactly the model's input tokens",
        )
    return position_ids.expand(b, length)


# Documents read from position ids (or flash-attention's kwargs), by tensor identity: every layer
# of a forward (and every recompute of a checkpointed layer) gets the same tensor; one host sync in
# all. Emptied by `usp_mask`, which transformers calls at the start of every forward, so a buffer
# refilled in place between forwards (through numpy or .data, which no version counter sees) is
# read again; CPU tensors are also compared by value on every hit (no sync there).
_READ: dict[tuple[Any, ...], tuple[weakref.ref, Tensor | None, AttentionMetadata]] = {}


def _version(t: Any) -> int | None:
    """`t`'s version counter (None: not a tensor, or an inference tensor, which keeps none)."""
    return t._version if isinstance(t, Tensor) and not t.is_inference() else None


def _recalled(key: tuple[Any, ...], source: Tensor) -> AttentionMetadata | None:
    """What `_remember` kept for `source` under `key` (None: nothing, another tensor since, or, on
    the CPU, other values)."""
    hit = _READ.get(key)
    if hit is None or hit[0]() is not source:
        return None
    return hit[2] if hit[1] is None or torch.equal(hit[1], source) else None


def _remember(key: tuple[Any, ...], source: Tensor, metadata: AttentionMetadata) -> AttentionMetadata:
    if len(_READ) >= 8:
        _READ.clear()
    snapshot = source.detach().clone() if source.device.type == "cpu" else None
    _READ[key] = (weakref.ref(source), snapshot, metadata)
    return metadata


def _positions_eager(
    position_ids: Any, b: int, length: int, mask_starts: Tensor | None = None
) -> AttentionMetadata | None:
    """The documents of `position_ids` (transformers' reading) cut also where the model's mask
    separates neighbours (`DocumentStarts`), read once per forward; None: neither given."""
    source = position_ids if position_ids is not None else mask_starts
    if source is None:
        return None
    key = (id(position_ids), _version(position_ids), id(mask_starts), b, length)
    hit = _recalled(key, source)
    if hit is not None:
        return hit
    pos_BL = _rows(position_ids, b, length)
    tokens = b * length
    if tokens == 0:
        return None
    starts = _starts(pos_BL, mask_starts, b, length)
    cu = torch.cat([starts.nonzero().squeeze(1), starts.new_tensor([tokens], dtype=torch.long)]).to(
        torch.int32
    )
    longest = int((cu[1:] - cu[:-1]).max()) if cu.numel() > 1 else 0
    if pos_BL is not None and bool((pos_BL < 0).any()):
        raise _refuse(
            "position_ids hold a negative position", "pass position ids that restart at 0 at each document"
        )
    return _remember(key, source, AttentionMetadata(cu, longest, tokens))


def _starts(pos_BL: Tensor | None, mask_starts: Tensor | None, b: int, length: int) -> Tensor:
    """(T,) bool: where a document starts by the position ids, by the model's mask, or both."""
    if mask_starts is not None and tuple(mask_starts.shape) != (b, length):
        mask_starts = None  # another call's shape (a mask built for other lengths): not this call's
    if pos_BL is None:
        assert mask_starts is not None
        return mask_starts.reshape(-1)
    starts = document_starts(pos_BL)
    return starts if mask_starts is None else starts | mask_starts.to(starts.device).reshape(-1)


def _flash_boundaries(kwargs: dict[str, Any], b: int, length: int) -> Tensor | None:
    """flash-attention's packed-sequence boundaries, as transformers hands them to attention
    (``cu_seq_lens_q`` / ``cu_seq_lens_k``: what ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``
    returns), checked in shape: one 1-D integer tensor for queries and keys. None: not given."""
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    if cu_q is None and cu_k is None:
        return None
    for name, cu in (("cu_seq_lens_q", cu_q), ("cu_seq_lens_k", cu_k)):
        if cu is not None and (
            not isinstance(cu, Tensor) or cu.dim() != 1 or cu.is_floating_point() or cu.shape[0] < 2
        ):
            raise _refuse(
                f"{name} must be a 1-D integer tensor (document starts, then the token count), got "
                f"{getattr(cu, 'shape', type(cu))}",
                "pass the cu_seq_lens_q/k that DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns",
            )
    if cu_q is not None and cu_k is not None and cu_k is not cu_q and cu_k.shape != cu_q.shape:
        raise _refuse(
            f"cu_seq_lens_q ({cu_q.shape[0] - 1} documents) and cu_seq_lens_k ({cu_k.shape[0] - 1}) differ",
            "usp reads one set of documents for queries and keys from these arguments; give the key/value "
            "stream's documents with usp_graph.documents(meta, kv=kv_meta)",
        )
    cu = cu_q if cu_q is not None else cu_k
    if cu_q is not None and cu_k is not None and cu_k is not cu_q:
        device_assert(
            torch.eq(cu_q, cu_k).all(),
            'attn_implementation="usp": cu_seq_lens_q and cu_seq_lens_k differ; usp reads one set of documents '
            "for queries and keys from these arguments",
        )
    return cu.to(torch.int32)


def _flash_eager(kwargs: dict[str, Any], b: int, length: int) -> AttentionMetadata | None:
    """The documents of flash-attention's kwargs (`_flash_boundaries`), read once per tensor; the
    position ids, when transformers passes them too, must count the same documents."""
    given = [kwargs.get(name) for name in ("cu_seq_lens_q", "cu_seq_lens_k", "position_ids")]
    source = given[0] if given[0] is not None else given[1]
    key = (b, length, *((id(t), _version(t)) for t in given))
    if isinstance(source, Tensor):  # every layer after the first: read already
        hit = _recalled(key, source)
        if hit is not None:
            return hit
    cu = _flash_boundaries(kwargs, b, length)
    if cu is None:
        return None
    pos = given[2]
    tokens = b * length
    ends = cu.tolist()
    if ends[0] != 0 or ends[-1] != tokens or any(y < x for x, y in zip(ends, ends[1:], strict=False)):
        raise _refuse(
            f"cu_seq_lens_q {ends[:4]}{'...' if len(ends) > 4 else ''}{ends[-1:]} does not describe the {tokens} "
            f"tokens of this call ({b} x {length}): it must start at 0, never decrease and end at {tokens}",
            "pass the boundaries of the packed batch the model is called with",
        )
    if pos is not None:
        counted = _positions_eager(pos, b, length)
        if counted is not None and counted.cu_seqlens.tolist() != [
            x for i, x in enumerate(ends) if i == 0 or x != ends[i - 1]
        ]:
            raise _refuse(
                "the position ids transformers passes to attention count other documents than cu_seq_lens_q "
                "(positions counted along the row, e.g. a model called without position_ids, give rotary angles "
                "that do not restart at each document)",
                "pass position_ids restarting at each document too (DataCollatorWithFlattening's default, "
                "return_position_ids=True)",
            )
    longest = max((y - x for x, y in zip(ends, ends[1:], strict=False)), default=0)
    return _remember(key, source, AttentionMetadata(cu, longest, tokens))


def _flash_in_graph(kwargs: dict[str, Any], b: int, length: int) -> AttentionMetadata | None:
    """The documents of flash-attention's kwargs in a compiled graph: bound L (no value read on the
    host, no guard on the batch's longest document); checked on the device against the position
    ids when transformers passes them too."""
    cu = _flash_boundaries(kwargs, b, length)
    if cu is None:
        return None
    pos_BL = _rows(kwargs.get("position_ids"), b, length)
    if pos_BL is not None:
        check_positions_match(cu, pos_BL)  # also: cu starts at 0 and ends at the call's B x L tokens
    else:
        device_assert(
            (cu[0] == 0) & (cu[-1] == b * length) & (cu[1:] >= cu[:-1]).all(),
            'attn_implementation="usp": cu_seq_lens_q does not describe the tokens of this call (it must start '
            "at 0, never decrease and end at batch x length)",
        )
    return AttentionMetadata(cu, length, b * length)


def _positions_in_graph(
    position_ids: Any, b: int, length: int, mask_starts: Tensor | None = None
) -> AttentionMetadata | None:
    """The documents of `position_ids` and of the model's mask (`_starts`) computed on their
    device inside the graph: capacity T + 1 (every token could start one) and max_seqlen L, so no
    value is read on the host."""
    pos_BL = _rows(position_ids, b, length)
    if mask_starts is not None and tuple(mask_starts.shape) != (b, length):
        mask_starts = None
    if pos_BL is None and mask_starts is None:
        return None
    return AttentionMetadata(
        cu_seqlens_from_starts(_starts(pos_BL, mask_starts, b, length)), length, b * length
    )


# ------------------------------------------------------------------------------------------------
# The mask builder: no mask, after checking that none is needed.

# The pieces of transformers' mask functions that describe documents, causality and windows,
# which the attention above computes from its own inputs (by qualified name, as
# transformers.masking_utils defines them). Any other piece (multimodal blocks, chunked
# attention, a user's function) would be lost, and is refused.
_KNOWN_MASK_PIECES = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "and_masks.<locals>.and_mask",
    "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "add_offsets_to_mask_function.<locals>.inner_mask",
    "padding_mask_function.<locals>.inner_mask",
}


def _unknown_pieces(fn: Any, seen: set[int] | None = None) -> list[str]:
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, (list, tuple)):
        return [x for f in fn for x in _unknown_pieces(f, seen)]
    if not callable(fn):
        return []
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    if name not in _KNOWN_MASK_PIECES:
        return [name]
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner) or isinstance(inner, (list, tuple)):
            found.extend(_unknown_pieces(inner, seen))
    return found


def usp_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask interface for "usp": builds nothing. Refuses a padding mask with a
    padded token (checked on the device under compile, no host sync) and a mask function that
    says more than documents, causality and a window."""
    # Dynamo cannot read a closure's cells (it would break the graph here), so compiled code does not
    # check the mask function: a model whose mask says more (multimodal blocks) is refused in eager
    # only; the README says so.
    compiling = torch.compiler.is_compiling()
    if not compiling:
        _READ.clear()  # a new forward: documents are read again from its tensors
    unknown = _unknown_pieces(mask_function) if mask_function is not None and not compiling else []
    if unknown:
        raise _refuse(
            f"the model's mask holds {', '.join(sorted(set(unknown)))}, beyond documents, causality and a sliding "
            "window (e.g. multimodal blocks or chunked attention)",
            'use attn_implementation="sdpa" for this model',
        )
    if attention_mask is not None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        message = (
            'attn_implementation="usp": the attention_mask pads tokens; usp attends within packed documents: '
            "pack them into rows and pass position_ids (DataCollatorWithFlattening), without an attention_mask"
        )
        if compiling or _is_tracing(attention_mask):
            device_assert(attention_mask.bool().all(), message)
        elif not bool(attention_mask.bool().all()):
            raise UnsupportedAttention(message)
    device = kwargs.get("device")
    if device is None and isinstance(kwargs.get("cache_position"), Tensor):
        device = kwargs["cache_position"].device
    return _mask_starts(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, device)


class DocumentStarts:
    """What "usp"'s mask builder hands transformers in place of a mask, and transformers hands each
    attention call: ``starts`` ((B, L) bool), where the model's own mask separates a token from the
    one before it (a new packed document, a chunk of chunked attention), read from the model's mask
    function at L - 1 pairs of neighbours: O(B x L), never (L, L). Attention takes its documents
    from it when nothing better says (a model that builds its packed-document mask from position
    ids but does not pass them to attention: Persimmon, GPTBigCode), and cuts documents at its
    starts too (chunked attention under compile, where the mask function cannot be inspected)."""

    __slots__ = ("starts",)

    def __init__(self, starts: Tensor) -> None:
        self.starts = starts

    def __repr__(self) -> str:
        return f"DocumentStarts(shape={tuple(self.starts.shape)})"


def _mask_starts(
    batch_size: Any,
    q_length: Any,
    kv_length: Any,
    q_offset: Any,
    kv_offset: Any,
    mask_function: Any,
    device: Any,
) -> DocumentStarts | None:
    """`DocumentStarts` of a self-attention mask (query and key lengths equal, no offset), or None
    where it cannot be read (cross-attention, a cache, no device given, a mask function that does
    not take index tensors)."""
    if (
        mask_function is None
        or device is None
        or not all(isinstance(n, (int, torch.SymInt)) for n in (batch_size, q_length, kv_length))
        or q_length != kv_length
        or q_length < 1
        or not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0)
    ):
        return None
    rows = torch.arange(batch_size, device=device)[:, None]
    heads = torch.zeros(1, 1, dtype=torch.long, device=device)
    queries = torch.arange(1, q_length, device=device)[None, :]
    try:  # can each token see the one before it?
        sees = mask_function(rows, heads, queries, queries - 1)
    except Exception:  # noqa: BLE001 - a mask function written for vmap only: nothing read
        return None
    if not isinstance(sees, Tensor):
        return None
    sees = torch.as_tensor(sees, device=device).bool().expand(batch_size, q_length - 1)
    first = torch.ones(batch_size, 1, dtype=torch.bool, device=device)
    return DocumentStarts(torch.cat([first, ~sees], dim=1))


# ------------------------------------------------------------------------------------------------
# Registration.


def register() -> None:
    """Register ``"usp"`` with transformers (idempotent). Runs by itself when transformers'
    modeling code is imported after usp_graph, or at ``import usp_graph`` after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .hf_rows import with_row_rules

    AttentionInterface.register(ATTENTION, with_row_rules(usp_attention_forward))
    AttentionMaskInterface.register(ATTENTION, usp_mask)
    _guard_model_classes()


def _refuse_own_attention(cls: type) -> None:
    """A model class whose attention layers do not call transformers' attention interface
    (Bloom and MPT with ALiBi, Falcon, GPT-Neo, ...) would never run usp: it would take usp's
    "no mask" for its own attention (wrong without a word) or fail looking the name up."""
    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if callable(can_set) and not can_set():
        raise _refuse(
            f"{cls.__name__} computes attention in its own code, not through transformers' attention interface, "
            "so usp would not run (and its attention would get no mask)",
            'load it with one of its own implementations (e.g. attn_implementation="eager")',
        )


def _guard_model_classes() -> None:
    """Refuse "usp" where transformers checks a model's attention implementation (at construction,
    from_pretrained and set_attn_implementation): see `_refuse_own_attention`. Left out quietly on
    a transformers without that check."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "_usp_guard", False):
        return

    def checked(self, attn_implementation, *args, **kwargs):
        if attn_implementation == ATTENTION:
            _refuse_own_attention(type(self))
            from .hf_rows import install_row_rules

            install_row_rules(self)  # packed documents: the rules of usp_graph.rules, as on every door
        return check(self, attn_implementation, *args, **kwargs)

    checked._usp_guard = True  # type: ignore[attr-defined]
    PreTrainedModel._check_and_adjust_attn_implementation = checked


_HOOKED = "transformers.modeling_utils"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers "usp" right after transformers' modeling code is imported, so that
    ``from_pretrained(..., attn_implementation="usp")`` works with no call beyond ``import
    usp_graph``, and usp_graph never imports transformers itself (seconds, for those without it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _HOOKED:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register_quietly()

        spec.loader.exec_module = exec_and_register
        return spec


def _register_quietly() -> None:
    try:
        register()
    except Exception as e:  # noqa: BLE001 - another transformers layout must not break its import
        import warnings

        warnings.warn(
            f'usp_graph could not register attn_implementation="usp" with transformers ({e!r}); '
            "call usp_graph.hf.register() to see why",
            stacklevel=2,
        )


def install() -> None:
    """Register now if transformers' modeling code is loaded, else when it is."""
    if _HOOKED in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
