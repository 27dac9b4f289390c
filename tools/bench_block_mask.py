"""Build time of a document BlockMask for flex_attention: usp_graph.flex vs create_block_mask.

    python tools/bench_block_mask.py --tokens 32768                    # CPU
    PYTHONUNBUFFERED=1 python tools/bench_block_mask.py --device cuda  # on a GPU

Log-normal document lengths (mean 2048, seeded). Both masks are compared block for block first
(`to_dense`, kv block counts, full block counts), then timed: `document_block_mask` as the median of
several builds, `create_block_mask` once (it takes seconds).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import warnings

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from usp_graph import AttentionMetadata  # noqa: E402
from usp_graph.flex import document_block_mask, document_ids  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from doc_lengths import lognormal_lengths  # noqa: E402


def timed(fn, device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) * 1e3


def row(total: int, causal: bool, device: torch.device, reps: int) -> str:
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
    t_ref = timed(reference, device)
    ref = reference()
    equal = (
        torch.equal(got.to_dense(), ref.to_dense())
        and torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
        and torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)
    )
    times = [timed(lambda: document_block_mask(meta, is_causal=causal), device) for _ in range(reps)]
    mode = "causal" if causal else "bi"
    return f"| {total} | {len(lens)} | {mode} | {equal} | {statistics.median(times):.2f} | {t_ref:.0f} |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="32768")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    device = torch.device(args.device)
    warnings.filterwarnings("ignore")
    print(f"torch {torch.__version__}, {device}, {torch.get_num_threads()} threads")
    print("| tokens | documents | mode | equal | document_block_mask ms | create_block_mask ms |")
    print("|---|---|---|---|---|---|")
    for total in (int(x) for x in args.tokens.split(",")):
        for causal in (True, False):
            print(row(total, causal, device, args.reps), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
