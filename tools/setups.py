"""The reference models and inputs the CPU tools share, built one way: a Llama-style decoder (GQA,
causal) over packed documents and a Flux-style MMDiT with per-sample attention.

    from setups import FLUX_DYNAMIC, flux_model, llama_inputs, llama_model

    model = llama_model(config, seed=0)
    batch, meta = llama_inputs(config, [9, 7, 11], torch.Generator().manual_seed(1), max_docs=8)

Scripts run as ``python tools/NAME.py`` have tools/ on sys.path, so ``import setups`` just works.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from usp_graph import AttentionMetadata
from usp_graph.models import Flux, FluxConfig, Llama, LlamaConfig, make_llama_batch

__all__ = ["FLUX_DYNAMIC", "flux_model", "llama_inputs", "llama_model"]

# Flux's text and image lengths change between steps: its batch keys' dynamic dims.
FLUX_DYNAMIC: dict[str, dict[int, str]] = {
    "txt": {1: "Lt"},
    "txt_ids": {1: "Lt"},
    "img": {1: "Li"},
    "img_ids": {1: "Li"},
    "target": {1: "Li"},
}


def llama_model(config: LlamaConfig, *, seed: int = 0) -> Llama:
    """A Llama of `config`, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return Llama(config)


def llama_inputs(
    config: LlamaConfig,
    lengths: Sequence[int],
    generator: torch.Generator,
    *,
    max_docs: int,
    max_seqlen: int | None = None,
) -> tuple[dict[str, Any], AttentionMetadata]:
    """A packed batch of documents with these lengths and its metadata (from the position ids)."""
    batch = make_llama_batch(config, list(lengths), generator=generator)
    meta = AttentionMetadata.from_position_ids(
        batch["position_ids"], max_docs=max_docs, max_seqlen=max_seqlen
    )
    return batch, meta


def flux_model(config: FluxConfig, *, seed: int = 0) -> Flux:
    """A Flux of `config`, its weights drawn after ``torch.manual_seed(seed)``."""
    torch.manual_seed(seed)
    return Flux(config)
