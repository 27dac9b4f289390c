"""Llama-style train step under context parallelism: tokens/s, scaling vs one GPU, memory per rank.

# T global packed tokens, P ranks, N documents

Run under torchrun on one host (NVLink multicast off, as the device README asks):
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \
    torchrun --nproc-per-node 2 tools/bench_train_cp_gpu.py --json $OUT/bench.jsonl
Smoke test of the logic on CPU (gloo, tiny model, aot_eager inner compiler):
    torchrun --nproc-per-node 2 tools/bench_train_cp_gpu.py --device cpu --quick

Every rank first runs the ONE-GPU step on the whole packed stream (the same model, same documents,
``torch.compile(backend="usp")`` with no CP, on its own GPU, no communication): that is the
baseline each rank measures itself, in the same run. Then, per strategy, the model is compiled with
``options={"cp": ContextParallel(strategy), "inner": ...}``, each rank feeds its sequence shard under
``usp_graph.documents(global metadata)``, the loss is the global token mean (`cp.token_mean`),
and the step is fwd + bwd + `cp.reduce_grads` (the rank-ordered gradient sum that CP needs, as data
parallelism would). Checked first: the CP loss (summed over ranks) and every gradient vs the one-GPU
step. Timed (`harness.time_ms`): median step after warm-up, compile excluded, CUDA events, with a
barrier before each CP step. `--json PATH` appends one JSON line per row.
Strategy ``ulysses_hgN``: Ulysses in N head groups (``head_groups=N``).
`--overlap on|off|both`: the compile backend's overlap pass (issued collectives) on, off, or each
strategy both ways. `--profile`: one more step under torch.profiler per row, reporting the
communication kernels' time and the part of it no compute kernel overlaps (exposed), as ms and as a
fraction of the step (`harness.profile_comm`).
Scaling efficiency = tokens/s on P GPUs / (P x tokens/s on one GPU). Memory: peak allocated per
rank during a step, above what was held before it.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from harness import Results, add_json_arg, peak_extra_gib, profile_comm, stopwatch, time_ms
from kernel_calls import kernel_calls

import usp_graph
from usp_graph import AttentionMetadata, ContextParallel
from usp_graph.cp import balance_documents, shard_work
from usp_graph.models import Llama, LlamaConfig, make_llama_batch
from usp_graph.ops.varlen import CUDA_KERNELS, cuda_kernel
from usp_graph.testing import lognormal_lengths

STRATEGIES = ("allgather_kv", "ulysses", "ring", "usp", "halo", "usp_halo")


def rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    return ((x.float() - ref.float()).norm() / ref.float().norm().clamp_min(1e-30)).item()


def calls_text(calls: dict[str, int]) -> str:
    return f"{calls['flex_fwd']}/{calls['fwd']}, {calls['flex_bwd']}/{calls['bwd']}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=131072, help="global packed tokens per step")
    ap.add_argument("--doc-mean", type=float, default=2048)
    ap.add_argument("--dim", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument(
        "--inner", default=None, help="inner compiler (default: inductor on cuda, aot_eager on cpu)"
    )
    ap.add_argument("--reps", type=int, default=8)
    ap.add_argument(
        "--balance", action="store_true", help="pack documents in usp_graph.cp.balance_documents order"
    )
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--overlap", choices=("on", "off", "both"), default="on")
    ap.add_argument("--profile", action="store_true", help="exposed communication from a profiled step")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--usp-kernel", choices=CUDA_KERNELS, default="auto",
                    help="usp's CUDA attention kernel for every step (usp_graph.ops.kernel_choice.cuda_kernel)")  # fmt: skip
    add_json_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.doc_mean, args.dim, args.layers, args.heads, args.kv_heads, args.reps = (
            256, 40, 64, 1, 4, 2, 2,
        )  # fmt: skip

    scope = contextlib.ExitStack()  # the kernel choice holds for the whole run, closed at exit
    scope.enter_context(cuda_kernel(args.usp_kernel))
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.device == "cuda":
        torch.cuda.set_device(local)
        device = torch.device("cuda", local)
        dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
        dtype = torch.bfloat16
    else:
        torch.set_num_threads(1)
        device = torch.device("cpu")
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=300))
        dtype = torch.float32
    inner = args.inner or ("inductor" if device.type == "cuda" else "aot_eager")
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
    lengths = lognormal_lengths(args.tokens, args.doc_mean, 0, shortest=2)
    if args.balance:  # the same documents, packed so that contiguous shards carry equal work
        lengths = [lengths[i] for i in balance_documents(lengths, world)]
    work = shard_work(lengths, world) if sum(lengths) % world == 0 else [1]
    balance = sum(work) / len(work) / max(work)
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(1), device=device)
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 16, device=device)
    total = sum(lengths)
    if rank == 0:
        name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
        print(f"# torch {torch.__version__}, {world} x {name}, {dtype}, inner {inner}; Llama dim {args.dim} x "
              f"{args.layers} layers, H={args.heads}, G={args.kv_heads}, usp kernel {args.usp_kernel}; {total} tokens in {len(lengths)} documents "
              f"(max {max(lengths)})", flush=True)  # fmt: skip

    def loss_sum_of(logits, labels):
        return F.cross_entropy(
            logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100, reduction="sum"
        )

    # ---- one GPU: the whole stream, every rank on its own GPU -------------------------------------
    single = torch.compile(model, backend="usp", options={"inner": inner})
    n_labels = (batch["labels"] != -100).sum()

    def single_step():
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(meta):
            logits = single(batch["input_ids"], batch["position_ids"])
        loss = loss_sum_of(logits, batch["labels"]) / n_labels
        loss.backward()
        return loss

    with stopwatch(device) as watch:
        ref_loss, calls = kernel_calls(single_step)  # also the warm-up
    ref_loss = ref_loss.detach()
    compile_single = watch.seconds
    ref_grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    ms_single = time_ms(single_step, device, warmup=0, reps=args.reps).median_ms
    gib_single = peak_extra_gib(single_step, device)
    model.zero_grad(set_to_none=True)
    rows = [{"strategy": "1 GPU", "world": 1, "ms": ms_single, "tokens_per_s": total / ms_single * 1e3,
             "efficiency": 1.0, "peak_extra_gib": gib_single, "compile_s": compile_single,
             "kernel_calls": calls}]  # fmt: skip
    if rank == 0:
        print(json.dumps(rows[0]), flush=True)
    torch._dynamo.reset()

    overlaps = {"on": (True,), "off": (False,), "both": (True, False)}[args.overlap]
    for strategy, overlap in ((s, o) for s in args.strategies.split(",") for o in overlaps):
        kw = {"ulysses_degree": 2 if world >= 4 else 1} if strategy == "usp" else {}
        if strategy in ("halo", "usp_halo"):
            kw = {"max_document_len": max(lengths)}
            if strategy == "usp_halo":  # Ulysses in pairs, halos across the pairs
                kw.update(ulysses_degree=2 if world >= 4 else 1, across="halo")
        try:
            if strategy.startswith("ulysses_hg"):  # ulysses_hgN: Ulysses in N head groups
                kw = {"head_groups": int(strategy.removeprefix("ulysses_hg"))}
            cp = ContextParallel(strategy.split("_halo")[0].split("_hg")[0], **kw)
            shard = {k: cp.shard(v, 1).contiguous() for k, v in batch.items()}
            labels = shard["labels"]
            options = {"cp": cp, "inner": inner, "disable": [] if overlap else ["overlap"]}
            compiled = torch.compile(model, backend="usp", options=options)
            n_local = (labels != -100).sum()

            def cp_step(cp=cp, compiled=compiled, shard=shard, labels=labels, n_local=n_local):
                model.zero_grad(set_to_none=True)
                with usp_graph.documents(meta):
                    logits = compiled(shard["input_ids"], shard["position_ids"])
                loss = cp.token_mean(loss_sum_of(logits, labels), n_local)
                loss.backward()
                cp.reduce_grads(model.parameters())
                return loss

            with stopwatch(device) as watch:
                loss, calls = kernel_calls(cp_step)  # also the warm-up
            compile_s = watch.seconds
            loss_err = rel(cp.global_sum(loss), ref_loss)
            grad_err = max(rel(p.grad, ref_grads[n]) for n, p in model.named_parameters())
            ms = time_ms(cp_step, device, warmup=0, reps=args.reps, barrier=dist.barrier).median_ms
            gib = peak_extra_gib(cp_step, device)
            prof = profile_comm(cp_step, device) if args.profile else None
            tol = 3e-2 if dtype == torch.bfloat16 else 1e-4
            row = {
                "strategy": strategy
                + (
                    f" ({kw['ulysses_degree']}x{world // kw['ulysses_degree']})"
                    if "ulysses_degree" in kw
                    else ""
                ),
                "world": world,
                "overlap": overlap,
                "ok": loss_err < tol and grad_err < tol,
                "loss_rel_err": loss_err,
                "worst_grad_rel_err": grad_err,
                "ms": ms,
                "tokens_per_s": total / ms * 1e3,
                "efficiency": ms_single / (world * ms),
                "peak_extra_gib": gib,
                "compile_s": compile_s,
                "kernel_calls": calls,
            }
            if prof is not None:
                row.update(prof, exposed_comm_frac=prof["exposed_comm_ms"] / ms)
            del compiled
        except Exception as e:  # report and go on with the other strategies
            row = {
                "strategy": strategy,
                "world": world,
                "overlap": overlap,
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[:400],
            }
        torch._dynamo.reset()
        rows.append(row)
        if rank == 0:
            print(json.dumps(row), flush=True)

    if rank == 0:
        print(f"\n{total} tokens, {len(lengths)} documents, {world} ranks, balanced order {args.balance}, "
              f"shard balance (mean/max attention work, causal) {balance:.2f}")  # fmt: skip
        print(
            "| GPUs | strategy | overlap | check (loss, worst grad) | step ms | tokens/s | scaling efficiency "
            "| peak extra GiB/rank | exposed comm ms (of comm ms) | flex / all attention calls (fwd, bwd) |"
        )
        print("|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            if "error" in r:
                print(
                    f"| {r['world']} | {r['strategy']} | {r.get('overlap', '')} | ERROR {r['error'][:80]} | | | | | | |"
                )
                continue
            check = (
                "-"
                if r["world"] == 1
                else (
                    f"{'PASS' if r['ok'] else 'FAIL'} {r['loss_rel_err']:.1e}, {r['worst_grad_rel_err']:.1e}"
                )
            )
            exposed = f"{r['exposed_comm_ms']:.2f} ({r['comm_ms']:.2f})" if "exposed_comm_ms" in r else "-"
            print(f"| {r['world']} | {r['strategy']} | {r.get('overlap', '-')} | {check} | {r['ms']:.1f} "
                  f"| {r['tokens_per_s']:,.0f} | {r['efficiency']:.2f} | {r['peak_extra_gib']:.2f} | {exposed} "
                  f"| {calls_text(r['kernel_calls'])} |")  # fmt: skip
        results = Results(args.json, bench="train_cp", device=device)
        settings = {k: v for k, v in vars(args).items() if k != "json"}
        for r in rows:
            results.write(settings=settings, inner=inner, dtype=str(dtype), lengths=lengths, shard_balance=balance,
                          **r)  # fmt: skip
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
