"""Small plain-PyTorch reference models (Llama decoder, Flux MMDiT) for exercising the pass."""

from __future__ import annotations

from usp_graph.models.flux import Flux, FluxConfig, flux_loss, make_flux_batch, make_packed_flux_batch
from usp_graph.models.llama import Llama, LlamaConfig, document_causal_mask, llama_loss, make_llama_batch

__all__ = [
    "Flux",
    "FluxConfig",
    "Llama",
    "LlamaConfig",
    "document_causal_mask",
    "flux_loss",
    "llama_loss",
    "make_flux_batch",
    "make_llama_batch",
    "make_packed_flux_batch",
]
