"""Bounded resources when reading graph files (issue 17, item 3): parsing memory is a bounded
multiple of the file size, size expressions are bounded in nodes, degree, value size and nesting so
loading is polynomial, and the CLI refuses FIFOs and devices and bad ``--values`` instead of hanging
or printing a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tracemalloc

import pytest
import sympy
import torch
from torch import nn
from torch.utils._sympy import functions as tfn

from usp_graph import AttentionMetadata, trace_train_step
from usp_graph.cli import main as cli_main
from usp_graph.graphfile import (
    CorruptGraphFileError,
    GraphFileSchemaError,
    document,
    load,
    load_graph_module,
    save,
)
from usp_graph.graphfile.document import dumps, fingerprint
from usp_graph.graphfile.exprs import ExprDecoder, decode_expr

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ENV = {**os.environ, "PYTHONPATH": REPO + os.pathsep + os.environ.get("PYTHONPATH", "")}


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


@pytest.fixture(scope="module")
def guarded(tmp_path_factory):
    """A tiny traced step whose file records guards on T (T even, T >= 4)."""

    def step(model, batch):
        x = batch["x"]
        return model.lin(x[:4] if x.shape[0] % 2 == 0 else x).sum()

    path = tmp_path_factory.mktemp("limits") / "g.uspg"
    save(trace_train_step(_Tiny(), step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6])), path)
    return path


def _rewrite(src, dst, edit) -> None:
    doc = json.loads(open(src, "rb").read())
    edit(doc)
    doc["fingerprint"] = fingerprint(doc)
    with open(dst, "w") as f:
        f.write(dumps(doc))


def _run(code: str, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    # A hang fails the test (TimeoutExpired) instead of blocking the suite.
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=timeout, env=ENV
    )


# ---- size expressions ---------------------------------------------------------------------------

SYMS = {n: sympy.Symbol(n, integer=True, positive=True) for n in ("T", "a", "b")}


def _decode(data):
    return decode_expr(data, SYMS.__getitem__, "guards[0]")


def test_the_nested_power_guard_of_the_issue_is_refused_at_load_not_evaluated(guarded, tmp_path):
    # The issue's file: still loading after 240 s. Loading runs in a child with a timeout so that a
    # regression fails here instead of hanging the suite.
    bomb = ["Eq", ["Pow", ["Pow", ["Pow", ["Pow", "T", 64], 64], 64], 64], 7]
    _rewrite(guarded, tmp_path / "bomb.uspg", lambda d: d["guards"].__setitem__(0, [bomb, "crafted"]))
    code = (
        "import sys\nfrom usp_graph.graphfile import load, GraphFileSchemaError\n"
        "try:\n    load(sys.argv[1])\nexcept GraphFileSchemaError as e:\n    print('refused:', e)\n"
    )
    r = _run(code, str(tmp_path / "bomb.uspg"))
    assert r.returncode == 0, r.stderr
    assert "refused:" in r.stdout and "degree 4096" in r.stdout and "over the 64" in r.stdout


@pytest.mark.parametrize(
    "data, message",
    [
        (["Pow", ["Pow", "T", 64], 2], r"degree 128 in the symbols, over the 64"),
        (["Mul", *(["T"] * 65)], r"Mul has degree 65"),
        (["Pow", "T", 65], r"exponents must be integer literals within \+-64"),
        (["Pow", "T", ["Add", 1, 1]], r"exponents must be integer literals"),
        (["Mul", ["Pow", 2, 64], *([["Pow", 2**4000, 1]] * 3)], r"could reach \d+-bit values, over the 8192"),
        (["Add", *([1] * 300)], r"more than 256 terms"),
        (["Pow", ["Add", "T", "a", "b"], 8], r"expands to more than 256 terms"),
        (
            ["Mod", ["FloorDiv", ["Mod", ["FloorDiv", ["Max", "T", 1], 2], 3], 4], 5],
            r"nested more than 4 deep",
        ),
    ],
)
def test_size_expressions_over_the_bounds_are_refused_before_sympy_builds_them(data, message):
    with pytest.raises(GraphFileSchemaError, match=message):
        _decode(data)


def test_size_expressions_a_tracer_writes_decode_unchanged():
    T, a = SYMS["T"], SYMS["a"]
    assert _decode(["Eq", ["Mod", "T", 2], 0]) == sympy.Eq(tfn.Mod(T, 2), 0)
    assert _decode(["Mul", 4, ["Pow", "T", 64]]) == 4 * T**64
    assert _decode(["Pow", ["Add", "T", "a"], 7]) == (T + a) ** 7  # 8 terms expanded: fine
    assert _decode(["Mod", ["FloorDiv", ["Mod", ["FloorDiv", "T", 2], 3], 4], 5]) is not None


def test_identical_expressions_decode_once_and_cost_once():
    decoder = ExprDecoder(lambda where: SYMS.__getitem__)
    first = decoder.decode(["FloorDiv", ["Add", "T", "a"], 2], "x")
    for _ in range(10_000):
        assert decoder.decode(["FloorDiv", ["Add", "T", "a"], 2], "y") is first
    assert decoder.work == 5 + 5  # 5 nodes, and the FloorDiv's subtree of 5


def test_a_file_whose_expressions_together_ask_too_much_is_refused():
    decoder = ExprDecoder(lambda where: SYMS.__getitem__)
    big = ["Max", *(["Add", "T", i] for i in range(80))]  # 241 nodes, 482 units; distinct each time
    with pytest.raises(GraphFileSchemaError, match=r"together are over the 8192 units of work"):
        for i in range(100):
            decoder.decode(["Ge", big, i], f"guards[{i}]")
    assert 15 <= i <= 18  # 17 expressions of 482 units fit


def test_loading_counts_every_expression_of_the_file(guarded, tmp_path, monkeypatch):
    from usp_graph.graphfile import exprs

    guards = [[["Ge", ["FloorDiv", ["Add", "T", i], 2], 0], f"g{i}"] for i in range(40)]
    _rewrite(guarded, tmp_path / "many.uspg", lambda d: d["guards"].extend(guards))
    assert load(tmp_path / "many.uspg").graph_module is not None
    monkeypatch.setattr(exprs, "MAX_FILE_WORK", 200)
    with pytest.raises(GraphFileSchemaError, match=r"guards\[\d+\].*together are over the 200 units"):
        load(tmp_path / "many.uspg")


# ---- parsing memory -----------------------------------------------------------------------------


def _peak(fn, *args):
    tracemalloc.start()
    try:
        fn(*args)
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    return peak


def _crafted(base, items: list[str]) -> bytes:
    """`base` with meta = {"x": [items...]} and a valid fingerprint, as compact bytes."""
    doc = json.loads(open(base, "rb").read())
    doc["meta"] = {"x": 0}
    doc["fingerprint"] = "sha256:" + "0" * 64
    text = json.dumps(doc, separators=(",", ":")).replace('"x":0', '"x":[' + ",".join(items) + "]")
    fp = fingerprint(json.loads(text))
    return text.replace("sha256:" + "0" * 64, fp).encode()


def test_a_real_file_parses_in_under_8x_its_size(guarded):
    data = open(guarded, "rb").read() * 1  # a traced file: guards, symbols, nodes with values
    assert document.parse_cost(data) < document.MAX_PARSE_MULTIPLE * len(data)
    assert _peak(document.parse, data) < 8 * len(data) + 2**16


@pytest.mark.parametrize("item", ["[]", "{}", '{"a":0}', "[[[]]]", '"a"', "[0]"])
def test_a_file_of_small_containers_is_refused_before_json_parses_it(guarded, item):
    # Each item costs >= 26x its bytes; 100K of them outweigh the base file wherever it was traced
    # (a short string such as "ab" sits at 21x, too close to the bound to test it).
    data = _crafted(guarded, [item] * 100_000)
    assert document.parse_cost(data) > 1.2 * document.MAX_PARSE_MULTIPLE * len(data)
    with pytest.raises(CorruptGraphFileError, match=r"could take up to .* MiB .*graph files stay under 20x"):
        document.parse(data)
    assert _peak(lambda: pytest.raises(CorruptGraphFileError, document.parse, data)) < 2 * len(data)


@pytest.mark.parametrize(
    "item", ["[]", "{}", '{"a":0}', "[[[]]]", '"ab"', "[0]", "[1.5]", '"\U0001f600"', '{"a":[]}']
)
def test_any_file_that_passes_the_check_parses_within_the_multiple(guarded, item):
    # Pad each shape until the bound admits it: what it then allocates stays under the bound.
    for pad in range(64):
        data = _crafted(guarded, [item + " " * pad] * 5_000)
        if document.parse_cost(data) <= document.MAX_PARSE_MULTIPLE * len(data):
            break
    peak = _peak(document.parse, data)
    assert peak <= document.parse_cost(data) + 2**16
    assert peak <= document.MAX_PARSE_MULTIPLE * len(data)


def test_the_fingerprint_is_hashed_in_pieces_with_the_same_result(guarded):
    import hashlib

    doc = json.loads(open(guarded, "rb").read())
    doc["meta"] = {
        "list": [1.5, "é\U0001f600", None, True, {"b": [], "a": {}}] * 300,
        "z": {str(i): i for i in range(300)},
    }
    assert fingerprint(doc) == "sha256:" + hashlib.sha256(document.canonical_bytes(doc)).hexdigest()


# ---- FIFOs, devices, directories ----------------------------------------------------------------


def test_loading_a_fifo_or_a_device_is_refused_not_waited_on(tmp_path):
    fifo = tmp_path / "pipe.uspg"
    os.mkfifo(fifo)
    code = (
        "import sys\nfrom usp_graph.graphfile import load, load_graph_module, CorruptGraphFileError\n"
        "for path in sys.argv[1:]:\n    for fn in (load, load_graph_module):\n        try:\n"
        "            fn(path)\n        except CorruptGraphFileError as e:\n            print(e)\n"
    )
    r = _run(code, str(fifo), "/dev/zero", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("is a FIFO (named pipe), not a regular file") == 2
    assert r.stdout.count("/dev/zero is a character device, not a regular file") == 2
    assert r.stdout.count("is a directory, not a regular file") == 2


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "usp_graph", *args], capture_output=True, text=True, timeout=300, env=ENV
    )


@pytest.fixture
def fifo_folder(guarded, tmp_path):
    folder = tmp_path / "dump"
    folder.mkdir()
    (folder / "a.uspg").write_bytes(open(guarded, "rb").read())
    os.mkfifo(folder / "b.uspg")
    return folder


def test_usp_graph_inspect_on_a_folder_holding_a_fifo_exits_2_instead_of_hanging(fifo_folder):
    r = _cli("inspect", str(fifo_folder))
    assert r.returncode == 2, (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == [
        f"usp-graph: {fifo_folder / 'b.uspg'} is a FIFO (named pipe), not a regular file: graph files are "
        "regular files"
    ]


# In-process: pytest-timeout's alarm interrupts a blocked open(), so a regression fails, not hangs.
@pytest.mark.timeout(60)
def test_verify_inspect_and_diff_refuse_a_fifo(guarded, fifo_folder, capsys):
    fifo = fifo_folder / "b.uspg"
    for args in (["verify", str(fifo_folder)], ["inspect", str(fifo)], ["diff", str(guarded), str(fifo)]):
        assert cli_main(args) == 2, args
        assert capsys.readouterr().err.splitlines() == [
            f"usp-graph: {fifo} is a FIFO (named pipe), not a regular file: graph files are regular files"
        ]


@pytest.mark.timeout(60)
def test_a_fifo_named_summary_json_is_refused(guarded, tmp_path, capsys):
    (tmp_path / "forward.uspg").write_bytes(open(guarded, "rb").read())
    os.mkfifo(tmp_path / "summary.json")
    assert cli_main(["inspect", str(tmp_path)]) == 2
    assert "summary.json is a FIFO (named pipe), not a regular file" in capsys.readouterr().err


@pytest.mark.parametrize(
    "value, message",
    [
        (
            "T=²",
            r"--values expects NAME=INT with INT a non-negative integer in ASCII digits below 2\*\*63 \(e.g. T=65536\)",
        ),
        ("T=" + "9" * 5000, r"got 'T=9999.*\.\.\. \(5002 characters\)"),
        ("T=-5", r"--values expects NAME=INT with INT a non-negative integer"),
        ("T=9223372036854775808", r"below 2\*\*63"),
        ("T", r"--values expects NAME=INT"),
        ("=5", r"--values expects NAME=INT"),
        ("T=1 2", r"--values expects NAME=INT with INT a non-negative integer"),
    ],
)
def test_bad_values_are_usage_errors_on_one_line(guarded, capsys, value, message):
    assert cli_main(["inspect", str(guarded), "--values", value]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("usp-graph: ")
    assert __import__("re").search(message, err), err


def test_bad_values_exit_2_without_a_traceback_from_the_command_line(guarded):
    r = _cli("inspect", str(guarded), "--values", "T=²", "max_seqlen=" + "1" * 5000)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_good_values_still_evaluate(guarded, capsys):
    assert cli_main(["inspect", str(guarded), "--json", "--values", "T=8", "max_seqlen=8"]) == 0
    assert json.loads(capsys.readouterr().out)


def test_a_loaded_file_within_the_bounds_still_loads(guarded):
    assert load(guarded).graph_module is not None
    assert load_graph_module(guarded).guards
