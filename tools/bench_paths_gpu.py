"""The path matrix: every way a transformers user reaches usp, against transformers' flex_attention.

# T packed tokens (one row), N documents

    PYTHONUNBUFFERED=1 python tools/bench_paths_gpu.py --json $OUT/paths.jsonl   # the H200 matrix
    python tools/bench_paths_gpu.py --device cpu --quick                         # smoke test

A transformers Llama (hidden 2048, 4 layers, 16 heads, 4 KV heads, ffn 5632, vocab 32000, bf16), one
packed row of T tokens holding documents of log-normal lengths (`bench_long_gpu`'s draws), position
ids restarting at 0 per document, **the model's own ``labels=`` loss**, ``use_cache=False``; one
forward + backward per step. Rows (what the user wrote), each a fresh model with the same weights:

- ``flex``: ``attn_implementation="flex_attention"`` + ``torch.compile``: the peer;
- ``usp_plain``: ``"usp"`` + plain ``torch.compile``: documents from the position ids inside the
  graph (the Trainer / TRL path);
- ``usp_collator``: the same with flash-attention's ``cu_seq_lens_q/k`` and ``max_length_q/k`` in
  the batch too (``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``): boundaries with a
  slot per document (in a compiled graph joined with the model's mask's starts, a slot per token);
- ``usp_backend``: ``"usp"`` + ``torch.compile(backend="usp")`` under ``usp_graph.documents(meta)``,
  default options (the README's snippet);
- ``sdpa_backend``: ``"sdpa"`` + backend usp under ``documents(meta)``, default options.

Columns: token counts, ``c`` marking transformers' activation checkpointing (non-reentrant):
``8192,32768,65536,131072,65536c,262144c`` by default. Each column runs in a process of its own
(every row of it in that process, one after the other). Each row: median ms over ``--iters`` steps
after ``--warmup`` (CUDA events, compile excluded), peak memory over the timed steps, the loss and
its relative difference to flex's, the attention kernel each usp row ran (`kernel_calls`), Dynamo's
graph breaks, and for the backend rows the attention sites the backend rewrote (`CompileReport`).
One JSON line per row (`harness.Results`) and a summary line per column (speed against flex).

``--paired R`` settles a column whose rows sit within their steps' spread (8K: +-1 ms on a 24 ms
step, and the GPU's clock drifts between rows run one after the other): every row's model stays
alive, and R rounds then run one step of each row, the order rotated per round; ``x_flex_paired``
is the median over rounds of flex's step over the row's step of the same round, with its quartiles.
Peak memory is then not per row (the earlier rows' models stay), so no ``peak_x_flex`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from bench_hf_gpu import _batch  # the packed row: ids, restarting positions, labels in the model's form
from bench_long_gpu import _mean_doc, _strip  # the long-context table's document draws; argv editing
from harness import Results, add_json_arg, stopwatch, time_ms
from hf_llama import add_size_args, checkpoint_layers, hf_llama, use_quick_sizes

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.testing import lognormal_lengths

ROWS = ("flex", "usp_plain", "usp_collator", "usp_backend", "sdpa_backend")
_ATTN = {"flex": "flex_attention", "usp_plain": "usp", "usp_collator": "usp", "usp_backend": "usp",
         "sdpa_backend": "sdpa"}  # fmt: skip


def _flash_kwargs(lengths: list[int], device: str) -> dict[str, Any]:
    """What ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds to a packed batch."""
    cu = torch.tensor([0, *lengths], device=device).cumsum(0).to(torch.int32)
    longest = max(lengths)
    return {"cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": longest, "max_length_k": longest}


COLUMNS = "8192,32768,65536,131072,65536c,262144c"


def _column(text: str) -> tuple[int, bool]:
    """``"65536c"`` -> (65536, checkpointing)."""
    return int(text.rstrip("c")), text.endswith("c")


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _run_row(row: str, a: argparse.Namespace, tokens: int, ckpt: bool, batch, meta, device: str):
    from usp_graph.ops import cudnn_kernel

    torch._dynamo.reset()
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    model = hf_llama(a, _ATTN[row], tokens=tokens, device=device)
    if ckpt:
        checkpoint_layers(model)
    reports: list[Any] = []
    if row.endswith("_backend"):
        compiled = torch.compile(model, backend="usp", options={"on_compile": reports.append})
        docs = meta
    else:
        compiled = torch.compile(model) if device == "cuda" else model
        docs = None

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(docs) if docs is not None else contextlib.nullcontext():
            loss = compiled(**batch, use_cache=False).loss
        loss.backward()
        return loss.detach()

    record: dict[str, Any] = {"row": row, "tokens": tokens, "checkpointing": ckpt}
    breaks = _graph_breaks()
    try:
        with stopwatch(device) as watch:
            losses = [step() for _ in range(a.warmup)]
        record["compile_and_warmup_s"] = round(watch.seconds, 1)
        record["graph_breaks"] = _graph_breaks() - breaks
        if row != "flex":
            from kernel_calls import kernel_calls

            _, record["kernels"] = kernel_calls(step)
        if reports:
            record["sites_rewritten"] = sum(len(r.rewritten) for r in reports)
            record["sites_kept"] = sum(len(r.kept) for r in reports)
            record["inner"] = sorted({r.inner for r in reports})
        if device == "cuda":
            torch.cuda.synchronize()
            # what the row holds before its timed steps (model, grads, what earlier rows left): the
            # peak is absolute, so a row's own share is peak - base
            record["base_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2)
            if a.base_trace:
                from mem_peak import live_now

                record["base_live"] = live_now()
                print(f"  {row}: {record['base_gib']} GiB held before the timed steps, by allocation site:")
                for g in record["base_live"]:
                    print(f"    {g['gib']:7.3f} GiB {g['blocks']:4d}x  {g['site'][:150]}  [{g['owner']}]")
            torch.cuda.reset_peak_memory_stats()
            events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.iters)]  # fmt: skip
            for start, end in events:
                start.record()
                losses.append(step())
                end.record()
            torch.cuda.synchronize()
            record["ms_each"] = [round(s.elapsed_time(e), 2) for s, e in events]
            record["ms"] = round(statistics.median(record["ms_each"]), 2)
            record["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
            if a.memory_trace:
                from mem_peak import peak_live, print_peak

                record["memory_trace"] = peak_live(step)
                print_peak(row, record["memory_trace"])
                if a.base_trace:  # peak_live turned the history off
                    from mem_peak import record_history

                    record_history()
            if a.profile:
                keep = (
                    None if a.profile_traces is None else a.profile_traces / f"{tokens}{'c' if ckpt else ''}"
                )
                record["gpu_idle"] = _profile_step(step, row, a.profile, keep)
        else:
            record["ms"] = round(
                time_ms(lambda: losses.append(step()), device, warmup=0, reps=a.iters).median_ms, 2
            )  # noqa: B023
        record["loss"] = float(losses[-1])
        record["cudnn"] = device == "cuda" and cudnn_kernel.available()
    except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
        record["error"] = f"{type(e).__name__}: {e}"[:1500]
        record.setdefault("graph_breaks", _graph_breaks() - breaks)
        return record, None
    return record, step


def _paired(steps: dict[str, Any], rounds: int, device: str) -> dict[str, list[float]]:
    """`rounds` rounds of one step of every row, the order rotated each round: ms per step per row.
    One untimed round first (rows compiled before a later row's ``_dynamo.reset`` compile again)."""
    order = list(steps)
    for row in order:
        steps[row]()
    timed: dict[str, list[Any]] = {row: [] for row in order}
    cuda = device == "cuda"
    if cuda:
        torch.cuda.synchronize()
    for i in range(rounds):
        for row in order[i % len(order) :] + order[: i % len(order)]:
            if cuda:  # CUDA events, as the rows' own timed steps: no synchronization between steps
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                steps[row]()
                end.record()
                timed[row].append((start, end))
            else:
                t0 = time.perf_counter()
                steps[row]()
                timed[row].append(time.perf_counter() - t0)
    if cuda:
        torch.cuda.synchronize()
        return {row: [round(s.elapsed_time(e), 2) for s, e in pairs] for row, pairs in timed.items()}
    return {row: [round(t * 1e3, 2) for t in ts] for row, ts in timed.items()}


def _quartiles(values: list[float]) -> tuple[float, float, float]:
    q = statistics.quantiles(values, n=4, method="inclusive") if len(values) > 1 else [values[0]] * 3
    return round(q[0], 4), round(q[1], 4), round(q[2], 4)


def _profile_step(step, row: str, top: int, keep: Path | None) -> dict[str, Any]:
    """One step under torch.profiler: the ops that take the GPU's time and the host's, and where the
    GPU waits between kernels (`gpu_gaps`); the trace itself (gzipped) into `keep` if given."""
    import gzip

    from gpu_gaps import idle_gaps, print_gaps
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    for key in ("cuda_time_total", "cpu_time_total"):
        print(f"  {row} by {key}:")
        print(prof.key_averages().table(sort_by=key, row_limit=top, max_name_column_width=60))
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        (keep / f"{row}.json.gz").write_bytes(gzip.compress(text.encode()))
    found = idle_gaps(json.loads(text), top=top)
    print_gaps(f"{row} GPU idle", found)
    return found


def _one_column(a: argparse.Namespace, text: str, rows: list[str]) -> list[dict[str, Any]]:
    import transformers as tf

    device = a.device
    tokens, ckpt = _column(text)
    if a.allow_checkpoint_side_effects:
        torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    lengths = lognormal_lengths(tokens, _mean_doc(tokens), seed=1)
    batch = _batch(lengths, a.vocab, device, for_model=True)  # the model's own labels= loss
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 8, device=device)
    print(
        f"T={tokens} N={len(lengths)} checkpointing={ckpt} torch {torch.__version__} transformers {tf.__version__}"
    )
    if a.base_trace and device == "cuda":
        from mem_peak import record_history

        record_history()
    collated = {**batch, **_flash_kwargs(lengths, device)}
    records, steps = [], {}
    for row in rows:
        record, step = _run_row(
            row, a, tokens, ckpt, collated if row == "usp_collator" else batch, meta, device
        )
        records.append(record)
        if a.paired and step is not None:  # kept alive: the rows after it hold its model too
            steps[row] = step
        del step
    if a.paired and steps:
        times = _paired(steps, a.paired, device)
        for r in records:
            if r["row"] in times:
                r["paired_ms_each"] = times[r["row"]]
                r["paired_ms"] = round(statistics.median(times[r["row"]]), 2)
                if "flex" in times:  # per round: flex's step over this row's, the same round
                    q1, q2, q3 = _quartiles(
                        [f / m for f, m in zip(times["flex"], times[r["row"]], strict=True)]
                    )
                    r["x_flex_paired"], r["x_flex_paired_iqr"] = q2, [q1, q3]
    flex = next((r for r in records if r["row"] == "flex" and "ms" in r), None)
    for r in records:
        r.update(documents=len(lengths), transformers=tf.__version__)
        if flex is not None and "ms" in r:
            r["x_flex"] = round(flex["ms"] / r["ms"], 3)
            r["loss_rel_flex"] = abs(r["loss"] - flex["loss"]) / abs(flex["loss"])
            if r.get("peak_gib") and flex.get("peak_gib") and not a.paired:
                r["peak_x_flex"] = round(r["peak_gib"] / flex["peak_gib"], 3)
        what = r.get("error") or (
            f"{r['ms']:9.1f} ms  x{r.get('x_flex', float('nan')):.3f}  peak {r.get('peak_gib')} GiB "
            f"(x{r.get('peak_x_flex', float('nan')):.3f}, base {r.get('base_gib')})  loss {r['loss']:.5f}  breaks {r['graph_breaks']}  "
            f"kernels {r.get('kernels')}  sites {r.get('sites_rewritten')}/{r.get('sites_kept')}"
        )
        if "x_flex_paired" in r:
            what = f"paired x{r['x_flex_paired']:.4f} (IQR {r['x_flex_paired_iqr']})  " + what
        print(f"  {r['row']:13s} {what[:400]}")
    return records


def _isolated(a: argparse.Namespace, argv: list[str]) -> int:
    """Each column in a fresh process; their JSON lines copied to `--json`, one summary per column."""
    summary = Results(a.json, bench="paths_summary", device=a.device)
    base = _strip(argv, ("--columns", "--json", "--isolate", "--no-isolate"))
    for text in a.columns.split(","):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / "column.jsonl"
            cmd = [sys.executable, __file__, *base, "--no-isolate", "--columns", text, "--json", str(path)]
            done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
            lines = path.read_text().splitlines() if path.exists() else []
        if not lines:
            print(f"  {text}: the process wrote no result (exit {done.returncode})")
            summary.write(column=text, error=f"no result (exit {done.returncode})")
            continue
        if a.json is not None:
            with Path(a.json).open("a") as f:
                f.writelines(line + "\n" for line in lines)
        table = {}
        for record in map(json.loads, lines):
            keep = (
                "ms",
                "x_flex",
                "peak_gib",
                "peak_x_flex",
                "base_gib",
                "x_flex_paired",
                "x_flex_paired_iqr",
                "loss_rel_flex",
                "kernels",
                "graph_breaks",
                "error",
            )
            table[record["row"]] = {k: record[k] for k in keep if k in record}
        print(f"{text}: {json.dumps(table)}")
        summary.write(column=text, rows=table)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--columns", default=COLUMNS, help="token counts, 'c' marking checkpointing (65536c)")
    p.add_argument("--rows", default=",".join(ROWS))
    add_size_args(p)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument(
        "--allow-checkpoint-side-effects", action="store_true",
        help="torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint = True (transformers >= 5.25)",
    )  # fmt: skip
    p.add_argument("--isolate", action=argparse.BooleanOptionalAction, default=None)
    p.add_argument(
        "--memory-trace", action="store_true",
        help="after the timed steps, one more under the allocator history: what is alive at the peak (tools/mem_peak.py)",
    )  # fmt: skip
    p.add_argument(
        "--base-trace", action="store_true",
        help="allocator history from the column's start: what each row holds before its timed steps, by allocation site",
    )  # fmt: skip
    p.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="N",
        help="profile one step of each row (torch.profiler): its top N ops by GPU and by host time",
    )
    p.add_argument(
        "--profile-traces", type=Path, default=None, metavar="DIR",
        help="with --profile: keep each row's trace as DIR/<column>/<row>.json.gz (tools/gpu_gaps.py reads it unzipped)",
    )  # fmt: skip
    p.add_argument(
        "--paired", type=int, default=0, metavar="R",
        help="then R rounds of one step of every row (order rotated; every row's model kept alive): flex's "
        "step over each row's, round by round (x_flex_paired: the median, with its quartiles)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes on any device (a smoke test)")
    add_json_arg(p)
    a = p.parse_args(argv)
    if a.quick:
        use_quick_sizes(a)
        a.iters, a.warmup = 2, 1
        if a.columns == COLUMNS:
            a.columns = "256,256c"
    if a.paired < 0:
        p.error(f"--paired: a number of rounds (0: none), got {a.paired}")
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            p.error(f"--rows: {r!r} is not one of {', '.join(ROWS)}")
    if a.isolate is None:
        a.isolate = a.device == "cuda"
    if a.isolate:
        return _isolated(a, argv if argv is not None else sys.argv[1:])
    out = Results(a.json, bench="paths", device=a.device)
    for text in a.columns.split(","):
        for record in _one_column(a, text, rows):
            out.write(settings={k: v for k, v in vars(a).items() if k != "json"}, **record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
