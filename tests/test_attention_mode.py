"""attention_mode / sdpa_to_usp on whole models, against SDPA with an explicit document mask."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.reference import rel_err as _rel
from usp_graph import AttentionMetadata, attention_mode, sdpa_to_usp
from usp_graph.models import (
    Flux,
    FluxConfig,
    Llama,
    LlamaConfig,
    flux_loss,
    llama_loss,
    make_flux_batch,
    make_llama_batch,
)


def _loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _block_mask(metadata: AttentionMetadata, batch: int, seq: int, *, causal: bool) -> torch.Tensor:
    cu = metadata.cu_seqlens.long()
    doc_BL = (torch.searchsorted(cu, torch.arange(batch * seq), right=True) - 1).reshape(batch, seq)
    keep = doc_BL[:, :, None] == doc_BL[:, None, :]
    if causal:
        keep &= torch.ones(seq, seq, dtype=torch.bool).tril()
    return keep[:, None]


def test_llama_under_attention_mode_matches_document_masked_sdpa_float64():
    gen = torch.Generator().manual_seed(0)
    config = LlamaConfig(n_layers=2)
    torch.manual_seed(0)
    model = Llama(config).double()
    lengths = [7, 0, 1, 13, 1, 9]
    batch = make_llama_batch(config, lengths, generator=gen, with_attn_mask=True)
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)

    ref_loss, ref_grads = _loss_and_grads(model, llama_loss, batch)
    no_mask = {k: v for k, v in batch.items() if k != "attn_mask"}
    with attention_mode(meta) as mode:
        loss, grads = _loss_and_grads(model, llama_loss, no_mask)
    assert mode.calls == config.n_layers
    assert _rel(loss, ref_loss) <= 1e-10
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 1e-10, name


def test_llama_documents_are_isolated_under_attention_mode():
    # Changing one document's tokens leaves the other documents' logits bitwise unchanged.
    gen = torch.Generator().manual_seed(1)
    config = LlamaConfig()
    model = Llama(config)
    batch = make_llama_batch(config, [6, 5, 8], generator=gen)
    meta = AttentionMetadata.from_position_ids(batch["position_ids"])
    ids2 = batch["input_ids"].clone()
    ids2[0, 6:11] = (ids2[0, 6:11] + 1) % config.vocab_size
    with attention_mode(meta), torch.no_grad():
        a = model(batch["input_ids"], batch["position_ids"])
        b = model(ids2, batch["position_ids"])
    assert torch.equal(a[0, :6], b[0, :6]) and torch.equal(a[0, 11:], b[0, 11:])
    assert not torch.equal(a[0, 6:11], b[0, 6:11])


def test_flux_under_attention_mode_matches_document_masked_sdpa_float64():
    gen = torch.Generator().manual_seed(2)
    config = FluxConfig(n_double=2, n_single=1)
    torch.manual_seed(2)
    model = Flux(config).double()
    b, txt, img = 2, 5, 12
    batch = make_flux_batch(config, b, txt, img, generator=gen, dtype=torch.float64)
    # Split each joint [txt, img] row into two documents, with an empty and a length-1 one.
    meta = AttentionMetadata.from_lengths([1, 10, 6, 0, 17], max_docs=8)
    mask = _block_mask(meta, b, txt + img, causal=False)

    ref_loss, ref_grads = _loss_and_grads(model, flux_loss, {**batch, "attn_mask": mask})
    with attention_mode(meta) as mode:
        loss, grads = _loss_and_grads(model, flux_loss, batch)
    assert mode.calls == config.n_double + config.n_single
    assert _rel(loss, ref_loss) <= 1e-10
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= 1e-10, name


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_no_metadata_means_one_document_per_row(dtype, tol):
    gen = torch.Generator().manual_seed(3)
    config = LlamaConfig()
    torch.manual_seed(3)
    model = Llama(config).to(dtype)
    input_ids = torch.randint(0, config.vocab_size, (3, 11), generator=gen)
    position_ids = torch.arange(11).expand(3, 11)
    batch = {"input_ids": input_ids, "position_ids": position_ids, "labels": input_ids.roll(-1, 1)}
    ref_loss, ref_grads = _loss_and_grads(model, llama_loss, batch)
    with attention_mode():
        loss, grads = _loss_and_grads(model, llama_loss, batch)
    assert _rel(loss, ref_loss) <= tol
    for name, g in grads.items():
        assert _rel(g, ref_grads[name]) <= tol, name


def test_eager_attention_mode_is_bitwise_sdpa_to_usp():
    # The mode adds nothing: it is exactly one sdpa_to_usp call per SDPA call.
    gen = torch.Generator().manual_seed(4)
    q = torch.randn(2, 4, 9, 8, generator=gen)
    k = torch.randn(2, 2, 9, 8, generator=gen)
    v = torch.randn(2, 2, 9, 8, generator=gen)
    meta = AttentionMetadata.from_lengths([4, 0, 7, 1, 6])
    with attention_mode(meta):
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3)
    b = sdpa_to_usp(q, k, v, is_causal=True, enable_gqa=True, scale=0.3, metadata=meta)
    assert torch.equal(a, b)


def test_three_dim_inputs_and_mqa_broadcast_follow_sdpa():
    gen = torch.Generator().manual_seed(5)
    q3 = torch.randn(2, 7, 8, generator=gen, dtype=torch.float64)
    with attention_mode():
        out3 = F.scaled_dot_product_attention(q3, q3, q3, is_causal=True)
    assert _rel(out3, F.scaled_dot_product_attention(q3, q3, q3, is_causal=True)) <= 1e-12
    q = torch.randn(2, 4, 7, 8, generator=gen, dtype=torch.float64)
    kv = torch.randn(2, 1, 7, 8, generator=gen, dtype=torch.float64)
    with attention_mode():
        out = F.scaled_dot_product_attention(q, kv, kv)
    assert _rel(out, F.scaled_dot_product_attention(q, kv, kv)) <= 1e-12


@pytest.mark.parametrize("split", ["chunk", "unbind", "slices"])
def test_views_of_one_fused_projection_made_before_the_block_are_self_attention(split):
    """q, k, v cut from one fused projection computed outside the block, reshaped inside it: one
    stream (their storage), not cross-attention; each document's own result."""
    torch.manual_seed(0)
    b, h, length, k_dim = 1, 2, 12, 4
    x = torch.randn(b, length, 3 * h * k_dim, dtype=torch.float64)
    qkv = x * 2
    if split == "chunk":
        parts = qkv.chunk(3, dim=-1)
    elif split == "unbind":
        parts = qkv.view(b, length, 3, h * k_dim).unbind(2)
    else:
        parts = [qkv[..., i * h * k_dim : (i + 1) * h * k_dim] for i in range(3)]
    heads = lambda a: a.reshape(b, length, h, k_dim).transpose(1, 2)  # noqa: E731
    meta = AttentionMetadata.from_lengths([5, 0, 7], max_docs=4)
    with attention_mode(meta):
        out = F.scaled_dot_product_attention(*(heads(p) for p in parts), is_causal=True)
    q, k, v = (heads(p) for p in parts)
    ref = torch.cat(
        [
            F.scaled_dot_product_attention(q[:, :, s], k[:, :, s], v[:, :, s], is_causal=True)
            for s in (slice(0, 5), slice(5, 12))
        ],
        2,
    )
    assert (out - ref).abs().max() <= 1e-12


def test_unrelated_outside_tensors_with_other_keys_are_still_cross_attention():
    torch.manual_seed(0)
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=4)
    q = torch.randn(1, 2, 8, 4)
    text = torch.randn(1, 8, 8)
    with attention_mode(meta), pytest.raises(ValueError, match="cross-attention"):
        kv = (text * 1.0).view(1, 8, 2, 4).transpose(1, 2)
        F.scaled_dot_product_attention(q * 1.0, kv, kv)
