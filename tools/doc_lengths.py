"""Document lengths for the benchmarks: log-normal, packed to an exact token total."""

from __future__ import annotations

import math

import torch


def lognormal_lengths(
    total: int, mean: float, seed: int, *, sigma: float = 1.0, shortest: int = 1
) -> list[int]:
    """Lengths drawn log-normal (mean `mean`, log-sd `sigma`, at least `shortest`) until they sum
    to `total`; the last one is cut to fit (and, when `shortest` > 1, a cut below it joins the one
    before). The same seed gives the same lengths on every machine."""
    gen = torch.Generator().manual_seed(seed)
    mu = math.log(mean) - sigma**2 / 2
    out: list[int] = []
    while sum(out) < total:
        n = int(torch.empty(1).log_normal_(mu, sigma, generator=gen).clamp(min=shortest).item())
        out.append(min(n, total - sum(out)))
    if shortest > 1 and len(out) > 1 and out[-1] < shortest:
        cut = out.pop()
        out[-1] += cut  # (not out[-2] += out.pop(): the index is taken before the pop)
    return out
