"""`ContextParallel("auto")`: the choice from sampled document lengths, head counts, P and measured
rates (`usp_graph.cp.auto`), and the chosen plan run on 2 gloo ranks against the fp64 reference."""

from __future__ import annotations

import math

import pytest
import torch

from tests.dist import run_ranks
from usp_graph.cp.auto import Rates, choose
from usp_graph.cp.balance import shard_work
from usp_graph.cp.cost import bytes_sent
from usp_graph.testing import attention_reference, cu_seqlens, lognormal_lengths, rel_err

# A fast link: compute decides. A slow link: bytes decide.
FAST_LINK = Rates(latency_s=1e-6, bandwidth=1e12, pair_s=1e-9)
SLOW_LINK = Rates(latency_s=1e-4, bandwidth=1e8, pair_s=1e-12)
SHAPE = {"heads": 16, "kv_heads": 4, "head_dim": 128, "element_size": 2}


def _runnable(d):
    return [c for c in d.candidates if c.refused is None]


def test_the_choice_is_the_smallest_estimate_and_every_estimate_is_the_model():
    steps = [lognormal_lengths(8192, 400, 300 + i, ones=1, empty=1) for i in range(3)]
    for rates in (FAST_LINK, SLOW_LINK):
        d = choose(steps, world=4, rates=rates, **SHAPE)
        runnable = _runnable(d)
        assert d.chosen in runnable and d.chosen.total_s == min(c.total_s for c in runnable)
        for c in runnable:
            u = c.options.get("ulysses_degree", 1)
            want_bytes = bytes_sent(c.strategy, tokens=8192, world=4, ulysses_degree=u,
                                    max_document_len=c.options.get("max_document_len"), **SHAPE)  # fmt: skip
            assert c.bytes_per_rank == want_bytes, c
            busiest = []
            for s in steps:
                if c.strategy == "ulysses":
                    busiest.append(sum(shard_work(s, 1)) / 4)  # 16 heads over 4 ranks: a quarter each
                elif c.strategy == "usp":
                    busiest.append(max(shard_work(s, 4 // u)) / u)
                elif c.strategy == "ring":  # zigzag: chunks p and 2P-1-p
                    w = shard_work(s, 8)
                    busiest.append(max(w[p] + w[7 - p] for p in range(4)))
                else:
                    busiest.append(max(shard_work(s, 4)))
            assert math.isclose(c.compute_s, sum(busiest) / 3 * rates.pair_s, rel_tol=1e-12), c


def test_many_short_documents_on_a_slow_link_pick_halo_with_the_longest_sampled_document():
    steps = [[64] * 127 + [56, 8], [32] * 256]  # 8192 tokens; no document near a shard's 2048
    d = choose(steps, world=4, rates=SLOW_LINK, **SHAPE)
    assert d.strategy == "halo" and d.options == {"max_document_len": 64}, d.line()
    assert "halo(max_document_len=64)" in d.line() and "next:" in d.line()


def test_a_document_longer_than_a_shard_rules_halo_out_and_says_why():
    steps = [[5000, 1000, 2192]]
    d = choose(steps, world=4, rates=SLOW_LINK, **SHAPE)
    halo = next(c for c in d.candidates if c.strategy == "halo")
    assert halo.refused == "the longest sampled document (5000 tokens) is longer than a shard + 1 (2049)"
    assert d.strategy != "halo" and "cannot run: halo(max_document_len=5000): the longest" in d.line()
    # Compute decides on a fast link: contiguous shards leave the long document's rank busiest,
    # Ulysses splits heads evenly, so it wins over allgather_kv.
    fast = choose(steps, world=4, rates=FAST_LINK, **SHAPE)
    assert fast.strategy in ("ulysses", "ring"), fast.line()


def test_too_few_heads_rule_ulysses_out_and_bidirectional_ring_needs_no_zigzag():
    d = choose([[100, 28]], world=4, heads=2, kv_heads=1, head_dim=8, element_size=4, rates=FAST_LINK,
               is_causal=False)  # fmt: skip
    uly = next(c for c in d.candidates if c.strategy == "ulysses")
    assert uly.refused == "2 heads cannot be split over 4 ranks"
    ring = next(c for c in d.candidates if c.strategy == "ring")
    assert ring.options == {} and ring.refused is None


def test_bad_samples_and_rates_are_refused_with_what_to_fix():
    with pytest.raises(ValueError, match="not empty"):
        choose([], world=2, rates=FAST_LINK, **SHAPE)
    with pytest.raises(ValueError, match="same length; step 0 holds 10 tokens, step 1 12"):
        choose([[5, 5], [6, 6]], world=2, rates=FAST_LINK, **SHAPE)
    with pytest.raises(ValueError, match="length -1"):
        choose([[5, -1, 6]], world=2, rates=FAST_LINK, **SHAPE)
    with pytest.raises(ValueError, match="no strategy can run these steps: ulysses: 11 tokens do not split"):
        choose([[11]], world=2, rates=FAST_LINK, **SHAPE)
    with pytest.raises(ValueError, match="head_dim must be a positive int, got 0"):
        choose([[8]], world=2, heads=2, kv_heads=1, head_dim=0, element_size=2, rates=FAST_LINK)
    with pytest.raises(ValueError, match=r"heads \(6\) must be a multiple of kv_heads \(4\)"):
        choose([[8]], world=2, heads=6, kv_heads=4, head_dim=8, element_size=2, rates=FAST_LINK)
    with pytest.raises(ValueError, match="bandwidth > 0"):
        Rates(latency_s=0.0, bandwidth=0.0, pair_s=1.0)
    with pytest.raises(ValueError, match="finite"):
        Rates(latency_s=float("nan"), bandwidth=1.0, pair_s=1.0)


def test_auto_takes_no_fixed_options_and_named_strategies_take_no_auto_inputs():
    from usp_graph import ContextParallel

    with pytest.raises(ValueError, match="strategy 'auto' chooses ulysses_degree itself"):
        ContextParallel("auto", ulysses_degree=2, documents=[4], heads=2, head_dim=8)
    with pytest.raises(ValueError, match="strategy 'auto' needs heads, head_dim"):
        ContextParallel("auto", documents=[4])
    with pytest.raises(ValueError, match="documents, heads: only for strategy 'auto', not 'ring'"):
        ContextParallel("ring", documents=[4], heads=2)


# ---- on 2 gloo ranks: rates measured, one decision everywhere, the plan exact --------------------

L, H, G, K = 256, 4, 2, 32


def _auto_run(rank: int, world: int) -> dict:
    from usp_graph import ContextParallel

    lengths = lognormal_lengths(L, 12, 7, ones=2, empty=1)
    cp = ContextParallel("auto", documents=[lengths], heads=H, kv_heads=G, head_dim=K, dtype=torch.float64)
    gen = torch.Generator().manual_seed(3)
    q, go = (torch.randn(1, H, L, K, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, G, L, K, generator=gen, dtype=torch.float64) for _ in range(2))
    cu = cu_seqlens(lengths)
    leaves = [cp.shard(t, 2).detach().requires_grad_() for t in (q, k, v)]
    out = cp.attention(*leaves, cu_seqlens=cu, max_seqlen=max(lengths), is_causal=True, scale=K**-0.5)
    out.backward(cp.shard(go, 2))
    ref_leaves = [t[0].transpose(0, 1).detach().requires_grad_() for t in (q, k, v)]
    ref, _ = attention_reference(*ref_leaves, cu, is_causal=True, scale=K**-0.5)
    ref.backward(go[0].transpose(0, 1))
    ref_out = cp.shard(ref.transpose(0, 1).unsqueeze(0), 2)
    errs = [rel_err(out, ref_out)] + [
        rel_err(leaf.grad, cp.shard(r.grad.transpose(0, 1).unsqueeze(0), 2))
        for leaf, r in zip(leaves, ref_leaves, strict=True)
    ]
    inspected = _trace_save_inspect(cp, rank)
    r = cp.decision.rates
    return {"inspected": inspected, "decision": cp.decision.as_dict(), "strategy": cp.strategy, "errs": errs,
            "rates": (r.latency_s, r.bandwidth, r.pair_s), "line": cp.decision.line()}  # fmt: skip


def _trace_save_inspect(cp, rank: int) -> str:
    """A Llama train step traced with the auto plan, saved, and `usp-graph inspect` on the file."""
    import contextlib
    import io
    import os
    import tempfile

    import torch.nn.functional as F

    from tests.test_trace import llama_inputs, llama_model
    from usp_graph import cli, save, trace_train_step

    def step(m, b):
        logits = m(b["input_ids"], b["position_ids"])
        loss = F.cross_entropy(
            logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum"
        )
        return cp.token_mean(loss, (b["labels"] != -100).sum())

    batch, meta = llama_inputs([9, 7, 11, 5], seed=1, max_seqlen=40)
    graph = trace_train_step(llama_model(), step, {k: cp.shard(v, 1) for k, v in batch.items()}, meta, cp=cp)
    assert graph.cp_decision == cp.decision.as_dict()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, f"rank{rank}.uspg")
        save(graph, path)
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert cli.main(["inspect", path]) == 0
    return out.getvalue()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_auto_on_2_ranks_measures_rates_decides_once_and_runs_exactly():
    results = run_ranks(_auto_run, 2, timeout=240)
    a, b = results
    assert (
        a["decision"] == b["decision"]
        and a["strategy"] == b["strategy"] == a["decision"]["chosen"]["strategy"]
    )
    assert all(x > 0 for x in a["rates"][1:]) and a["rates"][0] >= 0, a["rates"]
    assert max(a["errs"] + b["errs"]) <= 1e-12, (a["errs"], b["errs"])
    assert a["line"].startswith(f"ContextParallel('auto') chose {a['strategy']}")
    # inspect shows the decision saved with the traced step: every candidate, the chosen one marked
    text = a["inspected"]
    assert "CP strategy chosen by ContextParallel('auto') over 2 ranks" in text, text[:2000]
    chosen = [line for line in text.splitlines() if line.rstrip().endswith("CHOSEN")]
    assert len(chosen) == 1 and chosen[0].startswith(a["strategy"]), chosen
    for c in a["decision"]["candidates"]:
        assert c["strategy"] in text
