"""Draw the figures BENCHMARKS.md quotes from benchmark result lines (JSON lines, `harness.Results`).

    python tools/plot_benchmarks.py tools/results/benchmarks.jsonl --out docs/figures
    python tools/plot_benchmarks.py $OUT/bench.jsonl --out /tmp/figs --format png

Figures (each drawn when its records are there; the file names are fixed so docs can link them):
- ``attention_tflops.svg``: attention fwd+bwd TFLOP/s per kernel vs tokens, bidirectional and
  causal (``bench == "varlen"``, one head configuration: ``--config``, default MHA 16 K=128).
- ``cp_efficiency.svg``: context-parallel scaling efficiency vs GPUs, per strategy: one attention
  call (``bench == "cp"``, the largest token count) and the train step (``bench == "train_cp"``,
  one line per strategy and attention kernel).
- ``train_vs_padded.svg``: train-step time of usp vs padded SDPA per model (``bench == "train"``
  records of paths measured against a padded reference).

matplotlib is optional (``pip install 'usp_graph[plot]'``) and imported only here. The SVGs carry
no date and fixed ids, so the same records give the same files.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from collections import defaultdict
from pathlib import Path
from typing import Any

FIGURES = ("attention_tflops", "cp_efficiency", "train_vs_padded")
DEFAULT_CONFIG = "MHA 16 K=128"
_SHAPE = re.compile(r"(?P<n>[0-9]+)(?P<k>K?) (?P<mode>bi|causal)")
# one colour per kernel / strategy across figures
_IMPL_ORDER = ("usp", "usp_cudnn", "usp_flash", "usp_flex", "cudnn_raw", "torch_varlen", "flex", "flex_step",
               "dense_sdpa", "padded_sdpa")  # fmt: skip


class PlotError(ValueError):
    """Unusable input: the message says what to fix."""


def _matplotlib():
    try:
        import matplotlib
    except ImportError:
        raise SystemExit(
            "plot_benchmarks.py needs matplotlib: pip install 'usp_graph[plot]' (or pip install matplotlib)"
        ) from None
    matplotlib.use("Agg")
    matplotlib.rcParams.update({"svg.hashsalt": "usp_graph", "svg.fonttype": "none", "font.size": 9})
    import matplotlib.pyplot as plt

    return plt


def read_records(paths: list[Path]) -> list[dict[str, Any]]:
    """Every JSON object line of `paths` (blank lines skipped); a bad line is an error naming it."""
    out = []
    for path in paths:
        try:
            lines = path.read_text().splitlines()
        except OSError as e:
            raise PlotError(f"{path}: {e.strerror or e}") from None
        for i, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise PlotError(
                    f"{path}:{i}: not a JSON line ({e.msg}); each line must be one result record"
                ) from None
            if not isinstance(rec, dict) or "bench" not in rec:
                raise PlotError(
                    f"{path}:{i}: a result record is a JSON object with a 'bench' field (tools/harness.py)"
                )
            out.append(rec)
    return out


def _tokens(shape: str) -> tuple[int, str] | None:
    m = _SHAPE.fullmatch(str(shape))
    if m is None:
        return None
    return int(m["n"]) * (1024 if m["k"] else 1), m["mode"]


def _config(rec: dict[str, Any]) -> str:
    if rec.get("config"):
        return str(rec["config"])
    s = rec.get("settings") or {}
    h, kv, k = s.get("heads", 16), s.get("kv_heads") or s.get("heads", 16), s.get("head_dim", 128)
    return f"{'MHA' if kv == h else 'GQA'} {h}{'' if kv == h else f'/{kv}'} K={k}"


def _style(plt, ax, title: str, xlabel: str, ylabel: str) -> None:
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)


def _footer(fig, records: list[dict[str, Any]]) -> None:
    devices = sorted({f"{r.get('device_name', '?')}, torch {r.get('torch', '?')}" for r in records})
    dates = sorted({str(r.get("date_utc", "?"))[:10] for r in records})
    fig.text(0.01, 0.005, f"{'; '.join(devices)}; {', '.join(dates)}", fontsize=7, color="#555")


def attention_tflops(plt, records: list[dict[str, Any]], config: str):
    rows = [r for r in records if r["bench"] == "varlen" and r.get("tflops_fwd_bwd") is not None
            and _config(r) == config and _tokens(r.get("shape", "")) is not None]  # fmt: skip
    if not rows:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.8), sharey=True)
    for ax, mode in zip(axes, ("bi", "causal"), strict=True):
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in rows:
            tokens, m = _tokens(r["shape"])
            if m == mode:
                series[r["impl"]].append((tokens, float(r["tflops_fwd_bwd"])))
        for impl in sorted(series, key=lambda i: (_IMPL_ORDER.index(i) if i in _IMPL_ORDER else 99, i)):
            pts = sorted(series[impl])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=impl,
                    lw=2.2 if impl == "usp" else 1.2)  # fmt: skip
        name = "bidirectional" if mode == "bi" else "causal"
        if series:
            ax.set_xscale("log", base=2)
            ax.xaxis.set_major_formatter(plt.FuncFormatter(lambda x, _: f"{int(x) // 1024}K"))
        _style(plt, ax, name if series else f"{name} (no records)", "packed tokens", "fwd+bwd TFLOP/s")
    by_label = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels(), strict=True):
            by_label.setdefault(label, h)
    fig.legend(list(by_label.values()), list(by_label), fontsize=7, loc="center right")
    fig.suptitle(f"Packed-document attention, {config}: useful TFLOP/s per kernel")
    _footer(fig, rows)
    fig.tight_layout(rect=(0, 0.03, 0.87, 1))
    return fig


def cp_efficiency(plt, records: list[dict[str, Any]]):
    attn = [
        r for r in records if r["bench"] == "cp" and r.get("efficiency") is not None and r.get("ok", True)
    ]
    train = [
        r
        for r in records
        if r["bench"] == "train_cp" and r.get("efficiency") is not None and r.get("ok", True)
    ]
    if not attn and not train:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4.2), sharey=True)
    ax = axes[0]
    colors = {}

    def color(strategy: str) -> str:
        return colors.setdefault(strategy.split(" ")[0].rstrip(","), f"C{len(colors)}")

    if attn:
        tokens = max(int(r["tokens"]) for r in attn)
        series: dict[str, list[tuple[int, float]]] = defaultdict(list)
        for r in attn:
            if int(r["tokens"]) == tokens:
                series[f"{r['strategy']}, {'causal' if r.get('causal') else 'bi'}"].append(
                    (int(r["world"]), float(r["efficiency"]))
                )
        for name in sorted(series):
            pts = sorted([(1, 1.0), *series[name]])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name, color=color(name),
                    ls="-" if name.endswith("causal") else "--")  # fmt: skip
        ax.legend(fontsize=7, loc="lower left", ncol=2)
        title = f"one attention call, {tokens // 1024}K tokens"
    else:
        title = "one attention call (no records)"
    _style(plt, ax, title, "GPUs", "scaling efficiency")
    ax = axes[1]
    if train:
        series = defaultdict(list)
        for r in train:
            if r["strategy"] == "1 GPU" or int(r["world"]) == 1:
                continue
            kernel = (r.get("settings") or {}).get("usp_kernel", "auto")
            series[f"{r['strategy']} ({kernel})"].append((int(r["world"]), float(r["efficiency"])))
        for name in sorted(series):
            pts = sorted([(1, 1.0), *series[name]])
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=name, color=color(name),
                    ls="--" if "(cudnn)" in name else "-")  # fmt: skip
        ax.legend(fontsize=7, loc="lower left", ncol=2)
    _style(plt, ax, "train step" if train else "train step (no records)", "GPUs", "")
    for a in axes:
        a.axhline(1.0, color="#999", lw=0.8)
        a.set_xticks([1, 2, 4, 8])
        a.set_xlim(0.8, 4.4 if all(int(r["world"]) <= 4 for r in attn + train) else 8.5)
        a.set_ylim(0.2, 1.05)
    fig.suptitle("Context parallelism: efficiency = t(1 GPU) / (P × t(P GPUs))")
    _footer(fig, attn + train)
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    return fig


def train_vs_padded(plt, records: list[dict[str, Any]]):
    train = [r for r in records if r["bench"] == "train" and r.get("ms") is not None]
    padded = {
        (r.get("settings") or {}).get("model", "?"): r
        for r in train
        if str(r.get("path", "")).startswith("padded")
    }
    if not padded:
        return None
    models = sorted(padded)
    usp = {}
    for r in train:
        model = (r.get("settings") or {}).get("model", "?")
        if (
            model in padded
            and r.get("reference") == padded[model]["path"]
            and not str(r["path"]).startswith("padded")
        ):
            usp[model] = r
    models = [m for m in models if m in usp]
    if not models:
        return None
    fig, ax = plt.subplots(figsize=(6, 3.6))
    xs = range(len(models))
    w = 0.38
    pad_ms = [float(padded[m]["ms"]) for m in models]
    usp_ms = [float(usp[m]["ms"]) for m in models]
    ax.bar([x - w / 2 for x in xs], pad_ms, w, label="padded SDPA (inductor)", color="#bbbbbb")
    ax.bar([x + w / 2 for x in xs], usp_ms, w, label="usp, packed documents", color="#4c8bd6")
    for x, p, u in zip(xs, pad_ms, usp_ms, strict=True):
        ax.text(x + w / 2, u, f"{p / u:.2f}x faster", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(xs))
    ax.set_xticklabels(
        [f"{m} ({(padded[m].get('settings') or {}).get('tokens', '?')} tokens)" for m in models]
    )  # fmt: skip
    _style(plt, ax, "Train step: usp vs padded SDPA", "", "ms per step (lower is better)")
    ax.set_ylim(0, max(pad_ms + usp_ms) * 1.3)
    ax.legend(fontsize=8, loc="upper center", ncol=2)
    _footer(fig, [padded[m] for m in models] + [usp[m] for m in models])
    fig.tight_layout(rect=(0, 0.04, 1, 1))
    return fig


def plot(
    records: list[dict[str, Any]], out: Path, *, fmt: str = "svg", config: str = DEFAULT_CONFIG
) -> list[Path]:
    """Draw every figure the records allow into `out`; the paths written."""
    plt = _matplotlib()
    out.mkdir(parents=True, exist_ok=True)
    written = []
    for name, fig in (
        ("attention_tflops", attention_tflops(plt, records, config)),
        ("cp_efficiency", cp_efficiency(plt, records)),
        ("train_vs_padded", train_vs_padded(plt, records)),
    ):
        if fig is None:
            continue
        path = out / f"{name}.{fmt}"
        fig.savefig(path, format=fmt, metadata={"Date": None} if fmt == "svg" else None, dpi=120)
        plt.close(fig)
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "results", nargs="+", type=Path, help="JSON-lines files written with --json by tools/*.py"
    )
    ap.add_argument("--out", type=Path, default=Path("docs/figures"), help="folder for the figures")
    ap.add_argument("--format", choices=("svg", "png"), default="svg")
    ap.add_argument(
        "--config", default=DEFAULT_CONFIG, help=f"attention head configuration (default {DEFAULT_CONFIG!r})"
    )
    args = ap.parse_args(argv)
    try:
        records = read_records(args.results)
    except PlotError as e:
        print(f"plot_benchmarks.py: {e}", file=sys.stderr)
        return 2
    written = plot(records, args.out, fmt=args.format, config=args.config)
    if not written:
        benches = sorted({str(r["bench"]) for r in records})
        print(f"plot_benchmarks.py: no figure to draw: records of bench {benches}; the figures need bench "
              f"'varlen' (config {args.config!r}), 'cp'/'train_cp' or 'train' with a padded reference",
              file=sys.stderr)  # fmt: skip
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
