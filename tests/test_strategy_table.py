"""The CP strategy table is the one list of strategies: the CLI, the cost model and ContextParallel
read it."""

from __future__ import annotations

import pytest

from usp_graph.cli import build_parser
from usp_graph.cp import STRATEGIES, STRATEGY_TABLE, strategies
from usp_graph.cp.cost import bytes_sent
from usp_graph.cp.table import strategy_of


def test_each_row_runs_the_strategy_function_of_its_name():
    assert STRATEGIES == tuple(STRATEGY_TABLE) == ("allgather_kv", "ulysses", "ring", "usp", "halo")
    for name, row in STRATEGY_TABLE.items():
        assert row.name == name and row.attention is getattr(strategies, name)


def test_the_demo_offers_the_table_s_strategies():
    demo = build_parser()._subparsers._group_actions[0].choices["demo"]
    (action,) = [a for a in demo._actions if a.dest == "strategy"]
    assert tuple(action.choices) == STRATEGIES


@pytest.mark.parametrize("name", STRATEGIES)
def test_the_cost_model_has_a_formula_for_each_row(name):
    kw = dict(tokens=64, heads=4, kv_heads=2, head_dim=8, world=2, element_size=2, max_document_len=9)
    assert bytes_sent(name, ulysses_degree=2 if name == "usp" else 1, **kw) > 0


def test_the_cost_model_refuses_a_name_without_a_row():
    with pytest.raises(ValueError, match="unknown strategy 'zigzag'"):
        bytes_sent("zigzag", tokens=64, heads=4, kv_heads=2, head_dim=8, world=2, element_size=2)


def test_strategy_of_tells_each_variant_apart():
    variants = [(ops, row.name) for row in STRATEGY_TABLE.values() for ops in row.forward_ops]
    assert len({ops for ops, _ in variants}) == len(variants)
    for ops, name in variants:
        assert strategy_of(sorted(ops)) == name
    assert strategy_of([]) is None
