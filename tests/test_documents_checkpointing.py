"""Activation checkpointing inside `usp_graph.documents(...)`: the recompute attends its forward's documents.

A checkpointed region recomputes its forward in backward, usually after the block has closed, and
under gradient accumulation after (or inside) the next micro-batch's block. Each recompute must
attend the documents of ITS forward: checked against every document run alone in fp64, for
transformers' checkpointing (non-reentrant and reentrant), eager and compiled with backend usp, with
two micro-batches of different boundaries (empty and one-token documents included) whose summed
loss has one backward after both blocks.

# B batch, L sequence, T packed tokens, N documents
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.backend.documents import current_documents

pytest.importorskip("transformers")

from tests.realmodels import (  # noqa: E402
    checkpoint_layers,
    compile_usp,
    grads,
    make_lm,
    max_err,
    packed_positions,
    per_document,
    weighted_loss,
)

LENGTH = 16  # tokens of the one packed row
MAX_DOCS = 8  # both micro-batches: the same capacity, so the other one's metadata would fit


def _lengths(seed: int) -> list[int]:
    """Random document lengths summing to LENGTH, with an empty and a one-token document among them."""
    gen = torch.Generator().manual_seed(seed)
    cuts = sorted(torch.randint(1, LENGTH, (3,), generator=gen).tolist())
    lengths = [b - a for a, b in zip([0, *cuts], [*cuts, LENGTH], strict=True)]
    longest = max(range(len(lengths)), key=lengths.__getitem__)
    lengths[longest] -= 1
    for n in (1, 0):
        lengths.insert(int(torch.randint(0, len(lengths) + 1, (1,), generator=gen)), n)
    return lengths


MICRO = [_lengths(1), _lengths(2)]  # two micro-batches of gradient accumulation


def _batch(lengths: list[int], seed: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    pos = packed_positions(lengths)
    ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(seed))
    return ids, pos, AttentionMetadata.from_lengths(lengths, max_docs=MAX_DOCS)


BATCHES = [_batch(lengths, seed) for seed, lengths in enumerate(MICRO)]


def _logits(model: nn.Module, ids: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    return model(input_ids=ids, position_ids=pos, use_cache=False).logits


def _reference(model: nn.Module) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Each micro-batch's logits with every document run alone, and the grads of their summed loss."""
    outs, loss = [], 0
    for (ids, pos, _), lengths in zip(BATCHES, MICRO, strict=True):
        alone = [n for n in lengths if n]  # an empty document has no tokens to run
        out = per_document(lambda s, ids=ids, pos=pos: _logits(model, ids[:, s], pos[:, s]), alone)
        outs.append(out.detach())
        loss = loss + weighted_loss(out, seed=len(outs))
    loss.backward()
    return outs, grads(model)


def _accumulate(
    fn, model: nn.Module, block, *, inside: bool = False
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Two forwards, each in its own block (`block(meta)`), then ONE backward of their summed loss:
    after both blocks, or (`inside`) inside the second one, where the first forward's recompute runs."""
    outs, loss = [], 0
    for i, (ids, pos, meta) in enumerate(BATCHES):
        with block(meta):
            out = _logits(fn, ids, pos)
            outs.append(out.detach())
            loss = loss + weighted_loss(out, seed=len(outs))
            if inside and i == len(BATCHES) - 1:
                loss.backward()
    if not inside:
        loss.backward()
    return outs, grads(model)


# Python state outside the checkpointed layers that each layer's forward writes: Dynamo breaks the
# graph at such a region (as at transformers >= 5.25's own layers, whose attention wrapper from the
# `kernels` package is set and restored in the forward), on whatever transformers runs.
_OUTSIDE: dict[str, int] = {}


def _writes_outside(forward):
    def forward_with_a_side_effect(*args, **kwargs):
        _OUTSIDE["calls"] = _OUTSIDE.get("calls", 0) + 1
        return forward(*args, **kwargs)

    return forward_with_a_side_effect


def _checkpointed(attn: str, reentrant: bool, side_effect: bool = False) -> nn.Module:
    model = make_lm("llama")
    model.set_attn_implementation(attn)
    checkpoint_layers(model, use_reentrant=reentrant)
    if side_effect:
        for layer in model.model.layers:  # inside the region whichever level transformers wraps
            layer.self_attn.forward = _writes_outside(layer.self_attn.forward)
    model.train()  # transformers checkpoints only in training mode
    return model


def _assert_each_document_alone(got, ref) -> None:
    for out, want in zip(got[0], ref[0], strict=True):
        assert max_err(out, want) <= 1e-10
    assert got[1].keys() == ref[1].keys() and max_err(got[1], ref[1]) <= 1e-10


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("door", ["usp-documents", "sdpa-attention_mode"])
def test_eager_recompute_after_the_blocks_attends_each_forwards_documents(door, reentrant):
    model = _checkpointed("usp" if door.startswith("usp") else "sdpa", reentrant)
    ref = _reference(model)
    block = usp_graph.documents if door == "usp-documents" else usp_graph.attention_mode
    _assert_each_document_alone(_accumulate(model, model, block), ref)


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_eager_recompute_inside_the_next_block_attends_its_own_forwards_documents(reentrant):
    model = _checkpointed("usp", reentrant)
    ref = _reference(model)
    _assert_each_document_alone(_accumulate(model, model, usp_graph.documents, inside=True), ref)


@pytest.mark.slow
def test_compiled_usp_recompute_after_the_blocks_attends_each_forwards_documents():
    """transformers >= 5.25's checkpointed layers graph-break under Dynamo (usp_graph.checkpointing)
    and run as eager checkpoints; their recompute still attends each forward's documents."""
    model = _checkpointed("usp", reentrant=False)
    ref = _reference(model)
    torch._dynamo.reset()
    _assert_each_document_alone(_accumulate(compile_usp(model), model, usp_graph.documents), ref)


# The "sdpa" door's layers must be compiled whole (they would run plain SDPA eagerly inside the
# block, which is refused); their recompute is in the compiled backward, fed by each call's inputs.
@pytest.mark.slow
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_compiled_sdpa_regions_recompute_each_forwards_documents_after_the_blocks():
    model = _checkpointed("sdpa", reentrant=False)
    ref = _reference(model)
    torch._dynamo.reset()
    _assert_each_document_alone(_accumulate(compile_usp(model), model, usp_graph.documents), ref)


@pytest.mark.slow
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False)
def test_compiled_sdpa_regions_left_to_eager_are_refused_with_the_fix_at_the_forward():
    """Without the setting, the "sdpa" door's checkpointed layers run plain SDPA eagerly inside the
    block: refused at the forward, naming the setting (never a CheckpointError in backward)."""
    model = _checkpointed("sdpa", reentrant=False, side_effect=True)
    torch._dynamo.reset()
    ids, pos, meta = BATCHES[0]
    fix = "skip_fwd_side_effects_in_bwd_under_checkpoint = True"
    with pytest.raises(usp_graph.EagerAttentionError, match=fix), usp_graph.documents(meta):
        _logits(compile_usp(model), ids, pos)


# ---- a plain module checkpointed by hand -------------------------------------------------------


class _Attention(nn.Module):
    def __init__(self, width: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width, dtype=torch.float64)

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        b, length, d = x_BLD.shape
        q, k, v = self.qkv(x_BLD).view(b, length, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return x_BLD + out.transpose(1, 2).reshape(b, length, d)


class _Hand(nn.Module):
    """Two attention blocks, each under torch.utils.checkpoint written by hand."""

    def __init__(self, reentrant: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.ModuleList([_Attention(), _Attention()])
        self.reentrant = reentrant

    def forward(self, x_BLD: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x_BLD = checkpoint(block, x_BLD, use_reentrant=self.reentrant)
        return x_BLD


@pytest.mark.slow
@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
def test_hand_written_checkpoints_compiled_recompute_each_forwards_documents(reentrant):
    model = _Hand(reentrant)
    gens = [torch.Generator().manual_seed(s) for s in (5, 6)]
    # an input that requires grad: reentrant checkpointing gives no grads without one
    xs = [torch.randn(1, LENGTH, 8, dtype=torch.float64, generator=g, requires_grad=True) for g in gens]
    loss = 0
    for x, lengths in zip(xs, MICRO, strict=True):
        loss = loss + weighted_loss(per_document(lambda s, x=x: model(x[:, s]), [n for n in lengths if n]))
    loss.backward()
    ref = grads(model)
    fn, loss = compile_usp(model), 0
    for x, (_, _, meta) in zip(xs, BATCHES, strict=True):
        with usp_graph.documents(meta):
            out = fn(x)
        loss = loss + weighted_loss(out)
    loss.backward()
    assert max_err(grads(model), ref) <= 1e-10


# ---- the mechanism: what a recompute sees ------------------------------------------------------


def _weigh_by_documents(x_N1: torch.Tensor) -> torch.Tensor:
    """x times the active block's boundaries (a tensor backward saves): a recompute under other
    documents saves other weights, and x's grad says which documents it saw."""
    meta = current_documents()
    w_N1 = torch.zeros_like(x_N1) if meta is None else meta.cu_seqlens.to(x_N1.dtype)
    return x_N1 * w_N1


@pytest.mark.parametrize("reentrant", [False, True], ids=["nonreentrant", "reentrant"])
@pytest.mark.parametrize("backward", ["after the blocks", "inside a third block", "twice"])
def test_a_recompute_sees_the_documents_of_its_own_forward(reentrant, backward):
    metas = [meta for _, _, meta in BATCHES]
    xs = [torch.ones(MAX_DOCS + 1, dtype=torch.float64, requires_grad=True) for _ in metas]
    loss = 0
    for x, meta in zip(xs, metas, strict=True):
        with usp_graph.documents(meta):
            loss = loss + checkpoint(_weigh_by_documents, x, use_reentrant=reentrant).sum()
    if backward == "inside a third block":
        with usp_graph.documents(AttentionMetadata.from_lengths([LENGTH], max_docs=MAX_DOCS)):
            loss.backward()
    else:
        loss.backward(retain_graph=backward == "twice")
        if backward == "twice":  # a second backward recomputes again
            loss.backward()
    for x, meta in zip(xs, metas, strict=True):
        times = 2 if backward == "twice" else 1
        assert torch.equal(x.grad, times * meta.cu_seqlens.to(torch.float64))
    assert current_documents() is None


def test_a_recompute_of_a_forward_outside_any_block_sees_no_documents():
    x = torch.ones(MAX_DOCS + 1, dtype=torch.float64, requires_grad=True)
    loss = checkpoint(_weigh_by_documents, x, use_reentrant=False).sum()
    with usp_graph.documents(BATCHES[0][2]):
        loss.backward()
    assert torch.equal(x.grad, torch.zeros_like(x))


def test_the_composable_checkpoint_recomputes_under_its_forwards_documents():
    from torch.distributed._composable import checkpoint as composable

    class Weigh(nn.Module):
        def forward(self, x_N1: torch.Tensor) -> torch.Tensor:
            return _weigh_by_documents(x_N1)

    module = composable(Weigh())
    x = torch.ones(MAX_DOCS + 1, dtype=torch.float64, requires_grad=True)
    meta = BATCHES[0][2]
    with usp_graph.documents(meta):
        loss = module(x).sum()
    loss.backward()
    assert torch.equal(x.grad, meta.cu_seqlens.to(torch.float64))


@pytest.mark.slow
def test_a_checkpointed_region_given_usps_mask_compiles_whole():
    """Dynamo hands a checkpointed layer's arguments, the mask "usp" builds (`DocumentStarts`) among
    them, to the region's higher-order op: that is no model code reading the mask (it was refused,
    and the region ran eagerly, outside backend usp and its context parallelism)."""
    from usp_graph.resolve import DocumentStarts

    def body(x: torch.Tensor, mask: DocumentStarts) -> torch.Tensor:
        return x.sin() * mask.starts.to(x.dtype)

    def region(x: torch.Tensor, mask: DocumentStarts) -> torch.Tensor:
        return checkpoint(body, x, use_reentrant=False, mask=mask)

    mask = DocumentStarts(torch.tensor([[True, False, False, True]]))
    x = torch.randn(1, 4, dtype=torch.float64, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(region, backend="usp", fullgraph=True, options={"inner": "aot_eager"})
    compiled(x, mask).sum().backward()  # fullgraph: no graph break allowed
    assert torch.equal(x.grad, x.detach().cos() * mask.starts.to(x.dtype))


def _left_out_layer_under_cp(rank: int, world: int) -> str:
    """A rank's refusal: transformers' checkpointed layers graph-break (setting off) and run eagerly
    inside the block, outside backend usp's context parallelism."""
    from usp_graph import ContextParallel
    from usp_graph.resolve import UnsupportedAttention

    model = _checkpointed("usp", reentrant=False, side_effect=True)
    cp = ContextParallel("ulysses")
    ids, pos, meta = BATCHES[0]  # the GLOBAL documents; each rank gets its shard of the tokens
    fn = compile_usp(model, cp=cp)
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        try:
            with usp_graph.documents(meta):
                _logits(fn, cp.shard(ids, 1), cp.shard(pos, 1))
        except UnsupportedAttention as e:
            return str(e)
    return "ran"


@pytest.mark.slow
def test_a_checkpointed_layer_left_out_of_the_graph_under_cp_is_refused_with_the_fix():
    from tests.dist import run_ranks

    for message in run_ranks(_left_out_layer_under_cp, 2):
        assert "left out of its graph runs outside backend usp" in message, message
        assert "skip_fwd_side_effects_in_bwd_under_checkpoint = True" in message, message
