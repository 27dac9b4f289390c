"""Ring attention: one kernel call per ring step vs one per chunk pair (issue 19), on one GPU.

# T tokens, H heads, K head dim, C chunks per rank

    python tools/bench_ring_steps.py --json $OUT/ring_steps.jsonl
Smoke test of the logic on CPU (gloo, tiny shapes):
    python tools/bench_ring_steps.py --device cpu --quick

``usp::ring_attn_fwd`` + ``usp::ring_attn_bwd`` at world size 1 (a one-rank process group: one
ring step, every local chunk against every local chunk, no communication), with C = 2 and 4 chunks
per rank in zigzag order (C = 4 is what 2-D USP hands the ring at P = 2), timed fwd+bwd two ways
in the same process, interleaved:
- "per_step": the op as it is, one varlen call per kernel-argument group and one merge per step;
- "per_pair": the op's structure before issue 19, one varlen call and one merge per (query chunk,
  key chunk) pair: `ring._views`, `ring._calls` and `ring._merge_step` are swapped for the run for
  one view and one call per pair and one `_merge_step` per partial result.
Both are checked against each other (rel err of out, dq, dk, dv), their varlen kernel calls are
counted (`kernel_calls`), and the memory one fwd+bwd allocates is read (`peak_extra_gib`).
"""

from __future__ import annotations

import argparse
import contextlib
import sys

import torch
import torch.distributed as dist
from harness import Results, add_json_arg, attention_flops, log, peak_extra_gib, time_interleaved
from kernel_calls import kernel_calls

import usp_graph.ops  # noqa: F401  (registers the ops)
from usp_graph.ops import ring
from usp_graph.ops.window import NO_WINDOW
from usp_graph.testing import cu_seqlens, lognormal_lengths

ZIGZAG = {1: [0], 2: [0, 1], 4: [0, 3, 1, 2]}  # chunk order of one rank (C = 4: two zigzag ranks)


def pair_views(q_ids, k_ids, chunk, cu, is_causal, max_seqlen, window=NO_WINDOW):
    """One view per (query chunk, key chunk) pair with work, windowless: what the op ran before
    issue 19."""
    if window != NO_WINDOW:
        raise ValueError("the per-pair mode is windowless only")
    for qi, qc in enumerate(q_ids):
        for ki, kc in enumerate(k_ids):
            plan = ring._pair_plan(qc, kc, chunk, is_causal, window)
            if plan is not None:
                cu_q, cu_k = ring.pair_view(cu, qc * chunk, kc * chunk, chunk)
                rows, keys = slice(qi * chunk, (qi + 1) * chunk), slice(ki * chunk, (ki + 1) * chunk)
                yield ring._View([qi], [rows], [keys], cu_q, cu_k, plan[0] == "causal", (), max_seqlen)


@contextlib.contextmanager
def per_pair():
    """The op as it ran before issue 19: one kernel call and one merge per chunk pair."""
    saved = ring._views, ring._calls, ring._merge_step
    merge = ring._merge_step
    ring._views = pair_views
    ring._calls = lambda views: [ring._Call([p], p.causal, NO_WINDOW) for p in views]
    ring._merge_step = lambda out, lse, parts, seen: [merge(out, lse, [p], seen) for p in parts]
    try:
        yield
    finally:
        ring._views, ring._calls, ring._merge_step = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=65536)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--mean", type=int, default=8192, help="mean document length (log-normal)")
    ap.add_argument("--chunks", default="2,4", help="chunks per rank, comma-separated")
    ap.add_argument("--bidirectional", action="store_true", help="non-causal attention")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true", help="tiny shapes (a smoke test)")
    add_json_arg(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    if args.quick:
        args.tokens, args.heads, args.head_dim, args.mean, args.reps = 512, 4, 32, 64, 3
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    causal = not args.bidirectional
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)  # fmt: skip
    group = dist.group.WORLD.group_name
    results = Results(args.json, bench="ring_steps", device=device)
    lengths = lognormal_lengths(args.tokens, args.mean, 0)
    cu = cu_seqlens(lengths, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    t, h, kd = args.tokens, args.heads, args.head_dim
    q, k, v, go = (torch.randn(t, h, kd, generator=gen, device=device, dtype=dtype) for _ in range(4))
    flops = attention_flops(lengths, h, kd, causal)[1]
    log(f"T={t} H={h} K={kd} {dtype} causal={causal}, {len(lengths)} documents (mean {args.mean})")
    for c in (int(x) for x in args.chunks.split(",")):
        ids = ZIGZAG[c]

        def fwd_bwd(c=c, ids=ids):
            ql, kl, vl = (x.detach().requires_grad_() for x in (q, k, v))
            out, _ = torch.ops.usp.ring_attn_fwd(
                ql, kl, vl, cu, max(lengths), causal, kd**-0.5, ids, c, group
            )
            out.backward(go)
            return out, ql.grad, kl.grad, vl.grad

        def pairwise():
            with per_pair():
                return fwd_bwd()

        runs = {"per_pair": pairwise, "per_step": fwd_bwd}
        got, calls, mem = {}, {}, {}
        for name, fn in runs.items():
            got[name], calls[name] = kernel_calls(fn) if device.type == "cuda" else (fn(), {})
            mem[name] = peak_extra_gib(fn, device)
        err = {
            n: ((a.float() - b.float()).norm() / b.float().norm()).item()
            for n, a, b in zip(("out", "dq", "dk", "dv"), got["per_step"], got["per_pair"], strict=True)
        }
        del got
        times = time_interleaved(runs, device, reps=args.reps)
        for name in runs:
            ms = times[name].median_ms
            rec = results.write(
                mode=name, tokens=t, heads=h, head_dim=kd, chunks_per_rank=c, causal=causal,
                documents=len(lengths), fwd_bwd_ms=ms, tflops=flops / ms / 1e9, kernel_calls=calls[name],
                peak_extra_gib=mem[name], rel_err_vs_per_pair=err, timing=times[name].as_dict(),
            )  # fmt: skip
            log(
                f"C={c} {name:9s} fwd+bwd {ms:8.3f} ms  {rec['tflops']:6.1f} TFLOP/s  calls {calls[name]}  "
                f"extra memory {mem[name]:.2f} GiB  rel err vs per_pair {err}"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
