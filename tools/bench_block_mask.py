"""Build time of a document BlockMask for flex_attention: usp_graph.flex vs create_block_mask.

    python tools/bench_block_mask.py --tokens 32768                    # CPU
    PYTHONUNBUFFERED=1 python tools/bench_block_mask.py --device cuda  # on a GPU

Log-normal document lengths (mean 2048, seeded). Both masks are compared block for block first
(`to_dense`, kv block counts, full block counts), then timed (tools/harness.py): `document_block_mask`
repeated (`time_ms`), `create_block_mask` once (`stopwatch`; it takes seconds). `--json PATH` appends
one JSON line per row.
"""

from __future__ import annotations

import argparse
import sys
import warnings

import torch
from harness import Results, add_json_arg, stopwatch, time_ms

from usp_graph import AttentionMetadata
from usp_graph.flex import document_block_mask, document_ids
from usp_graph.testing import lognormal_lengths


def row(total: int, causal: bool, device: torch.device, reps: int, results: Results) -> str:
    from torch.nn.attention.flex_attention import create_block_mask

    lens = lognormal_lengths(total, 2048, total)
    meta = AttentionMetadata.from_lengths(lens, device=device)
    doc = document_ids(meta.cu_seqlens, total)

    def mask_mod(b, h, q, kv):
        same = doc[q] == doc[kv]
        return same & (q >= kv) if causal else same

    def reference():
        return create_block_mask(mask_mod, None, None, total, total, device=device)

    got = document_block_mask(meta, is_causal=causal)
    with stopwatch(device) as watch:
        ref = reference()
    equal = (
        torch.equal(got.to_dense(), ref.to_dense())
        and torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
        and torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)
    )
    ours = time_ms(lambda: document_block_mask(meta, is_causal=causal), device, warmup=1, reps=reps)
    mode = "causal" if causal else "bi"
    results.write(tokens=total, documents=len(lens), mode=mode, equal=equal,
                  document_block_mask=ours.as_dict(), create_block_mask_ms=watch.seconds * 1e3)  # fmt: skip
    return f"| {total} | {len(lens)} | {mode} | {equal} | {ours.median_ms:.2f} | {watch.seconds * 1e3:.0f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=10)
    add_json_arg(ap)
    args = ap.parse_args()
    device = torch.device(args.device)
    results = Results(args.json, bench="block_mask", device=device)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    print("| tokens | documents | mode | equal | document_block_mask ms | create_block_mask ms |")
    print("|---|---|---|---|---|---|")
    for total in (int(x) for x in args.tokens.split(",")):
        for causal in (True, False):
            print(row(total, causal, device, args.reps, results), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
