"""The closed op table of graph files and the check a loaded graph passes before it runs.

The table's OBSERVED block is regenerated from the workloads (`tools/gen_optable.py --check`); the
rest checks the mechanisms one by one on small hand-made graphs saved with `save_graph_module` and
edited as JSON with a valid fingerprint, so each file reaches the check it is about.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch
import torch.fx as fx

from tests import background
from usp_graph.graphfile import (
    DisallowedTargetError,
    GraphFileSchemaError,
    GraphReplayError,
    loads_graph_module,
    save_graph_module,
)
from usp_graph.graphfile.document import dumps, fingerprint
from usp_graph.graphfile.optable import COLLECTIVES, EXTRA, NEVER, OBSERVED, UNINITIALIZED, allowed

ROOT = Path(__file__).resolve().parents[1]
A = torch.ops.aten


def _file(tmp_path, fn, *example) -> dict:
    """A plain (non-symbolic) graph file of `fn`, as its JSON document."""
    from torch.fx.experimental.proxy_tensor import make_fx

    save_graph_module(make_fx(fn)(*example), tmp_path / "g.json")
    return json.loads((tmp_path / "g.json").read_text())


def _load(doc: dict):
    doc = dict(doc)
    doc["fingerprint"] = fingerprint(doc)
    return loads_graph_module(dumps(doc).encode())


def _node(doc: dict, prefix: str) -> dict:
    return next(n for n in doc["graph"]["nodes"] if n["name"].startswith(prefix))


# About a minute of compiling on one core: started when collection ends (tests/conftest.py), it runs
# beside the rest of the suite.
_GEN_CHECK = [sys.executable, str(ROOT / "tools" / "gen_optable.py"), "--check"]
_GEN_ENV = {**os.environ, "PYTHONPATH": str(ROOT)}


@pytest.mark.slow
@pytest.mark.start_early("gen_optable", _GEN_CHECK, cwd=str(ROOT), env=_GEN_ENV)
def test_the_table_holds_exactly_the_ops_the_workloads_write():
    code, output = background.result("gen_optable", _GEN_CHECK, timeout=850, cwd=str(ROOT), env=_GEN_ENV)
    assert code == 0, output[-6000:]


def test_every_table_op_exists_and_none_is_out_of_bounds_by_construction():
    for name in OBSERVED | EXTRA | COLLECTIVES | UNINITIALIZED:
        ns, op, overload = name.split(".")
        target = getattr(getattr(getattr(torch.ops, ns), op), overload)
        assert isinstance(target, torch._ops.OpOverload), name
        assert name.rsplit(".", 1)[0] not in NEVER, name
        writes = [
            a.name for a in target._schema.arguments if a.alias_info is not None and a.alias_info.is_write
        ]
        assert writes in ([], ["self"]), f"{name} writes to {writes}"  # in-place on self at most, never out=
        assert not writes or name in OBSERVED, f"{name}: in-place ops only where graphs hold them"
        assert allowed(name)
    for name in ("aten.manual_seed.default", "aten._reshape_alias.out", "aten.add.out", "aten.resize_.default",
                 "aten._unsafe_index.Tensor", "aten.nonzero.default", "aten.save.default", "aten.seed.default",
                 "aten._sparse_coo_tensor_with_dims_and_tensors.default", "aten._to_dense.default"):  # fmt: skip
        assert not allowed(name), name


def test_an_op_outside_the_table_is_refused_at_load(tmp_path):
    doc = _file(tmp_path, lambda x: x.sin(), torch.randn(3))
    _node(doc, "sin")["target"] = "aten.manual_seed.default"
    with pytest.raises(DisallowedTargetError, match="not in the table"):
        _load(doc)


def test_a_tensor_argument_must_be_a_node_that_makes_a_tensor(tmp_path):
    doc = _file(tmp_path, lambda x: (x * 2).sum(), torch.randn(3))
    mul = _node(doc, "mul")
    mul["args"][0] = 3  # the first argument of mul.Tensor: a plain int
    with pytest.raises(GraphFileSchemaError, match="argument 'self' must be Tensor, got int"):
        _load(doc)
    mul["args"] = [mul["args"][1], {"node": "x_1"}]  # a number for `other` is what aten wraps: fine
    with pytest.raises(GraphFileSchemaError, match="argument 'self' must be Tensor, got int"):
        _load(doc)
    mul["args"] = [{"node": "x_1"}, {"node": "sum_1"}]  # `sum_1` comes later: a dangling reference
    with pytest.raises(GraphFileSchemaError, match="not defined before"):
        _load(doc)
    doc = _file(tmp_path, lambda x: x.sin().sum(), torch.randn(3))
    _node(doc, "sum")["args"][0] = {"node": "x_1"}  # still a tensor: fine
    _load(doc)
    doc = _file(tmp_path, lambda x: torch.split(x, 2)[1].sum(), torch.randn(5))
    _node(doc, "getitem")["args"][1] = 7  # split makes a list: an index is only known at replay
    with pytest.raises(GraphReplayError, match="getitem"):
        _load(doc)(torch.randn(5))


def test_names_cannot_become_code(tmp_path):
    doc = _file(tmp_path, lambda x: x + torch.ones(2), torch.randn(2))
    for bad in ("self", "__init__", "__class__", "class"):
        d = json.loads(json.dumps(doc))
        _node(d, "add")["name"] = bad
        d["graph"]["nodes"][-1]["args"] = [{"node": bad}]
        with pytest.raises(GraphFileSchemaError, match="name"):
            _load(d)
    doc = _file(tmp_path, lambda x: x + torch.tensor([1.0, 2.0]), torch.randn(2))
    (const,) = doc["constants"]
    for bad in ("forward", "training", "graph", "code", "_code", "meta", "_modules", "__init__", "self"):
        d = json.loads(json.dumps(doc).replace(f'"{const}"', f'"{bad}"'))
        with pytest.raises(GraphFileSchemaError, match="name"):
            _load(d)


def test_writes_to_inputs_or_constants_are_refused_through_views(tmp_path):
    doc = _file(tmp_path, lambda x: x.clone().view(-1).add(1.0).sum(), torch.randn(2, 2))
    add = _node(doc, "add")
    add["target"] = "aten.add_.Scalar"  # in place, as some traced graphs hold it
    f = _load(doc)  # writing into a fresh clone is fine
    x = torch.randn(2, 2)
    before = x.clone()
    f(x)
    assert torch.equal(x, before)
    view = _node(doc, "view")
    view["args"][0] = {"node": "x_1"}  # now the in-place add writes into the caller's tensor
    with pytest.raises(GraphFileSchemaError, match="writes to placeholder 'x_1'"):
        _load(doc)


def test_a_view_with_explicit_strides_may_only_read_its_own_storage(tmp_path):
    doc = _file(tmp_path, lambda x: A._reshape_alias(x, [12], [1]).clone(), torch.randn(12))
    f = _load(doc)
    x = torch.randn(12)
    assert torch.equal(f(x), x)
    _node(doc, "_reshape_alias")["args"][1] = [1 << 20]
    f = _load(doc)  # sizes are literals here, but storage is only known at replay
    with pytest.raises(GraphReplayError, match="reach element"):
        f(torch.randn(12))
    doc = _file(tmp_path, lambda x: A.as_strided(x, [3], [4], 0).clone(), torch.randn(12))
    _node(doc, "as_strided")["args"][3] = 3  # elements 3, 7, 11: in bounds
    _load(doc)(torch.randn(12))
    _node(doc, "as_strided")["args"][3] = 4  # 4, 8, 12: one past the end
    with pytest.raises(GraphReplayError, match="reach element 12"):
        _load(doc)(torch.randn(12))


def test_uninitialized_allocations_replay_zero_filled(tmp_path):
    doc = _file(tmp_path, lambda x: torch.empty_like(x).add(0), torch.randn(1 << 12))
    f = _load(doc)
    junk = torch.randn(1 << 12)  # recently freed bytes the allocator may hand back
    del junk
    out = f(torch.randn(1 << 12))
    assert torch.equal(out, torch.zeros(1 << 12))
    assert f.graph_module.graph.find_nodes(
        op="call_function", target=A.empty_like.default
    )  # the file's graph


def test_a_node_bigger_than_the_limit_or_on_another_device_is_refused_before_anything_runs(
    tmp_path, monkeypatch
):
    doc = _file(tmp_path, lambda x: x.new_zeros([8, 8]).sum() + x.sum(), torch.randn(3))
    _node(doc, "new_zeros")["args"][1] = [1 << 20, 1 << 20]
    f = _load(doc)
    with pytest.raises(GraphReplayError, match="over the limit"):
        f(torch.randn(3))
    monkeypatch.setenv("USP_GRAPHFILE_MAX_TENSOR_BYTES", "64")
    with pytest.raises(GraphReplayError, match="over the limit"):
        _load(_file(tmp_path, lambda x: x.new_zeros([8, 8]).sum(), torch.randn(3)))(torch.randn(3))
    monkeypatch.setenv("USP_GRAPHFILE_MAX_TENSOR_BYTES", "1024")  # 8 x 800 bytes alive at once > 4 x 1024

    def many(x):
        parts = [x * float(i) for i in range(8)]
        return sum(p.sum() for p in parts)

    x = torch.randn(200)
    with pytest.raises(GraphReplayError, match="at once"):
        _load(_file(tmp_path, many, x))(x)

    def few(x):  # the same products, each dead before the next: 800 bytes live at most
        return sum((x * float(i)).sum() for i in range(8))

    assert torch.equal(_load(_file(tmp_path, few, x))(x), few(x))
    monkeypatch.delenv("USP_GRAPHFILE_MAX_TENSOR_BYTES")
    doc = _file(tmp_path, lambda x: x.to(torch.float64), torch.randn(3))
    to = next(n for n in doc["graph"]["nodes"] if n["op"] == "call_function")
    to["kwargs"]["device"] = {"device": "meta"}
    with pytest.raises(GraphReplayError, match="device"):
        _load(doc)(torch.randn(3))


def test_shape_errors_are_caught_before_the_real_run_and_caller_tensors_and_rng_are_untouched(tmp_path):
    doc = _file(tmp_path, lambda x, w: (x @ w).sum(), torch.randn(2, 3), torch.randn(3, 4))
    f = _load(doc)
    x, w = torch.randn(2, 3), torch.randn(3, 4)
    assert torch.equal(f(x, w), (x @ w).sum())
    mm = _node(doc, "mm")
    mm["args"] = [mm["args"][0], mm["args"][0]]  # (2, 3) @ (2, 3)
    f = _load(doc)
    state = torch.get_rng_state()
    with pytest.raises(GraphReplayError, match="nothing ran"):
        f(x, w)
    assert torch.equal(torch.get_rng_state(), state)


def test_random_ops_leave_the_callers_generator_as_it_was(tmp_path):
    doc = _file(tmp_path, lambda x: torch.rand_like(x) + x, torch.randn(4))
    f = _load(doc)
    state = torch.get_rng_state()
    a = f(torch.zeros(4))
    assert torch.equal(torch.get_rng_state(), state)
    assert torch.equal(f(torch.zeros(4)), a)


def test_the_check_runs_once_per_input_signature(tmp_path, monkeypatch):
    from usp_graph.graphfile import replay

    doc = _file(tmp_path, lambda x: x.sin(), torch.randn(3))
    f = _load(doc)
    calls = []
    original = replay.ReplayCheck._propagate
    monkeypatch.setattr(
        replay.ReplayCheck, "_propagate", lambda self, args: calls.append(1) or original(self, args)
    )
    f(torch.randn(3))
    f(torch.randn(3))
    assert len(calls) == 1
    with pytest.raises(ValueError):
        f(torch.randn(4))  # the file's static size: input checks refuse it first
    gm = f.graph_module
    gm(torch.randn(4))  # the module itself replays any size, after its own check
    assert len(calls) == 2
    assert isinstance(gm, fx.GraphModule)
