"""Documents the compiled backend derives from position ids (a Trainer with
DataCollatorWithFlattening, no `documents` block) are cut to their count and longest document
on accelerators: one host read per call instead of a capacity of T + 1 slots with bound L, which
made flash varlen and cuDNN launch work for every empty slot (a 32K-token step 1.9x slower).

On the CPU the read is off (the CPU kernel walks the documents anyway); the tests turn it on there
to check that the cut metadata gives bitwise the same step, and that it changes per batch without
a recompile.

# B batch, L tokens per row, T packed tokens (B * L), N documents
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.realmodels import compile_usp, lm_forward, make_lm, weighted_loss  # noqa: E402
from usp_graph import masks  # noqa: E402
from usp_graph.backend import inputs  # noqa: E402
from usp_graph.metadata import capacity_bucket, fit_to_documents  # noqa: E402


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def test_capacity_buckets():
    assert [capacity_bucket(n) for n in range(0, 14)] == [1, 1, 2, 3, 4, 6, 6, 8, 8, 12, 12, 12, 12, 16]
    for n in [*range(1, 5000), 20832, 83299, 2**20 + 1]:
        b = capacity_bucket(n)
        assert n <= b <= max(2, 1.5 * n) and capacity_bucket(b) == b


@pytest.mark.parametrize(
    "lengths",
    [[5, 1, 6, 4], [1] * 9, [16], [1, 15], [3, 3, 3, 3, 3, 1]],
    ids=["mixed", "all-length-1", "one", "short-then-long", "equal"],
)
def test_fit_keeps_every_document_and_cuts_the_empty_slots(lengths):
    pos = _positions(lengths)
    tokens = sum(lengths)
    cu = masks.cu_seqlens_from_positions(pos)  # capacity T + 1, unused slots repeat T
    assert cu.numel() == tokens + 1
    fit, bound = fit_to_documents(cu, tokens)
    n = len(lengths)
    assert fit.numel() - 1 == min(capacity_bucket(n), tokens)
    assert fit[: n + 1].tolist() == torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
    assert fit[n:].eq(tokens).all()  # unused slots stay empty
    assert bound == max(lengths)


def test_fit_of_no_tokens_is_unchanged():
    cu = torch.zeros(1, dtype=torch.int32)
    fit, bound = fit_to_documents(cu, 0)
    assert fit is cu and bound == 0


def _step(compiled, model, lengths, seed):
    ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(seed))
    model.zero_grad(set_to_none=True)
    out = lm_forward(compiled, ids, _positions(lengths))
    weighted_loss(out).backward()
    return out.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


BATCHES = [[5, 1, 6, 4], [9, 7], [1, 1, 2, 12], [3] * 5 + [1]]


def test_cut_metadata_gives_the_same_step_bitwise_and_changes_without_recompiling(monkeypatch):
    """Trainer's path: "sdpa" + backend usp, no documents block, the documents read from the mask
    transformers builds from the packed position ids."""
    torch._dynamo.reset()
    plain_model = make_lm("llama")
    plain = compile_usp(plain_model)
    want = [_step(plain, plain_model, lengths, i) for i, lengths in enumerate(BATCHES)]

    torch._dynamo.reset()
    fed = []

    def spy(cu, bound):
        got = fit_to_documents(cu, bound)
        fed.append((got[0].numel() - 1, got[1]))
        return got

    monkeypatch.setattr(inputs, "_fit_on_host", lambda cu: True)
    monkeypatch.setattr(inputs, "fit_to_documents", spy)
    model = make_lm("llama")
    compiled = compile_usp(model)
    frames, got = [], []
    for i, lengths in enumerate(BATCHES):
        got.append(_step(compiled, model, lengths, i))
        frames.append(torch._dynamo.utils.counters["stats"]["unique_graphs"])
    for (out_w, grads_w), (out_g, grads_g) in zip(want, got, strict=True):
        assert torch.equal(out_w, out_g)
        assert grads_w.keys() == grads_g.keys()
        assert all(torch.equal(grads_w[n], grads_g[n]) for n in grads_w)
    # each batch fed its own tight metadata: (capacity bucket of its document count, longest)
    expected = [(capacity_bucket(len(b)), max(b)) for b in BATCHES]
    assert sorted(set(fed)) == sorted(set(expected)) and len(fed) >= len(BATCHES)
    # no recompile after the second shape (Dynamo's first graph is static, the second dynamic)
    assert frames[-1] == frames[1]


def test_the_read_is_on_for_accelerators_only():
    assert not inputs._fit_on_host(torch.zeros(3, dtype=torch.int32))
    assert not inputs._fit_on_host(torch.zeros(3, dtype=torch.int32, device="meta"))  # no values to read
