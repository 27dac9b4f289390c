"""Graph analysis: sites, pairing, DOT, diff, the collectives inspect knows. (What inspect says of
CP graphs, strategy and bytes against the cost model, is checked in test_trace on its traced CP steps.)"""

from __future__ import annotations

import html

import networkx as nx
import pytest
import torch

from usp_graph import AttentionMetadata, registry, trace_train_step
from usp_graph.analysis import _comm_ops, diff, summarize, to_dot
from usp_graph.cp.table import STRATEGY_TABLE
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _traced(config: LlamaConfig = CONFIG, lengths=(5, 7, 3)):
    torch.manual_seed(0)
    model = Llama(config)
    batch = make_llama_batch(config, list(lengths), generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)
    return trace_train_step(model, llama_loss, batch, meta)


@pytest.fixture(scope="module")
def traced():
    """The 2-layer train step, traced once for the module (tests that edit it take a copy)."""
    return _traced()


@pytest.fixture(scope="module")
def traced_one_layer():
    return _traced(LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64))


def test_single_process_summary_lists_every_site_paired_and_fed_by_metadata(traced):
    graph = traced
    s = summarize(graph.graph_module, sites=graph.sites, symbols=graph.signature.symbols)
    assert len(s["attention"]) == CONFIG.n_layers
    for a in s["attention"]:
        assert a["rewritten"] and a["strategy"] == "single" and a["causal"] and a["gqa"]
        assert a["metadata_reaches"] and "llama.py" in a["source"]
        assert a["q_shape"] == ["T", 4, 8]
    assert len(s["pairing"]) == CONFIG.n_layers and s["unpaired"] == []
    assert s["metadata"]["capacity"] == 8
    assert {i["role"] for i in s["inputs"]} == {"param", "batch", "cu_seqlens", "max_seqlen"}
    assert s["collectives"] == []


def test_a_removed_backward_op_shows_as_unpaired(traced):
    copy = torch.fx.Graph()
    copy.output(copy.graph_copy(traced.graph_module.graph, {}))
    gm = torch.fx.GraphModule(traced.graph_module, copy)
    victim = next(
        n for n in gm.graph.nodes if n.meta.get("usp_phase") == "backward" and "varlen_bwd" in n.name
    )
    victim.target = torch.ops.aten.clone.default  # the backward attention op is gone
    victim.args = (victim.args[0],)
    s = summarize(gm)
    assert [u["node"] for u in s["unpaired"]] == [victim.meta["usp_fwd_node"]]
    assert "usp.varlen_bwd" in s["unpaired"][0]["missing"]
    assert summarize(traced.graph_module)["unpaired"] == []  # the shared graph is untouched


def test_dot_is_parsed_by_networkx_and_keeps_every_node(traced_one_layer):
    import pydot

    # One layer has every kind of node a deeper model has; pydot parses ~2 s per layer.
    dot = to_dot(traced_one_layer.graph_module)
    (parsed,) = pydot.graph_from_dot_data(dot)
    g = nx.nx_pydot.from_pydot(parsed)
    assert g.number_of_nodes() == len(traced_one_layer.graph_module.graph.nodes)


def test_diff_of_a_graph_with_itself_is_empty_and_sees_a_changed_model(traced, traced_one_layer):
    a = summarize(traced.graph_module)
    assert diff(a, a)["same"]
    d = diff(a, summarize(traced_one_layer.graph_module))
    assert not d["same"]
    assert d["op_counts"]["usp.varlen_fwd.default"] == {"a": 2, "b": 1}


def _schema_arg(arg, graph: torch.fx.Graph, prefix: str):
    """A value of the schema type of `arg`: a placeholder per tensor, small ints, a group name."""
    kind = str(arg.type)
    if kind == "Tensor":
        return graph.placeholder(f"{prefix}_{arg.name}")
    if kind in ("int", "SymInt"):
        return 2
    if kind.startswith("List[int]"):
        return [1, 1]
    if kind == "str":
        return "group0"
    raise AssertionError(f"no test value for a {kind} argument ({prefix}.{arg.name}); add one here")


def test_every_collective_of_the_registry_table_is_listed_as_a_collective_by_inspect():
    names = sorted(
        {
            op
            for row in registry.TABLE
            if row.kind == "collective"
            for op in (row.op, *row.backward_ops, row.adjoint)
        }
    )
    assert names, "the registry table has no collective row"
    graph = torch.fx.Graph()
    outs = []
    for qualified in names:
        ns, name = qualified.split("::")
        op = getattr(getattr(torch.ops, ns), name).default
        outs.append(graph.call_function(op, tuple(_schema_arg(a, graph, name) for a in op._schema.arguments)))
    graph.output(tuple(outs))
    s = summarize(torch.fx.GraphModule(torch.nn.Module(), graph))
    assert sorted(c["op"] for c in s["collectives"]) == sorted(q.replace("::", ".") for q in names)


def test_a_new_collective_row_is_recognised_without_editing_the_analysis():
    row = registry.Rule("usp::shift", "collective", ("usp::unshift",), "usp::unshift", "ext", "a test row")
    collectives, communicating = _comm_ops((*registry.TABLE, row), STRATEGY_TABLE)
    assert {"shift", "unshift"} <= collectives <= communicating
    # attention communicates only where a strategy's forward says so (ring), local varlen never
    assert {"ring_attn_fwd", "ring_attn_bwd"} <= communicating - collectives
    assert "varlen_fwd" not in communicating and "varlen_bwd" not in communicating


def test_a_cp_decision_record_from_a_file_is_shown_or_skipped_never_a_traceback(traced):
    from usp_graph import report

    s = summarize(traced.graph_module, sites=traced.sites, symbols=traced.signature.symbols)
    good = {"strategy": "halo", "options": {"max_document_len": 64}, "compute_s": 0.001, "comm_s": 0.002,
            "bytes_per_rank": 2048, "refused": None}  # fmt: skip
    hostile = [good, {"strategy": ["x"], "options": 3, "compute_s": "1", "comm_s": None,
                      "bytes_per_rank": -5, "refused": {"a": 1}}, 7, {"bytes_per_rank": [1]},
               {"strategy": "huge", "compute_s": 10**400, "comm_s": 1e308, "bytes_per_rank": 10**400,
                "refused": None}]  # fmt: skip
    s["cp_decision"] = {"chosen": good, "candidates": hostile, "world": "2", "steps": None, "tokens": 8}
    text = report.text(s)
    (row,) = [line for line in text.splitlines() if line.startswith("halo(")]
    assert "3" in row and "CHOSEN" in row and "2.0 KiB" in row, row
    assert "cannot run: {'a': 1}" in text and "?" in text
    (huge,) = [line for line in text.splitlines() if line.startswith("huge")]
    # 10**400 is no float: "-" and integer bytes, not an OverflowError
    assert huge.split()[1:5] == ["-", "-", "inf", "9.09e387"], huge
    page = report.to_html_page([{"title": "t", "summary": s}])
    assert html.escape("CP strategy chosen by ContextParallel('auto')") in page
    s["cp_decision"] = {"candidates": "nope"}  # not a record: no section
    assert "ContextParallel('auto')" not in report.text(s)
