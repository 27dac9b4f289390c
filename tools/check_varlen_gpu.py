"""GPU correctness of usp's varlen path against the float64 per-document reference
(`usp_graph.testing.attention_reference`, the one the tests use).

# T packed tokens, H query heads, G key/value heads, K head dim, N documents

Run on a CUDA machine from the repo root:
    PYTHONUNBUFFERED=1 python tools/check_varlen_gpu.py [--json OUT.jsonl]
Exits non-zero when any case fails. Cases: bf16/fp16 (flash kernel) and fp32 (math path),
causal and bidirectional, GQA, unequal query/key lengths (bottom-right causal), empty and
length-1 documents, rows that see no key, the lse gradient, determinism (forward always; backward
where the flex kernel runs), keys outside every document (a padded key window: zero gradient), and
a Llama-style model under attention_mode and under torch.compile(backend="usp"). `--kernel flex`
runs self-attention cases whose token count is a multiple of 128 on the flex kernel.
"""

from __future__ import annotations

import argparse
import sys

import torch
from harness import Results

import usp_graph
from usp_graph import AttentionMetadata, varlen_attn
from usp_graph.ops.varlen import CUDA_KERNELS, cuda_kernel
from usp_graph.testing import attention_reference
from usp_graph.testing import rel_err as rel

TOL = {torch.bfloat16: 2e-2, torch.float16: 5e-3, torch.float32: 1e-5}


# The --kernel setting of this run. The flex kernel's backward is bitwise repeatable and that is
# required of it; flash varlen's backward accumulates dq with atomics (repeat reported, not required).
KERNEL = "auto"


def _flex_runs(lens_q, lens_k, dtype) -> bool:
    return (
        KERNEL == "flex"
        and lens_q is lens_k
        and sum(lens_q) % 128 == 0
        and dtype in (torch.bfloat16, torch.float16)
    )


def check_case(name, dtype, lens_q, lens_k, h, g, dim, is_causal, gen, results, per_token=False):
    """`per_token`: self-attention boundaries with a slot per token (T + 1 entries, unused slots
    repeating T) and max_seqlen T, as documents derived from position ids reach the op."""
    dev = "cuda"
    mq = AttentionMetadata.from_lengths(lens_q, max_docs=len(lens_q) + 3, device=dev)
    mk = AttentionMetadata.from_lengths(lens_k, max_docs=len(lens_k) + 3, device=dev)
    if per_token:
        from usp_graph.masks import cu_seqlens_from_positions

        pos = torch.cat([torch.arange(n, device=dev) for n in lens_q])[None]
        mq = mk = AttentionMetadata(cu_seqlens_from_positions(pos), pos.shape[1], pos.shape[1])
    tq, tk = mq.total_tokens, mk.total_tokens
    q = torch.randn(tq, h, dim, generator=gen, device=dev).to(dtype).requires_grad_()
    k = torch.randn(tk, g, dim, generator=gen, device=dev).to(dtype).requires_grad_()
    v = torch.randn(tk, g, dim, generator=gen, device=dev).to(dtype).requires_grad_()
    scale = dim**-0.5
    # Self-attention passes one boundary tensor twice, as sdpa_to_usp does (the flex kernel needs it).
    cu_k = mq.cu_seqlens if lens_q is lens_k else mk.cu_seqlens
    args = (mq.cu_seqlens, cu_k, mq.max_seqlen, mk.max_seqlen)
    out, lse = varlen_attn(q, k, v, *args, is_causal=is_causal, enable_gqa=True, return_lse=True)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = attention_reference(
        q64, k64, v64, mq.cu_seqlens, mk.cu_seqlens, is_causal=is_causal, scale=scale
    )
    go = torch.randn(out.shape, generator=gen, device=dev, dtype=torch.float64)
    gl = torch.randn(lse.shape, generator=gen, device=dev, dtype=torch.float64)
    finite = ref_lse.isfinite()
    # lse gradient only where lse is finite (rows that see no key have no lse derivative)
    loss = (out.double() * go).sum() + (lse.double().masked_fill(~finite, 0) * gl).sum()
    ref_loss = (ref_out * go).sum() + (ref_lse.masked_fill(~finite, 0) * gl).sum()
    grads = torch.autograd.grad(loss, (q, k, v))
    ref_grads = torch.autograd.grad(ref_loss, (q64, k64, v64))
    errs = {
        "out": rel(out, ref_out),
        "lse": rel(lse.masked_fill(~finite, 0), ref_lse.masked_fill(~finite, 0)),
        "lse_inf_rows_match": bool(torch.equal(lse == float("-inf"), ref_lse == float("-inf"))),
        "dq": rel(grads[0], ref_grads[0]),
        "dk": rel(grads[1], ref_grads[1]),
        "dv": rel(grads[2], ref_grads[2]),
    }
    # determinism: same inputs twice -> bitwise
    out2, lse2 = varlen_attn(q, k, v, *args, is_causal=is_causal, enable_gqa=True, return_lse=True)
    errs["fwd_bitwise_repeat"] = bool(torch.equal(out, out2) and torch.equal(lse, lse2))
    loss2 = (out2.double() * go).sum() + (lse2.double().masked_fill(~finite, 0) * gl).sum()
    grads2 = torch.autograd.grad(loss2, (q, k, v))
    errs["bwd_bitwise_repeat"] = all(torch.equal(a, b) for a, b in zip(grads, grads2, strict=True))
    tol = TOL[dtype]
    ok = (
        all(errs[x] <= tol for x in ("out", "lse", "dq", "dk", "dv"))
        and errs["lse_inf_rows_match"]
        and errs["fwd_bitwise_repeat"]
        and (errs["bwd_bitwise_repeat"] or not _flex_runs(lens_q, lens_k, dtype))
        and bool(out.isfinite().all())
    )
    results.append({"case": name, "dtype": str(dtype), "ok": ok, "tol": tol, **errs})
    print(
        f"{'PASS' if ok else 'FAIL'} {name:42s} {str(dtype):15s} out {errs['out']:.1e} lse {errs['lse']:.1e} "
        f"dq {errs['dq']:.1e} dk {errs['dk']:.1e} dv {errs['dv']:.1e} inf-rows {errs['lse_inf_rows_match']} "
        f"bitwise fwd {errs['fwd_bitwise_repeat']} bwd {errs['bwd_bitwise_repeat']}"
    )
    return ok


def check_padded_keys(dtype, is_causal, gen, results):
    """Keys padded on both sides (cu_k starts after 0, ends before the key count, as the halo
    strategy's key window does): same result as the unpadded keys, zero gradient on the padding."""
    dev, lens, a, b, h, g, dim = "cuda", [300, 0, 1, 1000, 37], 64, 100, 8, 2, 128
    m = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 3, device=dev)
    t = m.total_tokens
    q = torch.randn(t, h, dim, generator=gen, device=dev).to(dtype).requires_grad_()
    kp, vp = (
        torch.randn(a + t + b, g, dim, generator=gen, device=dev).to(dtype).requires_grad_() for _ in range(2)
    )
    out = varlen_attn(q, kp, vp, m.cu_seqlens, m.cu_seqlens + a, m.max_seqlen, m.max_seqlen,
                      is_causal=is_causal, enable_gqa=True)  # fmt: skip
    q64, k64, v64 = (x.detach()[s].double().requires_grad_() for x, s in ((q, slice(None)), (kp, slice(a, a + t)), (vp, slice(a, a + t))))  # fmt: skip
    ref, _ = attention_reference(q64, k64, v64, m.cu_seqlens, is_causal=is_causal, scale=dim**-0.5)
    go = torch.randn(out.shape, generator=gen, device=dev, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad((out.double() * go).sum(), (q, kp, vp))
    rq, rk, rv = torch.autograd.grad((ref * go).sum(), (q64, k64, v64))
    errs = {
        "out": rel(out, ref),
        "dq": rel(dq, rq),
        "dk": rel(dk[a : a + t], rk),
        "dv": rel(dv[a : a + t], rv),
    }
    pads_zero = all(bool((x[:a] == 0).all() and (x[a + t :] == 0).all()) for x in (dk, dv))
    ok = all(e <= TOL[dtype] for e in errs.values()) and pads_zero
    name = f"padded keys {'causal' if is_causal else 'bidir'}"
    results.append({"case": name, "dtype": str(dtype), "ok": ok, "pads_zero": pads_zero, **errs})
    print(f"{'PASS' if ok else 'FAIL'} {name:42s} {str(dtype):15s} " + " ".join(f"{k} {v:.1e}" for k, v in errs.items())
          + f" pad grads zero {pads_zero}")  # fmt: skip
    return ok


def check_model(gen, results):
    from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch

    config = LlamaConfig(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=512)
    torch.manual_seed(0)
    model = Llama(config).cuda()
    lengths = [100, 0, 1, 333, 57, 1, 220]
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(0), with_attn_mask=True)
    batch = {k: v.cuda() for k, v in batch.items()}
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=12, device="cuda")
    model_ref = Llama(config).cuda().double()
    model_ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref = llama_loss(model_ref, batch)
    ref.backward()
    plain = {k: v for k, v in batch.items() if k != "attn_mask"}
    with torch.autocast("cuda", dtype=torch.bfloat16), usp_graph.attention_mode(meta):
        loss = llama_loss(model, plain)
    loss.backward()
    worst = max(
        rel(p.grad, pr.grad) for p, pr in zip(model.parameters(), model_ref.parameters(), strict=True)
    )
    loss_err = abs(loss.item() - ref.item()) / abs(ref.item())
    ok = loss_err < 2e-2 and worst < 5e-2
    results.append(
        {
            "case": "llama bf16 autocast attention_mode vs fp64 masked SDPA",
            "ok": ok,
            "loss_rel": loss_err,
            "worst_grad_rel": worst,
        }
    )
    print(
        f"{'PASS' if ok else 'FAIL'} llama bf16 autocast attention_mode vs fp64 masked SDPA: "
        f"loss {loss_err:.1e} worst grad {worst:.1e}"
    )
    return ok


def check_compiled_model(results, device="cuda", inner="inductor", timeout_s=240.0):
    """A Llama-style train step under torch.compile(backend="usp") vs an fp64 masked-SDPA reference.

    Head dim 128 and T = 2048 (a multiple of 128), so under --kernel flex the flex kernel is built
    from inside the compiled forward and, for the backward, from inside the autograd engine. A hang
    there dumps every thread's stack and exits instead of running into the caller's time limit."""
    import faulthandler

    from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch

    config = LlamaConfig(dim=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=512)
    torch.manual_seed(0)
    model = Llama(config).to(device=device, dtype=torch.bfloat16)
    lengths = [700, 0, 1, 1000, 1, 346]
    batch = make_llama_batch(config, lengths, generator=torch.Generator().manual_seed(1), with_attn_mask=True)
    batch = {k: v.to(device) for k, v in batch.items()}
    meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=10, device=device)
    model_ref = Llama(config).to(device).double()
    model_ref.load_state_dict({k: v.double() for k, v in model.state_dict().items()})
    ref = llama_loss(model_ref, batch)
    ref.backward()
    plain = {k: v for k, v in batch.items() if k != "attn_mask"}
    compiled = torch.compile(model, backend="usp", options={"inner": inner})
    faulthandler.dump_traceback_later(timeout_s, exit=True)
    try:
        for _ in range(2):  # the second step runs the built kernels without building
            model.zero_grad(set_to_none=True)
            with usp_graph.documents(meta):
                loss = llama_loss(compiled, plain)
            loss.backward()
    finally:
        faulthandler.cancel_dump_traceback_later()
    worst = max(
        rel(p.grad, pr.grad) for p, pr in zip(model.parameters(), model_ref.parameters(), strict=True)
    )
    loss_err = abs(loss.item() - ref.item()) / abs(ref.item())
    ok = loss_err < 2e-2 and worst < 5e-2
    name = f"llama bf16 compiled (usp, {inner}) vs fp64 masked SDPA"
    results.append({"case": name, "ok": ok, "loss_rel": loss_err, "worst_grad_rel": worst})
    print(f"{'PASS' if ok else 'FAIL'} {name}: loss {loss_err:.1e} worst grad {worst:.1e}")
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="append one JSON line per case here")
    ap.add_argument(
        "--kernel",
        choices=CUDA_KERNELS,
        default="auto",
        help="CUDA kernel for self-attention cases (usp_graph.ops.kernel_choice.cuda_kernel); default auto",
    )
    ap.add_argument(
        "--dtypes", default="bfloat16,float16,float32", help="comma list of dtypes for the kernel cases"
    )
    args = ap.parse_args()
    global KERNEL
    KERNEL = args.kernel
    with cuda_kernel(args.kernel):
        return run(args)


def run(args: argparse.Namespace) -> int:
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, kernel {args.kernel}")
    gen = torch.Generator(device="cuda").manual_seed(0)
    results: list[dict] = []
    lens = [300, 0, 1, 1000, 37, 1, 512, 2048]
    lens128 = [300, 0, 1, 1000, 37, 1, 512, 2245]
    lens_pos = [1, 300, 1, 1, 1000, 37, 1, 512, 2243]  # position ids have no empty documents
    ok = True
    for dtype in (getattr(torch, name) for name in args.dtypes.split(",")):
        for causal in (False, True):
            tag = "causal" if causal else "bidir"
            ok &= check_case(
                f"equal q/k, MHA H=8 K=128 {tag}", dtype, lens, lens, 8, 8, 128, causal, gen, results
            )
            ok &= check_case(
                f"equal q/k, GQA 8/2 K=64 {tag}", dtype, lens, lens, 8, 2, 64, causal, gen, results
            )
            # T a multiple of 128: the flex kernel runs these under --kernel flex
            ok &= check_case(
                f"equal q/k T=4096, MHA H=8 K=128 {tag}",
                dtype,
                lens128,
                lens128,
                8,
                8,
                128,
                causal,
                gen,
                results,
            )
            ok &= check_case(
                f"equal q/k T=4096, GQA 8/2 K=64 {tag}",
                dtype,
                lens128,
                lens128,
                8,
                2,
                64,
                causal,
                gen,
                results,
            )
            # a slot per token (documents from position ids): flex takes them with no host read
            ok &= check_case(
                f"slot per token T=4096, GQA 8/2 K=128 {tag}",
                dtype,
                lens_pos,
                lens_pos,
                8,
                2,
                128,
                causal,
                gen,
                results,
                per_token=True,
            )
        ok &= check_case(
            "unequal q/k bottom-right causal GQA 4/1",
            dtype,
            [30, 100, 0, 7, 64],
            [100, 30, 5, 0, 64],
            4,
            1,
            64,
            True,
            gen,
            results,
        )
    for causal in (False, True):
        ok &= check_padded_keys(torch.bfloat16, causal, gen, results)
    ok &= check_model(gen, results)
    ok &= check_compiled_model(results)
    out = Results(args.json, bench="check_varlen", device="cuda")
    for r in results:
        out.write(kernel=args.kernel, **r)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
