# B batch, L sequence, H heads, K head dim
"""The compile backend runs its passes as a `Pipeline`: named, disable-able and dumpable by option."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import usp_graph
from usp_graph import AttentionMetadata, UspOptions, documents
from usp_graph.backend import backend_pipeline
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch
from usp_graph.passes import Pipeline

pytestmark = pytest.mark.timeout(300)

CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compile_step(options: dict, *, backward: bool = True) -> list:
    """One compiled Llama step under `documents`; returns the compile reports."""
    torch.manual_seed(0)
    model = Llama(CONFIG)
    batch = make_llama_batch(CONFIG, [5, 7, 3], generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)
    reports: list = []
    compiled = torch.compile(model, backend="usp", options={"on_compile": reports.append, **options})
    with documents(meta):
        loss = llama_loss(compiled, batch)
    if backward:
        loss.backward()
    return reports


def test_the_backend_pipeline_is_a_printable_list_of_named_passes():
    pipeline = backend_pipeline()
    assert isinstance(pipeline, Pipeline)
    assert pipeline.names == ["rewrite_sdpa", "verify_rewrite", "joint", "verify", "overlap"]
    lines = str(pipeline).splitlines()
    assert lines[0] == "Pipeline (5 passes):" and "(required)" in lines[3]


def test_options_disable_and_dump_passes_build_the_pipeline(tmp_path):
    pipeline = UspOptions.parse({"disable": "verify"}).pipeline()
    assert pipeline.disabled == {"verify"}
    assert UspOptions.parse({"verify": False}).pipeline().disabled == {"verify_rewrite", "verify"}
    dumped = UspOptions.parse({"dump_passes": ["joint"], "dump_dir": str(tmp_path)}).pipeline()
    assert dumped.dump == {"joint"} and UspOptions.parse(
        {"dump_passes": True, "dump_dir": str(tmp_path)}
    ).pipeline().dump == set(pipeline.names)


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"disable": "nope"}, ValueError, r"option 'disable': cannot disable unknown pass\(es\) \['nope'\]; the passes are \['rewrite_sdpa', 'verify_rewrite', 'joint', 'verify', 'overlap'\]"),
        ({"disable": ["joint"]}, ValueError, "option 'disable': pass 'joint' is required and cannot be disabled"),
        ({"dump_passes": True}, ValueError, "option 'dump_passes' writes each pass's before/after graph below dump_dir; set that too"),
        ({"dump_passes": ["x"], "dump_dir": "d"}, ValueError, r"option 'dump_passes': cannot dump unknown pass\(es\) \['x'\]"),
        ({"disable": 3}, TypeError, "option 'disable' must be a pass name or a list of pass names, got 3"),
        ({"disable": ["verify", None]}, TypeError, r"option 'disable' must be a pass name or a list of pass names, got \['verify', None\]; the passes are \['rewrite_sdpa', 'verify_rewrite', 'joint', 'verify', 'overlap'\]"),
        ({"disable": {"verify"}}, TypeError, r"option 'disable' must be .*, got \{'verify'\}; the passes are \['rewrite_sdpa', "),
        ({"dump_passes": 1, "dump_dir": "d"}, TypeError, r"option 'dump_passes' must be True, a pass name or a list of pass names, got 1; the passes are \['rewrite_sdpa', 'verify_rewrite', 'joint', 'verify', 'overlap'\]"),
        ({"dump_passes": ["joint", 2], "dump_dir": "d"}, TypeError, r"option 'dump_passes' must be True, .*; the passes are \['rewrite_sdpa', "),
        ({"dump_passes": ["x"], "dump_dir": "d"}, ValueError, r"cannot dump unknown pass\(es\) \['x'\]; the passes are \['rewrite_sdpa', 'verify_rewrite', 'joint', 'verify', 'overlap'\]"),
        ({"disable": "Verify"}, ValueError, r"option 'disable': cannot disable unknown pass\(es\) \['Verify'\]; the passes are \["),
    ],
    ids=["unknown", "required", "dump_without_dir", "dump_unknown", "not_names", "disable_list_not_names",
         "disable_set", "dump_int", "dump_list_not_names", "dump_unknown_lists_passes", "disable_wrong_case"],
)  # fmt: skip
def test_bad_pass_options_say_what_the_passes_are(options, error, message):
    with pytest.raises(error, match=message):
        UspOptions.parse(options)


def test_good_pass_options_are_kept_as_tuples_of_names(tmp_path):
    o = UspOptions.parse({"disable": "verify", "dump_passes": "joint", "dump_dir": str(tmp_path)})
    assert o.disable == ("verify",) and o.dump_passes == ("joint",)
    o = UspOptions.parse({"disable": ("verify_rewrite", "verify"), "dump_passes": False})
    assert o.disable == ("verify_rewrite", "verify") and o.dump_passes is False
    assert o.pipeline().disabled == {"verify_rewrite", "verify"} and o.pipeline().dump == set()


def test_a_compile_reports_each_pass_and_a_disabled_one_does_not_run():
    (report,) = _compile_step({})
    assert list(report.passes) == ["rewrite_sdpa", "verify_rewrite", "joint", "verify", "overlap"]
    assert report.passes["rewrite_sdpa"] == CONFIG.n_layers and report.passes["joint"] > 0
    assert report.passes["overlap"] == 0  # one process: no collective to issue
    (report,) = _compile_step({"disable": ["verify"]})
    assert list(report.passes) == ["rewrite_sdpa", "verify_rewrite", "joint", "overlap"]


def test_under_no_grad_the_joint_passes_do_not_run():
    with torch.no_grad():
        (report,) = _compile_step({}, backward=False)
    assert list(report.passes) == ["rewrite_sdpa", "verify_rewrite", "overlap"]


def test_dump_passes_writes_before_and_after_into_the_graph_dump(tmp_path):
    _compile_step({"dump_dir": str(tmp_path), "dump_passes": ["rewrite_sdpa", "joint"]})
    (graph_dir,) = tmp_path.iterdir()
    files = sorted(p.name for p in graph_dir.iterdir() if p.name[:2].isdigit())
    assert files == [
        "01_rewrite_sdpa.after.txt",
        "01_rewrite_sdpa.before.txt",
        "03_joint.after.txt",
        "03_joint.before.txt",
    ]
    before, after = ((graph_dir / f"01_rewrite_sdpa.{w}.txt").read_text() for w in ("before", "after"))
    assert "scaled_dot_product_attention" in before and "varlen_fwd" not in before
    assert "usp.varlen_fwd" in after and "cu_seqlens_N1" in after
    assert "usp.varlen_bwd" in (graph_dir / "03_joint.after.txt").read_text()


def test_disabling_verify_by_name_skips_only_the_joint_check(monkeypatch):
    # A registry whose varlen rule no longer lists varlen_bwd: the joint's varlen_bwd has no rule.
    varlen_fwd = torch.ops.usp.varlen_fwd.default
    wrong = dataclasses.replace(usp_graph.registry.rule_for(varlen_fwd), backward_ops=())
    monkeypatch.setitem(usp_graph.registry._RULES, varlen_fwd, wrong)
    with pytest.raises(
        Exception, match=r"node varlen_bwd \(usp\.varlen_bwd\.default\) .* has no backward rule"
    ) as info:
        _compile_step({})
    assert isinstance(info.value.inner_exception, usp_graph.VerifyError)
    torch._dynamo.reset()
    (report,) = _compile_step({"disable": "verify"})
    assert "verify" not in report.passes and report.passes["joint"] > 0


def test_with_rewrite_disabled_sdpa_stays_and_documents_are_refused():
    with (
        pytest.raises(Exception, match="still in the graph but the rewrite did not report it as kept"),
        pytest.warns(UserWarning, match="pass rewrite_sdpa is disabled"),
    ):
        _compile_step({"disable": "rewrite_sdpa"})
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Llama(CONFIG)
    batch = make_llama_batch(CONFIG, [5, 7, 3], generator=torch.Generator().manual_seed(1))
    reports: list = []
    options = {"disable": ["rewrite_sdpa", "verify_rewrite", "verify"], "on_compile": reports.append}
    compiled = torch.compile(model, backend="usp", options=options)
    with pytest.warns(
        UserWarning, match=r"keeps 1 SDPA call\(s\) as SDPA.*not rewritten: pass rewrite_sdpa is disabled"
    ):
        logits = compiled(batch["input_ids"], batch["position_ids"])
    assert torch.equal(logits, model(batch["input_ids"], batch["position_ids"]))
    assert (
        reports[0].rewritten == () and len(reports[0].kept) == 1 and "rewrite_sdpa" not in reports[0].passes
    )
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)
    with pytest.raises(
        ValueError, match=r"kept SDPA call\(s\) it could not rewrite .*pass rewrite_sdpa is disabled"
    ):
        with documents(meta):
            compiled(batch["input_ids"], batch["position_ids"])
