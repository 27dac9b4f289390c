"""A graph file read without its fake values (``values=False``) builds no ShapeEnv: its symbolic sizes
are plain sympy symbols with the assumptions a ShapeEnv gives its own, and replay checks and runs
exactly as on the file read with its values."""

from __future__ import annotations

import pytest
import sympy
import torch
from torch import nn

from tests.graphfile_corpus import STEP, build_bases, example_inputs
from usp_graph import AttentionMetadata, trace_train_step
from usp_graph.graphfile import load, loads, save


def test_dims_read_without_values_are_plain_symbols_with_the_shape_envs_assumptions():
    data = build_bases()[STEP]
    with_values, plain = loads(data), loads(data, values=False)
    assert set(plain.file.dims) == set(with_values.file.dims) and plain.file.dims
    assert plain.file.symbols == {} and set(with_values.file.symbols) == set(with_values.file.dims)
    for name, sym in plain.file.dims.items():
        shape_env_sym = with_values.file.dims[name]
        assert type(sym) is sympy.Symbol and sym.name == name, sym
        assert (sym.is_integer, sym.is_positive) == (shape_env_sym.is_integer, shape_env_sym.is_positive), (
            name
        )
    assert plain.file.hints == with_values.file.hints and plain.file.ranges == with_values.file.ranges
    assert all(n.meta.get("val") is None for n in plain.graph_module.graph.nodes)


def test_a_step_read_without_values_replays_bitwise_as_with_them():
    data = build_bases()[STEP]
    loss, grads = loads(data).replay(*example_inputs(STEP))
    plain_loss, plain_grads = loads(data, values=False).replay(*example_inputs(STEP))
    assert torch.equal(plain_loss, loss) and grads.keys() == plain_grads.keys()
    assert all(torch.equal(plain_grads[n], grads[n]) for n in grads)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def test_recorded_guards_and_ranges_refuse_the_same_inputs_without_values(tmp_path):
    def step(model, batch):
        x = batch["x"]
        return model.lin(x[:4] if x.shape[0] % 2 == 0 else x).sum()  # guards: T even, T >= 4

    model = _Tiny()
    save(trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6])),
         tmp_path / "g.json")  # fmt: skip
    with_values, plain = load(tmp_path / "g.json"), load(tmp_path / "g.json", values=False)
    assert plain.signature.guards, "the trace recorded no guard to check"
    params = dict(model.named_parameters())
    for n, message in ((9, r"these inputs \(T=9, max_seqlen=9\) break an assumption made while tracing"),
                       (2, r"batch\['x'\] dim 0 = 2, but the graph was traced for T >= 4")):  # fmt: skip
        args = (params, {"x": torch.randn(n, 4)}, AttentionMetadata.from_lengths([n]))
        with pytest.raises(ValueError, match=message) as expected:
            with_values.replay(*args)
        with pytest.raises(ValueError, match=message) as got:
            plain.replay(*args)
        assert str(got.value) == str(expected.value)
    args = (params, {"x": torch.ones(10, 4)}, AttentionMetadata.from_lengths([10]))
    assert torch.equal(plain.replay(*args)[0], with_values.replay(*args)[0])
