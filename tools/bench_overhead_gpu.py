"""The rewrite's own cost: `sdpa_to_usp` (pack, metadata, unpack) vs the bare varlen op.

# B batch, H heads, L length, K head dim, T packed tokens

    PYTHONUNBUFFERED=1 python tools/bench_overhead_gpu.py       # on a GPU
    python tools/bench_overhead_gpu.py --device cpu --quick     # smoke test

fwd+bwd of one attention call on packed documents (bf16, H=16, K=128, log-normal documents), three
ways: `varlen_attn` on already-packed (T, H, K) tensors (the floor); `sdpa_to_usp` on the layout
models produce, q = (B, L, H, K).transpose(1, 2) (pack is then a free view); and `sdpa_to_usp` on
contiguous (B, H, L, K) tensors (pack and unpack copy). Overhead = extra time / floor. Median of
CUDA-event timings; the three alternate in each round (`harness.time_interleaved`). `--json PATH`
appends one JSON line per row.
"""

from __future__ import annotations

import argparse
import functools
import sys

import torch
from harness import Results, add_json_arg, time_interleaved

from usp_graph import AttentionMetadata, sdpa_to_usp, varlen_attn
from usp_graph.testing import lognormal_lengths


def bare(packed, meta, causal):
    """The floor: the varlen op on already-packed (T, H, K) tensors, fwd + bwd."""
    q, k, v = (x.detach().requires_grad_() for x in packed[:3])
    m = meta.max_seqlen
    out = varlen_attn(q, k, v, meta.cu_seqlens, meta.cu_seqlens, m, m, is_causal=causal)
    out.backward(packed[3])


def via_usp(inputs, meta, causal):
    """One SDPA call through sdpa_to_usp (pack -> varlen -> unpack), fwd + bwd."""
    q, k, v = (x.detach().requires_grad_() for x in inputs[:3])
    out = sdpa_to_usp(q, k, v, is_causal=causal, metadata=meta)
    out.backward(inputs[3])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32768,65536")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    add_json_arg(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    results = Results(args.json, bench="overhead", device=device)
    h, k, mean = (16, 128, 2048) if not args.quick else (4, 16, 40)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    tokens = [int(t) for t in args.tokens.split(",")] if not args.quick else [256]
    print(
        "| tokens | mode | bare varlen ms | sdpa_to_usp, model layout ms | overhead | sdpa_to_usp, contiguous BHLK ms | overhead |"
    )
    print("|---|---|---|---|---|---|---|")
    for t in tokens:
        meta = AttentionMetadata.from_lengths(lognormal_lengths(t, mean, 0), device=device)
        for causal in (True, False):
            x = [torch.randn(1, t, h, k, device=device, dtype=dtype) for _ in range(4)]
            packed = [v[0] for v in x]  # (T, H, K)
            model_layout = [v.transpose(1, 2) for v in x]  # (B, H, L, K) views, as attention modules make
            contiguous = [v.contiguous() for v in model_layout]

            fns = {
                "bare": functools.partial(bare, packed, meta, causal),
                "model": functools.partial(via_usp, model_layout, meta, causal),
                "contig": functools.partial(via_usp, contiguous, meta, causal),
            }
            timings = time_interleaved(fns, device, warmup=1, reps=args.reps)
            med = {name: t.median_ms for name, t in timings.items()}
            results.write(tokens=t, mode="causal" if causal else "bi", heads=h, head_dim=k, doc_mean=mean,
                          dtype=str(dtype), **{name: t.as_dict() for name, t in timings.items()})  # fmt: skip
            print(
                f"| {t} | {'causal' if causal else 'bi'} | {med['bare']:.3f} | {med['model']:.3f} | "
                f"{(med['model'] / med['bare'] - 1) * 100:+.1f}% | {med['contig']:.3f} | "
                f"{(med['contig'] / med['bare'] - 1) * 100:+.1f}% |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
