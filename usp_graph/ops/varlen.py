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

This module holds the ops, their backward rule and the `varlen_attn` wrapper. The kernels live
beside it, one module each: `cpu_kernel` (per document over the flash-CPU op; bitwise
deterministic), `math_kernel` (any device and dtype), and on CUDA `flash_kernel`, `cudnn_kernel`
and `flex_kernel`, of which `kernel_choice` picks one per shape (``USP_CUDA_ATTENTION``,
`cuda_kernel`, the measured `AUTO_TABLE`, each fast kernel's first call checked against flash).
`boundaries` checks cu_seqlens for all of them (on the host for CPU and math, on the device for
CUDA).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from .. import dynamo_marks, registry
from . import kernel_choice
from .boundaries import lse_dtype
from .cpu_kernel import cpu_bwd, cpu_fwd, group_sum
from .define import define
from .kernel_choice import AUTO_TABLE as AUTO_TABLE  # re-exported: tools and tests read them here
from .kernel_choice import CHECK_TOL as CHECK_TOL
from .kernel_choice import CUDA_KERNELS, cuda_bwd, cuda_fwd, cuda_kernel
from .kernel_choice import FLEX_CHECK_TOL as FLEX_CHECK_TOL
from .kernel_choice import FLEX_HEAD_DIMS as FLEX_HEAD_DIMS
from .kernel_choice import FLEX_MIN_TOKENS as FLEX_MIN_TOKENS
from .math_kernel import math_bwd, math_fwd
from .window import NO_WINDOW, check_window

__all__ = ["varlen_fwd", "varlen_bwd", "varlen_attn", "cuda_kernel", "CUDA_KERNELS"]

# The ops' kernel per device type: module globals, so a tool can wrap one to count its calls
# (tools/kernel_calls.py).
_cpu_fwd, _cpu_bwd = cpu_fwd, cpu_bwd
_cuda_fwd, _cuda_bwd = cuda_fwd, cuda_bwd
_math_fwd, _math_bwd = math_fwd, math_bwd
# Shapes moved to flash for good (the same set `kernel_choice` adds to; tools/check_cudnn_gpu.py reads it).
_cudnn_broken = kernel_choice._cudnn_broken


# ------------------------------------------------------------------------------------------------
# The ops.


@define("usp::varlen_fwd")
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
    return q.new_empty(t_q, h, v.shape[-1]), q.new_empty(h, t_q, dtype=lse_dtype(q.dtype))


@define("usp::varlen_bwd")
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
    g = k.shape[1]
    if grad_lse is not None and g != q.shape[1] and q.device.type == "cpu":
        # Grouped-query attention with an lse gradient: both terms per query head, each group
        # summed once at the end, as autograd sums for a model that repeats K/V itself (summing
        # the groups of each term first and then adding the terms would round differently). CPU
        # only: the CUDA kernels' own GQA sums differ from a repeat's anyway, and H heads of K/V
        # would cost GPU memory for no promise.
        k, v = (x.repeat_interleave(q.shape[1] // g, 1) for x in (k, v))
        dq, dk, dv = _terms(ctx, grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k)
        return dq, group_sum(dk, g), group_sum(dv, g), *(None,) * 8
    return *_terms(ctx, grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k), *(None,) * 8


def _terms(ctx, grad_out, grad_lse, q, k, v, out, lse, cu_q, cu_k):
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
    return dq, dk, dv


# The rules themselves (backward ops, adjoints) are rows of usp_graph.registry.TABLE.
registry.implement(varlen_fwd, setup_context=_setup_context, backward=_backward)


# ------------------------------------------------------------------------------------------------
# Public wrapper.


def _check_max(name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, torch.SymInt)):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if isinstance(value, int) and value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")


@dynamo_marks.assume_constant_result
def _has_autocast(device_type: str) -> bool:
    """`torch.amp.is_autocast_available`, a constant of a Dynamo trace: torch 2.11's Dynamo cannot
    trace the builtin it calls and broke the graph at every attention call of a compiled model."""
    return torch.amp.is_autocast_available(device_type)


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
    dev = q.device.type
    # Autocast exists for some device types only (not meta, where shapes are propagated).
    if _has_autocast(dev) and torch.is_autocast_enabled(dev) and q.is_floating_point():
        # Custom ops get no autocast rule of their own; follow SDPA's (run in the autocast dtype).
        dtype = torch.get_autocast_dtype(dev)
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
