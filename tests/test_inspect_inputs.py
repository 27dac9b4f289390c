"""`usp-graph inspect` / `verify` / `diff` on files anyone may have written (issue 31): linear time
in the graph's size, a one-line error (exit 2) for any malformed value they read, and text output
that a crafted file cannot use to drive the terminal or print lines of its own.

The files are generated here (tests.big_graphs), not traced: small, and fast to make."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path
from typing import Any

import networkx as nx
import pytest

from tests.big_graphs import deep_ulysses_doc, every_collective_doc, node, refingerprint
from usp_graph import analysis
from usp_graph.cli import main
from usp_graph.graphfile import load_graph_module
from usp_graph.terminal import escape

_COMMANDS = (("inspect",), ("verify",), ("diff",))


def _run(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


def _every_command(capsys, path: Path) -> list[tuple[tuple[str, ...], int, str, str]]:
    results = []
    for cmd in _COMMANDS:
        args = [*cmd, str(path)] if cmd[0] != "diff" else ["diff", str(path), str(path)]
        results.append((cmd, *_run(capsys, *args)))
    return results


def _assert_one_line_error(results, expected: str) -> None:
    for cmd, rc, out, err in results:
        assert rc == 2, (cmd, rc, out, err)
        lines = err.splitlines()
        assert len(lines) == 1 and lines[0].startswith("usp-graph: "), (cmd, err)
        assert expected in lines[0], (cmd, lines[0])
        assert "Traceback" not in out + err


# ---- linear time ---------------------------------------------------------------------------------


def _no_per_site_walks(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("a networkx walk per site: the analysis is one pass over the graph")

    for name in ("descendants", "ancestors", "has_path"):
        monkeypatch.setattr(nx, name, refuse)


def _visits(layers: int) -> tuple[int, int, dict[str, Any]]:
    """(walk visits of one summary, nodes + edges, the summary) of the `layers`-deep file."""
    g = load_graph_module_from(deep_ulysses_doc(layers))
    gm = g.graph_module
    size = sum(1 + len(n.all_input_nodes) for n in gm.graph.nodes)
    analysis.work.clear()
    s = analysis.summarize(gm, symbols=g.symbols, inputs=g.inputs)
    return sum(analysis.work.values()), size, s


def load_graph_module_from(doc: dict[str, Any]) -> Any:
    from usp_graph.graphfile import loads_graph_module

    return loads_graph_module(refingerprint(doc))


def test_the_summary_visits_each_node_and_edge_a_bounded_number_of_times(monkeypatch):
    _no_per_site_walks(monkeypatch)
    small, small_size, _ = _visits(25)
    big, big_size, s = _visits(200)
    # Each walk is one pass in graph order: visits are a fixed multiple of nodes + edges, so 8x
    # the layers is 8x the visits (a walk per collective per site was 8**3 = 512x).
    assert big <= 6 * big_size, (big, big_size)
    assert big / small <= 1.05 * big_size / small_size, (small, big)
    assert {a["strategy"] for a in s["attention"]} == {"ulysses"} and len(s["attention"]) == 200
    assert s["unpaired"] == [] and len(s["pairing"]) == 3 * 200


def test_verify_inspect_and_diff_of_a_deep_file_finish_in_seconds(monkeypatch, tmp_path, capsys):
    # 200 layers, 2000 nodes, ~720 KB: the cubic analysis took 136 s to verify it on 2 loaded cores
    # (issue 31: 268 s for a 428 KB file). The bound here is loose; the visit count above is the check.
    _no_per_site_walks(monkeypatch)
    path = tmp_path / "deep.uspg"
    path.write_bytes(refingerprint(deep_ulysses_doc(200)))
    start = time.monotonic()
    results = _every_command(capsys, path)
    elapsed = time.monotonic() - start
    for cmd, rc, _, err in results:
        assert rc == 0, (cmd, err)
    assert "ok (600 forward ops paired with their backward, 800 collectives)" in results[1][2]
    assert elapsed < 60, f"inspect, verify and diff of 200 layers took {elapsed:.0f} s"


def test_a_collective_feeding_two_sites_counts_for_each_it_feeds_around_the_other():
    """The strategy rule: a collective belongs to every attention op it reaches along a path with
    no other attention op on it; through an attention op it is that op's, not a later one's."""
    doc = deep_ulysses_doc(2)
    # layer 1 also reads layer 0's input all-to-all directly (as a cross-attention's gathered
    # keys would be read by every layer): it still sees that all-to-all
    node(doc, "attn_1")["args"][1] = {"node": "a2a_in_0"}
    s = analysis.summarize(load_graph_module_from(doc).graph_module)
    assert [a["strategy"] for a in s["attention"]] == ["ulysses", "ulysses"]


# ---- malformed values: one line, exit 2 ------------------------------------------------------------


def _set(path: tuple[Any, ...], value: Any):
    def edit(n: dict[str, Any]) -> None:
        target = n
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    "returned, message",
    [({"node": "scattered"}, "returns one value, not a tuple"), ({"tuple": []}, "returns 0 values")],
)
def test_output_names_that_do_not_match_the_outputs_are_a_one_line_error(tmp_path, capsys, returned, message):
    # pairing reads the loss as the first named output: a file whose names do not match raised
    # TypeError / IndexError in pairing before
    doc = every_collective_doc()
    doc["graph"]["meta"]["usp_outputs"] = ["loss"]
    node(doc, "output")["args"] = [returned]
    path = tmp_path / "outputs.uspg"
    path.write_bytes(refingerprint(doc))
    _assert_one_line_error(
        _every_command(capsys, path), "graph.meta.usp_outputs names 1 outputs but the graph " + message
    )


@pytest.mark.parametrize("flag", ["--dot", "--html"])
def test_an_output_path_that_cannot_be_written_is_a_one_line_error(tmp_path, capsys, flag):
    path = tmp_path / "good.uspg"
    path.write_bytes(refingerprint(every_collective_doc()))
    rc, out, err = _run(capsys, "inspect", str(path), flag, str(tmp_path / "no" / "such" / "folder" / "x"))
    _assert_one_line_error([(flag, rc, out, err)], f"{flag} {tmp_path}/no/such/folder/x: cannot write it")


def _to_kwargs(n: dict[str, Any]) -> None:
    names = ["x", "scatter_dim", "gather_dim", "scatter_sizes", "gather_sizes", "group_name"]
    n["kwargs"] = dict(zip(names, n.pop("args"), strict=True))


COLLECTIVE_ARGS = [
    # (node, edit, what the one-line error says)
    ("a2a", _set(("args", 3), []), "scatter_sizes has 0 entries; the group has 2 ranks"),
    ("a2a", _set(("args", 4), [8]), "gather_sizes has 1 entries"),
    ("a2a", _set(("args", 3), [-1, 2]), "scatter_sizes[0] must be a size >= 0"),
    ("a2a", _set(("args", 1), 7), "scatter_dim=7 is out of range for an input of 3 dims"),
    ("a2a_bwd", _set(("args", 2), -4), "gather_dim=-4 is out of range"),
    ("ring", _set(("args", 8), 0), "chunks_per_rank must be an int >= 1, got 0"),
    ("ring", _set(("args", 8), -3), "chunks_per_rank must be an int >= 1, got -3"),
    ("ring", _set(("args", 7), []), "chunk_ids has 0 entries; the ring has 2 ranks x 1 chunks per rank"),
    ("ring", _set(("args", 7), [0, 0]), "chunk_ids must be distinct chunk numbers in [0, 2)"),
    ("ring", _set(("args", 7), [0, 5]), "chunk_ids must be distinct chunk numbers in [0, 2)"),
    ("ring_bwd", _set(("args", 11), 0), "chunks_per_rank must be an int >= 1"),
    ("halo", _set(("args", 1), 0), "dim=0 must name a sequence dim of the input, not the row dim 0"),
    ("halo", _set(("args", 1), 9), "dim=9 is out of range for an input of 4 dims"),
    ("halo", _set(("args", 2), -1), "halo width before must be an int >= 0"),
    ("halo", _set(("args", 2), 100), "a halo of 100 tokens is wider than the 8 tokens of dim 1"),
    ("rows", _set(("meta", "val", "tensor", "shape"), [1, 0, 4, 8]), "wider than the 0 tokens of dim 1"),
    ("halo_bwd", _set(("args", 1), -7), "dim=-7 is out of range"),
    ("gathered", _set(("args", 1), 3), "dim=3 is out of range for an input of 3 dims"),
    ("gathered", _set(("args", 2), 0), "group_size=0"),
    ("scattered", _set(("args", 2), 5), "group_size=5"),
]


@pytest.mark.parametrize(
    "name, edit, message", COLLECTIVE_ARGS, ids=[f"{c[0]}:{c[2][:30]}" for c in COLLECTIVE_ARGS]
)
def test_a_malformed_collective_argument_is_a_one_line_error(tmp_path, capsys, name, edit, message):
    doc = every_collective_doc()
    edit(node(doc, name))
    path = tmp_path / "bad.uspg"
    path.write_bytes(refingerprint(doc))
    _assert_one_line_error(_every_command(capsys, path), message)


def test_collective_arguments_are_read_by_name_so_keywords_mean_the_same(tmp_path, capsys):
    doc = every_collective_doc()
    path = tmp_path / "good.uspg"
    path.write_bytes(refingerprint(doc))
    rc, positional, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    _to_kwargs(node(doc, "a2a"))
    path.write_bytes(refingerprint(doc))
    rc, keywords, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0, err
    (a2a,) = [c for c in json.loads(keywords)["collectives"] if c["node"] == "a2a"]
    assert a2a["bytes_per_rank"] == 512 and a2a["group_size"] == 2
    assert json.loads(keywords)["collectives"] == json.loads(positional)["collectives"]


def _decision() -> dict[str, Any]:
    from usp_graph.cp.auto import Candidate, Decision, Rates

    chosen = Candidate("ulysses", {}, 0.001, 0.002, 4096)
    refused = Candidate("halo", {"max_document_len": 64}, refused="a document is longer than a shard")
    return Decision(chosen, (chosen, refused), Rates(1e-5, 1e9, 1e-12), 2, 1, 128).as_dict()


DECISIONS = [
    (
        ("chosen", "bytes_per_rank"),
        10**400,
        "meta.cp_decision.chosen.bytes_per_rank must be an int in [0, 2**63)",
    ),
    (("candidates", 0, "compute_s"), 10**400, "candidates[0].compute_s must be a finite number >= 0 or null"),
    (("candidates", 0, "comm_s"), -1.0, "candidates[0].comm_s must be a finite number >= 0"),
    (("rates", "bandwidth"), "fast", "rates.bandwidth must be a finite number >= 0"),
    (("world",), "2", "meta.cp_decision.world must be an int in [1, 2**63)"),
    (("steps",), 0, "steps must be an int in [1, 2**63)"),
    (("candidates",), "nope", "candidates must be a list"),
    (("chosen",), 7, "meta.cp_decision.chosen must be an object"),
    (("candidates", 1, "options"), {"a": [1]}, "options['a'] must be a number, text"),
    (("candidates", 1, "refused"), {"a": 1}, "refused must be a reason (text) or null"),
    (("candidates", 1, "strategy"), ["x"], "strategy must be a strategy name"),
    (("rates",), None, "meta.cp_decision.rates must be an object"),
    (("surprise",), 1, "has unknown field(s) ['surprise']"),
]


@pytest.mark.parametrize("where, value, message", DECISIONS, ids=[m[:40] for _, _, m in DECISIONS])
def test_a_malformed_saved_cp_decision_is_a_one_line_error(tmp_path, capsys, where, value, message):
    decision = _decision()
    _set(where, value)(decision)
    doc = every_collective_doc()
    doc["meta"] = {"cp_decision": decision}
    path = tmp_path / "decided.uspg"
    path.write_bytes(refingerprint(doc))
    _assert_one_line_error(_every_command(capsys, path), message)


def test_a_saved_cp_decision_reads_back_as_it_was_written(tmp_path, capsys):
    from usp_graph.cp.auto import decode_decision

    assert decode_decision(_decision()) == _decision()
    doc = every_collective_doc()
    doc["meta"] = {"cp_decision": _decision()}
    path = tmp_path / "decided.uspg"
    path.write_bytes(refingerprint(doc))
    rc, out, err = _run(capsys, "inspect", str(path))
    assert rc == 0, err
    assert "CP strategy chosen by ContextParallel('auto') over 2 ranks" in out
    assert "cannot run: a document is longer than a shard" in out


def _dump(tmp_path: Path, manifest_edit) -> Path:
    """A compile dump folder: forward.uspg (the graph a dump names "g0") and its summary.json."""
    folder = tmp_path / "000_frame0_0"
    folder.mkdir()
    doc = every_collective_doc()
    doc["meta"] = {"compile_dump": "g0", "graph": "forward"}
    (folder / "forward.uspg").write_bytes(refingerprint(doc))
    manifest = {
        "format": "usp_graph.compile_dump",
        "version": 1,
        "graph": "g0",
        "sites": [
            {
                "name": "sdpa",
                "source": "m.py:3 in f",
                "rewritten": False,
                "reason": "dropout",
                "q_shape": ["T", 4, 8],
                "is_causal": True,
            }
        ],  # fmt: skip
        "graph_files": {"forward": {"file": "forward.uspg", "error": None}},
        "failed": {},
    }
    manifest_edit(manifest)
    (folder / "summary.json").write_text(json.dumps(manifest))
    return folder


MANIFESTS = [
    (("sites",), 5, "sites must be a list, got 5"),
    (("sites", 0, "name"), ["x"], "sites[0].name must be a string, got list"),
    (("sites", 0), 7, "sites[0] must be a site record (an object)"),
    (("sites", 0, "rewritten"), "no", "sites[0].rewritten must be true or false"),
    (("sites", 0, "source"), 3, "sites[0].source must be a string or null"),
    (("sites", 0, "reason"), {"x": 1}, "sites[0].reason must be a string or null"),
    (("sites", 0, "q_shape"), 5, "sites[0].q_shape must be a list"),
    (("sites", 0, "q_shape"), [[1]], "sites[0].q_shape[0] must be a size"),
    (("sites", 0, "q_shape"), [10**400], "sites[0].q_shape[0] must be a size"),
    (("sites", 0, "is_causal"), [1], "sites[0].is_causal must be true, false, a text or null"),
    (("failed",), [], "failed must be an object"),
    (("failed",), {"forward.uspg": 5}, "failed['forward.uspg'] must be a string"),
    (("graph_files",), {"forward": 5}, "graph_files['forward'] must be an object"),
    (("graph_files", "forward", "file"), 7, "graph_files['forward'].file must be a string or null"),
    (("graph_files", "forward", "file"), "../x.uspg", "graph_files['forward'].file must be a file name"),
    (("graph_files", "forward", "error"), ["e"], "graph_files['forward'].error must be a string or null"),
    (("graph",), 5, "graph must be a string or null"),
    (("version",), 2, "this usp_graph reads version 1 manifests"),
]


@pytest.mark.parametrize("where, value, message", MANIFESTS, ids=[m[:40] for _, _, m in MANIFESTS])
def test_a_malformed_dump_manifest_is_a_one_line_error(tmp_path, capsys, where, value, message):
    folder = _dump(tmp_path, _set(where, value))
    for args in (["inspect", str(tmp_path)], ["verify", str(tmp_path)], ["inspect", str(folder / "forward.uspg")],
                 ["diff", str(folder / "forward.uspg"), str(folder / "forward.uspg")]):  # fmt: skip
        rc, out, err = _run(capsys, *args)
        _assert_one_line_error([(args, rc, out, err)], message)
        assert "summary.json: not a readable compile dump manifest" in err


def test_a_well_formed_dump_manifest_shows_its_kept_site(tmp_path, capsys):
    _dump(tmp_path, lambda m: None)
    rc, out, err = _run(capsys, "inspect", str(tmp_path))
    assert rc == 0, err
    assert "NOT REWRITTEN: dropout" in out


# ---- text output: escaped -------------------------------------------------------------------------

# Retitles an xterm, clears the screen, returns the cursor, and prints a line that looks like
# verify's; C1 CSI (U+009B) and a right-to-left override as well.
PAYLOAD = "\x1b]0;pwned\x07\x1b[2J\x1b[H\r\nevil.uspg: ok (9 forward ops paired)\n\x9b31m\u202etxt\x00"
_RAW = ("\x1b", "\x07", "\r", "\x9b", "\u202e", "\x00")


def _assert_escaped(text: str) -> None:
    assert not any(c in text for c in _RAW), repr(text)
    assert not any(line.startswith("evil.uspg") for line in text.splitlines()), text


def test_escape_writes_every_unprintable_character_as_its_escape():
    assert escape("plain name_1 (T, 4) é 中") == "plain name_1 (T, 4) é 中"
    assert escape("\x1b[2J\r\n\t\x7f\x9b\u2028\u202e\x00") == "\\x1b[2J\\r\\n\\t\\x7f\\x9b\\u2028\\u202e\\x00"
    assert escape(PAYLOAD).isprintable()


def test_a_crafted_file_cannot_drive_the_terminal_or_fake_a_line(tmp_path, capsys):
    doc = every_collective_doc()
    ring = node(doc, "ring")
    ring["meta"].update(usp_site=PAYLOAD, usp_source=PAYLOAD, source="\x1b]0;x\x07m.py:1 in f")
    decision = _decision()
    decision["candidates"][1]["refused"] = PAYLOAD
    decision["candidates"][1]["strategy"] = PAYLOAD
    doc["meta"] = {"cp_decision": decision}
    doc["versions"]["torch"] = PAYLOAD  # quoted by the version warning
    path = tmp_path / "crafted.uspg"
    path.write_bytes(refingerprint(doc))
    for cmd, rc, out, err in _every_command(capsys, path):
        assert rc == 0, (cmd, err)
        _assert_escaped(out + err)
    rc, out, err = _run(capsys, "inspect", str(path), "--json")
    assert rc == 0 and json.loads(out)["attention"][0]["source"] == PAYLOAD  # JSON keeps it, escaped
    _assert_escaped(out + err)
    rc, out, err = _run(capsys, "inspect", str(path))
    assert "\\x1b]0;pwned\\x07" in out and "GraphFileVersionWarning" in err


def test_a_crafted_dump_and_refusals_quoting_it_are_escaped(tmp_path, capsys):
    def edit(m: dict[str, Any]) -> None:
        m["sites"][0].update(name=PAYLOAD, source=PAYLOAD, reason=PAYLOAD)
        m["failed"] = {"joint.uspg": PAYLOAD}

    _dump(tmp_path, edit)
    for args in (["inspect", str(tmp_path)], ["verify", str(tmp_path)]):
        rc, out, err = _run(capsys, *args)
        assert rc == 1, (args, err)  # the dump says a file was not written
        _assert_escaped(out + err)
        assert "FAILED" in out
    # a refusal quoting the file (an unknown version key) is one escaped line
    doc = every_collective_doc()
    doc["versions"][PAYLOAD] = 5
    path = tmp_path / "refused.uspg"
    path.write_bytes(refingerprint(doc))
    for cmd, rc, out, err in _every_command(capsys, path):
        assert rc == 2 and len(err.splitlines()) == 1, (cmd, err)
        _assert_escaped(out + err)


def test_a_file_name_with_a_newline_cannot_fake_a_verify_line(tmp_path, capsys):
    folder = tmp_path / "dump"
    folder.mkdir()
    doc = every_collective_doc()
    (folder / "x\nevil.uspg: ok (9 forward ops paired)\n.uspg").write_bytes(refingerprint(copy.deepcopy(doc)))
    rc, out, err = _run(capsys, "verify", str(folder))
    assert rc == 0, err
    assert len(out.splitlines()) == 1 and "\\nevil.uspg: ok" in out
    _assert_escaped(out + err)


def test_load_still_reads_every_generated_file():
    # the fixtures themselves are well-formed graph files (a broken generator would make every
    # refusal above vacuous)
    for doc in (every_collective_doc(), deep_ulysses_doc(3)):
        g = load_graph_module(_write_tmp(doc))
        assert g.kind == "graph_module"


def _write_tmp(doc: dict[str, Any]) -> str:
    import tempfile

    fd, path = tempfile.mkstemp(suffix=".uspg")
    with open(fd, "wb") as fh:
        fh.write(refingerprint(doc))
    return path
