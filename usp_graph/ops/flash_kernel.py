"""torch's flash varlen as the kernel of ``usp::varlen_fwd`` / ``usp::varlen_bwd`` on CUDA.

# T packed tokens, H query heads, G key/value heads, K head dim, Kv value head dim

``aten._flash_attention_forward/backward`` in their varlen form (the kernel behind
``torch.nn.attention.varlen.varlen_attn``; GQA native) for fp16/bf16 with K == Kv, K % 8 == 0 and
K <= 256 (`flash_ok`). Windows run on its local-attention kernels (`window.flash_window`). The
fallback of every other CUDA kernel (`kernel_choice`), and the reference their first calls are
checked against.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .boundaries import same_boundaries
from .window import flash_window

__all__ = ["flash_ok", "flash_fwd", "flash_bwd"]

_aten = torch.ops.aten
_INF, _NAN = float("inf"), float("nan")
# dropout is always 0: the backward's RNG state is never read; one per device, not a launch per call
_NO_RNG: dict[torch.device, tuple[Tensor, Tensor]] = {}


def lse_out(lse: Tensor) -> Tensor:
    """flash marks rows that see no key with lse = +inf; the contract says -inf (log of an empty
    sum). One kernel (a short call's launches are host time); NaN stays NaN, finite values exact."""
    return lse.nan_to_num(nan=_NAN, posinf=-_INF, neginf=-_INF)


def lse_in(lse: Tensor) -> Tensor:
    """The contract's lse as flash's backward reads it: -inf (no key) back to +inf."""
    return lse.nan_to_num(nan=_NAN, posinf=_INF, neginf=_INF)


def flash_ok(q: Tensor, v: Tensor) -> bool:
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and q.shape[-1] == v.shape[-1]
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 256
    )


def flash_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    max_k, win = flash_window(max_q, max_k, is_causal, left, right)  # no window: max_k, {}
    out, lse, *_ = _aten._flash_attention_forward(
        q, k, v, cu_q, cu_k, max_q, max_k, 0.0, is_causal, False, scale=scale, **win
    )
    return out, lse_out(lse)


def _no_rng(device: torch.device) -> tuple[Tensor, Tensor]:
    hit = _NO_RNG.get(device)
    if hit is None:
        hit = (torch.zeros(2, dtype=torch.uint64, device=device), torch.empty(0, device=device))
        if not torch.cuda.is_current_stream_capturing():  # never keep a CUDA graph's pool memory
            _NO_RNG[device] = hit
    return hit


def flash_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    max_k, win = flash_window(max_q, max_k, is_causal, left, right)  # no window: max_k, {}
    rng_state, unused = _no_rng(q.device)
    dq, dk, dv = _aten._flash_attention_backward(
        dout.contiguous(),
        q,
        k,
        v,
        out,
        lse_in(lse),
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
    if same_boundaries(q, k, cu_q, cu_k):
        return dq, dk, dv  # self-attention: every key lies in a document
    # Keys outside every document (before cu_k[0], after cu_k[-1]) are never attended; the kernel
    # leaves their gradient unwritten, the contract says zero. No host sync: a mask on the device.
    pos = torch.arange(k.shape[0], device=k.device)
    used = ((pos >= cu_k[0]) & (pos < cu_k[-1])).view(-1, 1, 1)
    return dq, torch.where(used, dk, 0), torch.where(used, dv, 0)
