"""Large graph files generated in the test, for inspect/verify/diff scaling (issue 31).

`deep_ulysses_doc(layers)`: a graph file (kind graph_module) shaped like a Ulysses CP train step
`layers` deep: per layer a forward all-to-all into an attention op, an all-to-all back and a
residual add (so every collective of every earlier layer is upstream of every later attention op,
the case that made the strategy analysis cubic), then the backward: each forward op's adjoint or
backward op, tagged with the forward node it differentiates. Written directly as JSON (no trace),
so a 1000-layer file takes well under a second to make.
"""

from __future__ import annotations

import json
import platform
from typing import Any

import torch

from usp_graph import __version__ as usp_version
from usp_graph.graphfile.document import FORMAT, FORMAT_VERSION, dumps, fingerprint

T, H, K, P = 8, 4, 8, 2  # local tokens, heads, head dim, ranks


def _t(*shape: Any, dtype: str = "float32") -> dict[str, Any]:
    return {"tensor": {"dtype": dtype, "shape": list(shape), "device": "cpu"}}


def _ref(name: str) -> dict[str, str]:
    return {"node": name}


def deep_ulysses_doc(layers: int) -> dict[str, Any]:
    nodes: list[dict[str, Any]] = []

    def call(name: str, target: str, args: list[Any], val: Any, phase: str, fwd: str | None = None,
             site: str | None = None) -> str:  # fmt: skip
        meta: dict[str, Any] = {"usp_phase": phase, "usp_pass": "generated", "val": val}
        if fwd:
            meta["usp_fwd_node"] = fwd
        if site:
            meta["usp_site"] = site
        nodes.append({"name": name, "op": "call_function", "target": target, "args": args, "meta": meta})
        return name

    heads = _t(T * P, H // P, K)
    tokens = _t(T, H, K)
    nodes += [
        {"name": "x", "op": "placeholder", "meta": {"val": tokens}},
        {"name": "cu_seqlens", "op": "placeholder", "meta": {"val": _t(5, dtype="int32")}},
        {"name": "max_seqlen", "op": "placeholder", "meta": {"val": {"symint": "max_seqlen"}}},
    ]
    a2a = "usp.all_to_all.default"
    h = "x"
    saved = []
    for i in range(layers):
        site = f"sdpa_{i}"
        q = call(f"a2a_in_{i}", a2a, [_ref(h), 1, 0, [H // P] * P, [T] * P, "0"], heads, "forward", site=site)
        attn = call(f"attn_{i}", "usp.varlen_fwd.default",
                    [_ref(q), _ref(q), _ref(q), _ref("cu_seqlens"), _ref("cu_seqlens"), _ref("max_seqlen"),
                     _ref("max_seqlen"), True, 0.35], [heads, _t(H // P, T * P)], "forward", site=site)  # fmt: skip
        out = call(f"out_{i}", "operator.getitem", [_ref(attn), 0], heads, "forward", site=site)
        lse = call(f"lse_{i}", "operator.getitem", [_ref(attn), 1], _t(H // P, T * P), "forward", site=site)
        back = call(f"a2a_out_{i}", a2a, [_ref(out), 0, 1, [T] * P, [H // P] * P, "0"], tokens, "forward",
                    site=site)  # fmt: skip
        h = call(f"h_{i}", "aten.add.Tensor", [_ref(h), _ref(back)], tokens, "forward")
        saved.append((q, attn, out, lse, back))
    grads = []
    g = h
    for i, (q, attn, out, lse, back) in reversed(list(enumerate(saved))):
        site = f"sdpa_{i}"
        dout = call(f"d_a2a_out_{i}", a2a, [_ref(g), 1, 0, [H // P] * P, [T] * P, "0"], heads, "backward",
                    fwd=back, site=site)  # fmt: skip
        bwd = call(f"attn_bwd_{i}", "usp.varlen_bwd.default",
                   [_ref(dout), _ref(q), _ref(q), _ref(q), _ref(out), _ref(lse), _ref("cu_seqlens"),
                    _ref("cu_seqlens"), _ref("max_seqlen"), _ref("max_seqlen"), True, 0.35],
                   [heads, heads, heads], "backward", fwd=attn, site=site)  # fmt: skip
        dq = call(f"dq_{i}", "operator.getitem", [_ref(bwd), 0], heads, "backward", site=site)
        g = call(f"d_a2a_in_{i}", a2a, [_ref(dq), 0, 1, [T] * P, [H // P] * P, "0"], tokens, "backward",
                 fwd=q, site=site)  # fmt: skip
        grads.append(g)
    nodes.append({"name": "output", "op": "output", "args": [{"tuple": [_ref(h), *map(_ref, grads)]}]})
    doc: dict[str, Any] = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "kind": "graph_module",
        "versions": {
            "torch": torch.__version__,
            "usp_graph": usp_version,
            "python": platform.python_version(),
        },
        "symbols": {"max_seqlen": {"hint": 64, "min": 0, "max": None}},
        "guards": [],
        "inputs": [
            {
                "node": "x",
                "name": "x",
                "role": "batch",
                "kind": "tensor",
                "dtype": "float32",
                "shape": [T, H, K],
                "device": "cpu",
            },
            {
                "node": "cu_seqlens",
                "name": "cu_seqlens",
                "role": "metadata",
                "kind": "tensor",
                "dtype": "int32",
                "shape": [5],
                "device": "cpu",
            },
            {
                "node": "max_seqlen",
                "name": "max_seqlen",
                "role": "metadata",
                "kind": "symint",
                "value": "max_seqlen",
            },
        ],  # fmt: skip
        "world": {"size": P, "rank": 0, "groups": [{"name": "0", "ranks": list(range(P))}]},
        "graph": {"nodes": nodes, "meta": {}},
        "constants": {},
        "meta": {},
    }
    doc["fingerprint"] = fingerprint(doc)
    return doc


def deep_ulysses_bytes(layers: int) -> bytes:
    return dumps(deep_ulysses_doc(layers)).encode()


def refingerprint(doc: dict[str, Any]) -> bytes:
    """`doc` (edited) as file bytes, with its fingerprint recomputed so the loader accepts it."""
    doc = json.loads(json.dumps(doc))
    doc["fingerprint"] = fingerprint(doc)
    return dumps(doc).encode()


def every_collective_doc() -> dict[str, Any]:
    """A small graph file (kind graph_module, 2 ranks) with one of every usp collective form the
    inspector reads arguments of: all_gather / reduce_scatter, ring attention forward and backward,
    halo exchange / reduce and all_to_all, each forward op with its backward tagged; it verifies.
    Tests edit one argument at a time (`refingerprint`)."""
    nodes: list[dict[str, Any]] = []

    def call(name: str, target: str, args: list[Any], val: Any, phase: str, fwd: str | None = None) -> None:
        meta: dict[str, Any] = {"usp_phase": phase, "usp_pass": "generated", "val": val}
        if fwd:
            meta["usp_fwd_node"] = fwd
        nodes.append({"name": name, "op": "call_function", "target": target, "args": args, "meta": meta})

    tokens, rows = _t(T, H, K), _t(1, T, H, K)
    cu, m = _ref("cu_seqlens"), _ref("max_seqlen")
    nodes += [
        {"name": "x", "op": "placeholder", "meta": {"val": tokens}},
        {"name": "cu_seqlens", "op": "placeholder", "meta": {"val": _t(5, dtype="int32")}},
        {"name": "max_seqlen", "op": "placeholder", "meta": {"val": {"symint": "max_seqlen"}}},
    ]
    call("gathered", "usp.all_gather.default", [_ref("x"), 0, P, "0"], _t(T * P, H, K), "forward")
    call("ring", "usp.ring_attn_fwd.default", [_ref("x"), _ref("x"), _ref("x"), cu, m, True, 0.35, [0, 1], 1, "0"],
         [tokens, _t(H, T)], "forward")  # fmt: skip
    call("ring_out", "operator.getitem", [_ref("ring"), 0], tokens, "forward")
    call("ring_lse", "operator.getitem", [_ref("ring"), 1], _t(H, T), "forward")
    call("rows", "aten.unsqueeze.default", [_ref("x"), 0], rows, "forward")
    call("halo", "usp.halo_exchange.default", [_ref("rows"), 1, 2, 0, m, "0"], _t(1, T + 2, H, K), "forward")
    call("a2a", "usp.all_to_all.default", [_ref("x"), 1, 0, [H // P] * P, [T] * P, "0"], _t(T * P, H // P, K),
         "forward")  # fmt: skip
    call(
        "scattered",
        "usp.reduce_scatter.default",
        [_ref("gathered"), 0, P, "0"],
        tokens,
        "backward",
        "gathered",
    )
    call("ring_bwd", "usp.ring_attn_bwd.default",
         [_ref("ring_out"), _ref("x"), _ref("x"), _ref("x"), _ref("ring_out"), _ref("ring_lse"), cu, m, True, 0.35,
          [0, 1], 1, "0"], [tokens, tokens, tokens], "backward", "ring")  # fmt: skip
    call("halo_bwd", "usp.halo_reduce.default", [_ref("halo"), 1, 2, 0, "0"], rows, "backward", "halo")
    call("a2a_bwd", "usp.all_to_all.default", [_ref("a2a"), 0, 1, [T] * P, [H // P] * P, "0"], tokens, "backward",
         "a2a")  # fmt: skip
    outs = ["scattered", "ring_bwd", "halo_bwd", "a2a_bwd"]
    nodes.append({"name": "output", "op": "output", "args": [{"tuple": [_ref(n) for n in outs]}]})
    doc = deep_ulysses_doc(1)
    doc["graph"]["nodes"] = nodes
    doc["fingerprint"] = fingerprint(doc)
    return doc


def node(doc: dict[str, Any], name: str) -> dict[str, Any]:
    """The node record called `name` in `doc`."""
    return next(n for n in doc["graph"]["nodes"] if n["name"] == name)
