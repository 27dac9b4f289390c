"""Fault injection for the collectives (issue 31), on 2 gloo ranks.

# P ranks, T local tokens, H heads, K head dim

Every collective form, blocking and issued (usp's all_to_all / all_gather / reduce_scatter and
their ``*_start`` + ``wait`` forms, ring attention forward and backward, the halo exchange and its
adjoint, the ordered all-reduce, and the functional collectives a replayed graph file runs), meets
each fault with rank 1 misbehaving:

- disagreeing sizes: rank 1 sends more than rank 0 expects (gloo aborts the process: SIGABRT);
- short sends: rank 1 sends fewer (gloo leaves the rest of rank 0's receive buffer unwritten);
- a rank that dies mid-collective (after the size agreement, before its payload);
- a rank that never arrives (alive, elsewhere), and one that stalls after the size agreement.

Each must end in a `CollectiveError` on every surviving rank within the group's timeout (a size
disagreement at once, on both ranks, nothing sent), with nothing pending afterwards (usp's table of
issued collectives and torch's functional-collective work registry both empty). Rank functions
catch and report, so one pooled spawn runs a whole class; a death costs a respawn.

Cost of the size agreement (one all-gather of 2 + 2P int64 per collective: one extra small round
trip), 2 gloo ranks on a 2-core CPU machine that other jobs kept at load 9-14, min (median) of 300
calls, agreement on vs off, interleaved: all_to_all of 4 KiB per rank 0.34 (1.14) ms vs 0.15 (0.52)
ms; of 4 MiB 2.24 (5.4) vs 2.19 (4.5) ms; issued all_to_all + wait of 4 KiB 0.55 (1.48) vs 0.23
(0.47) ms, of 4 MiB within noise. A second run at load 5: 4 KiB all_to_all 0.53 (1.44) vs 0.22
(0.65) ms, 4 MiB 2.91 (4.85) vs 2.10 (3.92) ms. So a small collective pays about one more round
trip (0.2-0.3 ms here); a large one little. Device tensors skip the agreement.
"""

from __future__ import annotations

import atexit
import datetime
import os
import sys
import time

import pytest
import torch
import torch.distributed as dist

from tests.dist import RankError, run_ranks

T_S = 1.0  # the fault groups' timeout: short, so a rank that never arrives costs one second
VERDICT_T_S = 20.0  # the timeout of groups whose faults are size disagreements: the verdict comes first


# ------------------------------------------------------------------------------------------------
# The forms. Each runs one collective as rank `rank` on group `name`; `variant` says how rank 1
# misbehaves ("honest", "more": it sends rank 0 more than rank 0 expects, "fewer": less). Every
# variant passes the op's own checks on rank 1's side: only the ranks together can tell.


def _x(*shape: int) -> torch.Tensor:
    return torch.arange(float(torch.Size(shape).numel()), dtype=torch.float64).reshape(shape)


def _rows(rank: int, variant: str, honest: int) -> int:
    return honest if rank == 0 else {"honest": honest, "more": honest + 1, "fewer": honest - 1}[variant]


def _a2a(rank, name, variant, issue=False):
    n = _rows(rank, variant, 2)  # rank 1 sends n rows to rank 0, which expects 2
    x = _x(n + 2, 3)
    args = (x, 0, 0, [n, 2] if rank else [2, 2], [2, 2], name)
    if issue:
        return torch.ops.usp.wait(torch.ops.usp.all_to_all_start(*args), 0, False)
    return torch.ops.usp.all_to_all(*args)


def _ulysses(rank, name, variant):
    seq = _rows(rank, variant, 3)  # the callers disagree on the token count (the demo's case)
    x = _x(1, 4, seq, 2)  # B H l K: scatter heads, gather the sequence
    return torch.ops.usp.all_to_all(x, 1, 2, [2, 2], [3, seq] if rank else [3, 3], name)


def _gather(rank, name, variant, issue=False):
    x = _x(_rows(rank, variant, 2), 3)
    if issue:
        return torch.ops.usp.wait(torch.ops.usp.all_gather_start(x, 0, 2, name), 0, False)
    return torch.ops.usp.all_gather(x, 0, 2, name)


def _scatter(rank, name, variant, issue=False):
    x = _x(2 * _rows(rank, variant, 2), 3)
    if issue:
        return torch.ops.usp.wait(torch.ops.usp.reduce_scatter_start(x, 0, 2, name), 0, True)
    return torch.ops.usp.reduce_scatter(x, 0, 2, name)


def _ring_inputs(rank, variant):
    t = _rows(rank, variant, 4)  # local tokens: K/V of rank 1 are larger or smaller
    q, k, v = _x(t, 2, 4), _x(t, 2, 4) / 50, _x(t, 2, 4)
    cu = torch.tensor([0, 2 * t], dtype=torch.int32)
    return q, k, v, cu, 2 * t


def _ring_fwd(rank, name, variant):
    q, k, v, cu, total = _ring_inputs(rank, variant)
    return torch.ops.usp.ring_attn_fwd(q, k, v, cu, total, True, 0.5, [0, 1], 1, name)


def _ring_bwd(rank, name, variant):
    q, k, v, cu, total = _ring_inputs(rank, variant)
    lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float64)
    return torch.ops.usp.ring_attn_bwd(q, q, k, v, q, lse, cu, total, True, 0.5, [0, 1], 1, name)


def _halo(rank, name, variant):
    after = _rows(rank, variant, 1)  # rank 1 sends its first `after` tokens to rank 0
    return torch.ops.usp.halo_exchange(_x(1, 4, 2), 1, 1, after, 2, name)


def _halo_reduce(rank, name, variant):
    before = _rows(rank, variant, 1)  # rank 1 sends the gradients of `before` tokens to rank 0
    return torch.ops.usp.halo_reduce(_x(1, 4 + before + 1, 2), 1, before, 1, name)


def _ordered_sum(rank, name, variant):
    from usp_graph.distributed import all_reduce_sum_ordered

    return all_reduce_sum_ordered([_x(_rows(rank, variant, 3))], name)[0]


def _replayed(op: str, x: torch.Tensor, *args) -> torch.Tensor:
    """`_c10d_functional.<op>(x, *args)` and its wait_tensor, run as a replayed graph file runs."""
    import torch.fx as fx

    from usp_graph.graphfile.replay import ReplayGraphModule

    graph = fx.Graph()
    x_node = graph.placeholder("x")
    issued = graph.call_function(getattr(torch.ops._c10d_functional, op).default, (x_node, *args))
    graph.output(graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (issued,)))
    return ReplayGraphModule(torch.nn.Module(), graph)(x)


def _c10d_a2a(rank, name, variant):
    n = _rows(rank, variant, 2)
    return _replayed("all_to_all_single", _x(n + 2, 3), [2, 2], [n, 2] if rank else [2, 2], name)


def _c10d_reduce(rank, name, variant):
    return _replayed("all_reduce", _x(_rows(rank, variant, 3)), "sum", name)


def _c10d_gather(rank, name, variant):
    return _replayed("all_gather_into_tensor", _x(_rows(rank, variant, 2), 3), 2, name)


def _c10d_scatter(rank, name, variant):
    return _replayed("reduce_scatter_tensor", _x(2 * _rows(rank, variant, 2), 3), "sum", 2, name)


def _c10d_broadcast(rank, name, variant):
    return _replayed("broadcast", _x(_rows(rank, variant, 3)), 0, name)  # rank 1 expects more / fewer


FORMS = {
    "all_to_all": _a2a,
    "all_to_all_ulysses": _ulysses,
    "all_to_all_start": lambda r, n, v: _a2a(r, n, v, issue=True),
    "all_gather": _gather,
    "all_gather_start": lambda r, n, v: _gather(r, n, v, issue=True),
    "reduce_scatter": _scatter,
    "reduce_scatter_start": lambda r, n, v: _scatter(r, n, v, issue=True),
    "ring_attn_fwd": _ring_fwd,
    "ring_attn_bwd": _ring_bwd,
    "halo_exchange": _halo,
    "halo_reduce": _halo_reduce,
    "all_reduce_sum_ordered": _ordered_sum,
    "replay_all_to_all_single": _c10d_a2a,
    "replay_all_reduce": _c10d_reduce,
    "replay_all_gather_into_tensor": _c10d_gather,
    "replay_reduce_scatter_tensor": _c10d_scatter,
    "replay_broadcast": _c10d_broadcast,
}


# ------------------------------------------------------------------------------------------------
# Rank side.


def _pending() -> tuple[int, int]:
    """(usp's issued collectives in flight, torch's functional-collective work registry size)."""
    from usp_graph.ops import collectives

    return collectives.pending_count(), torch._C._distributed_c10d._get_work_registry_size()


def _groups(world: int, timeout_s: float = T_S) -> dict[str, str]:
    import torch._dynamo  # noqa: F401 - torch imports it at a custom op's first call: paid before any timed call

    timeout = datetime.timedelta(seconds=timeout_s)
    return {form: dist.new_group(list(range(world)), timeout=timeout).group_name for form in FORMS}


def _try(form: str, rank: int, name: str, variant: str) -> dict:
    t0 = time.monotonic()
    try:
        out = FORMS[form](rank, name, variant)
        seen = {"type": "no error", "msg": "", "out": out}
    except Exception as e:  # the test asserts on type and message
        seen = {"type": type(e).__name__, "msg": str(e)}
    return {**seen, "s": time.monotonic() - t0, "pending": _pending()}


def _every_form(rank: int, world: int, variants: list[str]) -> dict:
    """Each form on fresh groups, honestly and then with each misbehaving variant."""
    out = {}
    for variant in variants:
        groups = _groups(world, VERDICT_T_S)
        out[variant] = {form: _try(form, rank, groups[form], variant) for form in FORMS}
    return out


def _dies(rank: int, world: int, where: str) -> dict:
    """Rank 1 passes the first form's size agreement, then exits before its payload (`where`: a
    blocking all_to_all or an issued one); rank 0 then meets every form, its peer gone."""
    from usp_graph import distributed
    from usp_graph.ops import collectives

    groups = _groups(world)
    first = {"blocking": "all_to_all", "issued": "all_to_all_start"}[where]
    if rank == 1:
        module = collectives
        real = distributed.agree_sizes

        def agree_then_die(*args, **kwargs):
            real(*args, **kwargs)
            os._exit(3)

        module.agree_sizes = agree_then_die
        FORMS[first](rank, groups[first], "honest")
        raise AssertionError("unreachable: rank 1 exits in its first collective")
    seen = {first: _try(first, rank, groups[first], "honest")}
    for form in FORMS:
        if form != first:
            seen[form] = _try(form, rank, groups[form], "honest")
    return seen


class _Released(Exception):
    pass


def _absent(rank: int, world: int) -> dict | None:
    """Rank 1 never arrives: for the first form it stalls after the size agreement (rank 0 waits in
    the payload), for every other form it never enters (rank 0 waits in the agreement)."""
    from usp_graph import distributed
    from usp_graph.ops import collectives

    groups = _groups(world)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:
        real = distributed.agree_sizes

        def agree_then_stall(*args, **kwargs):
            real(*args, **kwargs)
            store.wait(["rank0_done"], datetime.timedelta(seconds=120))
            raise _Released

        collectives.agree_sizes = agree_then_stall
        try:
            FORMS["all_to_all"](rank, groups["all_to_all"], "honest")
        except _Released:
            pass
        finally:
            collectives.agree_sizes = real  # pooled ranks serve later calls
        return None
    # Every form at once, one thread each (each on its own group): one timeout for all of them.
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(FORMS)) as pool:
        futures = {form: pool.submit(_try, form, rank, groups[form], "honest") for form in FORMS}
        seen = {form: f.result() for form, f in futures.items()}
    store.set("rank0_done", "1")
    return seen


def _fails_between_issue_and_wait(rank: int, world: int) -> dict:
    """A replayed graph that fails (an index out of range) between an all_to_all_start and its
    wait, and one between a functional all_reduce and its wait_tensor, three times each."""
    import torch.fx as fx

    from usp_graph.graphfile import GraphReplayError
    from usp_graph.graphfile.replay import ReplayGraphModule

    name = dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=T_S * 5)).group_name
    graphs = {}
    for kind in ("usp", "c10d"):
        graph = fx.Graph()
        x, idx = graph.placeholder("x"), graph.placeholder("idx")
        if kind == "usp":
            issued = graph.call_function(
                torch.ops.usp.all_to_all_start.default, (x, 0, 0, [1, 1], [1, 1], name)
            )
        else:
            issued = graph.call_function(torch.ops._c10d_functional.all_reduce.default, (x, "sum", name))
        bad = graph.call_function(torch.ops.aten.index_select.default, (x, 0, idx))
        if kind == "usp":
            done = graph.call_function(torch.ops.usp.wait.default, (issued, 0, False))
        else:
            done = graph.call_function(torch.ops._c10d_functional.wait_tensor.default, (issued,))
        graph.output((done, bad))
        graphs[kind] = ReplayGraphModule(torch.nn.Module(), graph)
    out = {}
    x = _x(2, 3) + 10 * rank
    for kind, gm in graphs.items():
        good = gm(x, torch.tensor([1]))[0]
        seen = []
        for _ in range(3):
            try:
                gm(x, torch.tensor([7]))
                seen.append(("no error", _pending()))
            except GraphReplayError as e:
                seen.append((str(e), _pending()))
        after = gm(x, torch.tensor([0]))[0]  # the group still works: the failed replays' collectives finished
        out[kind] = {"good": good, "after": after, "failures": seen}
    return out


def _c10d_in_a_graph_file(rank: int, world: int) -> dict:
    """A traced graph with a functional all_reduce, saved and loaded: it replays (through the size
    agreement), and the same file with the all_reduce read without its wait_tensor is refused."""
    import json
    import tempfile

    from torch.distributed import _functional_collectives as funcol
    from torch.fx.experimental.proxy_tensor import make_fx

    from usp_graph.distributed import resolve_group
    from usp_graph.graphfile import (
        GraphFileSchemaError,
        load_graph_module,
        loads_graph_module,
        save_graph_module,
    )
    from usp_graph.graphfile.document import fingerprint

    name = dist.group.WORLD.group_name

    def step(x):
        y = torch.ops.usp.all_gather(x, 0, 2, name)  # records the group in the file
        return funcol.wait_tensor(funcol.all_reduce(y, "sum", resolve_group(name)))

    x = _x(2, 3) + rank
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "step.uspg")
        save_graph_module(make_fx(step)(x), path)
        out = {"replayed": load_graph_module(path).graph_module(x)}
        doc = json.loads(open(path).read())
    for node in doc["graph"]["nodes"]:
        if node.get("target") == "_c10d_functional.wait_tensor.default":
            node["target"] = "aten.clone.default"  # the all_reduce's result read while it is written
            break
    doc["fingerprint"] = fingerprint(doc)
    try:
        loads_graph_module(json.dumps(doc).encode())
        out["unwaited"] = "loaded"
    except GraphFileSchemaError as e:
        out["unwaited"] = str(e)
    return out


# ------------------------------------------------------------------------------------------------
# Tests.


def _expected(form: str, rank: int) -> torch.Tensor | None:
    """What each honest form returns on `rank` (None: checked elsewhere, e.g. ring attention)."""
    if form in ("all_to_all", "all_to_all_start", "replay_all_to_all_single"):
        return torch.cat([_x(4, 3)[2 * rank : 2 * rank + 2], _x(4, 3)[2 * rank : 2 * rank + 2]])
    if form in ("all_gather", "all_gather_start", "replay_all_gather_into_tensor"):
        return torch.cat([_x(2, 3), _x(2, 3)])
    if form in ("reduce_scatter", "reduce_scatter_start", "replay_reduce_scatter_tensor"):
        return 2 * _x(4, 3)[2 * rank : 2 * rank + 2]
    if form in ("all_reduce_sum_ordered", "replay_all_reduce"):
        return 2 * _x(3)
    if form == "replay_broadcast":
        return _x(3)
    return None


@pytest.fixture(scope="module")
def misbehaving():
    return run_ranks(_every_form, 2, ["honest", "more", "fewer"], timeout=120, pg_timeout=30)


@pytest.mark.slow
def test_every_form_runs_honestly_and_leaves_nothing_pending(misbehaving):
    for rank, results in enumerate(misbehaving):
        for form, seen in results["honest"].items():
            assert seen["type"] == "no error", (rank, form, seen["msg"])
            assert seen["pending"] == (0, 0), (rank, form, seen)
            want = _expected(form, rank)
            if want is not None:
                assert torch.equal(seen["out"], want), (rank, form, seen["out"])


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["more", "fewer"], ids=["sends_more", "short_send"])
def test_disagreeing_sizes_are_a_collective_error_on_every_rank_at_once(misbehaving, variant):
    for rank, results in enumerate(misbehaving):
        for form, seen in results[variant].items():
            assert seen["type"] == "CollectiveError", (rank, form, seen["type"], seen["msg"])
            assert "the ranks disagree on the sizes" in seen["msg"], (rank, form, seen["msg"])
            assert " bytes to rank " in seen["msg"] or "different op" in seen["msg"], (
                rank,
                form,
                seen["msg"],
            )
            assert seen["s"] < VERDICT_T_S / 2, (rank, form, seen["s"])  # a verdict, not a timeout
            assert seen["pending"] == (0, 0), (rank, form, seen)


@pytest.mark.slow
@pytest.mark.parametrize("where", ["blocking", "issued"])
def test_a_rank_dying_mid_collective_is_a_collective_error_on_the_survivor(where):
    with pytest.raises(RankError) as info:
        run_ranks(_dies, 2, where, timeout=120, pg_timeout=30)
    assert info.value.failures == {1: "rank 1 exited with code 3 without reporting a result"}
    seen = info.value.results[0]
    assert set(seen) == set(FORMS)
    for form, s in seen.items():
        assert s["type"] == "CollectiveError", (form, s["type"], s["msg"])
        assert "failed on rank 0 of 2" in s["msg"], (form, s["msg"])
        assert s["s"] < T_S + 2, (form, s["s"])
        assert s["pending"] == (0, 0), (form, s)


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_a_collective_error_after_the_group_timeout():
    seen = run_ranks(_absent, 2, timeout=120, pg_timeout=60)[0]
    assert set(seen) == set(FORMS)
    for form, s in seen.items():
        assert s["type"] == "CollectiveError", (form, s["type"], s["msg"])
        assert "Timed out" in s["msg"] or "timed out" in s["msg"], (form, s["msg"])
        assert f"({datetime.timedelta(seconds=T_S)})" in s["msg"], (form, s["msg"])
        assert T_S - 0.5 <= s["s"] < T_S + 3, (form, s["s"])
        assert s["pending"] == (0, 0), (form, s)


@pytest.mark.slow
def test_a_replay_failing_between_issue_and_wait_leaves_nothing_pending():
    for rank, out in enumerate(run_ranks(_fails_between_issue_and_wait, 2, timeout=120, pg_timeout=30)):
        for kind, r in out.items():
            assert len(r["failures"]) == 3
            for msg, pending in r["failures"]:
                assert "index" in msg, (rank, kind, msg)
                assert pending == (0, 0), (rank, kind, pending)
            if kind == "c10d":
                want = 2 * _x(2, 3) + 10
            else:  # all_to_all of one row each way
                want = torch.stack([(_x(2, 3) + 10 * j)[rank] for j in range(2)])
            assert torch.equal(r["good"], want), (rank, kind, r["good"])
            assert torch.equal(r["after"], want), (rank, kind, r["after"])


# ------------------------------------------------------------------------------------------------
# A clean exit after a correct step: fresh processes (a pooled rank leaves by os._exit, which skips
# the interpreter teardown this is about), 2 gloo ranks, Ulysses, one step through each door in
# `doors`; the process group is left for the exit to tear down. Door "eager": every decoder layer
# under torch.utils.checkpoint(use_reentrant=False) in attention_mode, and one issued all_to_all
# left in flight (a step cut short). Door "compiled": backend usp with option cp under documents.
# Nothing imports Dynamo before init_process_group (torch does, at the first checkpoint call or
# compile: after it, as in a job).

DOORS = "eager,compiled"


def _train_then_exit(rank: int, world: int, store: str, log: str, doors: str = DOORS) -> None:
    err = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    os.dup2(err, 2)  # what the C++ runtime prints on abort ("terminate called ...") lands in `log`
    torch.set_num_threads(1)
    from usp_graph import AttentionMetadata, ContextParallel
    from usp_graph.models import Llama, LlamaConfig, make_llama_batch

    dist.init_process_group(
        "gloo",
        init_method="file://" + store,
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)
    model = Llama(config).to(torch.float64)
    lengths = [5, 3, 7, 1]
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(1))
    meta = AttentionMetadata.from_lengths(lengths, max_docs=8)
    cp = ContextParallel("ulysses")
    ids, pos, labels = (cp.shard(batch[k], 1) for k in ("input_ids", "position_ids", "labels"))
    for door in doors.split(","):
        step = {"eager": _eager_checkpointed_loss, "compiled": _compiled_loss}[door]
        step(model, config, meta, cp, ids, pos, labels).backward()
        cp.reduce_grads(model.parameters())
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    if "eager" in doors.split(","):
        y = _x(4, 3)
        torch.ops.usp.all_to_all_start(y, 0, 0, [2, 2], [2, 2], dist.group.WORLD.group_name)  # never waited
    print(f"trained; gloo threads: {len(_gloo_threads())}", flush=True, file=sys.stderr)
    atexit.register(_count_gloo_threads_after_the_exit_handler)  # runs before usp_graph's (LIFO)


def _eager_checkpointed_loss(model, config, meta, cp, ids, pos, labels) -> torch.Tensor:
    import torch.nn.functional as F
    from torch.utils.checkpoint import checkpoint

    from usp_graph import attention_mode
    from usp_graph.models.llama import rope_cos_sin

    with attention_mode(meta, cp=cp):
        x = model.tok_embeddings(ids)
        cos, sin = rope_cos_sin(pos, config.head_dim, config.rope_theta, x.dtype)
        for layer in model.layers:
            x = checkpoint(layer, x, cos, sin, use_reentrant=False)
        logits = model.lm_head(model.norm(x))
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _compiled_loss(model, config, meta, cp, ids, pos, labels) -> torch.Tensor:
    import torch.nn.functional as F

    from usp_graph import documents

    compiled = torch.compile(model, backend="usp", options={"cp": cp})
    with documents(meta):
        logits = compiled(ids, pos)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")


def _gloo_threads() -> list[str]:
    """This process's threads that gloo started (its worker and TCP loop threads), by name."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:  # a thread that ended meanwhile
            continue
    return [n for n in names if "gloo" in n]


def _count_gloo_threads_after_the_exit_handler() -> None:
    """usp_graph's exit handler (running it again afterwards does nothing more), then the count: a
    group still alive then keeps its threads running through the C++ teardown, the abort's cause.
    Where one is left, what still refers to a process group (its cause) is printed too."""
    from usp_graph.distributed import _exit_cleanly

    _exit_cleanly()
    left = len(_gloo_threads())
    print(f"after the exit handler, gloo threads: {left}", flush=True, file=sys.stderr)
    if left:
        print(f"process groups still held by: {_group_holders()}", flush=True, file=sys.stderr)


def _group_holders() -> list[str]:
    """What refers to a ProcessGroup, and what refers to that, among everything reachable from the
    objects the garbage collector tracks (a tuple or dict of untracked objects, such as a function's
    defaults, is untracked itself: `gc.get_referrers` misses it; following referents does not)."""
    import gc
    import types

    def describe(o) -> str:
        if isinstance(o, types.ModuleType):
            return f"module {o.__name__}"
        if isinstance(o, types.FunctionType | type):
            return f"{type(o).__name__} {o.__module__}.{o.__qualname__}"
        return type(o).__qualname__

    def referrers(targets: dict[int, object]) -> dict[int, tuple[object, int]]:
        found: dict[int, tuple[object, int]] = {}
        seen: set[int] = set()
        stack = gc.get_objects()
        while stack:
            o = stack.pop()
            if id(o) in seen or o is targets or o is found:
                continue
            seen.add(id(o))
            for r in gc.get_referents(o):
                if id(r) in targets or (not targets and dist.ProcessGroup in type(r).__mro__):
                    found.setdefault(id(o), (o, id(r)))
                elif id(r) not in seen:
                    stack.append(r)
        return found

    first = referrers({})
    second = referrers({i: o for i, (o, _) in first.items()})
    lines = [f"{describe(o)} <- {describe(by)}" for by, via in second.values() for o in [first[via][0]]]
    return sorted(set(lines))[:20] or sorted({describe(o) for o, _ in first.values()})


def _exit_run(tmp: str, tag: str, doors: str) -> list[tuple[int | None, str]]:
    """Two spawned ranks that train (`doors`) and exit: each rank's (exit code, log)."""
    ctx = torch.multiprocessing.get_context("spawn")
    logs = [os.path.join(tmp, f"{tag}.rank{r}.log") for r in range(2)]
    store = os.path.join(tmp, f"{tag}.store")
    procs = [ctx.Process(target=_train_then_exit, args=(r, 2, store, logs[r], doors)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        if p.is_alive():
            p.kill()
            p.join()
    return [
        (p.exitcode, open(log).read() if os.path.exists(log) else "")
        for p, log in zip(procs, logs, strict=True)
    ]


@pytest.mark.slow
@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads through /proc")
def test_a_process_that_trained_correctly_exits_cleanly(tmp_path):
    """The abort itself came 1-3 times in 50 runs; what caused it, every time: the gloo group outlived
    the exit handler (a reference held it), so its threads ran on into the C++ teardown. A run on 2
    ranks, an eager and a compiled step each, checking that no gloo thread is left once the exit
    handler ran (tools/exit_repeat.py repeats it)."""
    for r, (code, text) in enumerate(_exit_run(str(tmp_path), "run", DOORS)):
        assert code == 0 and "trained; gloo threads: " in text, (r, code, text[-2000:])
        assert "trained; gloo threads: 0" not in text, text  # the check below checks something
        assert "after the exit handler, gloo threads: 0" in text, (r, text[-2000:])
        assert "terminate called" not in text and "Abort" not in text, (r, text[-2000:])


_BOUND_AT_IMPORT = """
def f(x, group=G, other=O):
    pass

def g(*, group=G):
    pass

class C:
    def __init__(self, group=G):
        pass

    @staticmethod
    def s(group=G):
        pass
"""


@pytest.mark.filterwarnings("error")  # at exit: torch.distributed.reduce_op warns when it is read
def test_the_exit_handler_releases_defaults_torch_modules_bound_to_a_destroyed_group(monkeypatch):
    """torch.distributed.nn.functional writes ``group=group.WORLD``: imported after init_process_group
    (torch imports it through Dynamo, lazily), its defaults hold the default group for good. The exit
    handler sets such defaults of torch.distributed modules to None (their value had the module been
    imported before init), leaves every other default and every other module alone, and warns
    nothing."""
    import types

    from usp_graph.distributed import _release_import_time_defaults

    group, other = object(), object()  # only identity matters
    modules = {}
    for name in ("torch.distributed._bound_at_import", "elsewhere_bound_at_import"):
        modules[name] = types.ModuleType(name)
        modules[name].G, modules[name].O = group, other
        exec(_BOUND_AT_IMPORT, vars(modules[name]))
        monkeypatch.setitem(sys.modules, name, modules[name])
    _release_import_time_defaults([group])
    torch_side, elsewhere = modules.values()
    assert torch_side.f.__defaults__ == (None, other)
    assert torch_side.g.__kwdefaults__ == {"group": None}
    assert torch_side.C.__init__.__defaults__ == (None,) and torch_side.C.s.__defaults__ == (None,)
    assert elsewhere.f.__defaults__ == (group, other) and elsewhere.g.__kwdefaults__ == {"group": group}
    assert elsewhere.C.__init__.__defaults__ == (group,)


def test_a_context_parallel_plan_does_not_keep_its_process_group_alive(tmp_path):
    """A plan kept for the whole run (a global, Dynamo's cache of a compiled step) holds its group
    weakly: destroyed, the group goes, and the plan says so when asked for it."""
    import gc
    import weakref

    from usp_graph import ContextParallel

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        cp = ContextParallel("ulysses")
        group = weakref.ref(dist.group.WORLD)
        assert cp.group is group()
        dist.destroy_process_group()
        gc.collect()
        assert group() is None
        with pytest.raises(ValueError, match="process group '.+' of this ContextParallel was destroyed"):
            _ = cp.group
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


@pytest.mark.slow
def test_a_functional_collective_in_a_file_replays_and_must_be_waited_for():
    for rank, out in enumerate(run_ranks(_c10d_in_a_graph_file, 2, timeout=120, pg_timeout=30)):
        both = torch.cat([_x(2, 3), _x(2, 3) + 1])
        assert torch.equal(out["replayed"], 2 * both), (rank, out["replayed"])
        assert "exactly one _c10d_functional.wait_tensor.default" in out["unwaited"], out["unwaited"]
