"""Train-step speed on packed documents: backend="usp" (inductor) vs padded SDPA (inductor).

# B padded batch rows, L length, T packed tokens, N documents (samples)

    PYTHONUNBUFFERED=1 python tools/bench_train_gpu.py --json $OUT/bench.jsonl                  # Llama, GPU
    PYTHONUNBUFFERED=1 python tools/bench_train_gpu.py --model flux --json $OUT/bench.jsonl     # Flux, GPU
    PYTHONUNBUFFERED=1 python tools/bench_train_gpu.py --usp-kernels flash,flex --json $OUT/bench.jsonl  # kernels
    python tools/bench_train_gpu.py --device cpu --quick                                       # smoke tests
    python tools/bench_train_gpu.py --model flux --device cpu --quick

Both paths train the same model (bf16 on GPU) on the same documents: usp packs them into one row
of T tokens and compiles with ``torch.compile(backend="usp", options={"inner": "inductor"})``
under ``usp_graph.documents``; the baseline pads them into N rows and compiles with the default
inductor backend. Equal useful tokens; one fwd+bwd step (no optimizer) timed as the median of
several after warm-up (compile excluded; `harness.time_ms`, CUDA events). `--json PATH` appends one
JSON line per path. The two losses (float32, same model, same tokens) are
compared first: PASS when their relative difference is below 2e-2.

``--model llama`` (default): a Llama-style decoder on documents of log-normal lengths; the
baseline pads each document to the longest, with labels -100 on padding.

``--model flux``: a Flux-style MMDiT on samples of a text (length uniform in [64, 512]) and an
image (a square grid of log-normal side in [16, 90], so 256..8100 tokens), added until the joint
tokens reach ``--tokens``. usp runs the packed mode (``txt_doc``/``img_doc``: per-token
modulation, joint attention over each sample's text then image as one document); the baseline
pads text to the longest text and image to the longest image, with a boolean key mask (padded
keys ignored, padded queries still see real keys) and the loss over real image tokens only.

On ``--device cpu`` the usp path's inner compiler defaults to ``aot_eager`` (inductor on CPU
compiles slowly and is not what is measured); ``--inner`` overrides it.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from harness import Results, add_json_arg, stopwatch, time_ms
from kernel_calls import kernel_calls

import usp_graph
from usp_graph import AttentionMetadata
from usp_graph.models import Flux, FluxConfig, Llama, LlamaConfig, make_packed_flux_batch
from usp_graph.ops.varlen import CUDA_KERNELS, cuda_kernel
from usp_graph.testing import lognormal_lengths

TOLERANCE = 2e-2


@dataclass
class Setup:
    """One model's benchmark: the two step functions and what to report about the data."""

    usp_step: Callable[[], torch.Tensor]
    pad_step: Callable[[], torch.Tensor]
    useful_tokens: int
    header: str
    info: dict[str, Any] = field(default_factory=dict)


# -- Llama ------------------------------------------------------------------------------------------


def packed_batch(lengths, vocab, device, gen):
    ids = torch.randint(0, vocab, (sum(lengths),), generator=gen)
    pos = torch.cat([torch.arange(n) for n in lengths])
    labels = torch.full_like(ids, -100)
    start = 0
    for n in lengths:
        labels[start : start + n - 1] = ids[start + 1 : start + n]
        start += n
    return ids[None].to(device), pos[None].to(device), labels[None].to(device)


def padded_batch(lengths, ids, labels, device):
    lmax = max(lengths)
    n = len(lengths)
    pid = torch.zeros(n, lmax, dtype=torch.long)
    ppos = torch.arange(lmax).expand(n, lmax).clone()
    plab = torch.full((n, lmax), -100, dtype=torch.long)
    start = 0
    for i, ln in enumerate(lengths):
        pid[i, :ln] = ids[0, start : start + ln].cpu()
        plab[i, :ln] = labels[0, start : start + ln].cpu()
        start += ln
    return pid.to(device), ppos.to(device), plab.to(device)


def loss_of(logits, labels):
    return F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), ignore_index=-100)


def llama_setup(args, device: torch.device, dtype: torch.dtype) -> Setup:
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
    gen = torch.Generator().manual_seed(1)
    ids, pos, labels = packed_batch(lengths, config.vocab_size, device, gen)
    meta = AttentionMetadata.from_lengths(lengths, max_docs=len(lengths) + 16, device=device)
    pid, ppos, plab = padded_batch(lengths, ids, labels, device)
    header = (
        f"model dim {args.dim} x {args.layers} layers, H={args.heads}, G={args.kv_heads}; {sum(lengths)} tokens "
        f"in {len(lengths)} documents (max {max(lengths)}); padded batch {tuple(pid.shape)}"
    )

    usp_model = torch.compile(model, backend="usp", options={"inner": args.inner})
    pad_model = torch.compile(model)

    def usp_step():
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(meta):
            loss = loss_of(usp_model(ids, pos), labels)
        loss.backward()
        return loss

    def pad_step():
        model.zero_grad(set_to_none=True)
        loss = loss_of(pad_model(pid, ppos), plab)
        loss.backward()
        return loss

    return Setup(usp_step, pad_step, sum(lengths), header, {"lengths": lengths})


# -- Flux -------------------------------------------------------------------------------------------


def flux_axes_dims(head_dim: int) -> tuple[int, int, int]:
    """Even RoPE axes summing to the head dim, Flux-like: a small first axis, rows and columns equal
    (or nearly): 128 -> (16, 56, 56)."""
    first = max(2, head_dim // 16 * 2)
    rows = (head_dim - first) // 4 * 2
    return first, rows, head_dim - first - rows


def flux_sample_lengths(
    total: int, txt_range: tuple[int, int], side_range: tuple[int, int], seed: int
) -> tuple[list[int], list[int]]:
    """Text lengths uniform in ``txt_range``, image lengths ``side**2`` with a log-normal side
    clamped to ``side_range``, until text + image tokens reach exactly ``total``."""
    gen = torch.Generator().manual_seed(seed)
    lo, hi = side_range
    log_mid = 0.5 * (math.log(lo) + math.log(hi))
    txt: list[int] = []
    img: list[int] = []
    while sum(txt) + sum(img) < total:
        t = int(torch.randint(txt_range[0], txt_range[1] + 1, (1,), generator=gen))
        side = int(torch.empty(1).log_normal_(log_mid, 0.4, generator=gen).clamp(lo, hi).round())
        i = side * side
        left = total - sum(txt) - sum(img)
        if t + i > left:  # the last sample takes what is left, mostly image
            t = min(t, max(1, left // 4))
            i = left - t
        txt.append(t)
        img.append(i)
    if img[-1] == 0 and len(img) > 1:  # a lone leftover text token joins the previous sample's image
        txt.pop()
        img.pop()
        img[-1] += 1
    return txt, img


def padded_flux_batch(
    batch: dict[str, torch.Tensor], txt_lens: list[int], img_lens: list[int]
) -> dict[str, torch.Tensor]:
    """The packed samples as N rows: text padded to the longest text, image to the longest image.

    ``attn_mask`` (N, 1, 1, Tmax + Imax) is True on real keys; ``img_mask`` (N, Imax) marks the
    real image tokens (the loss's). Timesteps and pooled vectors are already one per sample.
    """
    n, tmax, imax = len(txt_lens), max(txt_lens), max(img_lens)
    device = batch["img"].device

    def pad(x_1LF: torch.Tensor, lens: list[int], width: int) -> torch.Tensor:
        out_NLF = x_1LF.new_zeros(n, width, x_1LF.shape[-1])
        start = 0
        for row, ln in enumerate(lens):
            out_NLF[row, :ln] = x_1LF[0, start : start + ln]
            start += ln
        return out_NLF

    txt_real_NT = torch.arange(tmax, device=device) < torch.tensor(txt_lens, device=device)[:, None]
    img_real_NI = torch.arange(imax, device=device) < torch.tensor(img_lens, device=device)[:, None]
    return {
        "img": pad(batch["img"], img_lens, imax),
        "txt": pad(batch["txt"], txt_lens, tmax),
        "timesteps": batch["timesteps"],
        "img_ids": pad(batch["img_ids"], img_lens, imax),
        "txt_ids": pad(batch["txt_ids"], txt_lens, tmax),
        "pooled": batch["pooled"],
        "target": pad(batch["target"], img_lens, imax),
        "attn_mask": torch.cat([txt_real_NT, img_real_NI], dim=1)[:, None, None],
        "img_mask": img_real_NI,
    }


def masked_mse(out_BIC: torch.Tensor, target_BIC: torch.Tensor, real_BI: torch.Tensor | None) -> torch.Tensor:
    """Float32 mean squared error over the real image tokens (all when ``real_BI`` is None)."""
    err_BIC = (out_BIC.float() - target_BIC.float()) ** 2
    if real_BI is None:
        return err_BIC.mean()
    return (err_BIC * real_BI[..., None]).sum() / (real_BI.sum() * out_BIC.shape[-1])


def flux_setup(args, device: torch.device, dtype: torch.dtype) -> Setup:
    head_dim = args.dim // args.heads
    quick = args.quick
    config = FluxConfig(
        in_channels=8 if quick else 64,
        hidden=args.dim,
        n_heads=args.heads,
        txt_dim=32 if quick else 1024,
        pooled_dim=16 if quick else 768,
        n_double=args.double,
        n_single=args.single,
        mlp_ratio=2.0 if quick else 4.0,
        axes_dims=flux_axes_dims(head_dim),
    )
    torch.manual_seed(0)
    model = Flux(config).to(device=device, dtype=dtype)
    txt_lens, img_lens = flux_sample_lengths(
        args.tokens, (4, 16) if quick else (64, 512), (2, 8) if quick else (16, 90), seed=0
    )
    batch, joint_lens = make_packed_flux_batch(
        config, txt_lens, img_lens, generator=torch.Generator().manual_seed(1), dtype=dtype, device=device
    )
    meta = AttentionMetadata.from_lengths(joint_lens, max_docs=len(joint_lens) + 16, device=device)
    pad = padded_flux_batch(batch, txt_lens, img_lens)
    names = ("img", "txt", "timesteps", "img_ids", "txt_ids", "pooled")
    packed_args = tuple(batch[k] for k in names)
    padded_args = tuple(pad[k] for k in names)
    header = (
        f"flux hidden {args.dim}, H={args.heads} (axes {config.axes_dims}), {args.double} double + {args.single} "
        f"single blocks; {sum(joint_lens)} tokens in {len(joint_lens)} samples (text {min(txt_lens)}..{max(txt_lens)}, "
        f"image {min(img_lens)}..{max(img_lens)}); padded batch ({len(joint_lens)}, "
        f"{max(txt_lens)} + {max(img_lens)})"
    )

    usp_model = torch.compile(model, backend="usp", options={"inner": args.inner})
    # Static shapes: the padded call is the second shape this forward sees, which would otherwise
    # make Dynamo recompile it with dynamic shapes (slower code, and inductor has failed on it).
    pad_model = torch.compile(model, dynamic=False)

    def usp_step():
        model.zero_grad(set_to_none=True)
        with usp_graph.documents(meta):
            out = usp_model(*packed_args, txt_doc_T=batch["txt_doc"], img_doc_I=batch["img_doc"])
        loss = masked_mse(out, batch["target"], None)
        loss.backward()
        return loss

    def pad_step():
        model.zero_grad(set_to_none=True)
        out = pad_model(*padded_args, pad["attn_mask"])
        loss = masked_mse(out, pad["target"], pad["img_mask"])
        loss.backward()
        return loss

    info = {"txt_lens": txt_lens, "img_lens": img_lens, "joint_lens": joint_lens}
    return Setup(usp_step, pad_step, sum(joint_lens), header, info)


def _under_kernel(step: Callable[[], torch.Tensor], kernel: str) -> Callable[[], torch.Tensor]:
    """`step` (forward and backward) with usp's CUDA attention kernel set to `kernel`."""

    def run() -> torch.Tensor:
        with cuda_kernel(kernel):
            return step()

    return run


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=("llama", "flux"), default="llama")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--doc-mean", type=float, default=2048, help="llama: mean document length")
    ap.add_argument("--dim", type=int, default=2048, help="model (hidden) width")
    ap.add_argument("--layers", type=int, default=4, help="llama: decoder layers")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4, help="llama: key/value heads")
    ap.add_argument("--double", type=int, default=2, help="flux: double-stream blocks")
    ap.add_argument("--single", type=int, default=4, help="flux: single-stream blocks")
    ap.add_argument("--inner", choices=("inductor", "aot_eager"), default=None,
                    help="usp inner compiler (default: inductor on cuda, aot_eager on cpu)")  # fmt: skip
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--usp-kernels", default="auto",
                    help="comma list of usp CUDA attention kernels to time, one path each (auto, flash, flex, cudnn): "
                         "the same compiled step, the kernel chosen at run time")  # fmt: skip
    ap.add_argument("--no-padded", action="store_true",
                    help="skip the padded SDPA baseline (then the first usp path is the reference)")  # fmt: skip
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--quick", action="store_true")
    add_json_arg(ap)
    args = ap.parse_args()
    if args.quick:
        args.tokens, args.doc_mean, args.dim, args.layers, args.heads, args.kv_heads, args.reps = (
            256,
            40,
            64,
            1,
            4,
            2,
            2,
        )
        args.double, args.single = 1, 1
    device = torch.device(args.device)
    if args.inner is None:
        args.inner = "inductor" if device.type == "cuda" else "aot_eager"
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    setup = (flux_setup if args.model == "flux" else llama_setup)(args, device, dtype)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, {dtype}; "
          f"{setup.header}", flush=True)  # fmt: skip

    kernels = [k.strip() for k in args.usp_kernels.split(",") if k.strip()]
    unknown = sorted(set(kernels) - set(CUDA_KERNELS))
    if unknown or not kernels:
        ap.error(
            f"--usp-kernels takes a comma list out of {', '.join(CUDA_KERNELS)}, got {args.usp_kernels!r}"
        )
    paths: list[tuple[str, Callable[[], torch.Tensor]]] = []
    for kernel in kernels:
        name = f"usp ({args.inner})" if kernels == ["auto"] else f"usp ({args.inner}, {kernel} kernel)"
        paths.append((name, _under_kernel(setup.usp_step, kernel)))
    padded = "padded SDPA (inductor)"
    if not args.no_padded:
        paths.append((padded, setup.pad_step))
    ref_name = paths[0][0] if args.no_padded else padded
    # First steps (compile) of every path, then their losses compared before any timing.
    first = {}
    for name, step in paths:
        with stopwatch(device) as watch:
            loss = step()
        first[name] = (float(loss.detach()), watch.seconds)
    ref_loss = first[ref_name][0]
    rels = {name: abs(first[name][0] - ref_loss) / abs(ref_loss) for name, _ in paths if name != ref_name}
    rel = max(rels.values(), default=0.0)
    verdict = "PASS" if rel < TOLERANCE else "FAIL"
    for name, r in rels.items():
        print(
            f"loss agreement: {name} {first[name][0]:.5f} vs {ref_name} {ref_loss:.5f}, rel diff {r:.1e}",
            flush=True,
        )

    rows = {}
    for name, step in paths:
        calls: dict[str, int] = {}
        if name == padded:
            step()  # warm-up
        else:
            _, calls = kernel_calls(step)  # also the warm-up
            print(f"{name}: attention calls fwd {calls['fwd']} (flex {calls['flex_fwd']}, cudnn {calls['cudnn_fwd']}), "
                  f"bwd {calls['bwd']} (flex {calls['flex_bwd']}, cudnn {calls['cudnn_bwd']})", flush=True)  # fmt: skip
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        ms = time_ms(step, device, warmup=0, reps=args.reps).median_ms
        peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0
        loss, compile_s = first[name]
        rows[name] = {"loss": loss, "ms": ms, "compile_s": compile_s, "peak_gib": peak,
                      "tokens_per_s": setup.useful_tokens / ms * 1e3, "kernel_calls": calls}  # fmt: skip
        print(f"{name}: loss {loss:.5f}, step {ms:.2f} ms, {rows[name]['tokens_per_s']:.0f} tok/s, "
              f"peak {peak:.2f} GiB, first step {compile_s:.1f} s", flush=True)  # fmt: skip
    b = rows[ref_name]
    print(f"\nloss agreement: worst rel diff {rel:.1e} ({verdict}); speedup vs {ref_name}")
    print("| path | loss | step ms | tokens/s | speedup | peak GiB |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(
            f"| {name} | {r['loss']:.5f} | {r['ms']:.2f} | {r['tokens_per_s']:.0f} | {b['ms'] / r['ms']:.2f}x "
            f"| {r['peak_gib']:.2f} |"
        )
    results = Results(args.json, bench="train", device=device)
    settings = {k: v for k, v in vars(args).items() if k != "json"}
    for name, r in rows.items():
        results.write(settings=settings, **setup.info, path=name, reference=ref_name, speedup=b["ms"] / r["ms"],
                      loss_rel_diff=rel, loss_pass=rel < TOLERANCE, **r)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
