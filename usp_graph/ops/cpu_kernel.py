"""The CPU kernel of ``usp::varlen_fwd`` / ``usp::varlen_bwd``: one flash-CPU call per document.

# T packed tokens, H query heads, G key/value heads, K head dim, Kv value head dim,
# lq / lk query / key count of one document

Per document over ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward op), which
was bitwise deterministic across runs and thread counts. GQA is native to its forward; the backward
runs the repeated heads and sums each group in head order (`cpu_bwd`). A value head dim
Kv != K runs it on inputs zero-padded to max(K, Kv), the result cut back (issue 17). A document a
sliding window cuts runs in blocks of query rows, each over the keys its rows can see with an
additive mask (memory rows x (rows + window), not lq x lk); a document it does not cut runs the
windowless call.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .boundaries import documents_of, lse_dtype
from .window import NO_WINDOW, doc_plan, keep_mask

__all__ = ["cpu_fwd", "cpu_bwd", "group_sum", "WINDOW_ROWS"]

_aten = torch.ops.aten


def _bottom_right_mask(lq: int, lk: int, dtype: torch.dtype) -> Tensor:
    # The CPU flash kernel's is_causal is top-left aligned when lq != lk; express bottom-right as an
    # additive mask (it must have the query's dtype).
    keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
    return torch.zeros(lq, lk, dtype=dtype).masked_fill(~keep, float("-inf"))


def _causal_args(lq: int, lk: int, is_causal: bool, dtype: torch.dtype) -> tuple[bool, Tensor | None]:
    if not is_causal:
        return False, None
    if lq == lk:
        return True, None
    return False, _bottom_right_mask(lq, lk, dtype)


def _bhlk(x: Tensor) -> Tensor:
    return x.transpose(0, 1).unsqueeze(0)


def _doc_mode(lq: int, lk: int, is_causal: bool, left: int, right: int) -> tuple[str, int, int]:
    """("plain" | "causal" | "window", left, right) of one document; without a window exactly
    today's choice, so windowless calls run the same kernel calls bit for bit."""
    if (left, right) == NO_WINDOW:
        return ("causal" if is_causal else "plain"), -1, -1
    return doc_plan(lq, lk, is_causal, left, right)


# Query rows per kernel call of a windowed document: the additive mask of a call is rows x (rows +
# window), never the document's lq x lk (a 32K-token document with a 4K window would need 4 GB).
WINDOW_ROWS = 512


def _window_blocks(lq: int, lk: int, left: int, right: int) -> list[tuple[range, range]]:
    """(query rows, keys) of each kernel call of a windowed document: rows in blocks of
    `WINDOW_ROWS`, keys cut to the span the block's rows can see; blocks that see no key are
    left out (their rows keep out = 0, lse = -inf)."""
    blocks = []
    for r0 in range(0, lq, WINDOW_ROWS):
        r1 = min(lq, r0 + WINDOW_ROWS)
        lo = max(0, r0 + lk - lq - left) if left >= 0 else 0
        hi = min(lk, r1 + lk - lq + right) if right >= 0 else lk
        if hi > lo:
            blocks.append((range(r0, r1), range(lo, hi)))
    return blocks


def _window_mask(rows: range, lq: int, lk: int, keys: range, left: int, right: int, dtype: torch.dtype):
    """(additive mask or None when the block sees every key, rows that see no key or None)."""
    keep = keep_mask(rows, lq, lk, keys, left, right)
    if bool(keep.all()):
        return None, None
    blind = ~keep.any(1)
    mask = torch.zeros(keep.shape, dtype=dtype).masked_fill(~keep, float("-inf"))
    return mask, (blind if bool(blind.any()) else None)


def _cpu_window_fwd(out, lse, q, k, v, sq, sk, lq, lk, left, right, scale):
    for rows, keys in _window_blocks(lq, lk, left, right):
        mask, blind = _window_mask(rows, lq, lk, keys, left, right, q.dtype)
        qs, ks = slice(sq + rows.start, sq + rows.stop), slice(sk + keys.start, sk + keys.stop)
        o_blk, lse_blk = _aten._scaled_dot_product_flash_attention_for_cpu(
            _bhlk(q[qs]), _bhlk(k[ks]), _bhlk(v[ks]), 0.0, False, attn_mask=mask, scale=scale
        )
        out[qs] = o_blk[0].transpose(0, 1)
        lse_blk = lse_blk[0]
        if blind is not None:  # the kernel gives such rows out 0 and lse 0; the contract says -inf
            lse_blk = lse_blk.masked_fill(blind, float("-inf"))
        lse[:, qs] = lse_blk


def _pad_head_dim(x: Tensor, d: int) -> Tensor:
    return x if x.shape[-1] == d else torch.nn.functional.pad(x, (0, d - x.shape[-1]))


def cpu_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if q.shape[-1] != v.shape[-1]:
        # The CPU flash kernel takes one head size for Q, K and V. Zero columns change no score
        # (q.k gains zero products; the scale is explicit) and add zero output columns, so pad the
        # narrower side to the wider and cut the output back (issue 17: `v_TGKv` is documented).
        d = max(q.shape[-1], v.shape[-1])
        args = (cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        out, lse = cpu_fwd(_pad_head_dim(q, d), _pad_head_dim(k, d), _pad_head_dim(v, d), *args)
        return out[..., : v.shape[-1]], lse
    t_q, h, _ = q.shape
    out = q.new_zeros(t_q, h, v.shape[-1])
    lse = torch.full((h, t_q), float("-inf"), dtype=lse_dtype(q.dtype), device=q.device)
    for sq, eq, sk, ek in documents_of(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
        lq, lk = eq - sq, ek - sk
        if lq == 0 or lk == 0:  # the kernel crashes on empty inputs; the answer is out 0, lse -inf
            continue
        mode, w_left, w_right = _doc_mode(lq, lk, is_causal, left, right)
        if mode == "window":
            _cpu_window_fwd(out, lse, q, k, v, sq, sk, lq, lk, w_left, w_right, scale)
            continue
        causal, mask = _causal_args(lq, lk, mode == "causal", q.dtype)
        o_doc, lse_doc = _aten._scaled_dot_product_flash_attention_for_cpu(
            _bhlk(q[sq:eq]), _bhlk(k[sk:ek]), _bhlk(v[sk:ek]), 0.0, causal, attn_mask=mask, scale=scale
        )
        out[sq:eq] = o_doc[0].transpose(0, 1)
        lse[:, sq:eq] = lse_doc[0]
        if mask is not None and lq > lk:  # rows that see no key: the kernel says lse 0 (and, with a
            lse[:, sq : sq + lq - lk] = float("-inf")  # NaN query, out NaN)
            out[sq : sq + lq - lk] = 0
    # The kernel gives a query row holding a NaN out 0 and lse 0: a finite loss over a NaN input.
    # Such a row that sees a key is NaN, as in the math attention (and as a NaN key or value is).
    nan_rows = q.isnan().any(-1).t() & (lse != float("-inf"))  # (H, T)
    if bool(nan_rows.any()):
        lse = lse.masked_fill(nan_rows, float("nan"))
        out = out.masked_fill(nan_rows.t().unsqueeze(-1), float("nan"))
    return out, lse


def _cpu_window_bwd(dq, dk, dv, dout, q, k, v, out, lse, sq, sk, lq, lk, left, right, scale):
    blocks = _window_blocks(lq, lk, left, right)
    # Keys seen by several row blocks sum their blocks' gradients (in block order, in the lse
    # dtype); a document of one block writes them directly.
    acc = None
    if len(blocks) > 1:
        acc = [torch.zeros((lk, *x.shape[1:]), dtype=lse_dtype(x.dtype)) for x in (k, v)]
    for rows, keys in blocks:
        mask, _ = _window_mask(rows, lq, lk, keys, left, right, q.dtype)
        qs, ks = slice(sq + rows.start, sq + rows.stop), slice(sk + keys.start, sk + keys.stop)
        l_blk = lse[:, qs]
        l_blk = l_blk.masked_fill(l_blk == float("-inf"), 0.0)  # back to the kernel's convention
        g_q, g_k, g_v = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhlk(dout[qs]), _bhlk(q[qs]), _bhlk(k[ks]), _bhlk(v[ks]), _bhlk(out[qs]),
            l_blk.unsqueeze(0), 0.0, False, attn_mask=mask, scale=scale,
        )  # fmt: skip
        dq[qs] = g_q[0].transpose(0, 1)
        if acc is None:
            dk[ks] = g_k[0].transpose(0, 1)
            dv[ks] = g_v[0].transpose(0, 1)
        else:
            acc[0][keys.start : keys.stop] += g_k[0].transpose(0, 1)
            acc[1][keys.start : keys.stop] += g_v[0].transpose(0, 1)
    if acc is not None:
        dk[sk : sk + lk] = acc[0]
        dv[sk : sk + lk] = acc[1]


def group_sum(x_THK: Tensor, g: int) -> Tensor:
    """(T, G, K): the H = G * rep heads of `x_THK` summed per group of `rep` consecutive heads."""
    t, h, d = x_THK.shape
    return x_THK.view(t, g, h // g, d).sum(2)


def cpu_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if q.shape[-1] != v.shape[-1]:  # as in `cpu_fwd`: zero columns, gradients cut back
        d, kq, kv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        args = (cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        padded = (_pad_head_dim(x, d) for x in (dout, q, k, v, out))
        dq, dk, dv = cpu_bwd(*padded, lse, *args)
        return dq[..., :kq], dk[..., :kq], dv[..., :kv]
    h, g = q.shape[1], k.shape[1]
    if g != h:
        # Grouped-query attention: each query head's key/value gradient is computed on its own and
        # the group's heads are summed in head order, exactly what autograd does for a model that
        # repeats K/V itself (expand or repeat_interleave, then SDPA). The kernel's own GQA sums in
        # an order that depends on the CPU's vector width, so a model that passes enable_gqa and
        # one that repeats K/V (transformers picks by whether it built a mask) would differ in the
        # last bit of dK/dV on some machines.
        rep = h // g
        args = (cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        k_h, v_h = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        dq, dk_h, dv_h = cpu_bwd(dout, q, k_h, v_h, out, lse, *args)
        return dq, group_sum(dk_h, g), group_sum(dv_h, g)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, eq, sk, ek in documents_of(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
        lq, lk = eq - sq, ek - sk
        if lq == 0 or lk == 0:
            continue
        mode, w_left, w_right = _doc_mode(lq, lk, is_causal, left, right)
        if mode == "window":
            _cpu_window_bwd(dq, dk, dv, dout, q, k, v, out, lse, sq, sk, lq, lk, w_left, w_right, scale)
            continue
        causal, mask = _causal_args(lq, lk, mode == "causal", q.dtype)
        l_doc = lse[:, sq:eq]
        if mask is not None and lq > lk:
            l_doc = l_doc.masked_fill(l_doc == float("-inf"), 0.0)  # back to the kernel's convention
        g_q, g_k, g_v = _aten._scaled_dot_product_flash_attention_for_cpu_backward(
            _bhlk(dout[sq:eq]),
            _bhlk(q[sq:eq]),
            _bhlk(k[sk:ek]),
            _bhlk(v[sk:ek]),
            _bhlk(out[sq:eq]),
            l_doc.unsqueeze(0),
            0.0,
            causal,
            attn_mask=mask,
            scale=scale,
        )
        dq[sq:eq] = g_q[0].transpose(0, 1)
        dk[sk:ek] = g_k[0].transpose(0, 1)
        dv[sk:ek] = g_v[0].transpose(0, 1)
    return dq, dk, dv
