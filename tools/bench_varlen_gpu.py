#!/usr/bin/env python
"""Forward+backward attention throughput on packed documents, implementations side by side.

Every implementation is first checked against the fp64 per-document reference the tests use
(`usp_graph.testing.attention_reference`) on a small check shape with the same document
distribution (`usp_graph.testing.lognormal_lengths`), then timed on each shape (`harness.time_ms`:
median of CUDA events):

  usp           usp_graph.varlen_attn (this repo's public wrapper; its per-shape kernel choice)
  usp_flash     the same, flash varlen forced (usp_graph.ops.kernel_choice.cuda_kernel("flash"))
  usp_flex      the same, flex_attention with a document block mask forced ("flex")
  usp_cudnn     the same, cuDNN's ragged attention forced ("cudnn"; needs nvidia-cudnn-frontend)
  cudnn_raw     cuDNN's ragged graphs alone: built once, their inputs and metadata bound once,
                each call only executes them (inside an autograd.Function): usp_cudnn's ceiling
  torch_varlen  torch.nn.attention.varlen.varlen_attn (flash varlen)
  flex          torch.compile(flex_attention) with a document BlockMask built once, untimed
  flex_step     the same with the BlockMask rebuilt by create_block_mask (compiled) on every call,
                from the document ids written into a fixed buffer: what a training step with new
                boundaries each step pays on plain flex_attention
  padded_sdpa   documents padded to the longest one, F.scaled_dot_product_attention; pack and
                unpack are timed; bidirectional needs a key-padding mask (not the flash backend)
  dense_sdpa    F.scaled_dot_product_attention on ONE sequence of all T tokens (no documents):
                the ceiling; its TFLOP/s count its own (dense) FLOPs; not checked (another function)

GQA: --kv-heads G < --heads; torch_varlen (no GQA) repeats K/V to H heads inside the timed call.

FLOPs are useful FLOPs only (no padding, no cross-document or masked-out work): a document of
n tokens costs fwd = 4*n*n*H*K bidirectional, 4*(n*(n+1)/2)*H*K causal; fwd+bwd = 3.5 * fwd
(backward = 2.5 * forward, the FlashAttention benchmark convention).

Examples:
  # the H200 run: markdown tables on stdout, one JSON line per shape and implementation
  PYTHONUNBUFFERED=1 python tools/bench_varlen_gpu.py --json $OUT/bench.jsonl

  # a subset of implementations and shapes
  python tools/bench_varlen_gpu.py --impls usp,torch_varlen --shapes 65536:causal

  # smoke test of the script's own logic (tiny shapes; GPU-only implementations are skipped)
  python tools/bench_varlen_gpu.py --device cpu --quick
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import math
import statistics
import sys
import traceback
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from harness import (
    FLOP_CONVENTION,
    Results,
    add_json_arg,
    attention_flops,
    environment,
    free_memory,
    log,
    stopwatch,
    time_ms,
)

from usp_graph.testing import attention_reference, lognormal_lengths, rel_err

# Legend of shape suffixes: T packed tokens, H heads, K head dim, N documents, L padded
# document length (the longest document), N1 = N + 1 boundaries, 1 = a batch of one.

AttnFn = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

IMPLS = (
    "usp",
    "usp_flash",
    "usp_flex",
    "usp_cudnn",
    "cudnn_raw",
    "torch_varlen",
    "flex",
    "flex_step",
    "padded_sdpa",
    "dense_sdpa",
)
UNCHECKED = ("dense_sdpa",)  # computes another function (no documents): timed, not checked
BASELINE = "torch_varlen"
TOLERANCE = 2e-2  # bf16 relative error bound, ||x - ref|| / ||ref||
DEFAULT_SHAPES = "32768:bi,32768:causal,65536:causal"
QUICK = {"shapes": "1024:bi,1024:causal", "doc_mean": 128.0, "check_tokens": 512, "warmup": 1, "reps": 3}
FULL = {"shapes": DEFAULT_SHAPES, "doc_mean": 2048.0, "check_tokens": 8192, "warmup": 3, "reps": 20}


# ---------------------------------------------------------------------------------------------
# Documents, inputs, FLOPs


@dataclass(frozen=True)
class Shape:
    tokens: int
    causal: bool

    @property
    def label(self) -> str:
        size = f"{self.tokens // 1024}K" if self.tokens % 1024 == 0 else str(self.tokens)
        return f"{size} {'causal' if self.causal else 'bi'}"


@dataclass
class Docs:
    """Document boundaries of one packed stream, in the forms the implementations want."""

    lengths: list[int]
    cu_seqlens_N1: torch.Tensor  # int32, on the device
    max_seqlen: int

    @property
    def num_docs(self) -> int:
        return len(self.lengths)

    @property
    def tokens(self) -> int:
        return sum(self.lengths)


def parse_shapes(text: str) -> list[Shape]:
    shapes = []
    for item in text.split(","):
        tokens, _, mode = item.strip().partition(":")
        if mode not in ("bi", "causal") or not tokens.isdigit() or int(tokens) < 1:
            raise argparse.ArgumentTypeError(
                f"bad shape {item!r}: expected TOKENS:bi or TOKENS:causal, e.g. 32768:causal"
            )
        shapes.append(Shape(int(tokens), mode == "causal"))
    return shapes


def sample_doc_lengths(total: int, *, mean: float, sigma: float, seed: int) -> list[int]:
    """`usp_graph.testing.lognormal_lengths`, seeded by (seed, total) so that the bidirectional and
    causal runs of one token count see the same documents."""
    return lognormal_lengths(total, mean, seed * 1_000_003 + total, sigma=sigma)


def make_docs(lengths: list[int], device: torch.device) -> Docs:
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return Docs(lengths, torch.tensor(cu, dtype=torch.int32, device=device), max(lengths))


def doc_stats(lengths: list[int]) -> dict[str, Any]:
    total = sum(lengths)
    return {
        "num_docs": len(lengths),
        "min": min(lengths),
        "median": statistics.median(lengths),
        "mean": total / len(lengths),
        "max": max(lengths),
        # share of the dense T x T score matrix that is inside documents
        "block_diag_density": sum(n * n for n in lengths) / (total * total),
    }


KV_HEADS: int | None = None  # --kv-heads (None: as many as query heads)


def make_inputs(
    tokens: int, heads: int, head_dim: int, *, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """q_THK, k_TGK, v_TGK (leaves requiring grad) and dout_THK, standard normal."""
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    g = KV_HEADS or heads
    q_THK, k_THK, v_THK, dout_THK = (
        torch.randn(tokens, h, head_dim, generator=gen, device=device, dtype=dtype)
        for h in (heads, g, g, heads)
    )
    for x in (q_THK, k_THK, v_THK):
        x.requires_grad_(True)
    return q_THK, k_THK, v_THK, dout_THK


# ---------------------------------------------------------------------------------------------
# Implementations: each builder returns (attention function on packed THK tensors, note)


def build_usp(docs: Docs, causal: bool, device: torch.device, kernel: str = "auto") -> tuple[AttnFn, str]:
    import usp_graph  # the package under test; may not exist yet, which reports FAIL

    varlen_attn = usp_graph.varlen_attn
    cu_N1, max_len = docs.cu_seqlens_N1, docs.max_seqlen

    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        out = varlen_attn(
            q_THK, k_THK, v_THK, cu_N1, cu_N1, max_len, max_len, is_causal=causal, enable_gqa=True
        )
        return out[0] if isinstance(out, tuple) else out

    return run, "" if kernel == "auto" else f"kernel {kernel}"


def kernel_scope(impl: str) -> contextlib.AbstractContextManager[None]:
    """usp's CUDA kernel setting for `impl`, held over forward and backward alike."""
    if not impl.startswith("usp"):
        return contextlib.nullcontext()
    from usp_graph.ops.varlen import cuda_kernel

    return cuda_kernel(impl.partition("_")[2] or "auto")


def build_torch_varlen(docs: Docs, causal: bool, device: torch.device) -> tuple[AttnFn, str]:
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    # torch 2.11 spells causal as window_size=(-1, 0) (bottom-right, equal to top-left for the
    # square per-document blocks here); other releases have or may have is_causal=.
    if not causal:
        kwargs: dict[str, Any] = {}
    elif "is_causal" in params:
        kwargs = {"is_causal": True}
    elif "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    else:
        raise RuntimeError(f"cannot ask varlen_attn{inspect.signature(varlen_attn)} for causal attention")
    cu_N1, max_len = docs.cu_seqlens_N1, docs.max_seqlen

    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        if k_THK.shape[1] != q_THK.shape[1]:  # no GQA in torch varlen: repeat K/V (timed)
            rep = q_THK.shape[1] // k_THK.shape[1]
            k_THK, v_THK = (x.repeat_interleave(rep, dim=1) for x in (k_THK, v_THK))
        return varlen_attn(q_THK, k_THK, v_THK, cu_N1, cu_N1, max_len, max_len, **kwargs)

    return run, " ".join(f"{k}={v}" for k, v in kwargs.items())


def build_flex(docs: Docs, causal: bool, device: torch.device, per_call: bool = False) -> tuple[AttnFn, str]:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    compiled = device.type == "cuda"
    if compiled:
        # A fresh Dynamo cache per (shape, mode) keeps static kernels and stays clear of the
        # recompile limit, past which flex_attention silently falls back to its dense eager path.
        torch._dynamo.reset()
    counts = torch.tensor(docs.lengths, device=device)
    doc_id_T = torch.repeat_interleave(torch.arange(docs.num_docs, device=device), counts)

    if causal:

        def document_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return (doc_id_T[q_idx] == doc_id_T[kv_idx]) & (q_idx >= kv_idx)
    else:

        def document_mask(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
            return doc_id_T[q_idx] == doc_id_T[kv_idx]

    tokens = docs.tokens
    with stopwatch(device) as watch:
        block_mask = create_block_mask(
            document_mask, None, None, tokens, tokens, device=device, _compile=compiled
        )
    mask_ms = watch.seconds * 1e3
    attend = torch.compile(flex_attention, dynamic=False) if compiled else flex_attention

    positions_T = torch.arange(tokens, dtype=docs.cu_seqlens_N1.dtype, device=device)
    cu_seqlens = docs.cu_seqlens_N1

    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        mask = block_mask
        if per_call:  # new boundaries each step: document ids from cu_seqlens, then a new mask
            doc_id_T.copy_(torch.searchsorted(cu_seqlens[1:], positions_T, right=True))
            mask = create_block_mask(
                document_mask, None, None, tokens, tokens, device=device, _compile=compiled
            )
        # (T, H, K) -> (1, H, T, K) is a view: the layout a projection + transpose produces
        q_1HTK, k_1HTK, v_1HTK = (x.transpose(0, 1).unsqueeze(0) for x in (q_THK, k_THK, v_THK))
        out_1HTK = attend(
            q_1HTK, k_1HTK, v_1HTK, block_mask=mask, enable_gqa=k_THK.shape[1] != q_THK.shape[1]
        )
        return out_1HTK[0].transpose(0, 1)

    mode = "compiled" if compiled else "eager"
    if per_call:
        return run, f"{mode}; BlockMask rebuilt every call (timed; first build {mask_ms:.0f} ms)"
    return run, f"{mode}; BlockMask built once, untimed ({mask_ms:.0f} ms)"


def build_padded_sdpa(docs: Docs, causal: bool, device: torch.device) -> tuple[AttnFn, str]:
    N, L = docs.num_docs, docs.max_seqlen
    # token t of document d at position p lives at row d * L + p of the padded (N * L) buffer
    dest_T = torch.cat([torch.arange(n, device=device) + d * L for d, n in enumerate(docs.lengths)])
    key_mask_N11L = None
    if not causal:
        # Padded keys must be masked for exactness. Causal needs no mask: padding sits at the
        # end, so valid rows never see it (and padded rows are dropped on unpack).
        lengths_N = torch.tensor(docs.lengths, device=device)
        key_mask_N11L = (torch.arange(L, device=device) < lengths_N[:, None]).view(N, 1, 1, L)

    def pack(x_THK: torch.Tensor) -> torch.Tensor:
        H, K = x_THK.shape[1:]
        padded = x_THK.new_zeros(N * L, H, K).index_copy(0, dest_T, x_THK)
        return padded.view(N, L, H, K).transpose(1, 2)  # N H L K

    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        out_NHLK = F.scaled_dot_product_attention(
            pack(q_THK),
            pack(k_THK),
            pack(v_THK),
            attn_mask=key_mask_N11L,
            is_causal=causal,
            enable_gqa=k_THK.shape[1] != q_THK.shape[1],
        )
        H, K = q_THK.shape[1:]
        return out_NHLK.transpose(1, 2).reshape(N * L, H, K).index_select(0, dest_T)

    padded_share = docs.tokens / (N * L)
    note = f"N={N} L={L} ({padded_share:.0%} of padded tokens valid); pack/unpack timed"
    if not causal:
        note += "; bool key-padding mask (no flash backend)"
    return run, note


def build_dense_sdpa(docs: Docs, causal: bool, device: torch.device) -> tuple[AttnFn, str]:
    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        q_1HTK, k_1HTK, v_1HTK = (x.transpose(0, 1).unsqueeze(0) for x in (q_THK, k_THK, v_THK))
        out_1HTK = F.scaled_dot_product_attention(
            q_1HTK, k_1HTK, v_1HTK, is_causal=causal, enable_gqa=k_THK.shape[1] != q_THK.shape[1]
        )
        return out_1HTK[0].transpose(0, 1)

    return run, "one sequence of all tokens, default SDPA backend; dense FLOPs"


def build_cudnn_raw(docs: Docs, causal: bool, device: torch.device) -> tuple[AttnFn, str]:
    """cuDNN's graphs with everything bound once: each call executes the forward (and, in
    backward, the backward) graph and nothing else."""
    from usp_graph.ops import cudnn_kernel as ck

    if not ck.available():
        raise RuntimeError("the cuDNN frontend (nvidia-cudnn-frontend) is not installed")
    cu_N1, max_len = docs.cu_seqlens_N1, docs.max_seqlen
    bound: dict[str, Any] = {}

    def bind(q, k, v):
        t, h, d = q.shape
        g = k.shape[1]
        scale = d**-0.5
        kf = ck.plan_key(q, k, cu_N1, max_len, max_len, causal, scale, (-1, -1), square=True)
        kb = ck.plan_key(q, k, cu_N1, max_len, max_len, causal, scale, (-1, -1), square=True, backward=True)
        pf, pb = ck._plan("fwd", kf), ck._plan("bwd", kb)
        (seq, _), (off_q, off_k, off_s) = ck.slot_metadata(cu_N1, cu_N1, h, g, d, kf.slots)
        out, stats = torch.empty_like(q), torch.empty(t, h, 1, dtype=torch.float32, device=q.device)
        dq, dk, dv, do = (torch.empty_like(x) for x in (q, k, v, q))
        meta = {ck._SEQ_Q: seq, ck._SEQ_K: seq, ck._OFF_Q: off_q, ck._OFF_K: off_k, ck._OFF_S: off_s}
        qd, kd, vd = q.detach(), k.detach(), v.detach()
        bound.update(
            key=(q.data_ptr(), k.data_ptr(), v.data_ptr()),
            fwd=(pf, kf, {**meta, ck._Q: qd, ck._K: kd, ck._V: vd, ck._O: out, ck._STATS: stats}),
            bwd=(
                pb,
                kb,
                {
                    **meta,
                    ck._Q: qd,
                    ck._K: kd,
                    ck._V: vd,
                    ck._O: out,
                    ck._STATS: stats,
                    ck._DO: do,
                    ck._DQ: dq,
                    ck._DK: dk,
                    ck._DV: dv,
                },
            ),  # fmt: skip
            out=out,
            do=do,
            grads=(dq, dk, dv),
        )

    class Raw(torch.autograd.Function):
        @staticmethod
        def forward(ctx, q, k, v):
            ck._execute(*bound["fwd"])
            return bound["out"]

        @staticmethod
        def backward(ctx, dout):
            if dout.data_ptr() != bound["do"].data_ptr():
                bound["do"].copy_(dout)  # the benchmark's dout is the same every call
            ck._execute(*bound["bwd"])
            return bound["grads"]

    def run(q_THK: torch.Tensor, k_THK: torch.Tensor, v_THK: torch.Tensor) -> torch.Tensor:
        if bound.get("key") != (q_THK.data_ptr(), k_THK.data_ptr(), v_THK.data_ptr()):
            bind(q_THK, k_THK, v_THK)
        return Raw.apply(q_THK, k_THK, v_THK)

    return run, "graphs and metadata bound once (includes one dout copy per backward)"


BUILDERS: dict[str, Callable[[Docs, bool, torch.device], tuple[AttnFn, str]]] = {
    "usp": build_usp,
    "usp_flash": lambda docs, causal, device: build_usp(docs, causal, device, "flash"),
    "usp_flex": lambda docs, causal, device: build_usp(docs, causal, device, "flex"),
    "usp_cudnn": lambda docs, causal, device: build_usp(docs, causal, device, "cudnn"),
    "cudnn_raw": build_cudnn_raw,
    "torch_varlen": build_torch_varlen,
    "flex": build_flex,
    "flex_step": lambda docs, causal, device: build_flex(docs, causal, device, per_call=True),
    "padded_sdpa": build_padded_sdpa,
    "dense_sdpa": build_dense_sdpa,
}


# ---------------------------------------------------------------------------------------------
# Reference check


def reference_attention(
    q_THK: torch.Tensor,
    k_THK: torch.Tensor,
    v_THK: torch.Tensor,
    dout_THK: torch.Tensor,
    lengths: list[int],
    causal: bool,
) -> dict[str, torch.Tensor]:
    """fp64 out, dq, dk, dv of `usp_graph.testing.attention_reference` (the tests' reference)."""
    q, k, v = (x.detach().double().requires_grad_(True) for x in (q_THK, k_THK, v_THK))
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    out_THK, _ = attention_reference(q, k, v, cu, is_causal=causal)
    dq, dk, dv = torch.autograd.grad(out_THK, (q, k, v), dout_THK.double())
    return {"out": out_THK.detach(), "dq": dq, "dk": dk, "dv": dv}


def check_impl(
    fn: AttnFn, inputs: tuple[torch.Tensor, ...], ref: dict[str, torch.Tensor]
) -> tuple[bool, dict[str, float]]:
    q_THK, k_THK, v_THK, dout_THK = inputs
    out_THK = fn(q_THK, k_THK, v_THK)
    if out_THK.shape != q_THK.shape:
        raise RuntimeError(f"output shape {tuple(out_THK.shape)} != query shape {tuple(q_THK.shape)}")
    dq, dk, dv = torch.autograd.grad(out_THK, (q_THK, k_THK, v_THK), dout_THK)
    errs = {
        name: rel_err(x, ref[name])
        for name, x in zip(("out", "dq", "dk", "dv"), (out_THK, dq, dk, dv), strict=True)
    }
    ok = all(math.isfinite(e) and e < TOLERANCE for e in errs.values())
    return ok, errs


def short_error(exc: BaseException) -> str:
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {first}"[:200]


def report_exception(what: str, exc: BaseException) -> None:
    log(f"  {what}: FAIL {short_error(exc)}")
    tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-4))
    print("    " + tb.strip().replace("\n", "\n    "), file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Run


@dataclass
class Result:
    shape: str
    impl: str
    status: str = "FAIL"  # PASS / FAIL (numerical check or error) / SKIP (not supported on CPU)
    check: dict[str, float] = field(default_factory=dict)
    error: str = ""
    note: str = ""
    ms_fwd_bwd: float | None = None
    ms_fwd: float | None = None
    tflops_fwd_bwd: float | None = None
    tflops_fwd: float | None = None
    vs_torch_fwd_bwd: float | None = None  # torch varlen time / this time (>1 = faster)
    vs_torch_fwd: float | None = None
    peak_mem_gib: float | None = None
    peak_extra_gib: float | None = None  # peak minus what was allocated before (inputs etc.)
    timing: dict[str, Any] = field(default_factory=dict)


def run_checks(
    impls: list[str], causal: bool, args: argparse.Namespace, device: torch.device, dtype: torch.dtype
) -> dict[str, tuple[str, dict[str, float], str]]:
    """impl -> (PASS/FAIL/SKIP, rel errors, error text) on the check shape for one mode."""
    lengths = sample_doc_lengths(args.check_tokens, mean=args.doc_mean, sigma=args.doc_sigma, seed=args.seed)
    docs = make_docs(lengths, device)
    mode = "causal" if causal else "bi"
    log(f"check {args.check_tokens} tokens {mode}: {docs.num_docs} documents, lengths {lengths}")
    inputs = make_inputs(
        args.check_tokens, args.heads, args.head_dim, dtype=dtype, device=device, seed=args.seed + 1
    )
    ref = reference_attention(*inputs, lengths, causal)
    results: dict[str, tuple[str, dict[str, float], str]] = {}
    for impl in impls:
        if impl in UNCHECKED:
            results[impl] = ("CEIL", {}, "")
            continue
        try:
            fn, _ = BUILDERS[impl](docs, causal, device)
            with kernel_scope(impl):
                ok, errs = check_impl(fn, inputs, ref)
            status = "PASS" if ok else "FAIL"
            shown = " ".join(f"{k}={v:.2e}" for k, v in errs.items())
            log(f"  {impl}: {status} rel err {shown} (< {TOLERANCE:g})")
            results[impl] = (status, errs, "" if ok else f"rel err >= {TOLERANCE:g}")
        except Exception as exc:
            skip = device.type == "cpu" and impl in ("torch_varlen", "flex", "flex_step")
            if skip:
                log(f"  {impl}: SKIP on CPU ({short_error(exc)})")
            else:
                report_exception(impl, exc)
            results[impl] = ("SKIP" if skip else "FAIL", {}, short_error(exc))
        finally:
            free_memory(device)
    return results


def bench_shape(
    shape: Shape,
    impls: list[str],
    checks: dict[str, tuple[str, dict[str, float], str]],
    args: argparse.Namespace,
    device: torch.device,
    dtype: torch.dtype,
) -> tuple[dict[str, Any], list[Result]]:
    lengths = sample_doc_lengths(shape.tokens, mean=args.doc_mean, sigma=args.doc_sigma, seed=args.seed)
    docs = make_docs(lengths, device)
    stats = doc_stats(lengths)
    fwd_flops, fwd_bwd_flops = attention_flops(lengths, args.heads, args.head_dim, shape.causal)
    log(
        f"{shape.label}: {docs.num_docs} documents (min {stats['min']}, median {stats['median']:g}, "
        f"max {stats['max']}), useful TFLOP fwd {fwd_flops / 1e12:.4g} fwd+bwd {fwd_bwd_flops / 1e12:.4g}"
    )
    shape_info = {
        "label": shape.label,
        "tokens": shape.tokens,
        "causal": shape.causal,
        "heads": args.heads,
        "head_dim": args.head_dim,
        "dtype": args.dtype,
        "docs": stats,
        "lengths": lengths,
        "fwd_flops": fwd_flops,
        "fwd_bwd_flops": fwd_bwd_flops,
    }
    q_THK, k_THK, v_THK, dout_THK = make_inputs(
        shape.tokens, args.heads, args.head_dim, dtype=dtype, device=device, seed=args.seed + 2
    )
    results = []
    for impl in impls:
        res = Result(shape.label, impl)
        status, res.check, res.error = checks[impl]
        if status == "SKIP" or (status == "FAIL" and not res.check):
            res.status = status  # could not even run on the check shape
            results.append(res)
            continue
        try:
            fn, res.note = BUILDERS[impl](docs, shape.causal, device)

            def fwd_bwd(fn: AttnFn = fn) -> None:
                out_THK = fn(q_THK, k_THK, v_THK)
                torch.autograd.grad(out_THK, (q_THK, k_THK, v_THK), dout_THK)

            def fwd(fn: AttnFn = fn) -> None:
                # the forward of the training step: grad enabled, graph dropped (no_grad would be
                # another compiled graph for flex, and inference kernels elsewhere)
                fn(q_THK, k_THK, v_THK)

            if device.type == "cuda":
                torch.cuda.synchronize(device)
                torch.cuda.reset_peak_memory_stats(device)
                before = torch.cuda.memory_allocated(device)
            with kernel_scope(impl):
                t_fb = time_ms(fwd_bwd, device, warmup=args.warmup, reps=args.reps)
                t_f = time_ms(fwd, device, warmup=args.warmup, reps=args.reps)
            if device.type == "cuda":
                peak = torch.cuda.max_memory_allocated(device)
                res.peak_mem_gib = peak / 2**30
                res.peak_extra_gib = (peak - before) / 2**30
            res.timing = {"fwd_bwd": t_fb.as_dict(), "fwd": t_f.as_dict()}
            res.ms_fwd_bwd, res.ms_fwd = t_fb.median_ms, t_f.median_ms
            f_fwd, f_fwd_bwd = fwd_flops, fwd_bwd_flops
            if impl == "dense_sdpa":  # one sequence of all tokens: its own FLOPs
                f_fwd, f_fwd_bwd = attention_flops([shape.tokens], args.heads, args.head_dim, shape.causal)
            res.tflops_fwd_bwd = f_fwd_bwd / (res.ms_fwd_bwd * 1e-3) / 1e12
            res.tflops_fwd = f_fwd / (res.ms_fwd * 1e-3) / 1e12
            res.status = status  # PASS, or FAIL of the numerical check (timed anyway, flagged)
            log(
                f"  {impl}: fwd+bwd {res.ms_fwd_bwd:.3f} ms {fmt_tflops(res.tflops_fwd_bwd)} TFLOP/s, "
                f"fwd {res.ms_fwd:.3f} ms {fmt_tflops(res.tflops_fwd)} TFLOP/s"
                + (f", peak {res.peak_mem_gib:.2f} GiB" if res.peak_mem_gib is not None else "")
            )
        except Exception as exc:
            report_exception(impl, exc)
            res.status, res.error = "FAIL", short_error(exc)
        finally:
            fn = fwd_bwd = fwd = None  # drop the closures (block mask, index buffers) before the next one
            free_memory(device)
        results.append(res)
    base = next((r for r in results if r.impl == BASELINE and r.ms_fwd_bwd is not None), None)
    if base is not None:
        for r in results:
            if r.ms_fwd_bwd is not None and r.ms_fwd is not None:
                r.vs_torch_fwd_bwd = base.ms_fwd_bwd / r.ms_fwd_bwd
                r.vs_torch_fwd = base.ms_fwd / r.ms_fwd
    return shape_info, results


def fmt(x: float | None, spec: str, suffix: str = "") -> str:
    return "-" if x is None else f"{x:{spec}}{suffix}"


def fmt_tflops(x: float | None) -> str:
    return "-" if x is None else f"{x:.1f}" if x >= 10 else f"{x:.3g}"


def markdown_table(results: list[Result]) -> str:
    header = (
        "| shape | impl | check | ms fwd+bwd | TFLOP/s fwd+bwd | ms fwd | TFLOP/s fwd "
        "| vs torch varlen f+b | vs torch varlen fwd | peak GiB | note |"
    )
    lines = [header, "|" + "---|" * header.count(" | ") + "---|"]
    for r in results:
        note = r.error if r.error else r.note
        lines.append(
            f"| {r.shape} | {r.impl} | {r.status} | {fmt(r.ms_fwd_bwd, '.3f')} | {fmt_tflops(r.tflops_fwd_bwd)} "
            f"| {fmt(r.ms_fwd, '.3f')} | {fmt_tflops(r.tflops_fwd)} | {fmt(r.vs_torch_fwd_bwd, '.2f', 'x')} "
            f"| {fmt(r.vs_torch_fwd, '.2f', 'x')} | {fmt(r.peak_mem_gib, '.2f')} | {note.replace('|', '/')} |"
        )
    return "\n".join(lines)


def check_table(checks: dict[str, dict[str, tuple[str, dict[str, float], str]]]) -> str:
    lines = [
        "| mode | impl | check | rel err out | dq | dk | dv | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for mode, per_impl in checks.items():
        for impl, (status, errs, error) in per_impl.items():
            cells = " | ".join(fmt(errs.get(k), ".2e") for k in ("out", "dq", "dk", "dv"))
            lines.append(f"| {mode} | {impl} | {status} | {cells} | {error.replace('|', '/')} |")
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__[__doc__.index("Examples:") :],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--shapes",
        default=None,
        help=f"comma list of TOKENS:bi|causal (default {FULL['shapes']}; --quick {QUICK['shapes']})",
    )
    parser.add_argument("--impls", default=",".join(IMPLS), help=f"comma list out of {','.join(IMPLS)}")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=None, help="key/value heads (GQA); default --heads")
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtype", choices=("bfloat16", "float16"), default="bfloat16")
    parser.add_argument(
        "--doc-mean",
        type=float,
        default=None,
        help=f"mean document length (default {FULL['doc_mean']:g}; --quick {QUICK['doc_mean']:g})",
    )
    parser.add_argument("--doc-sigma", type=float, default=1.0, help="sigma of log(document length)")
    parser.add_argument(
        "--check-tokens",
        type=int,
        default=None,
        help=f"tokens of the correctness check shape (default {FULL['check_tokens']})",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warmup", type=int, default=None, help=f"default {FULL['warmup']}")
    parser.add_argument(
        "--reps", type=int, default=None, help=f"timed reps, median reported (default {FULL['reps']})"
    )
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N, or cpu for a smoke test")
    parser.add_argument("--quick", action="store_true", help="tiny shapes and few reps: a smoke run")
    add_json_arg(parser)
    parser.add_argument("--strict", action="store_true", help="exit 1 if any implementation is FAIL")
    args = parser.parse_args(argv)
    preset = QUICK if args.quick else FULL
    for key, value in preset.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    try:
        args.shape_list = parse_shapes(args.shapes)
    except argparse.ArgumentTypeError as exc:
        parser.error(str(exc))
    args.impl_list = [s.strip() for s in args.impls.split(",") if s.strip()]
    unknown = sorted(set(args.impl_list) - set(IMPLS))
    if unknown:
        parser.error(f"unknown --impls {unknown}; choose from {', '.join(IMPLS)}")
    if args.reps < 1 or args.warmup < 1 or args.check_tokens < 1 or args.doc_mean < 1:
        # warmup >= 1 keeps compilation (flex, and its separate no_grad graph) out of the timings
        parser.error("--reps >= 1, --warmup >= 1, --check-tokens >= 1 and --doc-mean >= 1 are required")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if torch.device(args.device).type == "cuda" and not torch.cuda.is_available():
        print("CUDA is not available; use --device cpu --quick for a smoke test", file=sys.stderr)
        return 2
    records = run(args)
    failed = [r for r in records if r["status"] == "FAIL"]
    return 1 if args.strict and failed else 0


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Check and time every implementation on every shape; print the tables, append the JSON
    lines (one per shape and implementation) and return those records."""
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device and friends want an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    dtype = getattr(torch, args.dtype)
    global KV_HEADS
    KV_HEADS = args.kv_heads
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 implementations (CPU smoke runs) in true fp32
    warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile.*")
    warnings.filterwarnings(
        "ignore", message=".*_compile flag on create_block_mask.*"
    )  # deprecated, still works

    env = environment(device)
    print("# Packed-document attention benchmark")
    print(
        f"date {env['date_utc']}  torch {env['torch']}  cuda {env['cuda']}  triton {env['triton']}  "
        f"device {env['device_name']}  repo {env['git_commit']}"
    )
    print(
        f"{args.dtype} H={args.heads} G={args.kv_heads or args.heads} K={args.head_dim}; document lengths log-normal mean {args.doc_mean:g} "
        f"sigma {args.doc_sigma:g} seed {args.seed}; warmup {args.warmup}, median of {args.reps} reps"
    )
    print(f"FLOPs: {FLOP_CONVENTION}")
    if args.reps < 10 and not args.quick:
        print(f"warning: median of only {args.reps} reps", file=sys.stderr)

    checks: dict[str, dict[str, tuple[str, dict[str, float], str]]] = {}
    for causal in sorted({s.causal for s in args.shape_list}):
        mode = "causal" if causal else "bi"
        try:
            checks[mode] = run_checks(args.impl_list, causal, args, device, dtype)
        except Exception as exc:  # the reference itself failed: nothing can be checked
            report_exception(f"reference {mode}", exc)
            checks[mode] = {
                impl: ("FAIL", {}, f"reference failed: {short_error(exc)}") for impl in args.impl_list
            }

    shapes_info, results = [], []
    for shape in args.shape_list:
        info, shape_results = bench_shape(
            shape, args.impl_list, checks["causal" if shape.causal else "bi"], args, device, dtype
        )
        shapes_info.append(info)
        results.extend(shape_results)

    print(
        f"\n## Correctness vs the fp64 per-document reference ({args.check_tokens} tokens, rel err < {TOLERANCE:g})\n"
    )
    print(check_table(checks))
    print(f"\n## Throughput ({env['device_name']}, torch {env['torch']}, {env['date_utc']})\n")
    print(
        f"{args.dtype}, H={args.heads}, K={args.head_dim}. {FLOP_CONVENTION} (backward = 2.5x forward). "
        f"fwd = the forward of the training step (grad enabled). Times are medians of {args.reps} reps ({'CUDA events' if device.type == 'cuda' else 'wall clock'}); "
        "'vs torch varlen' = torch varlen time / this time (>1 = faster). "
        "Peak memory (max_memory_allocated, reset per implementation) includes inputs and grads.\n"
    )
    for info in shapes_info:
        d = info["docs"]
        print(
            f"- {info['label']}: {d['num_docs']} documents, lengths min {d['min']} median {d['median']:g} "
            f"max {d['max']}, {d['block_diag_density']:.2%} of the dense score matrix"
        )
    print()
    print(markdown_table(results))

    out = Results(args.json, bench="varlen", device=device)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
                if k not in ("shape_list", "impl_list", "json")}  # fmt: skip
    info_of = {info["label"]: info for info in shapes_info}
    records = [
        out.write(
            settings=settings,
            flop_convention=FLOP_CONVENTION,
            tolerance=TOLERANCE,
            shape_info=info_of[r.shape],
            **vars(r),
        )
        for r in results
    ]
    if args.json is not None:
        print(f"\nJSON lines appended to {args.json}")
    return records


if __name__ == "__main__":
    sys.exit(main())
