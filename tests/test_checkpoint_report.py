"""The compile report and ``usp-graph inspect`` count the attention sites inside checkpointed regions."""

from __future__ import annotations

import contextlib
import json

import torch
import torch.nn.functional as F

from usp_graph import AttentionMetadata, documents
from usp_graph.checkpointing import checkpoint_blocks
from usp_graph.models import Llama, LlamaConfig, make_llama_batch

LENGTHS = [5, 1, 7, 3]


def _loss(model, batch):
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _compile(tmp_path, checkpointed_blocks: int):
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48)
    ).double()
    if checkpointed_blocks:
        checkpoint_blocks(model, list(model.layers)[:checkpointed_blocks])
    reports: list = []
    compiled = torch.compile(
        model, backend="usp", options={"on_compile": reports.append, "dump_dir": str(tmp_path)}
    )
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(1))
    with documents(AttentionMetadata.from_lengths(LENGTHS, max_docs=6)):
        _loss(compiled, batch).backward()
    torch._dynamo.reset()
    return reports


def _inspected(tmp_path, capsys) -> tuple[dict, str]:
    from usp_graph.cli import main

    assert main(["inspect", str(tmp_path), "--json"]) == 0
    by_file = json.loads(capsys.readouterr().out)
    forward = next(s for f, s in by_file.items() if f.endswith("forward.uspg"))
    assert main(["inspect", str(tmp_path)]) == 0
    return forward, capsys.readouterr().out


def test_report_and_inspect_count_the_sites_inside_checkpointed_regions(tmp_path, capsys):
    reports = _compile(tmp_path, checkpointed_blocks=2)  # two of three blocks
    assert [(len(r.rewritten), r.checkpointed) for r in reports] == [(3, 2)]
    forward, text = _inspected(tmp_path, capsys)
    assert sorted(a["checkpointed"] for a in forward["attention"]) == [False, True, True]
    assert "Attention sites (2 inside checkpointed regions)" in text


def test_without_checkpointing_no_site_is_counted_inside_a_region(tmp_path, capsys):
    reports = _compile(tmp_path, checkpointed_blocks=0)
    assert [(len(r.rewritten), r.checkpointed) for r in reports] == [(3, 0)]
    forward, text = _inspected(tmp_path, capsys)
    assert [a["checkpointed"] for a in forward["attention"]] == [False, False, False]
    assert "inside checkpointed regions" not in text


def _saved_and_joint(monkeypatch, *, rewrite: bool):
    """(the forward graph's saved activations, the joint graph) of a fully checkpointed Llama under
    backend usp (aot_eager: its partitioner is inductor's, min-cut)."""
    from usp_graph.backend import compiler

    seen: dict = {}
    on_joint, on_graph = compiler._Compile.on_joint, compiler._Compile.on_graph

    def keep_joint(self, joint):
        seen["joint"] = joint
        return on_joint(self, joint)

    def keep_graph(self, kind, gm):
        seen[kind] = gm
        return on_graph(self, kind, gm)

    monkeypatch.setattr(compiler._Compile, "on_joint", keep_joint)
    monkeypatch.setattr(compiler._Compile, "on_graph", keep_graph)
    torch.manual_seed(0)
    model = Llama(
        LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    ).double()
    checkpoint_blocks(model)
    options = {} if rewrite else {"disable": "rewrite_sdpa", "verify": False}
    compiled = torch.compile(model, backend="usp", options=options)
    batch = make_llama_batch(model.config, LENGTHS, generator=torch.Generator().manual_seed(1))
    blocks = (
        documents(AttentionMetadata.from_lengths(LENGTHS, max_docs=6))
        if rewrite
        else contextlib.nullcontext()
    )
    with blocks:
        _loss(compiled, batch).backward()
    torch._dynamo.reset()
    (out,) = seen["forward"].graph.find_nodes(op="output")
    saved = [n for n in out.args[0] if isinstance(n, torch.fx.Node) and n.op != "placeholder"]
    return saved, seen["joint"], seen["backward"]


def test_rewritten_attention_in_a_checkpointed_region_is_tagged_recomputed_and_never_saved(monkeypatch):
    from torch.utils.checkpoint import CheckpointPolicy

    saved, joint, backward = _saved_and_joint(monkeypatch, rewrite=True)
    usp_fwd = [n for n in joint.graph.nodes if str(n.target) == "usp.varlen_fwd.default"]
    assert len(usp_fwd) == 2
    for n in usp_fwd:  # the region's tags, as AOTAutograd's partitioner reads them
        assert "ac_graph_id" in n.meta and n.meta["recompute"] in (
            CheckpointPolicy.PREFER_RECOMPUTE,
            CheckpointPolicy.MUST_RECOMPUTE,
        ), n.meta.get("recompute")
    # nothing attention computed is kept for backward: the backward recomputes it
    assert not [n for n in saved if "varlen" in str(n.target) or n.meta.get("usp_site")], saved
    assert sum(str(n.target) == "usp.varlen_fwd.default" for n in backward.graph.nodes) == 2
    # and checkpointing keeps no more activations than for the same model left as SDPA (6 against 8)
    plain, _, _ = _saved_and_joint(monkeypatch, rewrite=False)
    assert len(saved) <= len(plain), (saved, plain)
