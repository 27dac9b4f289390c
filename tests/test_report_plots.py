"""tools/plot_benchmarks.py: result lines in, the three figures out (SVG with their series as text).

The command runs in this process (`main(argv)`), so matplotlib is imported once."""

from __future__ import annotations

import importlib.util
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

pytest.importorskip("matplotlib", reason="plots need matplotlib: pip install 'usp_graph[plot]'")

TOOL = Path(__file__).resolve().parent.parent / "tools" / "plot_benchmarks.py"
_SVG = "{http://www.w3.org/2000/svg}"


def _records() -> list[dict]:
    head = {
        "torch": "2.11.0+cu130",
        "device_name": "NVIDIA H200",
        "date_utc": "2026-11-30",
        "command": "test",
    }
    out = []
    for impl, tflops in (("usp", (250.0, 480.0)), ("torch_varlen", (200.0, 300.0))):
        for shape, t in zip(("16K causal", "64K causal"), tflops, strict=True):
            out.append({**head, "bench": "varlen", "shape": shape, "impl": impl, "tflops_fwd_bwd": t,
                        "settings": {"heads": 16, "kv_heads": 16, "head_dim": 128}})  # fmt: skip
    for world, eff in ((2, 0.9), (4, 0.8)):
        out.append({**head, "bench": "cp", "tokens": 65536, "causal": True, "strategy": "ulysses", "world": world,
                    "efficiency": eff, "ok": True})  # fmt: skip
    for path, ms in (("usp (inductor)", 100.0), ("padded SDPA (inductor)", 250.0)):
        out.append({**head, "bench": "train", "settings": {"model": "llama", "tokens": 32768}, "path": path,
                    "reference": "padded SDPA (inductor)", "ms": ms})  # fmt: skip
    return out


def _texts(svg: Path) -> list[str]:
    return ["".join(t.itertext()) for t in ET.parse(svg).getroot().iter(f"{_SVG}text")]


def _load_tool():
    spec = importlib.util.spec_from_file_location("plot_benchmarks", TOOL)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_tool = _load_tool()


def _run(capsys, *args: str) -> tuple[int, str]:
    """`python tools/plot_benchmarks.py ARGS` in this process (matplotlib imported once): exit
    code and stderr."""
    capsys.readouterr()
    code = _tool.main(list(args))
    return code, capsys.readouterr().err


def test_plot_command_draws_the_three_figures_from_result_lines(tmp_path, capsys):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _records()) + "\n")
    code, err = _run(capsys, str(results), "--out", str(tmp_path / "figs"))
    assert code == 0, err
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["attention_tflops.svg", "cp_efficiency.svg", "train_vs_padded.svg"]
    attn = _texts(tmp_path / "figs" / "attention_tflops.svg")
    assert "usp" in attn and "torch_varlen" in attn and "16K" in attn and "64K" in attn
    assert "ulysses, causal" in _texts(tmp_path / "figs" / "cp_efficiency.svg")
    assert "2.50x faster" in _texts(tmp_path / "figs" / "train_vs_padded.svg")  # 250 ms / 100 ms
    # the same lines give the same files (no date, fixed ids): committed figures stay diffable
    assert _run(capsys, str(results), "--out", str(tmp_path / "again"))[0] == 0
    for name in names:
        assert (tmp_path / "figs" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_a_bad_line_is_an_error_naming_it(tmp_path, capsys):
    results = tmp_path / "bad.jsonl"
    results.write_text(json.dumps(_records()[0]) + "\n{not json\n")
    code, err = _run(capsys, str(results), "--out", str(tmp_path / "figs"))
    assert code == 2 and f"{results}:2: not a JSON line" in err, err


def test_records_of_no_figure_say_what_the_figures_need(tmp_path, capsys):
    results = tmp_path / "other.jsonl"
    results.write_text(json.dumps({"bench": "trace", "seconds": 1.0}) + "\n")
    code, err = _run(capsys, str(results), "--out", str(tmp_path / "figs"))
    assert code == 1 and "no figure to draw: records of bench ['trace']" in err, err


def test_without_matplotlib_the_command_says_how_to_install_it(tmp_path, monkeypatch):
    results = tmp_path / "results.jsonl"
    results.write_text(json.dumps(_records()[0]) + "\n")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an environment without it imports
    with pytest.raises(SystemExit, match=r"needs matplotlib: pip install 'usp_graph\[plot\]'"):
        _tool.main([str(results), "--out", str(tmp_path / "figs")])
    assert not (tmp_path / "figs").exists()
