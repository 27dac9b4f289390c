"""What transformers' packed mask costs under usp on the CPU: eager step, peak memory, compile time.

# T packed tokens (one row), N documents

    python tools/bench_mask_cpu.py --json tools/results/benchmarks.jsonl

A 1-layer tiny transformers Llama (hidden 64, 4 heads, 2 KV heads, fp32), one row of T = 16384
tokens holding 37 documents (log-normal lengths), position ids restarting at 0, loss + backward.
Each row runs in a process of its own (peak memory is the process's maximum resident set, minus
the same process's after building the model and batch):

- ``mask_build``: transformers' own packed-mask build alone (``create_causal_mask`` for "sdpa");
- ``eager_mask``: ``"sdpa"`` with ``use_cache=False`` under ``attention_mode(meta)``: transformers
  builds its (1, 1, T, T) mask every step and usp reads it (once per tensor, in blocks of rows);
- ``eager_nomask``: ``"usp"`` under ``attention_mode(meta)``: no mask built at all;
- ``compile_mask`` / ``compile_nomask``: the first call (compile) of ``torch.compile(backend="usp")``
  (aot_eager inside) under ``documents(meta)``, with and without the mask.

The targets (issue 29): eager_mask <= 1.3 x (eager_nomask + mask_build) in time and likewise in
peak memory; compile_mask <= 1.5 x compile_nomask.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

ROWS = ("mask_build", "eager_mask", "eager_nomask", "compile_mask", "compile_nomask")


def _rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _row(row: str, tokens: int, docs: int, iters: int) -> dict:
    import torch
    import transformers as tf

    import usp_graph
    from usp_graph import AttentionMetadata
    from usp_graph.testing import lognormal_lengths

    torch.manual_seed(0)
    lengths = lognormal_lengths(tokens, tokens / docs, seed=1)
    attn = "usp" if row.endswith("nomask") else "sdpa"
    config = tf.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=tokens, attn_implementation=attn,
    )  # fmt: skip
    model = tf.LlamaForCausalLM(config)
    ids = torch.randint(0, 256, (1, tokens))
    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    meta = AttentionMetadata.from_lengths(lengths)
    base = _rss()

    def step(fn, block):
        model.zero_grad(set_to_none=True)
        with block:
            logits = fn(input_ids=ids, position_ids=pos, use_cache=False).logits
        logits.float().logsumexp(-1).mean().backward()

    if row == "mask_build":
        from transformers.masking_utils import create_causal_mask

        embeds = model.model.embed_tokens(ids)

        def run():
            create_causal_mask(
                config=model.config, inputs_embeds=embeds, attention_mask=None, cache=None, position_ids=pos
            )
    elif row.startswith("eager"):

        def run():
            step(model, usp_graph.attention_mode(meta))
    else:
        compiled = torch.compile(model, backend="usp", options={"inner": "aot_eager"})
        start = time.perf_counter()
        step(compiled, usp_graph.documents(meta))
        return {"row": row, "seconds": time.perf_counter() - start, "peak_bytes": _rss() - base}
    run()  # warm-up
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    times.sort()
    return {"row": row, "seconds": times[len(times) // 2], "peak_bytes": _rss() - base}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--docs", type=int, default=37)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--rows", default=",".join(ROWS))
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row, in this process (the parent spawns these)
    p.add_argument("--json", metavar="PATH", help="append one JSON line per row")
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(_row(a.one, a.tokens, a.docs, a.iters)))
        return 0
    results = {}
    for row in a.rows.split(","):
        cmd = [sys.executable, __file__, "--one", row, "--tokens", str(a.tokens), "--docs", str(a.docs),
               "--iters", str(a.iters)]  # fmt: skip
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
        results[row] = json.loads(out.stdout.strip().splitlines()[-1])
        r = results[row]
        print(f"{row:15s} {r['seconds']:8.3f} s  peak +{r['peak_bytes'] / 2**30:.3f} GiB")
    ratios = {}
    if {"eager_mask", "eager_nomask", "mask_build"} <= results.keys():
        em, en, mb = results["eager_mask"], results["eager_nomask"], results["mask_build"]
        ratios["step"] = em["seconds"] / (en["seconds"] + mb["seconds"])
        ratios["memory"] = em["peak_bytes"] / max(1, en["peak_bytes"] + mb["peak_bytes"])
    if {"compile_mask", "compile_nomask"} <= results.keys():
        ratios["compile"] = results["compile_mask"]["seconds"] / results["compile_nomask"]["seconds"]
    for k, v in ratios.items():
        print(f"{k}: {v:.2f}x")
    if a.json:
        from harness import Results

        out = Results(a.json, bench="mask_cpu", device="cpu")
        for r in results.values():
            out.write(settings={"tokens": a.tokens, "docs": a.docs, "iters": a.iters}, **r)
        out.write(settings={"tokens": a.tokens, "docs": a.docs}, row="ratios", **ratios)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
