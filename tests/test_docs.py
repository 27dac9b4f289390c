"""The README and the guides under docs/ say what runs, and it runs as written.

Every ```python block of README.md and docs/*.md is run on the CPU, in a fresh namespace, in a
temporary working directory (blocks write graph files and trainer output there). A block that
cannot run here says why on its first line, ``# not run: <reason>``; a block that needs ranks
starts with ``# run with: torchrun --nproc-per-node N`` and runs under torchrun. Links between the
documents (and to docs/figures) must resolve, anchors included.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [
    ROOT / "README.md",
    ROOT / "CHANGELOG.md",
    ROOT / "BENCHMARKS.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
NOT_RUN = re.compile(r"^# not run: (\S.*)$")
TORCHRUN = re.compile(r"^# run with: torchrun --nproc-per-node (\d+)$")
README_MAX_LINES = 300


@dataclass(frozen=True)
class Block:
    path: Path
    line: int  # of the opening fence
    code: str

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def first_line(self) -> str:
        return self.code.split("\n", 1)[0]


def _blocks() -> list[Block]:
    blocks = []
    for path in DOCUMENTS:
        text = path.read_text()
        for m in FENCE.finditer(text):
            blocks.append(Block(path, text.count("\n", 0, m.start()) + 1, m.group(1)))
    return blocks


BLOCKS = _blocks()
RUN = [b for b in BLOCKS if not NOT_RUN.match(b.first_line) and not TORCHRUN.match(b.first_line)]
RANKS = [b for b in BLOCKS if TORCHRUN.match(b.first_line)]


def test_the_docs_hold_python_blocks_and_most_of_them_run():
    # A guard against an extraction that silently finds nothing (a changed fence, a moved file).
    assert len(BLOCKS) >= 10, [b.name for b in BLOCKS]
    assert len(RUN) >= len(BLOCKS) // 2, [b.name for b in BLOCKS if b not in RUN]


def test_every_block_that_is_not_run_says_why():
    for block in BLOCKS:
        first = block.first_line
        if first.lower().lstrip("# ").startswith(("not run", "skip", "no run", "run with")):
            assert NOT_RUN.match(first) or TORCHRUN.match(first), (
                f"{block.name}: a block that is not run starts with '# not run: <reason>' "
                f"or '# run with: torchrun --nproc-per-node N', got {first!r}"
            )


@pytest.mark.slow  # seconds each: imports, compiles, a trainer
@pytest.mark.parametrize("block", RUN, ids=[b.name for b in RUN])
def test_a_python_block_of_the_docs_runs_as_written(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    torch._dynamo.reset()  # every block compiles from scratch, as in a fresh process
    state = torch.random.get_rng_state()
    try:
        exec(compile(block.code, block.name, "exec"), {"__name__": "__main__"})
    finally:
        torch.random.set_rng_state(state)
        torch._dynamo.reset()


@pytest.mark.slow
@pytest.mark.parametrize("block", RANKS, ids=[b.name for b in RANKS])
def test_a_python_block_for_ranks_runs_under_torchrun(block, tmp_path):
    ranks = TORCHRUN.match(block.first_line).group(1)
    script = tmp_path / "block.py"
    script.write_text(block.code)
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node",
        ranks,
        str(script),
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=tmp_path)
    assert done.returncode == 0, f"{block.name}:\n{done.stdout[-3000:]}\n{done.stderr[-6000:]}"


LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def _anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    anchors = set()
    for line in path.read_text().splitlines():
        if line.startswith("#") and not line.startswith("#!"):
            title = line.lstrip("#").strip().lower()
            anchors.add(re.sub(r"[^\w\- ]", "", title).replace(" ", "-"))
    return anchors


def _prose(text: str) -> str:
    """The text outside fenced blocks (a link in a code block is code)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("path", DOCUMENTS, ids=[str(p.relative_to(ROOT)) for p in DOCUMENTS])
def test_every_link_between_the_docs_resolves(path):
    for target in LINK.findall(_prose(path.read_text())):
        if re.match(r"^[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        resolved = (path.parent / file).resolve() if file else path
        assert resolved.exists(), f"{path.relative_to(ROOT)}: link to {target!r}: no such file"
        if anchor and resolved.suffix == ".md":
            assert anchor in _anchors(resolved), (
                f"{path.relative_to(ROOT)}: link to {target!r}: no such heading"
            )


def test_the_readme_is_a_front_door():
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= README_MAX_LINES, f"README.md has {len(lines)} lines; the depth belongs in docs/"


def test_every_guide_is_linked_from_the_readme():
    readme = (ROOT / "README.md").read_text()
    for guide in sorted((ROOT / "docs").glob("*.md")):
        assert f"(docs/{guide.name})" in readme, f"docs/{guide.name} is not linked from README.md"


def test_the_readme_quickstart_is_what_ci_runs():
    readme, ci = (ROOT / "README.md").read_text(), (ROOT / ".ci" / "run").read_text()
    assert 'pip install torch==2.13.0 -e ".[test]" && usp-graph demo\npython -m pytest -q\n' in readme
    for command in ('pip install -q torch==2.13.0 -e ".[test]"', "usp_graph demo", "python -m pytest -q"):
        assert command in ci, f".ci/run no longer runs {command!r}: the README's quickstart says it does"
