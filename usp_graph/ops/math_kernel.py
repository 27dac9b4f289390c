"""The math kernel of ``usp::varlen_fwd`` / ``usp::varlen_bwd``: any device and dtype.

# T packed tokens, H query heads, G key/value heads, K head dim, Q / K (in names) a document's
# query / key rows

Per document in fp32 (fp64 for fp64 inputs): scores, logsumexp, probabilities, written out with
einsum. CUDA runs it for what flash does not take (fp32/fp64, head dims flash refuses); other
devices run it always. It honours the op's whole contract (windows, GQA, rows that see no key).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .boundaries import documents_of, lse_dtype
from .window import NO_WINDOW, bounds, keep_mask

__all__ = ["math_fwd", "math_bwd"]


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


def math_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    t_q, h, _ = q.shape
    acc = lse_dtype(q.dtype)
    out = q.new_zeros(t_q, h, v.shape[-1])
    lse = torch.full((h, t_q), float("-inf"), dtype=acc, device=q.device)
    g = k.shape[1]
    for sq, eq, sk, ek in documents_of(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
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


def math_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    t_q, h, _ = q.shape
    g = k.shape[1]
    acc = lse_dtype(q.dtype)
    dq, dk, dv = torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    for sq, eq, sk, ek in documents_of(cu_q, cu_k, t_q, k.shape[0], max_q, max_k):
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
