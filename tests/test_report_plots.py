"""tools/plot_benchmarks.py: result lines in, the three figures out (SVG with their series as text)."""

from __future__ import annotations

import json
import subprocess
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


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(TOOL), *args], capture_output=True, text=True, timeout=120)


def test_plot_command_draws_the_three_figures_from_result_lines(tmp_path):
    results = tmp_path / "results.jsonl"
    results.write_text("".join(json.dumps(r) + "\n" for r in _records()) + "\n")
    r = _run(str(results), "--out", str(tmp_path / "figs"))
    assert r.returncode == 0, r.stderr
    names = sorted(p.name for p in (tmp_path / "figs").iterdir())
    assert names == ["attention_tflops.svg", "cp_efficiency.svg", "train_vs_padded.svg"]
    attn = _texts(tmp_path / "figs" / "attention_tflops.svg")
    assert "usp" in attn and "torch_varlen" in attn and "16K" in attn and "64K" in attn
    assert "ulysses, causal" in _texts(tmp_path / "figs" / "cp_efficiency.svg")
    assert "2.50x faster" in _texts(tmp_path / "figs" / "train_vs_padded.svg")  # 250 ms / 100 ms
    # the same lines give the same files (no date, fixed ids): committed figures stay diffable
    assert _run(str(results), "--out", str(tmp_path / "again")).returncode == 0
    for name in names:
        assert (tmp_path / "figs" / name).read_bytes() == (tmp_path / "again" / name).read_bytes()


def test_a_bad_line_is_an_error_naming_it(tmp_path):
    results = tmp_path / "bad.jsonl"
    results.write_text(json.dumps(_records()[0]) + "\n{not json\n")
    r = _run(str(results), "--out", str(tmp_path / "figs"))
    assert r.returncode == 2 and f"{results}:2: not a JSON line" in r.stderr, r.stderr


def test_records_of_no_figure_say_what_the_figures_need(tmp_path):
    results = tmp_path / "other.jsonl"
    results.write_text(json.dumps({"bench": "trace", "seconds": 1.0}) + "\n")
    r = _run(str(results), "--out", str(tmp_path / "figs"))
    assert r.returncode == 1 and "no figure to draw: records of bench ['trace']" in r.stderr, r.stderr
