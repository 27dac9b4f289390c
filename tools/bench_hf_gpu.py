"""A transformers Llama train step on packed documents: plain transformers vs backend "usp".

# T packed tokens (one row), N documents, D hidden, V vocabulary

    PYTHONUNBUFFERED=1 python tools/bench_hf_gpu.py --json $OUT/bench.jsonl  # the H200 figure
    python tools/bench_hf_gpu.py --device cpu --quick                          # smoke test

One row of T tokens holding N documents (log-normal lengths, position ids restarting at 0 per
document), one forward + backward of the token-mean next-token loss (labels never cross a
document), bf16 on GPU. Rows:

- ``hf_eager``: transformers' own training path (``use_cache=False``): it builds the packed
  (1, 1, T, T) mask from the position ids and calls SDPA with it;
- ``hf_compile``: the same under ``torch.compile`` (inductor);
- ``hf_usp``: the same model under ``torch.compile(backend="usp", options={"inner": "inductor"})``
  with ``usp_graph.documents(meta)``: the mask is recognised and every SDPA becomes varlen;
- ``own_usp``: usp_graph's own Llama-style model of the same size under backend usp: the speed
  the transformers model should reach.

Each row: median ms of several steps after warm-up (compile excluded; `harness.time_ms`), peak
memory, and the loss (`--json PATH` appends one JSON line per row);
the transformers rows share weights, so their losses are compared (PASS below 2e-2 relative).
"""

from __future__ import annotations

import argparse
from typing import Any

import torch
import torch.nn.functional as F
from harness import Results, add_json_arg, stopwatch, time_ms
from hf_llama import add_size_args, hf_llama, use_quick_sizes

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.models import Llama, LlamaConfig
from usp_graph.testing import lognormal_lengths

TOLERANCE = 2e-2


def _batch(
    lengths: list[int], vocab: int, device: str, *, for_model: bool = False
) -> dict[str, torch.Tensor]:
    """One packed row. ``labels``: each token's next token in its document (-100 at a document's
    last token), for a loss taken on the logits as they are; ``for_model``: the form a model's own
    ``labels=`` loss shifts itself (``DataCollatorWithFlattening``'s: the ids, -100 at each
    document's first token)."""
    gen = torch.Generator().manual_seed(0)
    tokens = sum(lengths)
    ids = torch.randint(0, vocab, (tokens,), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = ids.clone() if for_model else torch.full((tokens,), -100)
    start = 0
    for n in lengths:
        if for_model:
            labels[start] = -100
        else:
            labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    return {k: v[None].to(device) for k, v in (("input_ids", ids), ("position_ids", pos), ("labels", labels))}


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def _time(step, device: str, warmup: int, iters: int) -> tuple[float, float, float]:
    """(median ms, peak GiB, loss) of `step()` (which returns the loss and runs backward)."""
    losses = []
    for _ in range(warmup):
        losses.append(step())
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    ms = time_ms(lambda: losses.append(step()), device, warmup=0, reps=iters).median_ms
    peak = torch.cuda.max_memory_allocated() / 2**30 if device == "cuda" else float("nan")
    return ms, peak, float(losses[-1])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=32768)
    p.add_argument("--docs", type=int, default=17, help="about this many documents (log-normal lengths)")
    add_size_args(p)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--rows", default="hf_eager,hf_compile,hf_usp,own_usp")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke test)")
    add_json_arg(p)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.docs = 256, 5
        use_quick_sizes(a)
        a.iters, a.warmup = 2, 1

    device = a.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inner = "inductor" if device == "cuda" else "aot_eager"
    lengths = lognormal_lengths(a.tokens, a.tokens / a.docs, seed=1)
    batch = _batch(lengths, a.vocab, device)
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 8, device=device)
    hf = hf_llama(a, "sdpa", tokens=a.tokens, device=device)
    own = Llama(
        LlamaConfig(
            vocab_size=a.vocab,
            dim=a.hidden,
            n_layers=a.layers,
            n_heads=a.heads,
            n_kv_heads=a.kv_heads,
            ffn_dim=a.ffn,
        )
    ).to(device=device, dtype=dtype)

    def hf_step(model, docs: AttentionMetadata | None):
        def step():
            hf.zero_grad(set_to_none=True)
            with usp_graph.documents(docs):
                logits = model(
                    input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
                ).logits
            loss = _loss(logits, batch["labels"])
            loss.backward()
            return loss.detach()

        return step

    def own_step(model):
        def step():
            own.zero_grad(set_to_none=True)
            with usp_graph.documents(meta):
                logits = model(batch["input_ids"], batch["position_ids"])
            loss = _loss(logits, batch["labels"])
            loss.backward()
            return loss.detach()

        return step

    makers: dict[str, Any] = {
        "hf_eager": lambda: hf_step(hf, None),
        "hf_compile": lambda: hf_step(torch.compile(hf), None),
        "hf_usp": lambda: hf_step(torch.compile(hf, backend="usp", options={"inner": inner}), meta),
        "own_usp": lambda: own_step(torch.compile(own, backend="usp", options={"inner": inner})),
    }
    results = []
    print(
        f"T={a.tokens} N={len(lengths)} D={a.hidden} layers={a.layers} H={a.heads}/{a.kv_heads} {dtype} on {device}"
    )
    for name in a.rows.split(","):
        torch._dynamo.reset()
        try:
            with stopwatch(device) as watch:
                ms, peak, loss = _time(makers[name](), device, a.warmup, a.iters)
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
            print(f"{name:10s} FAILED: {type(e).__name__}: {str(e)[:300]}")
            results.append({"row": name, "error": f"{type(e).__name__}: {e}"[:2000]})
            continue
        results.append({"row": name, "ms": ms, "peak_gib": peak, "loss": loss, "setup_s": watch.seconds})
        print(
            f"{name:10s} {ms:9.1f} ms  peak {peak:6.1f} GiB  loss {loss:.5f}  (setup+timing {results[-1]['setup_s']:.0f} s)"
        )
    by = {r["row"]: r for r in results if "ms" in r}
    if "hf_eager" in by and "hf_usp" in by:
        rel = abs(by["hf_usp"]["loss"] - by["hf_eager"]["loss"]) / abs(by["hf_eager"]["loss"])
        verdict = "PASS" if rel < TOLERANCE else "FAIL"
        print(f"loss hf_usp vs hf_eager: rel diff {rel:.2e} {verdict}")
        print(f"speed-up hf_usp over hf_eager: {by['hf_eager']['ms'] / by['hf_usp']['ms']:.2f}x")
    if "own_usp" in by and "hf_usp" in by:
        print(f"hf_usp / own_usp time: {by['hf_usp']['ms'] / by['own_usp']['ms']:.3f}")
    out = Results(a.json, bench="hf", device=device)
    settings = {k: v for k, v in vars(a).items() if k != "json"}
    for r in results:
        out.write(settings=settings, lengths=lengths, **r)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
