"""The HTML report opened in a real browser: headless Chromium draws it and runs its script.

The page is ``usp-graph inspect FILE --html`` of rank 0's graph file of the demo's Ulysses step
(`tests.report_graphs`). Chromium takes a screenshot (the picture must be there in its colours)
and dumps the DOM after the page's script ran (the script marks the page ready, links every pair
to its two boxes, shows a node's details as a click would, and records any error it hits).
CI installs Debian's ``chromium`` package (.ci/run); without it these tests skip.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.report_graphs import boxes, parse, ulysses_graph_file
from usp_graph import cli
from usp_graph.report_view import _COLORS

_BROWSER = next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)), None)
pytestmark = pytest.mark.skipif(
    _BROWSER is None, reason="no chromium on PATH (Debian: apt-get install chromium; .ci/run installs it)"
)


def _chromium(*args: str, home: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    # --no-sandbox: CI runs as root, where Chromium's sandbox refuses to start
    cmd = [_BROWSER, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", *args]
    env = {**os.environ, "HOME": str(home)}  # its profile goes to a temporary folder
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("browser") / "report.html"
    assert cli.main(["inspect", str(ulysses_graph_file()), "--html", str(out), "--values", "T=64"]) == 0
    return out


def test_the_screenshot_shows_the_picture(page, tmp_path):
    Image = pytest.importorskip("PIL.Image", reason="pillow (matplotlib's dependency) reads the screenshot")

    shot = tmp_path / "shot.png"
    r = _chromium(f"--screenshot={shot}", "--window-size=1400,1000", page.as_uri(), home=tmp_path)
    assert shot.exists(), r.stderr[-2000:]
    img = Image.open(shot).convert("RGB")
    assert img.size == (1400, 1000)
    colors = img.getcolors(maxcolors=1 << 20)
    count = {rgb: n for n, rgb in colors}
    assert len(count) > 50  # not blank

    def pixels(hex_color: str) -> int:
        return count.get(tuple(int(hex_color[i : i + 2], 16) for i in (1, 3, 5)), 0)

    # the all-to-all boxes and the attention boxes, each tens of pixels square, in the first screen
    assert pixels(_COLORS["all_to_all"]) > 16 * 40 * 40
    assert pixels(_COLORS["varlen_fwd"]) > 2 * 40 * 40 and pixels(_COLORS["varlen_bwd"]) > 2 * 40 * 40


def test_the_script_runs_without_errors_links_every_pair_and_shows_a_node(page, tmp_path):
    r = _chromium("--virtual-time-budget=3000", "--dump-dom", page.as_uri() + "#show=g0:all_to_all_3_start",
                  home=tmp_path)  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    dom = parse(r.stdout)
    (root,) = [a for tag, a in dom.elements if tag == "html"]
    assert "data-script-errors" not in root, root["data-script-errors"]
    assert root.get("data-script-ready") == "1"
    assert root.get("data-pairs-linked") == "10"
    assert len(boxes(dom, kind="collective")) == 16 and len(boxes(dom, kind="attention")) == 4
    (info,) = [a for tag, a in dom.elements if a.get("class") == "info"]
    assert info.get("data-shown") == "all_to_all_3_start" and "hidden" not in info
    assert "source: " in r.stdout and "llama.py:120 in forward" in r.stdout
    assert "sel" in boxes(dom, node="all_to_all_3_start")[0]["class"].split()


def test_a_script_error_is_recorded_where_the_test_reads_it(page, tmp_path):
    broken = tmp_path / "broken.html"
    broken.write_text(page.read_text() + "<script>undefined_function_of_the_page();</script>")
    r = _chromium("--virtual-time-budget=3000", "--dump-dom", broken.as_uri(), home=tmp_path)
    (root,) = [a for tag, a in parse(r.stdout).elements if tag == "html"]
    assert "undefined_function_of_the_page" in root.get("data-script-errors", ""), r.stdout[:300]
