"""The usp-graph CLI, run in a subprocess on real graph files (the demo's per-rank CP files).

`_cli` hands each command line to one long-lived CLI process (`_SERVER`: ``usp_graph.cli.main``
with its output captured and SystemExit turned into the exit code, as the console script does), so
the suite pays the torch import once; the demos and ``--help`` run as their own processes
(``python -m usp_graph``), which covers the entry point itself. The two demos start when
collection ends (`tests.background`) and run beside the tests before them.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

import networkx as nx
import pytest

from tests import background
from tests.graph_docs import remove_backward_adjoint

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}
_DEMO = [sys.executable, "-m", "usp_graph", "demo", "--out", "{tmp}"]
_HALO_DEMO = [sys.executable, "-m", "usp_graph", "demo", "--strategy", "halo", "--out", "{tmp}"]

pytestmark = [pytest.mark.slow, pytest.mark.start_early("demo", _DEMO, env=_ENV)]
_REPLY = "\x00usp-cli-reply "  # marks the server's replies among anything else written to stdout

_SERVER = """
import contextlib, io, json, sys, traceback
from usp_graph.cli import main
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(json.loads(line))
        except SystemExit as e:  # argparse: 2 with its usage message already on stderr
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
        except BaseException:  # the console script would print the traceback and exit 1
            traceback.print_exc()
            code = 1
    reply = {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}
    sys.__stdout__.write(PREFIX + json.dumps(reply) + "\\n")
    sys.__stdout__.flush()
"""


class _CliServer:
    def __init__(self) -> None:
        self.proc: subprocess.Popen | None = None

    def _start(self) -> subprocess.Popen:
        code = f"PREFIX = {_REPLY!r}\n" + _SERVER
        return subprocess.Popen(
            [sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL, text=True, env=_ENV, bufsize=1,
        )  # fmt: skip

    def run(self, args: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess:
        if self.proc is None or self.proc.poll() is not None:
            self.proc = self._start()
        proc = self.proc
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(json.dumps(list(args)) + "\n")
        proc.stdin.flush()
        end = time.monotonic() + timeout
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], max(0.0, end - time.monotonic()))
            if not ready:
                self.close()
                raise subprocess.TimeoutExpired(["usp-graph", *args], timeout)
            line = proc.stdout.readline()
            if not line:
                self.close()
                raise RuntimeError(f"the CLI process died running usp-graph {' '.join(args)}")
            if line.startswith(_REPLY):
                r = json.loads(line[len(_REPLY) :])
                return subprocess.CompletedProcess(
                    ["usp-graph", *args], r["returncode"], r["stdout"], r["stderr"]
                )

    def close(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None


_server = _CliServer()


@pytest.fixture(scope="module", autouse=True)
def _cli_server():
    yield
    _server.close()


def _cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """`usp-graph ARGS` in the module's CLI process: exit code, stdout and stderr."""
    return _server.run(args, timeout)


def _own_process(*args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`python -m usp_graph ARGS` as a process of its own."""
    return subprocess.run(
        [sys.executable, "-m", "usp_graph", *args], capture_output=True, text=True, timeout=timeout, env=_ENV
    )


@pytest.fixture(scope="module")
def demo_dir():
    code, output = background.result("demo", _DEMO, timeout=900, env=_ENV)
    assert code == 0, output
    assert "replay == eager, bitwise" in output
    assert output.count("loss and every grad bitwise equal") == 2
    return Path(background.folder("demo"))


def test_demo_prints_progress_and_the_inspect_summary(demo_dir):
    assert os.path.exists(demo_dir / "rank0.uspg") and os.path.exists(demo_dir / "rank1.uspg")
    _, output = background.result("demo", _DEMO, timeout=900, env=_ENV)
    report = demo_dir / "report.html"
    assert f"HTML report (the step as a picture, every rank): {report}" in output
    pictures = report.read_text().count('data-sites="2" data-collectives="16" data-pairs="10"')
    assert pictures == 2  # a section per rank


def test_inspect_json_lists_sites_collectives_and_pairing(demo_dir):
    r = _cli("inspect", str(demo_dir / "rank0.uspg"), "--json", "--values", "T=160")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert [a["strategy"] for a in s["attention"]] == ["ulysses", "ulysses"]
    assert all(a["rewritten"] and a["metadata_reaches"] for a in s["attention"])
    phases = [c["phase"] for c in s["collectives"]]
    assert phases.count("forward") == 8 and phases.count("backward") == 8  # 4 all-to-alls per site each way
    assert all(isinstance(c["bytes_per_rank"], int) and c["bytes_per_rank"] > 0 for c in s["collectives"])
    assert s["unpaired"] == [] and len(s["pairing"]) == 10  # 8 collectives + 2 attention ops
    assert {m["role"] for m in s["metadata"]["inputs"]} == {"cu_seqlens", "max_seqlen"}


def test_inspect_text_dot_and_html(demo_dir, tmp_path):
    import pydot

    dot, page = tmp_path / "g.dot", tmp_path / "g.html"
    r = _cli("inspect", str(demo_dir / "rank0.uspg"), "--dot", str(dot), "--html", str(page))
    assert r.returncode == 0, r.stderr
    assert "Attention sites" in r.stdout and "ulysses" in r.stdout
    (parsed,) = pydot.graph_from_dot_data(dot.read_text())
    g = nx.nx_pydot.from_pydot(parsed)
    assert any("varlen_fwd" in n for n in g.nodes)
    html = page.read_text()
    assert html.startswith("<!doctype html>") and html.count("<script>") == 1  # its own, inline
    assert 'data-sites="2" data-collectives="16" data-pairs="10" data-alarms="0"' in html  # the picture
    for site in ("varlen_fwd", "varlen_fwd_1"):
        assert f"<td>{site}</td>" in html


def test_inspect_a_dump_directory_covers_every_file(demo_dir):
    r = _cli("inspect", str(demo_dir), "--json")
    assert r.returncode == 0, r.stderr
    assert len(json.loads(r.stdout)) == 2


def test_verify_passes_a_good_file(demo_dir):
    r = _cli("verify", str(demo_dir / "rank0.uspg"))
    assert r.returncode == 0, r.stdout + r.stderr
    assert ": ok" in r.stdout


def test_verify_fails_naming_a_removed_backward_collective(demo_dir, tmp_path):
    bad = tmp_path / "no_adjoint.uspg"
    victim = remove_backward_adjoint(demo_dir / "rank0.uspg", bad)
    r = _cli("verify", str(bad))
    assert r.returncode == 1, r.stdout + r.stderr
    assert victim["meta"]["usp_fwd_node"] in r.stdout + r.stderr
    assert "all_to_all" in r.stdout + r.stderr


def test_verify_and_inspect_exit_2_on_a_corrupt_file(demo_dir, tmp_path):
    data = (demo_dir / "rank0.uspg").read_bytes()
    bad = tmp_path / "truncated.uspg"
    bad.write_bytes(data[: len(data) // 2])
    for cmd in ("verify", "inspect"):
        r = _cli(cmd, str(bad))
        assert r.returncode == 2, (cmd, r.stdout, r.stderr)
        assert "usp-graph:" in r.stderr
    assert _cli("inspect", str(tmp_path / "missing.uspg")).returncode == 2


def test_diff_reports_no_change_between_ranks_and_a_change_against_another_graph(demo_dir, tmp_path):
    r = _cli("diff", str(demo_dir / "rank0.uspg"), str(demo_dir / "rank1.uspg"))
    assert r.returncode == 0 and "no differences" in r.stdout, r.stdout + r.stderr
    # another graph: the same model traced in one process (no collectives)
    import torch

    from usp_graph import AttentionMetadata, save, trace_train_step
    from usp_graph.demo import _config
    from usp_graph.models import Llama, llama_loss, make_llama_batch

    config = _config(2)
    batch = make_llama_batch(config, [9, 1, 0, 22], generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=14)
    single = tmp_path / "single.uspg"
    save(trace_train_step(Llama(config), llama_loss, batch, meta), single)
    r = _cli("diff", str(demo_dir / "rank0.uspg"), str(single), "--json")
    d = json.loads(r.stdout)
    assert not d["same"]
    assert d["op_counts"]["usp.all_to_all_start.default"] == {"a": 16, "b": 0}  # issued (overlap pass)
    assert d["op_counts"]["usp.wait.default"] == {"a": 16, "b": 0}
    assert "usp.varlen_fwd.default" not in d["op_counts"]  # two attention sites in both


def test_help_has_examples():
    r = _own_process("--help")
    assert r.returncode == 0 and "examples:" in r.stdout and "usp-graph verify" in r.stdout


def test_every_subcommand_reads_a_torch_compile_dump_dir(tmp_path):
    import torch

    from usp_graph import AttentionMetadata, documents
    from usp_graph.models import Llama, LlamaConfig, make_llama_batch

    config = LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    model = Llama(config)
    batch = make_llama_batch(config, [6, 1, 0, 9], generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=6)
    dump = tmp_path / "dump"
    compiled = torch.compile(model, backend="usp", options={"dump_dir": str(dump)})
    with documents(meta):
        compiled(batch["input_ids"], batch["position_ids"]).sum().backward()
    files = sorted(p.name for p in dump.rglob("*.uspg"))
    assert {"joint.uspg", "forward.uspg", "backward.uspg"} <= set(files), files

    r = _cli("inspect", str(dump), "--json")
    assert r.returncode == 0, r.stderr
    by_file = json.loads(r.stdout)
    fwd = next(s for f, s in by_file.items() if f.endswith("forward.uspg"))
    assert len([a for a in fwd["attention"] if a["rewritten"]]) == config.n_layers
    joint = next(s for f, s in by_file.items() if f.endswith("joint.uspg"))
    assert joint["op_counts"]["usp.varlen_bwd.default"] == config.n_layers
    joint_file = next(str(p) for p in dump.rglob("joint.uspg"))
    r = _cli("verify", joint_file)
    assert r.returncode == 0, r.stdout + r.stderr
    r = _cli("diff", joint_file, joint_file)
    assert r.returncode == 0 and "no differences" in r.stdout


def test_bad_values_argument_is_a_clear_usage_error(demo_dir):
    r = _cli("inspect", str(demo_dir / "rank0.uspg"), "--values", "T=lots")
    assert r.returncode == 2 and "--values expects NAME=INT" in r.stderr, r.stderr


@pytest.mark.start_early("halo_demo", _HALO_DEMO, env=_ENV)
def test_demo_with_the_halo_strategy_replays_bitwise():
    code, output = background.result("halo_demo", _HALO_DEMO, timeout=900, env=_ENV)
    assert code == 0, output
    assert "replay == eager, bitwise" in output
    assert "usp.halo_exchange" in output and "usp.halo_reduce" in output


def test_an_output_path_that_names_an_input_is_refused_before_anything_is_written(tmp_path, capsys):
    from usp_graph.cli import main

    graph = tmp_path / "g.uspg"
    graph.write_bytes(b"not parsed: the paths are checked first")
    os.symlink(graph, tmp_path / "link.dot")
    (tmp_path / "sub").mkdir()
    out = str(tmp_path / "out.html")
    cases = [
        (["inspect", str(graph), "--html", str(graph)], "--html"),
        (["inspect", str(graph), "--dot", str(tmp_path / "sub" / ".." / "g.uspg")], "--dot"),
        (["inspect", str(graph), "--dot", str(tmp_path / "link.dot")], "--dot"),  # a link to it
        (["inspect", str(tmp_path), "--html", str(graph)], "--html"),  # a file of a dump directory
        (["inspect", str(graph), "--html", out, "--dot", out], "--html and --dot name the same file"),
    ]
    for argv, message in cases:
        assert main(argv) == 2, argv
        err = capsys.readouterr().err
        assert err.startswith(f"usp-graph: {message}") and err.count("\n") == 1, (argv, err)
        assert graph.read_bytes() == b"not parsed: the paths are checked first" and not os.path.exists(out)
