"""balance_documents: a packing order whose contiguous CP shards carry equal attention work."""

from __future__ import annotations

import pytest
import torch

from usp_graph.cp import balance_documents, shard_work
from usp_graph.testing import lognormal_lengths


def _brute_work(lengths, world, causal):
    """Query-key pairs per shard, counted token by token."""
    total = sum(lengths)
    tl = total // world
    work = [0] * world
    start = 0
    for n in lengths:
        for p in range(start, start + n):
            work[p // tl] += (p - start + 1) if causal else n
        start += n
    return work


@pytest.mark.parametrize("causal", [True, False])
def test_shard_work_counts_every_query_key_pair(causal):
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        world = int(torch.randint(1, 5, (1,), generator=gen))
        lens = torch.randint(0, 30, (int(torch.randint(1, 9, (1,), generator=gen)),), generator=gen).tolist()
        lens.append(world - sum(lens) % world + world)  # make the total divisible
        assert shard_work(lens, world, is_causal=causal) == _brute_work(lens, world, causal)


@pytest.mark.parametrize("world", [2, 4, 8])
@pytest.mark.parametrize("causal", [True, False])
def test_balanced_order_is_a_permutation_and_never_worse(world, causal):
    for seed in range(6):
        lens = lognormal_lengths(4096 * world, 256, seed)
        order = balance_documents(lens, world, is_causal=causal)
        assert sorted(order) == list(range(len(lens)))
        before = shard_work(lens, world, is_causal=causal)
        after = shard_work([lens[i] for i in order], world, is_causal=causal)
        assert sum(after) == sum(before)  # the same documents, the same total work
        assert max(after) <= max(before)
        assert order == balance_documents(lens, world, is_causal=causal)  # deterministic


def test_balanced_order_evens_out_a_long_document_on_one_rank():
    # Contiguous: both long documents sit on rank 0; balanced: one per rank.
    lens = [800, 800, 0, 1] + [15] * 166 + [5]
    assert sum(lens) == 2 * 2048
    before = shard_work(lens, 2)
    after = shard_work([lens[i] for i in balance_documents(lens, 2)], 2)
    assert sum(before) / 2 / max(before) < 0.6
    assert sum(after) / 2 / max(after) > 0.95


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="world must be a positive int"):
        balance_documents([3, 4], 0)
    with pytest.raises(ValueError, match=r"lengths\[1\] must be a non-negative int"):
        balance_documents([3, -4], 2)
    with pytest.raises(ValueError, match="7 tokens do not split into 2 equal shards"):
        shard_work([3, 4], 2)
