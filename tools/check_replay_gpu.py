"""A graph file replayed on the GPU with the cuDNN kernel, against the eager step (issue 16).

# T packed tokens, N documents

Run on a CUDA machine with ``nvidia-cudnn-frontend`` importable, from the repo root:
    PYTHONUNBUFFERED=1 python tools/check_replay_gpu.py [--json OUT.jsonl]
    python tools/check_replay_gpu.py --device cpu --tokens 256      # smoke test of the script

This process traces a Llama-style train step (bf16 on CUDA, head dim 128, GQA) with
`usp_graph.trace_train_step`, saves it with `usp_graph.save`, and runs the eager step
(`attention_mode`) under ``cuda_kernel("cudnn")`` on two batches (the traced boundaries and new
ones, same capacity), each twice: with ``torch.use_deterministic_algorithms(True)`` (cuDNN's
deterministic backward) and without (its default backward). A fresh Python process then loads the
file (`usp_graph.load`), rebuilds the same weights and batches from a saved state, replays each
step under the same settings, and compares every result with `torch.equal`:

- ``det``: replay == eager (the other process), loss and every gradient: REQUIRED bitwise.
- ``det_eager``: eager == eager within one process in deterministic mode: REQUIRED bitwise.
- ``default``: replay == eager with cuDNN's default backward: loss REQUIRED bitwise (the forward
  repeats); the gradients are reported (its dQ does not repeat bitwise, so every gradient
  upstream of an attention's queries may differ in the last bits), with the worst relative
  difference, which must stay within bf16 rounding (< 2e-2).
- ``cudnn``: every attention call of every step ran the cuDNN kernel (its executions counted),
  with no fallback warning.

Prints one line per check and ALL PASS / SOME FAILED; exits non-zero on a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import warnings

# cuBLAS needs this before CUDA starts for deterministic matmuls
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import torch  # noqa: E402

import usp_graph  # noqa: E402
from usp_graph import AttentionMetadata, attention_mode, trace_train_step  # noqa: E402
from usp_graph.models import Llama, LlamaConfig, llama_loss, make_llama_batch  # noqa: E402
from usp_graph.ops import cudnn_kernel  # noqa: E402
from usp_graph.ops.varlen import cuda_kernel  # noqa: E402
from usp_graph.testing import lognormal_lengths  # noqa: E402

MODES = ("det", "default")


def config_of(args: argparse.Namespace) -> LlamaConfig:
    return LlamaConfig(vocab_size=4096, dim=args.dim, n_layers=args.layers, n_heads=args.heads,
                       n_kv_heads=args.kv_heads, ffn_dim=4 * args.dim)  # fmt: skip


def batches(
    config: LlamaConfig, args: argparse.Namespace, device: torch.device
) -> list[dict[str, torch.Tensor]]:
    """Two packed batches of `args.tokens` tokens: different documents, the same capacity."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for seed in (0, 1):
        lengths = lognormal_lengths(args.tokens, args.doc_mean, seed, shortest=16)
        b = make_llama_batch(config, lengths, generator=gen)
        out.append({k: v.to(device) for k, v in b.items()})
    return out


def metadata(batch: dict[str, torch.Tensor], args: argparse.Namespace) -> AttentionMetadata:
    # max_seqlen left to the batch: cuDNN's padded length S is then the longest document (the
    # deterministic backward's workspace grows with slots x S^2; over its limit, 32 slots of
    # S = 5800 at H=8, the backward runs on flash, which this check counts as a failure)
    return AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=args.max_docs)


def settings(mode: str):
    # not warn_only: with it, torch 2.11's flash backward stays on its non-deterministic algorithm
    # (and only warns), so a shape that falls back to flash would not repeat
    torch.use_deterministic_algorithms(mode == "det")


def eager(model: Llama, batch, meta) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    model.zero_grad(set_to_none=True)
    with attention_mode(meta):
        loss = llama_loss(model, batch)
    loss.backward()
    return loss.detach().clone(), {n: p.grad.clone() for n, p in model.named_parameters()}


def counted(fn):
    """fn() under cuda_kernel("cudnn"); its result, cuDNN executions and warnings raised."""
    before = dict(cudnn_kernel._runs)
    with warnings.catch_warnings(record=True) as caught, cuda_kernel("cudnn"):
        warnings.simplefilter("always")
        result = fn()
    runs = {k: cudnn_kernel._runs[k] - before[k] for k in before}
    return result, runs, [str(w.message)[:200] for w in caught if "usp_graph" in str(w.message)]


def cpu(x):
    if isinstance(x, dict):
        return {k: cpu(v) for k, v in x.items()}
    if isinstance(x, (tuple, list)):
        return type(x)(cpu(v) for v in x)
    return x.detach().cpu() if isinstance(x, torch.Tensor) else x


def parent(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = config_of(args)
    torch.manual_seed(0)
    model = Llama(config).to(device=device, dtype=dtype)
    data = batches(config, args, device)
    metas = [metadata(b, args) for b in data]
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, "
          f"cuDNN frontend {'yes' if cudnn_kernel.available() else 'NO'}; Llama dim {args.dim}, {args.layers} layers, "
          f"H={args.heads} G={args.kv_heads} K={args.dim // args.heads}, {dtype}; "
          f"{args.tokens} tokens in {[int((b['position_ids'] == 0).sum()) for b in data]} documents, "
          f"capacity {args.max_docs}", flush=True)  # fmt: skip
    graph = trace_train_step(model, llama_loss, data[0], metas[0])
    folder = args.folder or tempfile.mkdtemp()
    path = os.path.join(folder, "llama_step" + usp_graph.graphfile.SUFFIX)
    usp_graph.save(graph, path)
    ref: dict[str, object] = {"state": cpu(model.state_dict()), "batches": cpu(data), "eager": {}, "info": {}}
    for mode in MODES:
        settings(mode)
        for i, (b, m) in enumerate(zip(data, metas, strict=True)):
            (loss, grads), runs, warned = counted(lambda b=b, m=m: eager(model, b, m))
            (loss2, grads2), _, _ = counted(lambda b=b, m=m: eager(model, b, m))
            ref["eager"][f"{mode}{i}"] = cpu((loss, grads))
            same = [n for n in grads if torch.equal(grads[n], grads2[n])]
            ref["info"][f"{mode}{i}"] = {"runs": runs, "warned": warned, "loss_repeat": bool(torch.equal(loss, loss2)),
                                         "grads_repeat": len(same), "grads": len(grads)}  # fmt: skip
    settings("default")
    state = os.path.join(folder, "ref.pt")
    torch.save(ref, state)
    cmd = [sys.executable, __file__, "--child", path, "--state", state, *sys.argv[1:]]
    out = subprocess.run(cmd, capture_output=True, text=True)
    sys.stderr.write(out.stderr[-4000:])
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    if out.returncode != 0 or not lines:
        print(out.stdout[-3000:])
        print("FAIL child process (rc", out.returncode, ")\nSOME FAILED")
        return 1
    child = json.loads(lines[-1])
    rows = []

    def check(name, ok, **info):
        rows.append({"check": name, "ok": bool(ok), **info})
        shown = " ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in info.items())
        print(f"{'PASS' if ok else 'FAIL'} {name}: {shown}", flush=True)

    n_layers = args.layers
    gpu = device.type == "cuda"
    for key, res in child["replay"].items():
        mode, info = key[:-1], ref["info"][key]
        if mode == "det":
            check(f"det batch {key[-1]}: replay (fresh process) == eager, bitwise",
                  res["loss_equal"] and res["grads_equal"] == res["grads"],
                  loss_equal=res["loss_equal"], grads_bitwise=f"{res['grads_equal']}/{res['grads']}")  # fmt: skip
            check(f"det_eager batch {key[-1]}: eager == eager in one process, bitwise",
                  info["loss_repeat"] and info["grads_repeat"] == info["grads"],
                  grads_bitwise=f"{info['grads_repeat']}/{info['grads']}")  # fmt: skip
        else:
            check(f"default batch {key[-1]}: replay loss == eager loss bitwise, gradients within rounding",
                  res["loss_equal"] and res["worst_rel"] < 2e-2,
                  grads_bitwise=f"{res['grads_equal']}/{res['grads']}", worst_rel=res["worst_rel"],
                  eager_repeat=f"{info['grads_repeat']}/{info['grads']}")  # fmt: skip
        if gpu:
            want = {"fwd": n_layers, "bwd": n_layers}
            check(f"cudnn {key}: every attention call on cuDNN (eager and replay)",
                  info["runs"] == want and res["runs"] == want and not info["warned"] and not res["warned"],
                  eager_runs=info["runs"], replay_runs=res["runs"], warned=info["warned"] + res["warned"])  # fmt: skip
    if args.json:
        with open(args.json, "a") as f:
            for r in rows:
                f.write(json.dumps({"bench": "check_replay", **r, "settings": vars(args)}) + "\n")
    ok = all(r["ok"] for r in rows)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


def child(args: argparse.Namespace) -> int:
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ref = torch.load(args.state)
    config = config_of(args)
    torch.manual_seed(0)
    model = Llama(config).to(device=device, dtype=dtype)
    model.load_state_dict(ref["state"])
    params = dict(model.named_parameters())
    step = usp_graph.load(args.child)
    data = [{k: v.to(device) for k, v in b.items()} for b in ref["batches"]]
    out = {}
    for mode in MODES:
        settings(mode)
        for i, b in enumerate(data):
            m = metadata(b, args)
            (loss, grads), runs, warned = counted(lambda b=b, m=m: step.replay(params, b, m))
            e_loss, e_grads = ref["eager"][f"{mode}{i}"]
            equal = [n for n, g in e_grads.items() if torch.equal(grads[n].cpu(), g)]
            rels = [float((grads[n].cpu().double() - g.double()).norm() / g.double().norm().clamp_min(1e-30))
                    for n, g in e_grads.items()]  # fmt: skip
            out[f"{mode}{i}"] = {"loss_equal": bool(torch.equal(loss.cpu(), e_loss)), "grads_equal": len(equal),
                                 "grads": len(e_grads), "worst_rel": max(rels), "runs": runs, "warned": warned,
                                 "differing": sorted(set(e_grads) - set(equal))[:8]}  # fmt: skip
    print(json.dumps({"replay": out}))
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--doc-mean", type=float, default=1024)
    ap.add_argument("--max-docs", type=int, default=24)
    ap.add_argument(
        "--folder", default=None, help="where the graph file and reference go (default: a temp dir)"
    )
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--state", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    return child(args) if args.child else parent(args)


if __name__ == "__main__":
    sys.exit(main())
