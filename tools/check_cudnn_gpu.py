"""GPU checks of the cuDNN kernel behind usp's varlen ops (issue 16) and of the max_seqlen guard
(issue 17, item 4).

# T packed tokens, H query heads, G key/value heads, K head dim, N document slots

Run on a CUDA machine with ``nvidia-cudnn-frontend`` importable, from the repo root:
    PYTHONUNBUFFERED=1 python tools/check_cudnn_gpu.py [--json OUT.jsonl]

1. ``forms``: every varlen form under ``cuda_kernel("cudnn")`` against the float64 per-document
   reference (`usp_graph.testing.attention_reference`; out, lse, dq, dk, dv; bf16/fp16 tolerance 2e-2): self-attention with empty
   and length-1 documents and unused capacity, GQA, head dims 64/128, distinct query/key
   boundaries (bottom-right causal, documents without keys or without queries), keys outside every
   document (zero gradient), sliding windows. Each case must run on cuDNN (graph executions
   counted) with no fallback warning.
2. ``reuse``: new boundaries with the same capacity and max length build no graph.
3. ``determinism``: forward bitwise repeat; default backward repeat (reported); backward under
   ``torch.use_deterministic_algorithms(True)`` bitwise over 3 runs (required), its workspace
   and time against the default backward (T=32768, H=16, K=128).
4. ``max_seqlen``: a max_seqlen below the longest document (T=512, documents [300, 212],
   max_seqlen=64) must not return: each kernel in a subprocess, which must fail (device-side
   assert); the same with max_seqlen=300 must pass.
Exits non-zero when any check fails.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import warnings

import torch
from harness import Results, stopwatch, time_ms

from usp_graph import varlen_attn
from usp_graph.ops import cudnn_kernel, varlen
from usp_graph.ops.varlen import cuda_kernel
from usp_graph.testing import attention_reference, lognormal_lengths, rel_err

RESULTS: list[dict] = []
TOL = 2e-2


def rel(x, ref):
    """`rel_err` over the entries where the reference is finite (lse is -inf on rows with no key)."""
    finite = torch.isfinite(ref)
    return rel_err(torch.where(finite, x.double(), 0), torch.where(finite, ref.double(), 0))


def cu_of(lens, extra_slots, dev, offset=0):
    c = [0]
    for n in lens:
        c.append(c[-1] + n)
    c += [c[-1]] * extra_slots
    return torch.tensor(c, dtype=torch.int32, device=dev) + offset


def record(name, ok, **info):
    RESULTS.append({"check": name, "ok": bool(ok), **info})
    shown = " ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
    print(f"{'PASS' if ok else 'FAIL'} {name}: {shown}", flush=True)
    return ok


def form(name, lens_q, lens_k, h, g, d, causal, *, window=(-1, -1), pad=(0, 0), dtype=torch.bfloat16, gen):
    """One varlen call forced onto cuDNN vs the float64 math path. lens_k None: self-attention
    (one boundary tensor); pad: keys outside every document before and after."""
    dev = "cuda"
    shared = lens_k is None
    cu_q = cu_of(lens_q, 3, dev)
    a, b = pad
    if shared and pad == (0, 0):
        cu_k = cu_q
        t_k = cu_q[-1].item()
    else:
        lk = lens_q if lens_k is None else lens_k
        cu_k = cu_of(lk, 3, dev, offset=a)
        t_k = a + sum(lk) + b
    t_q = sum(lens_q)
    max_q, max_k = max(lens_q), max(lens_q if lens_k is None else lens_k)
    q = torch.randn(t_q, h, d, generator=gen, device=dev).to(dtype).requires_grad_()
    k = torch.randn(t_k, g, d, generator=gen, device=dev).to(dtype).requires_grad_()
    v = torch.randn(t_k, g, d, generator=gen, device=dev).to(dtype).requires_grad_()
    dout = torch.randn(t_q, h, d, generator=gen, device=dev).to(dtype)
    scale = d**-0.5
    runs = dict(cudnn_kernel._runs)
    with warnings.catch_warnings(record=True) as caught, cuda_kernel("cudnn"):
        warnings.simplefilter("always")
        out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=causal, enable_gqa=True,
                               return_lse=True, window=window)  # fmt: skip
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ran = {kind: cudnn_kernel._runs[kind] - runs[kind] for kind in runs}
    fallbacks = [str(w.message)[:300] for w in caught if issubclass(w.category, RuntimeWarning)]
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref_out, ref_lse = attention_reference(
        q64, k64, v64, cu_q, cu_k, is_causal=causal, scale=scale, window=window
    )
    rq, rk, rv = torch.autograd.grad(ref_out, (q64, k64, v64), dout.double())
    errs = {
        "out": rel(out, ref_out),
        "lse": rel(lse, ref_lse),
        "dq": rel(dq, rq),
        "dk": rel(dk, rk),
        "dv": rel(dv, rv),
    }
    inf_rows = bool(torch.equal(lse == float("-inf"), ref_lse == float("-inf")))
    pads_zero = True
    if a or b:
        pads_zero = all(bool((x[:a] == 0).all() and (x[a + sum(lens_q if lens_k is None else lens_k) :] == 0).all()) for x in (dk, dv))  # fmt: skip
    finite = all(bool(x.isfinite().all()) for x in (out, dq, dk, dv))
    ok = all(e <= TOL for e in errs.values()) and inf_rows and pads_zero and finite and not fallbacks
    ok = ok and ran["fwd"] >= 1 and ran["bwd"] >= 1
    return record(f"forms: {name}", ok, **errs, inf_rows_match=inf_rows, pad_grads_zero=pads_zero,
                  cudnn_runs=ran, fallbacks=fallbacks)  # fmt: skip


def check_forms(gen):
    lens = [300, 0, 1, 1000, 37, 1, 512, 2048]
    ok = True
    for causal in (False, True):
        tag = "causal" if causal else "bidir"
        ok &= form(f"self MHA 8 K=128 {tag}", lens, None, 8, 8, 128, causal, gen=gen)
        ok &= form(f"self GQA 8/2 K=64 {tag}", lens, None, 8, 2, 64, causal, gen=gen)
        ok &= form(f"q/k boundaries differ, GQA 4/1 K=64 {tag}", [30, 100, 0, 7, 64], [100, 30, 5, 0, 64], 4, 1, 64, causal, gen=gen)  # fmt: skip
        ok &= form(f"keys outside every document, GQA 8/2 K=128 {tag}", [300, 0, 1, 1000, 37], None, 8, 2, 128, causal, pad=(64, 100), gen=gen)  # fmt: skip
        ok &= form(
            f"empty and length-1 documents {tag}", [1, 1, 0, 1, 5, 0, 1], None, 4, 4, 64, causal, gen=gen
        )
        ok &= form(
            f"fp16 self GQA 8/2 K=128 {tag}", lens, None, 8, 2, 128, causal, dtype=torch.float16, gen=gen
        )
    ok &= form("window (64, 0) causal self", lens, None, 8, 2, 128, True, window=(64, 0), gen=gen)
    ok &= form("window (32, 16) bidirectional self", lens, None, 8, 8, 64, False, window=(32, 16), gen=gen)
    ok &= form("window (16, -1) q/k differ causal", [30, 100, 0, 7, 64], [100, 30, 5, 0, 64], 4, 1, 64, True, window=(16, -1), gen=gen)  # fmt: skip
    return ok


def check_reuse(gen):
    dev = "cuda"
    h, d = 8, 128
    builds = dict(cudnn_kernel._builds)
    ok = True
    for i, lens in enumerate(([500, 12, 0, 1, 1511, 24], [1511, 1, 1, 300, 200, 35], [2048])):
        if i == 1:  # the first boundaries build what this shape needs (a grouped backward: two graphs)
            builds = dict(cudnn_kernel._builds)
        cu = cu_of(lens, 6 - len(lens) + 3, dev)
        t = sum(lens)
        q, k, v = (
            torch.randn(t, h, d, generator=gen, device=dev).bfloat16().requires_grad_() for _ in range(3)
        )
        with cuda_kernel("cudnn"):
            out = varlen_attn(q, k, v, cu, cu, 2048, 2048, is_causal=True)
            grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
        ro, _ = attention_reference(q64, k64, v64, cu, is_causal=True, scale=d**-0.5)
        rg = torch.autograd.grad(ro.square().sum(), (q64, k64, v64))
        ok &= rel(out, ro) <= TOL and all(rel(a, b) <= TOL for a, b in zip(grads, rg, strict=True))
    new = {kind: cudnn_kernel._builds[kind] - builds[kind] for kind in builds}
    # the boundaries after the first build no graph
    return record("reuse: 3 sets of boundaries, same capacity and max_seqlen", ok and new == {"fwd": 0, "bwd": 0}, builds=new)  # fmt: skip


def _time(fn, reps=10):
    return time_ms(fn, "cuda", warmup=2, reps=reps).median_ms


def check_determinism(gen):
    dev, h, g, d, t = "cuda", 16, 16, 128, 32768
    # Documents of at most 2048 tokens: the deterministic backward's workspace grows with
    # slots x S^2 (87.6 GB at 25 x 10421, 14.5 GB at 27 x 4096 on the H200), so S stays tight.
    lens = [piece for n in lognormal_lengths(t, 2048, seed=1) for piece in [2048] * (n // 2048) + [n % 2048] if piece]  # fmt: skip
    cu = cu_of(lens, 4, dev)
    m = max(lens)
    q, k, v, dout = (torch.randn(t, x, d, generator=gen, device=dev).bfloat16() for x in (h, g, g, h))
    scale = d**-0.5
    info: dict = {"T": t, "documents": len(lens), "max_len": m}
    with cuda_kernel("cudnn"):
        out, lse = torch.ops.usp.varlen_fwd(q, k, v, cu, cu, m, m, True, scale)
        out2, lse2 = torch.ops.usp.varlen_fwd(q, k, v, cu, cu, m, m, True, scale)
        fwd_eq = torch.equal(out, out2) and torch.equal(lse, lse2)

        def bwd():
            return torch.ops.usp.varlen_bwd(dout, q, k, v, out, lse, cu, cu, m, m, True, scale)

        default = [bwd() for _ in range(3)]
        info["default_bwd_bitwise"] = {n: all(torch.equal(default[0][i], r[i]) for r in default[1:]) for i, n in enumerate(("dq", "dk", "dv"))}  # fmt: skip
        info["default_bwd_ms"] = _time(bwd)
        torch.use_deterministic_algorithms(True)
        try:
            det = [bwd() for _ in range(3)]
            info["det_bwd_ms"] = _time(bwd)
        finally:
            torch.use_deterministic_algorithms(False)
    det_key = cudnn_kernel.plan_key(q, k, cu, m, m, True, scale, (-1, -1), square=True, backward=True, deterministic=True)  # fmt: skip
    plan = cudnn_kernel._plans.get(("bwd", det_key))
    info["det_ran_on_cudnn"] = plan is not None and det_key not in varlen._cudnn_broken
    info["det_workspace_mib"] = round(plan.workspace / 2**20, 1) if plan else None
    info["det_bwd_bitwise"] = {n: all(torch.equal(det[0][i], r[i]) for r in det[1:]) for i, n in enumerate(("dq", "dk", "dv"))}  # fmt: skip
    info["det_vs_default_max_abs"] = {n: float((det[0][i].float() - default[0][i].float()).abs().max()) for i, n in enumerate(("dq", "dk", "dv"))}  # fmt: skip
    info["fwd_bitwise"] = fwd_eq
    ok = fwd_eq and all(info["det_bwd_bitwise"].values()) and info["det_ran_on_cudnn"]
    return record("determinism (32K causal, H=16, K=128, documents <= 2048)", ok, **info)


_CHILD = """
import torch
from usp_graph import varlen_attn
from usp_graph.ops.varlen import cuda_kernel
cu = torch.tensor([0, 300, 512], dtype=torch.int32, device="cuda")
g = torch.Generator(device="cuda").manual_seed(0)
q, k, v = (torch.randn(512, 4, 64, generator=g, device="cuda").bfloat16() for _ in range(3))
with cuda_kernel({kernel!r}):
    out = varlen_attn(q, k, v, cu, cu, {max_len}, {max_len}, is_causal=False)
    torch.cuda.synchronize()
print("RETURNED", float(out.float().abs().max()))
"""


def check_max_seqlen():
    ok = True
    for kernel in ("flash", "cudnn", "auto"):
        for max_len, must_fail in ((64, True), (300, False)):
            p = subprocess.run([sys.executable, "-c", _CHILD.format(kernel=kernel, max_len=max_len)],
                               capture_output=True, text=True, timeout=180)  # fmt: skip
            failed = p.returncode != 0 and "RETURNED" not in p.stdout
            tail = (p.stderr.strip().splitlines() or [""])[-1][:200]
            ok &= record(f"max_seqlen={max_len} (longest document 300), kernel {kernel}", failed == must_fail,
                         returncode=p.returncode, stdout=p.stdout.strip()[:80], stderr_tail=tail)  # fmt: skip
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", default=None, help="append one JSON line per check here")
    ap.add_argument("--only", default="forms,reuse,determinism,max_seqlen")
    args = ap.parse_args()
    cudnn = cudnn_kernel.module()
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, libcudnn {torch.backends.cudnn.version()}, "
          f"cudnn frontend {getattr(cudnn, '__version__', None)} (backend {cudnn.backend_version() if cudnn else None})")  # fmt: skip
    if cudnn is None:
        print("FAIL: the cuDNN frontend is not importable")
        return 1
    gen = torch.Generator(device="cuda").manual_seed(0)
    with stopwatch("cuda") as watch:
        ok = run_checks(args.only.split(","), gen)
    print(f"builds {cudnn_kernel._builds}, runs {cudnn_kernel._runs}, {watch.seconds:.0f} s")
    out = Results(args.json, bench="check_cudnn", device="cuda")
    for r in RESULTS:
        out.write(**r)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


def run_checks(names, gen) -> bool:
    ok = True
    for name in names:
        try:
            if name == "forms":
                ok &= check_forms(gen)
            elif name == "reuse":
                ok &= check_reuse(gen)
            elif name == "determinism":
                ok &= check_determinism(gen)
            elif name == "max_seqlen":
                ok &= check_max_seqlen()
        except Exception as exc:  # report and go on with the next check
            import traceback

            traceback.print_exc()
            ok &= record(name, False, error=f"{type(exc).__name__}: {str(exc)[:300]}")
    return ok


if __name__ == "__main__":
    sys.exit(main())
