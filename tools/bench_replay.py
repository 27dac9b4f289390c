"""Graph files on CPU: save and load time, and a loaded graph's replay step time next to eager.

For the reference Llama-style and Flux-style models, in one run (same process, same inputs):
- trace: `trace_train_step` (for scale);
- save / file size: `usp_graph.save`;
- load: `usp_graph.load` (fake values rebuilt, the default) and ``load(values=False)``, plus, in a
  fresh interpreter, ``import usp_graph`` and the first `load` (cold caches);
- step: one training step's forward + backward (loss and every grad), median over `--steps`
  steps, eager `attention_mode` and replay of the LOADED graph measured on the same inputs in the
  same iteration, which one goes first alternating, so drift and allocator state hit both;
  ratio = replay / eager (goal: <= 1). Each replay is checked bitwise against its eager step.

  python tools/bench_replay.py                       # both models, default sizes, torch's threads
  python tools/bench_replay.py --threads 1 --steps 20
  python tools/bench_replay.py --json out/bench.jsonl   # + one JSON line per model

Every time here is a one-off (`harness.stopwatch`): the steps change inputs each iteration and
alternate with eager, so each is timed alone and the medians are taken here.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

import torch
from harness import Results, add_json_arg, stopwatch
from setups import FLUX_DYNAMIC, flux_model, llama_inputs, llama_model

import usp_graph
from usp_graph import AttentionMetadata, attention_mode, trace_train_step
from usp_graph.models import FluxConfig, LlamaConfig, flux_loss, llama_loss, make_flux_batch


def _llama(args: argparse.Namespace):
    config = LlamaConfig(
        vocab_size=1024, dim=args.dim, n_layers=args.layers, n_heads=8, n_kv_heads=4, ffn_dim=4 * args.dim
    )
    model = llama_model(config, seed=0)
    gen = torch.Generator().manual_seed(1)

    def inputs(step: int):
        lengths = (torch.rand(8, generator=gen) * args.tokens / 4 + 1).long().tolist()
        lengths[-1] = max(1, args.tokens - sum(lengths[:-1])) if sum(lengths[:-1]) < args.tokens else 1
        return llama_inputs(config, lengths, gen, max_docs=16, max_seqlen=args.tokens)

    return "llama", model, llama_loss, inputs, None


def _flux(args: argparse.Namespace):
    head_dim = args.dim // 8
    a0 = 2 * (head_dim // 8)
    a1 = 2 * ((head_dim - a0) // 4)
    config = FluxConfig(
        hidden=args.dim,
        n_heads=8,
        n_double=args.layers // 2 or 1,
        n_single=args.layers // 2 or 1,
        axes_dims=(a0, a1, head_dim - a0 - a1),
    )
    model = flux_model(config, seed=0)
    gen = torch.Generator().manual_seed(1)
    txt = max(2, args.tokens // 8)

    def inputs(step: int):
        img = args.tokens - txt - 16 * (step % 3)  # image length changes from step to step
        batch = make_flux_batch(config, 2, txt, img, generator=gen, grid_width=16)
        return batch, AttentionMetadata.per_sample(2, txt + img)

    return "flux", model, flux_loss, inputs, FLUX_DYNAMIC


def _eager_step(model, loss_fn, batch, meta):
    model.zero_grad(set_to_none=True)
    with attention_mode(meta):
        loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in model.named_parameters()}


def _cold_load_s(path: str) -> tuple[float, float]:
    """(import usp_graph s, first load s) in a fresh interpreter (timed inside it: loading the
    harness there first would import torch before usp_graph and hide that cost)."""
    code = (
        "import time; t0 = time.perf_counter(); import usp_graph; t1 = time.perf_counter(); "
        f"usp_graph.load({path!r}); print(t1 - t0, time.perf_counter() - t1)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    imp, load = out.stdout.strip().splitlines()[-1].split()
    return float(imp), float(load)


def bench(setup, args: argparse.Namespace, folder: str) -> dict:
    name, model, loss_fn, inputs, dynamic = setup(args)
    batch, meta = inputs(0)
    with stopwatch() as trace_watch:
        graph = trace_train_step(model, loss_fn, batch, meta, dynamic=dynamic)
    path = os.path.join(folder, name + usp_graph.graphfile.SUFFIX)
    with stopwatch() as save_watch:
        usp_graph.save(graph, path)
    trace_s, save_s = trace_watch.seconds, save_watch.seconds
    loads = []
    for values in (True, False):
        times = []
        for _ in range(args.loads):
            with stopwatch() as watch:
                step = usp_graph.load(path, values=values)
            times.append(watch.seconds)
        loads.append(statistics.median(times))
    cold_import, cold_load = _cold_load_s(path)
    step = usp_graph.load(path)
    params = dict(model.named_parameters())
    eager_t, replay_t = [], []
    for i in range(args.warmup + args.steps):
        b, m = inputs(i + 1)
        ref_loss = ref_grads = loss = grads = None  # neither run pays for the other's live results
        # Alternate which goes first, so allocator and cache state favour neither.
        for which in ("eager", "replay") if i % 2 == 0 else ("replay", "eager"):
            with stopwatch() as watch:
                if which == "eager":
                    ref_loss, ref_grads = _eager_step(model, loss_fn, b, m)
                else:
                    loss, grads = step.replay(params, b, m)
            if i >= args.warmup:
                (eager_t if which == "eager" else replay_t).append(watch.seconds)
        if not (torch.equal(loss, ref_loss) and all(torch.equal(grads[n], g) for n, g in ref_grads.items())):
            raise SystemExit(f"{name}: replay differs from eager at step {i}")
    eager_ms, replay_ms = statistics.median(eager_t) * 1e3, statistics.median(replay_t) * 1e3
    return {
        "model": name,
        "params": sum(p.numel() for p in model.parameters()),
        "tokens": meta.total_tokens,
        "nodes": len(graph.graph_module.graph.nodes),
        "trace_s": trace_s,
        "save_ms": save_s * 1e3,
        "file_kb": os.path.getsize(path) / 1024,
        "load_ms": loads[0] * 1e3,
        "load_no_values_ms": loads[1] * 1e3,
        "cold_import_s": cold_import,
        "cold_load_ms": cold_load * 1e3,
        "eager_ms": eager_ms,
        "replay_ms": replay_ms,
        "ratio": replay_ms / eager_ms,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", default=["llama", "flux"], choices=["llama", "flux"])
    parser.add_argument("--dim", type=int, default=256, help="model width (default 256)")
    parser.add_argument(
        "--layers", type=int, default=4, help="layers (Flux: half double, half single; default 4)"
    )
    parser.add_argument("--tokens", type=int, default=1024, help="tokens per step (default 1024)")
    parser.add_argument("--steps", type=int, default=10, help="timed steps (default 10)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--loads", type=int, default=5, help="timed loads (median; default 5)")
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    add_json_arg(parser)
    args = parser.parse_args(argv)
    results = Results(args.json, bench="replay", device="cpu")
    if args.threads:
        torch.set_num_threads(args.threads)
    setups = {"llama": _llama, "flux": _flux}
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            rows.append(bench(setups[name], args, folder))
            results.write(settings={k: v for k, v in vars(args).items() if k != "json"}, **rows[-1])
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, dim {args.dim}, {args.layers} layers, "
        f"~{args.tokens} tokens/step, median of {args.steps} steps"
    )
    print(
        "| model | params | nodes | file KB | save ms | load ms | load ms (no values) | fresh process: import s, load ms "
        "| eager step ms | replay step ms | replay / eager |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['model']} | {r['params'] / 1e6:.2f}M | {r['nodes']} | {r['file_kb']:.0f} | {r['save_ms']:.0f} | "
            f"{r['load_ms']:.0f} | {r['load_no_values_ms']:.0f} | {r['cold_import_s']:.2f}, {r['cold_load_ms']:.0f} | "
            f"{r['eager_ms']:.1f} | {r['replay_ms']:.1f} | {r['ratio']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
