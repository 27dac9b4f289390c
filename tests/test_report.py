"""The HTML report's picture of the step (`usp_graph.report_view`), read back from the page's markup.

The page comes from ``usp-graph inspect FILE --html`` (run in this process through `cli.main`) on
rank 0's graph file of the demo's Ulysses step (`tests.report_graphs`). What the picture must show
is checked against the graph and the pairing analysis (`usp_graph.passes.pairing`), not against the
page's own counters. tests/test_report_browser.py opens the same page in a real browser.
"""

from __future__ import annotations

import contextlib
import io
import json
from pathlib import Path

import pytest
import sympy
import torch

from tests.graph_docs import remove_backward_adjoint
from tests.report_graphs import boxes, cp_graph_file, parse, ulysses_graph_file
from usp_graph import AttentionMetadata, cli, registry, report, trace_train_step
from usp_graph.analysis import summarize
from usp_graph.graphfile import load_graph_module
from usp_graph.passes.pairing import pair_backward


def _inspect_html(path: Path, out: Path, *values: str) -> str:
    args = ["inspect", str(path), "--html", str(out)] + (["--values", *values] if values else [])
    assert cli.main(args) == 0
    return out.read_text()


def _inspect_json(path: Path, *values: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["inspect", str(path), "--json", "--values", *values]) == 0
    return out.getvalue()


@pytest.fixture(scope="module")
def ulysses_file() -> Path:
    return ulysses_graph_file()


@pytest.fixture(scope="module")
def ulysses_page(ulysses_file, tmp_path_factory) -> str:
    return _inspect_html(ulysses_file, tmp_path_factory.mktemp("report") / "report.html")


def test_ulysses_step_draws_two_sites_and_sixteen_all_to_alls_each_paired(ulysses_file, ulysses_page):
    p = parse(ulysses_page)
    gm = load_graph_module(str(ulysses_file)).graph_module
    # issued all-to-alls (the overlap pass): each drawn once, as its issue node
    a2a = [n.name for n in gm.graph.nodes if registry.canonical(n.target) is torch.ops.usp.all_to_all.default]
    assert len(a2a) == 16
    assert sorted(b["data-node"] for b in boxes(p, kind="collective", op="all_to_all")) == sorted(a2a)
    lanes = [a for tag, a in p.elements if tag == "svg" and "lane" in a.get("class", "").split()]
    assert len(lanes) == 2
    assert [b["data-node"] for b in boxes(p, op="varlen_fwd")] == ["varlen_fwd", "varlen_fwd_1"]
    # every pair the pairing analysis finds is one arc between two drawn boxes, and nothing else is
    expected = {(pr.forward.name, b.name) for pr in pair_backward(gm).pairs for b in pr.backward}
    arcs = {(a["data-forward"], a["data-backward"]) for tag, a in p.elements if "pair" == a.get("class")}
    assert arcs == expected and len(arcs) == 10
    drawn = {b["data-node"] for b in boxes(p)}
    assert all(f in drawn and b in drawn for f, b in arcs)
    for f, b in arcs:
        assert boxes(p, node=f)[0]["data-pair"] == b and boxes(p, node=f)[0]["data-phase"] == "forward"
    assert not any("data-alarm" in b for b in boxes(p))
    # each collective sits in its own site's lane: the forward four before the backward four
    for site in ("scaled_dot_product_attention", "scaled_dot_product_attention_1"):
        nodes = [n for n in gm.graph.nodes if n.name in a2a and n.meta["usp_site"] == site]
        assert [n.meta["usp_phase"] for n in nodes] == ["forward"] * 4 + ["backward"] * 4


def test_collectives_show_bytes_symbolic_and_numeric_with_values(ulysses_file, tmp_path):
    p = parse(_inspect_html(ulysses_file, tmp_path / "r.html", "T=64"))
    g = load_graph_module(str(ulysses_file))
    by_name = {n.name: n for n in g.graph_module.graph.nodes}
    t_expr = g.symbols["T"].node.expr
    for b in boxes(p, kind="collective"):
        x = by_name[b["data-node"]].args[0].meta["val"]  # all_to_all(x, ...): a rank sends (P-1)/P of x
        size = x.element_size() * sympy.prod(
            [d.node.expr if isinstance(d, torch.SymInt) else d for d in x.shape]
        )
        assert int(b["data-bytes"]) == size.subs(t_expr, 64) / 2
        assert sympy.sympify(b["data-bytes-symbolic"]) == (size / 2).subs(t_expr, sympy.Symbol("T"))


@pytest.mark.slow  # one more trace
def test_ring_attention_is_an_attention_box_that_carries_its_bytes(tmp_path):
    path = cp_graph_file("ring")
    p = parse(_inspect_html(path, tmp_path / "r.html", "T=64"))
    s = json.loads(_inspect_json(path, "T=64"))
    sent = {c["node"]: c["bytes_per_rank"] for c in s["collectives"]}
    ring = boxes(p, kind="attention")
    assert sorted(b["data-op"] for b in ring) == ["ring_attn_bwd"] * 2 + ["ring_attn_fwd"] * 2
    assert {b["data-node"]: int(b["data-bytes"]) for b in ring} == sent and all(v > 0 for v in sent.values())
    (step,) = [a for tag, a in p.elements if a.get("class") == "step"]
    assert (step["data-sites"], step["data-collectives"], step["data-pairs"]) == ("2", "4", "2")


def test_a_removed_backward_collective_shows_the_alarm_on_its_forward_node(ulysses_file, tmp_path):
    bad = tmp_path / "no_adjoint.uspg"
    victim = remove_backward_adjoint(ulysses_file, bad)
    p = parse(_inspect_html(bad, tmp_path / "r.html"))
    forward = victim["meta"]["usp_fwd_node"] + "_start"  # the forward all-to-all, issued
    alarmed = [b for b in boxes(p) if "data-alarm" in b]
    assert [b["data-node"] for b in alarmed] == [forward]
    assert alarmed[0]["data-alarm"] == "unpaired: no usp.all_to_all.default in the backward"
    assert "alarm" in alarmed[0]["class"].split()
    assert [a["data-alarm-node"] for tag, a in p.elements if "data-alarm-node" in a] == [forward]
    assert len(boxes(p, kind="collective")) == 15 and victim["name"] not in {b["data-node"] for b in boxes(p)}


def test_an_sdpa_left_in_the_graph_shows_the_alarm_with_its_reason():
    from tests.test_trace import BiasedAttention, biased_loss

    torch.manual_seed(8)
    batch = {"x": torch.randn(1, 10, 8), "bias": torch.randn(1, 1, 10, 10)}
    graph = trace_train_step(
        BiasedAttention(), biased_loss, batch, AttentionMetadata.from_lengths([10], max_docs=2),
        dynamic={"x": {1: "T"}, "bias": {2: "T", 3: "T"}},
    )  # fmt: skip
    symbols = graph.signature.symbols
    s = summarize(graph.graph_module, sites=graph.skipped, symbols=symbols)
    p = parse(report.to_html(s, graph=graph.graph_module, symbols=symbols))
    (site,) = graph.skipped
    # the kept call's forward and backward SDPA ops, in one lane, each with the site's reason
    alarmed = [b for b in boxes(p) if "data-alarm" in b]
    assert [b["data-phase"] for b in alarmed] == ["forward", "backward"]
    assert all(b["data-alarm"] == f"not rewritten: {site.reason}" for b in alarmed)
    assert all(b["data-source"] == site.source for b in alarmed)
    assert len([a for tag, a in p.elements if tag == "svg" and "lane" in a.get("class", "").split()]) == 1
    assert not boxes(p, kind="collective") and not boxes(p, kind="attention")


def test_boxes_carry_node_source_line_and_shapes(ulysses_file, ulysses_page):
    p = parse(ulysses_page)
    g = load_graph_module(str(ulysses_file))
    node = next(n for n in g.graph_module.graph.nodes if n.name == "varlen_fwd")
    (box,) = boxes(p, node="varlen_fwd")
    assert box["data-source"].endswith("llama.py:120 in forward")
    t_expr = g.symbols["T"].node.expr

    def shape(x) -> str:
        dims = [
            d.node.expr.subs(t_expr, sympy.Symbol("T")) if isinstance(d, torch.SymInt) else d for d in x.shape
        ]
        return "(" + ", ".join(map(str, dims)) + ")"

    q, k, v = (a.meta["val"] for a in node.args[:3])
    assert box["data-in-shapes"].startswith(f"{shape(q)} {shape(k)} {shape(v)} "), box["data-in-shapes"]
    assert box["data-out-shapes"] == " ".join(shape(o) for o in node.meta["val"])


def test_the_page_is_self_contained(ulysses_page):
    p = parse(ulysses_page)
    for tag, a in p.elements:
        assert not any(k in ("src", "href") and not v.startswith("#") for k, v in a.items()), (tag, a)
    assert len(p.scripts) == 1 and "http" not in p.scripts[0] and "import" not in p.scripts[0]
    assert "<td>varlen_fwd</td>" in ulysses_page  # the tables stay below the picture
    assert ulysses_page.index('class="overview"') < ulysses_page.index("<h3>Attention sites</h3>")


def test_a_big_step_starts_with_its_lanes_collapsed(ulysses_file):
    from usp_graph import report_view

    g = load_graph_module(str(ulysses_file))
    s = summarize(g.graph_module, symbols=g.symbols)
    view = report_view.step(g.graph_module, s, symbols=g.symbols)
    small = parse(report_view.render(view))
    big = parse(report_view.render(view, open_lanes=1))
    for page, is_open in ((small, True), (big, False)):
        details = [a for tag, a in page.elements if tag == "details"]
        assert len(details) == 2 and all(("open" in d) == is_open for d in details)


@pytest.mark.slow  # a torch.compile
def test_a_compile_dump_dir_is_one_page_with_a_section_per_graph_linked_across_files(tmp_path):
    from usp_graph import documents
    from usp_graph.models import Llama, LlamaConfig, make_llama_batch

    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    batch = make_llama_batch(config, [6, 1, 0, 9], generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=6)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(Llama(config), backend="usp", options={"dump_dir": str(tmp_path / "dump")})
        with documents(meta):
            compiled(batch["input_ids"], batch["position_ids"]).sum().backward()
    finally:
        torch._dynamo.reset()
    p = parse(_inspect_html(tmp_path / "dump", tmp_path / "r.html"))
    files = [a["data-file"].rsplit("/", 1)[-1] for tag, a in p.elements if tag == "section"]
    assert files == ["backward.uspg", "forward.uspg", "joint.uspg"]
    bwd, fwd, joint = (boxes(p, section=f"g{i}") for i in range(3))
    assert [b["data-op"] for b in bwd] == ["varlen_bwd"] * 2
    assert [b["data-op"] for b in fwd] == ["varlen_fwd"] * 2
    # the forward file's attention ops name their backward ops in the backward file
    assert sorted(b["data-pair-elsewhere"] for b in fwd) == sorted(b["data-node"] for b in bwd)
    arcs = [a for tag, a in p.elements if a.get("class") == "pair" and a.get("data-section") == "g2"]
    assert len(arcs) == 2 and sorted(b["data-op"] for b in joint) == ["varlen_bwd"] * 2 + ["varlen_fwd"] * 2
    # each lane holds one layer's forward and backward ops
    lanes = [a for tag, a in p.elements if tag == "svg" and a.get("data-lane", "").startswith("g2-")]
    assert len(lanes) == 2
