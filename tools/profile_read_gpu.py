"""The eager documents read of ``attn_implementation="usp"`` and where an eager step's host time goes.

# T packed tokens (one row)

    PYTHONUNBUFFERED=1 python tools/profile_read_gpu.py --json $OUT/read.jsonl   # one GPU
    python tools/profile_read_gpu.py --device cpu --quick                         # smoke test

A checkpointed layer that Dynamo leaves out of its graph runs its attention eagerly: each forward's
first `"usp"` attention call reads the documents from the position ids (`resolve._positions_eager`:
kernels on the device, then one host read), and every call pays the op's host work. At 8K tokens
those layers were host-bound on an H100 (BENCHMARKS.md 0r). This measures, on one row of T tokens
whose documents include an empty and a length-1 one:

- the read: host µs per read (a fresh position-id tensor each time, the read's one sync included;
  the least of ``--rounds`` rounds), the synchronizations one read makes (CUDA's sync debug mode)
  and the kernels it launches (torch.profiler);
- one eager step of a transformers Llama (hidden 2048, 4 layers, 16/4 heads, bf16 on CUDA) with
  `"usp"` attention: ms per step, and cProfile's top functions by own time and usp_graph's by
  cumulative time (``--top``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time
import warnings

import torch
from harness import Results, add_json_arg, sync

from usp_graph import resolve


def _positions(lengths: list[int], device: str) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths]).to(device)[None]


def _syncs_per_read(pos: torch.Tensor) -> int | None:
    if pos.device.type != "cuda":
        return None
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            resolve._positions_eager(pos.clone(), 1, pos.shape[1])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in caught)


def _kernels_per_read(pos: torch.Tensor) -> int | None:
    if pos.device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    fresh = pos.clone()
    sync(pos.device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        resolve._positions_eager(fresh, 1, pos.shape[1])
        sync(pos.device)
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def _read_us(pos: torch.Tensor, reads: int, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        fresh = [pos.clone() for _ in range(reads)]  # a new tensor per read: never a cached one
        sync(pos.device)
        t0 = time.perf_counter()
        for p in fresh:
            resolve._positions_eager(p, 1, pos.shape[1])
        best = min(best, (time.perf_counter() - t0) / reads * 1e6)
        resolve._READ.clear()
    return best


def _step_profile(args: argparse.Namespace, pos: torch.Tensor) -> tuple[float, str]:
    import transformers

    quick = args.quick
    config = transformers.LlamaConfig(
        vocab_size=256 if quick else 32000, hidden_size=64 if quick else 2048,
        intermediate_size=128 if quick else 5632, num_hidden_layers=4, num_attention_heads=4 if quick else 16,
        num_key_value_heads=2 if quick else 4,
    )  # fmt: skip
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="usp").to(
        args.device, dtype
    )
    ids = torch.randint(0, config.vocab_size, pos.shape, device=args.device)

    def step() -> None:
        out = model(input_ids=ids, position_ids=pos, use_cache=False)
        out.logits.float().sum().backward()

    for _ in range(3):
        step()
    sync(args.device)
    t0 = time.perf_counter()
    for _ in range(args.steps):
        step()
    sync(args.device)
    ms = (time.perf_counter() - t0) / args.steps * 1e3
    if args.top <= 0:
        return ms, ""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(args.steps):
        step()
    sync(args.device)
    prof.disable()
    text = io.StringIO()
    stats = pstats.Stats(prof, stream=text)
    stats.sort_stats("tottime").print_stats(args.top)
    stats.sort_stats("cumulative").print_stats("usp_graph", args.top)
    return ms, text.getvalue()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument(
        "--documents", default="300,1,0,4000,3891", help="document lengths of the row (T is their sum)"
    )
    p.add_argument("--reads", type=int, default=50, help="reads per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--steps", type=int, default=10, help="eager steps timed, and profiled")
    p.add_argument("--top", type=int, default=30, help="cProfile rows per listing (0: no profile)")
    p.add_argument("--quick", action="store_true", help="a tiny model and row, few reads: a smoke test")
    add_json_arg(p)
    args = p.parse_args(argv)
    lengths = [int(n) for n in args.documents.split(",")]
    if args.quick:
        lengths, args.reads, args.rounds, args.steps = [30, 1, 0, 60, 37], 5, 2, 2
    pos = _positions(lengths, args.device)
    results = Results(args.json, bench="profile_read_gpu", device=args.device)
    read_us = _read_us(pos, args.reads, args.rounds)
    syncs, kernels = _syncs_per_read(pos), _kernels_per_read(pos)
    step_ms, listing = _step_profile(args, pos)
    record = results.write(
        tokens=pos.shape[1], documents=lengths, read_us=round(read_us, 1), syncs_per_read=syncs,
        kernels_per_read=kernels, eager_step_ms=round(step_ms, 2),
    )  # fmt: skip
    print(
        f"T={record['tokens']}: read {record['read_us']} µs (syncs {syncs}, kernels {kernels}); "
        f"eager usp step {record['eager_step_ms']} ms"
    )
    print(listing)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
