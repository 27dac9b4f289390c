"""Shared numeric helpers for the tests."""

from __future__ import annotations

import torch


def rel_err(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in float64; absolute when ref is exactly zero (e.g. dq of a length-1 document)."""
    x, ref = x.double(), ref.double()
    denom = ref.norm().item()
    return (x - ref).norm().item() / (denom if denom > 0 else 1.0)
