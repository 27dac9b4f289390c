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
128K, MHA K=128). `--json PATH` appends bench_varlen_gpu's JSON lines (its settings in each line).
"""

from __future__ import annotations

import argparse
import sys

import bench_varlen_gpu as bv
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
QUICK = [("quick", ["--quick", "--impls", "usp,usp_cudnn,usp_flash,dense_sdpa"])]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="matrix", help=f"comma list out of {', '.join(PRESETS)}")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    add_json_arg(ap)
    args = ap.parse_args()
    runs = QUICK if args.quick else [run for name in args.preset.split(",") for run in PRESETS[name]]
    rows: dict[tuple[str, str], dict[str, float]] = {}
    for label, extra in runs:
        argv = [*BASE, *extra, "--device", args.device] + (["--json", str(args.json)] if args.json else [])
        print(f"\n### {label}: bench_varlen_gpu.py {' '.join(argv)}", flush=True)
        for r in bv.run(bv.parse_args(argv)):
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
