"""Long context on a transformers user's own stack: usp beside transformers' own attention options.

# T packed tokens (one row), N documents

    PYTHONUNBUFFERED=1 python tools/bench_long_gpu.py --json $OUT/long.jsonl      # the H200 table
    python tools/bench_long_gpu.py --device cpu --quick                           # smoke test

A transformers Llama (hidden 2048, 4 layers, 16 heads, 4 KV heads, vocab 32000, bf16), one row of
T tokens holding documents of log-normal lengths (sigma 1; mean T/8 up to 32K tokens, then 4K,
8K, 16K), position ids restarting at 0 per document; loss (token-mean next-token cross entropy
within documents) + backward. Rows, each a fresh model with the same weights:

- ``flex``: ``attn_implementation="flex_attention"`` + ``torch.compile`` (inductor): transformers
  builds a flex block mask from the packed position ids. The peer to beat.
- ``sdpa``: ``"sdpa"`` + ``torch.compile``: transformers' packed (1, 1, T, T) mask (short T only:
  ``--sdpa-max``).
- ``usp``: ``attn_implementation="usp"`` + ``torch.compile(backend="usp")`` (inductor inside)
  under ``usp_graph.documents(meta)``: no mask anywhere.
- ``sdpa_usp``: ``"sdpa"`` + backend usp under ``documents(meta)``: transformers builds its mask in
  the graph, usp reads it at a probe length and rewrites every SDPA; the mask is dead code.
- ``sdpa_trainer`` (optional): ``"sdpa"`` + backend usp with no ``documents`` block: the backend
  reads the documents from the mask transformers builds from the position ids (what a ``Trainer``
  with ``DataCollatorWithFlattening`` and ``model.compile(backend="usp")`` runs).
- ``usp_inductor`` (optional): ``"usp"`` + plain ``torch.compile``, documents from the position ids
  inside the graph (no block, no host sync).

``--vary N``: every step takes the next of N batches of other documents (log-normal draws with
seeds 1..N, each with its own exact metadata), as a training run does, instead of one batch; the
warm-up runs each batch once at least, and every row's timed steps start at the first batch
(``ms_mean``: their mean, each batch weighted alike when ``--iters`` is a multiple of N).

``--checkpoint-from T`` turns activation checkpointing on (every row) from that length on.
Each row: median ms of ``--iters`` steps after ``--warmup`` (compile excluded), peak memory over
the timed steps, the loss, which attention kernel usp ran (flash / flex / cuDNN; `kernel_calls`),
and a profile of one step by kernel class (attention, matmul, other: CUDA time in ms). One JSON
line per row with ``--json PATH`` (`harness.Results`).
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
import torch.nn.functional as F
from bench_hf_gpu import _batch  # the same packed row: ids, restarting positions, in-document labels
from harness import Results, add_json_arg, stopwatch, time_ms
from hf_llama import add_size_args, checkpoint_layers, hf_llama, use_quick_sizes

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.testing import lognormal_lengths

ROWS = ("flex", "sdpa", "usp", "sdpa_usp", "sdpa_trainer", "usp_inductor")
_ATTN = {"flex": "flex_attention", "sdpa": "sdpa", "usp": "usp", "sdpa_usp": "sdpa", "sdpa_trainer": "sdpa",
         "usp_inductor": "usp"}  # fmt: skip


def _mean_doc(tokens: int) -> int:
    return {8192: 1024, 32768: 2048, 65536: 4096, 131072: 8192, 262144: 16384}.get(
        tokens, max(1, tokens // 8)
    )


def _kernel_class(name: str) -> str:
    n = name.lower()
    if any(s in n for s in ("flash", "fmha", "cudnn", "attn", "attention", "flex", "sdpa")):
        return "attention"
    if any(s in n for s in ("gemm", "cutlass", "xmma", "nvjet", "matmul", "sm90_", "cublas")):
        return "matmul"
    return "other"


def _profile(step, device: str, top: int = 0) -> dict[str, Any] | None:
    """CUDA time of one step by kernel class, ms (and the `top` kernels by time, with their class)."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    out: dict[str, Any] = {"attention": 0.0, "matmul": 0.0, "other": 0.0}
    kernels = []
    for evt in prof.key_averages():
        us = getattr(evt, "self_device_time_total", None)
        if us is None:
            us = getattr(evt, "self_cuda_time_total", 0.0)
        if us:
            out[_kernel_class(evt.key)] += us / 1e3
            kernels.append((us / 1e3, evt.count, _kernel_class(evt.key), evt.key[:120]))
    out = {k: round(v, 2) for k, v in out.items()}
    if top:
        out["top"] = [
            [round(ms, 2), n, cls, name] for ms, n, cls, name in sorted(kernels, reverse=True)[:top]
        ]
    return out


def _gaps(step, device: str, top: int, steps: int = 3) -> dict[str, Any] | None:
    """Where the GPU waits during `steps` back-to-back steps (no synchronization between them, as
    in the timed loop): the `top` longest idle gaps between device activities, each with the kernel
    that ends it, how late the host launched that kernel (ms after the GPU went idle: host-bound
    when positive), the runtime calls longer than 50 us inside the gap and the host ops running at
    the launch, outermost first; and the `top` longest synchronizing runtime calls with their host ops."""
    if device != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            step()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as tmp:
        trace = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(trace))
        events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e.get("ph") == "X" and "dur" in e]
    gpu = sorted(
        (e for e in spans if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")), key=lambda e: e["ts"]
    )
    runtime = [e for e in spans if e.get("cat") == "cuda_runtime"]
    launch = {e["args"].get("correlation"): e["ts"] for e in runtime if "args" in e}
    ops = [e for e in spans if e.get("cat") in ("cpu_op", "user_annotation", "python_function")]

    def host_at(t: float) -> list[str]:
        stack = sorted((e for e in ops if e["ts"] <= t <= e["ts"] + e["dur"]), key=lambda e: -e["dur"])
        return [e["name"][:60] for e in stack][:8]

    if not gpu:
        return {"gaps": []}
    gaps, busy, end = [], 0.0, gpu[0]["ts"]
    for e in gpu:
        if e["ts"] > end:
            gaps.append((e["ts"] - end, end, e))
        busy += max(0.0, e["ts"] + e["dur"] - max(end, e["ts"]))
        end = max(end, e["ts"] + e["dur"])
    out: dict[str, Any] = {
        "steps": steps,
        "span_ms": round((end - gpu[0]["ts"]) / 1e3, 2),
        "busy_ms": round(busy / 1e3, 2),
        "idle_ms": round(sum(g for g, _, _ in gaps) / 1e3, 2),
        "gaps_over_0.1ms": sum(1 for g, _, _ in gaps if g > 100),
    }
    listed = []
    for gap, start, nxt in sorted(gaps, key=lambda g: -g[0])[:top]:
        at = launch.get(nxt.get("args", {}).get("correlation"), nxt["ts"])
        inside = sorted(
            {
                f"{e['name']} {e['dur'] / 1e3:.2f}ms"
                for e in runtime
                if e["dur"] > 50 and e["ts"] < nxt["ts"] and e["ts"] + e["dur"] > start
            }
        )
        listed.append(
            {
                "ms": round(gap / 1e3, 3),
                "next": nxt["name"][:80],
                "host_late_ms": round((at - start) / 1e3, 3),
                "runtime": inside[:4],
                "host": host_at(at),
            }
        )
    out["gaps"] = listed
    by_cat: dict[str, float] = {}
    by_name: dict[str, list[float]] = {}
    for e in gpu:
        by_cat[e["cat"]] = by_cat.get(e["cat"], 0.0) + e["dur"] / 1e3 / steps
        n = by_name.setdefault(e["name"][:90], [0.0, 0])
        n[0] += e["dur"] / 1e3 / steps
        n[1] += 1
    out["per_step_ms_by_kind"] = {k: round(v, 2) for k, v in by_cat.items()}
    out["per_step_top"] = [
        [round(ms, 2), count // steps, name]
        for name, (ms, count) in sorted(by_name.items(), key=lambda x: -x[1][0])[:top]
    ]
    syncs = sorted(
        (e for e in runtime if "ynchronize" in e["name"] or e["name"].startswith("cudaMemcpy")),
        key=lambda e: -e["dur"],
    )
    out["syncs"] = [
        {"ms": round(e["dur"] / 1e3, 3), "call": e["name"], "host": host_at(e["ts"])} for e in syncs[:top]
    ]
    return out


def _memory_at_peak(step, device: str, top: int, steps: int = 3) -> dict[str, Any] | None:
    """What is live at the peak of `steps` back-to-back steps (as in the timed loop): allocated
    memory before them, the peak over it, and the `top` largest groups of blocks live at the peak by
    where they were allocated (the innermost frames outside torch's own dispatch code), GiB."""
    if device != "cuda":
        return None
    with _memory_history(top) as result:
        for _ in range(steps):
            step()
    return {"steps": steps, **result}


def _where(frames: list[dict[str, Any]], depth: int = 3) -> str:
    """An allocation's site: its innermost `depth` Python frames outside torch's dispatch code."""
    keep = [
        f for f in frames
        if not any(s in f["filename"] for s in ("torch/_ops.py", "torch/utils/", "torch/_tensor.py", "torch/_prims", "torch/_refs", "torch/_decomp"))
    ]  # fmt: skip
    return " < ".join(f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in keep[:depth]) or "?"


def _live_now(top: int) -> dict[str, Any]:
    """The `top` largest groups of blocks allocated now, by site (history recorded from the start of
    the process: `--memory-from-start`), GiB."""
    snap = torch.cuda.memory._snapshot()
    groups: dict[str, int] = {}
    for seg in snap["segments"]:
        for block in seg["blocks"]:
            if block["state"] == "active_allocated":
                at = _where(block.get("frames", []), 6)
                groups[at] = groups.get(at, 0) + block["size"]
    return {
        "allocated_gib": round(torch.cuda.memory_allocated() / 2**30, 2),
        "top": [[round(b / 2**30, 3), at] for at, b in sorted(groups.items(), key=lambda g: -g[1])[:top]],
    }


@contextlib.contextmanager
def _memory_history(top: int):
    """Records the allocator's history over the block; the dict it yields is filled on exit with
    the peak and the `top` groups live at it (see `_memory_at_peak`)."""
    result: dict[str, Any] = {}
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    torch.cuda.reset_peak_memory_stats()
    try:
        yield result
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    live: dict[int, tuple[int, str]] = {}
    now = peak = 0
    peak_live: dict[int, tuple[int, str]] = {}

    for e in trace:
        if e["action"] == "alloc":
            live[e["addr"]] = (e["size"], _where(e.get("frames", [])))
            now += e["size"]
            if now > peak:
                peak, peak_live = now, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            now -= live.pop(e["addr"])[0]
    groups: dict[str, int] = {}
    for size, at in peak_live.values():
        groups[at] = groups.get(at, 0) + size
    result.update({
        "before_gib": round(base / 2**30, 2),
        "peak_over_before_gib": round(peak / 2**30, 2),
        "max_memory_allocated_gib": round(torch.cuda.max_memory_allocated() / 2**30, 2),
        "top": [[round(b / 2**30, 3), at] for at, b in sorted(groups.items(), key=lambda g: -g[1])[:top]],
    })  # fmt: skip


def _step(model, compiled, batches: list[dict[str, torch.Tensor]], metas: list[AttentionMetadata] | None):
    """One train step (loss + backward) on the next of `batches`, under `documents` of its
    metadata when `metas` are given."""

    def step() -> torch.Tensor:
        i = step.turn % len(batches)  # type: ignore[attr-defined]
        step.turn += 1  # type: ignore[attr-defined]
        batch, docs = batches[i], metas[i] if metas is not None else None
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(docs) if docs is not None else contextlib.nullcontext():
            logits = compiled(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            ).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    step.turn = 0  # type: ignore[attr-defined]  # the next batch; the timed loop starts every row at 0
    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default=None, help="comma-separated lengths (8192,32768,65536,131072,262144)")
    p.add_argument("--rows", default="flex,sdpa,usp,sdpa_usp")
    p.add_argument("--sdpa-max", type=int, default=32768, help="row sdpa only up to this many tokens")
    p.add_argument("--checkpoint-from", type=int, default=262144, help="activation checkpointing from T on")
    add_size_args(p)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--top", type=int, default=0, help="list this many kernels of the profiled step")
    p.add_argument("--vary", type=int, default=1, help="cycle through this many batches of other documents")
    p.add_argument(
        "--gaps", type=int, default=0, help="list this many GPU idle gaps of one step, with their cause"
    )
    p.add_argument(
        "--memory-top", type=int, default=0, help="list this many allocation sites live at the peak"
    )
    p.add_argument(
        "--memory-when", choices=("warmup", "timed"), default="warmup",
        help="--memory-top over three steps after the warm-up, or over the timed steps themselves",
    )  # fmt: skip
    p.add_argument(
        "--memory-from-start", type=int, default=0,
        help="record the allocator's history from the start; list this many sites live before the timed steps",
    )  # fmt: skip
    p.add_argument(
        "--usp-options", type=json.loads, default={},
        help='more options for backend usp, as JSON (e.g. \'{"dump_dir": "/tmp/d"}\')',
    )  # fmt: skip
    p.add_argument(
        "--repeat", type=int, default=1,
        help="with --isolate: run every row this many times, the order reversed on every other round",
    )  # fmt: skip
    p.add_argument(
        "--isolate", action=argparse.BooleanOptionalAction, default=None,
        help="each row in a process of its own (the default on CUDA: a row's speed and peak then do not "
        "depend on the rows before it)",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes on any device (a smoke test)")
    add_json_arg(p)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens = a.tokens or "256,512"
        use_quick_sizes(a)
        a.iters, a.warmup, a.sdpa_max, a.checkpoint_from = 2, 1, 512, 512
    a.tokens = a.tokens or "8192,32768,65536,131072,262144"
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            p.error(f"--rows: {r!r} is not one of {', '.join(ROWS)}")
    if a.isolate is None:
        a.isolate = a.device == "cuda"
    if a.isolate:
        return _isolated(a, rows, argv if argv is not None else sys.argv[1:])
    import transformers as tf

    from usp_graph.ops import cudnn_kernel

    device = a.device
    inner = "inductor" if device == "cuda" else "aot_eager"
    cudnn = device == "cuda" and cudnn_kernel.available()
    out = Results(a.json, bench="long", device=device)
    if a.memory_from_start and device == "cuda":
        torch.cuda.memory._record_memory_history(max_entries=1, stacks="python")
    print(
        f"cuDNN frontend: {'installed' if cudnn else 'missing'}; torch {torch.__version__}, transformers {tf.__version__}"
    )
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    for tokens in (int(t) for t in a.tokens.split(",")):
        draws = [lognormal_lengths(tokens, _mean_doc(tokens), seed=s) for s in range(1, a.vary + 1)]
        lengths = draws[0]
        batches = [_batch(d, a.vocab, device) for d in draws]
        if a.vary == 1:  # one batch, capacity with room to spare (section 0's setting)
            metas = [AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 8, device=device)]
        else:  # each batch's own exact metadata, as AttentionMetadata.from_position_ids gives
            metas = [AttentionMetadata.from_lengths(d, device=device) for d in draws]
        ckpt = tokens >= a.checkpoint_from
        print(f"T={tokens} N={len(lengths)} longest={max(lengths)} checkpointing={ckpt}")
        for row in rows:
            if row == "sdpa" and tokens > a.sdpa_max:
                continue
            torch._dynamo.reset()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            model = hf_llama(a, _ATTN[row], tokens=tokens, device=device)
            if ckpt:
                checkpoint_layers(model)
            if row in ("usp", "sdpa_usp", "sdpa_trainer"):
                compiled = torch.compile(model, backend="usp", options={"inner": inner, **a.usp_options})
                docs = metas if row != "sdpa_trainer" else None
            else:
                compiled = torch.compile(model) if device == "cuda" else model
                docs = None
            step = _step(model, compiled, batches, docs)
            record: dict[str, Any] = {
                "row": row,
                "tokens": tokens,
                "documents": len(lengths),
                "batches": a.vary,
                "checkpointing": ckpt,
            }
            try:
                with stopwatch(device) as watch:
                    # every batch once at least: a training run's first batches build what the rest reuse
                    losses = [step() for _ in range(max(a.warmup, a.vary))]
                record["compile_and_warmup_s"] = round(watch.seconds, 1)
                if a.memory_top and a.memory_when == "warmup":  # the steps the timed loop would run next
                    record["memory_at_peak"] = _memory_at_peak(step, device, a.memory_top)
                if row.startswith("usp") or row.startswith("sdpa_"):
                    from kernel_calls import kernel_calls

                    _, record["kernels"] = kernel_calls(step)
                    record["cudnn_workspace_mib"] = {
                        f"{kind} T={k.total_q} N={k.slots} S={k.s_q}": round(plan.workspace / 2**20, 1)
                        for (kind, k), plan in cudnn_kernel._plans.items()
                    }
                step.turn = 0  # type: ignore[attr-defined]
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    if a.memory_from_start:
                        before_gc = round(torch.cuda.memory_allocated() / 2**30, 2)
                        gc.collect()
                        record["live_before_timed"] = {
                            "before_gc_gib": before_gc,
                            **_live_now(a.memory_from_start),
                        }
                        print(f"  {row:13s} live_before_timed: {json.dumps(record['live_before_timed'])}")
                if device == "cuda":  # CUDA events around each step, no synchronization between steps
                    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(a.iters)]  # fmt: skip
                    record["timed_unix_s"] = [round(time.time(), 2)]
                    with (
                        _memory_history(a.memory_top)
                        if a.memory_top and a.memory_when == "timed"
                        else contextlib.nullcontext()
                    ) as history:
                        for start, end in events:
                            start.record()
                            losses.append(step())
                            end.record()
                        torch.cuda.synchronize()
                    if history is not None:
                        record["memory_at_peak"] = {"steps": "timed", **history}
                    record["timed_unix_s"].append(round(time.time(), 2))
                    record["ms_each"] = [round(s.elapsed_time(e), 2) for s, e in events]
                    record["ms"] = round(statistics.median(record["ms_each"]), 2)
                    record["ms_mean"] = round(statistics.fmean(record["ms_each"]), 2)
                else:
                    timing = time_ms(lambda: losses.append(step()), device, warmup=0, reps=a.iters)  # noqa: B023
                    record["ms"] = round(timing.median_ms, 2)
                record["peak_gib"] = (
                    round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None
                )
                if device == "cuda":  # what the tensors asked for, and what the allocator held
                    stats = torch.cuda.memory_stats()
                    record["peak_requested_gib"] = round(stats.get("requested_bytes.all.peak", 0) / 2**30, 2)
                    record["peak_reserved_gib"] = round(torch.cuda.max_memory_reserved() / 2**30, 2)
                record["loss"] = float(losses[-1])
                if not a.no_profile:
                    record["profile_ms"] = _profile(step, device, a.top)
                if a.gaps:
                    record["gaps"] = _gaps(step, device, a.gaps)
            except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
                record["error"] = f"{type(e).__name__}: {e}"[:1500]
            del compiled, model
            if "error" in record:
                print(f"  {row:13s} FAILED: {record['error'][:300]}")
            else:
                print(
                    f"  {row:13s} {record['ms']:9.1f} ms  peak {record['peak_gib']} GiB  loss {record['loss']:.5f}  "
                    f"kernels {record.get('kernels')}  profile {record.get('profile_ms')}  "
                    f"(compile+warmup {record['compile_and_warmup_s']} s)"
                )
                for key in ("gaps", "memory_at_peak"):
                    if record.get(key):
                        print(f"  {row:13s} {key}: {json.dumps(record[key])}")
            out.write(settings={k: v for k, v in vars(a).items() if k != "json"}, cudnn=cudnn, **record)
    return 0


def _strip(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """`argv` without the options `names` (each with its value, as `--name v` or `--name=v`)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
            continue
        name = arg.split("=", 1)[0]
        if name in names:
            skip = "=" not in arg and name not in ("--isolate", "--no-isolate")
            continue
        out.append(arg)
    return out


def _isolated(a: argparse.Namespace, rows: list[str], argv: list[str]) -> int:
    """Every (length, row) in a fresh process, `--repeat` rounds with the row order reversed on every
    other round; each run's JSON line gains `round` and `position`, and a summary line per length
    gives each row's median time over the rounds, its largest peak and its speed against flex."""
    base = _strip(argv, ("--tokens", "--rows", "--repeat", "--json", "--isolate", "--no-isolate"))
    summary = Results(a.json, bench="long_summary", device=a.device)
    for tokens in a.tokens.split(","):
        runs: dict[str, list[dict[str, Any]]] = {r: [] for r in rows}
        for rnd in range(a.repeat):
            order = rows if rnd % 2 == 0 else rows[::-1]
            for position, row in enumerate(order):
                with tempfile.TemporaryDirectory() as tmp:
                    path = Path(tmp) / "row.jsonl"
                    cmd = [
                        sys.executable,
                        __file__,
                        *base,
                        "--no-isolate",
                        "--tokens",
                        tokens,
                        "--rows",
                        row,
                        "--json",
                        str(path),
                    ]
                    done = subprocess.run(cmd, env={**os.environ, "PYTHONUNBUFFERED": "1"}, check=False)
                    lines = path.read_text().splitlines() if path.exists() else []
                if not lines:
                    print(f"  {row}: the process wrote no result (exit {done.returncode})")
                    continue
                for line in lines:
                    record = {**json.loads(line), "round": rnd, "position": position, "isolated": True}
                    runs[row].append(record)
                    if a.json is not None:
                        with Path(a.json).open("a") as f:
                            f.write(json.dumps(record, default=str) + "\n")
        table = {}
        for row, recs in runs.items():
            ok = [r for r in recs if "ms" in r]
            if ok:
                table[row] = {
                    "ms": round(statistics.median(r["ms"] for r in ok), 2),
                    "ms_all": [r["ms"] for r in ok],
                    "peak_gib": max(r["peak_gib"] or 0 for r in ok),
                }
            elif recs:
                table[row] = {"error": recs[0].get("error", "no result")[:300]}
        flex = table.get("flex", {}).get("ms")
        for t in table.values():
            if flex and "ms" in t:
                t["x_flex"] = round(flex / t["ms"], 3)
        print(f"T={tokens} over {a.repeat} round(s), each row in its own process: {json.dumps(table)}")
        summary.write(tokens=int(tokens), rounds=a.repeat, rows=table)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
