#!/usr/bin/env python
"""cuDNN ragged attention behind usp's varlen op (issue 16): the benchmark matrix on one GPU.

Runs `bench_varlen_gpu.py` (same process, one run per configuration) over the matrix the issue
asks for and prints one summary table: fwd+bwd TFLOP/s (useful FLOPs, bench_varlen_gpu's
convention) per configuration and shape for

  usp          usp's default (`auto`: cuDNN where installed and measured faster)
  usp_cudnn    usp with the cuDNN kernel forced
  cudnn_raw    cuDNN's graphs alone, everything bound once (usp_cudnn's ceiling: usp's overhead)
  usp_flash    usp with flash varlen forced (the kernel before cuDNN and flex)
  usp_flex     usp with flex forced (block mask rebuilt inside every call)
  torch_varlen torch.nn.attention.varlen.varlen_attn
  flex         compiled flex_attention, block mask built once, untimed
  flex_step    the same, block mask rebuilt every call
  dense_sdpa   one sequence of all T tokens (the ceiling; dense FLOPs)

    PYTHONUNBUFFERED=1 python tools/bench_cudnn_gpu.py --json $OUT/bench.jsonl             # the matrix
    PYTHONUNBUFFERED=1 python tools/bench_cudnn_gpu.py --preset flex --json $OUT/bench.jsonl # flex rows
    python tools/bench_cudnn_gpu.py --device cpu --quick                                  # smoke test

Presets: ``matrix`` (H=16; MHA and GQA 16/4; head dims 128 and 64; 4K-256K tokens, bidirectional
and causal; no flex: its compiles take minutes), ``issue`` (the issue's rows: MHA K=128, mean
document length 3377 ~ the issue's log-normal(log 2048, 1)), ``flex`` (the flex rows at 32K and
128K, MHA K=128), ``probe`` (MHA K=128 at 32K-128K on the issue probe's own documents,
`probe_lengths`). `--json PATH` appends bench_varlen_gpu's JSON lines (its settings in each line).

    PYTHONUNBUFFERED=1 python tools/bench_cudnn_gpu.py --preset probe,issue --json $OUT/bench.jsonl
    PYTHONUNBUFFERED=1 python tools/bench_cudnn_gpu.py --plans    # every cuDNN plan timed, 64K/128K causal
"""

from __future__ import annotations

import argparse
import math
import sys
from typing import Any

import bench_varlen_gpu as bv
import torch
from harness import add_json_arg

BASE = ["--warmup", "2", "--reps", "10"]
CORE = "usp,usp_cudnn,cudnn_raw,usp_flash,torch_varlen"
ALL_SHAPES = ",".join(
    f"{t}:{m}" for t in (4096, 16384, 32768, 65536, 131072, 262144) for m in ("bi", "causal")
)
GQA_SHAPES = "4096:causal,16384:causal,32768:bi,65536:causal,131072:causal,262144:causal"
DENSE_SHAPES = "16384:bi,16384:causal,32768:bi,32768:causal,65536:bi,65536:causal"

# (label, extra argv) per run
PRESETS: dict[str, list[tuple[str, list[str]]]] = {
    "matrix": [
        ("MHA 16 K=128", ["--head-dim", "128", "--impls", CORE, "--shapes", ALL_SHAPES]),
        ("MHA 16 K=128", ["--head-dim", "128", "--impls", "dense_sdpa", "--shapes", DENSE_SHAPES]),
        ("GQA 16/4 K=128", ["--head-dim", "128", "--kv-heads", "4", "--impls", CORE, "--shapes", GQA_SHAPES]),
        (
            "GQA 16/4 K=128",
            [
                "--head-dim",
                "128",
                "--kv-heads",
                "4",
                "--impls",
                "dense_sdpa",
                "--shapes",
                "32768:bi,65536:causal",
            ],
        ),  # fmt: skip
        ("MHA 16 K=64", ["--head-dim", "64", "--impls", CORE, "--shapes", GQA_SHAPES]),
        ("MHA 16 K=64", ["--head-dim", "64", "--impls", "dense_sdpa", "--shapes", "32768:bi,65536:causal"]),
        ("GQA 16/4 K=64", ["--head-dim", "64", "--kv-heads", "4", "--impls", CORE, "--shapes", GQA_SHAPES]),
    ],
    "issue": [
        (
            "issue: MHA 16 K=128, mean 3377",
            [
                "--head-dim",
                "128",
                "--doc-mean",
                "3377",
                "--impls",
                CORE + ",dense_sdpa",
                "--shapes",
                "32768:bi,32768:causal,65536:causal,131072:causal",
            ],
        ),  # fmt: skip
    ],
    "probe": [
        (
            "probe: MHA 16 K=128, the issue probe's documents",
            [
                "--head-dim",
                "128",
                "--impls",
                "usp,usp_cudnn,cudnn_raw,torch_varlen",
                "--shapes",
                "32768:bi,32768:causal,65536:causal,131072:causal",
            ],
        ),  # fmt: skip
    ],
    "flex": [
        (
            "MHA 16 K=128 (flex)",
            [
                "--head-dim",
                "128",
                "--impls",
                "usp_cudnn,usp_flex,flex,flex_step,torch_varlen",
                "--shapes",
                "32768:bi,32768:causal,131072:causal",
            ],
        ),  # fmt: skip
    ],
}
# The probe drew its documents its own way: log_normal_(log(m), 1.0) (a mean of m * e^0.5),
# at least 16 tokens, the last one cut, one generator seeded 1, with m = 2048 at 32K and 128K and
# 1024 at 64K: 17 documents at 32K (longest 3967) and 27 at 64K and 128K, where one document holds
# 36,992 of the 64K tokens and 73,984 of the 128K ones.
PROBE_MEANS = {65536: 1024}
SAMPLERS: dict[str, Any] = {}


def probe_lengths(total: int, *, mean: float, sigma: float, seed: int) -> list[int]:
    """The probe's document lengths for `total` tokens (`mean`, `sigma` and `seed` are ignored)."""
    gen = torch.Generator().manual_seed(1)
    m = PROBE_MEANS.get(total, 2048)
    out: list[int] = []
    while sum(out) < total:
        n = int(torch.empty(1).log_normal_(math.log(m), 1.0, generator=gen).clamp(16, total).item())
        out.append(min(n, total - sum(out)))
    return out


SAMPLERS["probe"] = probe_lengths
QUICK = [("quick", ["--quick", "--impls", "usp,usp_cudnn,usp_flash,dense_sdpa"])]


def _events_ms(fn, reps: int = 10, warmup: int = 2) -> float:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return sorted(times)[len(times) // 2]


def plan_sweep(args: argparse.Namespace) -> int:
    """Every plan cuDNN's heuristics offer for usp's forward and backward graphs, timed one by one
    (median of 10 after 2 warm-ups, CUDA events): does a plan other than the one usp takes (the
    heuristics' first that builds) run faster on these documents?"""
    from usp_graph.ops import cudnn_kernel as ck

    device = torch.device(args.device)
    h, d = 16, 128
    cases = [
        (name, t, lengths)
        for t in (65536, 131072)
        for name, lengths in (
            ("issue (--doc-mean 3377)", bv.sample_doc_lengths(t, mean=3377, sigma=1.0, seed=0)),
            ("probe", probe_lengths(t, mean=0, sigma=0, seed=0)),
        )
    ]
    print(
        "| documents | tokens | N, longest | graph | plan | name | workspace MiB | ms | TFLOP/s | usp's plan |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, t, lengths in cases:
        fwd_flops, _ = bv.attention_flops(lengths, h, d, True)
        cu = bv.make_docs(lengths, device).cu_seqlens_N1
        gen = torch.Generator(device=device).manual_seed(0)
        q, k, v, do = (
            torch.randn(t, h, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(4)
        )
        s_max = max(lengths)
        kf = ck.plan_key(q, k, cu, s_max, s_max, True, d**-0.5, (-1, -1), square=True)
        kb = ck.plan_key(q, k, cu, s_max, s_max, True, d**-0.5, (-1, -1), square=True, backward=True)
        (seq, _), (off_q, off_k, off_s) = ck.slot_metadata(cu, cu, h, h, d, kf.slots)
        out, stats = torch.empty_like(q), torch.empty(t, h, 1, dtype=torch.float32, device=device)
        dq, dk, dv = (torch.empty_like(q) for _ in range(3))
        meta = {ck._SEQ_Q: seq, ck._SEQ_K: seq, ck._OFF_Q: off_q, ck._OFF_K: off_k, ck._OFF_S: off_s}
        packs = {
            "fwd": {**meta, ck._Q: q, ck._K: k, ck._V: v, ck._O: out, ck._STATS: stats},
            "bwd": {**meta, ck._Q: q, ck._K: k, ck._V: v, ck._O: out, ck._STATS: stats, ck._DO: do,
                    ck._DQ: dq, ck._DK: dk, ck._DV: dv},
        }  # fmt: skip
        ck._execute(ck._plan("fwd", kf), kf, packs["fwd"])  # out and stats for the backward
        handle = ck._handle(kf.device)
        ck.module().set_stream(handle=handle, stream=torch.cuda.current_stream().cuda_stream)
        for kind, key, flops in (("fwd", kf, fwd_flops), ("bwd", kb, 2.5 * fwd_flops)):
            usp_plan = ck._plan(kind, key).graph
            chosen = usp_plan.get_plan_name_at_index(getattr(usp_plan, "_plan_index", 0))
            try:
                graph = ck._build(kind, key, all_plans=True).graph
                count = graph.get_execution_plan_count()
            except Exception as exc:
                print(
                    f"| {name} | {t} | - | {kind} | - | build failed: {bv.short_error(exc)} | - | - | - | - |"
                )
                continue
            for i in range(count):
                label = f"| {name} | {t} | {len(lengths)}, {s_max} | {kind} | {i} |"
                try:
                    pname = graph.get_plan_name_at_index(i)
                    need = graph.get_workspace_size_plan_at_index(i)
                    ws = torch.empty(max(need, 1), dtype=torch.uint8, device=device)
                    pack = packs[kind]
                    ms = _events_ms(
                        lambda i=i, ws=ws, pack=pack, g=graph, hd=handle: g.execute_plan_at_index(
                            pack, ws, i, hd
                        )
                    )
                except Exception as exc:
                    print(f"{label} - | failed: {bv.short_error(exc)} | - | - | - | - |", flush=True)
                    continue
                print(f"{label} {pname} | {need / 2**20:.0f} | {ms:.3f} | {flops / ms / 1e9:.1f} "
                      f"| {'yes' if pname == chosen else ''} |", flush=True)  # fmt: skip
            del graph
        del q, k, v, do, out, stats, dq, dk, dv, packs
        torch.cuda.empty_cache()
    return 0


def padding_sweep(args: argparse.Namespace) -> int:
    """The same documents through cuDNN's ragged forward and backward with more document slots N
    and a longer padded length S than they need (usp buckets both, `metadata.capacity_bucket`, so
    that a training run's batches share graphs): does the padding cost time? Median of 10 after 3
    warm-ups, CUDA events, per call."""
    import dataclasses
    from functools import partial

    from usp_graph.ops import cudnn_kernel as ck
    from usp_graph.testing import lognormal_lengths

    device = torch.device(args.device)
    h, g, d = 16, 4, 128  # bench_long_gpu.py's Llama: 16 query heads, 4 key-value heads
    print("| T | batch (seed) | N, S needed | N, S run | N x S / T | fwd ms | bwd ms |")
    print("|---|---|---|---|---|---|---|")
    for t, mean, seeds in ((65536, 4096, (1, 2, 3, 4)), (131072, 8192, (1,))):
        for seed in seeds:
            lengths = lognormal_lengths(t, mean, seed=seed)  # bench_long_gpu.py's batches
            n, s_max = len(lengths), max(lengths)
            cu = bv.make_docs(lengths, device).cu_seqlens_N1
            gen = torch.Generator(device=device).manual_seed(0)
            q, do = (
                torch.randn(t, h, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2)
            )
            k, v = (
                torch.randn(t, g, d, generator=gen, device=device, dtype=torch.bfloat16) for _ in range(2)
            )
            kf = ck.plan_key(q, k, cu, s_max, s_max, True, d**-0.5, (-1, -1), square=True)
            kb = ck.plan_key(q, k, cu, s_max, s_max, True, d**-0.5, (-1, -1), square=True, backward=True)
            shapes = [(n, s_max), (kf.slots, s_max), (n, kf.s_q), (kf.slots, kf.s_q), (2 * kf.slots, kf.s_q),
                      (n, min(2 * kf.s_q, t))]  # fmt: skip
            for slots, s in dict.fromkeys(shapes):
                common = {"square": True, "metadata": ck.slot_metadata(cu, cu, h, g, d, slots)}
                fwd = partial(ck.cudnn_fwd, q, k, v, cu, cu, s_max, s_max, True, d**-0.5,
                              key=dataclasses.replace(kf, slots=slots, s_q=s, s_k=s), **common)  # fmt: skip
                out, lse = fwd()
                bwd = partial(ck.cudnn_bwd, do, q, k, v, out, lse, cu, cu, s_max, s_max, True, d**-0.5,
                              key=dataclasses.replace(kb, slots=slots, s_q=s, s_k=s), **common)  # fmt: skip
                ms_f, ms_b = _events_ms(fwd, warmup=3), _events_ms(bwd, warmup=3)
                print(f"| {t} | {seed} | {n}, {s_max} | {slots}, {s} | {slots * s / t:.2f} | {ms_f:.3f} | {ms_b:.3f} |",
                      flush=True)  # fmt: skip
            del q, k, v, do
            torch.cuda.empty_cache()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="matrix", help=f"comma list out of {', '.join(PRESETS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--plans", action="store_true",
                    help="time every cuDNN plan (engine) of the forward and backward graphs instead, at 64K and "
                         "128K causal, on the issue preset's and the probe's documents")  # fmt: skip
    ap.add_argument("--padding", action="store_true",
                    help="time cuDNN's forward and backward on the same documents with more slots and a longer "
                         "padded length than they need (what usp's bucketing adds)")  # fmt: skip
    add_json_arg(ap)
    args = ap.parse_args()
    if args.plans:
        return plan_sweep(args)
    if args.padding:
        return padding_sweep(args)
    runs = (
        [("quick", r) for r in QUICK]
        if args.quick
        else [(n, r) for n in args.preset.split(",") for r in PRESETS[n]]
    )
    rows: dict[tuple[str, str], dict[str, float]] = {}
    default_sampler = bv.sample_doc_lengths
    for preset, (label, extra) in runs:
        argv = [*BASE, *extra, "--device", args.device] + (["--json", str(args.json)] if args.json else [])
        print(f"\n### {label}: bench_varlen_gpu.py {' '.join(argv)}", flush=True)
        bv.sample_doc_lengths = SAMPLERS.get(preset, default_sampler)
        try:
            records = bv.run(bv.parse_args(argv))
        finally:
            bv.sample_doc_lengths = default_sampler
        for r in records:
            if r["tflops_fwd_bwd"] is not None:
                rows.setdefault((label, r["shape"]), {})[r["impl"]] = r["tflops_fwd_bwd"]
    impls = [i for i in bv.IMPLS if any(i in v for v in rows.values())]
    print("\n## fwd+bwd TFLOP/s (useful FLOPs; dense_sdpa: one sequence, dense FLOPs)\n")
    print("| config | shape | " + " | ".join(impls) + " | usp / cudnn_raw |")
    print("|---|---|" + "---|" * (len(impls) + 1))
    for (label, shape), v in rows.items():
        ratio = v["usp"] / v["cudnn_raw"] if "usp" in v and "cudnn_raw" in v else None
        cells = [f"{v[i]:.0f}" if i in v else "-" for i in impls]
        print(
            f"| {label} | {shape} | " + " | ".join(cells) + f" | {'-' if ratio is None else f'{ratio:.3f}'} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
