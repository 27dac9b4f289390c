"""Tracing cost of `usp_graph.trace_train_step` next to plain make_fx of the same train step.

For the reference Llama-style model at several depths, times (one run each, same process):
- usp: `trace_train_step` = pre-dispatch forward trace + rewrite_sdpa + joint + verify, with the
  per-pass split;
- plain: ``make_fx(step, tracing_mode="symbolic")`` of forward + loss + ``torch.autograd.grad``
  with SDPA left alone (what a user would get without usp_graph).

  python tools/bench_trace.py                     # 8, 16, 32 layers
  python tools/bench_trace.py --layers 4 8 --docs 5 9 3 --json out/bench.jsonl

Times are one-offs (`harness.stopwatch`); `--json PATH` appends one JSON line per depth.
"""

from __future__ import annotations

import argparse

import torch
from harness import Results, add_json_arg, stopwatch
from torch.fx.experimental.proxy_tensor import make_fx

from usp_graph import AttentionMetadata, trace_train_step
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch


def plain_make_fx(model: Llama, batch: dict[str, torch.Tensor]) -> tuple[float, int]:
    names = [n for n, _ in model.named_parameters()]

    def step(params, b):
        loss = torch.func.functional_call(
            model, dict(zip(names, params, strict=True)), (b["input_ids"], b["position_ids"])
        )
        loss = torch.nn.functional.cross_entropy(loss.flatten(0, 1), b["labels"].flatten(), ignore_index=-100)
        return loss, torch.autograd.grad(loss, params)

    params = [p.detach().requires_grad_() for p in model.parameters()]
    with stopwatch() as watch:
        gm = make_fx(step, tracing_mode="symbolic")(params, batch)
    return watch.seconds, len(gm.graph.nodes)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[8, 16, 32])
    parser.add_argument("--docs", type=int, nargs="+", default=[37, 5, 60, 1, 25], help="document lengths")
    add_json_arg(parser)
    args = parser.parse_args()
    results = Results(args.json, bench="trace", device="cpu")
    torch.manual_seed(0)
    # Warm up imports and dispatcher caches so the first row is not charged for them.
    warm = Llama(LlamaConfig(n_layers=1))
    warm_batch = make_llama_batch(warm.config, [4, 4])
    trace_train_step(
        warm, llama_loss, warm_batch, AttentionMetadata.from_position_ids(warm_batch["position_ids"])
    )
    plain_make_fx(warm, warm_batch)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, documents {args.docs}")
    print(
        "| layers | usp trace (s) | trace / rewrite / joint / verify (s) | nodes | plain make_fx (s) | nodes | ratio |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for layers in args.layers:
        config = LlamaConfig(n_layers=layers)
        model = Llama(config)
        batch = make_llama_batch(config, args.docs, generator=torch.Generator().manual_seed(layers))
        meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=len(args.docs) + 4)
        with stopwatch() as watch:
            graph = trace_train_step(model, llama_loss, batch, meta)
        usp = watch.seconds
        passes = {r.name: r.seconds for r in graph.run.results}
        forward = usp - sum(passes.values())
        split = " / ".join(f"{s:.2f}" for s in (forward, *passes.values()))
        plain, plain_nodes = plain_make_fx(model, batch)
        nodes = len(graph.graph_module.graph.nodes)
        results.write(layers=layers, documents=args.docs, usp_trace_s=usp, forward_s=forward, passes_s=passes,
                      usp_nodes=nodes, plain_make_fx_s=plain, plain_nodes=plain_nodes, ratio=usp / plain)  # fmt: skip
        print(
            f"| {layers} | {usp:.2f} | {split} | {nodes} | {plain:.2f} | {plain_nodes} | {usp / plain:.2f}x |",
            flush=True,
        )


if __name__ == "__main__":
    main()
