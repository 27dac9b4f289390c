"""The main job on an embedded default: trace -> rewrite with CP -> save -> load fresh -> replay.

A small Llama-style model on packed documents, context parallel over 2 gloo ranks on CPU:
1. each rank traces its train step (global token-mean loss) with `ContextParallel(strategy)`;
   every SDPA becomes varlen attention plus the strategy's collectives, verified, and is saved as a
   per-rank graph file; each rank also runs the eager step on NEW document boundaries;
2. two fresh processes load the graph files and replay them with the new boundaries;
3. the replayed loss and every grad must equal the eager ones bitwise; the parent prints the
   inspect summary of rank 0's file.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from .graphfile.document import SUFFIX

__all__ = ["run_demo"]


def _config(layers: int):
    from .models import LlamaConfig

    return LlamaConfig(vocab_size=256, dim=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128)


def _lengths(seed: int, docs: int, total: int) -> list[int]:
    """Log-normal document lengths summing to `total`, with an empty and a length-1 document."""
    gen = torch.Generator().manual_seed(seed)
    raw = (torch.randn(docs, generator=gen, dtype=torch.float64) * 0.8).exp()
    lens = (raw / raw.sum() * (total - 1)).floor().long().tolist()
    lens[0] += total - 1 - sum(lens)
    return [*lens[:-1], 0, 1, lens[-1]]


# Strategy "halo": documents are cut to at most this many tokens (a packer's usual limit), which
# fits within one rank's 64 traced tokens.
HALO_DOCUMENT_LEN = 64


def _cp(strategy: str):
    from . import ContextParallel

    if strategy == "halo":
        return ContextParallel("halo", max_document_len=HALO_DOCUMENT_LEN)
    return ContextParallel(strategy, **({"ulysses_degree": 2} if strategy == "usp" else {}))


def _cut(lengths: list[int], longest: int) -> list[int]:
    """Documents longer than `longest` cut into pieces of at most `longest` tokens."""
    out: list[int] = []
    for n in lengths:
        while n > longest:
            out.append(longest)
            n -= longest
        out.append(n)
    return out


def _make_step(cp):
    def step(model, batch):
        logits = model(batch["input_ids"], batch["position_ids"])
        labels = batch["labels"].flatten()
        loss_sum = F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum")
        return cp.token_mean(loss_sum, (labels != -100).sum())

    return step


def _batch(config, lengths: list[int], seed: int, cp, max_docs: int):
    from . import AttentionMetadata
    from .models import make_llama_batch

    if cp.strategy == "halo":
        lengths = _cut(lengths, HALO_DOCUMENT_LEN)
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(seed))
    longest = HALO_DOCUMENT_LEN if cp.strategy == "halo" else sum(lengths)
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=max_docs, max_seqlen=longest)
    return {k: cp.shard(v, 1) for k, v in batch.items()}, meta


def _trace_and_save(rank: int, world: int, out_dir: str, strategy: str, seed: int, layers: int, docs: int):
    from . import attention_mode, save, trace_train_step
    from .models import Llama

    t0 = time.perf_counter()
    cp = _cp(strategy)
    config = _config(layers)
    torch.manual_seed(seed)
    model = Llama(config)
    step = _make_step(cp)
    local_a, meta_a = _batch(config, _lengths(seed, docs, 64 * world), seed, cp, docs + 8)
    graph = trace_train_step(model, step, local_a, meta_a, cp=cp)
    path = os.path.join(out_dir, f"rank{rank}{SUFFIX}")
    save(graph, path)
    t_trace = time.perf_counter() - t0

    # Eager on NEW boundaries and a new token count: what the fresh replay must reproduce.
    local_b, meta_b = _batch(config, _lengths(seed + 1, docs + 3, 80 * world), seed + 1, cp, docs + 8)
    model.zero_grad(set_to_none=True)
    with attention_mode(meta_b, cp=cp):
        loss = step(model, local_b)
    loss.backward()
    torch.save(
        {
            "params": {n: p.detach() for n, p in model.named_parameters()},
            "batch": local_b,
            "cu_seqlens": meta_b.cu_seqlens,
            "max_seqlen": meta_b.max_seqlen,
            "loss": loss.detach(),
            "grads": {n: p.grad for n, p in model.named_parameters()},
        },
        os.path.join(out_dir, f"rank{rank}.expected.pt"),
    )
    return {
        "path": path,
        "sites": len(graph.sites),
        "trace_s": t_trace,
        "docs_a": meta_a.lengths(),
        "docs_b": meta_b.lengths(),
    }


def _load_and_replay(rank: int, world: int, out_dir: str, strategy: str) -> dict[str, Any]:
    from . import AttentionMetadata, load

    _cp(strategy)  # creates the process groups the graph's collectives name
    t0 = time.perf_counter()
    graph = load(os.path.join(out_dir, f"rank{rank}{SUFFIX}"))
    t_load = time.perf_counter() - t0
    exp = torch.load(os.path.join(out_dir, f"rank{rank}.expected.pt"), weights_only=True)
    meta = AttentionMetadata(exp["cu_seqlens"], exp["max_seqlen"], int(exp["cu_seqlens"][-1]))
    loss, grads = graph.replay(exp["params"], exp["batch"], meta)
    bad = [n for n, g in exp["grads"].items() if not torch.equal(grads[n], g)]
    return {"loss_equal": bool(torch.equal(loss, exp["loss"])), "bad_grads": bad, "load_s": t_load,
            "loss": float(loss)}  # fmt: skip


def run_demo(
    *,
    out_dir: str,
    summary: Callable[[str], str],
    html_report: Callable[[list[str], str], None] | None = None,
    strategy: str = "ulysses",
    seed: int = 0,
    layers: int = 2,
    docs: int = 6,
) -> int:
    """Run the main job; print progress and `summary(path)` of rank 0's graph file (the CLI passes
    its inspect text, so the demo does not import the CLI that runs it) and, with `html_report(paths,
    out)`, write the HTML report of every rank's file as report.html next to them; return a process
    exit code."""
    from .launch import run_local_ranks

    def say(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    os.makedirs(out_dir, exist_ok=True)
    world = 2
    say(f"[1/4] tracing a {layers}-layer Llama-style train step on packed documents, CP '{strategy}' over "
        f"{world} gloo ranks (spawned)")  # fmt: skip
    traced = run_local_ranks(_trace_and_save, world, out_dir, strategy, seed, layers, docs)
    say(
        f"      {traced[0]['sites']} SDPA sites rewritten per rank; traced with documents {traced[0]['docs_a']}"
    )
    say(
        f"[2/4] saved {', '.join(t['path'] for t in traced)}; eager reference on new documents {traced[0]['docs_b']}"
    )
    say("[3/4] loading the graph files in 2 fresh processes and replaying with the new documents")
    replayed = run_local_ranks(_load_and_replay, world, out_dir, strategy)
    ok = all(r["loss_equal"] and not r["bad_grads"] for r in replayed)
    for rank, r in enumerate(replayed):
        verdict = (
            "bitwise equal" if r["loss_equal"] and not r["bad_grads"] else f"DIFFERENT: {r['bad_grads'][:3]}"
        )
        say(
            f"      rank {rank}: load {r['load_s'] * 1e3:.0f} ms, loss {r['loss']:.6f}, loss and every grad {verdict}"
        )
    say("[4/4] inspect summary of rank 0's graph file")
    say(summary(traced[0]["path"]))
    if html_report is not None:
        report = os.path.join(out_dir, "report.html")
        html_report([t["path"] for t in traced], report)
        say(f"HTML report (the step as a picture, every rank): {report}")
    say(f"done in {time.perf_counter() - t0:.1f} s: {'replay == eager, bitwise' if ok else 'MISMATCH'}")
    return 0 if ok else 1
