"""`attention_mode`: route every SDPA call through `sdpa_to_usp`, in eager."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .metadata import AttentionMetadata
from .sdpa import sdpa_to_usp

__all__ = ["attention_mode"]

# F.scaled_dot_product_attention is the C function itself; list both spellings in case a release
# wraps it in Python.
_SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _SDPAToUSP(TorchFunctionMode):
    def __init__(self, metadata: AttentionMetadata | None, cp) -> None:
        super().__init__()
        self.metadata = metadata
        self.cp = cp
        self.calls = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SDPA_FUNCS:
            self.calls += 1
            return sdpa_to_usp(*args, **kwargs, metadata=self.metadata, cp=self.cp)
        return func(*args, **kwargs)


@contextlib.contextmanager
def attention_mode(metadata: AttentionMetadata | None = None, *, cp=None) -> Iterator[_SDPAToUSP]:
    """Run every `F.scaled_dot_product_attention` call inside through `sdpa_to_usp`.

    `metadata=None`: one document per batch row (SDPA's own semantics). With metadata, each call's
    `B * L` tokens (row-major) are the packed stream it describes and documents are isolated.
    With `cp` (a `usp_graph.ContextParallel`), SDPA inputs are this rank's sequence shards and
    `metadata` describes the global stream of all ranks' tokens.
    The yielded object counts the calls it routed (`.calls`).
    """
    if metadata is not None and not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"metadata must be a usp_graph.AttentionMetadata or None, got {type(metadata).__name__}"
        )
    if cp is not None:
        from .cp import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a usp_graph.ContextParallel or None, got {type(cp).__name__}")
    mode = _SDPAToUSP(metadata, cp)
    with mode:
        yield mode
