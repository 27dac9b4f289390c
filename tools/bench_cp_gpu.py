"""Context-parallel attention on packed documents over NCCL: correctness and speed per strategy.

# T global packed tokens, H heads, K head dim, P ranks

Run under torchrun on one host (NVLink multicast off, as the device README asks):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc-per-node 2 tools/bench_cp_gpu.py --json $OUT/bench.jsonl
Smoke test of the logic on CPU (gloo, tiny shapes):
    torchrun --nproc-per-node 2 tools/bench_cp_gpu.py --device cpu --quick

For each strategy x shape: every rank computes the single-device reference on the same global
inputs (usp's varlen path), then the CP call on its shard; out and dq/dk/dv are compared shard by
shard (rel err, bf16 tolerance 2e-2), then fwd+bwd is timed (`harness.time_ms`: median of CUDA
events, ranks meeting at a barrier before each rep). `--json PATH` appends one JSON line per row.
Memory: what one fwd+bwd call allocates above the tensors held before it (activations, workspaces,
out and grads), on one GPU for the whole stream and per rank under CP: ideally 1/P of it.
Per-GPU efficiency = t_single / (P * t_cp). Bytes sent per rank per attention call (fwd + bwd) come
from `usp_graph.cp.cost.bytes_sent` (the test suite checks it against the ops' own counts; for
"halo" it is the mean over ranks). "halo" runs with max_document_len = the longest document. "shard balance" is the mean over the max of
the ranks' attention work under contiguous sharding (`usp_graph.cp.shard_work`): what caps the
strategies that shard queries by position (allgather_kv, ring, halo); --balance packs the
documents in `usp_graph.cp.balance_documents` order first.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import sys

import torch
import torch.distributed as dist
from harness import Results, add_json_arg, attention_flops, peak_extra_gib, time_ms

from usp_graph import AttentionMetadata, ContextParallel, sdpa_to_usp
from usp_graph.cp import balance_documents, shard_work
from usp_graph.cp.cost import bytes_sent
from usp_graph.testing import lognormal_lengths

STRATEGIES = ("allgather_kv", "ulysses", "ring", "usp", "halo", "usp_halo")


def fwd_bwd(tensors, causal, meta, cp):
    """One attention call forward + backward on (q, k, v, grad_out): (out, dq, dk, dv)."""
    q, k, v = (x.detach().requires_grad_() for x in tensors[:3])
    out = sdpa_to_usp(q, k, v, is_causal=causal, metadata=meta, cp=cp)
    out.backward(tensors[3])
    return out, q.grad, k.grad, v.grad


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="65536,131072,262144")
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--doc-mean", type=float, default=2048)
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--modes", default="causal,bi", help="causal, bi or both")
    ap.add_argument("--no-zigzag", action="store_true", help="skip the zigzag rows")
    ap.add_argument(
        "--balance", action="store_true", help="pack documents in usp_graph.cp.balance_documents order"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    add_json_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.heads, args.head_dim, args.doc_mean, args.reps = "256", 4, 16, 40, 2

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=120))
        dtype = torch.bfloat16
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
        dtype = torch.float32
    h, k = args.heads, args.head_dim
    results = Results(args.json if rank == 0 else None, bench="cp", device=device)
    rows = []
    if rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(
            f"# CP attention: torch {torch.__version__}, {world} x {name}, {dtype}, H={h} K={k}", flush=True
        )
    for total in [int(x) for x in args.tokens.split(",")]:
        lens = lognormal_lengths(total, args.doc_mean, total)
        meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 8, device=device)
        for causal in [m == "causal" for m in args.modes.split(",")]:
            if args.balance:  # the same documents, packed so that contiguous shards carry equal work
                lens = [lens[i] for i in balance_documents(lens, world, is_causal=causal)]
                meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 8, device=device)
            work = shard_work(lens, world, is_causal=causal)
            balance = sum(work) / world / max(work)
            gen = torch.Generator(device=device).manual_seed(total + causal)
            q, kk, v, go = (
                torch.randn(1, h, total, k, generator=gen, device=device, dtype=dtype) for _ in range(4)
            )
            flops = attention_flops(lens, h, k, causal)[1]

            single = functools.partial(fwd_bwd, (q, kk, v, go), causal, meta, None)

            ref = single()  # also the warm-up
            t_single = time_ms(single, device, warmup=0, reps=args.reps, barrier=dist.barrier).median_ms
            del ref
            mem_single = peak_extra_gib(single, device)
            for strategy in args.strategies.split(","):
                for lb in (None, "zigzag") if causal and not args.no_zigzag else (None,):
                    kw = {"ulysses_degree": 2 if world >= 4 else 1} if strategy == "usp" else {}
                    if strategy in ("halo", "usp_halo"):  # the longest document of this step bounds the halo
                        if lb is not None:
                            continue
                        kw = {"max_document_len": max(lens)}
                        if strategy == "usp_halo":  # Ulysses in pairs, halos across the pairs
                            kw.update(ulysses_degree=2 if world >= 4 else 1, across="halo")
                    cp = ContextParallel(strategy.split("_halo")[0], load_balance=lb, **kw)
                    shards = [cp.shard(x, 2).contiguous() for x in (q, kk, v, go)]
                    step = functools.partial(fwd_bwd, shards, causal, meta, cp)

                    try:
                        got = step()
                        ref = single()
                        errs = [rel(a, cp.shard(b, 2)) for a, b in zip(got, ref, strict=True)]
                        del got, ref
                        t_cp = time_ms(step, device, warmup=0, reps=args.reps, barrier=dist.barrier).median_ms
                        mem_cp = peak_extra_gib(step, device)
                        row = {
                            "tokens": total,
                            "docs": len(lens),
                            "causal": causal,
                            "strategy": strategy,
                            "load_balance": lb,
                            "world": world,
                            "balanced_order": args.balance,
                            "shard_balance": balance,
                            "max_rel_err": max(errs),
                            "ok": max(errs) < (2e-2 if dtype == torch.bfloat16 else 1e-4),
                            "ms_single": t_single,
                            "ms_cp": t_cp,
                            "tflops_per_gpu_single": flops / t_single / 1e9,
                            "tflops_per_gpu_cp": flops / world / t_cp / 1e9,
                            "efficiency": t_single / (world * t_cp),
                            "extra_gib_single": mem_single,
                            "extra_gib_rank": mem_cp,
                            "bytes_sent_rank": bytes_sent(
                                cp.strategy,
                                tokens=total,
                                heads=h,
                                kv_heads=h,
                                head_dim=k,
                                world=world,
                                element_size=q.element_size(),
                                ulysses_degree=kw.get("ulysses_degree", 1),
                                max_document_len=kw.get("max_document_len"),
                                is_causal=causal,
                            ),  # fmt: skip
                        }
                    except Exception as e:  # report and go on with the other strategies
                        row = {
                            "tokens": total,
                            "causal": causal,
                            "strategy": strategy,
                            "load_balance": lb,
                            "ok": False,
                            "error": f"{type(e).__name__}: {e}"[:300],
                        }
                    rows.append(row)
                    if rank == 0:
                        print(json.dumps(row), flush=True)
                        results.write(heads=h, head_dim=k, dtype=str(dtype), reps=args.reps, **row)
    if rank == 0:
        print(
            "\n| tokens | docs | mode | strategy | lb | shard balance | check | ms 1 GPU | ms CP | TFLOP/s/GPU 1 | TFLOP/s/GPU CP | eff | GiB 1 GPU | GiB/rank CP | MB sent/rank |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(
                    f"| {r['tokens']} | | {'causal' if r['causal'] else 'bi'} | {r['strategy']} | {r['load_balance']} | ERROR {r['error'][:60]} |"
                )
                continue
            print(
                f"| {r['tokens']} | {r['docs']} | {'causal' if r['causal'] else 'bi'} | {r['strategy']} | {r['load_balance']} "
                f"| {r['shard_balance']:.2f} "
                f"| {'PASS' if r['ok'] else 'FAIL'} {r['max_rel_err']:.1e} | {r['ms_single']:.2f} | {r['ms_cp']:.2f} "
                f"| {r['tflops_per_gpu_single']:.0f} | {r['tflops_per_gpu_cp']:.0f} | {r['efficiency']:.2f} "
                f"| {r['extra_gib_single']:.2f} | {r['extra_gib_rank']:.2f} | {r['bytes_sent_rank'] / 1e6:.0f} |"
            )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
