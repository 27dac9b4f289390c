"""Which documents does this attention call attend within: one answer for every front door.

# B batch, L sequence, T packed tokens (B * L)

Every door (eager `attention_mode`, eager and compiled `documents`, transformers' attention
implementation ``"usp"``, ``"sdpa"`` + backend usp) asks `documents_for_call` (or, for a bare
SDPA call, `refuse_unhonoured`); the first source that applies gives the documents:

======  ===========================================  ==========================================
order   source                                       where it is read
======  ===========================================  ==========================================
1       an active ``attention_mode(metadata)``       eager: the mode routes the call (`ROUTED`);
                                                     compiled: refused (the mode is eager-only)
2       an active ``documents(metadata)`` block      eager: here; compiled with backend usp:
                                                     the rewrite's graph input (`ROUTED`); any
                                                     other compiler: refused, never ignored
3       flash-attention kwargs ``cu_seq_lens_q/k``   eager once per tensor; in graph on device
4       ``position_ids``                             (documents start where a position is not
                                                     its predecessor + 1, and at row starts)
5       the model's mask's document starts           `DocumentStarts` (the mask builder's read)
6       nothing: one document per batch row          SDPA's own semantics
======  ===========================================  ==========================================

Whatever source wins, the position ids the call also got must count the same documents
(`masks.check_positions_match`'s rule: metadata left from another batch, or built for other
lengths, is refused on every door, not used).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch
from torch import Tensor

from .dynamo_marks import assume_constant_result
from .masks import check_positions_match, cu_seqlens_from_starts, document_starts, starts_of_boundaries
from .metadata import AttentionMetadata
from .ops.boundaries import device_assert, vouch_checked

__all__ = [
    "ROUTED",
    "DocumentStarts",
    "UnsupportedAttention",
    "attention_mode_active",
    "documents_for_call",
    "refuse_unhonoured",
]


class UnsupportedAttention(ValueError):
    """A call of attention implementation "usp" that it would not compute exactly."""


def refuse(what: str, fix: str) -> UnsupportedAttention:
    return UnsupportedAttention(f'attn_implementation="usp": {what}; {fix}')


class _Routed:
    """The call's documents are applied outside it: `attention_mode` routes it, backend usp
    rewrites it as an attention site, or usp_graph's own tracer does."""

    def __repr__(self) -> str:
        return "ROUTED"


ROUTED = _Routed()


def _is_tracing(*tensors: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) or t.is_meta or type(t) is not Tensor for t in tensors)


# ------------------------------------------------------------------------------------------------
# Which blocks are active, and whether the active compiler honours them.


def attention_mode_active() -> bool:
    """Whether an `attention_mode` block routes this thread's SDPA calls (read-only)."""
    from torch.overrides import _get_current_function_mode_stack

    from .mode import _SDPAToUSP

    return any(isinstance(m, _SDPAToUSP) for m in _get_current_function_mode_stack())


def _backend_function_step(fn: Any) -> Any:
    inner = getattr(fn, "_torchdynamo_orig_backend", None) or getattr(fn, "compiler_fn", None)
    inner = inner or getattr(fn, "func", None)
    return None if inner is None or inner is fn else inner


def _backend_function(fn: Any) -> Any:
    """The function a torch.compile backend wrapper finally calls (Dynamo's debug wrapper, the
    `torch.compile(options=...)` wrapper, a functools.partial)."""
    for _ in range(8):
        inner = _backend_function_step(fn)
        if inner is None:
            return fn
        fn = inner
    return fn


def _another_known_backend(compiler: Any, fn: Any) -> bool:
    """Whether Dynamo compiles for one of its registered backends other than usp (inductor,
    aot_eager, ...), which would ignore a documents block. A backend usp_graph cannot name (a
    function of the user's, a wrapper around usp's) is given the benefit of the doubt: usp's own
    checks then run if it calls usp, and nothing is falsely refused."""
    if (
        getattr(fn, "__module__", None) == "usp_graph.backend.compiler"
        and getattr(fn, "__name__", None) == "usp_backend"
    ):
        return False  # by name: the backend imports this module, never the other way
    chain = [compiler]
    while len(chain) < 8:  # every wrapper between Dynamo and the backend function (`_backend_function`)
        inner = _backend_function_step(chain[-1])
        if inner is None:
            break
        chain.append(inner)
    names = [getattr(f, a, None) for f in chain for a in ("compiler_name", "backend")]
    if "usp" in names:
        return False
    from torch._dynamo.backends.registry import _COMPILER_FNS, _lazy_import

    _lazy_import()  # Dynamo registers its own backends at their first lookup
    registered = {name: f for name, f in _COMPILER_FNS.items() if name != "usp"}
    return any(isinstance(n, str) and n in registered for n in names) or any(
        fn is f for f in registered.values()
    )


@assume_constant_result
def _compiling_frame() -> tuple[bool, bool]:
    """(compiled for backend usp, an `attention_mode` with documents is active), read while Dynamo
    traces a frame (a constant of the trace: Dynamo runs this on the host rather than tracing it). Outside Dynamo
    (export, usp_graph's tracer): (True, False), nothing to refuse."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        compiler = tx.output.compiler_fn
    except Exception:  # noqa: BLE001 - not under Dynamo, or another torch layout
        return True, False
    from torch.overrides import _get_current_function_mode_stack

    from .mode import _SDPAToUSP

    fn = _backend_function(compiler)
    usp = not _another_known_backend(compiler, fn)
    # Dynamo moves the active torch function modes off the real stack while it traces.
    stack = getattr(getattr(tx, "symbolic_torch_function_state", None), "mode_stack", ())
    modes = [getattr(m, "value", None) for m in stack] + list(_get_current_function_mode_stack())
    # attention_mode() without metadata or cp is SDPA's own per-row semantics: compiled code agrees.
    mode = any(isinstance(m, _SDPAToUSP) and (m.metadata is not None or m.cp is not None) for m in modes)
    return usp, mode


# The `documents` blocks' state: `usp_graph.backend.documents`, which sets itself here when it is
# imported (it imports this module; before it is, no block can be active).
_BLOCKS: Any = None


def _block_active() -> bool:
    return _BLOCKS is not None and _BLOCKS.packed_documents_active()


def block_active() -> bool:
    """Whether a ``documents(...)`` block is active (read where compiled code decides on it)."""
    return _block_active()


def refuse_unhonoured(like: Tensor) -> None:
    """Under torch.compile: fail the call (an assert in the compiled code, whatever the backend) when
    an active block would be ignored: ``documents(metadata)`` under any backend but usp, or an
    `attention_mode` (eager only) under any backend. Nothing outside compiled code."""
    if not torch.compiler.is_compiling():
        return
    for_usp, mode = _compiling_frame()
    # The block's state is a module global Dynamo guards on: read only where it decides (backend
    # usp handles both, and a guard there would recompile between packed and per-row batches).
    if not for_usp and _block_active():
        why = (
            "usp_graph.documents(...) is active, but this code is compiled with a backend other than "
            '"usp", which ignores the block (every row would be one document); compile with '
            'torch.compile(model, backend="usp"), or drop the block and pass position_ids that restart at 0 '
            "at each document"
        )
    elif mode:
        why = (
            "usp_graph.attention_mode(...) is active around compiled code, which it does not route; use "
            'usp_graph.documents(metadata) with torch.compile(model, backend="usp"), or run the model eagerly '
            "inside attention_mode"
        )
    else:
        return
    device_assert(torch.zeros((), dtype=torch.bool, device=like.device), f"usp_graph: {why}")


def _refuse_chunks_in_block(module: torch.nn.Module) -> None:
    """Chunked attention (Llama 4) inside a `documents` block: the block's documents would replace
    the chunks, which compiled code cannot read from the mask function (without the block the
    documents are cut at the chunks, `DocumentStarts`)."""
    if getattr(getattr(module, "config", None), "attention_chunk_size", None):
        raise refuse(
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
        raise refuse(
            f"{type(module).__name__} is part of an encoder-decoder model, whose attention calls all get the same "
            "position ids (or flash-attention kwargs) of one stream",
            'compile the model with backend="usp" under usp_graph.documents(target_meta, kv=source_meta), which '
            "tells cross-attention from the graph's data flow",
        )


# ------------------------------------------------------------------------------------------------
# What usp cannot know: said once per cause.

_WARNED: set[str] = set()


@assume_constant_result
def _warn_once(cause: str, message: str) -> bool:
    """warnings.warn(`message`) the first time `cause` is met (while Dynamo traces: at trace time)."""
    if cause not in _WARNED:
        _WARNED.add(cause)
        warnings.warn(f"usp_graph: {message}", UserWarning, stacklevel=4)
    return True


def _rope_type(config: Any) -> str | None:
    for name in ("rope_parameters", "rope_scaling"):
        params = getattr(config, name, None)
        if isinstance(params, dict):
            kind = params.get("rope_type", params.get("type"))
            if kind is None and params and all(isinstance(v, dict) for v in params.values()):
                kind = next((p.get("rope_type") for p in params.values() if p.get("rope_type")), None)
            if kind is not None:
                return str(kind)
    return None


def warn_where_unknown(module: torch.nn.Module, is_causal: bool, from_positions: bool) -> None:
    """Say once what usp cannot know about a call whose documents it attends within: an encoder given
    documents only by its position ids (the model's own implementations attend the whole row: usp
    cannot tell whether the documents were meant), and rotary scaling computed from the row's
    length (dynamic, longrope: each document alone would get other frequencies)."""
    config = getattr(module, "config", None)
    if from_positions and not is_causal:
        _warn_once(
            "encoder",
            f"{type(module).__name__} attends bidirectionally and its documents come only from the position ids: "
            "usp attends within each document, while the model's own attention implementations attend the whole "
            "row; pass usp_graph.documents(metadata) to say the documents are meant",
        )
    kind = _rope_type(config)
    if kind is not None and ("dynamic" in kind or kind == "longrope"):
        _warn_once(
            f"rope:{kind}",
            f"{type(module).__name__}'s rotary scaling ({kind}) is computed from the packed row's length, not each "
            "document's: each document's result can differ from the document run alone",
        )


# ------------------------------------------------------------------------------------------------
# The precedence table.


def documents_for_call(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    b: int,
    length: int,
    *,
    mask_starts: Tensor | None,
    like: Tensor,
    is_causal: bool = True,
) -> AttentionMetadata | None | _Routed:
    """The documents of one self-attention call of `b` rows of `length` tokens, by the table of the
    module docstring: metadata, None (one document per row), or `ROUTED`. Says once what usp
    cannot know about them (`warn_where_unknown`)."""
    found, source = _documents_for_call(module, kwargs, b, length, mask_starts, like)
    if found is not None:
        # The mask's starts hold the forward's position ids too (`install_forward_positions`).
        positions = source == "positions" or (source == "mask" and forward_positions() is not None)
        warn_where_unknown(module, is_causal, positions)
    return found


def _documents_for_call(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    b: int,
    length: int,
    mask_starts: Tensor | None,
    like: Tensor,
) -> tuple[AttentionMetadata | None | _Routed, str]:
    """(documents, the source that gave them: "routed", "block", "flash", "positions", "rows")."""
    if torch.compiler.is_compiling():
        return _in_graph(module, kwargs, b, length, mask_starts, like)
    if _is_tracing(like) or attention_mode_active():
        return ROUTED, "routed"
    if _BLOCKS is None:
        block = kv_block = None
    else:
        block, kv_block = _BLOCKS.current_documents(), _BLOCKS.current_kv_documents()
    if kv_block is not None:
        raise refuse(
            "documents(..., kv=...) in eager code: eager attention cannot tell cross-attention calls from "
            "self-attention ones",
            'compile the model with backend="usp" inside the block (it reads which calls are cross-attention '
            "from the graph)",
        )
    if block is not None:
        _refuse_chunks_in_block(module)
        _BLOCKS.refuse_left_out_region(block, b * length)
        _check_block_eager(block, kwargs.get("position_ids"), b, length)
        return block, "block"
    _refuse_encoder_decoder_kwargs(module, kwargs)
    metadata = _flash_eager(kwargs, b, length)
    if metadata is not None:
        return metadata, "flash"
    metadata = _positions_eager(kwargs.get("position_ids"), b, length, mask_starts)
    return metadata, "rows" if metadata is None else "positions" if kwargs.get(
        "position_ids"
    ) is not None else "mask"


def _in_graph(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    b: int,
    length: int,
    mask_starts: Tensor | None,
    like: Tensor,
) -> tuple[AttentionMetadata | None | _Routed, str]:
    refuse_unhonoured(like)
    if _block_active():  # backend "usp" rewrites this site with the block's documents
        _refuse_chunks_in_block(module)
        return ROUTED, "block"
    _refuse_encoder_decoder_kwargs(module, kwargs)
    metadata = _flash_in_graph(kwargs, b, length, mask_starts)
    if metadata is not None:
        return metadata, "flash"
    metadata = _positions_in_graph(kwargs.get("position_ids"), b, length, mask_starts)
    return metadata, "rows" if metadata is None else "positions" if kwargs.get(
        "position_ids"
    ) is not None else "mask"


def _check_block_eager(block: AttentionMetadata, position_ids: Any, b: int, length: int) -> None:
    """The position ids of a call inside a `documents` block count the block's documents (the rule
    the "sdpa" door checks in its graph, `check_positions_match`), read once per forward: the
    verdict and the negative-position flag, computed on the device, in one host read."""
    if position_ids is None or b * length != block.total_tokens:
        return  # a call of another stream: the token count check of sdpa_to_usp speaks for it
    key = ("block", id(block.cu_seqlens), _version(block.cu_seqlens), b, length)
    hit = _CHECKED.get(key)
    if hit is not None and hit[0]() is position_ids and hit[1] == _version(position_ids):
        return
    pos_BL = _rows(position_ids, b, length)
    tokens = b * length
    starts = starts_of_boundaries(block.cu_seqlens.to(pos_BL.device), tokens)
    agree = torch.eq(starts, document_starts(pos_BL)).all()
    agree, negative = torch.stack([agree, (pos_BL < 0).any()]).tolist()  # one host read (a sync on CUDA)
    if negative:
        raise _negative_position()
    if not agree:
        raise refuse(
            "the position ids of this call count other documents than the active usp_graph.documents(metadata) "
            "(metadata left from another batch, built for other lengths, or a model called without position ids)",
            "build the metadata from this batch (AttentionMetadata.from_position_ids(position_ids)) and pass the "
            "same position ids to the model",
        )
    if len(_CHECKED) >= 8:
        _CHECKED.clear()
    _CHECKED[key] = (weakref.ref(position_ids), _version(position_ids))


# (block boundaries, call shape) -> the position ids checked against them and their version;
# emptied with `_READ` at every forward (a buffer refilled where no version counter sees it).
_CHECKED: dict[tuple[Any, ...], tuple[weakref.ref, int | None]] = {}


# ------------------------------------------------------------------------------------------------
# Documents from position ids, flash-attention's kwargs and the model's mask.


def _rows(position_ids: Any, b: int, length: int) -> Tensor | None:
    if position_ids is None:
        return None
    if not isinstance(position_ids, Tensor) or position_ids.dim() != 2 or position_ids.is_floating_point():
        raise refuse(
            f"position_ids must be a 2-D integer tensor, got {getattr(position_ids, 'shape', type(position_ids))}",
            "pass (batch, length) position ids that restart at 0 at each packed document",
        )
    if position_ids.shape[-1] != length or position_ids.shape[0] not in (1, b):
        raise refuse(
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
    # On the device, before the one host read (few kernels: each is a launch on the host's clock):
    # the boundaries with a slot per token (unused slots repeat T), their lengths, and the four
    # values read: the document count n, the longest document, the least position and cu[0]. After
    # the read nothing is left for the GPU to wait on: the boundaries are a view of the first n + 1
    # slots, checked here.
    cu_all = cu_seqlens_from_starts(starts)
    lengths = cu_all[1:] - cu_all[:-1]
    least = pos_BL.min() if pos_BL is not None else torch.zeros((), dtype=torch.long, device=starts.device)
    values = torch.stack([starts.sum(), lengths.max().long(), least.long(), cu_all[0].long()])
    n, longest, least, first = values.tolist()  # the forward's one host read (a sync on CUDA)
    if least < 0:
        raise _negative_position()
    cu = cu_all[: n + 1]
    if first != 0:  # no start at token 0 (a mask's starts alone): validation says so
        return _remember(key, source, AttentionMetadata(cu, longest, tokens))
    # Every boundary is a start's index (searchsorted of the running start counts: never
    # decreasing), the first 0 and cu[n] = T (no token's count exceeds n): checked, and so is every
    # length against the longest.
    vouch_checked(cu, tokens, longest, lengths[:n])
    return _remember(key, source, AttentionMetadata._read_on_host(cu, longest, tokens))


def _negative_position() -> UnsupportedAttention:
    return refuse(
        "position_ids hold a negative position", "pass position ids that restart at 0 at each document"
    )


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
            raise refuse(
                f"{name} must be a 1-D integer tensor (document starts, then the token count), got "
                f"{getattr(cu, 'shape', type(cu))}",
                "pass the cu_seq_lens_q/k that DataCollatorWithFlattening(return_flash_attn_kwargs=True) returns",
            )
    if cu_q is not None and cu_k is not None and cu_k is not cu_q and cu_k.shape != cu_q.shape:
        raise refuse(
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
    return _as_int32(cu, "cu_seq_lens_q" if cu_q is not None else "cu_seq_lens_k")


_INT32 = torch.iinfo(torch.int32)


def _as_int32(cu: Tensor, name: str) -> Tensor:
    """`cu` as int32, its range checked before the cast (an int64 boundary past 2**31 would wrap
    into one that passes every later check)."""
    if cu.dtype == torch.int32:
        return cu
    message = (
        f"{name} holds a value outside int32, which usp's kernels take; pass int32 boundaries of this call"
    )
    in_range = (cu >= _INT32.min).all() & (cu <= _INT32.max).all()
    if torch.compiler.is_compiling() or _is_tracing(cu):
        device_assert(in_range, f'attn_implementation="usp": {message}')
    elif not bool(in_range):
        raise refuse(message, "pass the cu_seq_lens_q/k of the packed batch the model is called with")
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
    pos_BL = _rows(given[2], b, length)
    tokens = b * length
    lengths = cu[1:] - cu[:-1]
    read = cu.long()
    if pos_BL is not None:  # the position ids' documents and negative flag, in the same transfer
        agree = torch.eq(starts_of_boundaries(cu, tokens), document_starts(pos_BL).to(cu.device)).all()
        read = torch.cat([read, torch.stack([agree, (pos_BL < 0).any().to(cu.device)]).long()])
    values = read.tolist()  # the forward's one host read (a sync on CUDA)
    ends = values[: cu.shape[0]]
    if ends[0] != 0 or ends[-1] != tokens or any(y < x for x, y in zip(ends, ends[1:], strict=False)):
        raise refuse(
            f"cu_seq_lens_q {ends[:4]}{'...' if len(ends) > 4 else ''}{ends[-1:]} does not describe the {tokens} "
            f"tokens of this call ({b} x {length}): it must start at 0, never decrease and end at {tokens}",
            "pass the boundaries of the packed batch the model is called with",
        )
    if pos_BL is not None and values[-1]:
        raise _negative_position()
    if pos_BL is not None and not values[-2]:
        raise refuse(
            "the position ids transformers passes to attention count other documents than cu_seq_lens_q "
            "(positions counted along the row, e.g. a model called without position_ids, give rotary angles "
            "that do not restart at each document)",
            "pass position_ids restarting at each document too (DataCollatorWithFlattening's default, "
            "return_position_ids=True)",
        )
    longest = max((y - x for x, y in zip(ends, ends[1:], strict=False)), default=0)
    vouch_checked(cu, tokens, longest, lengths)  # checked above, on the host
    return _remember(key, source, AttentionMetadata._read_on_host(cu, longest, tokens))


def _flash_in_graph(
    kwargs: dict[str, Any], b: int, length: int, mask_starts: Tensor | None = None
) -> AttentionMetadata | None:
    """The documents of flash-attention's kwargs in a compiled graph: bound L (no value read on the
    host, no guard on the batch's longest document); checked on the device against the position
    ids when transformers passes them too; cut also where the model's mask separates neighbours
    (`DocumentStarts`: the chunks of chunked attention)."""
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
    tokens = b * length
    if mask_starts is not None and tuple(mask_starts.shape) == (b, length):
        starts = starts_of_boundaries(cu, tokens) | mask_starts.to(cu.device).reshape(-1)
        cu = cu_seqlens_from_starts(starts)
    return AttentionMetadata(cu, length, tokens)


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


# The position ids each running forward of a "usp" model was called with, innermost last (None: it
# got none), pushed and popped by hooks on the model (`install_forward_positions`). A forward with
# a cache (``use_cache=True``, the default of ``model(**batch)`` in eval) has transformers build no
# packed-sequence mask from them, and models whose attention gets no position ids (GPT-BigCode,
# Persimmon) would cross documents; so would models that hand neither their mask builder nor
# attention the position ids (ModernBERT, DistilBERT, OPT): the mask builder cuts its
# `DocumentStarts` at them too. Under
# torch.compile Dynamo traces the hooks (the list's changes are side effects it replays), so the
# compiled mask builder reads the same position ids as eager code.
_FORWARD_POSITIONS: list[Tensor | None] = []


def install_forward_positions(model: torch.nn.Module) -> None:
    """Keep the position ids of each forward of `model` for its mask builder
    (`forward_positions`); once per model."""
    if getattr(model, "_usp_forward_positions", False):
        return
    model.register_forward_pre_hook(_push_positions, with_kwargs=True)
    model.register_forward_hook(_pop_positions, always_call=True)
    model._usp_forward_positions = True


def _push_positions(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    pos = kwargs.get("position_ids")
    _FORWARD_POSITIONS.append(pos if isinstance(pos, Tensor) else None)


def _pop_positions(model: torch.nn.Module, *rest: Any) -> None:
    if _FORWARD_POSITIONS:
        _FORWARD_POSITIONS.pop()


def forward_positions() -> Tensor | None:
    """The position ids of the innermost running forward of a "usp" model (None: none given)."""
    return _FORWARD_POSITIONS[-1] if _FORWARD_POSITIONS else None


class DocumentStarts:
    """What "usp"'s mask builder hands transformers in place of a mask, and transformers hands each
    attention call: ``starts`` ((B, L) bool), where the model's own mask separates a token from the
    one before it (a new packed document, a chunk of chunked attention), read from the model's mask
    function at L - 1 pairs of neighbours: O(B x L), never (L, L). Attention takes its documents
    from it when nothing better says (a model that builds its packed-document mask from position
    ids but does not pass them to attention: Persimmon, GPTBigCode), and cuts documents at its
    starts too (chunked attention under compile, where the mask function cannot be inspected)."""

    __slots__ = ("starts", "window", "mask_function")

    def __init__(
        self, starts: Tensor, window: tuple[int, int] | None = None, mask_function: Any = None
    ) -> None:
        self.starts = starts
        # The mask's own sliding window (flash-attention's (left, right); right -1: as far as the
        # left, for a bidirectional mask), read in eager from transformers' window pieces.
        self.window = window
        # Compiled code, which cannot read the window: the mask function, which attention probes
        # for the window it chose (`masks.check_mask_window`).
        self.mask_function = mask_function

    def __repr__(self) -> str:
        return f"DocumentStarts(shape={tuple(self.starts.shape)})"

    # Model code that reads its attention mask itself (Doge's dynamic mask: ``attention_mask.dtype``,
    # slices of it) gets a refusal with the reason, not an AttributeError from deep inside the model.
    def _read_by_model(self, what: str) -> UnsupportedAttention:
        return refuse(
            f"the model reads its attention mask in its own code ({what}), and usp builds no mask (it attends "
            "within the documents directly)",
            'use attn_implementation="sdpa" (or "eager") for this model',
        )

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        raise self._read_by_model(f"attention_mask.{name}")

    def __getitem__(self, index: Any) -> Any:
        raise self._read_by_model("attention_mask[...]")

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if isinstance(func, torch._ops.HigherOrderOperator):
            # Not the model reading its mask: Dynamo hands a checkpointed layer's arguments, this
            # mask among them, to the region's higher-order op (`tag_activation_checkpoint`).
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        raise refuse(
            f"the model reads its attention mask in its own code ({getattr(func, '__name__', func)}(mask, ...)), "
            "and usp builds no mask (it attends within the documents directly)",
            'use attn_implementation="sdpa" (or "eager") for this model',
        )
