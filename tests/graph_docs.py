"""Edits of saved graph files that tests make: a file whose content is changed on purpose (and
re-fingerprinted, so the loader accepts it and the check under test has to find the change)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from usp_graph.graphfile.document import fingerprint


def remove_backward_adjoint(src: Path, dst: Path) -> dict[str, Any]:
    """Write `src` to `dst` with its first backward all-to-all replaced by a clone of its input (the
    adjoint collective is gone; the data still flows); returns the replaced node's record."""
    doc = json.loads(Path(src).read_text())
    victim = next(
        n
        for n in doc["graph"]["nodes"]
        if n.get("target") == "usp.all_to_all.default" and n["meta"].get("usp_phase") == "backward"
    )
    victim["target"] = "aten.clone.default"
    victim["args"] = victim["args"][:1]
    doc["fingerprint"] = fingerprint(doc)
    Path(dst).write_text(json.dumps(doc))
    return victim
