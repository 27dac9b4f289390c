"""Compile time of ``torch.compile(backend="usp")`` next to ``backend="aot_eager"`` (CPU).

For the reference Llama-style model at several depths, each round compiles the same model afresh
(``torch._dynamo.reset()``) with each backend, in alternating order, and times:

- first step: the first forward + backward (Dynamo trace, backend, AOTAutograd, the backward
  compile), minus a warm step of the same compiled model: the compile time;
- backend: the time inside the backend function alone (usp: copy, rewrite, verify, AOTAutograd,
  inner compile; aot_eager: AOTAutograd). The lazily compiled backward is not inside it.

The usp model trains on packed documents (``usp_graph.documents``); the aot_eager one runs plain
SDPA. Ratios are usp / aot_eager of the medians over the rounds, all measured in one run.
Compute runs on one thread by default (``--threads``): compiling is single-threaded Python, and on
a shared machine OpenMP threads that wait on each other made a warm step 300x slower, which
swamped the subtraction.

  python tools/bench_compile.py                    # 2, 4, 8 layers, 3 rounds
  python tools/bench_compile.py --layers 4 --rounds 5 --json out/bench.jsonl   # + one JSON line per depth

Times are one-offs (`harness.stopwatch`): a compile happens once per round.
"""

from __future__ import annotations

import argparse
import copy
import statistics
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from harness import Results, add_json_arg, stopwatch

from usp_graph import AttentionMetadata, documents, usp_backend
from usp_graph.models import Llama, LlamaConfig, make_llama_batch

BACKENDS = ("aot_eager", "usp")


def _loss(model: Any, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    logits = model(batch["input_ids"], batch["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), batch["labels"].flatten(), ignore_index=-100)


def _timed_backend(name: str, spent: list[float]) -> Callable[..., Any]:
    from torch._dynamo.backends.registry import lookup_backend

    inner = usp_backend if name == "usp" else lookup_backend(name)

    def backend(gm: Any, example_inputs: Any) -> Any:
        with stopwatch() as watch:
            compiled = inner(gm, example_inputs)
        spent.append(watch.seconds)
        return compiled

    return backend


def measure(
    model: Llama, batch: dict[str, torch.Tensor], meta: AttentionMetadata, name: str
) -> dict[str, float]:
    """One fresh compile of `model` with backend `name`: compile time and backend time, seconds."""
    torch._dynamo.reset()
    model = copy.deepcopy(model)
    spent: list[float] = []
    compiled = torch.compile(model, backend=_timed_backend(name, spent), fullgraph=True)
    ctx = (lambda: documents(meta)) if name == "usp" else (lambda: documents(None))

    def step() -> float:
        with stopwatch() as watch:
            with ctx():
                loss = _loss(compiled, batch)
            loss.backward()
            model.zero_grad(set_to_none=True)
        return watch.seconds

    first = step()
    warm = statistics.median(step() for _ in range(3))
    assert len(spent) == 1, f"{name}: {len(spent)} compiles; expected one"
    return {"compile": first - warm, "backend": spent[0], "warm_step": warm}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--layers", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--docs", type=int, nargs="+", default=[37, 5, 60, 1, 25], help="document lengths")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    add_json_arg(parser)
    args = parser.parse_args()
    results = Results(args.json, bench="compile", device="cpu")
    torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    # Warm up imports and caches so the first row is not charged for them.
    warm = Llama(LlamaConfig(n_layers=1))
    warm_batch = make_llama_batch(warm.config, [4, 4])
    warm_meta = AttentionMetadata.from_position_ids(warm_batch["position_ids"])
    for name in BACKENDS:
        measure(warm, warm_batch, warm_meta, name)

    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, documents {args.docs}, {args.rounds} rounds"
    )
    print(
        "| layers | aot_eager compile s | usp compile s | ratio | aot_eager backend s | usp backend s | ratio |"
    )
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for layers in args.layers:
        config = LlamaConfig(n_layers=layers)
        model = Llama(config)
        batch = make_llama_batch(config, args.docs, generator=torch.Generator().manual_seed(layers))
        meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=len(args.docs) + 4)
        runs: dict[str, list[dict[str, float]]] = {name: [] for name in BACKENDS}
        for r in range(args.rounds):
            for name in BACKENDS if r % 2 == 0 else reversed(BACKENDS):
                runs[name].append(measure(model, batch, meta, name))
        med = {
            name: {k: statistics.median(run[k] for run in runs[name]) for k in runs[name][0]}
            for name in BACKENDS
        }
        row = {
            "layers": layers,
            **{f"{name}_{k}": v for name in BACKENDS for k, v in med[name].items()},
            "compile_ratio": med["usp"]["compile"] / med["aot_eager"]["compile"],
            "backend_ratio": med["usp"]["backend"] / med["aot_eager"]["backend"],
        }
        results.write(documents=args.docs, rounds=args.rounds, threads=torch.get_num_threads(), **row)
        print(
            f"| {layers} | {med['aot_eager']['compile']:.2f} | {med['usp']['compile']:.2f} | "
            f"{row['compile_ratio']:.2f} | {med['aot_eager']['backend']:.2f} | {med['usp']['backend']:.2f} | "
            f"{row['backend_ratio']:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
