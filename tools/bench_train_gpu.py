"""Train-step speed on packed documents: backend="usp" (inductor) vs padded SDPA (inductor).

# B padded batch rows, L length, T packed tokens, N documents

    PYTHONUNBUFFERED=1 python tools/bench_train_gpu.py --json $OUT/train.json     # on a GPU
    python tools/bench_train_gpu.py --device cpu --quick                          # smoke test

Both paths train the same Llama-style model (bf16 on GPU) on the same documents (log-normal
lengths): usp packs them into one row of T tokens and compiles with
``torch.compile(backend="usp", options={"inner": "inductor"})`` under ``usp_graph.documents``;
the baseline pads each document to the longest into (N, Lmax) rows and compiles with the default
inductor backend, with labels -100 on padding. Equal useful tokens; one fwd+bwd step (no
optimizer) timed as the median of several after warm-up (compile excluded). The two losses are
compared first (same model, same tokens).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import usp_graph  # noqa: E402
from usp_graph import AttentionMetadata  # noqa: E402
from usp_graph.models import Llama, LlamaConfig  # noqa: E402


def doc_lengths(total: int, mean: float, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    out: list[int] = []
    while sum(out) < total:
        n = int(torch.empty(1).log_normal_(math.log(mean) - 0.5, 1.0, generator=gen).clamp(min=2).item())
        out.append(min(n, total - sum(out)))
    if out[-1] < 2:
        out[-2] += out.pop()
    return out


def packed_batch(lengths, vocab, device, gen):
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.full_like(ids, -100)
    start = 0
    for n in lengths:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    return ids[None].to(device), pos[None].to(device), labels[None].to(device)


def padded_batch(lengths, ids, labels, device):
    lmax = max(lengths)
    n = len(lengths)
    pid = torch.zeros(n, lmax, dtype=torch.long)
    ppos = torch.arange(lmax).expand(n, lmax).clone()
    plab = torch.full((n, lmax), -100, dtype=torch.long)
    start = 0
    for i, ln in enumerate(lengths):
        pid[i, :ln] = ids[0, start : start + ln].cpu()
        plab[i, :ln] = labels[0, start : start + ln].cpu()
        start += ln
    return pid.to(device), ppos.to(device), plab.to(device)


def loss_of(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def timed(fn, reps, device):
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            torch.cuda.synchronize()
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            fn()
            b.record()
            torch.cuda.synchronize()
            times.append(a.elapsed_time(b))
        else:
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--doc-mean", type=float, default=2048)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.doc_mean, args.dim, args.layers, args.heads, args.kv_heads, args.reps = (
            256,
            40,
            64,
            1,
            4,
            2,
            2,
        )
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = LlamaConfig(
        vocab_size=32000 if not args.quick else 256,
        dim=args.dim,
        n_layers=args.layers,
        n_heads=args.heads,
        n_kv_heads=args.kv_heads,
        ffn_dim=int(args.dim * 8 / 3) // 64 * 64,
    )
    torch.manual_seed(0)
    model = Llama(config).to(device=device, dtype=dtype)
    lengths = doc_lengths(args.tokens, args.doc_mean, 0)
    gen = torch.Generator().manual_seed(1)
    ids, pos, labels = packed_batch(lengths, config.vocab_size, device, gen)
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 16, device=device)
    pid, ppos, plab = padded_batch(lengths, ids, labels, device)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}; "
          f"model dim {args.dim} x {args.layers} layers, H={args.heads}, G={args.kv_heads}; {sum(lengths)} tokens in "
          f"{len(lengths)} documents (max {max(lengths)}); padded batch {tuple(pid.shape)}", flush=True)  # fmt: skip

    usp_model = torch.compile(model, backend="usp", options={"inner": "inductor"})
    pad_model = torch.compile(model)

    def usp_step():
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(meta):
            loss = loss_of(usp_model(ids, pos), labels)
        loss.backward()
        return loss

    def pad_step():
        model.zero_grad(set_to_none=True)
        loss = loss_of(pad_model(pid, ppos), plab)
        loss.backward()
        return loss

    rows = {}
    for name, step in (("usp (inductor)", usp_step), ("padded SDPA (inductor)", pad_step)):
        t0 = time.perf_counter()
        loss = step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = timed(step, args.reps, device)
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        rows[name] = {"loss": float(loss.detach()), "ms": ms, "compile_s": compile_s, "peak_gib": peak,
                      "tokens_per_s": sum(lengths) / ms * 1e3}  # fmt: skip
        print(f"{name}: loss {float(loss.detach()):.5f}, step {ms:.2f} ms, {rows[name]['tokens_per_s']:.0f} tok/s, "
              f"peak {peak:.2f} GiB, first step {compile_s:.1f} s", flush=True)  # fmt: skip
    a, b = rows["usp (inductor)"], rows["padded SDPA (inductor)"]
    rel = abs(a["loss"] - b["loss"]) / abs(b["loss"])
    print(f"\nloss agreement: rel diff {rel:.1e} ({'PASS' if rel < 2e-2 else 'FAIL'})")
    print("| path | step ms | tokens/s | speedup | peak GiB |")
    print("|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {b['ms'] / r['ms']:.2f}x | {r['peak_gib']:.2f} |"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {"torch": torch.__version__, "lengths": lengths, "rows": rows, "loss_rel_diff": rel},
                f,
                indent=1,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
