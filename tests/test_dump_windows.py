"""Compile dumps of sliding-window models write every graph file (issue 30).

Mistral and Gemma3 with ``use_cache=True`` build their sliding-window masks from 0-d tensor
constants, which stay in AOTAutograd's graphs; a graph file could not hold a 0-d constant
(``self.dim() cannot be 0 to view Long as Byte``), so ``forward.uspg`` and ``joint.uspg`` were
missing and ``usp-graph inspect`` saw no attention site.
"""

from __future__ import annotations

import json

import pytest
import torch

from usp_graph import cli
from usp_graph.graphfile import load_graph_module
from usp_graph.graphfile.values import decode_tensor_data, encode_tensor_data

pytestmark = pytest.mark.timeout(180)


@pytest.mark.parametrize(
    "value",
    [
        torch.tensor(7),
        torch.tensor(-3, dtype=torch.int32),
        torch.tensor(2.5, dtype=torch.float64),
        torch.tensor(-0.0),
        torch.tensor(True),
        torch.tensor(1.5, dtype=torch.bfloat16),
        torch.tensor([4]),  # one element, 1-d: as before
        torch.zeros(0, dtype=torch.float64),  # no element
        torch.arange(6, dtype=torch.int16).reshape(2, 3)[:, 1],  # strided
    ],
    ids=["int64", "int32", "float64", "neg_zero", "bool", "bfloat16", "one", "empty", "strided"],
)
def test_tensor_constants_of_every_rank_round_trip_bit_for_bit(value):
    got = decode_tensor_data(encode_tensor_data(value), "t")
    assert (got.dtype, got.shape) == (value.dtype, value.shape)
    assert torch.equal(got.reshape(-1).view(torch.uint8), value.contiguous().reshape(-1).view(torch.uint8))


def _model(name: str):
    """One sliding-window layer (the tiny configs of tests/realmodels.py, one layer: half the compile)."""
    transformers = pytest.importorskip("transformers")
    common = dict(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, sliding_window=4, attn_implementation="sdpa",
    )  # fmt: skip
    if name == "mistral":
        config, cls = transformers.MistralConfig(**common), transformers.MistralForCausalLM
    else:
        config = transformers.Gemma3TextConfig(head_dim=8, layer_types=["sliding_attention"], **common)
        cls = transformers.Gemma3ForCausalLM
    torch.manual_seed(0)
    return cls(config).double()


@pytest.mark.parametrize("name", ["mistral", "gemma3"])
def test_sliding_window_model_dump_writes_every_graph_file(name, tmp_path, capsys):
    from tests.realmodels import packed_positions, weighted_loss

    model = _model(name)
    torch._dynamo.reset()  # models of one class share code objects: make sure this one compiles
    try:
        compiled = torch.compile(model, backend="usp", options={"dump_dir": str(tmp_path)})
        pos = packed_positions([7, 9])
        ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(0))
        weighted_loss(compiled(input_ids=ids, position_ids=pos, use_cache=True).logits).backward()
    finally:
        torch._dynamo.reset()
    varlen, constants = [], []
    for graph_dir in sorted(p for p in tmp_path.iterdir() if p.is_dir()):  # Gemma3: a graph break
        manifest = json.loads((graph_dir / "summary.json").read_text())
        assert manifest["failed"] == {}, graph_dir.name
        files = manifest["graph_files"]
        assert all(v["error"] is None for v in files.values()), (graph_dir.name, files)
        if "forward" not in files:
            continue
        assert set(files) == {"joint", "forward", "backward"}
        forward = load_graph_module(graph_dir / "forward.uspg").graph_module
        constants += [getattr(forward, n.target) for n in forward.graph.find_nodes(op="get_attr")]
        varlen += [n for n in forward.graph.nodes if str(n.target) == "usp.varlen_fwd.default"]
    assert any(c.dim() == 0 for c in constants)  # what failed to write
    assert len(varlen) == model.config.num_hidden_layers
    assert all(len(n.args) > 9 and n.args[9] != -1 for n in varlen), "sliding windows run as varlen windows"
    assert cli.main(["inspect", str(tmp_path)]) == 0, capsys.readouterr().err


def test_a_moe_router_graph_writes_loads_and_replays(tmp_path):
    """MoE routers (Mixtral, Qwen-MoE, OLMoE) pick experts with ``aten.topk``, which graph files
    could not hold: their dumps wrote no forward or joint file. Forward and backward, bit for bit."""
    from torch._functorch.aot_autograd import aot_function

    from usp_graph.graphfile import save_graph_module

    graphs = []

    def keep(gm, _):
        graphs.append(gm)
        return gm

    def route(x, w):
        weights, experts = torch.topk((x @ w).softmax(-1), 2, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).sum() + experts.sum() * torch.tensor(0.0)

    x = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w = torch.randn(4, 5, dtype=torch.float64, requires_grad=True)
    aot_function(route, fw_compiler=keep, bw_compiler=keep)(x, w).backward()
    assert any(n.target == torch.ops.aten.topk.default for n in graphs[0].graph.nodes)
    forward, _ = graphs
    args = [torch.randn(6, 4, dtype=torch.float64), torch.randn(4, 5, dtype=torch.float64)]
    for i, gm in enumerate(graphs):
        save_graph_module(gm, tmp_path / f"{i}.uspg")
        loaded = load_graph_module(tmp_path / f"{i}.uspg")
        got, want = loaded(*args), gm(*args)
        for a, b in zip(got, want, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        if gm is forward:  # the backward takes what the forward saved (topk's indices), then the grad
            args = [*want[1:], torch.ones((), dtype=torch.float64)]
