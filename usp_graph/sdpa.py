"""`sdpa_to_usp`: the one function that decides the op sequence of an SDPA call under usp_graph.

# B batch, H query heads, G key/value heads, L sequence, K head dim, T packed tokens (B * L)

Eager (`attention_mode`), traced and compiled execution all call this function, so all of them
run the same ops in the same order: that is what makes eager-vs-replay equality bitwise by
construction rather than by luck.
"""

from __future__ import annotations

import math
import weakref
from functools import partial
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from . import masks
from .graph_inputs import call_tokens, check_token_count, per_row_cu_seqlens
from .metadata import AttentionMetadata
from .ops import varlen
from .packing import pack, unpack

if TYPE_CHECKING:
    from .cp import ContextParallel

__all__ = ["sdpa_to_usp", "pack", "unpack"]


def _as_bhlk(name: str, x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dim() == 4:
        return x
    if x.dim() == 3:  # (B, L, K): SDPA without a head dim
        return x.unsqueeze(1)
    raise ValueError(f"{name} must be (B, H, L, K) or (B, L, K) for usp_graph, got shape {tuple(x.shape)}")


def _is_tracing(*tensors: Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return any(is_fake(t) or t.is_meta or type(t) is not Tensor for t in tensors)


def _document_ids(metadata: AttentionMetadata | None, batch: int, seq: int, device: torch.device) -> Tensor:
    """Document id of every token, (B, L)."""
    if metadata is None:
        return torch.arange(batch, device=device).unsqueeze(1).expand(batch, seq)
    cu = metadata.cu_seqlens.to(device=device, dtype=torch.int64)
    tokens = torch.arange(batch * seq, device=device)
    return (torch.searchsorted(cu, tokens, right=True) - 1).reshape(batch, seq)


# Concrete masks already read, by identity: transformers builds one mask per forward and hands it to
# every layer (and to every recompute of a checkpointed layer). An entry holds a weak reference, so
# a freed mask's reused id is never mistaken for it; a write to the mask changes its version.
_READ: dict[tuple, tuple[weakref.ref, tuple]] = {}


def _read_mask(
    attn_mask: Tensor, metadata: AttentionMetadata | None, batch: int, heads: int, seq_q: int, seq_k: int
) -> tuple[bool, tuple[int, int] | None, AttentionMetadata | None]:
    """`(is_causal, window, metadata)` that attend exactly like `attn_mask`, a concrete mask that
    is a band (causal, bidirectional or a sliding window) inside documents.

    With `metadata`, the documents are its documents. Without, they are read off the mask (the
    finest runs it keeps apart, e.g. the packed sequences transformers finds in position ids), and
    the metadata returned describes them (None when each row is one document). Raises ValueError
    for any other mask: a varlen kernel cannot express it, and dropping it would change the result.

    The mask is read once, in blocks of rows (O(L) extra memory, `masks.read_rows`); a mask
    already read (the same tensor, unchanged, with the same metadata) is not read again."""
    if _is_tracing(attn_mask):
        raise ValueError(
            "attn_mask cannot be evaluated while tracing outside the usp rewrite; drop the mask and pass the "
            "document boundaries as usp_graph.AttentionMetadata instead"
        )
    meta_key = None if metadata is None else (id(metadata.cu_seqlens), metadata.cu_seqlens._version)
    key = (id(attn_mask), attn_mask._version, meta_key, batch, heads, seq_q, seq_k)
    hit = _READ.get(key)
    if hit is not None and hit[0]() is attn_mask:
        return hit[1]
    read = _read_mask_once(attn_mask, metadata, batch, heads, seq_q, seq_k)
    if len(_READ) >= 16:
        for k in [k for k, (ref, _) in _READ.items() if ref() is None] or list(_READ)[:8]:
            del _READ[k]
    _READ[key] = (weakref.ref(attn_mask), read)
    return read


def _read_mask_once(
    attn_mask: Tensor, metadata: AttentionMetadata | None, batch: int, heads: int, seq_q: int, seq_k: int
) -> tuple[bool, tuple[int, int] | None, AttentionMetadata | None]:
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise ValueError(f"attn_mask must be bool or float, got {attn_mask.dtype}")
    if seq_q != seq_k:
        raise ValueError(
            f"attn_mask with query length {seq_q} != key length {seq_k} cannot be rewritten to varlen attention"
        )
    try:
        mask_BHLL = torch.broadcast_to(attn_mask, (batch, heads, seq_q, seq_k))
    except RuntimeError:
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to (B, H, L, L) = "
            f"({batch}, {heads}, {seq_q}, {seq_k})"
        ) from None
    if heads == 0:
        mask_BHLL = torch.ones(batch, 1, seq_q, seq_k, dtype=torch.bool, device=attn_mask.device)
    elif heads > 1 and mask_BHLL.stride(1) != 0 and not _same_over_heads(mask_BHLL):
        raise ValueError("attn_mask differs between heads; usp_graph rewrites only document masks")
    rows = masks.read_rows(mask_BHLL[:, 0])
    if rows is None:
        raise ValueError(
            "attn_mask: a float mask is only rewritten when every entry is 0 or -inf (a document mask); "
            "pass document boundaries as AttentionMetadata instead of an additive bias"
        )
    derived = None
    if metadata is not None:
        doc_BL = _document_ids(metadata, batch, seq_q, attn_mask.device)
        if batch > 1 and seq_q > 0 and bool((doc_BL[1:, 0] == doc_BL[:-1, -1]).any()):
            raise ValueError(
                "attn_mask: a document of the metadata spans two batch rows, which a per-row SDPA mask cannot "
                "express; drop the mask (the metadata alone defines the documents) or split documents at rows"
            )
    else:
        doc_BL = masks.documents_of_mask(rows)
        if seq_q > 0 and bool((doc_BL[:, -1] > 0).any()):  # more than one document in some row
            docs = doc_BL + (doc_BL[:, -1:] + 1).cumsum(0) - (doc_BL[:, -1:] + 1)
            derived = AttentionMetadata.from_document_ids(docs.reshape(-1), max_seqlen=seq_q)
    window = masks.band_of(rows, doc_BL)
    if window is None and metadata is not None:
        # A band over whole rows (a causal or sliding-window mask built without the documents, as
        # transformers does with a cache): the metadata's documents replace the rows, as they do
        # for is_causal=True.
        window = masks.band_of(rows)
    if window is None:
        what = "the documents of the metadata" if metadata is not None else "its own documents"
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} is not a causal, bidirectional or sliding-window mask "
            f"within {what}; usp_graph rewrites only document masks. Pass the document boundaries as "
            "usp_graph.AttentionMetadata and no mask"
        )
    left, right = window
    is_causal = right == 0
    extra = (
        None
        if left == masks.UNBOUNDED and right in (masks.UNBOUNDED, 0)
        else (left, -1 if is_causal else right)
    )
    return is_causal, extra, derived


def _same_over_heads(mask_BHLL: Tensor) -> bool:
    """Every head's mask equals head 0's, compared in blocks of rows (no whole-mask temporary)."""
    b, h, lq, lk = mask_BHLL.shape
    step = max(1, masks._BLOCK_ELEMS // max(1, b * lk))
    for r0 in range(0, lq, step):
        first = mask_BHLL[:, :1, r0 : r0 + step]
        for i in range(1, h):
            if not torch.equal(mask_BHLL[:, i : i + 1, r0 : r0 + step], first):
                return False
    return True


def _token_mismatch(
    name: str, x: Tensor, n: int, meta: AttentionMetadata, world: int, kv_metadata: AttentionMetadata | None
) -> str:
    across = f" x {world} CP ranks" if world > 1 else ""
    which = "kv_metadata" if name == "key" and kv_metadata is not None else "the metadata"
    return (
        f"SDPA call with {name} of shape {tuple(x.shape)} has {n} tokens (batch * length{across}) but "
        f"{which} describes {meta.total_tokens}; give metadata for this call's packed tokens"
    )


def sdpa_to_usp(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    *,
    metadata: AttentionMetadata | None = None,
    cp: ContextParallel | None = None,
    window: tuple[int, int] | None = None,
    kv_metadata: AttentionMetadata | None = None,
) -> Tensor:
    """One SDPA call as pack -> ``usp::varlen_fwd`` -> unpack, with `metadata`'s document boundaries.

    Arguments are SDPA's. `metadata=None` means one document per batch row (exactly SDPA's
    semantics); otherwise the `B * L` tokens of the call, read row-major, are the packed stream the
    metadata describes, and no attention crosses a document boundary. `attn_mask` is accepted only
    when it is a causal, bidirectional or sliding-window mask inside documents (those of
    `metadata`, or, without metadata, the ones the mask itself keeps apart; checked in eager);
    `dropout_p > 0` is refused. `window=(left, right)`: a sliding window inside each document in
    flash-attention's convention (-1 unbounded).

    Cross-attention: `kv_metadata` describes the documents of the key/value stream (document i
    of the queries attends document i of the keys); without it, keys share the queries' metadata
    (self-attention), or, without any metadata, each batch row is one document of both.

    With `cp` (a `usp_graph.ContextParallel`), `query/key/value` are this rank's sequence shards
    and `metadata` (or one document per row) describes the GLOBAL packed stream of `B * L * P`
    tokens; the strategy's collectives and ops run and the result is this rank's output shard.
    """
    q_BHLK, k_BGLK, v_BGLK = _as_bhlk("query", query), _as_bhlk("key", key), _as_bhlk("value", value)
    _check_arguments(query, key, value, q_BHLK, k_BGLK, dropout_p, is_causal, enable_gqa, metadata)
    b, h, seq_q, dim = q_BHLK.shape
    g, seq_k = k_BGLK.shape[1], k_BGLK.shape[2]
    world = 1
    if cp is not None:
        from .cp import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a usp_graph.ContextParallel or None, got {type(cp).__name__}")
        if attn_mask is not None:
            # A model builds its mask from this rank's shard (transformers from the local position
            # ids): only a band inside documents is accepted, for its window; the documents are
            # the global metadata's.
            is_causal, window = _band_of_mask(attn_mask, None, is_causal, window, b, h, seq_q, seq_k)[:2]
            attn_mask = None
        world = cp.world
    _check_kv_metadata(metadata, kv_metadata, attn_mask)
    if metadata is not None:
        _check_tokens(query, key, metadata, kv_metadata, b, seq_q, seq_k, world)
    if attn_mask is not None:
        is_causal, window, derived = _band_of_mask(attn_mask, metadata, is_causal, window, b, h, seq_q, seq_k)
        metadata = metadata if metadata is not None else derived
    if metadata is None and is_causal and seq_q != seq_k:
        raise ValueError(
            f"is_causal with query length {seq_q} != key length {seq_k}: SDPA aligns such a mask top-left, "
            "varlen attention bottom-right; pass AttentionMetadata with explicit boundaries"
        )
    cu_q, cu_k, max_q, max_k = _boundaries(metadata, kv_metadata, b, seq_q, seq_k, q_BHLK.device)
    if dim == 0:
        raise ValueError(f"query head dim must be positive, got query of shape {tuple(query.shape)}")
    if scale is None:
        scale = 1.0 / math.sqrt(dim)
    if cp is not None:
        if metadata is None:  # one document per global row
            cu_q = per_row_cu_seqlens(b, seq_q * world, device=q_BHLK.device)
        if g != h and not enable_gqa:  # SDPA's broadcast of a single kv head
            k_BGLK, v_BGLK = k_BGLK.expand(-1, h, -1, -1), v_BGLK.expand(-1, h, -1, -1)
        out_BHLK = _cp_attention(
            cp, q_BHLK, k_BGLK, v_BGLK, cu_q, cu_k, max_q if metadata is not None else seq_q * world, max_k,
            is_causal=is_causal, scale=float(scale), window=window, cross=kv_metadata is not None,
        )  # fmt: skip
        return out_BHLK.squeeze(1) if query.dim() == 3 else out_BHLK
    out_THK = varlen.varlen_attn(
        pack(q_BHLK),
        pack(k_BGLK),
        pack(v_BGLK),
        cu_q,
        cu_k,
        max_q,
        max_k,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=g != h,
        **({} if window is None else {"window": window}),
    )
    out_BHLK = unpack(out_THK, b)
    return out_BHLK.squeeze(1) if query.dim() == 3 else out_BHLK


def _check_arguments(query, key, value, q_BHLK, k_BGLK, dropout_p, is_causal, enable_gqa, metadata) -> None:
    """SDPA's own argument rules, and usp's: no dropout, metadata of the right type."""
    if dropout_p:
        raise ValueError(
            f"dropout_p={dropout_p}: usp_graph does not support dropout inside attention; pass 0.0"
        )
    b, h = q_BHLK.shape[:2]
    bk, g = k_BGLK.shape[:2]
    if bk != b or value.shape[0] != b:
        raise ValueError(
            f"query, key, value must share the batch size, got {tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if g != h and not enable_gqa and g != 1:
        raise ValueError(
            f"query has {h} heads but key/value have {g}; pass enable_gqa=True for grouped-query attention"
        )
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    if metadata is not None and not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"metadata must be a usp_graph.AttentionMetadata or None, got {type(metadata).__name__}"
        )


def _band_of_mask(attn_mask, metadata, is_causal, window, b, h, seq_q, seq_k):
    """(is_causal, window, derived metadata) of a mask that is a band inside documents (`_read_mask`);
    a mask without a window beyond causality keeps the call's `window`."""
    if is_causal:
        raise ValueError("attn_mask and is_causal=True were both given; SDPA accepts only one of them")
    is_causal, mask_window, derived = _read_mask(attn_mask, metadata, b, h, seq_q, seq_k)
    return is_causal, mask_window if mask_window is not None else window, derived


def _check_kv_metadata(metadata, kv_metadata, attn_mask) -> None:
    if kv_metadata is None:
        return
    if not isinstance(kv_metadata, AttentionMetadata):
        raise TypeError(
            f"kv_metadata must be a usp_graph.AttentionMetadata or None, got {type(kv_metadata).__name__}"
        )
    if metadata is None:
        raise ValueError("kv_metadata needs metadata for the queries too")
    if attn_mask is not None:
        raise ValueError("attn_mask with kv_metadata: the two metadata define the documents; drop the mask")
    if kv_metadata.cu_seqlens.shape != metadata.cu_seqlens.shape:
        raise ValueError(
            f"query metadata has {metadata.cu_seqlens.numel() - 1} document slots but kv_metadata has "
            f"{kv_metadata.cu_seqlens.numel() - 1}; build both with the same max_docs (document i of the "
            "queries attends document i of the keys)"
        )


def _check_tokens(query, key, metadata, kv_metadata, b, seq_q, seq_k, world) -> None:
    kv_meta = kv_metadata if kv_metadata is not None else metadata
    for name, x, n, meta_n in (
        ("query", query, call_tokens(b, seq_q, world), metadata),
        # Under CP the key/value stream of cross-attention is replicated, not sharded.
        ("key", key, call_tokens(b, seq_k, world if kv_metadata is None else 1), kv_meta),
    ):
        # Symbolic sizes are not checked here: the graph's input checks own them.
        check_token_count(
            n, meta_n.total_tokens, partial(_token_mismatch, name, x, n, meta_n, world, kv_metadata)
        )


def _boundaries(metadata, kv_metadata, b, seq_q, seq_k, device):
    """(cu_q, cu_k, max_q, max_k) on `device`: the metadata's, or one document per row."""
    if metadata is None:
        cu_q = per_row_cu_seqlens(b, seq_q, device=device)
        # Self-attention shares one boundary tensor (a kernel may then treat queries and keys alike).
        cu_k = cu_q if seq_k == seq_q else per_row_cu_seqlens(b, seq_k, device=device)
        return cu_q, cu_k, seq_q, seq_k
    cu_q = cu_k = metadata.cu_seqlens
    if cu_q.device != device:
        cu_q = cu_k = cu_q.to(device, non_blocking=True)
    max_q = max_k = metadata.max_seqlen
    if kv_metadata is not None:
        cu_k, max_k = kv_metadata.cu_seqlens, kv_metadata.max_seqlen
        if cu_k.device != device:
            cu_k = cu_k.to(device, non_blocking=True)
    return cu_q, cu_k, max_q, max_k


def _cp_attention(cp, q_BHLK, k_BGLK, v_BGLK, cu_q, cu_k, max_q, max_k, *, is_causal, scale, window, cross):
    """The strategy's attention over this rank's shards (cross-attention: `cp.cross`)."""
    if cross:
        from .cp.cross import cross_attention

        if is_causal or window is not None:
            raise ValueError("causal or windowed cross-attention is not supported under context parallelism")
        return cross_attention(
            cp, q_BHLK, k_BGLK, v_BGLK, cu_seqlens_q=cu_q, max_seqlen_q=max_q, cu_seqlens_k=cu_k,
            max_seqlen_k=max_k, scale=scale,
        )  # fmt: skip
    return cp.attention(
        q_BHLK,
        k_BGLK,
        v_BGLK,
        cu_seqlens=cu_q,
        max_seqlen=max_q,
        is_causal=is_causal,
        scale=scale,
        window=window,
    )


# ------------------------------------------------------------------------------------------------
# SDPA with a sliding window, as one op that every path reads as an attention call.
#
# SDPA has no window argument, and a window spelled as a (L, L) mask is quadratic memory wherever
# nothing rewrites it. ``usp_graph::sdpa`` is SDPA plus flash-attention's ``window``: composite
# (its own decomposition is `sdpa_to_usp` with one document per batch row, so any backend and
# the meta device run it), `attention_mode` routes it with its documents, and the compile
# backend finds it as an attention site (`sites.SDPA_FORMS`) and rewrites it like SDPA.

_LIB = torch.library.Library("usp_graph", "DEF")
_LIB.define(
    "sdpa(Tensor query, Tensor key, Tensor value, bool is_causal=False, float? scale=None, "
    "bool enable_gqa=False, int[2] window=[-1, -1]) -> Tensor"
)


def _sdpa_rows(query, key, value, is_causal=False, scale=None, enable_gqa=False, window=(-1, -1)):
    win = tuple(int(w) for w in window)
    return sdpa_to_usp(
        query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa,
        window=None if win == (-1, -1) else win,
    )  # fmt: skip


_LIB.impl("sdpa", _sdpa_rows, "CompositeImplicitAutograd")
SDPA_OP = torch.ops.usp_graph.sdpa.default


def windowed_sdpa(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    window: tuple[int, int] | None = None,
) -> Tensor:
    """SDPA (no mask, no dropout) with a sliding `window` (flash-attention's ``(left, right)``,
    -1 unbounded; with `is_causal` the right side is 0). Without a window it is
    ``F.scaled_dot_product_attention`` itself, so every path that reads SDPA reads it unchanged."""
    if window is None or tuple(window) == (-1, -1):
        return torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
        )
    return SDPA_OP(query, key, value, is_causal, scale, enable_gqa, [int(window[0]), int(window[1])])
