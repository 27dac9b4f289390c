"""Edits of saved graph files that tests make: a file whose content is changed on purpose (and
re-fingerprinted, so the loader accepts it and the check under test has to find the change)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from usp_graph.graphfile.document import fingerprint

_ALL_TO_ALL = ("usp.all_to_all.default", "usp.all_to_all_start.default")


def remove_backward_adjoint(src: Path, dst: Path) -> dict[str, Any]:
    """Write `src` to `dst` with its first backward all-to-all replaced by a clone of its input (the
    adjoint collective is gone; the data still flows); returns the replaced node's record. An
    issued all-to-all (the overlap pass) loses its wait too (a clone as well)."""
    doc = json.loads(Path(src).read_text())
    nodes = doc["graph"]["nodes"]
    victim = next(
        n for n in nodes if n.get("target") in _ALL_TO_ALL and n["meta"].get("usp_phase") == "backward"
    )
    if victim["target"] == _ALL_TO_ALL[1]:
        for n in nodes:
            if n.get("target") == "usp.wait.default" and n["args"][0] == {"node": victim["name"]}:
                n["target"] = "aten.clone.default"
                n["args"] = n["args"][:1]
    victim["target"] = "aten.clone.default"
    victim["args"] = victim["args"][:1]
    doc["fingerprint"] = fingerprint(doc)
    Path(dst).write_text(json.dumps(doc))
    return victim


def break_first_wait(src: Path, how: str) -> bytes:
    """`src`'s bytes (re-fingerprinted) with its first issued collective's wait broken: "dropped"
    (the wait's readers read the receive buffer instead), "wrong_dim" (another dim), "extra_reader"
    (a clone also reads the receive buffer while it is in flight), "wait_on_tensor" (one more
    wait, of a node that issued nothing)."""
    doc = json.loads(Path(src).read_text())
    nodes = doc["graph"]["nodes"]
    start = next(n for n in nodes if str(n.get("target", "")).endswith("_start.default"))
    i, wait = next(
        (i, n)
        for i, n in enumerate(nodes)
        if n.get("target") == "usp.wait.default" and n["args"][0] == {"node": start["name"]}
    )
    if how == "dropped":
        del nodes[i]
        text = json.dumps(doc).replace(
            json.dumps({"node": wait["name"]}), json.dumps({"node": start["name"]})
        )
        doc = json.loads(text)
    elif how == "wrong_dim":
        wait["args"][1] += 1
    elif how == "extra_reader":
        nodes.insert(i, {"name": "peek", "op": "call_function", "target": "aten.clone.default",
                         "args": [{"node": start["name"]}], "kwargs": {}, "meta": {}})  # fmt: skip
    elif how == "wait_on_tensor":
        nodes.insert(i, {**wait, "name": "stray_wait", "args": [start["args"][0], *wait["args"][1:]]})
    else:
        raise ValueError(how)
    doc["fingerprint"] = fingerprint(doc)
    return json.dumps(doc).encode()
