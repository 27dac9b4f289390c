"""The independent fp64 reference (`usp_graph.testing`) against dense SDPA with a block-diagonal mask."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from usp_graph.testing import attention_reference, cu_seqlens, document_mask, lognormal_lengths, rel_err

# T packed tokens, H query heads, G key/value heads, K head dim, N documents


def _sdpa_dense(q_THK, k_TGK, v_TGK, keep_QS, scale):
    """SDPA over the whole packed sequence with the mask; rows that see no key are out 0, lse -inf."""
    h, g = q_THK.shape[1], k_TGK.shape[1]
    q, k, v = (x.transpose(0, 1).unsqueeze(0) for x in (q_THK, k_TGK, v_TGK))
    blind_Q = ~keep_QS.any(dim=1)
    mask = keep_QS | blind_Q.unsqueeze(1)  # SDPA gives NaN for fully masked rows; zeroed below
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=h != g)
    out_THK = out[0].transpose(0, 1).masked_fill(blind_Q[:, None, None], 0.0)
    s_HQS = torch.einsum("qhk,shk->hqs", q_THK, k_TGK.repeat_interleave(h // g, dim=1)) * scale
    lse_HQ = torch.logsumexp(s_HQS.masked_fill(~keep_QS, float("-inf")), dim=-1)
    return out_THK, lse_HQ


CASES = [
    # lengths_q, lengths_k (None: self-attention), causal, window, heads (H, G)
    ([5, 1, 9, 0, 3], None, True, (-1, -1), (4, 4)),
    ([5, 1, 9, 0, 3], None, False, (-1, -1), (4, 2)),
    ([2, 7, 4], [6, 3, 4], True, (-1, -1), (6, 2)),  # lq > lk: leading rows see no key
    ([2, 7, 4], [6, 3, 4], False, (-1, -1), (2, 1)),
    ([12, 1, 8], None, True, (3, 0), (4, 2)),
    ([12, 1, 8], None, False, (2, 4), (2, 2)),
    ([3, 6], [8, 2], False, (1, 1), (2, 2)),
]


@pytest.mark.parametrize("lq, lk, causal, window, heads", CASES)
def test_reference_matches_block_diagonal_sdpa_fp64(lq, lk, causal, window, heads):
    torch.manual_seed(0)
    h, g = heads
    lk = lq if lk is None else lk
    cu_q, cu_k = cu_seqlens(lq), cu_seqlens(lk)
    t_q, t_k = int(cu_q[-1]), int(cu_k[-1])
    q = torch.randn(t_q, h, 16, dtype=torch.float64, requires_grad=True)
    k = torch.randn(t_k, g, 16, dtype=torch.float64, requires_grad=True)
    v = torch.randn(t_k, g, 16, dtype=torch.float64, requires_grad=True)
    scale = 0.3
    out, lse = attention_reference(q, k, v, cu_q, cu_k, is_causal=causal, scale=scale, window=window)
    keep = document_mask(cu_q, cu_k, is_causal=causal, window=window)
    ref_out, ref_lse = _sdpa_dense(q, k, v, keep, scale)
    assert out.dtype == torch.float64 and lse.shape == (h, t_q)
    assert rel_err(out, ref_out) <= 1e-12
    assert torch.equal(torch.isinf(lse), torch.isinf(ref_lse))
    finite = torch.isfinite(ref_lse)
    assert rel_err(lse[finite], ref_lse[finite]) <= 1e-12
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref_grads = torch.autograd.grad(ref_out, (q, k, v), dout)
    for name, a, b in zip("qkv", grads, ref_grads, strict=True):
        assert torch.isfinite(a).all(), name
        assert rel_err(a, b) <= 1e-10, name


@pytest.mark.parametrize("lq, lk, causal, window, heads", CASES)
def test_document_mask_keeps_exactly_the_keys_the_contract_names(lq, lk, causal, window, heads):
    # Element by element from the contract (usp_graph.testing's docstring), padding rows/columns too.
    lk = lq if lk is None else lk
    cu_q, cu_k = cu_seqlens(lq).tolist(), cu_seqlens(lk).tolist()
    keep = document_mask(
        cu_q, cu_k, is_causal=causal, window=window, total_q=cu_q[-1] + 2, total_k=cu_k[-1] + 1
    )
    left, right = window
    want = torch.zeros_like(keep)
    for i in range(len(lq)):
        for r in range(lq[i]):
            for c in range(lk[i]):
                d = r + lk[i] - lq[i]
                want[cu_q[i] + r, cu_k[i] + c] = (
                    (not causal or c <= d) and (left < 0 or c >= d - left) and (right < 0 or c <= d + right)
                )
    assert keep.shape == (cu_q[-1] + 2, cu_k[-1] + 1) and torch.equal(keep, want)


def test_reference_rows_outside_documents_are_zero_with_lse_minus_inf():
    q = torch.randn(10, 2, 8, dtype=torch.float64)
    out, lse = attention_reference(q, q, q, [2, 5, 7], is_causal=True)
    outside = [0, 1, 7, 8, 9]
    assert torch.equal(out[outside], torch.zeros_like(out[outside]))
    assert torch.isinf(lse[:, outside]).all() and (lse[:, outside] < 0).all()
    assert torch.isfinite(lse[:, 2:7]).all()


def test_reference_default_scale_and_single_key_row():
    q = torch.randn(4, 1, 9, dtype=torch.float64)
    k = torch.randn(4, 1, 9, dtype=torch.float64)
    out, lse = attention_reference(q, k, k, [0, 4], is_causal=True)
    # The first causal row sees only key 0: out is v[0], lse its single score.
    assert torch.allclose(out[0], k[0], rtol=0, atol=1e-15)
    assert torch.allclose(lse[0, 0], (q[0, 0] @ k[0, 0]) / math.sqrt(9), rtol=0, atol=1e-14)


def test_lognormal_lengths_sum_seed_and_forced_documents():
    plain = lognormal_lengths(4096, 300, 7, sigma=1.0)
    assert sum(plain) == 4096 and min(plain) >= 1
    assert plain == lognormal_lengths(4096, 300, 7, sigma=1.0)
    assert plain == lognormal_lengths(4096, 300, generator=torch.Generator().manual_seed(7))
    forced = lognormal_lengths(4096, 300, 7, empty=2, ones=3)
    assert sum(forced) == 4096 and forced.count(0) == 2 and forced.count(1) >= 3
    long = lognormal_lengths(1000, 200, 1, shortest=50)
    assert sum(long) == 1000 and min(long) >= 50
    with pytest.raises(ValueError, match="seed"):
        lognormal_lengths(10, 3)


def test_cu_seqlens_is_int32_prefix_sum():
    cu = cu_seqlens([3, 0, 1])
    assert cu.dtype == torch.int32 and cu.tolist() == [0, 3, 3, 4]
    with pytest.raises(ValueError):
        cu_seqlens([2, -1])
