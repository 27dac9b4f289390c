"""GPU checks for the real-model path: windowed varlen, transformers models, documents from position ids.

    PYTHONUNBUFFERED=1 python tools/check_hf_gpu.py            # on a CUDA machine
    python tools/check_hf_gpu.py --device cpu --quick           # smoke test

1. ``window``: usp's varlen op with sliding windows on CUDA (bf16, fwd + bwd) against the float64
   per-document reference (`usp_graph.testing.attention_reference`), random documents with length-1 ones,
   causal and bidirectional, GQA; relative errors must stay under 2e-2 (bf16 operands).
2. ``models``: tiny transformers Mistral (sliding window shorter than a document), Qwen2 and
   Gemma3 in float32 under ``backend="usp"`` (inductor) with packed documents, ``use_cache`` True
   and False, against each document run alone through the plain model (float32: under 1e-4).
3. ``option``: the 32K-token Llama train step of `bench_hf_gpu.py` with documents derived from
   ``position_ids`` inside the graph (``options={"documents": "position_ids"}``, capacity one slot
   per token, and ``max_docs=64``) against ``documents(meta)``: time (`harness.time_ms`) and loss.
Prints PASS/FAIL per check and ALL PASS at the end when every check passed.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F
from harness import time_ms

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.testing import attention_reference, cu_seqlens, lognormal_lengths
from usp_graph.testing import rel_err as _rel

FAILED: list[str] = []


def _report(name: str, err: float, tol: float) -> None:
    ok = err == err and err <= tol
    print(f"{name:60s} {err:.2e} (tol {tol:.0e}) {'PASS' if ok else 'FAIL'}")
    if not ok:
        FAILED.append(name)


def check_window(device: str, quick: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    total = 512 if quick else 4096
    for window, causal, (h, g) in (
        ((64, 0), True, (8, 2)),
        ((32, 16), False, (8, 8)),
        ((128, -1), False, (8, 4)),
    ):
        lengths = lognormal_lengths(total, total / 6, seed=len(FAILED) + window[0]) + [1]
        cu = cu_seqlens(lengths, device=device)
        t = sum(lengths)
        q, k, v, go = (torch.randn(t, n, 128, generator=gen).to(device, torch.bfloat16) for n in (h, g, g, h))
        for x in (q, k, v):
            x.requires_grad_()
        out = usp_graph.varlen_attn(
            q, k, v, cu, cu, max(lengths), max(lengths), is_causal=causal, enable_gqa=True, window=window
        )
        out.backward(go)
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ref_out, _ = attention_reference(q64, k64, v64, cu, is_causal=causal, window=window)
        ref_out.backward(go.double())
        for name, got, ref in zip(
            ("out", "dq", "dk", "dv"),
            (out, q.grad, k.grad, v.grad),
            (ref_out, q64.grad, k64.grad, v64.grad),
            strict=True,
        ):
            _report(f"window {window} causal={causal} H/G={h}/{g} {name}", _rel(got, ref), 2e-2)


def check_models(device: str) -> None:
    import transformers as tf

    makers = {
        "mistral": lambda: tf.MistralForCausalLM(
            tf.MistralConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                sliding_window=5,
                attn_implementation="sdpa",
            )
        ),
        "qwen2": lambda: tf.Qwen2ForCausalLM(
            tf.Qwen2Config(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=1,
                attn_implementation="sdpa",
            )
        ),
        "gemma3": lambda: tf.Gemma3ForCausalLM(
            tf.Gemma3TextConfig(
                vocab_size=128,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=16,
                sliding_window=4,
                layer_types=["sliding_attention", "full_attention"],
                attn_implementation="sdpa",
            )
        ),
    }
    lengths = [9, 1, 12, 3, 7]
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    ids = torch.randint(0, 128, pos.shape, generator=torch.Generator().manual_seed(1)).to(device)
    meta = AttentionMetadata.from_position_ids(pos, max_docs=8)
    for name, make in makers.items():
        torch.manual_seed(0)
        model = make().to(device).eval()
        alone, start = [], 0
        for n in lengths:
            alone.append(
                model(input_ids=ids[:, start : start + n], position_ids=pos[:, start : start + n]).logits
            )
            start += n
        ref = torch.cat(alone, 1)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="usp", options={"inner": "inductor"})
        for use_cache in (False, True):
            with usp_graph.documents(meta):
                out = compiled(input_ids=ids, position_ids=pos, use_cache=use_cache).logits
            _report(f"{name} use_cache={use_cache} packed vs each document alone", _rel(out, ref), 1e-4)


def check_option(device: str, quick: bool) -> None:
    import transformers as tf

    tokens = 1024 if quick else 32768
    lengths = lognormal_lengths(tokens, tokens / 17, seed=1)
    pos = torch.cat([torch.arange(n) for n in lengths])[None].to(device)
    ids = torch.randint(0, 32000, pos.shape, generator=torch.Generator().manual_seed(0)).to(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    torch.manual_seed(0)
    hidden = 256 if quick else 2048
    model = tf.LlamaForCausalLM(
        tf.LlamaConfig(
            vocab_size=32000,
            hidden_size=hidden,
            intermediate_size=2 * hidden,
            num_hidden_layers=2,
            num_attention_heads=16,
            num_key_value_heads=4,
            max_position_embeddings=tokens,
            attn_implementation="sdpa",
        )
    ).to(device, dtype)
    meta = AttentionMetadata.from_position_ids(pos, max_docs=64)
    inner = "inductor" if device == "cuda" else "aot_eager"
    rows = {}
    for name, options, docs in (
        ("documents(meta)", {}, meta),
        ("option documents, capacity T + 1", {"documents": "position_ids"}, None),
        ("option documents, max_docs=64", {"documents": "position_ids", "max_docs": 64}, None),
    ):
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="usp", options={"inner": inner, **options})

        def step(compiled=compiled, docs=docs):
            model.zero_grad(set_to_none=True)
            with usp_graph.documents(docs):
                logits = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
            loss = F.cross_entropy(logits.flatten(0, 1).float(), ids.flatten())
            loss.backward()
            return loss.detach()

        losses = []
        ms = time_ms(
            lambda step=step, losses=losses: losses.append(step()), device, warmup=2, reps=5
        ).median_ms
        rows[name] = (ms, float(losses[-1]))
        print(f"{name:40s} {rows[name][0]:8.1f} ms  loss {rows[name][1]:.5f}")
    base = rows["documents(meta)"][1]
    for name, (_, loss) in rows.items():
        _report(f"loss of {name} vs documents(meta)", abs(loss - base) / abs(base), 1e-3)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--checks", default="window,models,option")
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    checks = a.checks.split(",")
    if "window" in checks:
        check_window(a.device, a.quick)
    if "models" in checks:
        check_models(a.device)
    if "option" in checks:
        check_option(a.device, a.quick)
    print("ALL PASS" if not FAILED else f"FAILED: {FAILED}")
    return 0 if not FAILED else 1


if __name__ == "__main__":
    raise SystemExit(main())
