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
- ``usp_inductor`` (optional): ``"usp"`` + plain ``torch.compile``, documents from the position ids
  inside the graph (no block, no host sync).

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
from typing import Any

import torch
import torch.nn.functional as F
from bench_hf_gpu import _batch  # the same packed row: ids, restarting positions, in-document labels
from harness import Results, add_json_arg, stopwatch, time_ms

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.testing import lognormal_lengths

ROWS = ("flex", "sdpa", "usp", "sdpa_usp", "usp_inductor")
_ATTN = {"flex": "flex_attention", "sdpa": "sdpa", "usp": "usp", "sdpa_usp": "sdpa", "usp_inductor": "usp"}


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


def _step(model, compiled, batch: dict[str, torch.Tensor], docs: AttentionMetadata | None):
    """One train step (loss + backward), under `documents(docs)` when given."""

    def step() -> torch.Tensor:
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(docs) if docs is not None else contextlib.nullcontext():
            logits = compiled(
                input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False
            ).logits
        loss = F.cross_entropy(logits.flatten(0, 1).float(), batch["labels"].flatten(), ignore_index=-100)
        loss.backward()
        return loss.detach()

    return step


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="8192,32768,65536,131072,262144", help="comma-separated lengths")
    p.add_argument("--rows", default="flex,sdpa,usp,sdpa_usp")
    p.add_argument("--sdpa-max", type=int, default=32768, help="row sdpa only up to this many tokens")
    p.add_argument("--checkpoint-from", type=int, default=262144, help="activation checkpointing from T on")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--ffn", type=int, default=5632)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--no-profile", action="store_true")
    p.add_argument("--top", type=int, default=0, help="list this many kernels of the profiled step")
    p.add_argument("--quick", action="store_true", help="tiny sizes on any device (a smoke test)")
    add_json_arg(p)
    a = p.parse_args(argv)
    if a.quick:
        a.tokens, a.hidden, a.layers, a.heads, a.kv_heads, a.ffn, a.vocab = "256,512", 64, 2, 4, 2, 128, 128
        a.iters, a.warmup, a.sdpa_max, a.checkpoint_from = 2, 1, 512, 512
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            p.error(f"--rows: {r!r} is not one of {', '.join(ROWS)}")
    import transformers as tf

    from usp_graph.ops import cudnn_kernel

    device = a.device
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    inner = "inductor" if device == "cuda" else "aot_eager"
    cudnn = device == "cuda" and cudnn_kernel.available()
    out = Results(a.json, bench="long", device=device)
    print(
        f"cuDNN frontend: {'installed' if cudnn else 'missing'}; torch {torch.__version__}, transformers {tf.__version__}"
    )
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)

    for tokens in (int(t) for t in a.tokens.split(",")):
        lengths = lognormal_lengths(tokens, _mean_doc(tokens), seed=1)
        batch = _batch(lengths, a.vocab, device)
        meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 8, device=device)
        ckpt = tokens >= a.checkpoint_from
        print(f"T={tokens} N={len(lengths)} longest={max(lengths)} checkpointing={ckpt}")
        for row in rows:
            if row == "sdpa" and tokens > a.sdpa_max:
                continue
            torch._dynamo.reset()
            gc.collect()
            if device == "cuda":
                torch.cuda.empty_cache()
            torch.manual_seed(0)
            config = tf.LlamaConfig(
                vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.ffn, num_hidden_layers=a.layers,
                num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
                max_position_embeddings=max(tokens, 2048), attn_implementation=_ATTN[row],
            )  # fmt: skip
            model = tf.LlamaForCausalLM(config).to(device=device, dtype=dtype)
            model.train()
            if ckpt:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            if row in ("usp", "sdpa_usp"):
                compiled = torch.compile(model, backend="usp", options={"inner": inner})
                docs = meta
            else:
                compiled = torch.compile(model) if device == "cuda" else model
                docs = None
            step = _step(model, compiled, batch, docs)
            record: dict[str, Any] = {
                "row": row,
                "tokens": tokens,
                "documents": len(lengths),
                "checkpointing": ckpt,
            }
            try:
                with stopwatch(device) as watch:
                    losses = [step() for _ in range(a.warmup)]
                record["compile_and_warmup_s"] = round(watch.seconds, 1)
                if row.startswith("usp") or row == "sdpa_usp":
                    from kernel_calls import kernel_calls

                    _, record["kernels"] = kernel_calls(step)
                if device == "cuda":
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                timing = time_ms(lambda: losses.append(step()), device, warmup=0, reps=a.iters)  # noqa: B023
                record["ms"] = round(timing.median_ms, 2)
                record["peak_gib"] = (
                    round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else None
                )
                record["loss"] = float(losses[-1])
                if not a.no_profile:
                    record["profile_ms"] = _profile(step, device, a.top)
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
            out.write(settings={k: v for k, v in vars(a).items() if k != "json"}, cudnn=cudnn, **record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
