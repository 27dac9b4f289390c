"""Varlen attention on packed documents: the ``usp::varlen_fwd`` / ``usp::varlen_bwd`` custom ops.

# T packed tokens, H query heads, G key/value heads (H % G == 0), K head dim, Kv value head dim,
# N document slots (cu_seqlens has N + 1 entries)

Semantics (the flash-attention varlen convention):
- document i holds queries ``q[cu_q[i]:cu_q[i+1]]`` and keys ``k[cu_k[i]:cu_k[i+1]]``; no attention
  crosses documents;
- causal is bottom-right aligned: query r of a document with lq queries and lk keys sees keys
  c <= r + lk - lq (identical to ordinary causal when lq == lk);
- a query row that sees no key (an empty key range, or causal with lq > lk) gets out = 0 and
  lse = -inf (log of an empty sum), on every device;
- lse is `(H, T)`, float32 (float64 for float64 inputs);
- cu_q runs from 0 to the query count; cu_k may start after 0 and end before the key count: keys
  outside every document are never attended and get zero gradient (a key window with padding).
- an optional sliding window ``(window_left, window_right)``, flash-attention's ``window_size``:
  query r attends key c iff ``r + lk - lq - left <= c <= r + lk - lq + right`` (-1: unbounded
  side); causal is right = 0. (-1, -1), the default, runs the windowless kernels bit for bit.

Kernels:
- CPU: per document over ``aten._scaled_dot_product_flash_attention_for_cpu`` (and its backward op),
  which was bitwise deterministic across runs and thread counts; GQA is native to it. A value head
  dim Kv != K runs it on inputs zero-padded to max(K, Kv), the result cut back (issue 17).
- CUDA: ``aten._flash_attention_forward/backward`` in their varlen form (the kernel behind
  ``torch.nn.attention.varlen.varlen_attn``; GQA native) for fp16/bf16; cuDNN's ragged attention
  (`cudnn_kernel`, with the optional ``nvidia-cudnn-frontend`` package; every varlen form, 1.4-1.7x
  flash for forward+backward at 32K-256K tokens on the H200); or flex_attention with a document
  block mask (`flex_kernel`; deterministic backward, 4-19% faster than flash at 16K-128K tokens)
  for self-attention: queries and keys share one ``cu_seqlens`` tensor and T is a multiple of 128.
  `cuda_kernel("flash" | "flex" | "cudnn" | "auto")` or ``USP_CUDA_ATTENTION`` picks; "auto" (the
  default) follows `AUTO_TABLE`. The choice depends on shapes, dtype and settings only, never on
  boundary values, so a step runs the same kernels wherever it runs. cuDNN's and flex's first
  forward and first backward per shape are checked against flash varlen on the same inputs; a
  disagreement (or a graph that cannot be built) warns and moves that shape to flash for good.
  Before any of them runs, the boundaries and max_seqlen are checked on the device and asserted
  asynchronously (no host sync; `_checked_lengths`). Other dtypes and head dims use a
  per-document math path in fp32 (fp64 for fp64).
- Windows: on CPU a document the window cuts runs in blocks of query rows, each over the keys its
  rows can see with an additive mask (memory rows x (rows + window), not lq x lk); a document it
  does not cut runs the windowless call. On CUDA windows run on cuDNN's diagonal band or flash's local-attention kernels
  (flex is windowless only), or the math path.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from .. import registry
from . import cudnn_kernel, flex_kernel
from .window import NO_WINDOW, bounds, check_window, doc_plan, flash_window, keep_mask

__all__ = ["varlen_fwd", "varlen_bwd", "varlen_attn", "cuda_kernel", "CUDA_KERNELS"]

_aten = torch.ops.aten


def _lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


# ------------------------------------------------------------------------------------------------
# CPU kernel: one flash-CPU call per document.


def _doc_bounds(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> list[tuple[int, int, int, int]]:
    """Per-document (q start, q end, k start, k end), with the checks the CUDA kernel cannot afford."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(
            f"cu_seqlens_q has {len(bq)} entries but cu_seqlens_k has {len(bk)}; they must match"
        )
    for name, b, total, bound in (("cu_seqlens_q", bq, t_q, max_q), ("cu_seqlens_k", bk, t_k, max_k)):
        if name == "cu_seqlens_q" and (b[0] != 0 or b[-1] != total):
            raise ValueError(f"{name} must run from 0 to the token count {total}, got {b[0]}..{b[-1]}")
        if b[0] < 0 or b[-1] > total:  # keys before cu_seqlens_k[0] or after its end are unused
            raise ValueError(f"{name} must stay within 0..{total} (the key count), got {b[0]}..{b[-1]}")
        for i in range(1, len(b)):
            if b[i] < b[i - 1]:
                raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {b[i]} < {b[i - 1]}")
            if b[i] - b[i - 1] > bound:
                raise ValueError(
                    f"document {i - 1} has {b[i] - b[i - 1]} tokens in {name}, more than its max_seqlen={bound}"
                )
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


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
_WINDOW_ROWS = 512


def _window_blocks(lq: int, lk: int, left: int, right: int) -> list[tuple[range, range]]:
    """(query rows, keys) of each kernel call of a windowed document: rows in blocks of
    `_WINDOW_ROWS`, keys cut to the span the block's rows can see; blocks that see no key are
    left out (their rows keep out = 0, lse = -inf)."""
    blocks = []
    for r0 in range(0, lq, _WINDOW_ROWS):
        r1 = min(lq, r0 + _WINDOW_ROWS)
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


def _cpu_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if q.shape[-1] != v.shape[-1]:
        # The CPU flash kernel takes one head size for Q, K and V. Zero columns change no score
        # (q.k gains zero products; the scale is explicit) and add zero output columns, so pad the
        # narrower side to the wider and cut the output back (issue 17: `v_TGKv` is documented).
        d = max(q.shape[-1], v.shape[-1])
        args = (cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        out, lse = _cpu_fwd(_pad_head_dim(q, d), _pad_head_dim(k, d), _pad_head_dim(v, d), *args)
        return out[..., : v.shape[-1]], lse
    t_q, h, _ = q.shape
    out = q.new_zeros(t_q, h, v.shape[-1])
    lse = torch.full((h, t_q), float("-inf"), dtype=_lse_dtype(q.dtype), device=q.device)
    for sq, eq, sk, ek in _doc_bounds(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
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
        if mask is not None and lq > lk:
            lse[:, sq : sq + lq - lk] = float("-inf")  # rows that see no key (the kernel says 0)
    return out, lse


def _cpu_window_bwd(dq, dk, dv, dout, q, k, v, out, lse, sq, sk, lq, lk, left, right, scale):
    blocks = _window_blocks(lq, lk, left, right)
    # Keys seen by several row blocks sum their blocks' gradients (in block order, in the lse
    # dtype); a document of one block writes them directly.
    acc = None
    if len(blocks) > 1:
        acc = [torch.zeros((lk, *x.shape[1:]), dtype=_lse_dtype(x.dtype)) for x in (k, v)]
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


def _cpu_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if q.shape[-1] != v.shape[-1]:  # as in `_cpu_fwd`: zero columns, gradients cut back
        d, kq, kv = max(q.shape[-1], v.shape[-1]), q.shape[-1], v.shape[-1]
        args = (cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        padded = (_pad_head_dim(x, d) for x in (dout, q, k, v, out))
        dq, dk, dv = _cpu_bwd(*padded, lse, *args)
        return dq[..., :kq], dk[..., :kq], dv[..., :kv]
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, eq, sk, ek in _doc_bounds(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k):
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


# ------------------------------------------------------------------------------------------------
# Math path: any device and dtype (CUDA fp32/fp64, head dims flash does not take).


def _math_doc_scores(q_d, k_d, lq, lk, is_causal, scale, acc, left, right):
    """Masked scores `s_HQK` of one document, in `acc`."""
    h, g = q_d.shape[1], k_d.shape[1]
    k_rep = k_d.to(acc).repeat_interleave(h // g, dim=1)
    s_HQK = torch.einsum("qhd,khd->hqk", q_d.to(acc), k_rep) * scale
    if (left, right) != NO_WINDOW:
        w_left, w_right = bounds((left, right), is_causal)
        keep = keep_mask(range(lq), lq, lk, range(lk), w_left, w_right, q_d.device)
        s_HQK = s_HQK.masked_fill(~keep, float("-inf"))
    elif is_causal:
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q_d.device).tril(lk - lq)
        s_HQK = s_HQK.masked_fill(~keep, float("-inf"))
    return s_HQK


def _probs(s_HQK: Tensor, lse_HQ: Tensor) -> Tensor:
    # Rows that see no key (lse -inf) get p = 0, as do rows whose lse is +inf (a CP caller's
    # rows that must not contribute).
    return torch.exp(s_HQK - lse_HQ.masked_fill(lse_HQ == float("-inf"), 0.0).unsqueeze(-1))


def _math_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    t_q, h, _ = q.shape
    acc = _lse_dtype(q.dtype)
    out = q.new_zeros(t_q, h, v.shape[-1])
    lse = torch.full((h, t_q), float("-inf"), dtype=acc, device=q.device)
    g = k.shape[1]
    for sq, eq, sk, ek in _doc_bounds(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
        lq, lk = eq - sq, ek - sk
        if lq == 0 or lk == 0:
            continue
        s_HQK = _math_doc_scores(q[sq:eq], k[sk:ek], lq, lk, is_causal, scale, acc, left, right)
        lse_HQ = torch.logsumexp(s_HQK, dim=-1)
        p_HQK = _probs(s_HQK, lse_HQ)
        v_rep = v[sk:ek].to(acc).repeat_interleave(h // g, dim=1)
        out[sq:eq] = torch.einsum("hqk,khd->qhd", p_HQK, v_rep).to(q.dtype)
        lse[:, sq:eq] = lse_HQ
    return out, lse


def _math_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    t_q, h, _ = q.shape
    g = k.shape[1]
    acc = _lse_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, eq, sk, ek in _doc_bounds(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
        lq, lk = eq - sq, ek - sk
        if lq == 0 or lk == 0:
            continue
        s_HQK = _math_doc_scores(q[sq:eq], k[sk:ek], lq, lk, is_causal, scale, acc, left, right)
        # The given lse, not this document's own: ring attention passes the lse of the whole row,
        # merged over key chunks (for a plain call the two are the same bits).
        p_HQK = _probs(s_HQK, lse[:, sq:eq].to(acc))
        do_ = dout[sq:eq].to(acc)
        v_rep = v[sk:ek].to(acc).repeat_interleave(h // g, dim=1)
        k_rep = k[sk:ek].to(acc).repeat_interleave(h // g, dim=1)
        dv_rep = torch.einsum("hqk,qhd->khd", p_HQK, do_)
        dp_HQK = torch.einsum("qhd,khd->hqk", do_, v_rep)
        d_HQ = (do_ * out[sq:eq].to(acc)).sum(-1).transpose(0, 1)
        ds_HQK = p_HQK * (dp_HQK - d_HQ.unsqueeze(-1)) * scale
        dq[sq:eq] = torch.einsum("hqk,khd->qhd", ds_HQK, k_rep).to(q.dtype)
        dk_rep = torch.einsum("hqk,qhd->khd", ds_HQK, q[sq:eq].to(acc))
        dk[sk:ek] = dk_rep.unflatten(1, (g, h // g)).sum(2).to(k.dtype)
        dv[sk:ek] = dv_rep.unflatten(1, (g, h // g)).sum(2).to(v.dtype)
    return dq, dk, dv


# ------------------------------------------------------------------------------------------------
# CUDA kernels: torch's flash varlen, flex_attention, cuDNN's ragged attention.


def _flash_ok(q: Tensor, v: Tensor) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


CUDA_KERNELS = ("auto", "flash", "flex", "cudnn")
_ENV = "USP_CUDA_ATTENTION"


def _kernel_setting(value: str, where: str) -> str:
    if value not in CUDA_KERNELS:
        raise ValueError(f"{where} must be one of {', '.join(CUDA_KERNELS)}, got {value!r}")
    return value


_cuda_kernel = _kernel_setting(os.environ.get(_ENV, "auto"), _ENV)


@contextlib.contextmanager
def cuda_kernel(name: str) -> Iterator[None]:
    """Run CUDA varlen attention with kernel `name` inside the block: ``"flash"`` (flash varlen),
    ``"flex"`` (flex_attention with a document block mask, where it applies: self-attention in
    fp16/bf16; flash elsewhere), ``"cudnn"`` (cuDNN's ragged attention through the optional
    ``nvidia-cudnn-frontend`` package, where it applies: fp16/bf16 with K == Kv; flash elsewhere
    or without the package) or ``"auto"`` (the measured per-shape choice; the default). The
    process-wide default comes from ``USP_CUDA_ATTENTION``. Outputs agree within rounding across
    kernels; pick one for a run whose bits must match another run's."""
    global _cuda_kernel
    before, _cuda_kernel = _cuda_kernel, _kernel_setting(name, "cuda_kernel")
    try:
        yield
    finally:
        _cuda_kernel = before


def _same_boundaries(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor) -> bool:
    """Self-attention: queries and keys share one boundary tensor (the same memory, so the same
    values, known without a sync) and one token count; cu_q runs 0..T, so every key is in use."""
    return q.shape[0] == k.shape[0] and cu_q.shape == cu_k.shape and cu_q.data_ptr() == cu_k.data_ptr()


def _flex_applies(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> bool:
    """Self-attention flex can run: shared boundaries, fp16/bf16, K == Kv a power of 2, and a
    token count that is a whole number of flex blocks (a ragged last block is not taken)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and q.shape[0] > 0
        and q.shape[0] % flex_kernel.BLOCK_SIZE == 0
        and _same_boundaries(q, k, cu_q, cu_k)
    )


def _cudnn_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """cuDNN's ragged kernel can run: the package is installed, fp16/bf16, K == Kv, K % 8 == 0 and
    K <= 128 (a shape whose graph still fails to build runs flash, `_kernel_failed`)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and d % 8 == 0
        and d <= 128
        and q.shape[0] > 0
        and k.shape[0] > 0
        and cudnn_kernel.available()
    )


# The measured choice (tools/bench_cudnn_gpu.py and tools/bench_varlen_gpu.py on the H200,
# BENCHMARKS.md): rows (kernel, least token count, head dims) in order, the first whose kernel
# applies to the call wins; flash varlen where none does. Shapes and settings only, never boundary
# values. Through usp's op, cuDNN ran 1.4-1.7x flash varlen for fwd+bwd at 32K-256K tokens (head
# dims 64 and 128, MHA and GQA 16/4, causal and not) and at 16K with head dim 128; below that the
# op's host-side cost decides (4K: flash 1.6 ms, cuDNN 2.4 ms per fwd+bwd; 16K with head dim 64:
# flash ahead). flex measured faster than flash at T >= 16K with head dim 128, and runs there when
# the cuDNN package is absent.
FLEX_MIN_TOKENS = 16384
FLEX_HEAD_DIMS = (128,)
AUTO_TABLE: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("cudnn", 16384, (128,)),
    ("cudnn", 32768, (64,)),
    ("flex", FLEX_MIN_TOKENS, FLEX_HEAD_DIMS),
)


def _auto_kernels(q: Tensor) -> list[str]:
    """The measured table's kernels for this shape (token count, head dim), best first."""
    rows = [name for name, tokens, dims in AUTO_TABLE if q.shape[0] >= tokens and q.shape[-1] in dims]
    return [n for n in rows if n != "cudnn" or cudnn_kernel.available()] + ["flash"]


def _auto_kernel(q: Tensor) -> str:
    """The kernel measured fastest for this shape (token count, head dim), among those installed."""
    return _auto_kernels(q)[0]


# Shapes whose flex graphs failed to build: flash varlen runs them (warned once per shape).
_flex_broken: set[tuple[object, ...]] = set()
# Likewise for cuDNN (keyed by the forward graph's key, or the backward's for a backward failure).
_cudnn_broken: set[object] = set()
_cudnn_warned_missing = False


def _use_flex(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, is_causal: bool, scale: float
) -> bool:
    if _cuda_kernel in ("flash", "cudnn") or not _flex_applies(q, k, v, cu_q, cu_k):
        return False
    if flex_kernel.plan_key(q, k, v, is_causal, scale) in _flex_broken:
        return False
    return _cuda_kernel == "flex" or _auto_kernel(q) == "flex"


def _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right):
    square = _same_boundaries(q, k, cu_q, cu_k)
    fwd = cudnn_kernel.plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, (left, right), square=square)
    bwd = cudnn_kernel.plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, (left, right), square=square,
                                backward=True, deterministic=torch.are_deterministic_algorithms_enabled())  # fmt: skip
    return square, fwd, bwd


def _use_cudnn(q: Tensor, k: Tensor, v: Tensor, keys: tuple[object, ...]) -> bool:
    """cuDNN for this call: asked for (or auto's first choice), applicable, and neither of this
    shape's graphs failed to build or disagreed with flash."""
    global _cudnn_warned_missing
    if _cuda_kernel in ("flash", "flex"):
        return False
    if _cuda_kernel == "cudnn" and not cudnn_kernel.available() and not _cudnn_warned_missing:
        _cudnn_warned_missing = True
        warnings.warn(
            "usp_graph: USP_CUDA_ATTENTION / cuda_kernel asks for cudnn, but the cuDNN frontend is not "
            "installed (pip install 'usp_graph[cuda]', i.e. nvidia-cudnn-frontend); flash varlen runs instead",
            RuntimeWarning,
            stacklevel=4,
        )
    if not _cudnn_applies(q, k, v) or any(key in _cudnn_broken for key in keys):
        return False
    return _cuda_kernel == "cudnn" or _auto_kernels(q)[0] == "cudnn"


def _kernel_failed(kernel: str, broken: set, key: object, reason: object) -> None:
    broken.add(key)
    warnings.warn(
        f"usp_graph: {reason}; flash varlen runs this shape instead",
        RuntimeWarning,
        stacklevel=4,
    )


def _flex_failed(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, reason: object) -> None:
    _kernel_failed("flex", _flex_broken, flex_kernel.plan_key(q, k, v, is_causal, scale), reason)


# Each fast kernel's first forward and first backward of each shape are checked against flash
# varlen on the same inputs (one sync, an extra output's memory, once per shape): a kernel that is
# wrong for a shape (torch 2.11's compiled flex backward was, for a ragged last block) then costs a
# warning and flash for that shape, never a wrong gradient, on whatever version runs it.
# bf16/fp16 flex, cuDNN and flash each agree with fp32 to ~3e-3; a broken kernel was off by ~70.
FLEX_CHECK_TOL = 2e-2
CHECK_TOL = FLEX_CHECK_TOL
_flex_checked: set[tuple[object, ...]] = set()
_cudnn_checked: set[tuple[object, ...]] = set()


def _disagreement(names: tuple[str, ...], got: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> str | None:
    """None if every `got` matches its `ref` (the same infinities, finite entries within
    CHECK_TOL relative norm), else what differs."""
    errs = []
    for a, b in zip(got, ref, strict=True):
        a, b = a.float(), b.float()
        finite = torch.isfinite(b)
        # NaN anywhere, or an infinity where the other has none or another one: no match
        other_inf = (torch.isfinite(a) != finite) | (~finite & (a != b))
        diff = torch.where(finite, a - b, 0).norm() / torch.where(finite, b, 0).norm().clamp_min(1e-30)
        errs.append(torch.where(other_inf.any(), math.inf, diff))
    values = torch.stack(errs).tolist()  # the one sync
    bad = [f"{n} rel err {e:.1e}" for n, e in zip(names, values, strict=True) if not e <= CHECK_TOL]
    return ", ".join(bad) if bad else None


def _checked_or_flash(
    kernel: str, kind: str, names: tuple[str, ...], got: tuple[Tensor, ...], flash: Any, key: object,
    checked: set, broken: set, broken_key: object,
) -> tuple[Tensor, ...]:  # fmt: skip
    """`got` (`kernel`'s result) if this shape's `kind` kernel was checked already or agrees with
    `flash()` now; otherwise flash's result, with the shape moved to flash from then on."""
    if (kind, key) in checked:
        return got
    ref = flash()
    bad = _disagreement(names, got, ref)
    if bad is None:
        checked.add((kind, key))
        return got
    _kernel_failed(
        kernel,
        broken,
        broken_key,
        f"the {kernel} {kind} kernel for {key} disagrees with flash varlen ({bad})",
    )
    return ref


def _flex_checked_or_flash(
    kind: str, names: tuple[str, ...], got: tuple[Tensor, ...], flash: Any, q: Tensor, k: Tensor, v: Tensor,
    is_causal: bool, scale: float,
) -> tuple[Tensor, ...]:  # fmt: skip
    key = flex_kernel.plan_key(q, k, v, is_causal, scale)
    return _checked_or_flash("flex", kind, names, got, flash, key, _flex_checked, _flex_broken, key)


# ------------------------------------------------------------------------------------------------
# Kernel preconditions on the device (issue 17): a max_seqlen below the longest document, or
# boundaries outside the tensors, would make flash and cuDNN compute a silently wrong result (flash
# bf16 was off by 4.66 at T=512, documents [300, 212], max_seqlen=64). Reading the boundaries on the
# host would sync every call; instead a few tiny kernels compute the verdict and an asynchronous
# assertion stops the process (a device-side assert) when it is false.


def _boundaries_ok(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(ok, lengths_q, lengths_k): `ok` a 0-d bool tensor on the boundaries' device, true iff cu_q
    runs 0..t_q, cu_k stays in 0..t_k, both are non-decreasing, and no document is longer than its
    max_seqlen; the per-slot lengths (int32 `(N,)`) as a by-product the cuDNN kernel reuses."""
    if cu_q is cu_k:  # one boundary tensor (self-attention)
        lens = torch.diff(cu_q)
        ends = torch.stack((cu_q[0], cu_q[-1] - t_q))
        lo, hi = torch.aminmax(lens)
        return (ends == 0).all() & (lo >= 0) & (hi <= min(max_q, max_k)), lens, lens
    lens = torch.diff(torch.stack((cu_q, cu_k)), dim=1)
    lo, hi = torch.aminmax(lens, dim=1)
    # cu_q[0] == 0, cu_q[-1] == t_q, cu_k[0] >= 0, cu_k[-1] <= t_k, lengths in 0..max, in one tensor
    viol = torch.stack((cu_q[0].abs(), (cu_q[-1] - t_q).abs(), -cu_k[0], cu_k[-1] - t_k, -lo[0], -lo[1], hi[0] - max_q, hi[1] - max_k))  # fmt: skip
    return (viol <= 0).all(), lens[0], lens[1]


def _assert_boundaries(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> tuple[Tensor, Tensor]:
    """Assert `_boundaries_ok` without a host sync; returns the per-slot lengths as `(N, 1, 1, 1)`."""
    ok, lens_q, lens_k = _boundaries_ok(cu_q, cu_k, t_q, t_k, max_q, max_k)
    if ok.device.type == "cuda":
        torch._assert_async(ok)  # no host sync; a failure is a device-side assert at the next sync
    else:
        torch._assert_async(
            ok,
            f"usp::varlen: cu_seqlens must run 0..{t_q} (queries) / within 0..{t_k} (keys), non-decreasing, "
            f"with no document longer than max_seqlen_q={max_q} / max_seqlen_k={max_k}",
        )
    return lens_q.view(-1, 1, 1, 1), lens_k.view(-1, 1, 1, 1)


# The checks and what the cuDNN kernel derives from the boundaries are the same for every layer of a
# step (one boundary tensor, forward and backward): computed once per boundary tensor object and
# version. A hit needs the very same tensor objects (weak references, so a new tensor at a reused
# address misses) at the same version (an in-place write misses); inference tensors, which track
# no version, and calls during CUDA graph capture (whose kernels must be in the graph) never hit.
_BOUNDARY_CACHE_SIZE = 64
_boundary_cache: dict[tuple[object, ...], tuple[Any, Any, tuple[int, int], object]] = {}


def _per_boundaries(name: str, cu_q: Tensor, cu_k: Tensor, settings: tuple[object, ...], compute: Any) -> Any:
    """`compute()`, or what it returned for these boundary tensors (same objects, same versions)
    and `settings` before."""
    try:
        versions = (cu_q._version, cu_k._version)
    except RuntimeError:  # an inference tensor
        return compute()
    if cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return compute()
    key = (name, id(cu_q), id(cu_k), *settings)
    hit = _boundary_cache.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k and hit[2] == versions:
        return hit[3]
    value = compute()
    if len(_boundary_cache) >= _BOUNDARY_CACHE_SIZE:
        for k in [k for k, e in _boundary_cache.items() if e[0]() is None or e[1]() is None]:
            del _boundary_cache[k]
        if len(_boundary_cache) >= _BOUNDARY_CACHE_SIZE:
            _boundary_cache.clear()
    _boundary_cache[key] = (weakref.ref(cu_q), weakref.ref(cu_k), versions, value)
    return value


def _checked_lengths(cu_q, cu_k, t_q, t_k, max_q, max_k):
    return _per_boundaries(
        "check", cu_q, cu_k, (t_q, t_k, max_q, max_k),
        lambda: _assert_boundaries(cu_q, cu_k, t_q, t_k, max_q, max_k),
    )  # fmt: skip


def _cudnn_offsets(cu_q, cu_k, q, k):
    h, g, d = q.shape[1], k.shape[1], q.shape[2]
    return _per_boundaries(
        "offsets", cu_q, cu_k, (h, g, d), lambda: cudnn_kernel.ragged_offsets(cu_q, cu_k, h, g, d)
    )


def _cuda_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if not _flash_ok(q, v):
        return _math_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
    if cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape:
        cu_k = cu_q  # one tensor: one check
    lengths = _checked_lengths(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)

    def flash() -> tuple[Tensor, Tensor]:
        return _flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)

    if _cuda_kernel == "cudnn" or (_cuda_kernel == "auto" and _auto_kernels(q)[0] == "cudnn"):
        square, key, bkey = _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        if _use_cudnn(q, k, v, (key, bkey)):
            try:
                got = cudnn_kernel.cudnn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, (left, right),
                                             square=square, lengths=lengths, key=key,
                                             offsets=_cudnn_offsets(cu_q, cu_k, q, k))  # fmt: skip
            except cudnn_kernel.BuildError as exc:
                _kernel_failed("cudnn", _cudnn_broken, key, exc)
            else:
                return _checked_or_flash("cudnn", "forward", ("out", "lse"), got, flash, key, _cudnn_checked,
                                         _cudnn_broken, key)  # fmt: skip
    # A window runs on flash (or cuDNN): its local-attention kernels take (left, right) as they are,
    # and the flex path's block masks know documents only.
    if (left, right) == NO_WINDOW and _use_flex(q, k, v, cu_q, cu_k, is_causal, scale):
        try:
            got = flex_kernel.flex_fwd(q, k, v, cu_q, is_causal, scale)
        except flex_kernel.BuildError as exc:
            _flex_failed(q, k, v, is_causal, scale, exc)
        else:
            return _flex_checked_or_flash("forward", ("out", "lse"), got, flash, q, k, v, is_causal, scale)
    return flash()


def _cuda_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if not _flash_ok(q, v):
        return _math_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
    if cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape:
        cu_k = cu_q
    lengths = _checked_lengths(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)

    def flash() -> tuple[Tensor, Tensor, Tensor]:
        return _flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)

    if _cuda_kernel == "cudnn" or (_cuda_kernel == "auto" and _auto_kernels(q)[0] == "cudnn"):
        square, key, bkey = _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        if _use_cudnn(q, k, v, (key, bkey)):
            try:
                got = cudnn_kernel.cudnn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale,
                                             (left, right), square=square, lengths=lengths, key=bkey,
                                             offsets=_cudnn_offsets(cu_q, cu_k, q, k))  # fmt: skip
            except cudnn_kernel.BuildError as exc:
                _kernel_failed("cudnn", _cudnn_broken, bkey, exc)
            else:
                return _checked_or_flash("cudnn", "backward", ("dq", "dk", "dv"), got, flash, bkey, _cudnn_checked,
                                         _cudnn_broken, bkey)  # fmt: skip
    if (left, right) == NO_WINDOW and _use_flex(q, k, v, cu_q, cu_k, is_causal, scale):
        try:
            got = flex_kernel.flex_bwd(dout, q, k, v, out, lse, cu_q, is_causal, scale)
        except flex_kernel.BuildError as exc:
            _flex_failed(q, k, v, is_causal, scale, exc)
        else:
            return _flex_checked_or_flash(
                "backward", ("dq", "dk", "dv"), got, flash, q, k, v, is_causal, scale
            )
    return flash()


def _flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    max_k, win = flash_window(max_q, max_k, is_causal, left, right)  # no window: max_k, {}
    out, lse, *_ = _aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, scale=scale, **win
    )
    # flash marks rows that see no key with lse = +inf; the contract says -inf (log of an empty sum).
    return out, lse.masked_fill(lse == float("inf"), float("-inf"))


def _flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    max_k, win = flash_window(max_q, max_k, is_causal, left, right)  # no window: max_k, {}
    rng_state = torch.zeros(2, dtype=torch.uint64, device=q.device)  # dropout is always 0
    unused = torch.empty(0, device=q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse.masked_fill(lse == float("-inf"), float("inf")),
        cu_q,
        cu_k,
        max_q,
        max_k,
        0.0,
        is_causal,
        rng_state,
        unused,
        scale=scale,
        **win,
    )
    if _same_boundaries(q, k, cu_q, cu_k):
        return dq, dk, dv  # self-attention: every key lies in a document
    # Keys outside every document (before cu_k[0], after cu_k[-1]) are never attended; the kernel
    # leaves their gradient unwritten, the contract says zero. No host sync: a mask on the device.
    pos = torch.arange(k.shape[0], device=k.device)
    used = ((pos >= cu_k[0]) & (pos < cu_k[-1])).view(-1, 1, 1)
    return dq, torch.where(used, dk, 0), torch.where(used, dv, 0)


# ------------------------------------------------------------------------------------------------
# The ops.


@torch.library.custom_op("usp::varlen_fwd", mutates_args=())
def varlen_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """Packed-document attention forward: `(out_THKv, lse_HT)`. See the module docstring.

    `window_left/right`: flash-attention's sliding window (`usp_graph.ops.window`), -1 unbounded;
    appended with defaults, so graphs saved before they existed still load and replay.
    Outputs are contiguous whatever the inputs' strides (the flash kernel would hand back q's
    layout): the fake impl promises that, and a compiler checks it."""
    args = (q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale)
    # The op checks what the wrapper checks: a graph file calls it directly.
    check_window((window_left, window_right), "usp::varlen_fwd window (window_left, window_right)")
    if (window_left, window_right) != NO_WINDOW:
        args += (window_left, window_right)
    if q.device.type == "cpu":
        out, lse = _cpu_fwd(*args)
    elif q.device.type == "cuda":
        out, lse = _cuda_fwd(*args)
    else:
        out, lse = _math_fwd(*args)
    return out.contiguous(), lse.contiguous()


@varlen_fwd.register_fake
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale, window_left=-1,
      window_right=-1):  # fmt: skip
    t_q, h, _ = q.shape
    return q.new_empty(t_q, h, v.shape[-1]), q.new_empty(h, t_q, dtype=_lse_dtype(q.dtype))


@torch.library.custom_op("usp::varlen_bwd", mutates_args=())
def varlen_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    is_causal: bool,
    scale: float,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Packed-document attention backward: `(dq, dk, dv)` given the forward's `out` and `lse`;
    contiguous, like the forward's outputs. `lse` may hold +inf for rows that must add nothing."""
    args = (
        grad_out,
        q,
        k,
        v,
        out,
        lse,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        is_causal,
        scale,
    )
    check_window((window_left, window_right), "usp::varlen_bwd window (window_left, window_right)")
    if (window_left, window_right) != NO_WINDOW:
        args += (window_left, window_right)
    if q.device.type == "cpu":
        grads = _cpu_bwd(*args)
    elif q.device.type == "cuda":
        grads = _cuda_bwd(*args)
    else:
        grads = _math_bwd(*args)
    return tuple(g.contiguous() for g in grads)


@varlen_bwd.register_fake
def _(grad_out, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, scale,
      window_left=-1, window_right=-1):  # fmt: skip
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ------------------------------------------------------------------------------------------------
# Backward rule.


def _window_args(left: int, right: int) -> tuple[int, ...]:
    """The trailing window arguments of a varlen op call: none for no window, so windowless calls
    (and the graphs traced from them) are exactly what they were before windows existed."""
    return () if (left, right) == NO_WINDOW else (left, right)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, *win = inputs  # defaults filled in
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.max_q, ctx.max_k, ctx.is_causal, ctx.scale = max_q, max_k, is_causal, scale
    ctx.window = _window_args(*win) if win else ()
    # An unused lse (the common case) then arrives as None and costs nothing in backward.
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    meta = (cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.is_causal, ctx.scale, *ctx.window)
    if grad_out is None:
        dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    else:
        dq, dk, dv = torch.ops.usp.varlen_bwd(grad_out, q, k, v, out, lse, *meta)
    if grad_lse is not None:
        # d lse_i / d s_ij = p_ij, so the lse term adds scale * dlse_i * sum_j p_ij k_j to dq_i (an
        # attention output with values k) and scale * sum_i p_ij dlse_i q_i to dk_j (the dv of a
        # backward whose output gradient is dlse * q). Both reuse the same kernels.
        w_TH1 = grad_lse.transpose(0, 1).unsqueeze(-1)
        pk, lse_k = torch.ops.usp.varlen_fwd(q, k, k, *meta)
        dq = dq + (ctx.scale * w_TH1 * pk).to(dq.dtype)
        _, _, pt_wq = torch.ops.usp.varlen_bwd((w_TH1 * q).to(q.dtype), q, k, k, pk, lse_k, *meta)
        dk = dk + (ctx.scale * pt_wq).to(dk.dtype)
    return dq, dk, dv, None, None, None, None, None, None, None, None


registry.register_rule(
    varlen_fwd,
    kind="attention",
    setup_context=_setup_context,
    backward=_backward,
    backward_ops=(varlen_bwd,),
    doc="varlen_bwd on the saved out/lse; an lse gradient adds terms computed by varlen_fwd/varlen_bwd",
)


# ------------------------------------------------------------------------------------------------
# Public wrapper.


def _check_max(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


def varlen_attn(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    window: tuple[int, int] | None = None,
) -> Tensor | tuple[Tensor, Tensor]:
    """Attention within documents of packed `(T, H, K)` tensors.

    q_THK, k_TGK, v_TGKv; `cu_seqlens_q/k` int32 `(N + 1,)` document boundaries (unused tail slots
    repeat the total); `max_seqlen_q/k` upper bounds on document lengths. Causal is bottom-right
    aligned within each document. With `enable_gqa`, G may divide H. Returns `out_THKv`, and
    `lse_HT` when `return_lse` (differentiable too).

    `window=(left, right)`: sliding-window attention exactly as flash-attention's `window_size`:
    within a document, query r (at key position d = r + lk - lq) attends key c iff
    ``d - left <= c <= d + right``; -1 leaves a side unbounded. With `is_causal`, right is 0.
    None or (-1, -1): no window (the windowless kernels, bit for bit).
    """
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if torch.is_autocast_enabled(q.device.type) and q.is_floating_point():
        # Custom ops get no autocast rule of their own; follow SDPA's (run in the autocast dtype).
        dtype = torch.get_autocast_dtype(q.device.type)
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 3:
            raise ValueError(f"{name} must be packed (T, H, K), got shape {tuple(t.shape)}")
        if t.dtype != q.dtype or t.device != q.device:
            raise ValueError(
                f"q, k, v must share dtype and device; {name} is {t.dtype} on {t.device}, q is {q.dtype} on {q.device}"
            )
    if not q.is_floating_point():
        raise ValueError(f"q, k, v must be floating point, got {q.dtype}")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(
            f"k and v must have the same tokens and heads, got {tuple(k.shape)} and {tuple(v.shape)}"
        )
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head dim, got {q.shape[-1]} and {k.shape[-1]}")
    h, g = q.shape[1], k.shape[1]
    if h == 0 or g == 0:
        raise ValueError(f"q and k/v need at least one head, got q {tuple(q.shape)} and k {tuple(k.shape)}")
    if q.shape[-1] == 0:
        raise ValueError(f"head dim must be positive, got q of shape {tuple(q.shape)}")
    if h != g:
        if not enable_gqa:
            raise ValueError(
                f"q has {h} heads but k/v have {g}; pass enable_gqa=True for grouped-query attention"
            )
        if g == 0 or h % g:
            raise ValueError(f"enable_gqa needs q heads ({h}) divisible by k/v heads ({g})")
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        if not isinstance(cu, Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() < 2:
            desc = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, Tensor) else type(cu).__name__
            raise ValueError(f"{name} must be a 1-D int32 tensor with >= 2 entries, got {desc}")
        if cu.device != q.device:
            raise ValueError(f"{name} is on {cu.device} but q is on {q.device}; move it with .to(q.device)")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q {tuple(cu_seqlens_q.shape)} and cu_seqlens_k {tuple(cu_seqlens_k.shape)} must have the same length"
        )
    _check_max("max_seqlen_q", max_seqlen_q)
    _check_max("max_seqlen_k", max_seqlen_k)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None, got {type(scale).__name__}")
    if not isinstance(is_causal, bool):
        raise TypeError(f"is_causal must be a bool, got {type(is_causal).__name__}")
    win = _window_args(*check_window(window))
    out, lse = torch.ops.usp.varlen_fwd(
        q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, is_causal, float(scale), *win
    )
    return (out, lse) if return_lse else out
