"""Independent references for tests and benchmarks: fp64 per-document attention, its dense mask,
document lengths, rel_err.

# T packed tokens, H query heads, G key/value heads (H % G == 0), K head dim, Kv value head dim,
# N documents, Q / S query / key rows of one document

Nothing here calls a usp op or an SDPA kernel: `attention_reference` is a loop over documents with
a plain matmul, a mask and a softmax in float64, so a bug shared by usp's kernels and its CP
strategies cannot hide in the reference. It follows the varlen contract (`usp_graph.ops.varlen`):
document i holds queries ``q[cu_q[i]:cu_q[i+1]]`` and keys ``k[cu_k[i]:cu_k[i+1]]``; causal is
bottom-right aligned (query r of a document with lq queries and lk keys sees keys
c <= r + lk - lq, the flash convention); the window ``(left, right)`` keeps key c iff
``d - left <= c <= d + right`` with ``d = r + lk - lq`` (-1: unbounded side); a row that sees no
key, and a row outside every document, gets out 0 and lse -inf.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor

__all__ = ["attention_reference", "document_mask", "lognormal_lengths", "cu_seqlens", "rel_err"]


def rel_err(x: Tensor, ref: Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; absolute when ref is exactly zero (e.g. dq of a length-1 document)."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)


def cu_seqlens(lengths: Sequence[int], *, device: torch.device | str | None = None) -> Tensor:
    """The int32 boundaries ``[0, l0, l0 + l1, ...]`` of documents with these lengths."""
    cu = [0]
    for n in lengths:
        if n < 0:
            raise ValueError(f"document lengths must be >= 0; got {list(lengths)}")
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=torch.int32, device=device)


def _keep_SQ(lq: int, lk: int, is_causal: bool, left: int, right: int) -> Tensor:
    """Boolean `(lq, lk)`: which keys each query row of one document attends."""
    d = torch.arange(lq).unsqueeze(1) + (lk - lq)
    c = torch.arange(lk).unsqueeze(0)
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if is_causal:
        keep &= c <= d
    if left >= 0:
        keep &= c >= d - left
    if right >= 0:
        keep &= c <= d + right
    return keep


def _boundaries(cu: Tensor | Sequence[int]) -> list[int]:
    return [int(x) for x in (cu.tolist() if isinstance(cu, Tensor) else cu)]


def _window(window: tuple[int, int] | None) -> tuple[int, int]:
    return (-1, -1) if window is None else (int(window[0]), int(window[1]))


def document_mask(
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    *,
    is_causal: bool = False,
    window: tuple[int, int] | None = None,
    total_q: int | None = None,
    total_k: int | None = None,
) -> Tensor:
    """Boolean ``(total_q, total_k)``: which keys each packed query attends under the varlen
    contract, the mask of one dense SDPA over the whole pack that `attention_reference` equals.

    Block-diagonal over documents, bottom-right causal and windowed inside each (the same per-document
    rule as `attention_reference`); rows and columns outside every document are all False. `total_q`
    / `total_k` default to the last boundary of `cu_seqlens_q` / `cu_seqlens_k` (which defaults to
    `cu_seqlens_q`)."""
    cu_q = _boundaries(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _boundaries(cu_seqlens_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k need the same length; got {len(cu_q)} and {len(cu_k)}"
        )
    left, right = _window(window)
    keep_TS = torch.zeros(cu_q[-1] if total_q is None else total_q, cu_k[-1] if total_k is None else total_k,
                          dtype=torch.bool)  # fmt: skip
    for i in range(len(cu_q) - 1):
        sq, eq, sk, ek = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        keep_TS[sq:eq, sk:ek] = _keep_SQ(eq - sq, ek - sk, is_causal, left, right)
    return keep_TS


def attention_reference(
    q_THK: Tensor,
    k_TGK: Tensor,
    v_TGKv: Tensor,
    cu_seqlens_q: Tensor | Sequence[int],
    cu_seqlens_k: Tensor | Sequence[int] | None = None,
    *,
    is_causal: bool = False,
    scale: float | None = None,
    window: tuple[int, int] | None = None,
) -> tuple[Tensor, Tensor]:
    """(out_THKv, lse_HT) of varlen attention on packed documents, in float64.

    `cu_seqlens_k` defaults to `cu_seqlens_q` (self-attention). GQA: query head h uses key/value
    head ``h // (H // G)`` (SDPA's ``enable_gqa``). `scale` defaults to 1/sqrt(K). `lse` is the
    natural log of each row's softmax denominator. The result is differentiable: backward through
    it gives the reference dq, dk, dv (in float64 when the inputs require grad in float64)."""
    cu_q = _boundaries(cu_seqlens_q)
    cu_k = cu_q if cu_seqlens_k is None else _boundaries(cu_seqlens_k)
    if len(cu_q) != len(cu_k):
        raise ValueError(
            f"cu_seqlens_q and cu_seqlens_k need the same length; got {len(cu_q)} and {len(cu_k)}"
        )
    t_q, h, kd = q_THK.shape
    g = k_TGK.shape[1]
    if h % g:
        raise ValueError(f"query heads ({h}) must be a multiple of key/value heads ({g})")
    left, right = _window(window)
    scale = 1.0 / math.sqrt(kd) if scale is None else float(scale)
    q, k, v = q_THK.double(), k_TGK.double(), v_TGKv.double()
    # Rows outside every document keep out 0 and lse -inf; each document's rows are written once.
    outs: list[Tensor] = []
    lses: list[Tensor] = []
    row = 0
    for i in range(len(cu_q) - 1):
        sq, eq, sk, ek = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        if sq > row:
            outs.append(q.new_zeros(sq - row, h, v.shape[-1]))
            lses.append(q.new_full((h, sq - row), float("-inf")))
        lq, lk = eq - sq, ek - sk
        q_QHK = q[sq:eq]
        k_SHK = k[sk:ek].repeat_interleave(h // g, dim=1)
        v_SHKv = v[sk:ek].repeat_interleave(h // g, dim=1)
        s_HQS = torch.einsum("qhk,shk->hqs", q_QHK, k_SHK) * scale
        s_HQS = s_HQS.masked_fill(~_keep_SQ(lq, lk, is_causal, left, right).to(q.device), float("-inf"))
        lse_HQ = torch.logsumexp(s_HQS, dim=-1) if lk else q.new_full((h, lq), float("-inf"))
        # A row that sees no key has lse -inf: subtracting 0 instead keeps its p at exp(-inf) = 0
        # (and its gradient finite) rather than exp(nan).
        p_HQS = torch.exp(s_HQS - lse_HQ.masked_fill(torch.isinf(lse_HQ), 0.0).unsqueeze(-1))
        outs.append(torch.einsum("hqs,shv->qhv", p_HQS, v_SHKv))
        lses.append(lse_HQ)
        row = eq
    if t_q > row:
        outs.append(q.new_zeros(t_q - row, h, v.shape[-1]))
        lses.append(q.new_full((h, t_q - row), float("-inf")))
    return torch.cat(outs, dim=0), torch.cat(lses, dim=1)


def lognormal_lengths(
    total: int,
    mean: float,
    seed: int | None = None,
    *,
    sigma: float = 1.0,
    shortest: int = 1,
    generator: torch.Generator | None = None,
    empty: int = 0,
    ones: int = 0,
) -> list[int]:
    """Document lengths summing to `total`: drawn log-normal (mean `mean`, log-sd `sigma`, at least
    `shortest`) until they reach it; the last one is cut to fit (and, when `shortest` > 1, a cut
    below it joins the one before). The same seed gives the same lengths on every machine.

    `empty` zero-length and `ones` length-1 documents are then inserted at positions drawn from
    the same generator (the length-1 documents' tokens come out of `total`), so boundary code
    meets them; with both 0 the draw is exactly the plain sampler's. Pass `seed` or `generator`."""
    if (seed is None) == (generator is None):
        raise ValueError("lognormal_lengths needs exactly one of seed= or generator=")
    if total < 0 or empty < 0 or ones < 0 or ones > total:
        raise ValueError(
            f"need total >= ones >= 0 and empty >= 0; got total={total} ones={ones} empty={empty}"
        )
    gen = torch.Generator().manual_seed(seed) if generator is None else generator
    mu = math.log(mean) - sigma**2 / 2
    rest = total - ones
    out: list[int] = []
    while sum(out) < rest:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=gen).clamp(min=shortest).item())
        out.append(min(n, rest - sum(out)))
    if shortest > 1 and len(out) > 1 and out[-1] < shortest:
        cut = out.pop()
        out[-1] += cut  # (not out[-2] += out.pop(): the index is taken before the pop)
    for n in [1] * ones + [0] * empty:
        at = int(torch.randint(len(out) + 1, (1,), generator=gen).item())
        out.insert(at, n)
    return out
