"""GPU: a NaN in one query row, through each CUDA kernel, and the "usp" attention of transformers
on CUDA under inductor with an all-ones attention_mask and flash-attention kwargs.

    PYTHONUNBUFFERED=1 python tools/check_nan_gpu.py

Prints, per kernel (cuDNN, flash varlen, flex): whether the row is NaN, its lse, whether the other
documents' output and query gradient stay finite, the warnings of the first call (a kernel that
disagrees with flash on its first call is moved to flash for good) and how many shapes were moved;
then the max error of a tiny bf16 Llama with "usp" (eager and `torch.compile`) against "sdpa".
"""

from __future__ import annotations

import warnings

import torch
import transformers

import usp_graph  # noqa: F401 - registers attn_implementation="usp"
from usp_graph import varlen_attn
from usp_graph.ops import kernel_choice as kc


def kernels(dev: str = "cuda") -> None:
    cu = torch.tensor([0, 1000, 3000, 4096], dtype=torch.int32, device=dev)
    for name in ("cudnn", "flash", "flex"):
        torch.manual_seed(0)
        q, k, v = (torch.randn(4096, 8, 128, device=dev, dtype=torch.bfloat16) for _ in range(3))
        q[1500, 2, 5] = float("nan")
        for t in (q, k, v):
            t.requires_grad_()
        with warnings.catch_warnings(record=True) as caught, kc.cuda_kernel(name):
            warnings.simplefilter("always")
            out, lse = varlen_attn(q, k, v, cu, cu, 2000, 2000, is_causal=True, return_lse=True)
            out.float().sum().backward()
        moved = [str(w.message)[:120] for w in caught if "usp_graph" in str(w.message)]
        print(
            f"{name}: row NaN {bool(out[1500, 2].isnan().all())}, lse {lse[2, 1500].item()}, other documents "
            f"finite {bool(out[:1000].isfinite().all() and out[3000:].isfinite().all())}, their dq finite "
            f"{bool(q.grad[:1000].isfinite().all())}, warnings {moved}, moved to flash {len(kc._cudnn_broken)}",
            flush=True,
        )


def llama(dev: str = "cuda") -> None:
    cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=128)  # fmt: skip
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
    usp = transformers.LlamaForCausalLM(cfg).to(dev, torch.bfloat16)
    usp.load_state_dict(ref.state_dict())
    usp.set_attn_implementation("usp")
    ids = torch.randint(0, 64, (1, 48), device=dev)
    docs = [{"input_ids": d} for d in (ids[0, :20].tolist(), ids[0, 20:21].tolist(), ids[0, 21:].tolist())]
    batch = transformers.DataCollatorWithFlattening(return_flash_attn_kwargs=True)(docs)
    batch = {k: v.to(dev) for k, v in batch.items() if k != "labels" and hasattr(v, "to")}
    expected = ref(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits
    ones = ref(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
    for label, fn in (("eager", usp), ("inductor", torch.compile(usp))):
        a = fn(**batch, use_cache=False).logits
        b = fn(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        print(f"{label}: flash kwargs err {(a - expected).abs().max().item()}, all-ones mask err "
              f"{(b - ones).abs().max().item()}", flush=True)  # fmt: skip


if __name__ == "__main__":
    kernels()
    llama()
