"""One pairing analysis: the verify pass and inspect (`analysis.summarize`) agree on every graph.

Each test builds a graph, paired or with one forward op's backward removed, and checks that
`verify` passes exactly when `summarize` lists nothing unpaired, naming the same node.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, fx, nn

from usp_graph import AttentionMetadata, VerifyError, documents, trace_train_step
from usp_graph.analysis import summarize
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch
from usp_graph.passes import pair_backward, verify

pytestmark = pytest.mark.timeout(300)

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
VARLEN_FWD = torch.ops.usp.varlen_fwd.default
VARLEN_BWD = torch.ops.usp.varlen_bwd.default


def _batch(config: LlamaConfig = CONFIG):
    batch = make_llama_batch(config, [5, 7, 3], generator=torch.Generator().manual_seed(1))
    return batch, AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)


def _traced():
    torch.manual_seed(0)
    batch, meta = _batch()
    return trace_train_step(Llama(CONFIG), llama_loss, batch, meta).graph_module


def _verdicts(gm) -> tuple[str | None, list[str], int]:
    """(the node verify names, or None when it passes; the nodes inspect lists unpaired; pairs inspect lists)."""
    s = summarize(gm)
    try:
        verify(gm)
        failed = None
    except VerifyError as e:
        failed = str(e)
    return failed, [u["node"] for u in s["unpaired"]], len(s["pairing"])


def _drop_backward_op(gm: fx.GraphModule, target) -> fx.Node:
    """Make the first backward `target` node a clone of its first input: the data still flows, the op is gone."""
    victim = next(n for n in gm.graph.nodes if n.meta.get("usp_phase") == "backward" and n.target is target)
    victim.target = torch.ops.aten.clone.default
    victim.args = (victim.args[0],)
    gm.recompile()
    return victim


def test_verify_and_inspect_agree_on_a_paired_traced_graph():
    gm = _traced()
    failed, unpaired, pairs = _verdicts(gm)
    assert failed is None and unpaired == [] and pairs == CONFIG.n_layers
    assert [p.forward.target for p in pair_backward(gm).pairs] == [VARLEN_FWD] * CONFIG.n_layers


def test_verify_and_inspect_name_the_same_unpaired_node_of_a_traced_graph():
    gm = _traced()
    victim = _drop_backward_op(gm, VARLEN_BWD)
    failed, unpaired, pairs = _verdicts(gm)
    (missing,) = pair_backward(gm).unpaired
    assert unpaired == [missing.node.name] and pairs == CONFIG.n_layers - 1
    assert missing.node.meta["usp_fwd_node"] == victim.meta["usp_fwd_node"]
    assert failed is not None and f"forward node {missing.node.name} (usp.varlen_fwd.default)" in failed


def test_pairing_follows_provenance_not_node_names():
    # The forward node's name is not what its backward's usp_fwd_node says (a joint renames nodes
    # freely); pairing goes by the forward node's own usp_fwd_node tag, for verify and inspect alike.
    gm = _traced()
    fwd = next(n for n in gm.graph.nodes if n.target is VARLEN_FWD)
    old = fwd.meta["usp_fwd_node"]
    for n in gm.graph.nodes:
        if n.meta.get("usp_fwd_node") == old:
            n.meta["usp_fwd_node"] = "attention_of_layer_0"
    assert fwd.name != "attention_of_layer_0"
    failed, unpaired, pairs = _verdicts(gm)
    assert failed is None and unpaired == [] and pairs == CONFIG.n_layers


class _DeadAttention(nn.Module):
    """One attention whose output reaches the loss and one whose output is dropped."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x_BLD: Tensor) -> Tensor:
        q_BHLK = self.proj(x_BLD).unflatten(-1, (2, 4)).transpose(1, 2)
        F.scaled_dot_product_attention(q_BHLK, q_BHLK, q_BHLK, is_causal=True)  # dropped: no backward
        return F.scaled_dot_product_attention(q_BHLK, q_BHLK, q_BHLK, is_causal=True).sum()


def test_an_attention_that_never_reaches_the_loss_is_neither_paired_nor_missing():
    batch = {"x": torch.randn(1, 10, 8)}
    graph = trace_train_step(
        _DeadAttention(), lambda m, b: m(b["x"]), batch, AttentionMetadata.from_lengths([4, 6]),
        dynamic={"x": {1: "T"}},
    )  # fmt: skip
    gm = graph.graph_module
    assert sum(n.target is VARLEN_FWD for n in gm.graph.nodes) == 2
    failed, unpaired, pairs = _verdicts(gm)
    assert failed is None and unpaired == [] and pairs == 1
    assert len(pair_backward(gm).skipped) == 1


@pytest.fixture(scope="module")
def dump_dir(tmp_path_factory):
    """One compiled Llama's dump directory (joint.uspg, forward.uspg, backward.uspg)."""
    torch._dynamo.reset()
    out = tmp_path_factory.mktemp("dump")
    config = LlamaConfig(n_layers=1)
    torch.manual_seed(0)
    model = Llama(config)
    batch, meta = _batch(config)
    compiled = torch.compile(model, backend="usp", options={"dump_dir": str(out)})
    with documents(meta):
        llama_loss(compiled, batch).backward()
    torch._dynamo.reset()
    (graph_dir,) = out.iterdir()
    return graph_dir


def _load(graph_dir, name: str) -> fx.GraphModule:
    from usp_graph.graphfile import load_graph_module

    return load_graph_module(graph_dir / f"{name}.uspg").graph_module


def test_verify_and_inspect_agree_on_a_compile_dump_joint_and_across_its_files(dump_dir):
    joint = _load(dump_dir, "joint")
    failed, unpaired, pairs = _verdicts(joint)
    assert failed is None and unpaired == [] and pairs == 1
    forward, backward = _load(dump_dir, "forward"), _load(dump_dir, "backward")
    across = summarize(forward, backward=backward)
    assert across["unpaired"] == [] and [p["forward"] for p in across["pairing"]] == [
        p.forward.name for p in pair_backward(joint).pairs
    ]


def test_verify_and_inspect_name_the_same_unpaired_node_of_a_compile_dump(dump_dir):
    joint = _load(dump_dir, "joint")
    _drop_backward_op(joint, VARLEN_BWD)
    failed, unpaired, _ = _verdicts(joint)
    assert unpaired == ["varlen_fwd"]
    assert failed is not None and "forward node varlen_fwd (usp.varlen_fwd.default)" in failed
    forward, backward = _load(dump_dir, "forward"), _load(dump_dir, "backward")
    _drop_backward_op(backward, VARLEN_BWD)
    assert [u.node.name for u in pair_backward(forward, backward).unpaired] == unpaired
    assert [u["node"] for u in summarize(forward, backward=backward)["unpaired"]] == unpaired
