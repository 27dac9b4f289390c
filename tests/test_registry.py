"""The registry's table is the rules as data; the ops modules only implement its rows."""

from __future__ import annotations

import pytest
import torch

from usp_graph import registry


def test_every_row_is_wired_as_the_table_says():
    wired = {str(op._schema.name): rule for op, rule in registry.rules().items()}
    assert sorted(wired) == sorted(r.op for r in registry.TABLE)
    for row in registry.TABLE:
        rule = wired[row.op]
        assert rule.kind == row.kind
        assert tuple(str(b._schema.name) for b in rule.backward_ops) == row.backward_ops
        assert (rule.adjoint and str(rule.adjoint._schema.name)) == row.adjoint
        assert rule.module == row.module == rule.backward.__module__
        if row.kind == "collective":
            assert row.adjoint is not None


def test_implement_refuses_an_op_without_a_row():
    lib = torch.library.Library("usp_test_norow", "DEF")
    lib.define("norow(Tensor x) -> Tensor")
    with pytest.raises(
        NotImplementedError, match=r"usp_test_norow::norow has no row in usp_graph\.registry\.TABLE"
    ):
        registry.implement(torch.ops.usp_test_norow.norow.default, setup_context=None, backward=None)


def test_implement_refuses_an_implementation_from_another_module():
    def backward(ctx, grad):  # defined here, not in usp_graph.ops.varlen
        return grad

    with pytest.raises(
        ValueError, match=r"implemented in usp_graph\.ops\.varlen, but \S*test_registry implements"
    ):
        registry.implement(torch.ops.usp.varlen_fwd.default, setup_context=backward, backward=backward)


def test_check_complete_names_a_row_no_module_implemented(monkeypatch):
    row = registry.Rule("usp::nowhere", "attention", (), None, "usp_graph.ops.nowhere", "test")
    monkeypatch.setattr(registry, "TABLE", (*registry.TABLE, row))
    with pytest.raises(
        NotImplementedError, match=r"no module implemented: usp::nowhere \(in usp_graph\.ops\.nowhere\)"
    ):
        registry.check_complete()
