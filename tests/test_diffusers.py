"""Real diffusers transformers under backend "usp": Flux, SD3 (joint text+image attention), Wan
(self-attention on video, cross-attention to text). Tiny random configs, fp64, no downloads.

Joint attention (Flux, SD3) runs one document per sample: packing several samples into one joint
sequence is not supported, so only the per-row path is tested there. Wan's cross-attention is
tested packed at the block level: videos packed in one row attend their own text, packed in
another stream, given by ``documents(video_meta, kv=text_meta)``.

# B batch, L tokens per row, D model width (32), N documents
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

pytest.importorskip("diffusers")

import usp_graph  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.realmodels import (  # noqa: E402
    compile_usp,
    flux_inputs,
    grads,
    make_flux,
    make_sd3,
    make_wan,
    max_err,
    sd3_inputs,
    wan_inputs,
    weighted_loss,
)
from usp_graph import AttentionMetadata  # noqa: E402


@pytest.fixture(autouse=True, scope="module")
def _one_thread_fresh_dynamo():
    # Tiny models: compiling is single-threaded Python, and on a busy 2-core machine OpenMP threads
    # waiting on each other make eager steps far slower. Dynamo starts and ends empty; a recompile
    # limit hit would silently run eagerly (documents(...) ignored), so it fails loudly instead.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield
    _wan_block.cache_clear()
    torch._dynamo.reset()
    torch.set_num_threads(threads)


MODELS = {
    # name: (factory, inputs of 2 samples, one document each)
    "flux": (make_flux, lambda: flux_inputs(2, txt=4, img=8, seed=1)),
    "sd3": (make_sd3, lambda: sd3_inputs(2, txt=6, seed=1)),
    "wan": (make_wan, lambda: wan_inputs(2, frames=2, txt=6, seed=1)),  # cross-attention per row
}


def _loss_grads(model: nn.Module, fn, inputs: dict, mode=None) -> tuple[Tensor, dict]:
    if mode is None:
        out = fn(**inputs).sample
    else:
        with mode:
            out = fn(**inputs).sample
    weighted_loss(out).backward()
    return out.detach(), grads(model)


@pytest.mark.parametrize("name", list(MODELS))
def test_one_document_per_row_compiled_is_bitwise_equal_to_eager(name):
    make, inputs = MODELS[name]
    model, x = make(), inputs()
    reports: list = []
    out, got = _loss_grads(model, compile_usp(model, on_compile=reports.append), x)
    with torch.no_grad():
        plain = model(**x).sample
    assert torch.equal(out, plain), max_err(out, plain)
    _, ref = _loss_grads(model, model, x, usp_graph.attention_mode())
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref), max_err(got, ref)
    assert len(reports) == 1 and reports[0].rewritten and reports[0].kept == (), reports


# ---- Wan: packed cross-attention at the block level ----------------------------------------------

# Two packings, each of two samples: (video frames, text tokens) per sample. A 1 x 4 x 4 frame is
# 4 tokens (patches of 2 x 2), so the videos are 8 + 16 and 16 + 8 tokens, the texts 12 + 12 and
# 6 + 18: equal totals (24 and 24), so nothing but data flow can tell self- from cross-attention.
WAN_PACKINGS = (((2, 12), (4, 12)), ((4, 6), (2, 18)))
WAN_MAX_DOCS = 3
# Wan's block normalises in fp32 even in an fp64 model (FP32LayerNorm: weight and bias cast to
# fp32), so norm2's weight and bias grads are sums over tokens in fp32: packed (one sum over 24
# tokens) and alone (two sums, then added) round differently, ~1e-7. Everything else is fp64.
WAN_TOL = 1e-6


def _wan_samples(model: nn.Module, packing, *, seed: int) -> list[dict]:
    """Keyword inputs of `model.blocks[0]` for each sample alone: video tokens, text tokens, RoPE
    of the sample's own video grid, and a per-token time embedding (B, L, 6, D; Wan 2.2's form)."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    width = model.config.num_attention_heads * model.config.attention_head_dim
    samples = []
    for frames, txt in packing:
        cos, sin = model.rope(torch.zeros(1, model.config.in_channels, frames, 4, 4, dtype=torch.float64))
        length = cos.shape[1]
        samples.append(
            {
                "hidden_states": torch.randn(1, length, width, **f64),
                "encoder_hidden_states": torch.randn(1, txt, width, **f64),
                "temb": torch.randn(1, 1, 6, width, **f64).expand(1, length, 6, width),
                "rotary_emb": (cos, sin),
            }
        )
    return samples


def _pack(samples: list[dict]) -> dict:
    """The samples side by side in one row (every input along its token dim)."""
    packed = {k: torch.cat([s[k] for s in samples], 1) for k in samples[0] if k != "rotary_emb"}
    packed["rotary_emb"] = tuple(torch.cat([s["rotary_emb"][i] for s in samples], 1) for i in range(2))
    return packed


def _metas(samples: list[dict]) -> tuple[AttentionMetadata, AttentionMetadata]:
    video = [s["hidden_states"].shape[1] for s in samples]
    text = [s["encoder_hidden_states"].shape[1] for s in samples]
    return (
        AttentionMetadata.from_lengths(video, max_docs=WAN_MAX_DOCS),
        AttentionMetadata.from_lengths(text, max_docs=WAN_MAX_DOCS),
    )


def _wan_alone(block: nn.Module, samples: list[dict]) -> tuple[Tensor, dict]:
    out = torch.cat([block(**s) for s in samples], 1)
    weighted_loss(out).backward()
    return out.detach(), grads(block)


@dataclass
class WanBlock:
    """Wan's block compiled with backend "usp"; the reports of every compile it made."""

    model: nn.Module
    reports: list = field(default_factory=list)

    def __post_init__(self):
        self.block = self.model.blocks[0]
        self.fn = compile_usp(self.block, on_compile=self.reports.append)

    def run(self, packed: dict, video: AttentionMetadata, text: AttentionMetadata | None):
        with usp_graph.documents(video, kv=text):
            out = self.fn(**packed)
        weighted_loss(out).backward()
        return out.detach(), grads(self.block)


@functools.cache
def _wan_block() -> WanBlock:
    return WanBlock(make_wan())


def _check_grads(got: dict, ref: dict) -> None:
    """Every grad within 1e-10 but norm2's (fp32 sums: WAN_TOL)."""
    fp32 = {n for n in ref if n.startswith("norm2.")}
    assert fp32 and got.keys() == ref.keys()
    assert max_err({n: got[n] for n in fp32}, {n: ref[n] for n in fp32}) <= WAN_TOL
    rest = ref.keys() - fp32
    assert max_err({n: got[n] for n in rest}, {n: ref[n] for n in rest}) <= 1e-10


@pytest.mark.parametrize("packing", range(len(WAN_PACKINGS)))
def test_wan_packed_cross_attention_matches_each_sample_alone(packing):
    w = _wan_block()
    samples = _wan_samples(w.model, WAN_PACKINGS[packing], seed=packing)
    out, got = w.run(_pack(samples), *_metas(samples))
    ref_out, ref = _wan_alone(w.block, samples)
    assert max_err(out, ref_out) <= 1e-10
    _check_grads(got, ref)


def test_wan_new_boundaries_reuse_the_compiled_block():
    w = _wan_block()
    for packing in WAN_PACKINGS:
        samples = _wan_samples(w.model, packing, seed=7)
        w.run(_pack(samples), *_metas(samples))
    assert len(w.reports) == 1, [r.graph for r in w.reports]
    (report,) = w.reports
    assert len(report.rewritten) == 2 and report.kept == (), report
    # data flow, not lengths, tells them apart: the second site reads its keys from the text
    assert [" cross " in site for site in report.rewritten] == [False, True], report.rewritten


def test_wan_packed_cross_attention_without_kv_documents_raises():
    w = _wan_block()
    samples = _wan_samples(w.model, WAN_PACKINGS[0], seed=8)
    video, _ = _metas(samples)
    with pytest.raises(ValueError, match=r"kv=") as info:
        w.run(_pack(samples), video, None)
    assert "cross-attention" in str(info.value)
    w.block.zero_grad(set_to_none=True)


def test_wan_eager_packed_cross_attention_without_kv_documents_raises():
    model = make_wan()
    samples = _wan_samples(model, WAN_PACKINGS[0], seed=9)
    video, _ = _metas(samples)
    with pytest.raises(ValueError, match=r"kv=") as info, usp_graph.attention_mode(video):
        model.blocks[0](**_pack(samples))
    assert "cross-attention" in str(info.value)


def test_wan_eager_packed_cross_attention_with_kv_documents_matches_each_sample_alone():
    model = make_wan()
    block = model.blocks[0]
    samples = _wan_samples(model, WAN_PACKINGS[1], seed=10)
    video, text = _metas(samples)
    with usp_graph.attention_mode(video, kv=text):
        out = block(**_pack(samples))
    weighted_loss(out).backward()
    got = grads(block)
    ref_out, ref = _wan_alone(block, samples)
    assert max_err(out.detach(), ref_out) <= 1e-10
    _check_grads(got, ref)


# ---- gradient checkpointing ----------------------------------------------------------------------


# diffusers' checkpoint helper calls an lru_cache'd version check, which Dynamo traces through (harmless).
@pytest.mark.filterwarnings("ignore:Dynamo detected a call to a `functools.lru_cache`")
def test_gradient_checkpointing_flux_compiled_matches_eager():
    model = make_flux()
    x = flux_inputs(2, txt=4, img=8, seed=2)
    _, ref = _loss_grads(model, model, x)  # no checkpointing
    model.enable_gradient_checkpointing()
    model.train()
    assert model.is_gradient_checkpointing
    reports: list = []
    _, got = _loss_grads(model, compile_usp(model, on_compile=reports.append), x)
    assert max_err(got, ref) <= 1e-10
    assert len(reports) == 1 and len(reports[0].rewritten) == 2, reports


# ---- context parallelism -------------------------------------------------------------------------

CP_OP = {"ulysses": "usp.all_to_all", "ring": "usp.ring_attn_fwd"}  # the strategy ran: its forward op
# Inputs of the Flux model along the sequence. Text and image tokens are sharded separately: each
# text token lives on one rank, so the all-to-all never duplicates it and the ring rotates it once.
FLUX_SEQ_DIM = {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}


def _flux_cp(rank: int, world: int, strategies: list[str]) -> list[dict]:
    """Loss and every param grad of a compiled CP step per strategy vs the single process."""
    from usp_graph import ContextParallel

    model = make_flux()
    x = flux_inputs(2, txt=4 * world, img=8 * world, seed=3)
    target = torch.randn(2, 8 * world, 8, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    pred = model(**x).sample  # plain model, one process, one document per sample
    ref_loss = F.mse_loss(pred, target, reduction="sum") / pred.numel()
    ref_loss.backward()
    ref = grads(model)
    out = []
    for strategy in strategies:
        cp = ContextParallel(strategy)
        reports: list = []
        fn = compile_usp(model, cp=cp, on_compile=reports.append)
        local = {k: cp.shard(v, FLUX_SEQ_DIM[k]) if k in FLUX_SEQ_DIM else v for k, v in x.items()}
        pred = fn(**local).sample
        loss = cp.token_mean(F.mse_loss(pred, cp.shard(target, 1), reduction="sum"), pred.numel())
        loss.backward()
        cp.reduce_grads(model.parameters())
        got = grads(model)
        out.append(
            {
                "strategy": strategy,
                "loss": max_err(cp.global_sum(loss), ref_loss.detach()),
                "grads": max_err(got, ref),
                "usp_ops": reports[0].usp_ops["forward"],
            }
        )
    return out


def test_flux_context_parallel_ulysses_and_ring_match_one_process():
    for rank_results in run_ranks(_flux_cp, 2, ["ulysses", "ring"]):
        for r in rank_results:
            assert r["loss"] <= 1e-10 and r["grads"] <= 1e-10, r
            assert any(op.startswith(CP_OP[r["strategy"]]) for op in r["usp_ops"]), r
