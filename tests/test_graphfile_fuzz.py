"""Fuzzing the graph-file loader: every mutated file loads or raises a GraphFileError subclass.

Mutations: bit flips, truncations and byte-range splices of the raw file (these mostly meet the
JSON parser and the fingerprint), and JSON-level edits of node targets, ops, names, args, kwargs,
metadata, fake values, symbols, guards, inputs, process groups and the train-step section, most of
them re-fingerprinted so they reach every check behind the hash.

    pytest tests/test_graphfile_fuzz.py                           # USP_FUZZ_CASES=500 (CI)
    USP_FUZZ_CASES=1000 USP_FUZZ_SEED=7 pytest tests/test_graphfile_fuzz.py -s   # nightly size
"""

from __future__ import annotations

import copy
import json
import os
import random
import traceback
import warnings
from collections import Counter
from typing import Any

import pytest
import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from usp_graph import AttentionMetadata, trace_train_step
from usp_graph.graphfile import (
    GraphFileError,
    GraphFileVersionWarning,
    loads,
    loads_graph_module,
    save,
    save_graph_module,
)
from usp_graph.graphfile.document import dumps, fingerprint
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch

CASES = int(os.environ.get("USP_FUZZ_CASES", "500"))
SEED = int(os.environ.get("USP_FUZZ_SEED", "0"))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> list[tuple[str, bytes, Any]]:
    """Valid files: a train step (usp ops, SymInt arithmetic, getitem, dtypes, devices) and a plain
    symbolic graph module (a tensor constant, an inf argument)."""
    folder = tmp_path_factory.mktemp("fuzz")
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32, dim=16, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32)
    batch = make_llama_batch(config, [3, 5], generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=4)
    save(trace_train_step(Llama(config), llama_loss, batch, meta), folder / "step.json")

    def fn(x: torch.Tensor) -> torch.Tensor:
        return (x * torch.tensor([1.0, 2.0, 3.0])).clamp(max=float("inf")).sum(0) / x.shape[0]

    save_graph_module(
        make_fx(fn, tracing_mode="symbolic")(torch.randn(4, 3)), folder / "gm.json", meta={"k": [1]}
    )
    return [
        ("train_step", (folder / "step.json").read_bytes(), loads),
        ("graph_module", (folder / "gm.json").read_bytes(), loads_graph_module),
    ]


# ---- random values --------------------------------------------------------------------------------

_STRINGS = ["", "T", "max_seqlen", "$s1", "x", "output", "aten.mm.default", "aten.add.Tensor", "usp.varlen_fwd.default",
            "operator.getitem", "builtins.exec", "os.system", "eval", "aten.from_file.default", "aten.__dict__.default",
            "prims.iota.default", "_c10d_functional.wait_tensor.default", "float32", "cpu", "cuda:0", "tensor", "node",
            "Mul", "placeholder", "call_function", "call_method", "get_attr", "sha256:" + "0" * 64, "é\u0000\ud7ff", "a" * 300,
            "x.py:1 in f", "0"]  # fmt: skip
_INTS = [0, 1, -1, 2, 7, 255, 2**31, 2**62, 2**63, -(2**63), 2**64, 2**200, 10**40]
_FLOATS = [0.5, -0.0, 1e308, -1e-308, 3.0]


def _value(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(12 if depth < 3 else 5)
    if kind == 0:
        return None
    if kind == 1:
        return rng.choice([True, False])
    if kind == 2:
        return rng.choice(_INTS)
    if kind == 3:
        return rng.choice(_FLOATS)
    if kind == 4:
        return rng.choice(_STRINGS)
    if kind == 5:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(4))]
    if kind == 6:
        return {
            "node": rng.choice(
                ["nowhere", "output", "p_tok_embeddings_weight", "in_input_ids", "mm", 3, None]
            )
        }
    if kind == 7:
        tag = rng.choice(["tuple", "float", "dtype", "device", "layout", "memory_format", "slice", "symint", "tensor",
                          "int", "bool", "dict", "list", "nope"])  # fmt: skip
        return {tag: _value(rng, depth + 1)}
    if kind == 8:  # size expressions
        fn = rng.choice(["Add", "Mul", "Pow", "FloorDiv", "Mod", "PythonMod", "Max", "Eq", "Lt", "And", "Not",
                         "Rational", "Sqrt", "ModularIndexing", "CeilDiv"])  # fmt: skip
        return [fn, *(_value(rng, depth + 1) if rng.random() < 0.5 else rng.choice(["T", 2, 0, -3, 64, 10**6])
                      for _ in range(rng.randrange(4)))]  # fmt: skip
    if kind == 9:
        return {"tensor": {"dtype": rng.choice(["float32", "int64", "qint8", "bogus", 1]),
                           "shape": [_value(rng, depth + 1) for _ in range(rng.randrange(3))],
                           "device": rng.choice(["cpu", "cuda:0", "meta", "nope:1", "cpu:99999"])}}  # fmt: skip
    if kind == 10:
        return {rng.choice(_STRINGS): _value(rng, depth + 1) for _ in range(rng.randrange(3))}
    return rng.choice([[1, 2], ["T", 4], {"tuple": []}, {"float": "inf"}, {"dtype": "int32"}])


# ---- mutations ------------------------------------------------------------------------------------


def _paths(x: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix]
    if isinstance(x, dict):
        for k, v in x.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(x, list):
        for i, v in enumerate(x):
            out += _paths(v, (*prefix, i))
    return out


def _get(x: Any, path: tuple) -> Any:
    for p in path:
        x = x[p]
    return x


def _mutate_doc(doc: dict, rng: random.Random) -> str:
    nodes = doc["graph"]["nodes"]
    choice = rng.randrange(8)
    if choice <= 2:  # a node's target / op / name / args / kwargs / meta
        node = rng.choice(nodes)
        field = rng.choice(["target", "op", "name", "args", "args", "kwargs", "meta", "meta"])
        if field == "args" and node.get("args") and rng.random() < 0.7:
            i = rng.randrange(len(node["args"]))
            how = rng.randrange(3)
            if how == 0:
                node["args"][i] = _value(rng)
            elif how == 1:
                del node["args"][i]
            else:
                node["args"].insert(i, _value(rng))
            return f"node {node['name']!r} args[{i}] ({['replaced', 'deleted', 'inserted'][how]})"
        if field == "meta" and isinstance(node.get("meta"), dict) and node["meta"] and rng.random() < 0.7:
            paths = _paths(node["meta"])[1:]
            path = rng.choice(paths)
            parent = _get(node["meta"], path[:-1])
            parent[path[-1]] = _value(rng)
            return f"node {node['name']!r} meta{list(path)}"
        if rng.random() < 0.2:
            node.pop(field, None)
            return f"node {node.get('name')!r} lost {field}"
        node[field] = _value(rng) if rng.random() < 0.6 else rng.choice(_STRINGS)
        return f"node {node.get('name')!r} {field} <- {str(node[field])[:40]}"
    if choice == 3:  # reorder / drop / duplicate nodes
        i, j = rng.randrange(len(nodes)), rng.randrange(len(nodes))
        how = rng.randrange(3)
        if how == 0:
            nodes[i], nodes[j] = nodes[j], nodes[i]
        elif how == 1:
            del nodes[i]
        else:
            nodes.insert(j, copy.deepcopy(nodes[i]))
        return f"nodes {i}, {j} ({['swapped', 'deleted', 'duplicated'][how]})"
    # anywhere in a section: symbols, guards, inputs, world, constants, train_step, meta, versions, ...
    section = rng.choice([k for k in doc if k != "fingerprint"])
    paths = _paths(doc[section])
    path = (section, *rng.choice(paths))
    parent = _get(doc, path[:-1])
    if isinstance(parent, dict) and rng.random() < 0.25:
        del parent[path[-1]]
        return f"deleted {list(path)}"
    if isinstance(parent, list) and rng.random() < 0.25:
        parent.insert(path[-1], _value(rng))
        return f"inserted at {list(path)}"
    parent[path[-1]] = _value(rng)
    return f"replaced {list(path)} <- {str(parent[path[-1]])[:40]}"


def _mutate(data: bytes, rng: random.Random) -> tuple[bytes, str]:
    kind = rng.randrange(10)
    if kind == 0:
        b = bytearray(data)
        flips = [rng.randrange(len(b)) for _ in range(rng.randrange(1, 5))]
        for i in flips:
            b[i] ^= 1 << rng.randrange(8)
        return bytes(b), f"bit flips at {flips}"
    if kind == 1:
        cut = rng.randrange(len(data))
        return data[:cut], f"truncated at {cut}"
    if kind == 2:
        i, j = sorted(rng.randrange(len(data)) for _ in range(2))
        return (data[:i] + data[j:], f"bytes {i}:{j} deleted") if rng.random() < 0.5 else (
            data[:j] + data[i:j] + data[j:], f"bytes {i}:{j} duplicated")  # fmt: skip
    doc = json.loads(data)
    what = "; ".join(_mutate_doc(doc, rng) for _ in range(rng.randrange(1, 3)))
    if rng.random() < 0.9:  # most edits re-fingerprinted, so they reach the checks behind the hash
        try:
            doc["fingerprint"] = fingerprint(doc)
        except ValueError:
            pass
    else:
        what += " (stale fingerprint)"
    return dumps(doc).encode() if rng.random() < 0.8 else json.dumps(doc).encode(), what


@pytest.mark.timeout(600)
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
