# B batch, T packed tokens, L sequence, H heads, K head dim, D model dim
"""trace_train_step: graph structure, bitwise replay against eager attention_mode, dynamic dims, input checks."""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from usp_graph import (
    AttentionMetadata,
    TrainStepGraph,
    attention_mode,
    find_sites,
    registry,
    trace_train_step,
)
from usp_graph.models import (
    Flux,
    FluxConfig,
    Llama,
    LlamaConfig,
    llama_loss,
    make_flux_batch,
    make_llama_batch,
)

VARLEN_FWD = torch.ops.usp.varlen_fwd.default
VARLEN_BWD = torch.ops.usp.varlen_bwd.default

LLAMA = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
FLUX = FluxConfig(hidden=32, n_heads=2, n_double=1, n_single=1)
FLUX_DYNAMIC = {
    "txt": {1: "Lt"},
    "txt_ids": {1: "Lt"},
    "img": {1: "Li"},
    "img_ids": {1: "Li"},
    "target": {1: "Li"},
}
MAX_DOCS = 8


def llama_model(config: LlamaConfig = LLAMA, seed: int = 0) -> Llama:
    torch.manual_seed(seed)
    return Llama(config)


def llama_inputs(lengths, seed: int, config: LlamaConfig = LLAMA, max_seqlen: int | None = None):
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(seed))
    meta = AttentionMetadata.from_position_ids(
        batch["position_ids"], max_docs=MAX_DOCS, max_seqlen=max_seqlen
    )
    return batch, meta


def count(gm: torch.fx.GraphModule, target) -> int:
    return sum(1 for n in gm.graph.nodes if n.target is target)


@pytest.fixture(scope="module")
def llama_traced() -> tuple[Llama, TrainStepGraph]:
    model = llama_model()
    batch, meta = llama_inputs([5, 7, 3], seed=0)
    return model, trace_train_step(model, llama_loss, batch, meta)


def eager_step(model, loss_fn, batch, meta):
    model.zero_grad(set_to_none=True)
    with attention_mode(meta):
        loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def grad_norm(grads) -> torch.Tensor:
    return torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))


def assert_bitwise(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], what: str) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), f"{what} {name} differs"


# ---- structure ----------------------------------------------------------------------------------


def test_each_sdpa_call_becomes_one_varlen_fwd_and_one_varlen_bwd():
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64)
    batch, meta = llama_inputs([6, 4], seed=1, config=config)
    graph = trace_train_step(llama_model(config), llama_loss, batch, meta)
    gm = graph.graph_module
    assert count(gm, VARLEN_FWD) == 3
    assert count(gm, VARLEN_BWD) == 3
    assert find_sites(gm) == [] and find_sites(graph.forward_graph) == []
    assert len(graph.sites) == 3 and graph.skipped == ()


def test_graph_inputs_are_params_then_batch_then_metadata(llama_traced):
    model, graph = llama_traced
    placeholders = list(graph.graph_module.graph.find_nodes(op="placeholder"))
    names = [p.name for p in placeholders]
    n_params = len(list(model.parameters()))
    assert names[0] == "p_tok_embeddings_weight" and len(names) == n_params + 3 + 2
    assert names[n_params:] == ["in_input_ids", "in_position_ids", "in_labels", "cu_seqlens_N1", "max_seqlen"]
    cu_val = placeholders[-2].meta["val"]
    assert tuple(cu_val.shape) == (MAX_DOCS + 1,) and cu_val.dtype == torch.int32
    assert isinstance(placeholders[-1].meta["val"], torch.SymInt)


def test_metadata_reaches_varlen_as_graph_inputs_never_constants(llama_traced):
    _, graph = llama_traced
    gm = graph.graph_module
    cu, max_seqlen = list(gm.graph.find_nodes(op="placeholder"))[-2:]
    for node in gm.graph.nodes:
        if node.target in (VARLEN_FWD, VARLEN_BWD):
            args = node.args[-7:-2] if node.target is VARLEN_BWD else node.args[3:7]
            assert list(args[-4:]) == [cu, cu, max_seqlen, max_seqlen], node.format_node()


def test_token_dim_is_symbolic_and_shared_by_name(llama_traced):
    _, graph = llama_traced
    batch_specs = {t.name: t.shape for t in graph.signature.batch}
    assert batch_specs == {"input_ids": (1, "T"), "position_ids": (1, "T"), "labels": (1, "T")}
    tokens = graph.signature.symbols["T"]
    assert all(expr == tokens for _, _, expr in graph.signature.token_checks)


def test_token_count_equal_to_head_dim_is_not_duck_sized():
    # head dim 8 == 8 tokens: a duck-sized trace would merge them and bake the token count in.
    batch, meta = llama_inputs([3, 5], seed=2)
    assert batch["input_ids"].shape[1] == LLAMA.head_dim == 8
    model = llama_model()
    graph = trace_train_step(model, llama_loss, batch, meta)
    batch2, meta2 = llama_inputs([4, 9, 2], seed=3)
    loss, grads = graph.replay(dict(model.named_parameters()), batch2, meta2)
    ref_loss, ref_grads = eager_step(copy.deepcopy(model), llama_loss, batch2, meta2)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads, ref_grads, "grad")


# ---- bitwise against eager ----------------------------------------------------------------------


def _adamw_steps(model, loss_fn, inputs, replay_fn=None):
    """10 AdamW steps; per step (loss, grad norm, grads, params after the step)."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    history = []
    for batch, meta in inputs:
        if replay_fn is None:
            loss, grads = eager_step(model, loss_fn, batch, meta)
        else:
            loss, grads = replay_fn(dict(model.named_parameters()), batch, meta)
            for name, p in model.named_parameters():
                p.grad = grads[name]
        norm = grad_norm(grads)
        opt.step()
        params = {n: p.detach().clone() for n, p in model.named_parameters()}
        history.append((loss, norm, {n: g.clone() for n, g in grads.items()}, params))
    return history


def _assert_same_history(eager, replayed):
    assert len(eager) == len(replayed) == 10
    for step, ((l1, n1, g1, p1), (l2, n2, g2, p2)) in enumerate(zip(eager, replayed, strict=True)):
        assert torch.equal(l1, l2), f"step {step}: loss {l1.item()} vs {l2.item()}"
        assert torch.equal(n1, n2), f"step {step}: grad norm"
        assert_bitwise(g1, g2, f"step {step}: grad")
        assert_bitwise(p1, p2, f"step {step}: param")


# The 10-step Llama and Flux replays (eager vs replayed, bitwise) live in tests/test_graphfile.py,
# which traces the same steps once for them and for their saved files loaded here and fresh.


def test_traced_with_boundaries_a_replayed_with_b_equals_eager_with_b_bitwise(llama_traced):
    model, graph = llama_traced
    batch_b, meta_b = llama_inputs([2, 8, 1, 6, 4], seed=30, max_seqlen=12)
    assert meta_b.total_tokens != 15 and len([n for n in meta_b.lengths() if n]) == 5  # A: 3 docs, 15 tokens
    loss, grads = graph.replay(dict(model.named_parameters()), batch_b, meta_b)
    ref_loss, ref_grads = eager_step(copy.deepcopy(model), llama_loss, batch_b, meta_b)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads, ref_grads, "grad")


def test_max_seqlen_changes_without_retracing(llama_traced):
    model, graph = llama_traced
    batch, meta = llama_inputs([5, 7, 3], seed=31, max_seqlen=40)
    loss, grads = graph.replay(dict(model.named_parameters()), batch, meta)
    ref_loss, ref_grads = eager_step(copy.deepcopy(model), llama_loss, batch, meta)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads, ref_grads, "grad")


def test_frozen_parameter_is_an_input_without_a_grad_output():
    model = llama_model()
    model.tok_embeddings.weight.requires_grad_(False)
    batch, meta = llama_inputs([6, 6], seed=7)
    graph = trace_train_step(model, llama_loss, batch, meta)
    loss, grads = graph.replay(dict(model.named_parameters()), batch, meta)
    assert "tok_embeddings.weight" not in grads
    assert set(grads) == {n for n, p in model.named_parameters() if p.requires_grad}
    ref_loss, ref_grads = eager_step(copy.deepcopy(model), llama_loss, batch, meta)
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads, {n: g for n, g in ref_grads.items() if g is not None}, "grad")


# ---- sites kept as SDPA -------------------------------------------------------------------------


class BiasedAttention(nn.Module):
    """One attention layer with an additive float bias from the batch: not provably a document mask."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(8, 24)

    def forward(self, x_BLD: torch.Tensor, bias_11LL: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x_BLD).unflatten(-1, (3, 2, 4)).permute(2, 0, 3, 1, 4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias_11LL)


def biased_loss(model: BiasedAttention, batch) -> torch.Tensor:
    return model(batch["x"], batch["bias"]).square().mean()


def test_float_mask_site_is_reported_and_kept_not_rewritten():
    torch.manual_seed(8)
    model = BiasedAttention()
    batch = {"x": torch.randn(1, 10, 8), "bias": torch.randn(1, 1, 10, 10)}
    meta = AttentionMetadata.from_lengths([10], max_docs=2)
    graph = trace_train_step(
        model, biased_loss, batch, meta, dynamic={"x": {1: "T"}, "bias": {2: "T", 3: "T"}}
    )
    assert graph.sites == () and len(graph.skipped) == 1
    (site,) = graph.skipped
    assert "attn_mask" in site.reason and site.source.endswith("in forward")
    assert count(graph.graph_module, VARLEN_FWD) == 0
    assert [s.form for s in find_sites(graph.graph_module)] == ["flash_cpu"]
    # Kept SDPA replays like plain eager SDPA, at a new length too.
    batch2 = {"x": torch.randn(1, 13, 8), "bias": torch.randn(1, 1, 13, 13)}
    loss, grads = graph.replay(
        dict(model.named_parameters()), batch2, AttentionMetadata.from_lengths([13], max_docs=2)
    )
    ref = copy.deepcopy(model)
    ref_loss = biased_loss(ref, batch2)
    ref_loss.backward()
    assert torch.equal(loss, ref_loss)
    assert_bitwise(grads, {n: p.grad for n, p in ref.named_parameters()}, "grad")


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor(2.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale


def test_buffers_are_inputs_after_params_and_default_to_the_models():
    torch.manual_seed(11)
    model = WithBuffer()
    step = lambda m, b: m(b["x"]).square().mean()
    graph = trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6]))
    names = [p.name for p in graph.graph_module.graph.find_nodes(op="placeholder")]
    assert names == ["p_lin_weight", "p_lin_bias", "buf_scale", "in_x", "cu_seqlens_N1", "max_seqlen"]
    x = torch.randn(9, 4)
    params = dict(model.named_parameters())
    for scale in (None, torch.tensor(3.0)):
        buffers = None if scale is None else {"scale": scale}
        loss, _ = graph.replay(params, {"x": x}, AttentionMetadata.from_lengths([9]), buffers=buffers)
        ref = copy.deepcopy(model)
        if scale is not None:
            ref.scale.copy_(scale)
        assert torch.equal(loss, step(ref, {"x": x}))


# ---- dynamic dims and guards --------------------------------------------------------------------


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def test_a_step_that_specializes_the_token_count_is_rejected():
    def step(model, batch):
        n = int(batch["x"].shape[0])  # bakes the token count in
        return model.lin(batch["x"]).sum() * n

    batch = {"x": torch.randn(6, 4)}
    with pytest.raises(ValueError, match=r"dynamic dim 'T' \(batch\['x'\] dim 0\) was specialized to 6"):
        trace_train_step(Tiny(), step, batch, AttentionMetadata.from_lengths([6]))


def test_a_guard_recorded_while_tracing_is_checked_at_replay():
    def step(model, batch):
        x = batch["x"]
        return model.lin(x[:4] if x.shape[0] % 2 == 0 else x).sum()

    model = Tiny()
    graph = trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6]))
    params = dict(model.named_parameters())
    graph.replay(params, {"x": torch.randn(10, 4)}, AttentionMetadata.from_lengths([10]))
    with pytest.raises(
        ValueError, match=r"these inputs \(T=9, max_seqlen=9\) break an assumption made while tracing: .*T, 2"
    ):
        graph.replay(params, {"x": torch.randn(9, 4)}, AttentionMetadata.from_lengths([9]))


def test_a_size_bound_learned_while_tracing_is_checked_at_replay():
    def step(model, batch):
        x = batch["x"]
        return model.lin(x[:4] if x.shape[0] > 5 else x).sum()

    model = Tiny()
    graph = trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6]))
    with pytest.raises(ValueError, match=r"batch\['x'\] dim 0 = 5, but the graph was traced for T >= 6"):
        graph.replay(
            dict(model.named_parameters()), {"x": torch.randn(5, 4)}, AttentionMetadata.from_lengths([5])
        )


@pytest.mark.parametrize(
    ("dynamic", "error"),
    [
        ({"nope": 0}, r"dynamic names batch key 'nope', which the batch does not have"),
        ({"x": 3}, r"dynamic\['x'\] names dim 3, but x has shape \(6, 4\)"),
        ({"x": {0: "max_seqlen"}}, r"dim names must be identifiers other than 'max_seqlen'"),
        ({"x": 0, "y": {0: "T"}}, r"batch\['y'\] dim 0 has size 5 but dim 'T' is 6"),
        ({"y": {1: "T"}}, r"has size 1 in the example batch"),
        ([0], r"dynamic must map batch keys"),
    ],
)
def test_bad_dynamic_specs_are_rejected(dynamic, error):
    batch = {"x": torch.randn(6, 4), "y": torch.randn(5, 1)}
    with pytest.raises((ValueError, TypeError), match=error):
        trace_train_step(
            Tiny(),
            lambda m, b: m.lin(b["x"]).sum(),
            batch,
            AttentionMetadata.from_lengths([6]),
            dynamic=dynamic,
        )


def test_no_token_dim_in_batch_asks_for_dynamic():
    batch = {"x": torch.randn(6, 4)}
    with pytest.raises(ValueError, match=r"no batch tensor has a dim of metadata.total_tokens=7"):
        trace_train_step(Tiny(), lambda m, b: m.lin(b["x"]).sum(), batch, AttentionMetadata.from_lengths([7]))


# ---- bad replay inputs --------------------------------------------------------------------------


def _bad_inputs(model):
    params = dict(model.named_parameters())
    batch, meta = llama_inputs([4, 6], seed=40)
    p_missing = {k: v for k, v in params.items() if k != "norm.weight"}
    p_extra = {**params, "extra.weight": torch.zeros(1)}
    p_shape = {**params, "norm.weight": torch.zeros(LLAMA.dim + 1)}
    p_dtype = {**params, "norm.weight": params["norm.weight"].double()}
    b_missing = {k: v for k, v in batch.items() if k != "labels"}
    b_static = {**batch, "labels": batch["labels"].expand(2, -1)}
    b_inconsistent = {**batch, "labels": batch["labels"][:, :-1]}
    b_dtype = {**batch, "input_ids": batch["input_ids"].int()}
    b_short, meta_short = llama_inputs([1], seed=41)
    meta_capacity = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=MAX_DOCS + 1)
    meta_tokens = AttentionMetadata.from_lengths([4, 7], max_docs=MAX_DOCS)
    return [
        ((p_missing, batch, meta), ValueError, r"params do not match the traced model: missing 'norm.weight'"),
        ((p_extra, batch, meta), ValueError, r"unexpected 'extra.weight'; pass dict\(model.named_parameters\(\)\)"),
        ((p_shape, batch, meta), ValueError, r"params\['norm.weight'\] has shape \(33,\), traced \(32,\)"),
        ((p_dtype, batch, meta), ValueError, r"params\['norm.weight'\] has dtype torch.float64, the graph was traced with torch.float32"),
        ((list(params.values()), batch, meta), TypeError, r"params must be a mapping of name -> tensor"),
        ((params, b_missing, meta), ValueError, r"batch does not have the traced structure: missing \['labels'\]"),
        ((params, b_static, meta), ValueError, r"batch\['labels'\] has shape \(2, 10\), traced \(1, 'T'\): dim 0 is static"),
        ((params, b_inconsistent, meta), ValueError, r"batch\['labels'\] dim 1 is 9 but dynamic dim 'T' is 10 from batch\['input_ids'\] dim 1"),
        ((params, b_dtype, meta), ValueError, r"batch\['input_ids'\] has dtype torch.int32"),
        ((params, batch, meta.cu_seqlens), TypeError, r"metadata must be a usp_graph.AttentionMetadata"),
        ((params, batch, meta_capacity), ValueError, r"metadata has capacity max_docs=9 but the graph was traced with max_docs=8"),
        ((params, batch, meta_tokens), ValueError, r"metadata describes 11 tokens but attention site scaled_dot_product_attention at \S+llama.py:\d+ in forward attends over 10"),
        ((params, b_short, meta_short), ValueError, r"batch\['input_ids'\] dim 1 = 1, but the graph was traced for T >= 2"),
    ]  # fmt: skip


def test_bad_replay_inputs_raise_clear_errors(llama_traced):
    model, graph = llama_traced
    for args, error, message in _bad_inputs(model):
        with pytest.raises(error, match=message):
            graph.replay(*args)


def test_trace_rejects_bad_arguments():
    batch, meta = llama_inputs([4, 4], seed=42)
    model = llama_model()
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        trace_train_step(llama_loss, llama_loss, batch, meta)
    with pytest.raises(TypeError, match="metadata must be a usp_graph.AttentionMetadata"):
        trace_train_step(model, llama_loss, batch, None)
    with pytest.raises(TypeError, match=re.escape("batch['n'] must be a tensor, got int")):
        trace_train_step(model, llama_loss, {**batch, "n": 3}, meta)
    with pytest.raises(TypeError, match="passes must be a usp_graph.passes.Pipeline"):
        trace_train_step(model, llama_loss, batch, meta, passes=["verify"])


# ---- context parallelism plugs in through `cp` --------------------------------------------------


def _cp_counts(gm) -> dict[str, int]:
    """usp ops per phase; an issued collective (the overlap pass) counts as its collective, once,
    and must have exactly one wait."""
    counts: dict[str, int] = {}
    for n in gm.graph.nodes:
        if n.op == "call_function" and getattr(n.target, "namespace", None) == "usp":
            if registry.is_wait_op(n.target):
                continue
            if registry.canonical(n.target) is not n.target:
                assert [registry.is_wait_op(u.target) for u in n.users] == [True], n.format_node()
            key = f"{registry.canonical(n.target)._schema.name.split('::')[1]}:{n.meta.get('usp_phase')}"
            counts[key] = counts.get(key, 0) + 1
    return counts


def _cp_trace_and_replay(rank: int, world: int, configs: list[tuple[str, str | None]]) -> list[dict]:
    """Per strategy: trace a CP train step (global token-mean loss), then 10 AdamW steps driven by
    replay with boundaries and token counts changed every step vs 10 eager steps."""
    from usp_graph import ContextParallel

    out = []
    for strategy, lb in configs:
        kw = {"ulysses_degree": 2} if strategy == "usp" else {}
        if strategy == "halo":  # 16 to 20 tokens per rank: documents of up to 17 tokens
            kw = {"max_document_len": 17}
        cp = ContextParallel(strategy, load_balance=lb, **kw)
        model = llama_model(seed=9)

        def step(m, b, cp=cp):
            logits = m(b["input_ids"], b["position_ids"])
            labels = b["labels"].flatten()
            loss_sum = F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum")
            return cp.token_mean(loss_sum, (labels != -100).sum())

        def shard(lengths, seed, cp=cp, strategy=strategy):
            batch, meta = llama_inputs(lengths, seed=seed, max_seqlen=17 if strategy == "halo" else 40)
            return {k: cp.shard(v, 1) for k, v in batch.items()}, meta

        example = shard([9, 7, 11, 5], 50)
        graph = trace_train_step(model, step, *example, cp=cp)
        doc_lists = [[3, 20, 1, 4, 6, 2], [36], [10, 0, 10, 8, 12], [1, 1, 30], [16, 16],
                     [5, 5, 5, 5, 4], [2, 38], [24, 8], [7, 9, 0, 11, 1], [12, 12, 12, 4]]  # fmt: skip
        if strategy == "halo":
            doc_lists = [[3, 17, 1, 4, 6, 5], [17, 17, 6], [10, 0, 10, 8, 12], [1, 1, 17, 17, 4], [16, 16, 8],
                         [5, 5, 5, 5, 4, 16], [2, 17, 17, 2], [17, 17], [7, 9, 0, 11, 1, 12], [12, 12, 12, 4]]  # fmt: skip
        inputs = [shard(lengths, 60 + i) for i, lengths in enumerate(doc_lists)]
        equal = _cp_eager_equals_replay(model, step, graph, inputs, cp)
        out.append({"strategy": strategy, "lb": lb, "equal": equal, "counts": _cp_counts(graph.graph_module),
                    "inspect": _inspected(graph, cp, kw.get("max_document_len"), example[0]["input_ids"].shape[1], world)})  # fmt: skip
    return out


def _inspected(graph, cp, max_document_len: int | None, t_local: int, world: int) -> dict:
    """What `usp-graph inspect` says of a traced CP step, and the bytes the cost model predicts."""
    from usp_graph.analysis import summarize
    from usp_graph.cp.cost import bytes_sent

    s = summarize(graph.graph_module, symbols=graph.signature.symbols, values={"T": t_local})
    head_dim = LLAMA.dim // LLAMA.n_heads
    if cp.strategy == "halo":
        # inspect counts what a rank with neighbours on both sides sends (max_document_len - 1 K/V
        # tokens each way); the cost model's per-rank figure is tested against the ops in test_cp.
        model_bytes = 2 * 2 * (max_document_len - 1) * LLAMA.n_kv_heads * head_dim * 4
    else:
        model_bytes = bytes_sent(cp.strategy, tokens=t_local * world, heads=LLAMA.n_heads,
                                 kv_heads=LLAMA.n_kv_heads, head_dim=head_dim, world=world, element_size=4,
                                 ulysses_degree=cp.ulysses_degree if cp.strategy == "usp" else 1)  # fmt: skip
    return {
        "site_strategies": [a["strategy"] for a in s["attention"]],
        "bytes": sum(c["bytes_per_rank"] for c in s["collectives"]),
        "model_bytes": model_bytes * LLAMA.n_layers,
        "unpaired": s["unpaired"],
        "pairs": len(s["pairing"]),
    }


def _cp_eager_equals_replay(model, step, graph, inputs, cp) -> bool:
    """10 AdamW steps (grads reduced over the CP group) driven by eager and by replay: bitwise?"""
    histories = []
    for replay in (None, graph.replay):
        m = copy.deepcopy(model)
        opt = torch.optim.AdamW(m.parameters(), lr=1e-2, weight_decay=0.1)
        history = []
        for local, meta in inputs:
            if replay is None:
                m.zero_grad(set_to_none=True)
                with attention_mode(meta, cp=cp):
                    loss = step(m, local)
                loss.backward()
                loss = loss.detach()
            else:
                loss, grads = replay(dict(m.named_parameters()), local, meta)
                for name, p in m.named_parameters():
                    p.grad = grads[name]
            cp.reduce_grads(m.parameters())
            opt.step()
            history.append([loss] + [p.detach().clone() for p in m.parameters()])
        histories.append(history)
    return all(
        torch.equal(a, b) for he, hr in zip(*histories, strict=True) for a, b in zip(he, hr, strict=True)
    )


def _cp_flux_trace_and_replay(rank: int, world: int, strategies: list[str]) -> list[dict]:
    """Flux (joint text+image, one document per sample; text and image sharded separately)."""
    from usp_graph import ContextParallel

    out = []
    for strategy in strategies:
        cp = ContextParallel(strategy, **({"ulysses_degree": 2} if strategy == "usp" else {}))
        torch.manual_seed(5)
        model = Flux(FLUX)

        def step(m, b, cp=cp):
            pred = m(b["img"], b["txt"], b["timesteps"], b["img_ids"], b["txt_ids"], b["pooled"])
            return cp.token_mean(F.mse_loss(pred, b["target"], reduction="sum"), pred.numel())

        def shard(t, i, seed, cp=cp):
            batch = make_flux_batch(
                FLUX, 2, t, i, generator=torch.Generator().manual_seed(seed), grid_width=3
            )
            seq = {"img", "txt", "img_ids", "txt_ids", "target"}
            local = {k: cp.shard(v, 1) if k in seq else v for k, v in batch.items()}
            return local, AttentionMetadata.per_sample(2, t + i)

        graph = trace_train_step(model, step, *shard(4, 10, 70), dynamic=FLUX_DYNAMIC, cp=cp)
        sizes = [(4, 10), (8, 6), (4, 12), (6, 4), (4, 16), (8, 8), (4, 4), (6, 10), (4, 14), (12, 12)]
        inputs = [shard(t, i, 80 + n) for n, (t, i) in enumerate(sizes)]
        out.append({"strategy": strategy, "equal": _cp_eager_equals_replay(model, step, graph, inputs, cp)})
    return out


def test_cp_flux_train_steps_replayed_equal_eager_cp_bitwise_on_2_ranks():
    from tests.dist import run_ranks

    for results in run_ranks(
        # usp at P=2 is Ulysses and a ring of one: test_cp_train_steps_replayed... replays it on Llama
        _cp_flux_trace_and_replay,
        2,
        ["allgather_kv", "ulysses", "ring"],
    ):
        for r in results:
            assert r["equal"], r


def test_cp_train_steps_replayed_equal_eager_cp_bitwise_on_2_ranks():
    from tests.dist import run_ranks

    configs = [("allgather_kv", None), ("ulysses", None), ("ring", None), ("usp", None), ("ring", "zigzag"),
               ("halo", None)]  # fmt: skip
    k = LLAMA.n_layers
    expected = {
        # every attention call: forward collectives, and their adjoints in the backward
        "allgather_kv": {"all_gather:forward": 2 * k, "reduce_scatter:backward": 2 * k},
        "ulysses": {"all_to_all:forward": 4 * k, "all_to_all:backward": 4 * k},
        "ring": {"ring_attn_fwd:forward": k, "ring_attn_bwd:backward": k},
        "halo": {"halo_exchange:forward": k, "halo_reduce:backward": k},  # K and V in one exchange
        "usp": {"all_to_all:forward": 4 * k, "all_to_all:backward": 4 * k,
                "ring_attn_fwd:forward": k, "ring_attn_bwd:backward": k},
    }  # fmt: skip
    for results in run_ranks(_cp_trace_and_replay, 2, configs):
        for r in results:
            assert r["equal"], r
            # what inspect says of the same graphs: each site's strategy, bytes = the cost model's
            i = r["inspect"]
            assert i["site_strategies"] == [r["strategy"]] * LLAMA.n_layers, r
            assert i["bytes"] == i["model_bytes"], r
            assert i["unpaired"] == [] and i["pairs"] > 0, r
            for key, n in expected[r["strategy"]].items():
                assert r["counts"].get(key) == n, (r["strategy"], key, r["counts"])
            if r["strategy"] != "ring":
                assert "varlen_fwd:forward" in r["counts"] or r["strategy"] == "usp", r
