"""Issued collectives and the overlap pass on a GPU (NCCL), one process (issue 19).

# T packed tokens

Run on a CUDA machine from the repo root:
    PYTHONUNBUFFERED=1 python tools/check_overlap_gpu.py [--tokens 16384] [--json OUT.jsonl]
    python tools/check_overlap_gpu.py --device cpu --tokens 256      # smoke test (gloo)

A group of one rank (NCCL on CUDA): the collectives move no data between GPUs, but they run
NCCL's asynchronous path (work handles, the stream wait in ``usp::wait``), and the compiled
graphs are the ones a larger group gets. Checks, each printed as one line, then ALL PASS / SOME
FAILED (non-zero exit on a failure):

- ``ops``: every ``*_start`` + ``usp::wait`` equals its blocking collective (``torch.equal``), with
  the input overwritten right after the issue.
- ``aot_eager``: a Llama-style train step compiled with ``backend="usp"`` (Ulysses, inner
  aot_eager) gives the same loss and gradients (``torch.equal``) with and without the overlap pass.
- ``inductor``: the same with inner inductor; the loss must agree within bf16 rounding (the
  schedule changes the order inductor emits kernels in, not what they compute), and the step time
  with and without the pass is reported (CUDA events, interleaved).
"""

from __future__ import annotations

import argparse
import copy
import os
import sys
import tempfile

import harness
import torch
import torch.distributed as dist
import torch.nn.functional as F
from setups import llama_inputs, llama_model

from usp_graph import ContextParallel, documents
from usp_graph.distributed import group_name
from usp_graph.models import LlamaConfig


def _ops(device: str) -> bool:
    name = group_name(None)
    g = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(2, 8, 64, 16, device=device, generator=g, dtype=torch.bfloat16)
    cases = [
        (torch.ops.usp.all_to_all, torch.ops.usp.all_to_all_start, (x, 1, 2, [8], [64], name), (2, False)),
        (torch.ops.usp.all_gather, torch.ops.usp.all_gather_start, (x, 0, 1, name), (0, False)),
        (torch.ops.usp.reduce_scatter, torch.ops.usp.reduce_scatter_start, (x, 2, 1, name), (2, True)),
    ]
    ok = True
    for sync, start, args, (dim, reduce) in cases:
        expected = sync(*args)
        moved = (args[0].clone(), *args[1:])
        handle = start(*moved)
        moved[0].fill_(7)
        ok &= torch.equal(torch.ops.usp.wait(handle, dim, reduce), expected)
    return ok


def _step(model, compiled, local, meta, cp):
    model.zero_grad(set_to_none=True)
    with documents(meta):
        logits = compiled(local["input_ids"], local["position_ids"])
    labels = local["labels"].flatten()
    loss = cp.token_mean(
        F.cross_entropy(logits.float().flatten(0, 1), labels, reduction="sum"), labels.numel()
    )
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=4)
    harness.add_json_arg(parser)
    args = parser.parse_args()
    device = args.device
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    store = tempfile.mktemp()
    backend = "nccl" if device == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"file://{store}", rank=0, world_size=1)
    if device == "cuda":
        torch.cuda.set_device(0)
    results = harness.Results(args.json, bench="check_overlap_gpu", device=device)
    checks: dict[str, bool] = {}

    checks["ops"] = _ops(device)
    print(
        f"ops: {'PASS' if checks['ops'] else 'FAIL'} (start + wait == blocking, input overwritten after the issue)"
    )

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    dim, heads = (2048, 16) if device == "cuda" else (64, 4)
    config = LlamaConfig(vocab_size=32000 if device == "cuda" else 256, dim=dim, n_layers=args.layers,
                         n_heads=heads, n_kv_heads=heads // 2, ffn_dim=4 * dim)  # fmt: skip
    cp = ContextParallel("ulysses")
    base = llama_model(config, seed=0).to(device=device, dtype=dtype)
    lengths = [args.tokens // 8] * 8
    batch, meta = llama_inputs(config, lengths, torch.Generator().manual_seed(1), max_docs=16)
    local = {k: v.to(device) for k, v in batch.items()}
    meta = meta.to(device)

    timings = {}
    for inner in ("aot_eager", "inductor"):
        runs = {}
        for overlap in (True, False):
            model = copy.deepcopy(base)
            options = {"cp": cp, "inner": inner, "disable": [] if overlap else ["overlap"]}
            compiled = torch.compile(model, backend="usp", fullgraph=True, options=options)
            runs[overlap] = (model, compiled, _step(model, compiled, local, meta, cp))
        (la, ga), (lb, gb) = runs[True][2], runs[False][2]
        if inner == "aot_eager":
            ok = torch.equal(la, lb) and all(torch.equal(a, b) for a, b in zip(ga, gb, strict=True))
            detail = "loss and every gradient bitwise"
        else:
            ok = bool(torch.allclose(la, lb, rtol=2e-2))
            detail = f"loss {la.item():.6f} vs {lb.item():.6f}"
            fns = {
                f"overlap={o}": (lambda m=runs[o][0], c=runs[o][1]: _step(m, c, local, meta, cp))
                for o in (True, False)
            }
            timings = harness.time_interleaved(fns, device, warmup=2, reps=10)
            detail += "; step ms " + ", ".join(f"{k}: {t.median_ms:.2f}" for k, t in timings.items())
        checks[inner] = ok
        print(f"{inner}: {'PASS' if ok else 'FAIL'} ({detail})")
    results.write(
        checks=checks, tokens=args.tokens, layers=args.layers, dim=dim,
        step_ms={k: t.median_ms for k, t in timings.items()},
    )  # fmt: skip
    dist.destroy_process_group()
    ok = all(checks.values())
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
