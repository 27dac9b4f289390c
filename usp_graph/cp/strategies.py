"""Context-parallel attention strategies: local shards in, local shards out, global metadata.

# B batch rows, H query heads, G key/value heads, Ll local row length, L global row length,
# K head dim, T packed tokens, P CP ranks, U Ulysses degree, R ring size

Every strategy derives its local document view from the GLOBAL `cu_seqlens` inside the
computation (clamps and slices whose bounds come from shapes), so boundaries may change every
step without retracing, and documents may cross shard boundaries.

Sliding windows (`window=(left, right)`, positions global within each document): the kernel's
window is anchored at the end of each document's query and key views (bottom-right), so a query
chunk whose keys reach past its end gets `right` dummy query rows appended (`_window_view`): every
document's query view then ends where its key view ends, and the dummy rows' outputs are dropped
(zero gradient). A left-only window (right unbounded) runs on the reversed stream, where it is a
right-only one. Ulysses sees whole documents and passes the window through; ring pairs are planned
in ``usp::ring_attn_fwd``.

`usp_graph.cp.table` lists the strategies (one row each, with the facts other modules read);
`usp_graph.cp.common` holds what they share with the cost model and `ContextParallel` (head
splits, halo widths, chunk order, `RankPlan`: what a strategy reads of its plan).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..ops import varlen
from ..ops.window import NO_WINDOW, bounds
from ..packing import pack, unpack
from .common import RankPlan, halo_widths, reorder_chunks, ulysses_head_split


def _rows_in_order(x_BHLK: Tensor, cp: RankPlan) -> Tensor:
    """(B, H, P*Ll, K) gathered rank-major -> global row order."""
    return reorder_chunks(x_BHLK, 2, cp.layout.gather_order())


def _rows_rank_major(x_BHLK: Tensor, cp: RankPlan) -> Tensor:
    return reorder_chunks(x_BHLK, 2, cp.layout.scatter_order())


def _ulysses_heads(
    q: Tensor, k: Tensor, v: Tensor, degree: int
) -> tuple[Tensor, Tensor, list[int], list[int]]:
    """K, V ready for the all-to-all (repeated to the query heads where `ulysses_head_split` says
    so), query head sizes, key/value head sizes."""
    h, g = q.shape[1], k.shape[1]
    q_sizes, kv_sizes, repeat = ulysses_head_split(h, g, degree)
    if repeat:
        k, v = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1)
    return k, v, q_sizes, kv_sizes


def _a2a(
    x: Tensor, scatter_dim: int, gather_dim: int, scatter: list[int], gather: list[int], group: str
) -> Tensor:
    return torch.ops.usp.all_to_all(x, scatter_dim, gather_dim, scatter, gather, group)


def _window_view(q_T, k_T, v_T, cu_q, cu_k, *, pad, max_seqlen, is_causal, scale, window):
    """Windowed varlen attention of the query rows `q_T` over keys `k_T`, where keys reach up to
    `pad` tokens past q_T's last position. The caller clamps both views at that bound (q_T's end
    + pad): `cu_q` counts `pad` dummy rows past q_T, appended here as zeros, so each document's
    query and key views end together, the window's anchor. A slot of its own takes the dummy rows
    past the stream's end (no keys). Returns out for q_T's rows; the dummy rows' gradient is 0."""
    if pad:
        rows = q_T.shape[0]
        q_T = torch.cat([q_T, q_T.new_zeros(pad, *q_T.shape[1:])])
        cu_q = torch.cat([cu_q, cu_q.new_full((1,), rows + pad)])
        cu_k = torch.cat([cu_k, cu_k[-1:]])
    out = varlen.varlen_attn(
        q_T, k_T, v_T, cu_q, cu_k, max_seqlen + pad, max_seqlen, is_causal=is_causal, scale=scale,
        enable_gqa=True, window=window,
    )  # fmt: skip
    return out[: out.shape[0] - pad] if pad else out


def _reversed_stream(cu: Tensor, total) -> Tensor:
    """Document boundaries of the token stream read backwards (position x -> total - 1 - x)."""
    return total - cu.flip(0)


def _allgather_windowed(q_T, k_T, v_T, chunks, chunk, cu, max_seqlen, is_causal, scale, window):
    """allgather_kv under a window: per local chunk, keys from the stream start to `right` tokens
    past the chunk (dummy query rows, `_window_view`); a left-only window on the reversed stream."""
    left, right = bounds(window, is_causal)
    total = k_T.shape[0]
    flip = right == -1  # (left, -1) reads backwards as (-1, left)
    if flip:
        k_T, v_T, cu = k_T.flip(0), v_T.flip(0), _reversed_stream(cu, total)
        window, is_causal, right = (-1, left), False, left
    outs = []
    for i, cid in enumerate(chunks):
        start, end = cid * chunk, (cid + 1) * chunk
        q_i = q_T[i * chunk : (i + 1) * chunk]
        if flip:
            start, end, q_i = total - end, total - start, q_i.flip(0)
        out = _window_view(
            q_i, k_T, v_T, cu.clamp(start, end + right) - start, cu.clamp(max=end + right), pad=right, max_seqlen=max_seqlen, is_causal=is_causal, scale=scale, window=window,
        )  # fmt: skip
        outs.append(out.flip(0) if flip else out)
    return outs[0] if len(outs) == 1 else torch.cat(outs, 0)


def allgather_kv(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    """Q stays sharded; K/V are all-gathered. One varlen call per local chunk, whose query view is
    the global boundaries clamped to the chunk and whose keys run from 0 to the chunk end (causal)
    or over the whole stream."""
    b, _, ll, _ = q.shape
    k_g = _rows_in_order(torch.ops.usp.all_gather(k, 2, cp.world, cp.group_name), cp)
    v_g = _rows_in_order(torch.ops.usp.all_gather(v, 2, cp.world, cp.group_name), cp)
    k_T, v_T, q_T = pack(k_g), pack(v_g), pack(q)
    chunk = ll // cp.layout.per_rank
    if window != NO_WINDOW:
        chunks = cp.layout.global_chunks(cp.rank, b)
        out_T = _allgather_windowed(
            q_T, k_T, v_T, chunks, chunk, cu_seqlens, max_seqlen, is_causal, scale, window
        )
        return unpack(out_T, b)
    outs = []
    for i, cid in enumerate(cp.layout.global_chunks(cp.rank, b)):
        start, end = cid * chunk, (cid + 1) * chunk
        cu_q = cu_seqlens.clamp(start, end) - start
        if is_causal:
            k_i, v_i, cu_k = k_T[:end], v_T[:end], cu_seqlens.clamp(max=end)
        else:
            k_i, v_i, cu_k = k_T, v_T, cu_seqlens
        outs.append(
            varlen.varlen_attn(
                q_T[i * chunk : (i + 1) * chunk],
                k_i,
                v_i,
                cu_q,
                cu_k,
                max_seqlen,
                max_seqlen,
                is_causal=is_causal,
                scale=scale,
                enable_gqa=True,
            )
        )
    out_T = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return unpack(out_T, b)


def ulysses(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    """Sequence <-> heads all-to-all; the full sequence with a subset of heads runs varlen with the
    global boundaries, then the output goes back to sequence shards. With ``cp.head_groups`` > 1,
    group by group of heads (each head's attention unchanged), so one group's all-to-alls can
    travel while another group attends."""
    groups = getattr(cp, "head_groups", 1)
    if groups == 1:
        return _ulysses(cp, q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, is_causal=is_causal,
                        scale=scale, window=window)  # fmt: skip
    h, g = q.shape[1], k.shape[1]
    n = groups * cp.world
    if h % n:
        raise ValueError(
            f"Ulysses with head_groups={groups} over {cp.world} ranks splits the query heads into {n} equal "
            f"parts, but there are {h}; use a head_groups that divides {h} // {cp.world}"
        )
    if g % n:  # K/V heads do not split as the query heads do: repeat them (the repeat's backward sums)
        k, v, g = k.repeat_interleave(h // g, 1), v.repeat_interleave(h // g, 1), h
    hq, hk = h // groups, g // groups
    outs = [
        _ulysses(cp, q[:, j * hq : (j + 1) * hq], k[:, j * hk : (j + 1) * hk], v[:, j * hk : (j + 1) * hk],
                 cu_seqlens=cu_seqlens, max_seqlen=max_seqlen, is_causal=is_causal, scale=scale, window=window)
        for j in range(groups)
    ]  # fmt: skip
    return torch.cat(outs, dim=1)


def _ulysses(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    b, _, ll, _ = q.shape
    k, v, q_sizes, kv_sizes = _ulysses_heads(q, k, v, cp.world)
    seq = [ll] * cp.world
    q_g = _rows_in_order(_a2a(q, 1, 2, q_sizes, seq, cp.group_name), cp)
    k_g = _rows_in_order(_a2a(k, 1, 2, kv_sizes, seq, cp.group_name), cp)
    v_g = _rows_in_order(_a2a(v, 1, 2, kv_sizes, seq, cp.group_name), cp)
    out_T = varlen.varlen_attn(
        pack(q_g),
        pack(k_g),
        pack(v_g),
        cu_seqlens,
        cu_seqlens,
        max_seqlen,
        max_seqlen,
        is_causal=is_causal,
        scale=scale,
        enable_gqa=True,
        window=window,  # whole documents, global boundaries: the window as it is
    )
    out = _rows_rank_major(unpack(out_T, b), cp)
    return _a2a(out, 2, 1, seq, q_sizes, cp.group_name)


def _ring_call(q_T, k_T, v_T, chunk_ids, per_rank, group, cu_seqlens, max_seqlen, is_causal, scale,
               window=NO_WINDOW):  # fmt: skip
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    win = {} if window == NO_WINDOW else {"window_left": window[0], "window_right": window[1]}
    out, _ = torch.ops.usp.ring_attn_fwd(
        q_T, k_T, v_T, cu_seqlens, max_seqlen, is_causal, float(scale), chunk_ids, per_rank, group, **win
    )
    return out


def ring(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    """K/V rotate around the ring; partial outputs merged by log-sum-exp (``usp::ring_attn_fwd``)."""
    b = q.shape[0]
    ids = [c for r in range(cp.world) for c in cp.layout.global_chunks(r, b)]
    per_rank = b * cp.layout.per_rank
    out_T = _ring_call(
        pack(q),
        pack(k),
        pack(v),
        ids,
        per_rank,
        cp.group_name,
        cu_seqlens,
        max_seqlen,
        is_causal,
        scale,
        window,
    )
    return unpack(out_T, b)


def usp(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    """2-D: Ulysses all-to-all inside groups of `ulysses_degree` ranks, ring (or, with
    ``across="halo"``, halo exchange) across the groups."""
    b, _, ll, _ = q.shape
    u = cp.ulysses_degree
    k, v, q_sizes, kv_sizes = _ulysses_heads(q, k, v, u)
    seq = [ll] * u
    q_g = _a2a(q, 1, 2, q_sizes, seq, cp.ulysses_group_name)
    k_g = _a2a(k, 1, 2, kv_sizes, seq, cp.ulysses_group_name)
    v_g = _a2a(v, 1, 2, kv_sizes, seq, cp.ulysses_group_name)
    if cp.across == "halo":
        # Contiguous layout: after the all-to-all, member i of the ring dimension holds, per row, the
        # U consecutive chunks of CP ranks i*U .. i*U+U-1: one chunk of U*Ll tokens of the stream.
        r, i = cp.ring_size, cp.rank // u
        out = _halo_attention(
            q_g, k_g, v_g, chunk_ids=[bb * r + i for bb in range(b)], group=cp.ring_group_name,
            max_document_len=cp.max_document_len, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
            is_causal=is_causal, scale=scale, window=window,
        )  # fmt: skip
        return _a2a(out, 2, 1, seq, q_sizes, cp.ulysses_group_name)
    # After the all-to-all, ring member i holds, per row, the chunks of CP ranks i*U .. i*U+U-1.
    n = cp.layout.row_chunks_total
    ids = [
        bb * n + c
        for i in range(cp.ring_size)
        for bb in range(b)
        for j in range(u)
        for c in cp.layout.row_chunks(i * u + j)
    ]
    per_rank = b * u * cp.layout.per_rank
    out_T = _ring_call(
        pack(q_g),
        pack(k_g),
        pack(v_g),
        ids,
        per_rank,
        cp.ring_group_name,
        cu_seqlens,
        max_seqlen,
        is_causal,
        scale,
        window,
    )
    return _a2a(unpack(out_T, b), 2, 1, seq, q_sizes, cp.ulysses_group_name)


def _halo_attention(q, k, v, *, chunk_ids, group, max_document_len, cu_seqlens, max_seqlen, is_causal, scale,
                    window=NO_WINDOW):  # fmt: skip
    """Varlen attention of q (B, H, Lc, K), whose row b is global chunk `chunk_ids[b]` of length Lc,
    over K/V windows extended by halos exchanged with the neighbouring chunks' owners in `group`."""
    b, _, ll, _ = q.shape
    before, after, must_fit = halo_widths(max_document_len, is_causal, window)
    # usp::halo_exchange refuses documents longer than the halo allows; with both sides bounded by
    # the window any document length is fine (max_seqlen 0: nothing to check).
    check = max_seqlen if must_fit else 0
    # One exchange for K and V (head dims side by side): half the messages, the same bytes; its
    # adjoint is one halo_reduce of dK and dV together.
    kd = k.shape[-1]
    kv_w = torch.ops.usp.halo_exchange(torch.cat([k, v], dim=-1), 2, before, after, check, group)
    k_w, v_w = kv_w[..., :kd], kv_w[..., kd:]
    q_T, k_T, v_T = pack(q), pack(k_w), pack(v_w)
    span = before + ll + after
    outs = []
    for i, cid in enumerate(chunk_ids):
        start = cid * ll
        first = start - before  # global position of the window's first key (may be < 0)
        # Keys of the window past the stream's ends (zeros) lie outside every document: unused,
        # with zero gradient (the varlen contract), and halo_reduce drops them.
        q_i, k_i, v_i = (
            q_T[i * ll : (i + 1) * ll],
            k_T[i * span : (i + 1) * span],
            v_T[i * span : (i + 1) * span],
        )
        cu_k = cu_seqlens.clamp(first, first + span) - first
        if window == NO_WINDOW:
            outs.append(
                varlen.varlen_attn(
                    q_i,
                    k_i,
                    v_i,
                    cu_seqlens.clamp(start, start + ll) - start,
                    cu_k,
                    max_seqlen,
                    max_seqlen,
                    is_causal=is_causal,
                    scale=scale,
                    enable_gqa=True,
                )  # fmt: skip
            )
        else:  # query views extended over `after` dummy rows end where the key views end
            cu_q = cu_seqlens.clamp(start, start + ll + after) - start
            outs.append(
                _window_view(
                    q_i,
                    k_i,
                    v_i,
                    cu_q,
                    cu_k,
                    pad=after,
                    max_seqlen=max_seqlen,
                    is_causal=is_causal,
                    scale=scale,
                    window=window,
                )  # fmt: skip
            )
    out_T = outs[0] if len(outs) == 1 else torch.cat(outs, 0)
    return unpack(out_T, b)


def halo(cp: RankPlan, q, k, v, *, cu_seqlens, max_seqlen, is_causal, scale, window=NO_WINDOW):
    """Q stays sharded; each rank takes from its neighbours only the K/V that a document crossing
    its shard boundary can need: the last ``max_document_len - 1`` tokens of the preceding chunk
    (and, bidirectional, the first ones of the following chunk), or fewer where a sliding window
    reaches less far. One varlen call per row, keys over that window. ``usp::halo_exchange``
    refuses a step whose documents are longer than the halo allows (unless the window bounds both
    sides within it), so a too-long document is an error, never a wrong result."""
    return _halo_attention(
        q, k, v, chunk_ids=cp.layout.global_chunks(cp.rank, q.shape[0]), group=cp.group_name,
        max_document_len=cp.max_document_len, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen,
        is_causal=is_causal, scale=scale, window=window,
    )  # fmt: skip
