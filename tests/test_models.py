# B batch, L sequence, H heads, G kv heads, K head dim, D model dim, V vocab, C image channels,
# N packed samples, T / I text / image tokens, S joint tokens
"""Behaviour tests for the reference models in usp_graph.models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from tests.reference import rel_err
from usp_graph import AttentionMetadata, attention_mode
from usp_graph.models import (
    Flux,
    FluxConfig,
    Llama,
    LlamaConfig,
    document_causal_mask,
    flux_loss,
    llama_loss,
    make_flux_batch,
    make_llama_batch,
    make_packed_flux_batch,
)
from usp_graph.models.flux import packed_layout


class SDPACounter(TorchFunctionMode):
    """Records the args/kwargs of every F.scaled_dot_product_attention call under the mode."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __torch_function__(
        self,
        func: Any,
        types: Any,
        args: tuple[Any, ...] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        kwargs = kwargs or {}
        # usp_graph.documents() makes F.scaled_dot_product_attention a thin check that calls the C
        # function: a mode sees that one.
        if func in (F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention):
            self.calls.append((args, dict(kwargs)))
        return func(*args, **kwargs)


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def llama_model(config: LlamaConfig, seed: int, dtype: torch.dtype = torch.float32) -> Llama:
    torch.manual_seed(seed)
    return Llama(config).to(dtype)


def flux_model(config: FluxConfig, seed: int, dtype: torch.dtype = torch.float32) -> Flux:
    torch.manual_seed(seed)
    return Flux(config).to(dtype)


def flux_forward(model: Flux, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    return model(
        batch["img"],
        batch["txt"],
        batch["timesteps"],
        batch["img_ids"],
        batch["txt_ids"],
        batch["pooled"],
        batch.get("attn_mask"),
    )


def assert_all_grads_nonzero_finite(model: nn.Module) -> None:
    for name, param in model.named_parameters():
        assert param.grad is not None, f"{name} got no grad"
        assert torch.isfinite(param.grad).all(), f"{name} grad not finite"
        assert param.grad.abs().sum() > 0, f"{name} grad is all zero"


def test_llama_logits_have_shape_batch_seq_vocab() -> None:
    config = LlamaConfig()
    model = llama_model(config, seed=0)
    g = gen(1)
    input_ids_BL = torch.randint(0, config.vocab_size, (2, 11), generator=g)
    position_ids_BL = torch.arange(11).expand(2, -1)
    assert model(input_ids_BL, position_ids_BL).shape == (2, 11, config.vocab_size)


def test_flux_output_covers_only_image_tokens() -> None:
    config = FluxConfig()
    model = flux_model(config, seed=0)
    batch = make_flux_batch(config, batch_size=2, txt_len=5, img_len=9, generator=gen(1))
    assert flux_forward(model, batch).shape == (2, 9, config.in_channels)


def test_llama_every_parameter_gets_nonzero_finite_grad() -> None:
    config = LlamaConfig()
    model = llama_model(config, seed=2)
    batch = make_llama_batch(config, [6, 9, 4], generator=gen(3))
    llama_loss(model, batch).backward()
    assert_all_grads_nonzero_finite(model)


def test_flux_every_parameter_gets_nonzero_finite_grad() -> None:
    config = FluxConfig(n_double=2, n_single=2)
    model = flux_model(config, seed=2)
    batch = make_flux_batch(config, batch_size=2, txt_len=4, img_len=6, generator=gen(3))
    flux_loss(model, batch).backward()
    assert_all_grads_nonzero_finite(model)


def test_llama_calls_causal_gqa_sdpa_once_per_layer_with_unrepeated_kv() -> None:
    config = LlamaConfig(n_layers=3)
    model = llama_model(config, seed=4)
    batch = make_llama_batch(config, [7, 5], generator=gen(5))
    with SDPACounter() as counter:
        model(batch["input_ids"], batch["position_ids"])
    assert len(counter.calls) == config.n_layers
    for (q_BHLK, k_BGLK, v_BGLK), kwargs in counter.calls:
        assert kwargs == {"is_causal": True, "enable_gqa": True, "scale": config.head_dim**-0.5}
        assert q_BHLK.shape == (1, config.n_heads, 12, config.head_dim)
        assert k_BGLK.shape == v_BGLK.shape == (1, config.n_kv_heads, 12, config.head_dim)


def test_llama_with_attn_mask_passes_mask_instead_of_is_causal() -> None:
    config = LlamaConfig()
    model = llama_model(config, seed=6)
    batch = make_llama_batch(config, [3, 4], generator=gen(7), with_attn_mask=True)
    with SDPACounter() as counter:
        model(batch["input_ids"], batch["position_ids"], batch["attn_mask"])
    assert len(counter.calls) == config.n_layers
    for _, kwargs in counter.calls:
        assert set(kwargs) == {"attn_mask", "enable_gqa", "scale"}
        assert kwargs["attn_mask"] is batch["attn_mask"]
        assert kwargs["enable_gqa"] is True


def test_flux_calls_plain_sdpa_once_per_block() -> None:
    config = FluxConfig(n_double=2, n_single=3)
    model = flux_model(config, seed=8)
    batch = make_flux_batch(config, batch_size=1, txt_len=3, img_len=4, generator=gen(9))
    with SDPACounter() as counter:
        flux_forward(model, batch)
    assert len(counter.calls) == config.n_double + config.n_single
    for args, kwargs in counter.calls:
        assert kwargs == {}
        assert all(t.shape == (1, config.n_heads, 7, config.head_dim) for t in args)


def test_flux_with_attn_mask_passes_it_to_every_sdpa_call() -> None:
    config = FluxConfig()
    model = flux_model(config, seed=10)
    batch = make_flux_batch(config, batch_size=1, txt_len=3, img_len=4, generator=gen(11))
    batch["attn_mask"] = torch.ones(7, 7, dtype=torch.bool)
    with SDPACounter() as counter:
        flux_forward(model, batch)
    assert [kwargs for _, kwargs in counter.calls] == [{"attn_mask": batch["attn_mask"]}] * 2


def test_llama_packed_document_with_document_mask_matches_document_alone() -> None:
    config = LlamaConfig()
    model = llama_model(config, seed=12, dtype=torch.float64)
    lengths = [5, 0, 8, 3]
    batch = make_llama_batch(config, lengths, generator=gen(13), with_attn_mask=True)
    packed_logits_BLV = model(batch["input_ids"], batch["position_ids"], batch["attn_mask"])
    start = 0
    for n in lengths:
        if n == 0:  # an empty document occupies no tokens; nothing to compare
            continue
        doc_ids_BL = batch["input_ids"][:, start : start + n]
        alone_logits_BLV = model(doc_ids_BL, torch.arange(n)[None])
        err = (packed_logits_BLV[:, start : start + n] - alone_logits_BLV).abs().max().item()
        assert err <= 1e-10, f"document at {start} (len {n}) differs by {err}"
        start += n


def test_llama_logits_change_with_position_ids() -> None:
    config = LlamaConfig()
    model = llama_model(config, seed=14)
    input_ids_BL = torch.randint(0, config.vocab_size, (1, 8), generator=gen(15))
    logits_BLV = model(input_ids_BL, torch.arange(8)[None])
    shifted_logits_BLV = model(input_ids_BL, torch.arange(8)[None] * 3 + 1)
    # Token 0 attends only to itself, where RoPE cancels; later tokens must see the change.
    assert not torch.allclose(logits_BLV[:, 1:], shifted_logits_BLV[:, 1:], atol=1e-4)


def test_make_llama_batch_restarts_positions_and_masks_labels_at_document_ends() -> None:
    config = LlamaConfig()
    batch = make_llama_batch(config, [0, 3, 1, 2], generator=gen(16), with_attn_mask=True)
    ids_L = batch["input_ids"][0]
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 0, 1]]
    assert batch["labels"][0].tolist() == [ids_L[1], ids_L[2], -100, -100, ids_L[5], -100]
    assert torch.equal(batch["attn_mask"], document_causal_mask([3, 1, 2]))


def test_make_flux_batch_has_zero_text_ids_and_image_grid_ids() -> None:
    config = FluxConfig()
    batch = make_flux_batch(config, batch_size=2, txt_len=3, img_len=6, generator=gen(17), grid_width=3)
    assert torch.equal(batch["txt_ids"], torch.zeros(2, 3, 3))
    expected_I3 = torch.tensor([[0, r, c] for r in range(2) for c in range(3)], dtype=torch.float32)
    assert torch.equal(batch["img_ids"], expected_I3.expand(2, -1, -1))


@pytest.mark.parametrize("axes_dims", [(4, 6, 4), (4, 6, 8), (5, 5, 6)])
def test_flux_config_rejects_axes_dims_not_splitting_head_dim_into_even_parts(
    axes_dims: tuple[int, ...],
) -> None:
    with pytest.raises(ValueError):
        FluxConfig(axes_dims=axes_dims)


def flux_args(batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
    keys = ("img", "txt", "timesteps", "img_ids", "txt_ids", "pooled")
    return tuple(batch[k] for k in keys)


def flux_sse_and_grads(
    model: Flux, batches: list[dict[str, torch.Tensor]]
) -> tuple[list[torch.Tensor], dict[str, torch.Tensor]]:
    """Outputs of each batch, and the gradients of their summed squared error to the targets."""
    outs = [model(*flux_args(b), txt_doc_T=b.get("txt_doc"), img_doc_I=b.get("img_doc")) for b in batches]
    sse = sum(((out - b["target"]) ** 2).sum() for out, b in zip(outs, batches, strict=True))
    names, params = zip(*model.named_parameters(), strict=True)
    grads = torch.autograd.grad(sse, params)
    return [out.detach() for out in outs], dict(zip(names, grads, strict=True))


def sample_of_packed(
    batch: dict[str, torch.Tensor], txt_lens: list[int], img_lens: list[int], n: int
) -> dict[str, torch.Tensor]:
    """Sample n of a packed batch as an ordinary one-row batch."""
    t0, i0 = sum(txt_lens[:n]), sum(img_lens[:n])
    t_sl, i_sl = slice(t0, t0 + txt_lens[n]), slice(i0, i0 + img_lens[n])
    return {
        "img": batch["img"][:, i_sl],
        "txt": batch["txt"][:, t_sl],
        "timesteps": batch["timesteps"][n : n + 1],
        "img_ids": batch["img_ids"][:, i_sl],
        "txt_ids": batch["txt_ids"][:, t_sl],
        "pooled": batch["pooled"][n : n + 1],
        "target": batch["target"][:, i_sl],
    }


def test_make_packed_flux_batch_indexes_samples_and_sums_joint_lengths() -> None:
    config = FluxConfig()
    batch, joint_lens = make_packed_flux_batch(config, [2, 0, 1], [3, 4, 1], generator=gen(18))
    assert joint_lens == [5, 4, 2]
    assert batch["txt_doc"].tolist() == [0, 0, 2]
    assert batch["img_doc"].tolist() == [0, 0, 0, 1, 1, 1, 1, 2]
    assert batch["timesteps"].shape == (3,) and batch["pooled"].shape == (3, config.pooled_dim)
    assert batch["img"].shape == batch["target"].shape == (1, 8, config.in_channels)
    # Every sample's image ids are its own grid, starting again at (0, 0).
    grid = [[0, 0], [0, 1], [1, 0]]
    assert batch["img_ids"][0, :, 1:].tolist() == grid + [*grid, [1, 1]] + [[0, 0]]


def test_packed_layout_orders_each_samples_text_then_image() -> None:
    txt_doc_T = torch.tensor([0, 0, 2, 3])
    img_doc_I = torch.tensor([0, 1, 1, 3, 3])
    layout = packed_layout(txt_doc_T, img_doc_I)
    # Stream order [t0 t1 t2 t3 | i0 i1 i2 i3 i4] -> document order t0 t1 i0 | i1 i2 | t2 | t3 i3 i4.
    assert layout.perm_S.tolist() == [0, 1, 4, 5, 6, 2, 3, 7, 8]
    assert layout.joint_doc_S.tolist() == [0, 0, 0, 1, 1, 2, 3, 3, 3]
    assert layout.txt_pos_T.tolist() == [0, 1, 5, 6]
    assert layout.img_pos_I.tolist() == [2, 3, 4, 7, 8]


def test_flux_packed_samples_match_each_sample_alone_float64() -> None:
    config = FluxConfig(n_double=2, n_single=2)
    model = flux_model(config, seed=19, dtype=torch.float64)
    g = gen(20)
    txt_lens = torch.randint(1, 7, (5,), generator=g).tolist()
    img_lens = torch.randint(1, 13, (5,), generator=g).tolist()
    txt_lens[1], img_lens[3] = 1, 1  # a one-token text and a one-token image
    batch, joint_lens = make_packed_flux_batch(config, txt_lens, img_lens, generator=g, dtype=torch.float64)
    meta = AttentionMetadata.from_lengths(joint_lens, max_docs=8)

    with attention_mode(meta) as mode:
        (packed_out_BIC,), packed_grads = flux_sse_and_grads(model, [batch])
    assert mode.calls == config.n_double + config.n_single
    samples = [sample_of_packed(batch, txt_lens, img_lens, n) for n in range(len(txt_lens))]
    alone_outs, alone_grads = flux_sse_and_grads(model, samples)

    assert rel_err(packed_out_BIC, torch.cat(alone_outs, dim=1)) <= 1e-10
    for name, grad in packed_grads.items():
        assert rel_err(grad, alone_grads[name]) <= 1e-10, name
        assert torch.isfinite(grad).all() and grad.abs().sum() > 0, f"{name} grad is zero or not finite"


def test_flux_loss_on_packed_batch_is_mse_over_every_image_token() -> None:
    config = FluxConfig()
    model = flux_model(config, seed=21)
    batch, joint_lens = make_packed_flux_batch(config, [3, 2], [4, 6], generator=gen(22))
    with attention_mode(AttentionMetadata.from_lengths(joint_lens)):
        out_BIC = model(*flux_args(batch), txt_doc_T=batch["txt_doc"], img_doc_I=batch["img_doc"])
        loss = flux_loss(model, batch)
    assert torch.equal(loss, F.mse_loss(out_BIC, batch["target"]))


@pytest.mark.parametrize(
    "key,value,match",
    [
        ("txt_doc", torch.tensor([0, 1]), "txt_doc_T has 2 entries but the row has 3"),
        ("img_doc", torch.tensor([0, 1, 1, 0, 1]), "img_doc_I must be non-decreasing"),
        ("txt_doc", torch.tensor([0, 1, 2]), r"sample indices in \[0, 2\] but .* N = 2"),
        ("img_doc", torch.tensor([0, 0, 1, 1, 1], dtype=torch.int32), "1-D int64"),
        ("timesteps", torch.rand(3), "one timestep and one pooled vector per sample"),
    ],
)
def test_flux_packed_rejects_inconsistent_sample_indices(key: str, value: torch.Tensor, match: str) -> None:
    config = FluxConfig()
    model = flux_model(config, seed=23)
    batch, _ = make_packed_flux_batch(config, [2, 1], [3, 2], generator=gen(24))
    batch[key] = value
    with pytest.raises(ValueError, match=match):
        model(*flux_args(batch), txt_doc_T=batch["txt_doc"], img_doc_I=batch["img_doc"])
