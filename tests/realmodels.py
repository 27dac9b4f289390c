"""Tiny random-init HuggingFace models (transformers, diffusers) and references for the real-model tests.

Every model is built from a config (no download), seeded, in fp64, with SDPA attention and no
dropout, so one run is a deterministic function of its inputs. Each factory imports its library
lazily: a test module calls `pytest.importorskip` first and skips cleanly without it.

    model = make_lm("llama")                          # fp64, attn_implementation="sdpa"
    out = lm_forward(model, ids_BL, pos_BL, use_cache=False)
    ref = per_document(lambda s: lm_forward(model, ids_BL[:, s], pos_BL[:, s]), lengths)

# B batch, L sequence (tokens of one row), T packed tokens, D model width, N documents
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = [
    "LM_SPECS",
    "LMSpec",
    "checkpoint_layers",
    "compile_usp",
    "grads",
    "lm_batch",
    "lm_forward",
    "make_lm",
    "make_flux",
    "make_sd3",
    "make_wan",
    "flux_inputs",
    "sd3_inputs",
    "wan_inputs",
    "max_err",
    "packed_positions",
    "per_document",
    "weighted_loss",
]

VOCAB = 64
WIDTH = 32  # hidden size of every tiny model
HEADS, KV_HEADS = 4, 2
WINDOW = 4  # sliding window (tokens a query sees, itself included), shorter than the documents


@dataclass(frozen=True)
class LMSpec:
    """One transformers model of the suite.

    causal: a decoder (use_cache applies; the loss reads logits); False for an encoder (BERT: no
    cache, bidirectional, the output is the last hidden state).
    tol: fp64 max error allowed vs each document run alone. Gemma3's RMSNorm computes in fp32 even
    when the model is fp64 (`Gemma3RMSNorm._norm(x.float())`), so its hidden states carry fp32
    rounding: a 1e-16 difference in attention can flip an fp32 rounding and show up as ~1e-7.
    """

    name: str
    causal: bool = True
    tol: float = 1e-10


LM_SPECS = {
    s.name: s
    for s in (
        LMSpec("llama"),
        LMSpec("qwen2"),  # sliding window on its second layer (use_sliding_window, max_window_layers=1)
        LMSpec("mistral"),  # sliding window on every layer
        LMSpec("gemma3", tol=1e-6),  # layer_types: sliding then full; fp32 RMSNorm (see LMSpec.tol)
        LMSpec("gpt2"),
        LMSpec("bert", causal=False),
    )
}


def _lm_config(name: str):
    import transformers

    common = dict(vocab_size=VOCAB, max_position_embeddings=64, attn_implementation="sdpa")
    decoder = dict(
        hidden_size=WIDTH,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        **common,
    )
    if name == "llama":
        return transformers.LlamaConfig(**decoder), transformers.LlamaForCausalLM
    if name == "qwen2":
        cfg = transformers.Qwen2Config(
            use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1, **decoder
        )
        return cfg, transformers.Qwen2ForCausalLM
    if name == "mistral":
        return transformers.MistralConfig(sliding_window=WINDOW, **decoder), transformers.MistralForCausalLM
    if name == "gemma3":
        cfg = transformers.Gemma3TextConfig(
            head_dim=WIDTH // HEADS,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "full_attention"],
            **decoder,
        )
        return cfg, transformers.Gemma3ForCausalLM
    if name == "gpt2":
        cfg = transformers.GPT2Config(
            n_embd=WIDTH,
            n_layer=2,
            n_head=HEADS,
            n_positions=64,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
            vocab_size=VOCAB,
            bos_token_id=0,
            eos_token_id=0,
            attn_implementation="sdpa",
        )
        return cfg, transformers.GPT2LMHeadModel
    if name == "bert":
        cfg = transformers.BertConfig(
            hidden_size=WIDTH,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=HEADS,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
            **common,
        )
        # No pooler: the loss reads the last hidden state only, and an unused pooler would get None
        # grads in eager but zeros from a compiled graph (AOTAutograd's convention, not usp's).
        return cfg, lambda c: transformers.BertModel(c, add_pooling_layer=False)
    raise ValueError(f"unknown model {name!r}; one of {sorted(LM_SPECS)}")


def make_lm(name: str, *, seed: int = 0) -> nn.Module:
    """A tiny random-init transformers model `name` (see `LM_SPECS`), fp64, SDPA attention."""
    config, cls = _lm_config(name)
    torch.manual_seed(seed)
    model = cls(config).double()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    return model


def lm_forward(model: nn.Module, ids_BL: torch.Tensor, pos_BL: torch.Tensor, *, use_cache: bool = False):
    """The model's output tensor: logits of a decoder, the last hidden state of BERT.

    use_cache=False is transformers' training path: with no attention mask it builds a
    packed-sequence mask from the position ids. use_cache=True leaves the mask out (is_causal)."""
    if model.config.model_type == "bert":
        return model(input_ids=ids_BL, position_ids=pos_BL).last_hidden_state
    return model(input_ids=ids_BL, position_ids=pos_BL, use_cache=use_cache).logits


def packed_positions(lengths: Sequence[int]) -> torch.Tensor:
    """(1, sum(lengths)) position ids restarting at 0 at every document."""
    return torch.cat([torch.arange(n) for n in lengths])[None]


def lm_batch(rows: int, length: int, *, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids_BL, pos_BL): random token ids and positions 0..L-1 on every row (one document per row)."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, length), generator=gen)
    return ids, torch.arange(length).expand(rows, length).contiguous()


def checkpoint_layers(model: nn.Module, use_reentrant: bool | None = None) -> None:
    """transformers' own activation checkpointing (its default kind where `use_reentrant` is None):
    `activation_checkpointing_enable` from transformers 5.23, `gradient_checkpointing_enable`
    (deprecated there) before."""
    kwargs = None if use_reentrant is None else {"use_reentrant": use_reentrant}
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def compile_usp(model: nn.Module, **options) -> nn.Module:
    """`torch.compile(model, backend="usp")` with the bitwise inner compiler (aot_eager)."""
    return torch.compile(model, backend="usp", options={"inner": "aot_eager", **options})


def weighted_loss(out: torch.Tensor, *, seed: int = 123) -> torch.Tensor:
    """sum(out * W) for a fixed random W: linear in every output element, so the loss of a packed
    row is the sum of its documents' losses and their grads add up."""
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(out.shape, generator=gen, dtype=out.dtype)
    return (out * weight).sum()


def per_document(
    run: Callable[[slice], torch.Tensor], lengths: Sequence[int], *, dim: int = 1
) -> torch.Tensor:
    """Concatenate `run(slice of document i)` over the documents along `dim` (each run alone)."""
    outs, start = [], 0
    for n in lengths:
        outs.append(run(slice(start, start + n)))
        start += n
    return torch.cat(outs, dim)


def grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """name -> grad of every parameter that got one (cloned); then the grads are cleared."""
    out = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return out


def max_err(got, ref) -> float:
    """Max absolute difference of two tensors, or over two dicts of tensors with the same keys."""
    if isinstance(ref, dict):
        assert got.keys() == ref.keys(), sorted(set(got) ^ set(ref))
        return max(max_err(got[k], ref[k]) for k in ref)
    assert got.shape == ref.shape, (got.shape, ref.shape)
    return (got.double() - ref.double()).abs().max().item()


# ---- diffusers ------------------------------------------------------------------------------------


def make_flux(*, seed: int = 0) -> nn.Module:
    """A tiny `FluxTransformer2DModel` (one double and one single stream block), fp64."""
    from diffusers import FluxTransformer2DModel

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1,
        in_channels=8,
        num_layers=1,
        num_single_layers=1,
        attention_head_dim=16,
        num_attention_heads=2,
        joint_attention_dim=32,
        pooled_projection_dim=16,
        axes_dims_rope=(4, 6, 6),
    ).double()


def flux_inputs(batch: int, txt: int, img: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Keyword inputs of `make_flux()`'s model: `img` image tokens and `txt` text tokens per sample."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    img_ids = torch.zeros(img, 3, dtype=torch.float64)
    img_ids[:, 1] = torch.arange(img) // 4
    img_ids[:, 2] = torch.arange(img) % 4
    return {
        "hidden_states": torch.randn(batch, img, 8, **f64),
        "encoder_hidden_states": torch.randn(batch, txt, 32, **f64),
        "pooled_projections": torch.randn(batch, 16, **f64),
        "timestep": torch.rand(batch, **f64),
        "img_ids": img_ids,
        "txt_ids": torch.zeros(txt, 3, dtype=torch.float64),
    }


def make_sd3(*, seed: int = 0) -> nn.Module:
    """A tiny `SD3Transformer2DModel` (one joint block), fp64."""
    from diffusers import SD3Transformer2DModel

    torch.manual_seed(seed)
    return SD3Transformer2DModel(
        sample_size=4,
        patch_size=1,
        in_channels=4,
        num_layers=1,
        attention_head_dim=8,
        num_attention_heads=4,
        joint_attention_dim=32,
        caption_projection_dim=32,
        pooled_projection_dim=16,
        out_channels=4,
        pos_embed_max_size=8,
    ).double()


def sd3_inputs(batch: int, txt: int, *, seed: int) -> dict[str, torch.Tensor]:
    """Keyword inputs of `make_sd3()`'s model: a 4x4 latent (16 image tokens) and `txt` text tokens."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    return {
        "hidden_states": torch.randn(batch, 4, 4, 4, **f64),
        "encoder_hidden_states": torch.randn(batch, txt, 32, **f64),
        "pooled_projections": torch.randn(batch, 16, **f64),
        "timestep": torch.rand(batch, **f64) * 1000,
    }


WAN_CHANNELS = 4


def make_wan(*, seed: int = 0) -> nn.Module:
    """A tiny `WanTransformer3DModel` (one block: self-attention, then cross-attention to text), fp64."""
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    return WanTransformer3DModel(
        patch_size=(1, 2, 2),
        num_attention_heads=2,
        attention_head_dim=16,
        in_channels=WAN_CHANNELS,
        out_channels=WAN_CHANNELS,
        text_dim=32,
        freq_dim=32,
        ffn_dim=64,
        num_layers=1,
        rope_max_seq_len=32,
    ).double()


def wan_inputs(batch: int, frames: int, txt: int, *, seed: int, size: int = 4) -> dict[str, torch.Tensor]:
    """Keyword inputs of `make_wan()`'s model: a video of `frames` x `size` x `size` pixels (patches
    of 1x2x2: frames * size**2 / 4 tokens) and `txt` text tokens."""
    gen = torch.Generator().manual_seed(seed)
    f64 = dict(generator=gen, dtype=torch.float64)
    return {
        "hidden_states": torch.randn(batch, WAN_CHANNELS, frames, size, size, **f64),
        "encoder_hidden_states": torch.randn(batch, txt, 32, **f64),
        "timestep": torch.rand(batch, **f64) * 1000,
    }


# ---- the model-family sweep (tools/sweep_models.py, tests/test_model_sweep.py) -------------------
#
# More transformers families, each tiny and fp64 from a config, every dropout probability zeroed
# (the checks run in training mode). kind: "decoder" (logits, use_cache=False), "encoder" (last
# hidden state) or "seq2seq" (an encoder-decoder: packed source and target documents, document i of
# the target reads document i of the source through cross-attention).


@dataclass(frozen=True)
class SweepSpec:
    """One family of the sweep: its config class and model class names in transformers, the config
    keywords on top of the family's defaults, its kind and its fp64 tolerance (see `LMSpec.tol`)."""

    name: str
    config: str
    model: str
    kwargs: tuple = ()
    kind: str = "decoder"
    tol: float = 1e-10
    model_kwargs: tuple = ()
    no_positions: bool = False  # learned position embeddings replaced by zeros (see make_sweep_model)
    experts: str = (
        "batched_mm"  # MoE experts (transformers' experts_implementation); grouped_mm has no fp64 kernel
    )


_DEC = dict(
    hidden_size=WIDTH,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=HEADS,
    num_key_value_heads=KV_HEADS,
)
_ENC = dict(hidden_size=WIDTH, intermediate_size=64, num_hidden_layers=2, num_attention_heads=HEADS)


def _kw(*dicts, **extra) -> tuple:
    out: dict = {}
    for d in dicts:
        out.update(d)
    out.update(extra)
    return tuple(sorted(out.items()))


_SLIDE2 = dict(sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"])
# No pooler: an unused pooler gets None grads in eager but zeros from a compiled graph (see _lm_config).
_NO_POOLER = (("add_pooling_layer", False),)
_FP32_NORM = 1e-6  # Gemma and Helium RMSNorm, Cohere LayerNorm: fp32 even in fp64 models (see LMSpec.tol)

SWEEP_SPECS = {
    s.name: s
    for s in (
        SweepSpec("llama", "LlamaConfig", "LlamaForCausalLM", _kw(_DEC)),
        SweepSpec("phi3", "Phi3Config", "Phi3ForCausalLM", _kw(_DEC, partial_rotary_factor=0.5)),
        SweepSpec("qwen3", "Qwen3Config", "Qwen3ForCausalLM", _kw(_DEC, head_dim=8)),
        SweepSpec(
            "qwen3_moe",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            _kw(_DEC, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
        ),
        SweepSpec(  # eager experts loop over the experts hit: a graph break between the mask and attention
            "qwen3_moe_eager",
            "Qwen3MoeConfig",
            "Qwen3MoeForCausalLM",
            _kw(_DEC, head_dim=8, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16),
            experts="eager",
        ),
        SweepSpec("olmo", "OlmoConfig", "OlmoForCausalLM", _kw(_DEC, clip_qkv=8.0)),
        SweepSpec("olmo2", "Olmo2Config", "Olmo2ForCausalLM", _kw(_DEC)),
        SweepSpec("olmo3", "Olmo3Config", "Olmo3ForCausalLM", _kw(_DEC, **_SLIDE2)),
        SweepSpec("granite", "GraniteConfig", "GraniteForCausalLM", _kw(_DEC, attention_multiplier=0.3)),
        SweepSpec(
            "starcoder2", "Starcoder2Config", "Starcoder2ForCausalLM", _kw(_DEC, sliding_window=WINDOW)
        ),
        SweepSpec(
            "stablelm",
            "StableLmConfig",
            "StableLmForCausalLM",
            _kw(_DEC, partial_rotary_factor=0.5, qk_layernorm=True),
        ),
        SweepSpec(
            "gpt_neox",
            "GPTNeoXConfig",
            "GPTNeoXForCausalLM",
            _kw(_ENC, rotary_pct=0.25, use_parallel_residual=True),
        ),
        SweepSpec("cohere", "CohereConfig", "CohereForCausalLM", _kw(_DEC, use_qk_norm=True), tol=_FP32_NORM),
        SweepSpec("cohere2", "Cohere2Config", "Cohere2ForCausalLM", _kw(_DEC, **_SLIDE2), tol=_FP32_NORM),
        SweepSpec("glm", "GlmConfig", "GlmForCausalLM", _kw(_DEC, head_dim=8)),
        SweepSpec("glm4", "Glm4Config", "Glm4ForCausalLM", _kw(_DEC, head_dim=8)),
        SweepSpec("smollm3", "SmolLM3Config", "SmolLM3ForCausalLM", _kw(_DEC, no_rope_layers=[1, 0])),
        SweepSpec(
            "mixtral",
            "MixtralConfig",
            "MixtralForCausalLM",
            _kw(_DEC, num_local_experts=4, sliding_window=WINDOW),
        ),
        SweepSpec("ministral", "MinistralConfig", "MinistralForCausalLM", _kw(_DEC, head_dim=8, **_SLIDE2)),
        SweepSpec("gemma", "GemmaConfig", "GemmaForCausalLM", _kw(_DEC, head_dim=8), tol=_FP32_NORM),
        SweepSpec("helium", "HeliumConfig", "HeliumForCausalLM", _kw(_DEC, head_dim=8), tol=_FP32_NORM),
        SweepSpec("exaone4", "Exaone4Config", "Exaone4ForCausalLM", _kw(_DEC, **_SLIDE2)),
        SweepSpec("ernie4_5", "Ernie4_5Config", "Ernie4_5ForCausalLM", _kw(_DEC, head_dim=8)),
        SweepSpec("apertus", "ApertusConfig", "ApertusForCausalLM", _kw(_DEC)),
        SweepSpec("arcee", "ArceeConfig", "ArceeForCausalLM", _kw(_DEC)),
        SweepSpec("nemotron", "NemotronConfig", "NemotronForCausalLM", _kw(_DEC, partial_rotary_factor=0.5)),
        SweepSpec("persimmon", "PersimmonConfig", "PersimmonForCausalLM", _kw(_ENC, qk_layernorm=True)),
        SweepSpec(
            "falcon",
            "FalconConfig",
            "FalconForCausalLM",
            _kw(_ENC, num_kv_heads=KV_HEADS, new_decoder_architecture=True, alibi=False),
        ),
        SweepSpec(
            "opt",
            "OPTConfig",
            "OPTForCausalLM",
            _kw(
                hidden_size=WIDTH,
                ffn_dim=64,
                num_hidden_layers=2,
                num_attention_heads=HEADS,
                word_embed_proj_dim=WIDTH,
            ),
        ),
        SweepSpec(
            "gptj", "GPTJConfig", "GPTJForCausalLM", _kw(n_embd=WIDTH, n_layer=2, n_head=HEADS, rotary_dim=4)
        ),
        SweepSpec(
            "phi", "PhiConfig", "PhiForCausalLM", _kw(_ENC, partial_rotary_factor=0.5, qk_layernorm=True)
        ),
        SweepSpec(
            "codegen",
            "CodeGenConfig",
            "CodeGenForCausalLM",
            _kw(n_embd=WIDTH, n_layer=2, n_head=HEADS, rotary_dim=4),
        ),
        SweepSpec(
            "gpt_bigcode",
            "GPTBigCodeConfig",
            "GPTBigCodeForCausalLM",
            _kw(n_embd=WIDTH, n_layer=2, n_head=HEADS, multi_query=True),
        ),
        SweepSpec(  # multi-head latent attention: value head dim 8, query/key head dim 16 (8 of them rotary)
            "deepseek_v3",
            "DeepseekV3Config",
            "DeepseekV3ForCausalLM",
            _kw(
                _DEC,
                num_key_value_heads=HEADS,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=8,
                qk_nope_head_dim=8,
                v_head_dim=8,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                moe_intermediate_size=16,
                first_k_dense_replace=2,  # dense layers only: its MoE router computes in fp32
            ),
        ),
        SweepSpec(
            "olmoe", "OlmoeConfig", "OlmoeForCausalLM", _kw(_DEC, num_experts=4, num_experts_per_tok=2)
        ),
        SweepSpec("granitemoe", "GraniteMoeConfig", "GraniteMoeForCausalLM", _kw(_DEC, num_local_experts=4)),
        SweepSpec(
            "qwen2_moe",
            "Qwen2MoeConfig",
            "Qwen2MoeForCausalLM",
            _kw(_DEC, num_experts=4, moe_intermediate_size=16, shared_expert_intermediate_size=16),
        ),
        SweepSpec("seed_oss", "SeedOssConfig", "SeedOssForCausalLM", _kw(_DEC, head_dim=8)),
        SweepSpec(
            "hunyuan_v1_dense", "HunYuanDenseV1Config", "HunYuanDenseV1ForCausalLM", _kw(_DEC, head_dim=8)
        ),
        SweepSpec("bitnet", "BitNetConfig", "BitNetForCausalLM", _kw(_DEC)),
        SweepSpec("lfm2", "Lfm2Config", "Lfm2ForCausalLM", _kw(_DEC, layer_types=["conv", "full_attention"])),
        SweepSpec(
            "modernbert_decoder",
            "ModernBertDecoderConfig",
            "ModernBertDecoderForCausalLM",
            _kw(_ENC, global_attn_every_n_layers=2, local_attention=WINDOW),
        ),
        SweepSpec(
            "roberta", "RobertaConfig", "RobertaModel", _kw(_ENC), kind="encoder", model_kwargs=_NO_POOLER
        ),
        SweepSpec(
            "xlm_roberta",
            "XLMRobertaConfig",
            "XLMRobertaModel",
            _kw(_ENC),
            kind="encoder",
            model_kwargs=_NO_POOLER,
        ),
        SweepSpec(
            "electra", "ElectraConfig", "ElectraModel", _kw(_ENC, embedding_size=WIDTH), kind="encoder"
        ),
        SweepSpec(
            "albert",
            "AlbertConfig",
            "AlbertModel",
            _kw(_ENC, embedding_size=16),
            kind="encoder",
            model_kwargs=_NO_POOLER,
        ),
        SweepSpec(
            "distilbert",
            "DistilBertConfig",
            "DistilBertModel",
            _kw(dim=WIDTH, hidden_dim=64, n_layers=2, n_heads=HEADS),
            kind="encoder",
        ),
        SweepSpec(
            "camembert",
            "CamembertConfig",
            "CamembertModel",
            _kw(_ENC),
            kind="encoder",
            model_kwargs=_NO_POOLER,
        ),
        SweepSpec("eurobert", "EuroBertConfig", "EuroBertModel", _kw(_DEC), kind="encoder"),
        SweepSpec(
            "modernbert",
            "ModernBertConfig",
            "ModernBertModel",
            _kw(_ENC, global_attn_every_n_layers=2, local_attention=WINDOW, pad_token_id=0),
            kind="encoder",
        ),
        SweepSpec(
            "bart",
            "BartConfig",
            "BartModel",
            _kw(
                d_model=WIDTH,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
            ),
            kind="seq2seq",
        ),
        SweepSpec(
            "bart_nopos",
            "BartConfig",
            "BartModel",
            _kw(
                d_model=WIDTH,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=HEADS,
                decoder_attention_heads=HEADS,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
            ),
            kind="seq2seq",
            no_positions=True,
        ),
        SweepSpec(
            "t5",
            "T5Config",
            "T5Model",
            _kw(d_model=WIDTH, d_kv=8, d_ff=64, num_layers=1, num_decoder_layers=1, num_heads=HEADS),
            kind="seq2seq",
        ),
    )
}


def make_sweep_model(name: str, *, seed: int = 0) -> nn.Module:
    """The sweep's tiny family `name` (`SWEEP_SPECS`): fp64, SDPA attention, dropout zeroed."""
    import transformers

    spec = SWEEP_SPECS[name]
    config = getattr(transformers, spec.config)(
        vocab_size=VOCAB, max_position_embeddings=64, **dict(spec.kwargs)
    )
    for key, value in list(vars(config).items()):
        if isinstance(value, float) and ("dropout" in key or "pdrop" in key or key.endswith("_drop")):
            setattr(config, key, 0.0)
        if key.endswith("token_id") and isinstance(value, int) and value >= VOCAB:
            setattr(config, key, 0)  # the family's real vocabulary ids do not fit the tiny one
    config._attn_implementation = "sdpa"
    config._experts_implementation = spec.experts
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model)(config, **dict(spec.model_kwargs)).double()
    assert model.config._attn_implementation == "sdpa", model.config._attn_implementation
    if spec.no_positions:
        # The family's positions count along the whole row and its forward takes no position ids, so
        # they cannot restart per document (the backend refuses packed documents then). Without
        # them, the packed row runs the family's attention routing alone: what usp decides.
        for mod_name, module in list(model.named_modules()):
            if mod_name.endswith("embed_positions"):
                parent = model.get_submodule(mod_name.rpartition(".")[0])
                parent.embed_positions = _NoPositions(module.embedding_dim)
    return model


class _NoPositions(nn.Module):
    """Stands in for a learned position embedding: zeros of its width for every token."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.width = width
        # holds the model's dtype (model.float() converts it): the zeros take it
        self.register_buffer("like", torch.zeros(0, dtype=torch.float64), persistent=False)

    def forward(self, input_ids: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.like.new_zeros(*input_ids.shape[:2], self.width)
