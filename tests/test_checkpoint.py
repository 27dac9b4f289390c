"""Activation checkpointing: attention inside checkpointed regions runs under the same metadata in
the recompute, eager (`attention_mode`, backward outside the block) and compiled (regions are
higher-order ops whose bodies the backend rewrites)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import usp_graph
from tests.reference import rel_err
from usp_graph import AttentionMetadata, attention_mode, documents
from usp_graph.models import Llama, LlamaConfig, make_llama_batch

LENGTHS = [5, 1, 0, 7, 3]


class _Checkpointed(torch.nn.Module):
    """`Llama` whose decoder blocks run under `torch.utils.checkpoint`."""

    def __init__(self, model: Llama, *, use_reentrant: bool) -> None:
        super().__init__()
        self.model = model
        self.use_reentrant = use_reentrant

    def forward(self, input_ids_BL, position_ids_BL):
        m = self.model
        x_BLD = m.tok_embeddings(input_ids_BL)
        cos, sin = usp_graph.models.llama.rope_cos_sin(
            position_ids_BL, m.config.head_dim, m.config.rope_theta, x_BLD.dtype
        )
        for layer in m.layers:
            x_BLD = checkpoint(layer, x_BLD, cos, sin, use_reentrant=self.use_reentrant)
        return m.lm_head(m.norm(x_BLD))


def _model(dtype=torch.float64) -> Llama:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    return Llama(config).to(dtype)


def _loss(model, batch):
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _grads(module, loss):
    module.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.clone() for n, p in module.named_parameters()}


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_eager_checkpoint_recomputes_under_attention_mode_after_the_block_closed(use_reentrant):
    model = _model()
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=8)
    with attention_mode(meta):
        ref = _loss(model, batch)
    ref_grads = _grads(model, ref)
    wrapped = _Checkpointed(model, use_reentrant=use_reentrant)
    if use_reentrant:  # a reentrant region recomputes only when one of its inputs needs grad
        model.tok_embeddings.weight.requires_grad_(True)
    with attention_mode(meta):
        loss = _loss(wrapped, batch)
    grads = _grads(wrapped, loss)  # backward (and the recompute) outside the block
    assert torch.equal(loss, ref)
    for name, g in ref_grads.items():
        assert torch.equal(grads["model." + name], g), name
    # The wrapping ends with the block: plain checkpointing is untouched afterwards.
    assert torch.utils.checkpoint.CheckpointFunction.__name__ == "CheckpointFunction"


def test_compiled_checkpointed_regions_are_rewritten_and_bitwise_equal_to_eager():
    model = _model()
    wrapped = _Checkpointed(model, use_reentrant=False)
    reports: list = []
    compiled = torch.compile(wrapped, backend="usp", options={"on_compile": reports.append})
    for lengths in (LENGTHS, [2, 9, 3, 2]):
        batch = make_llama_batch(model.config, lengths, generator=torch.Generator().manual_seed(2))
        meta = AttentionMetadata.from_lengths(lengths, max_docs=8)
        with attention_mode(meta):
            ref = _loss(model, batch)
        ref_grads = _grads(model, ref)
        with documents(meta):
            loss = _loss(compiled, batch)
        grads = _grads(wrapped, loss)
        assert torch.equal(loss, ref)
        for name, g in ref_grads.items():
            assert torch.equal(grads["model." + name], g), name
    assert len(reports) == 1 and len(reports[0].rewritten) == 2 and reports[0].kept == ()
    assert reports[0].usp_ops["backward"].get("usp.varlen_bwd.default") == 2


def test_compiled_checkpointed_packed_documents_match_each_document_alone():
    model = _model()
    wrapped = _Checkpointed(model, use_reentrant=False)
    compiled = torch.compile(wrapped, backend="usp")
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(3))
    with documents(AttentionMetadata.from_lengths(LENGTHS, max_docs=8)):
        logits = compiled(batch["input_ids"], batch["position_ids"])
    start = 0
    for n in LENGTHS:
        if n:
            alone = model(
                batch["input_ids"][:, start : start + n], batch["position_ids"][:, start : start + n]
            )
            assert rel_err(logits[:, start : start + n], alone) <= 1e-10
        start += n


def _packed_mask(pos_BL):
    """transformers' training-path mask: documents where positions count up by one, causal."""
    seg = (torch.diff(pos_BL, prepend=pos_BL[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    keep = (seg[:, :, None] == seg[:, None, :]) & (pos_BL[:, None, :] <= pos_BL[:, :, None])
    return keep[:, None]


class _MaskedCheckpointed(torch.nn.Module):
    """Builds the packed mask once, outside the checkpointed blocks, and hands it to each."""

    def __init__(self, model: Llama) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids_BL, position_ids_BL):
        m = self.model
        x_BLD = m.tok_embeddings(input_ids_BL)
        cos, sin = usp_graph.models.llama.rope_cos_sin(
            position_ids_BL, m.config.head_dim, m.config.rope_theta, x_BLD.dtype
        )
        mask = _packed_mask(position_ids_BL)
        for layer in m.layers:
            x_BLD = checkpoint(layer, x_BLD, cos, sin, mask, use_reentrant=False)
        return m.lm_head(m.norm(x_BLD))


def test_a_recognised_mask_is_no_longer_built_to_be_passed_to_checkpointed_regions(monkeypatch):
    import usp_graph.backend.pipeline as compiler  # the backend pipeline's rewrite pass calls rewrite_sdpa

    rewritten = []
    real = compiler.rewrite_sdpa

    def capture(gm, **kwargs):
        result = real(gm, **kwargs)
        rewritten.append(gm)
        return result

    monkeypatch.setattr(compiler, "rewrite_sdpa", capture)
    model = _model()
    wrapped = _MaskedCheckpointed(model)
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(5))
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=8)
    with attention_mode(meta):
        ref = _loss(model, batch)
    ref_grads = _grads(model, ref)
    with documents(meta):
        loss = _loss(torch.compile(wrapped, backend="usp"), batch)
    grads = _grads(wrapped, loss)
    assert torch.equal(loss, ref)
    for name, g in ref_grads.items():
        assert torch.equal(grads["model." + name], g), name
    (gm,) = rewritten
    masks = [
        n
        for n in gm.graph.nodes
        if isinstance(v := n.meta.get("example_value"), torch.Tensor)
        and v.dtype == torch.bool
        and v.dim() == 4
    ]
    assert masks == [], [n.format_node() for n in masks]


@pytest.mark.parametrize("use_reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_a_checkpoint_entry_point_copied_inside_the_block_holds_no_mode(monkeypatch, use_reentrant):
    """A module imported inside the block may copy checkpoint's entry points (torch imports Dynamo
    at the first checkpoint call, and Dynamo imports torch.distributed._composable, which copies
    the non-reentrant one): the copy keeps no block's mode (nor its ContextParallel and process
    group) once the block closed, and outside a block it checkpoints as torch does."""
    import gc
    import weakref

    import torch.utils.checkpoint as ckpt

    model = _model()
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(1))
    with attention_mode(AttentionMetadata.from_lengths(LENGTHS, max_docs=8)) as mode:
        copied = {
            "_checkpoint_without_reentrant_generator": ckpt._checkpoint_without_reentrant_generator,
            "CheckpointFunction": ckpt.CheckpointFunction,
        }
    block = weakref.ref(mode)
    del mode
    gc.collect()
    assert block() is None
    ref_grads = _grads(model, _loss(model, batch))  # no block: one document per row
    for name, entry in copied.items():
        monkeypatch.setattr(ckpt, name, entry)
    wrapped = _Checkpointed(model, use_reentrant=use_reentrant)
    grads = _grads(wrapped, _loss(wrapped, batch))
    for name, g in ref_grads.items():
        assert torch.equal(grads["model." + name], g), name
