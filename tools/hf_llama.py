"""The transformers Llama that the GPU benchmarks time (`bench_long_gpu`, `bench_paths_gpu`,
`bench_hf_gpu`): its size arguments, the smoke test's sizes, the model, and transformers' own
activation checkpointing. One place, so the tables of those tools describe the same model."""

from __future__ import annotations

import argparse
from typing import Any

import torch

# hidden 2048, 4 layers, 16 heads, 4 KV heads, ffn 5632, vocab 32000: the long-context tables' model
SIZES = {"hidden": 2048, "layers": 4, "heads": 16, "kv_heads": 4, "ffn": 5632, "vocab": 32000}
QUICK_SIZES = {"hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "ffn": 128, "vocab": 128}


def add_size_args(p: argparse.ArgumentParser) -> None:
    """--hidden, --layers, --heads, --kv-heads, --ffn, --vocab (defaults: `SIZES`)."""
    for name, default in SIZES.items():
        p.add_argument("--" + name.replace("_", "-"), type=int, default=default)


def use_quick_sizes(a: argparse.Namespace) -> None:
    """The smoke test's tiny model (`--quick`)."""
    for name, value in QUICK_SIZES.items():
        setattr(a, name, value)


def hf_llama(a: argparse.Namespace, attn: str, *, tokens: int, device: str) -> Any:
    """A `transformers.LlamaForCausalLM` of `a`'s sizes with attention `attn`, seeded (every row the
    same weights), bf16 on CUDA (fp32 elsewhere), in training mode."""
    import transformers as tf

    torch.manual_seed(0)
    config = tf.LlamaConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
        num_attention_heads=a.heads, num_key_value_heads=a.kv_heads, max_position_embeddings=max(tokens, 2048),
        attn_implementation=attn,
    )  # fmt: skip
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = tf.LlamaForCausalLM(config).to(device=device, dtype=dtype)
    model.train()
    return model


def checkpoint_layers(model: Any) -> None:
    """transformers' own activation checkpointing, non-reentrant (5.23 renamed the entry point)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
