"""Graphs the report tests draw, traced once per session and shared by tests/test_report*.py.

`ulysses_graph_file()`: the demo's 2-layer Llama-style train step, CP "ulysses" over 2 ranks, as
rank 0 traces it, saved as a graph file. Tracing runs on fake tensors, so rank 0 traces alone
here: torch's fake process group (world size 2) stands in for the other rank, which tracing never
talks to; the graph is the one a real rank 0 saves (the demo's own runs are in tests/test_cli.py).

`parse(page)` and `boxes(parsed, **data)` read a report page's elements back.
"""

from __future__ import annotations

import atexit
import functools
import shutil
import tempfile
from html.parser import HTMLParser
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from usp_graph import save, trace_train_step

_DIR = Path(tempfile.mkdtemp(prefix="usp_report_graphs_"))
atexit.register(shutil.rmtree, _DIR, ignore_errors=True)


def ulysses_graph_file() -> Path:
    """Rank 0's graph file of the demo's train step (2 attention sites, 16 all-to-alls)."""
    return cp_graph_file("ulysses")


@functools.cache
def cp_graph_file(strategy: str) -> Path:
    """Rank 0's graph file of the demo's train step under CP `strategy` over 2 ranks."""
    from usp_graph.demo import _batch, _config, _cp, _lengths, _make_step
    from usp_graph.models import Llama

    try:
        from torch.testing._internal.distributed.fake_pg import FakeStore
    except ImportError as e:  # torch moved its test helper
        pytest.skip(f"torch's fake process group is not importable ({e}); cannot trace rank 0 alone")
    if dist.is_initialized():
        pytest.skip("a process group is already initialized in this process; rank 0 is traced in a fresh one")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=2)
    try:
        cp = _cp(strategy)
        config = _config(2)
        torch.manual_seed(0)
        model = Llama(config)
        local, meta = _batch(config, _lengths(0, 6, 128), 0, cp, 14)
        graph = trace_train_step(model, _make_step(cp), local, meta, cp=cp)
        path = _DIR / f"{strategy}_rank0.uspg"
        save(graph, path)  # the file records the groups' ranks, read from the process group
    finally:
        dist.destroy_process_group()
    return path


class _Elements(HTMLParser):
    """Every start tag's (tag, attributes) and the page's script and text."""

    def __init__(self) -> None:
        super().__init__()
        self.elements: list[tuple[str, dict[str, str]]] = []
        self.scripts: list[str] = []
        self._in_script = False

    def handle_starttag(self, tag, attrs):
        self.elements.append((tag, {k: v or "" for k, v in attrs}))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)


def parse(page: str) -> _Elements:
    p = _Elements()
    p.feed(page)
    return p


def boxes(p: _Elements, **match: str) -> list[dict[str, str]]:
    """The picture's event boxes (``<g class="ev ...">``) whose data-* attributes match."""
    out = []
    for tag, a in p.elements:
        if tag == "g" and a.get("class", "").split()[:1] == ["ev"]:
            if all(a.get(f"data-{k.replace('_', '-')}") == v for k, v in match.items()):
                out.append(a)
    return out
