"""Activation checkpointing of blocks (`usp_graph.checkpointing.checkpoint_blocks`): full and selective
policies, eager `attention_mode`, ``backend="usp"`` and context parallelism, with no `context_fn` from
the user. Grads equal the run without checkpointing bitwise (fp64), and the recompute runs exactly
the usp ops the policy says: all of them (full, recompute_attention) or none (save_attention).
"""

from __future__ import annotations

import collections
import copy
import glob
import os

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from tests.dist import run_ranks

POLICIES = ["full", "save_attention", "recompute_attention"]
LENGTHS = [5, 1, 0, 7, 3]
# usp forward ops a recompute reruns: attention and the CP collectives before it.
RECOMPUTED = {"full": True, "save_attention": False, "recompute_attention": True}


class _UspOps(TorchDispatchMode):
    """Counts the usp ops dispatched inside the block."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.namespace == "usp":
            self.counts[func.overloadpacket.__name__] += 1
        return func(*args, **(kwargs or {}))


def _model():
    from usp_graph.models import Llama, LlamaConfig

    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)).double()


def _loss(model, batch, reduction="mean"):
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(
        logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100, reduction=reduction
    )


def _grads(model) -> dict:
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def _batch(lengths=LENGTHS, seed=1):
    from usp_graph import AttentionMetadata
    from usp_graph.models import make_llama_batch

    batch = make_llama_batch(_model().config, lengths, generator=torch.Generator().manual_seed(seed))
    return batch, AttentionMetadata.from_lengths(lengths, max_docs=8, max_seqlen=sum(lengths))


def _eager_grads(model, batch, meta, cp=None):
    """(loss, grads, usp ops in forward, usp ops in backward): attention_mode, backward after the block."""
    from usp_graph import attention_mode

    model.zero_grad(set_to_none=True)
    with _UspOps() as fwd, attention_mode(meta, cp=cp):
        loss = _loss(model, batch) if cp is None else cp.token_mean(*_sum_and_count(model, batch))
    with _UspOps() as bwd:
        loss.backward()
    if cp is not None:
        cp.reduce_grads(model.parameters())
    return loss.detach(), _grads(model), fwd.counts, bwd.counts


def _sum_and_count(model, batch):
    labels = batch["labels"]
    return _loss(model, batch, "sum"), (labels != -100).sum()


@pytest.mark.parametrize("policy", POLICIES)
def test_eager_policy_grads_bitwise_and_recompute_reruns_what_the_policy_says(policy):
    from usp_graph.checkpointing import checkpoint_blocks

    batch, meta = _batch()
    ref_loss, ref, _, _ = _eager_grads(_model(), batch, meta)
    model = _model()
    checkpoint_blocks(model, policy=policy)
    loss, grads, fwd, bwd = _eager_grads(model, batch, meta)
    assert torch.equal(loss, ref_loss)
    for name, g in ref.items():
        assert torch.equal(grads[name], g), name
    assert fwd["varlen_fwd"] == 2 and bwd["varlen_bwd"] == 2
    assert bwd["varlen_fwd"] == (2 if RECOMPUTED[policy] else 0), bwd


def _compiled_backward_ops(dump_dir: str) -> collections.Counter:
    from usp_graph import load_graph_module

    counts: collections.Counter = collections.Counter()
    for path in glob.glob(os.path.join(dump_dir, "*", "backward.uspg")):
        for node in load_graph_module(path).graph_module.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("usp."):
                counts[str(node.target).split(".")[1]] += 1
    return counts


@pytest.mark.slow
@pytest.mark.parametrize("policy", POLICIES)
def test_compiled_policy_grads_bitwise_and_backward_graph_recomputes_what_the_policy_says(policy, tmp_path):
    from usp_graph import attention_mode, documents
    from usp_graph.checkpointing import checkpoint_blocks

    base = _model()
    model = copy.deepcopy(base)
    checkpoint_blocks(model, policy=policy)
    compiled = torch.compile(model, backend="usp", options={"dump_dir": str(tmp_path)})
    for lengths, seed in ((LENGTHS, 1), ([2, 9, 3, 2], 2)):  # new boundaries: no recompile, still exact
        batch, meta = _batch(lengths, seed)
        base.zero_grad(set_to_none=True)
        with attention_mode(meta):
            ref_loss = _loss(base, batch)
        ref_loss.backward()
        model.zero_grad(set_to_none=True)
        with documents(meta):
            loss = _loss(compiled, batch)
        loss.backward()
        assert torch.equal(loss, ref_loss)
        for name, p in base.named_parameters():
            assert torch.equal(model.get_parameter(name).grad, p.grad), name
    ops = _compiled_backward_ops(str(tmp_path))
    assert ops["varlen_bwd"] == 2 and ops["varlen_fwd"] == (2 if RECOMPUTED[policy] else 0), ops


def test_checkpoint_blocks_refuses_twice_and_bad_policies():
    from usp_graph.checkpointing import checkpoint_blocks

    model = _model()
    with pytest.raises(ValueError, match="policy must be one of"):
        checkpoint_blocks(model, policy="attention")
    checkpoint_blocks(model)
    with pytest.raises(ValueError, match="already checkpointed"):
        checkpoint_blocks(model)
    with pytest.raises(ValueError, match="no blocks"):
        checkpoint_blocks(torch.nn.Linear(2, 2))


def _cp_policies(rank: int, world: int, strategies: list[str]) -> list[dict]:
    """Per strategy and policy: grads and loss vs the same CP step without checkpointing (eager and
    compiled), and the usp ops the forward and the backward ran."""
    from usp_graph import ContextParallel, documents
    from usp_graph.checkpointing import checkpoint_blocks

    batch, meta = _batch([9, 1, 0, 14, 8], seed=3)  # 32 tokens; documents cross the shard boundary
    out = []
    for strategy in strategies:
        cp = ContextParallel(strategy)
        local = {k: cp.shard(v, 1) for k, v in batch.items()}
        ref_loss, ref, _, ref_bwd = _eager_grads(_model(), local, meta, cp)
        for policy in POLICIES:
            model = _model()
            checkpoint_blocks(model, policy=policy)
            loss, grads, fwd, bwd = _eager_grads(model, local, meta, cp)
            extra = dict(bwd - ref_bwd)  # what the backward ran beyond the one without checkpointing
            row = {"strategy": strategy, "policy": policy, "mode": "eager", "fwd": dict(fwd), "extra": extra}
            row["same_backward"] = not (ref_bwd - bwd)
            row["loss"] = torch.equal(loss, ref_loss)
            row["bad"] = [n for n, g in ref.items() if (grads[n] - g).abs().max() > 1e-12]
            out.append(row)
        model = _model()
        checkpoint_blocks(model, policy="save_attention")
        compiled = torch.compile(model, backend="usp", options={"cp": cp})
        with documents(meta):
            loss = cp.token_mean(*_sum_and_count(compiled, local))
        loss.backward()
        cp.reduce_grads(model.parameters())
        row = {
            "strategy": strategy,
            "policy": "save_attention",
            "mode": "compiled",
            "loss": torch.equal(loss, ref_loss),
        }
        row["bad"] = [n for n, g in ref.items() if (model.get_parameter(n).grad - g).abs().max() > 1e-12]
        out.append(row)
    return out


@pytest.mark.slow
def test_policies_under_context_parallelism_are_exact_and_recompute_the_collectives():
    for rank_rows in run_ranks(_cp_policies, 2, ["ulysses", "ring"]):
        for row in rank_rows:
            assert row["loss"] and row["bad"] == [], row
            if row["mode"] != "eager":
                continue
            assert row["same_backward"], row
            # The recompute reruns every forward usp op (attention and collectives) or none of them.
            assert row["extra"] == (row["fwd"] if RECOMPUTED[row["policy"]] else {}), row
