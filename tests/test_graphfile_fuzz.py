"""Fuzzing the graph-file loader: every mutated file loads or raises a GraphFileError subclass.

Mutations (shared with tests/test_graphfile_redteam.py, which also replays the mutants; they live
in tests/graphfile_corpus.py): bit flips, truncations and byte-range splices of the raw file (these
mostly meet the JSON parser and the fingerprint), and JSON-level edits of node targets, ops, names, args, kwargs,
metadata, fake values, symbols, guards, inputs, process groups and the train-step section, most of
them re-fingerprinted so they reach every check behind the hash.

    pytest tests/test_graphfile_fuzz.py                           # USP_FUZZ_CASES=500 (CI)
    USP_FUZZ_CASES=1000 USP_FUZZ_SEED=7 pytest tests/test_graphfile_fuzz.py -s   # nightly size
"""

from __future__ import annotations

import json
import os
import random
import traceback
import warnings
from collections import Counter
from typing import Any

import pytest
import torch.fx as fx

from tests.graphfile_corpus import GM_OPS, GM_SYM, STEP, build_bases, dumps, fast_fingerprint, mutate_bytes
from usp_graph.graphfile import (
    GraphFileError,
    GraphFileSchemaError,
    GraphFileVersionWarning,
    loads,
    loads_graph_module,
)

CASES = int(os.environ.get("USP_FUZZ_CASES", "500"))
SEED = int(os.environ.get("USP_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def corpus() -> list[tuple[str, bytes, Any]]:
    """Valid files (tests/graphfile_corpus.py): a train step (usp ops, SymInt arithmetic, getitem,
    dtypes, devices), a symbolic graph module (a tensor constant, an inf argument) and a static one
    (views, indexing, multi-output ops)."""
    bases = build_bases()
    return [
        ("train_step", bases[STEP], loads),
        ("graph_module", bases[GM_SYM], loads_graph_module),
        ("graph_module_ops", bases[GM_OPS], loads_graph_module),
    ]


def _mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    return mutate_bytes(data, rng)


@pytest.mark.slow
def test_mutated_graph_files_load_or_raise_a_graph_file_error(corpus):
    rng = random.Random(SEED)
    outcomes: Counter[str] = Counter()
    failures = []
    for case in range(CASES):
        name, data, loader = corpus[case % len(corpus)]
        mutated, what = _mutate(data, rng)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", GraphFileVersionWarning)
                result = loader(mutated)
            gm = result.graph_module
            assert isinstance(gm, fx.GraphModule) and isinstance(gm.code, str)
            outcomes["loaded"] += 1
        except GraphFileError as e:
            outcomes[type(e).__name__] += 1
            assert str(e), what
        except Exception as e:  # anything else is a loader bug: collect them all, fail once
            failures.append(
                f"case {case} ({name}, seed {SEED}): {what}\n{type(e).__name__}: {e}\n{traceback.format_exc()[-2500:]}"
            )
    print(f"\n{CASES} fuzz cases (seed {SEED}): {dict(sorted(outcomes.items()))}")
    assert not failures, f"{len(failures)} of {CASES} cases raised outside GraphFileError:\n" + "\n".join(
        failures[:5]
    )
    assert outcomes["loaded"] < CASES  # the mutations do bite


@pytest.mark.parametrize(
    "graph",
    [{"layout": "float32"}, {}, {"nodes": None, "meta": {}}, {"nodes": [1], "meta": {}}, [], "nodes"],
    ids=["replaced", "empty", "nodes_null", "node_not_an_object", "a_list", "a_string"],
)
def test_a_graph_section_without_a_node_list_is_refused_by_the_schema(corpus, graph):
    """The red-team fuzzer's seed 20790 (case 175) replaced the graph section with
    ``{"layout": "float32"}``; every such file, re-fingerprinted, is a schema error, never a KeyError."""
    for _name, data, loader in corpus:
        doc = json.loads(data)
        doc["graph"] = graph
        doc["fingerprint"] = fast_fingerprint(doc)
        with pytest.raises(GraphFileSchemaError, match=r"graph"):
            loader(dumps(doc).encode())
