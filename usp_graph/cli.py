"""The ``usp-graph`` command line (also ``python -m usp_graph``)."""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence

EXAMPLES = """examples:
  usp-graph demo                      run the main job on the embedded default model
  usp-graph demo --docs 12 --seed 3   more documents, another draw of boundaries
"""


def _loss_and_grads(model, loss_fn, batch):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model, batch)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def _demo(args: argparse.Namespace) -> int:
    import torch

    from . import AttentionMetadata, attention_mode
    from .models import Llama, LlamaConfig, llama_loss, make_llama_batch

    def say(msg: str) -> None:
        print(msg, flush=True)

    t0 = time.perf_counter()
    gen = torch.Generator().manual_seed(args.seed)
    config = LlamaConfig(vocab_size=256, dim=64, n_layers=args.layers, n_heads=4, n_kv_heads=2, ffn_dim=128)
    # Log-normal document lengths with empty and length-1 documents mixed in, as real packs have.
    lengths = (
        (torch.randn(args.docs, generator=gen, dtype=torch.float64) * 0.8 + 3.0)
        .exp()
        .round()
        .long()
        .clamp(1, 200)
    )
    lengths[1 % args.docs] = 0
    lengths[2 % args.docs] = 1
    lengths = lengths.tolist()
    say(
        f"[1/3] Llama-style model ({config.n_layers} layers, {config.n_heads} heads, {config.n_kv_heads} kv heads)"
    )
    say(f"      packed row of {sum(lengths)} tokens in {len(lengths)} documents: {lengths}")

    status = 0
    for dtype, tol in ((torch.float64, 1e-10), (torch.float32, 1e-5)):
        torch.manual_seed(args.seed)
        model = Llama(config).to(dtype)
        batch = make_llama_batch(
            config, lengths, generator=torch.Generator().manual_seed(args.seed), with_attn_mask=True
        )
        meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=len(lengths) + 4)

        ref_loss, ref_grads = _loss_and_grads(model, llama_loss, batch)
        plain = {k: v for k, v in batch.items() if k != "attn_mask"}
        with attention_mode(meta) as mode:
            loss, grads = _loss_and_grads(model, llama_loss, plain)
        worst = max(((g - ref_grads[n]).norm() / ref_grads[n].norm()).item() for n, g in grads.items())
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        ok = loss_err <= tol and worst <= tol
        status |= not ok
        say(
            f"[2/3] {str(dtype).removeprefix('torch.'):8s} {mode.calls} SDPA calls -> usp::varlen_fwd/bwd; "
            f"vs SDPA + block-diagonal mask: loss rel err {loss_err:.1e}, worst grad rel err {worst:.1e} "
            f"(<= {tol:.0e}) {'OK' if ok else 'FAIL'}"
        )

    torch.manual_seed(args.seed)
    model = Llama(config)
    with attention_mode(meta):
        a = model(plain["input_ids"], plain["position_ids"])
        b = model(plain["input_ids"], plain["position_ids"])
    same = torch.equal(a, b)
    status |= not same
    say(f"[3/3] two eager runs bitwise equal: {'OK' if same else 'FAIL'}")
    say(
        f"done in {time.perf_counter() - t0:.1f} s: {'all checks passed' if status == 0 else 'CHECKS FAILED'}"
    )
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="usp-graph",
        description="usp_graph: SDPA -> varlen attention + context-parallel collectives, with registered backward rules.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    demo = sub.add_parser(
        "demo",
        help="run the main job on the embedded default model",
        description="Route a small Llama-style model's SDPA calls through varlen attention on packed "
        "documents and check loss and every grad against SDPA with a block-diagonal mask.",
    )
    demo.add_argument("--docs", type=int, default=8, help="documents in the packed row (default 8)")
    demo.add_argument("--layers", type=int, default=2, help="decoder layers (default 2)")
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "docs", 1) < 3:
        print("usp-graph demo: --docs must be at least 3", file=sys.stderr)
        return 2
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
