# B batch, L sequence, H heads, K head dim, D model dim, T packed tokens, P CP ranks
"""The torch.compile backend "usp": registration, options, per-call documents, exactness, CP."""

from __future__ import annotations

import copy
import dataclasses
import json
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch._dynamo.testing import CompileCounterWithBackend
from torch.fx.experimental.proxy_tensor import make_fx

import usp_graph
from tests.dist import run_ranks
from tests.reference import rel_err as _rel
from usp_graph import AttentionMetadata, ContextParallel, UspOptions, attention_mode, documents, sdpa_to_usp
from usp_graph.models import (
    Flux,
    FluxConfig,
    Llama,
    LlamaConfig,
    make_flux_batch,
    make_llama_batch,
)
from usp_graph.sites import node_value

STRATEGIES = ["allgather_kv", "ulysses", "ring", "usp", "halo"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # The models are tiny: compiling is single-threaded Python, and on a busy 2-core machine OpenMP
    # threads waiting on each other made each eager step ~100x slower.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Every test starts from empty Dynamo caches: models of one class share code objects, so a
    # previous test's compiles would count against the recompile limit and blur the counters.
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _compiled(model: nn.Module, reports: list, **options):
    return torch.compile(model, backend="usp", options={"on_compile": reports.append, **options})


def _llama_step(model, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """(loss, logits): `_adamw_steps` compares both."""
    logits_BLV = model(batch["input_ids"], batch["position_ids"])
    loss = F.cross_entropy(logits_BLV.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)
    return loss, logits_BLV


def _llama_loss(model, batch: dict[str, Tensor]) -> Tensor:
    return _llama_step(model, batch)[0]


def _flux_step(model, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    keys = ("img", "txt", "timesteps", "img_ids", "txt_ids", "pooled")
    pred_BIC = model(*(batch[k] for k in keys))
    return F.mse_loss(pred_BIC, batch["target"]), pred_BIC


def _llama_batch(config: LlamaConfig, lengths: list[int], seed: int, max_docs: int = 8):
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(seed))
    return batch, AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=max_docs)


def _assert_same_step(model: nn.Module, ref: nn.Module, out, ref_out) -> None:
    (loss, output), (ref_loss, ref_output) = out, ref_out
    assert torch.equal(loss, ref_loss), (loss.item(), ref_loss.item())
    assert torch.equal(output, ref_output)
    for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
        assert torch.equal(p, q), name


def _adamw_steps(model, step_fn, batches, *, options=None, fullgraph=True):
    """`len(batches)` AdamW steps compiled (backend usp) and in eager attention_mode; loss, model
    output, every grad and every parameter compared bitwise after each step.

    step_fn(model, batch) -> (loss, output); batches: (batch, metadata or None). Returns the
    compile reports."""
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = torch.compile(
        model, backend="usp", fullgraph=fullgraph, options={"on_compile": reports.append, **(options or {})}
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    for batch, meta in batches:
        with documents(meta):
            out = step_fn(compiled, batch)
        out[0].backward()
        with attention_mode(meta):
            ref_out = step_fn(ref, batch)
        ref_out[0].backward()
        opt.step()
        ref_opt.step()
        _assert_same_step(model, ref, out, ref_out)
        opt.zero_grad()
        ref_opt.zero_grad()
    return reports


# ---- registration --------------------------------------------------------------------------------


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only
        cwd="/",  # not the repo: usp_graph must come from the installed package and its entry point
    )


def test_backend_usp_is_found_through_the_entry_point_without_importing_usp_graph():
    proc = _python(
        """
        import sys, torch
        import torch.nn.functional as F

        def attend(q):
            return F.scaled_dot_product_attention(q, q, q, is_causal=True)

        q = torch.randn(1, 2, 8, 4)
        out = torch.compile(attend, backend="usp", fullgraph=True)(q)
        from usp_graph import attention_mode, usp_backend
        from torch._dynamo.backends.registry import lookup_backend
        assert lookup_backend("usp") is usp_backend
        with attention_mode():
            assert torch.equal(out, attend(q))
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_importing_usp_graph_after_torch_found_the_entry_point_registers_once():
    # torch discovers entry points (list_backends) before usp_graph is imported: the import must
    # leave the registration to torch's own lookup, which would fail on a duplicate name.
    proc = _python(
        """
        import sys, torch
        import torch.nn.functional as F
        assert "usp" in torch._dynamo.list_backends() and "usp_graph" not in sys.modules
        import usp_graph
        q = torch.randn(1, 2, 8, 4)
        out = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="usp")(q)
        from torch._dynamo.backends.registry import lookup_backend
        assert lookup_backend("usp") is usp_graph.usp_backend
        print("ok")
        """
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr[-3000:]


def test_importing_usp_graph_registers_the_backend():
    from torch._dynamo.backends.registry import lookup_backend

    assert lookup_backend("usp") is usp_graph.usp_backend
    assert "usp" in torch._dynamo.list_backends()
    usp_graph.backend.register()  # idempotent


# ---- options --------------------------------------------------------------------------------------


def test_options_parse_into_a_frozen_dataclass_with_defaults(tmp_path):
    opts = UspOptions.parse({"inner": "inductor", "dump_dir": str(tmp_path), "verify": False})
    assert (opts.inner, opts.dump_dir, opts.verify, opts.cp) == ("inductor", tmp_path, False, None)
    assert UspOptions.parse(None) == UspOptions() and UspOptions().inner == "auto"
    with pytest.raises(AttributeError):
        opts.inner = "aot_eager"


def test_unknown_option_lists_the_valid_keys():
    with pytest.raises(
        ValueError, match=r"unknown option\(s\) \['fullgraph'\] for backend 'usp'; the valid options"
    ):
        UspOptions.parse({"fullgraph": True})
    f = torch.compile(lambda q: F.scaled_dot_product_attention(q, q, q), backend="usp", options={"nope": 1})
    with pytest.raises(
        Exception,
        match=r"\['cp', 'disable', 'documents', 'dump_dir', 'dump_passes', 'inductor', 'inner', 'max_docs', 'on_compile', 'verify'\]",
    ) as info:
        f(torch.randn(1, 1, 4, 2))
    assert isinstance(info.value.inner_exception, ValueError)  # Dynamo wraps what a backend raises


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"verify": "yes"}, "option 'verify' must be a bool, got str"),
        ({"inner": 3}, "option 'inner' must be a str"),
        ({"dump_dir": 5}, "option 'dump_dir' must be a str or os.PathLike"),
        ({"cp": "ring"}, "option 'cp' must be a usp_graph.ContextParallel or None, got str"),
        ({"on_compile": 1}, "option 'on_compile' must be callable"),
        ({"documents": 3}, "option 'documents' must be the name of the model argument holding position ids"),
        ({"documents": "position ids"}, "option 'documents' must be the name of the model argument"),
        (
            {"documents": "position_ids", "max_docs": 2.0},
            "option 'max_docs' must be an int or None, got float",
        ),
        ({"inner": "inductor", "inductor": ["max_autotune"]}, "option 'inductor' must be a dict"),
    ],
    ids=[
        "verify",
        "inner",
        "dump_dir",
        "cp",
        "on_compile",
        "documents",
        "documents_not_a_name",
        "max_docs",
        "inductor",
    ],
)
def test_wrong_option_type_is_a_type_error_naming_the_key(options, message):
    with pytest.raises(TypeError, match=message):
        UspOptions.parse(options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"documents": "position_ids", "max_docs": 0}, "option 'max_docs' must be >= 1, got 0"),
        ({"max_docs": 8}, "option 'max_docs' sizes documents derived with option 'documents'; set that too"),
    ],
    ids=["max_docs_zero", "max_docs_alone"],
)
def test_bad_documents_options_are_value_errors_saying_what_to_set(options, message):
    with pytest.raises(ValueError, match=message):
        UspOptions.parse(options)


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"inner": "aot_eager", "inductor": {"max_autotune": True}},
            r"configures inner='inductor' \(or 'auto' on a GPU\), but inner is 'aot_eager'",
        ),
        ({"inner": "inductor", "inductor": {"max_autotune_typo": True}}, r"\['max_autotune_typo'\] are not"),
        ({"inner": "inductor", "inductor": {"joint_custom_pre_pass": None}}, "set by the usp backend itself"),
    ],
    ids=["not_inductor", "unknown_setting", "backend_setting"],
)
def test_bad_inductor_settings_are_value_errors_naming_them(options, message):
    with pytest.raises(ValueError, match=message):
        UspOptions.parse(options)


def test_inductor_settings_reach_inductor_for_this_compile_only(monkeypatch):
    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor_config

    seen = []
    inner = compile_fx.compile_fx_inner

    def spy(*args, **kwargs):
        seen.append((inductor_config.size_asserts, inductor_config.reorder_for_locality))
        return inner(*args, **kwargs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", spy)
    default = inductor_config.size_asserts
    opts = UspOptions.parse({"inner": "inductor", "inductor": {"size_asserts": not default}})
    assert opts.inductor == (("size_asserts", not default),) and hash(opts)
    f = torch.compile(
        lambda q: F.scaled_dot_product_attention(q, q, q, is_causal=True), backend="usp", options=opts
    )
    q = torch.randn(1, 2, 8, 4, requires_grad=True)
    f(q).sum().backward()
    assert seen and all(s == (not default, False) for s in seen), seen
    assert inductor_config.size_asserts == default
    torch._dynamo.reset()


def test_bad_kv_documents_are_refused_before_any_call():
    meta = AttentionMetadata.from_lengths([4, 4], max_docs=3)
    with pytest.raises(TypeError, match="as kv"):
        with documents(meta, kv=[0, 4, 8]):
            pass
    with pytest.raises(ValueError, match="key/value documents need query documents too"):
        with documents(None, kv=meta):
            pass
    with pytest.raises(ValueError, match="key/value documents need query documents too"):
        with attention_mode(None, kv=meta):
            pass


def test_unknown_inner_compiler_lists_the_choices():
    with pytest.raises(
        ValueError, match=r"option 'inner' must be one of \['auto', 'aot_eager', 'inductor'\], got 'eager'"
    ):
        UspOptions.parse({"inner": "eager"})


def test_cp_that_does_not_match_the_process_group_is_refused(tmp_path):
    import torch.distributed as dist

    def init(name: str) -> None:
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / name}", rank=0, world_size=1)

    init("a")
    try:
        cp = ContextParallel("ulysses")
        assert UspOptions.parse({"cp": cp}).cp is cp
        dist.destroy_process_group()
        with pytest.raises(ValueError, match="option 'cp' needs torch.distributed initialized"):
            UspOptions.parse({"cp": cp})
        init("b")  # a new world: cp still names the old one
        with pytest.raises(ValueError, match="option 'cp' .* does not match the initialized process group"):
            UspOptions.parse({"cp": cp})
        f = torch.compile(
            lambda q: F.scaled_dot_product_attention(q, q, q), backend="usp", options={"cp": cp}
        )
        with pytest.raises(Exception, match="does not match the initialized process group") as info:
            f(torch.randn(1, 1, 4, 2))
        assert isinstance(info.value.inner_exception, ValueError)
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


# ---- exactness: aot_eager is bitwise equal to eager attention_mode --------------------------------


def test_llama_packed_documents_bitwise_equal_to_eager_over_adamw_steps():
    config = LlamaConfig(n_layers=2)
    torch.manual_seed(0)
    model = Llama(config)
    batches = [
        _llama_batch(config, lengths, seed) for seed, lengths in enumerate(([5, 7, 4], [16], [1, 0, 9, 6]))
    ]
    reports = _adamw_steps(model, _llama_step, batches)
    assert len(reports) == 1  # three boundary sets, one compile
    (report,) = reports
    assert report.metadata == "inputs" and len(report.rewritten) == config.n_layers and report.kept == ()


def test_flux_one_document_per_row_bitwise_equal_to_eager_over_adamw_steps():
    config = FluxConfig(n_double=1, n_single=1)
    torch.manual_seed(0)
    model = Flux(config)
    batches = [
        (make_flux_batch(config, 2, 4, 8, generator=torch.Generator().manual_seed(s)), None) for s in range(3)
    ]
    reports = _adamw_steps(model, _flux_step, batches)
    assert len(reports) == 1 and len(reports[0].rewritten) == config.n_double + config.n_single


def test_flux_packed_documents_bitwise_equal_to_eager():
    config = FluxConfig(n_double=1, n_single=1)
    torch.manual_seed(1)
    model = Flux(config)
    batch = make_flux_batch(config, 2, 4, 8, generator=torch.Generator().manual_seed(3))
    # Two samples of 12 joint tokens, the second split in two documents.
    batches = [(batch, AttentionMetadata.from_lengths([12, 5, 7], max_docs=4)), (batch, None)]
    assert len(_adamw_steps(model, _flux_step, batches)) == 1


def test_inference_under_no_grad_is_bitwise_equal_and_has_no_backward():
    config = LlamaConfig(n_layers=2)
    model = Llama(config)
    batch, meta = _llama_batch(config, [7, 1, 4], 0)
    reports: list = []
    compiled = _compiled(model, reports)
    with torch.no_grad(), documents(meta):
        logits = compiled(batch["input_ids"], batch["position_ids"])
    with torch.no_grad(), attention_mode(meta):
        assert torch.equal(logits, model(batch["input_ids"], batch["position_ids"]))
    (report,) = reports
    assert report.graphs == ("inference",)
    assert report.usp_ops == {"inference": {"usp.varlen_fwd.default": config.n_layers}}


def test_backward_comes_from_the_registered_rules(tmp_path):
    config = LlamaConfig(n_layers=1)
    model = Llama(config)
    batch, meta = _llama_batch(config, [6, 6], 0)
    compiled = torch.compile(model, backend="usp", options={"dump_dir": str(tmp_path)})
    with documents(meta):
        _llama_loss(compiled, batch).backward()
    (dump,) = tmp_path.iterdir()
    summary = json.loads((dump / "summary.json").read_text())
    assert summary["format"] == "usp_graph.compile_dump" and summary["metadata"]["mode"] == "inputs"
    forward = summary["graphs"]["forward"]["ops"]["all"]
    backward = summary["graphs"]["backward"]["ops"]["all"]
    joint = summary["graphs"]["joint"]["ops"]
    assert forward["usp.varlen_fwd.default"] == 1 and backward["usp.varlen_bwd.default"] == 1
    assert (
        joint["forward"]["usp.varlen_fwd.default"] == 1 and joint["backward"]["usp.varlen_bwd.default"] == 1
    )
    assert not any("scaled_dot_product" in op for g in (forward, backward) for op in g)
    assert [s["rewritten"] for s in summary["sites"]] == [True]
    for name in ("dynamo", "rewritten", "joint", "forward", "backward"):
        assert (dump / f"{name}.txt").is_file(), name
    assert "cu_seqlens_N1" in (dump / "rewritten.txt").read_text()
    assert (
        "usp_fwd_node" in (dump / "joint.txt").read_text()
        or "usp.varlen_bwd" in (dump / "joint.txt").read_text()
    )


def test_verify_checks_the_compiled_joint_graph_against_the_registry(monkeypatch):
    varlen_fwd = torch.ops.usp.varlen_fwd.default
    rule = usp_graph.registry.rule_for(varlen_fwd)
    # A registry whose varlen rule no longer lists varlen_bwd: the compiled backward's varlen_bwd is an
    # op without a rule, and verify names it with the forward node and model line it came from.
    wrong = dataclasses.replace(rule, backward_ops=(torch.ops.usp.ring_attn_bwd.default,))
    monkeypatch.setitem(usp_graph.registry._RULES, varlen_fwd, wrong)
    model = Llama(LlamaConfig(n_layers=1))
    batch, meta = _llama_batch(model.config, [6, 6], 0)
    compiled = torch.compile(model, backend="usp")
    with (
        documents(meta),
        pytest.raises(
            Exception,
            match=r"node varlen_bwd \(usp\.varlen_bwd\.default\) from forward node varlen_fwd at \S+llama\.py:\d+ in "
            r"forward has no backward rule",
        ) as info,
    ):
        _llama_loss(compiled, batch)
    assert isinstance(info.value.inner_exception, usp_graph.VerifyError)
    torch._dynamo.reset()
    # verify=False compiles the same graph.
    compiled = torch.compile(model, backend="usp", options={"verify": False})
    with documents(meta):
        _llama_loss(compiled, batch).backward()


# ---- no recompiles ---------------------------------------------------------------------------------


def test_new_boundaries_capacity_and_token_counts_do_not_recompile():
    config = LlamaConfig(n_layers=1)
    torch.manual_seed(0)
    model = Llama(config)
    ref = copy.deepcopy(model)
    counter = CompileCounterWithBackend("usp")  # counts Dynamo's calls of the backend
    compiled = torch.compile(model, backend=counter)
    calls = [  # (document lengths, capacity; None: no documents block)
        ([12], 4),
        ([3, 9], 4),  # new boundaries
        ([2, 2, 8], 9),  # new capacity
        ([12], None),  # no documents: one document per row, same graph
        ([16], 4),  # new token count: Dynamo's one dynamic recompile
        ([20, 4], 4),  # new token count and boundaries
        ([1, 2, 3, 4, 5, 15], 6),
        ([30], None),
    ]
    counts = []
    for seed, (lengths, max_docs) in enumerate(calls):
        batch, meta = _llama_batch(config, lengths, seed, max_docs or 1)
        if max_docs is None:
            meta = None
        with documents(meta):
            logits = compiled(batch["input_ids"], batch["position_ids"])
        with attention_mode(meta):
            assert torch.equal(logits, ref(batch["input_ids"], batch["position_ids"])), (lengths, max_docs)
        counts.append(counter.frame_count)
    assert counts == [1, 1, 1, 1, 2, 2, 2, 2], counts
    dynamic = counter.graphs[1].graph.find_nodes(op="placeholder")
    assert any(isinstance(node_value(p), torch.SymInt) for p in dynamic)  # the token count is a symbol


def test_metadata_with_the_wrong_token_count_is_refused():
    model = Llama(LlamaConfig(n_layers=1))
    batch, _ = _llama_batch(model.config, [5, 7], 0)
    compiled = torch.compile(model, backend="usp")
    with documents(AttentionMetadata.from_lengths([5, 8])):
        with pytest.raises(
            ValueError, match=r"metadata describes 13 tokens, but .* see 12 \(batch 1 x length 12\)"
        ):
            compiled(batch["input_ids"], batch["position_ids"])


# ---- graph breaks --------------------------------------------------------------------------------


class _Breaking(nn.Module):
    """Three causal attention layers with a graph break between them: three Dynamo graphs."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(3))

    def layer(self, i: int, x_BLD: Tensor) -> Tensor:
        q, k, v = self.qkv[i](x_BLD).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
        return x_BLD + F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).flatten(2)

    def forward(self, x_BLD: Tensor) -> Tensor:
        # Not a loop: Dynamo cannot resume a frame after a break inside a loop, and runs it eagerly.
        x_BLD = self.layer(0, x_BLD)
        torch._dynamo.graph_break()
        x_BLD = self.layer(1, x_BLD)
        print("", end="")  # a break Dynamo cannot trace through
        return self.layer(2, x_BLD)


def test_every_sdpa_is_rewritten_across_graph_breaks():
    torch.manual_seed(0)
    model = _Breaking()
    x = torch.randn(1, 10, 16)

    def step_fn(m, x_BLD):
        out_BLD = m(x_BLD)
        return out_BLD.square().mean(), out_BLD

    meta = AttentionMetadata.from_lengths([4, 6], max_docs=3)
    reports = _adamw_steps(model, step_fn, [(x, meta), (x, None)], fullgraph=False)
    assert [len(r.rewritten) for r in reports] == [1, 1, 1] and all(r.kept == () for r in reports)


def test_documents_refused_where_a_kept_sdpa_would_attend_across_them():
    def masked(q: Tensor, mask: Tensor) -> Tensor:
        return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    reports: list = []
    f = torch.compile(masked, backend="usp", options={"on_compile": reports.append})
    q, mask = torch.randn(1, 2, 6, 4), torch.randn(1, 1, 6, 6)
    with pytest.warns(UserWarning, match=r"keeps 1 SDPA call\(s\) as SDPA.*attn_mask is not a document mask"):
        assert torch.equal(f(q, mask), masked(q, mask))  # kept as SDPA: SDPA's own result
    assert reports[0].rewritten == () and "attn_mask" in reports[0].kept[0]
    with documents(AttentionMetadata.from_lengths([6])):
        with pytest.raises(ValueError, match="kept SDPA call.* would attend across documents"):
            f(q, mask)


# ---- inductor ------------------------------------------------------------------------------------


def test_inductor_matches_eager_within_fp32_rounding():
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    torch.manual_seed(0)
    model = Llama(config)
    ref = copy.deepcopy(model)
    reports: list = []
    compiled = _compiled(model, reports, inner="inductor")
    for seed, lengths in enumerate(([5, 7], [2, 4, 6])):
        batch, meta = _llama_batch(config, lengths, seed)
        with documents(meta):
            loss = _llama_loss(compiled, batch)
        loss.backward()
        with attention_mode(meta):
            ref_loss = _llama_loss(ref, batch)
        ref_loss.backward()
        assert _rel(loss, ref_loss) <= 1e-5
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert _rel(p.grad, q.grad) <= 1e-5, name
        model.zero_grad()
        ref.zero_grad()
    assert len(reports) == 1 and reports[0].inner == "inductor" and len(reports[0].rewritten) == 1


# ---- context parallelism -------------------------------------------------------------------------


def _cp_compiled_llama(rank: int, world: int, strategies: list[str]) -> list[dict]:
    from usp_graph import AttentionMetadata, ContextParallel, attention_mode, documents
    from usp_graph.models import Llama, LlamaConfig, make_llama_batch

    config = LlamaConfig(n_layers=2, n_heads=4, n_kv_heads=2)
    torch.manual_seed(0)
    model = Llama(config)
    lengths = [5, 1, 0, 11, 8, 7]  # 32 = 16 per rank; documents cross the shard boundary
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)
    with attention_mode(meta):
        ref_loss = _llama_loss(model, batch)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = []
    for strategy in strategies:
        torch._dynamo.reset()
        if strategy == "halo":  # the longest document has 11 tokens; 16 tokens per rank
            cp = ContextParallel("halo", max_document_len=12)
        else:
            cp = ContextParallel(strategy, ulysses_degree=1 if strategy == "usp" else None)
        local = {k: cp.shard(v, 1) for k, v in batch.items()}
        reports: list = []
        compiled = torch.compile(
            model, backend="usp", fullgraph=True, options={"cp": cp, "on_compile": reports.append}
        )
        model.zero_grad(set_to_none=True)
        with documents(meta):
            logits = compiled(local["input_ids"], local["position_ids"])
        labels = local["labels"]
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
        loss = cp.token_mean(loss_sum, (labels != -100).sum())
        loss.backward()
        none_grads = [n for n, p in model.named_parameters() if p.grad is None]
        cp.reduce_grads(model.parameters())
        errs = {n: _rel(p.grad, ref_grads[n]) for n, p in model.named_parameters()}
        out.append(
            {
                "strategy": strategy,
                "loss": _rel(cp.global_sum(loss), ref_loss.detach()),
                "worst_grad": max(errs.values()),
                "none_grads": none_grads,
                "compiles": len(reports),
                "rewritten": sum(len(r.rewritten) for r in reports),
                "usp_ops": reports[0].usp_ops,
            }
        )
    return out


def _cp_compiled_collectives(rank: int, world: int) -> dict:
    """Model code that calls the collectives itself traces through Dynamo with fullgraph=True."""
    from usp_graph import ContextParallel
    from usp_graph.ops.collectives import all_gather, all_to_all, reduce_scatter

    cp = ContextParallel("ulysses")

    def f(x_LK: Tensor) -> Tensor:
        y = all_to_all(all_gather(x_LK * 2, 1), 0, 1)
        return reduce_scatter(y, 1).sum() + cp.unshard(x_LK, 1).square().sum()

    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank), requires_grad=True)
    reports: list = []
    out = torch.compile(f, backend="usp", fullgraph=True, options={"cp": cp, "on_compile": reports.append})(x)
    out.backward()
    grad, x.grad = x.grad, None
    ref = f(x)
    ref.backward()
    return {"out": torch.equal(out, ref), "grad": torch.equal(grad, x.grad), "usp_ops": reports[0].usp_ops}


def _cp_compiled_flux(rank: int, world: int, strategies: list[str]) -> list[dict]:
    """Flux under CP without documents: one document per (global) row, fed per call."""
    from usp_graph import ContextParallel, attention_mode
    from usp_graph.models import Flux, FluxConfig, make_flux_batch

    config = FluxConfig(n_double=1, n_single=1)
    torch.manual_seed(0)
    model = Flux(config)
    batch = make_flux_batch(config, 2, 4 * world, 8 * world, generator=torch.Generator().manual_seed(2))
    keys = ("img", "txt", "timesteps", "img_ids", "txt_ids", "pooled")
    with attention_mode():
        ref_loss = F.mse_loss(model(*(batch[k] for k in keys)), batch["target"])
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    out = []
    for strategy in strategies:
        torch._dynamo.reset()
        cp = ContextParallel(strategy, ulysses_degree=1 if strategy == "usp" else None)
        # Text and image tokens are sharded separately (as in test_cp): each token lives on one rank.
        seq = {"img", "txt", "img_ids", "txt_ids", "target"}
        local = {k: cp.shard(v, 1) if k in seq else v for k, v in batch.items()}
        compiled = torch.compile(model, backend="usp", fullgraph=True, options={"cp": cp})
        model.zero_grad(set_to_none=True)
        pred = compiled(*(local[k] for k in keys))
        loss = cp.token_mean(F.mse_loss(pred, local["target"], reduction="sum"), pred.numel())
        loss.backward()
        cp.reduce_grads(model.parameters())
        errs = [_rel(p.grad, ref_grads[n]) for n, p in model.named_parameters()]
        out.append(
            {
                "strategy": strategy,
                "loss": _rel(cp.global_sum(loss), ref_loss.detach()),
                "worst_grad": max(errs),
            }
        )
    return out


def _cp_worker(rank: int, world: int, strategies: list[str]) -> dict:
    return {
        "collectives": _cp_compiled_collectives(rank, world),
        "llama": _cp_compiled_llama(rank, world, strategies),
        # The per-row metadata path under CP; the strategies themselves are covered by Llama.
        "flux": _cp_compiled_flux(rank, world, ["ulysses", "ring"]),
    }


def test_cp_compiled_every_strategy_matches_one_process_on_2_ranks():
    rules = usp_graph.registry.rules()
    for worker in run_ranks(_cp_worker, 2, STRATEGIES):
        c = worker["collectives"]
        assert c["out"] and c["grad"], c
        assert c["usp_ops"]["backward"] == {
            "usp.all_gather.default": 1,
            "usp.all_to_all.default": 1,
            "usp.reduce_scatter.default": 2,
        }, c
        for r in worker["flux"]:
            assert r["loss"] <= 1e-5 and r["worst_grad"] <= 1e-5, r
        results = worker["llama"]
        for r in results:
            assert r["none_grads"] == [] and r["compiles"] == 1 and r["rewritten"] == 2, r
            assert r["loss"] <= 1e-5 and r["worst_grad"] <= 1e-5, r
            # Every forward collective has its adjoint in the compiled backward (what verify checked).
            forward, backward = r["usp_ops"]["forward"], r["usp_ops"]["backward"]
            collectives = {str(op): rule for op, rule in rules.items() if rule.kind == "collective"}
            adjoints = [(name, str(collectives[name].adjoint)) for name in forward if name in collectives]
            assert adjoints or "usp.ring_attn_fwd.default" in forward, r
            for name, adjoint in adjoints:
                assert backward.get(adjoint, 0) >= forward[name], (r["strategy"], name, adjoint)


# ---- HuggingFace transformers ----------------------------------------------------------------------


def test_hf_llama_compiled_with_usp_is_bitwise_equal_to_eager():
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    assert model.config._attn_implementation == "sdpa"

    def step_fn(m, batch):
        out = m(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"])
        return out.loss, out.logits

    batches = []
    for seed, lengths in enumerate(([5, 7], [3, 3, 6], None)):
        gen = torch.Generator().manual_seed(seed)
        ids = torch.randint(0, 64, (1, 12), generator=gen)
        if lengths is None:
            batches.append(({"input_ids": ids, "position_ids": torch.arange(12)[None], "labels": ids}, None))
            continue
        pos = torch.cat([torch.arange(n) for n in lengths])[None]
        batches.append(
            (
                {"input_ids": ids, "position_ids": pos, "labels": ids},
                AttentionMetadata.from_position_ids(pos, max_docs=4),
            )
        )
    reports = _adamw_steps(model, step_fn, batches)
    assert sum(len(r.rewritten) for r in reports) == config.num_hidden_layers
    assert all(r.kept == () for r in reports) and len(reports) == 1


def test_only_32_bit_index_bounds_on_metadata_symbols_are_tolerated():
    # A GPU code generator guards `numel <= 2**31 - 1` to index with int32; int32 cu_seqlens always
    # satisfy it, so it does not specialize the metadata. Anything else still fails the compile.
    import sympy

    from usp_graph.backend.inputs import is_index_bound

    s = sympy.Symbol("s9", integer=True, positive=True)
    assert is_index_bound(s <= 2**31 - 1) and is_index_bound(s < 2**31) and is_index_bound(2**31 - 1 >= s)
    assert not is_index_bound(s <= 4096)
    assert not is_index_bound(sympy.Eq(s, 8))
    assert not is_index_bound(s + 1 <= 2**31 - 1)
    assert not is_index_bound(s >= 2)


def test_sdpa_run_eagerly_inside_documents_raises_instead_of_attending_across_them():
    from usp_graph.backend.documents import EagerAttentionError

    @torch.compiler.disable
    def attend(q):
        return F.scaled_dot_product_attention(q, q, q, is_causal=True)

    compiled = torch.compile(lambda q: attend(q * 2) + 1, backend="usp")
    q = torch.randn(1, 2, 8, 4)
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=2)
    with documents(meta):
        with pytest.raises(EagerAttentionError, match="ran eagerly, outside every graph"):
            compiled(q)
        with pytest.raises(EagerAttentionError):
            F.scaled_dot_product_attention(q, q, q)
        with attention_mode(meta):  # eager code under attention_mode is routed, not refused
            assert torch.equal(F.scaled_dot_product_attention(q, q, q), sdpa_to_usp(q, q, q, metadata=meta))
        traced = make_fx(lambda x: F.scaled_dot_product_attention(x, x, x), tracing_mode="fake")(
            q
        )  # not a run
        assert any("scaled_dot_product" in str(n.target) for n in traced.graph.nodes)
    assert torch.equal(compiled(q), attend(q * 2) + 1)  # outside any block: plain SDPA


# ---- what a compiled graph keeps ------------------------------------------------------------------


class _BrokenAfterFirstLayer(nn.Module):
    """Two layers with a graph break between them (as transformers' checkpointed layers break on
    5.25): the second graph's inputs are the first layer's activations."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
        h = self.a(x).relu()
        torch._dynamo.graph_break()
        return self.b(h).sum(), h


def test_a_compiled_graph_keeps_no_tensor_of_the_call_it_was_compiled_for():
    """The backend's compiled function outlives the call it was compiled at: it must not hold that
    call's tensors (at 64K tokens with checkpointing, the activations and logits the graphs behind
    each break were handed: 4.4 GiB held between steps on an H100)."""
    import gc
    import weakref

    torch._dynamo.reset()
    model = _BrokenAfterFirstLayer()
    compiled = torch.compile(model, backend="usp")
    refs = []
    for _ in range(2):
        x = torch.randn(8, 16, requires_grad=True)
        loss, h = compiled(x)
        loss.backward()
        refs.append((weakref.ref(x), weakref.ref(h)))
        del x, h, loss
    gc.collect()
    assert [(rx() is None, rh() is None) for rx, rh in refs] == [(True, True)] * 2
    torch._dynamo.reset()


def test_a_checkpointed_transformers_model_under_backend_usp_keeps_no_activation_between_steps():
    """The same on a transformers model as users run it: checkpointed layers (where transformers
    5.25 breaks the graph), backend usp; between steps no activation of the batch stays alive."""
    import gc

    pytest.importorskip("transformers")
    from tests.realmodels import checkpoint_layers, lm_batch, lm_forward, make_lm, weighted_loss

    torch._dynamo.reset()
    model = make_lm("llama")
    checkpoint_layers(model, use_reentrant=False)
    compiled = torch.compile(model, backend="usp")
    ids, pos = lm_batch(1, 24, seed=0)
    own = {id(t) for t in model.parameters()} | {id(t) for t in model.buffers()}

    def activations() -> list[tuple[int, ...]]:
        gc.collect()
        return [
            tuple(o.shape)
            for o in gc.get_objects()
            if type(o) is torch.Tensor and id(o) not in own and o.dim() == 3 and o.shape[:2] == (1, 24)
        ]

    for _ in range(2):
        model.zero_grad(set_to_none=True)
        weighted_loss(lm_forward(compiled, ids, pos)).backward()
        assert activations() == []
    torch._dynamo.reset()
