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
