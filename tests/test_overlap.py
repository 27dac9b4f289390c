"""Collectives as issue + wait, and the overlap pass that schedules them (`usp_graph.passes.overlap`).

The ops: every ``*_start`` + ``usp::wait`` gives the bits of its blocking collective (even and
uneven splits, the gathered dim first or not), several may be in flight and be waited for in any
order, and changing the input after the issue does not change what was sent. The pass: a traced
CP train step holds no blocking collective, each issue has its wait, compute runs between them,
and the step replays bitwise equal to the same step traced without the pass, also after a graph
file round trip and through torch.compile. The schedule keeps RNG and side-effect order.
"""

from __future__ import annotations

import copy
import re

import pytest
import torch
import torch.fx as fx
import torch.nn.functional as F

from tests.dist import run_ranks
from usp_graph import AttentionMetadata, ContextParallel, attention_mode, registry, trace_train_step
from usp_graph.models import Llama, LlamaConfig, make_llama_batch
from usp_graph.passes import default_pipeline
from usp_graph.passes.overlap import ASYNC_META, schedule

U = torch.ops.usp
CONFIG = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)


# ---- the ops ----------------------------------------------------------------------------------


def _ops_match_blocking(rank: int, world: int, seed: int) -> dict:
    from usp_graph.distributed import group_name

    name = group_name(None)
    g = torch.Generator().manual_seed(seed * 10 + rank)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x4 = rand(2, 5, 6, 3)  # (B, H, L, K): 5 heads split 3 + 2
    x0 = rand(4, 3)
    mine = [[1, 3], [2, 2]][rank]  # uneven split along dim 0; rank j gets mine[j] rows
    gathered = [[1, 2], [3, 2]][rank]  # what rank 0 and rank 1 send to this rank
    cases = {
        "a2a_heads_to_seq": (U.all_to_all, U.all_to_all_start, (x4, 1, 2, [3, 2], [6, 6], name), (2, False)),
        "a2a_seq_to_heads": (U.all_to_all, U.all_to_all_start, (rand(2, 2, 12, 3), 2, 1, [6, 6], [2, 2], name),
                             (1, False)),
        "a2a_dim0_uneven": (U.all_to_all, U.all_to_all_start, (x0, 0, 0, mine, gathered, name), (0, False)),
        "gather_dim0": (U.all_gather, U.all_gather_start, (x0, 0, world, name), (0, False)),
        "gather_dim2": (U.all_gather, U.all_gather_start, (x4, 2, world, name), (2, False)),
        "scatter_dim0": (U.reduce_scatter, U.reduce_scatter_start, (x0, 0, world, name), (0, True)),
        "scatter_dim2": (U.reduce_scatter, U.reduce_scatter_start, (x4, 2, world, name), (2, True)),
        "gather_empty": (U.all_gather, U.all_gather_start, (rand(0, 3), 0, world, name), (0, False)),
    }  # fmt: skip
    out: dict = {}
    for key, (sync, start, args, (dim, reduce)) in cases.items():
        expected = sync(*args)
        # the input changed after the issue: what was sent is what the input held at the issue
        moved = (args[0].clone(), *args[1:])
        handle = start(*moved)
        moved[0].add_(1000.0)
        got = U.wait(handle, dim, reduce)
        out[key] = torch.equal(expected, got) and got.is_contiguous()
    # several in flight, waited for in the reverse order of their issue
    a, b, c = (U.all_to_all_start(*cases["a2a_heads_to_seq"][2]), U.all_gather_start(*cases["gather_dim2"][2]),
               U.reduce_scatter_start(*cases["scatter_dim0"][2]))  # fmt: skip
    rc, rb, ra = U.wait(c, 0, True), U.wait(b, 2, False), U.wait(a, 2, False)
    out["reverse_waits"] = (
        torch.equal(ra, U.all_to_all(*cases["a2a_heads_to_seq"][2]))
        and torch.equal(rb, U.all_gather(*cases["gather_dim2"][2]))
        and torch.equal(rc, U.reduce_scatter(*cases["scatter_dim0"][2]))
    )
    # the issue form is never differentiated: a clear error, not a silent None gradient
    x = rand(4, 3).requires_grad_()
    try:
        U.wait(U.all_gather_start(x, 0, world, name), 0, False).sum().backward()
        out["grad_error"] = "no error"
    except RuntimeError as e:
        out["grad_error"] = str(e)
    return out


@pytest.mark.parametrize("seed", [0, 1])
def test_issue_and_wait_give_the_bits_of_the_blocking_collective(seed):
    for r in run_ranks(_ops_match_blocking, 2, seed):
        assert r.pop("grad_error").startswith("usp::wait is a collective's issue/wait form"), r
        assert all(r.values()), r


def test_every_issue_op_is_a_row_of_the_registry_and_maps_to_its_collective():
    for row in registry.TABLE:
        if row.kind == "collective" and row.op.startswith("usp::") and row.issue is not None:
            op = getattr(U, row.op.split("::")[1]).default
            issue = registry.issue_of(op)
            assert issue is getattr(U, row.issue.split("::")[1]).default
            assert registry.canonical(issue) is op and registry.canonical(op) is op
    assert registry.is_wait_op(U.wait.default) and not registry.is_wait_op(U.all_to_all.default)


# ---- the schedule on a hand-made graph ----------------------------------------------------------


def _graph_with_rng() -> fx.GraphModule:
    """x -> issue -> ... with two dropouts and an independent branch, as the lowering leaves it."""
    g = fx.Graph()
    x = g.placeholder("x")
    y = g.placeholder("y")
    d1 = g.call_function(torch.ops.aten.rand_like.default, (y,))
    a = g.call_function(torch.ops.aten.mul.Tensor, (x, 2.0))
    start = g.call_function(U.all_gather_start.default, (a, 0, 2, "g"))
    start.meta[ASYNC_META] = "issue"
    done = g.call_function(U.wait.default, (start, 0, False))
    d2 = g.call_function(torch.ops.aten.rand_like.default, (a,))
    b = g.call_function(torch.ops.aten.add.Tensor, (y, d1))
    c = g.call_function(torch.ops.aten.add.Tensor, (done, 1.0))
    g.output((c, b, d2))
    return fx.GraphModule(torch.nn.Module(), g)


def test_the_schedule_issues_early_waits_late_and_keeps_rng_order():
    gm = _graph_with_rng()
    schedule(gm)
    order = [n.name for n in gm.graph.nodes]
    assert order[:2] == ["x", "y"] and order[-1] == "output"
    at = order.index
    # rand_like_1 (reads a) stays after rand_like (the RNG order), the issue comes right after a,
    # and the wait comes after every node that does not need it
    assert at("rand_like_default") < at("rand_like_default_1")
    assert at("all_gather_start_default") == at("mul_tensor") + 1
    assert at("wait_default") == at("add_tensor_1") - 1 and at("wait_default") > at("add_tensor")
    gm.graph.lint()
    # a compile dump's summary counts the issued collective as its collective
    from usp_graph.backend.dump import _collectives

    assert _collectives(gm, False) == {"all": {"usp.all_gather.default": 1}}


# ---- the pass on traced train steps -------------------------------------------------------------


def _batch(lengths, seed):
    batch = make_llama_batch(CONFIG, lengths, generator=torch.Generator().manual_seed(seed))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=8)
    return batch, meta


def _traced_steps_agree(rank: int, world: int, strategy: str, tmp: str) -> dict:
    from usp_graph.analysis import summarize
    from usp_graph.graphfile import load, save

    cp = ContextParallel(strategy)
    torch.manual_seed(3)
    model = Llama(CONFIG)

    def step(m, b, cp=cp):
        logits = m(b["input_ids"], b["position_ids"])
        labels = b["labels"].flatten()
        return cp.token_mean(F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum"), labels.numel())

    def shard(lengths, seed):
        batch, meta = _batch(lengths, seed)
        return {k: cp.shard(v, 1) for k, v in batch.items()}, meta

    example = shard([9, 7, 11, 5], 1)
    overlapped = trace_train_step(model, step, *example, cp=cp)
    blocking = trace_train_step(model, step, *example, cp=cp, passes=default_pipeline().disable("overlap"))
    path = f"{tmp}/rank{rank}.uspg"
    save(overlapped, path)
    loaded = load(path)
    params = dict(model.named_parameters())
    equal = True
    for i, lengths in enumerate([[3, 20, 1, 4, 0, 4], [32], [1, 1, 30]]):
        local, meta = shard(lengths, 10 + i)
        ref_loss, ref_grads = blocking.replay(params, local, meta)
        for g in (overlapped, loaded):
            loss, grads = g.replay(params, local, meta)
            equal &= torch.equal(loss, ref_loss) and all(
                torch.equal(grads[k], ref_grads[k]) for k in ref_grads
            )
        m = copy.deepcopy(model)
        with attention_mode(meta, cp=cp):
            eager = step(m, local)
        equal &= torch.equal(eager.detach(), ref_loss)

    gm = overlapped.graph_module
    nodes = list(gm.graph.nodes)
    issues = [n for n in nodes if n.meta.get(ASYNC_META) == "issue"]
    s = summarize(gm, symbols=overlapped.signature.symbols)
    first = issues[0]
    wait = next(iter(first.users))
    between = nodes[nodes.index(first) + 1 : nodes.index(wait)]
    return {
        "equal": equal,
        "blocking_left": sum(1 for n in nodes if registry.issue_of(n.target) is not None),
        "issues": len(issues),
        "blocking_issues": sum(1 for n in blocking.graph_module.graph.nodes if registry.issue_of(n.target)),
        "one_wait_each": all(
            len(n.users) == 1 and registry.is_wait_op(next(iter(n.users)).target) for n in issues
        ),
        "matmul_in_flight": any(
            n.target in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default) for n in between
        ),  # fmt: skip
        "overlap_ops": [c.get("overlap_ops") for c in s["collectives"]],
        "unpaired": s["unpaired"],
        "pairs": len(s["pairing"]),
    }


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ulysses"])  # every strategy replays == eager in test_trace
def test_a_traced_cp_step_issues_every_collective_and_replays_bitwise(strategy, tmp_path):
    for r in run_ranks(_traced_steps_agree, 2, strategy, str(tmp_path), timeout=300):
        assert r["equal"], r
        assert r["blocking_left"] == 0 and r["issues"] == r["blocking_issues"] > 0, r
        assert r["one_wait_each"], r
        assert r["unpaired"] == [] and r["pairs"] > 0, r
        assert all(isinstance(n, int) for n in r["overlap_ops"]), r
        if strategy == "ulysses":  # q travels while the k and v projections run
            assert r["matmul_in_flight"], r
            assert sum(n > 0 for n in r["overlap_ops"]) >= len(r["overlap_ops"]) // 2, r
    # a file whose issued collective is not finished by exactly one matching wait is refused at load
    # (it would leave work and buffers in flight past the replay, or read a buffer being written)
    from tests.graph_docs import break_first_wait
    from usp_graph.graphfile import GraphFileSchemaError, loads_graph_module

    for how, says in [("dropped", "exactly one usp.wait"), ("wrong_dim", "must be called as (recv, dim="),
                      ("extra_reader", "exactly one usp.wait"), ("wait_on_tensor", "finishes an issued collective")]:  # fmt: skip
        with pytest.raises(GraphFileSchemaError, match=re.escape(says)):
            loads_graph_module(break_first_wait(tmp_path / "rank0.uspg", how))


def _compiled_agree(rank: int, world: int) -> dict:
    from usp_graph import documents

    cp = ContextParallel("ulysses")
    torch.manual_seed(4)
    model = Llama(CONFIG)
    results, lowered = {}, {}
    for disable in ([], ["overlap"]):
        m = copy.deepcopy(model)
        reports: list = []
        options = {"cp": cp, "inner": "aot_eager", "disable": disable, "on_compile": reports.append}
        compiled = torch.compile(m, backend="usp", fullgraph=True, options=options)
        out = []
        for i, lengths in enumerate([[9, 7, 11, 5], [30, 2]]):
            batch, meta = _batch(lengths, 20 + i)
            local = {k: cp.shard(v, 1) for k, v in batch.items()}
            m.zero_grad(set_to_none=True)
            with documents(meta):
                logits = compiled(local["input_ids"], local["position_ids"])
            loss = logits.float().pow(2).mean()
            loss.backward()
            out.append([loss.detach()] + [p.grad.clone() for p in m.parameters()])
        results[tuple(disable)] = out
        lowered[tuple(disable)] = [r.passes.get("overlap") for r in reports]
    a, b = results[()], results[("overlap",)]
    equal = all(torch.equal(x, y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))
    return {"equal": equal, "lowered": lowered[()], "lowered_off": lowered[("overlap",)]}


@pytest.mark.slow
def test_compiled_with_the_overlap_pass_is_bitwise_equal_to_without():
    for r in run_ranks(_compiled_agree, 2, timeout=300):
        assert r["equal"], r
        # the backward graph (compiled at the first backward) is lowered after the report
        assert r["lowered"] and all(n and n > 0 for n in r["lowered"]), r
        assert r["lowered_off"] and all(n is None for n in r["lowered_off"]), r


class _Attention(torch.nn.Module):
    """One attention block: q, k, v projections, SDPA, output projection."""

    def __init__(self, dim: int = 32, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, d = x.shape

        def split(y):
            return y.view(b, t, self.heads, d // self.heads).transpose(1, 2)

        y = F.scaled_dot_product_attention(
            split(self.q(x)), split(self.k(x)), split(self.v(x)), is_causal=True
        )
        return self.o(y.transpose(1, 2).reshape(b, t, d))


def _inductor_keeps_the_overlap(rank: int, world: int) -> dict:
    from torch._inductor.utils import run_and_get_code

    from usp_graph import documents

    cp = ContextParallel("ulysses")
    torch.manual_seed(6)
    block = _Attention()
    meta = AttentionMetadata.from_lengths([5, 1, 0, 11, 8, 7], max_docs=8)
    x = cp.shard(torch.randn(1, 32, 32, generator=torch.Generator().manual_seed(7)), 1)
    out = {}
    for inner in ("aot_eager", "inductor"):
        m = copy.deepcopy(block)
        compiled = torch.compile(m, backend="usp", fullgraph=True, options={"cp": cp, "inner": inner})

        def run(m=m, compiled=compiled):
            with documents(meta):
                y = compiled(x)
            y.pow(2).sum().backward()
            return y.detach(), [p.grad for p in m.parameters()]

        if inner == "inductor":
            (y, grads), code = run_and_get_code(run)
            out["code"] = code
        else:
            y, grads = run()
        out[inner] = (y, grads)
    (ya, ga), (yi, gi) = out["aot_eager"], out["inductor"]
    close = torch.allclose(ya, yi, atol=1e-5) and all(
        torch.allclose(a, b, atol=1e-5) for a, b in zip(ga, gi, strict=True)
    )
    forward = out["code"][0]
    at = forward.find
    return {
        "close": close,
        # in the generated forward, q's all-to-all is issued before the k projection's matmul and
        # waited for after it
        "issue_before_mm": 0 <= at("usp.all_to_all_start") < forward.find("extern_kernels.mm", at("usp.all_to_all_start")) < at("usp.wait"),
    }  # fmt: skip


@pytest.mark.slow
def test_inductor_keeps_issue_before_independent_compute_and_matches_aot_eager():
    for r in run_ranks(_inductor_keeps_the_overlap, 2, timeout=400):
        assert r["close"] and r["issue_before_mm"], r


def test_exposed_communication_is_the_comm_time_no_compute_kernel_overlaps():
    """tools/harness.exposed_time, which the CP train bench reports from a profiled step."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "tools" / "harness.py"
    spec = importlib.util.spec_from_file_location("harness_for_test", path)
    harness = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = harness  # its dataclasses look their module up
    spec.loader.exec_module(harness)
    # comm [0,10) and [12,14) (overlapping pieces merged); compute covers [2,5), [4,8), [13,20)
    comm = [(0.0, 6.0), (5.0, 10.0), (12.0, 14.0)]
    compute = [(2.0, 5.0), (4.0, 8.0), (13.0, 20.0)]
    assert harness.exposed_time(comm, compute) == (12.0, 12.0 - 6.0 - 1.0)
    assert harness.exposed_time(comm, []) == (12.0, 12.0)
    assert harness.exposed_time([], compute) == (0.0, 0.0)
    assert harness.exposed_time([(0.0, 4.0)], [(-1.0, 9.0)]) == (4.0, 0.0)


# ---- Ulysses by head groups ------------------------------------------------------------------------


def _head_groups_agree(rank: int, world: int) -> dict:
    from usp_graph.analysis import summarize

    torch.manual_seed(8)
    model = Llama(CONFIG)  # 4 query heads, 2 K/V heads: 2 groups x 2 ranks repeat K/V
    one, two = ContextParallel("ulysses"), ContextParallel("ulysses", head_groups=2)

    def step(m, b, cp):
        logits = m(b["input_ids"], b["position_ids"])
        labels = b["labels"].flatten()
        return cp.token_mean(F.cross_entropy(logits.flatten(0, 1), labels, reduction="sum"), labels.numel())

    batch, meta = _batch([9, 1, 0, 13, 9], 2)
    local = {k: one.shard(v, 1) for k, v in batch.items()}
    out = {}
    for name, cp in (("one", one), ("two", two)):
        m = copy.deepcopy(model)
        with attention_mode(meta, cp=cp):
            loss = step(m, local, cp)
        loss.backward()
        out[name] = [loss.detach()] + [p.grad for p in m.parameters()]
    eager_equal = all(torch.equal(a, b) for a, b in zip(out["one"], out["two"], strict=True))
    graph = trace_train_step(model, lambda m, b: step(m, b, two), local, meta, cp=two)
    loss, grads = graph.replay(dict(model.named_parameters()), local, meta)
    replay_equal = torch.equal(loss, out["one"][0]) and all(
        torch.equal(grads[n], g) for (n, _), g in zip(model.named_parameters(), out["one"][1:], strict=True)
    )
    # in the first layer's forward, group 1's q is issued before group 0 attends
    nodes = list(graph.graph_module.graph.nodes)
    issues = [n for n in nodes if n.meta.get(ASYNC_META) == "issue" and n.meta.get("usp_phase") == "forward"]
    attend = next(n for n in nodes if n.target is U.varlen_fwd.default)
    s = summarize(graph.graph_module, symbols=graph.signature.symbols)
    try:
        ContextParallel("ring", head_groups=2)
        wrong = "no error"
    except ValueError as e:
        wrong = str(e)
    three = ContextParallel("ulysses", head_groups=3)  # 4 heads do not split into 3 x 2
    try:
        with attention_mode(meta, cp=three):
            step(copy.deepcopy(model), local, three)
        uneven = "no error"
    except ValueError as e:
        uneven = str(e)
    return {
        "uneven": uneven,
        "eager_equal": eager_equal,
        "replay_equal": replay_equal,
        "issued_before_first_attention": sum(nodes.index(i) < nodes.index(attend) for i in issues),
        "a2a": sum(c["op"] == "usp.all_to_all" for c in s["collectives"]),
        "repr": repr(two),
        "wrong": wrong,
    }


@pytest.mark.slow
def test_ulysses_by_head_groups_is_bitwise_the_one_group_result_and_issues_ahead():
    for r in run_ranks(_head_groups_agree, 2, timeout=300):
        assert r["eager_equal"] and r["replay_equal"], r
        # 2 layers x 2 groups x (q, k, v, out) forward and as many adjoints
        assert r["a2a"] == 2 * 2 * 4 * 2, r
        assert r["issued_before_first_attention"] == 6, r  # q, k, v of both groups
        assert "head_groups=2" in r["repr"], r
        assert r["wrong"] == "head_groups is only for strategy 'ulysses', not 'ring'", r
        assert (
            "head_groups=3 over 2 ranks splits the query heads into 6 equal parts, but there are 4"
            in r["uneven"]
        )
