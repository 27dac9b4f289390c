# B batch, L sequence, H heads, G kv heads, K head dim, D model dim, V vocab, C image channels
"""Behaviour tests for the reference models in usp_graph.models."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

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
)


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
        if func is F.scaled_dot_product_attention:
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
