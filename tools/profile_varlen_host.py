"""Where a short varlen call's time goes: host work layer by layer against the GPU's own time.

# T packed tokens, H query heads, G key/value heads, K head dim

    PYTHONUNBUFFERED=1 python tools/profile_varlen_host.py --json $OUT/host.jsonl   # one GPU

At short contexts (4K tokens) a varlen call's GPU work is under a millisecond, so the host work in
front of each kernel (the op's checks, its dispatch, autograd, the kernel choice, cuDNN's graph
execution) decides the time. For each kernel (``--kernels``, default cudnn and flash) this times,
per call, the layers of one attention call from the outside in:

- ``varlen_attn fwd+bwd``: `usp_graph.varlen_attn` forward and backward through autograd;
- ``varlen_attn fwd``: the same forward under ``no_grad``;
- ``op fwd``: ``torch.ops.usp.varlen_fwd`` under ``no_grad`` (no wrapper checks);
- ``kernel fwd``: `kernel_choice.cuda_fwd` (no op dispatch);
- ``cudnn fwd``: `cudnn_kernel.cudnn_fwd` with its plan key and metadata given (cudnn only);
- ``op bwd``, ``kernel bwd``, ``cudnn bwd``: the same three layers of the backward alone, from a
  saved forward's `out` and `lse` (no autograd);
- ``bare graphs fwd+bwd``: cuDNN's two graphs with everything bound once (cudnn only; the same
  `build_cudnn_raw` as bench_varlen_gpu).

Each layer gets ``host_ms`` (wall time of issuing a fifth of ``--reps`` calls, no sync inside,
divided by their number; the least of five such rounds), ``gpu_ms`` (CUDA events around the same calls issued behind a `torch.cuda._sleep` long enough
that the host finishes issuing first: the GPU's own time, no host gaps) and ``ms`` (events around
calls issued as a user issues them: max of the two, roughly). Then cProfile over the fwd+bwd layer
prints the functions that take the host time (``--top``).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time
from collections.abc import Callable
from typing import Any

import torch
from bench_varlen_gpu import build_cudnn_raw, make_docs, make_inputs, sample_doc_lengths
from harness import Results, add_json_arg

import usp_graph
from usp_graph.ops import cudnn_kernel, kernel_choice
from usp_graph.ops.varlen import cuda_kernel


def _host_ms(fn: Callable[[], Any], reps: int) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) * 1e3 / reps


def _events_ms(fn: Callable[[], Any], reps: int, *, behind_sleep_ms: float = 0.0) -> float:
    torch.cuda.synchronize()
    if behind_sleep_ms:
        torch.cuda._sleep(int(behind_sleep_ms * 2e6))  # ~2 GHz: the host issues everything meanwhile
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def _layer(name: str, fn: Callable[[], Any], reps: int) -> dict[str, Any]:
    for _ in range(3):
        fn()
    # The least of five rounds: one round's figure once came out at twice the layer's as-issued time
    # (a pause of the process, not the calls' cost).
    host = min(_host_ms(fn, max(1, reps // 5)) for _ in range(5))
    # The launch queue holds ~1000 kernels: a short burst behind the sleep.
    burst = max(1, min(reps, 20))
    gpu = _events_ms(fn, burst, behind_sleep_ms=host * burst * 1.5 + 5)
    ms = _events_ms(fn, reps)
    return {"layer": name, "host_ms": round(host, 4), "gpu_ms": round(gpu, 4), "ms": round(ms, 4)}


def _profile(fn: Callable[[], Any], reps: int, top: int) -> str:
    prof = cProfile.Profile()
    torch.cuda.synchronize()
    prof.enable()
    for _ in range(reps):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    out = io.StringIO()
    stats = pstats.Stats(prof, stream=out).strip_dirs()
    stats.sort_stats("tottime").print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    return out.getvalue()


def run_kernel(kernel: str, a: argparse.Namespace, docs, q, k, v, dout) -> list[dict[str, Any]]:
    cu, mx = docs.cu_seqlens_N1, docs.max_seqlen
    scale = 1.0 / math.sqrt(q.shape[-1])
    causal = a.causal
    rows = []

    def fwd_bwd() -> None:
        out = usp_graph.varlen_attn(q, k, v, cu, cu, mx, mx, is_causal=causal, enable_gqa=True)
        out.backward(dout)

    def attn_fwd() -> None:
        with torch.no_grad():
            usp_graph.varlen_attn(q, k, v, cu, cu, mx, mx, is_causal=causal, enable_gqa=True)

    qd, kd, vd = q.detach(), k.detach(), v.detach()

    def op_fwd() -> None:
        with torch.no_grad():
            torch.ops.usp.varlen_fwd(qd, kd, vd, cu, cu, mx, mx, causal, scale)

    def kernel_fwd() -> None:
        kernel_choice.cuda_fwd(qd, kd, vd, cu, cu, mx, mx, causal, scale)

    with cuda_kernel(kernel), torch.no_grad():
        out, lse = torch.ops.usp.varlen_fwd(qd, kd, vd, cu, cu, mx, mx, causal, scale)

    def op_bwd() -> None:
        torch.ops.usp.varlen_bwd(dout, qd, kd, vd, out, lse, cu, cu, mx, mx, causal, scale)

    def kernel_bwd() -> None:
        kernel_choice.cuda_bwd(dout, qd, kd, vd, out, lse, cu, cu, mx, mx, causal, scale)

    layers: list[tuple[str, Callable[[], Any]]] = [
        ("varlen_attn fwd+bwd", fwd_bwd),
        ("varlen_attn fwd", attn_fwd),
        ("op fwd", op_fwd),
        ("kernel fwd", kernel_fwd),
        ("op bwd", op_bwd),
        ("kernel bwd", kernel_bwd),
    ]
    if kernel == "cudnn":
        key = cudnn_kernel.plan_key(qd, kd, cu, mx, mx, causal, scale, (-1, -1), square=True)
        meta = cudnn_kernel.slot_metadata(cu, cu, q.shape[1], k.shape[1], q.shape[2], key.slots)

        def cudnn_fwd() -> None:
            cudnn_kernel.cudnn_fwd(
                qd, kd, vd, cu, cu, mx, mx, causal, scale, square=True, key=key, metadata=meta
            )

        bkey = cudnn_kernel.plan_key(qd, kd, cu, mx, mx, causal, scale, (-1, -1), square=True, backward=True)

        def cudnn_bwd() -> None:
            cudnn_kernel.cudnn_bwd(
                dout,
                qd,
                kd,
                vd,
                out,
                lse,
                cu,
                cu,
                mx,
                mx,
                causal,
                scale,
                square=True,
                key=bkey,
                metadata=meta,
            )

        raw, _ = build_cudnn_raw(docs, causal, q.device)

        def bare() -> None:
            raw(q, k, v).backward(dout)

        layers += [("cudnn fwd", cudnn_fwd), ("cudnn bwd", cudnn_bwd), ("bare graphs fwd+bwd", bare)]
    with cuda_kernel(kernel):
        for name, fn in layers:
            rows.append({"kernel": kernel, **_layer(name, fn, a.reps)})
            r = rows[-1]
            print(
                f"  {kernel:6s} {name:22s} host {r['host_ms']:.3f} ms  gpu {r['gpu_ms']:.3f} ms  as issued {r['ms']:.3f} ms"
            )
        if a.top:
            print(_profile(fwd_bwd, a.reps, a.top))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=16)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--doc-mean", type=float, default=2048.0)
    p.add_argument("--causal", action=argparse.BooleanOptionalAction, default=True)
    p.add_argument("--kernels", default="cudnn,flash")
    p.add_argument("--reps", type=int, default=200)
    p.add_argument("--top", type=int, default=30, help="cProfile rows per listing (0: none)")
    add_json_arg(p)
    a = p.parse_args(argv)
    device = torch.device("cuda")
    import bench_varlen_gpu as bv

    bv.KV_HEADS = a.kv_heads
    lengths = sample_doc_lengths(a.tokens, mean=a.doc_mean, sigma=1.0, seed=0)
    docs = make_docs(lengths, device)
    q, k, v, dout = make_inputs(a.tokens, a.heads, a.head_dim, dtype=torch.bfloat16, device=device, seed=0)
    print(f"T={a.tokens} N={len(lengths)} max {docs.max_seqlen} H={a.heads} G={a.kv_heads} K={a.head_dim} causal={a.causal} "
          f"cudnn={cudnn_kernel.available()} torch {torch.__version__}")  # fmt: skip
    out = Results(a.json, bench="varlen_host", device=device)
    for kernel in a.kernels.split(","):
        if kernel == "cudnn" and not cudnn_kernel.available():
            print("  cudnn: the cuDNN frontend is not installed; skipped")
            continue
        for row in run_kernel(kernel, a, docs, q, k, v, dout):
            out.write(tokens=a.tokens, documents=len(lengths), causal=a.causal, **row)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
