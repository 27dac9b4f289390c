"""document_block_mask: flex_attention's BlockMask for packed documents, built from cu_seqlens."""

from __future__ import annotations

import warnings

import pytest
import torch

from usp_graph import AttentionMetadata, varlen_attn
from usp_graph.flex import document_block_mask, document_ids

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _lengths(gen: torch.Generator, total: int) -> list[int]:
    cuts = sorted(torch.randint(0, total + 1, (5,), generator=gen).tolist())
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    big = lens.index(max(lens))
    lens[big] -= 1
    return [*lens[:big], 1, 0, *lens[big:]]  # an empty and a length-1 document, wherever they land


def _reference_mask(meta: AttentionMetadata, causal: bool, block: int):
    doc = document_ids(meta.cu_seqlens, meta.total_tokens)

    def mask_mod(b, h, q, kv):
        same = doc[q] == doc[kv]
        return same & (q >= kv) if causal else same

    t = meta.total_tokens
    return flex.create_block_mask(mask_mod, None, None, t, t, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("total, block", [(200, 16), (256, 32), (97, 8)])
def test_blocks_equal_create_block_mask_and_flex_equals_varlen(causal, total, block):
    gen = torch.Generator().manual_seed(total + block + causal)
    meta = AttentionMetadata.from_lengths(_lengths(gen, total), max_docs=10)
    got = document_block_mask(meta, is_causal=causal, block_size=block)
    ref = _reference_mask(meta, causal, block)
    assert torch.equal(got.to_dense(), ref.to_dense())
    assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)

    q = torch.randn(1, 4, total, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it is not compiled (a CPU reference here)
        out = flex.flex_attention(q, k, v, block_mask=got, enable_gqa=True)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    ref_out = varlen_attn(
        *(x[0].transpose(0, 1) for x in (q, k, v)), cu, cu, m, m, is_causal=causal, enable_gqa=True
    )
    assert (out[0].transpose(0, 1) - ref_out).abs().max() <= 1e-12


def test_document_ids_skip_empty_documents():
    meta = AttentionMetadata.from_lengths([2, 0, 3, 1], max_docs=6)
    assert document_ids(meta.cu_seqlens, 6).tolist() == [0, 0, 2, 2, 2, 3]


def test_bad_arguments_name_the_fix():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass total_tokens with a cu_seqlens tensor"):
        document_block_mask(cu, is_causal=True)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        document_block_mask(cu, 4, is_causal=True, block_size=0)
    with pytest.raises(ValueError, match="total_tokens must be a positive int"):
        document_block_mask(cu, 0, is_causal=True)
