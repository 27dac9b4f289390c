# B batch, H heads, G kv heads, L sequence, K head dim, T packed tokens
"""find_sites on every SDPA form, rewrite_sdpa, verify, and the pass pipeline."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor, nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import usp_graph.passes.rewrite as rewrite_module
from usp_graph import (
    AttentionMetadata,
    VerifyError,
    attention_mode,
    default_pipeline,
    find_sites,
    registry,
    trace_train_step,
)
from usp_graph.passes import Pass, PassResult, Pipeline, rewrite_sdpa, verify

VARLEN_FWD = torch.ops.usp.varlen_fwd.default
VARLEN_BWD = torch.ops.usp.varlen_bwd.default


def qkv(seq: int = 12, heads: int = 4, kv_heads: int = 2, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(1, heads, seq, 16, generator=g),
        torch.randn(1, kv_heads, seq, 16, generator=g),
        torch.randn(1, kv_heads, seq, 16, generator=g),
    )


def gqa_attention(q, k, v):
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=0.3) * 2


def count(gm: fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


class TinyAttention(nn.Module):
    """`layers` causal attention layers with a residual; each makes one SDPA call."""

    def __init__(self, layers: int = 2, dim: int = 8, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.ModuleList(nn.Linear(dim, 3 * dim) for _ in range(layers))

    def forward(self, x_BLD: Tensor) -> Tensor:
        for lin in self.qkv:
            q, k, v = lin(x_BLD).unflatten(-1, (3, self.heads, -1)).permute(2, 0, 3, 1, 4)
            o_BHLK = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x_BLD = x_BLD + o_BHLK.transpose(1, 2).flatten(2)
        return x_BLD


def tiny_loss(model: nn.Module, batch: dict[str, Tensor]) -> Tensor:
    return model(batch["x"]).square().mean()


def tiny_inputs(lengths, seed: int = 0):
    x = torch.randn(1, sum(lengths), 8, generator=torch.Generator().manual_seed(seed))
    return {"x": x}, AttentionMetadata.from_lengths(lengths, max_docs=4)


def tiny_trace(passes: Pipeline | None = None, **kwargs):
    torch.manual_seed(0)
    model = TinyAttention()
    batch, meta = tiny_inputs([4, 6])
    return model, trace_train_step(
        model, tiny_loss, batch, meta, dynamic={"x": {1: "T"}}, passes=passes, **kwargs
    )


# ---- find_sites: one record per SDPA form -------------------------------------------------------


def test_pre_dispatch_make_fx_site_is_aten_sdpa():
    gm = make_fx(gqa_attention, pre_dispatch=True)(*qkv())
    (site,) = find_sites(gm)
    assert site.form == "aten" and site.node.target is torch.ops.aten.scaled_dot_product_attention.default
    assert (site.is_causal, site.scale, site.enable_gqa, site.dropout_p, site.attn_mask) == (
        True,
        0.3,
        True,
        0.0,
        None,
    )
    assert site.q_shape == (1, 4, 12, 16) and site.k_shape == (1, 2, 12, 16) and site.dtype == torch.float32
    assert site.rewritable and site.reason is None


def test_plain_make_fx_site_is_the_cpu_flash_kernel():
    gm = make_fx(gqa_attention, tracing_mode="symbolic", record_stack_traces=True)(*qkv())
    (site,) = find_sites(gm)
    assert site.form == "flash_cpu" and site.output_is_tuple
    assert (site.is_causal, site.scale, site.enable_gqa) == (True, 0.3, True)  # GQA read off the head counts
    assert site.rewritable, site.reason


def test_dynamo_graph_site_is_torch_level_sdpa():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    torch.compile(gqa_attention, backend=capture, fullgraph=True)(*qkv())
    (site,) = find_sites(graphs[0])
    assert site.form == "torch" and site.node.target is torch._C._nn.scaled_dot_product_attention
    assert (site.is_causal, site.scale, site.enable_gqa) == (True, 0.3, True) and site.rewritable
    assert site.q_shape == (1, 4, 12, 16)
    assert "test_passes.py:" in site.source and site.source.endswith("in gqa_attention")


def _hand_built(op, args, kwargs, *, use_lse: bool = False) -> fx.GraphModule:
    """`op(q, k, v, *args, **kwargs)[0]` on fake (B, H, L, K) inputs, as a post-dispatch CUDA graph holds it."""
    graph = fx.Graph()
    with FakeTensorMode():
        vals = [torch.empty(2, 4, 16, 8) for _ in range(3)]
    inputs = []
    for name, val in zip("qkv", vals, strict=True):
        node = graph.placeholder(name)
        node.meta["val"] = val
        inputs.append(node)
    call = graph.call_function(op, (*inputs, *args), kwargs)
    out = graph.call_function(operator.getitem, (call, 0))
    outs = (out, graph.call_function(operator.getitem, (call, 1))) if use_lse else (out,)
    graph.output(outs)
    return fx.GraphModule(nn.Module(), graph)


aten = torch.ops.aten
CUDA_FORMS = [
    ("flash", aten._scaled_dot_product_flash_attention.default, (0.0, True, False), {"scale": 0.5}),
    (
        "efficient",
        aten._scaled_dot_product_efficient_attention.default,
        (None, False, 0.0, True),
        {"scale": 0.5},
    ),
    (
        "cudnn",
        aten._scaled_dot_product_cudnn_attention.default,
        (None, False, 0.0, True, False),
        {"scale": 0.5},
    ),
    (
        "overrideable",
        aten._scaled_dot_product_fused_attention_overrideable.default,
        (None, 0.0, True),
        {"scale": 0.5},
    ),
]


@pytest.mark.parametrize(("form", "op", "args", "kwargs"), CUDA_FORMS, ids=[f[0] for f in CUDA_FORMS])
def test_post_dispatch_cuda_kernels_are_sites(form, op, args, kwargs):
    (site,) = find_sites(_hand_built(op, args, kwargs))
    assert site.form == form and site.output_is_tuple
    assert (site.is_causal, site.scale, site.enable_gqa, site.dropout_p) == (True, 0.5, False, 0.0)
    assert site.q_shape == (2, 4, 16, 8) and site.rewritable, site.reason


def test_post_dispatch_site_whose_logsumexp_is_used_is_not_rewritable():
    form, op, args, kwargs = CUDA_FORMS[0]
    (site,) = find_sites(_hand_built(op, args, kwargs, use_lse=True))
    assert not site.rewritable and "joint graph" in site.reason


def test_sdpa_in_a_joint_graph_is_reported_not_rewritable():
    def joint(q, k, v):
        out = gqa_attention(q, k, v)
        return torch.autograd.grad(out.sum(), (q, k, v))

    q, k, v = (t.requires_grad_() for t in qkv())
    gm = make_fx(joint)(q, k, v)
    (site,) = find_sites(gm)
    assert site.form == "flash_cpu" and not site.rewritable
    assert "rewrite the forward graph before differentiating" in site.reason


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
            "attn_mask is not a document mask: the mask depends on the values of input",
        ),
        (
            lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, dropout_p=0.1),
            "dropout inside attention is not supported",
        ),
        (
            lambda q, k, v, m: F.scaled_dot_product_attention(
                q * 2, torch.cat([q, k], 2), torch.cat([v, v], 2)
            ),
            "a KV cache is not supported",
        ),
    ],
    ids=["float_mask", "dropout", "longer_self_keys"],
)
def test_unrewritable_site_is_reported_and_left_as_sdpa(fn, reason):
    q, k, v = qkv(kv_heads=4)
    mask = torch.randn(1, 1, 12, 12)
    gm = make_fx(fn, tracing_mode="symbolic", pre_dispatch=True)(q, k, v, mask)
    (site,) = find_sites(gm)
    assert not site.rewritable and reason in site.reason
    result = rewrite_sdpa(gm, metadata=AttentionMetadata.from_lengths([12]))
    assert result.matches == 0 and [s.node for s in result.skipped] == [site.node]
    assert count(gm, aten.scaled_dot_product_attention.default) == 1 and count(gm, VARLEN_FWD) == 0
    assert gm.meta["usp_skipped"] == [(site.name, site.reason, site.source)]


# ---- rewrite_sdpa on graphs from other tracers --------------------------------------------------


def test_rewrite_of_plain_make_fx_inference_graph_equals_attention_mode_bitwise():
    q, k, v = qkv()
    gm = make_fx(gqa_attention, tracing_mode="symbolic")(q, k, v)
    meta = AttentionMetadata.from_lengths([5, 7], max_docs=4)
    result = rewrite_sdpa(gm, metadata=meta)
    assert result.matches == 1 and count(gm, VARLEN_FWD) == 1 and find_sites(gm) == []
    for lengths in ([5, 7], [2, 2, 8]):
        meta = AttentionMetadata.from_lengths(lengths, max_docs=4)
        with attention_mode(meta):
            ref = gqa_attention(q, k, v)
        assert torch.equal(gm(q, k, v, meta.cu_seqlens, meta.max_seqlen), ref)


def test_rewrite_of_dynamo_graph_adds_metadata_inputs_and_equals_attention_mode_bitwise():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm

    torch._dynamo.reset()
    q, k, v = qkv(seed=1)
    torch.compile(gqa_attention, backend=capture, fullgraph=True, dynamic=False)(q, k, v)
    gm = graphs[0]
    result = rewrite_sdpa(gm, metadata=AttentionMetadata.from_lengths([5, 7], max_docs=4))
    assert result.matches == 1
    cu, max_seqlen = list(gm.graph.find_nodes(op="placeholder"))[-2:]
    assert (cu.name, max_seqlen.name) == ("cu_seqlens_N1", "max_seqlen")
    assert isinstance(max_seqlen.meta["val"], torch.SymInt)
    for lengths, bound in (([5, 7], 7), ([3, 3, 6], 9)):
        meta = AttentionMetadata.from_lengths(lengths, max_docs=4, max_seqlen=bound)
        with attention_mode(meta):
            ref = gqa_attention(q, k, v)
        (out,) = gm(q, k, v, meta.cu_seqlens, meta.max_seqlen)
        assert torch.equal(out, ref)


def test_rewrite_needs_a_shape_env_to_make_max_seqlen_an_input():
    form, op, args, kwargs = CUDA_FORMS[0]
    gm = _hand_built(op, args, kwargs)  # fake values from a FakeTensorMode without a ShapeEnv
    with pytest.raises(ValueError, match="no symbolic ShapeEnv, so max_seqlen cannot become a SymInt input"):
        rewrite_sdpa(gm, metadata=AttentionMetadata.from_lengths([12]))


def test_rewrite_forwards_cp_to_sdpa_to_usp_only_when_given(monkeypatch):
    calls = []
    original = rewrite_module.sdpa_to_usp

    def spy(*args, **kwargs):
        calls.append(dict(kwargs))
        kwargs.pop("cp", None)  # sdpa_to_usp gains `cp` with the CP work
        return original(*args, **kwargs)

    monkeypatch.setattr(rewrite_module, "sdpa_to_usp", spy)
    plan = object()
    for cp in (None, plan):
        gm = make_fx(gqa_attention, tracing_mode="symbolic", pre_dispatch=True)(*qkv())
        rewrite_sdpa(gm, metadata=AttentionMetadata.from_lengths([12]), cp=cp)
    assert "cp" not in calls[0] and calls[1]["cp"] is plan
    assert all(isinstance(c["metadata"], AttentionMetadata) for c in calls)
    tiny_trace(cp=plan)
    assert calls[-1]["cp"] is plan


# ---- verify -------------------------------------------------------------------------------------


def test_verify_fails_naming_the_node_when_a_registry_rule_is_removed(monkeypatch):
    _, graph = tiny_trace()
    verify(graph.graph_module)
    monkeypatch.delitem(registry._RULES, VARLEN_FWD)
    with pytest.raises(
        VerifyError,
        match=r"node varlen_fwd \(usp\.varlen_fwd\.default\) at \S+test_passes\.py:\d+ in forward has no backward rule"
        r".*add its row .* to TABLE in usp_graph/registry\.py",
    ):
        verify(graph.graph_module)


def test_verify_fails_naming_the_forward_node_when_its_backward_node_is_removed():
    _, graph = tiny_trace(passes=default_pipeline().disable("verify"))
    gm = graph.graph_module
    bwd = next(n for n in gm.graph.nodes if n.target is VARLEN_BWD)
    origin = bwd.meta["usp_fwd_node"]
    for user in list(bwd.users):  # dq, dk, dv -> zeros: the graph stays valid, the rule's op is gone
        with gm.graph.inserting_before(user):
            zero = gm.graph.call_function(aten.zeros_like.default, (bwd.args[1 + user.args[1]],))
        user.replace_all_uses_with(zero)
        gm.graph.erase_node(user)
    gm.graph.erase_node(bwd)
    gm.recompile()
    with pytest.raises(
        VerifyError,
        match=rf"forward node {origin} \(usp\.varlen_fwd\.default\) at \S+test_passes\.py:\d+ in forward has no backward op usp\.varlen_bwd\.default",
    ):
        verify(gm)


def test_verify_rejects_sdpa_left_unreported():
    _, graph = tiny_trace(passes=default_pipeline().disable("rewrite_sdpa", "verify"))
    with pytest.raises(
        VerifyError,
        match=r"SDPA node \S+ \(flash_cpu\) from forward node scaled_dot_product_attention at \S+test_passes\.py:\d+ in forward is still in the graph",
    ):
        verify(graph.graph_module)
    with pytest.raises(VerifyError, match="still in the graph"):
        tiny_trace(passes=default_pipeline().disable("rewrite_sdpa"))


def test_verify_rejects_a_trainable_parameter_without_gradient():
    class Unused(TinyAttention):
        def __init__(self) -> None:
            super().__init__()
            self.unused = nn.Linear(2, 2)

    batch, meta = tiny_inputs([4, 6])
    with pytest.raises(VerifyError, match=r"trainable parameter 'unused.weight' has no gradient output"):
        trace_train_step(Unused(), tiny_loss, batch, meta, dynamic={"x": {1: "T"}})


def test_verify_accepts_attention_whose_output_never_reaches_the_loss():
    class DeadAttention(TinyAttention):
        def forward(self, x_BLD: Tensor) -> Tensor:
            q = x_BLD.unflatten(-1, (2, 4)).transpose(1, 2)
            F.scaled_dot_product_attention(q, q, q, is_causal=True)  # result dropped: no backward
            return super().forward(x_BLD)

    batch, meta = tiny_inputs([4, 6])
    graph = trace_train_step(DeadAttention(), tiny_loss, batch, meta, dynamic={"x": {1: "T"}})
    assert count(graph.graph_module, VARLEN_FWD) == 3 and count(graph.graph_module, VARLEN_BWD) == 2


# A stand-in collective pair (namespace usp_test, so the package's registry check never sees it):
# `gather` differentiates through `scatter`, its adjoint; `gather_no_adjoint` claims the same
# adjoint but its backward never emits it, which verify must catch.
@torch.library.custom_op("usp_test::gather", mutates_args=())
def _gather(x: Tensor) -> Tensor:
    return x.clone()


@torch.library.custom_op("usp_test::gather_no_adjoint", mutates_args=())
def _gather_no_adjoint(x: Tensor) -> Tensor:
    return x.clone()


@torch.library.custom_op("usp_test::scatter", mutates_args=())
def _scatter(x: Tensor) -> Tensor:
    return x.clone()


for _op in (_gather, _gather_no_adjoint, _scatter):
    _op.register_fake(lambda x: torch.empty_like(x))


def _no_context(ctx, inputs, output) -> None:
    return None


def _gather_bwd(ctx, grad: Tensor) -> Tensor:
    return torch.ops.usp_test.scatter(grad)


def _wrong_bwd(ctx, grad: Tensor) -> Tensor:
    return grad.clone()


torch.library.register_autograd("usp_test::gather", _gather_bwd, setup_context=_no_context)
torch.library.register_autograd("usp_test::gather_no_adjoint", _wrong_bwd, setup_context=_no_context)
torch.library.register_autograd("usp_test::scatter", _gather_bwd, setup_context=_no_context)


class Gathered(nn.Module):
    def __init__(self, op) -> None:
        super().__init__()
        self.op = op
        self.lin = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.op(self.lin(x))


@pytest.mark.parametrize("good", [True, False], ids=["with_adjoint", "adjoint_missing"])
def test_verify_requires_each_forward_collective_to_have_its_adjoint_in_backward(monkeypatch, good):
    gather = torch.ops.usp_test.gather.default if good else torch.ops.usp_test.gather_no_adjoint.default
    scatter = torch.ops.usp_test.scatter.default
    rule = registry.BackwardRule(
        op=gather,
        kind="collective",
        setup_context=_no_context,
        backward=_gather_bwd,
        adjoint=scatter,
        doc="test",
    )
    monkeypatch.setitem(registry._RULES, gather, rule)
    monkeypatch.setitem(
        registry._RULES,
        scatter,
        registry.BackwardRule(
            op=scatter, kind="collective", setup_context=_no_context, backward=_gather_bwd, adjoint=gather
        ),
    )
    model = Gathered(gather)
    batch = {"x": torch.randn(6, 4)}
    step = lambda m, b: m(b["x"]).sum()
    if good:
        graph = trace_train_step(model, step, batch, AttentionMetadata.from_lengths([6]))
        assert count(graph.graph_module, scatter) == 1
        return
    with pytest.raises(
        VerifyError,
        match=r"forward node gather_no_adjoint \(usp_test\.gather_no_adjoint\.default\) at \S+test_passes\.py:\d+ in forward has no adjoint collective usp_test\.scatter\.default",
    ):
        trace_train_step(model, step, batch, AttentionMetadata.from_lengths([6]))


# ---- the pipeline -------------------------------------------------------------------------------


def test_pipeline_prints_as_an_ordered_list():
    text = str(default_pipeline().disable("verify"))
    lines = text.splitlines()
    assert lines[0] == "Pipeline (4 passes):"
    assert lines[1].split()[:3] == ["1.", "rewrite_sdpa", "on"]
    assert lines[2].split()[:3] == ["2.", "joint", "on"] and "(required)" in lines[2]
    assert lines[3].split()[:3] == ["3.", "verify", "off"]
    assert lines[4].split()[:3] == ["4.", "overlap", "on"]


def test_pipeline_rejects_unknown_and_required_pass_names():
    with pytest.raises(
        ValueError,
        match=r"unknown pass\(es\) \['nope'\]; the passes are \['rewrite_sdpa', 'joint', 'verify', 'overlap'\]",
    ):
        default_pipeline().disable("nope")
    with pytest.raises(ValueError, match="pass 'joint' is required and cannot be disabled"):
        default_pipeline().disable("joint")
    for bad in (3, [3], None):
        with pytest.raises(
            TypeError, match=r"pass names.*the passes are \['rewrite_sdpa', 'joint', 'verify', 'overlap'\]"
        ):
            default_pipeline().with_dump(only=bad) if bad is not None else default_pipeline().disable(None)


def test_pipeline_reports_match_counts_and_skips_disabled_passes():
    model, graph = tiny_trace()
    n_params = len(list(model.parameters()))
    # overlap: no collective in one process
    assert graph.run.matches == {"rewrite_sdpa": 2, "joint": n_params, "verify": 2 + n_params, "overlap": 0}
    assert all(isinstance(r, PassResult) for r in graph.run.results)
    _, graph = tiny_trace(passes=default_pipeline().disable("verify"))
    assert [r.name for r in graph.run.results] == ["rewrite_sdpa", "joint", "overlap"]


def test_every_node_records_the_pass_that_created_it():
    _, graph = tiny_trace()
    tags = {n: n.meta.get("usp_pass") for n in graph.graph_module.graph.nodes}
    assert set(tags.values()) == {"trace", "rewrite_sdpa", "joint"}
    for node, tag in tags.items():
        if node.target is VARLEN_FWD:
            assert tag == "rewrite_sdpa" and node.meta["usp_phase"] == "forward"
        elif node.target is VARLEN_BWD:
            assert tag == "joint" and node.meta["usp_phase"] == "backward"
        elif node.target is aten.mm.default and node.meta["usp_phase"] == "forward":
            assert tag == "trace"
    assert all(n.meta.get("usp_pass") in ("trace", "rewrite_sdpa") for n in graph.forward_graph.graph.nodes)


def test_pipeline_dumps_each_pass_before_and_after(tmp_path):
    _, graph = tiny_trace(passes=default_pipeline().with_dump(tmp_path, only=["rewrite_sdpa", "joint"]))
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "01_rewrite_sdpa.after.txt",
        "01_rewrite_sdpa.before.txt",
        "02_joint.after.txt",
        "02_joint.before.txt",
    ]
    before, after = graph.run.dumps["rewrite_sdpa"]
    assert "scaled_dot_product_attention" in before and "varlen_fwd" not in before
    assert "usp.varlen_fwd" in after and "usp_pass: rewrite_sdpa" in after
    assert "varlen_bwd" in (tmp_path / "02_joint.after.txt").read_text()
    assert "verify" not in graph.run.dumps


def test_pipeline_runs_a_custom_pass_and_tags_its_nodes():
    def double_loss(gm: fx.GraphModule, ctx) -> PassResult:
        (out,) = gm.graph.find_nodes(op="output")
        (loss,) = out.args
        with gm.graph.inserting_before(out):
            doubled = gm.graph.call_function(aten.mul.Tensor, (loss, 2.0))
        out.args = (doubled,)
        gm.recompile()
        return PassResult("double_loss", gm, 1)

    base = default_pipeline()
    pipeline = Pipeline([base.passes[0], Pass("double_loss", double_loss, "loss * 2"), *base.passes[1:]])
    model, graph = tiny_trace(passes=pipeline)
    (doubled,) = [n for n in graph.forward_graph.graph.nodes if n.meta.get("usp_pass") == "double_loss"]
    batch, meta = tiny_inputs([3, 3, 5], seed=2)
    loss, _ = graph.replay(dict(model.named_parameters()), batch, meta)
    with attention_mode(meta):
        assert torch.equal(loss, tiny_loss(model, batch).detach() * 2)


def test_without_rewrite_the_replay_equals_plain_eager_sdpa_bitwise():
    model, graph = tiny_trace(passes=default_pipeline().disable("rewrite_sdpa", "verify"))
    assert count(graph.graph_module, VARLEN_FWD) == 0
    batch, meta = tiny_inputs([7, 6], seed=3)
    loss, grads = graph.replay(dict(model.named_parameters()), batch, meta)
    ref = copy.deepcopy(model)
    ref_loss = tiny_loss(ref, batch)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    for name, p in ref.named_parameters():
        assert torch.equal(grads[name], p.grad), name
