"""Bytes each rank sends per attention call, per CP strategy, measured from the ops.

# T global tokens, H heads, G kv heads, K head dim, P ranks

    torchrun --nproc-per-node 2 tools/bench_cp_bytes.py
    torchrun --nproc-per-node 4 tools/bench_cp_bytes.py --json out/bench.jsonl   # + JSON lines

Runs one causal attention call forward + backward per strategy on gloo (CPU) with log-normal
documents, counts what usp's ops send (`usp_graph.distributed.count_bytes_sent`), and prints it
next to the cost model (`usp_graph.cp.cost.bytes_sent`) and the document-aware lower bound (K/V of
documents that span ranks; `usp_graph.cp.cost.document_lower_bound`). Bytes are linear in T.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist
from harness import Results, add_json_arg

from usp_graph import AttentionMetadata, ContextParallel, sdpa_to_usp
from usp_graph.cp.cost import bytes_sent, document_lower_bound
from usp_graph.distributed import count_bytes_sent
from usp_graph.testing import lognormal_lengths


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", default="16,4")
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-mean", type=float, default=512)
    add_json_arg(ap)
    args = ap.parse_args()
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    meta = AttentionMetadata.from_lengths(lognormal_lengths(args.tokens, args.doc_mean, 0))
    h, k, dtype = args.heads, args.head_dim, torch.bfloat16
    rows = []
    for g in (int(x) for x in args.kv_heads.split(",")):
        longest = max(meta.lengths())
        for strategy in ("allgather_kv", "ulysses", "ring", "usp", "halo"):
            u = 2 if (strategy == "usp" and world >= 4) else 1
            extra = (
                {"max_document_len": longest, "is_causal": True, "rank": rank} if strategy == "halo" else {}
            )
            if strategy == "halo" and longest > args.tokens // world + 1:
                rows.append((g, f"halo (a {longest}-token document spans more than two shards)", 0, 0))
                continue
            kw = {"ulysses_degree": u} if strategy == "usp" else {}
            if strategy == "halo":
                kw = {"max_document_len": longest}
            cp = ContextParallel(strategy, **kw)
            q = torch.randn(1, h, args.tokens // world, k, dtype=dtype, requires_grad=True)
            kv = torch.randn(1, g, args.tokens // world, k, dtype=dtype, requires_grad=True)
            with count_bytes_sent() as counts:
                sdpa_to_usp(q, kv, kv, is_causal=True, enable_gqa=True, metadata=meta, cp=cp).sum().backward()
            measured = sum(counts.values())
            model = bytes_sent(
                strategy,
                tokens=args.tokens,
                heads=h,
                kv_heads=g,
                head_dim=k,
                world=world,
                element_size=2,
                ulysses_degree=u,
                **extra,
            )
            rows.append((g, strategy + (f" {world // u}x{u}" if strategy == "usp" else ""), measured, model))
    bound = {
        g: document_lower_bound(
            meta.cu_seqlens, world=world, kv_heads=g, head_dim=k, element_size=2, is_causal=True
        )
        for g in {r[0] for r in rows}
    }
    if rank == 0:
        results = Results(args.json, bench="cp_bytes", device="cpu")
        for g, s, m, mdl in rows:
            results.write(world=world, tokens=args.tokens, documents=len(meta.lengths()), doc_mean=args.doc_mean,
                          heads=h, kv_heads=g, head_dim=k, strategy=s, measured_bytes=m, cost_model_bytes=mdl,
                          document_lower_bound_bytes=bound[g])  # fmt: skip
        print(
            f"P={world}, T={args.tokens}, {len(meta.lengths())} documents (log-normal mean {args.doc_mean}), "
            f"H={h}, K={k}, bf16, causal, fwd+bwd, rank 0"
        )
        print("| G | strategy | measured MB/rank | cost model MB | document lower bound MB |")
        print("|---|---|---|---|---|")
        for g, s, m, mdl in rows:
            print(f"| {g} | {s} | {m / 1e6:.2f} | {mdl / 1e6:.2f} | {bound[g] / 1e6:.2f} |")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
