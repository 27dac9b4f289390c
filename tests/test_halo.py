"""usp::halo_exchange and usp::halo_reduce on gloo ranks: the exchange against the global stream,
and the adjoint identity <exchange(x), y> == <x, reduce(y)> that makes the backward right."""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks

CASES = [(b, before, after) for b in (1, 3) for before, after in ((3, 0), (0, 2), (4, 4), (5, 1))]
N = 5  # tokens per rank per row


def _global(b: int, world: int, seed: int) -> torch.Tensor:
    """(B, 2, P*N, 3): the whole stream, the same on every rank."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(b, 2, world * N, 3, generator=gen, dtype=torch.float64)


def _expected(x: torch.Tensor, rank: int, world: int, before: int, after: int) -> torch.Tensor:
    """This rank's window of the stream: rows back to back, zeros past either end."""
    b = x.shape[0]
    stream = x.transpose(1, 2).reshape(b * world * N, 2, 3)  # tokens of all rows, in order
    pad = torch.zeros(before, 2, 3, dtype=x.dtype), torch.zeros(after, 2, 3, dtype=x.dtype)
    stream = torch.cat([pad[0], stream, pad[1]])
    rows = []
    for r in range(b):
        start = r * world * N + rank * N  # global position of this rank's chunk of row r
        rows.append(stream[start : start + before + N + after])  # shifted by the front padding
    return torch.stack(rows).transpose(1, 2)


def _checks(rank: int, world: int) -> list[tuple]:
    import torch.distributed as dist

    from usp_graph.distributed import group_name

    name = group_name(dist.group.WORLD)
    out = []
    for i, (b, before, after) in enumerate(CASES):
        x_glob = _global(b, world, seed=i)
        x = x_glob[:, :, rank * N : (rank + 1) * N].contiguous()
        got = torch.ops.usp.halo_exchange(x, 2, before, after, 1, name)
        exchange_ok = torch.equal(got, _expected(x_glob, rank, world, before, after))
        # Adjoint: sum over ranks of <exchange(x), y> equals sum over ranks of <x, reduce(y)>.
        y = torch.randn(
            got.shape, generator=torch.Generator().manual_seed(100 + 10 * i + rank), dtype=x.dtype
        )
        lhs = (got * y).sum()
        rhs = (x * torch.ops.usp.halo_reduce(y, 2, before, after, name)).sum()
        both = torch.stack([lhs, rhs])
        dist.all_reduce(both)
        out.append(((b, before, after), exchange_ok, abs(both[0] - both[1]).item(), abs(both[0]).item()))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2, 3])
def test_exchange_matches_the_stream_and_reduce_is_its_adjoint(world):
    for rank_results in run_ranks(_checks, world):
        for case, exchange_ok, gap, scale in rank_results:
            assert exchange_ok, (world, case)
            assert gap <= 1e-12 * max(scale, 1.0), (world, case, gap)
