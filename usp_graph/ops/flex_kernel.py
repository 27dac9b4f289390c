"""flex_attention as a kernel behind ``usp::varlen_fwd`` / ``usp::varlen_bwd`` on CUDA.

# T packed tokens, H query heads, G key/value heads, K head dim, Nb = ceil(T / block) blocks

For self-attention over packed documents (queries and keys share one `cu_seqlens`), flex_attention
with a document block mask is an exact alternative to flash varlen: 4-19% faster for forward +
backward on the H200 at 16K-128K tokens (BENCHMARKS.md). Two graphs per (T, H, G, K, Kv, dtype,
causal, scale), built on first use and compiled by inductor:

- forward: document ids (computed outside, a graph input) -> block mask (`usp_graph.flex`, a few
  fused kernels, no host sync) -> flex's forward kernel; returns ``out_THK`` and ``lse_HT`` in
  natural log (flex's own is base 2);
- backward: the same block mask and flex's own backward kernel from the saved ``out`` and ``lse``
  (no forward recomputation), through the ``flex_attention_backward`` operator that flex's
  autograd rule calls.

Both graphs come from `make_fx` over flex's operators with fake tensors (nothing runs at trace
time), then `compile_fx`, in a thread of its own (see `_build_isolated`). The operators are torch
internals (`torch._higher_order_ops.flex_attention`); the block mask goes through
`BlockMask.as_tuple()`, whose layout changes between torch releases, so one code serves each
(checked: 2.11 and 2.13). A shape whose graphs cannot be built raises `BuildError`; the caller
then runs flash varlen for it.

Limits found on the H200 with torch 2.11 (BENCHMARKS.md): a token count that is not a multiple
of the 128-token block gave finite but wrong gradients from the compiled backward (rel. error ~70
at T=3899), so `varlen` never sends such a shape here.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

__all__ = ["BuildError", "flex_fwd", "flex_bwd", "plan_key"]

_LN2 = math.log(2.0)
BLOCK_SIZE = 128


class BuildError(RuntimeError):
    """The flex kernel path could not be traced or compiled for a shape (an internal API of this
    torch moved, or inductor refused the shape); the cause is chained."""


def _score_identity(score: Tensor, b: Tensor, h: Tensor, q: Tensor, kv: Tensor) -> Tensor:
    return score


def _mask_document(b: Tensor, h: Tensor, q: Tensor, kv: Tensor, doc: Tensor) -> Tensor:
    return doc[q] == doc[kv]


def _mask_document_causal(b: Tensor, h: Tensor, q: Tensor, kv: Tensor, doc: Tensor) -> Tensor:
    return (doc[q] == doc[kv]) & (q >= kv)


def _internals() -> tuple[Any, Any, Any, Any, Any]:
    try:
        from torch._higher_order_ops.flex_attention import (
            create_fw_bw_graph,
            flex_attention,
            flex_attention_backward,
        )
        from torch.nn.attention.flex_attention import BlockMask, _apply_kernel_options
    except ImportError as exc:  # pragma: no cover - depends on the torch release
        raise BuildError(f"flex_attention internals not found in torch {torch.__version__}: {exc}") from exc
    return flex_attention, flex_attention_backward, create_fw_bw_graph, BlockMask, _apply_kernel_options


def _block_mask(doc: Tensor, blocks: tuple[Tensor, ...], is_causal: bool) -> tuple[Any, ...]:
    """flex's block-mask tuple, built directly (no `from_kv_blocks`: its transpose runs under vmap,
    which a fake-tensor trace inside another compile refused)."""
    *_, BlockMask, _ = _internals()
    total = doc.shape[0]
    mask = _mask_document_causal if is_causal else _mask_document
    bm = BlockMask((total, total), *blocks, (BLOCK_SIZE, BLOCK_SIZE), mask)
    return bm.as_tuple()


def _blocks(doc: Tensor, is_causal: bool) -> tuple[Tensor, ...]:
    from ..flex import blocks_of_documents

    return blocks_of_documents(doc, is_causal=is_causal, block_size=BLOCK_SIZE, with_q_blocks=True)


def _kernel_options(q: Tensor, k: Tensor, v: Tensor) -> dict[str, Any]:
    *_, apply = _internals()
    # Triton kernels: lse in base 2 (converted here), the same kernel on every GPU flex supports.
    return dict(apply(q, k, v, True, {"BACKEND": "TRITON"}))


def _b1(x_THK: Tensor) -> Tensor:
    return x_THK.transpose(0, 1).unsqueeze(0)


def _thk(x_1HTK: Tensor) -> Tensor:
    return x_1HTK[0].transpose(0, 1).contiguous()


def _forward_graph(is_causal: bool, scale: float, dtype: torch.dtype) -> Callable[..., tuple[Tensor, Tensor]]:
    hop, *_ = _internals()
    _score_graphs(dtype)  # ready for the backward, built here where no backward is running

    def forward(q: Tensor, k: Tensor, v: Tensor, doc: Tensor) -> tuple[Tensor, Tensor]:
        bm = _block_mask(doc, _blocks(doc, is_causal), is_causal)
        qb, kb, vb = _b1(q), _b1(k), _b1(v)
        out, lse2, _ = hop(qb, kb, vb, _score_identity, bm, scale, _kernel_options(qb, kb, vb), (), (doc,))
        return _thk(out), (lse2[0] * _LN2).contiguous()

    return forward


@functools.cache
def _score_graphs(dtype: torch.dtype) -> tuple[Any, Any]:
    """flex's forward and joint graphs of the identity score, traced on CPU scalars.

    The graphs hold no device; tracing the joint runs autograd, and on CUDA scalars that would need
    the autograd engine's device thread, which is busy when a build starts from inside a backward."""
    _, _, create_fw_bw_graph, *_ = _internals()
    example = (
        torch.zeros((), dtype=dtype, requires_grad=True),
        *(torch.zeros((), dtype=torch.int) for _ in range(4)),
    )
    with torch.enable_grad():
        return create_fw_bw_graph(_score_identity, example, ())


def _backward_graph(is_causal: bool, scale: float, dtype: torch.dtype) -> Callable[..., tuple[Tensor, ...]]:
    _, hop_bwd, *_ = _internals()
    fw_graph, joint_graph = _score_graphs(dtype)

    def backward(
        dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, doc: Tensor
    ) -> tuple[Tensor, Tensor, Tensor]:
        bm = _block_mask(doc, _blocks(doc, is_causal), is_causal)
        qb, kb, vb = _b1(q), _b1(k), _b1(v)
        lse2 = (lse * (1.0 / _LN2)).unsqueeze(0)
        dq, dk, dv, _ = hop_bwd(
            qb,
            kb,
            vb,
            _b1(out),
            lse2,
            _b1(dout),
            None,
            fw_graph,
            joint_graph,
            bm,
            scale,
            _kernel_options(qb, kb, vb),
            (),
            (doc,),
        )
        return _thk(dq), _thk(dk), _thk(dv)

    return backward


def trace(fn: Callable[..., Any], inputs: list[Tensor]) -> torch.fx.GraphModule:
    """`fn` as an aten graph, traced with fake tensors shaped like `inputs` (nothing runs)."""
    from torch._dynamo._trace_wrapped_higher_order_op import TransformGetItemToIndex
    from torch.fx.experimental.proxy_tensor import make_fx

    with torch.no_grad(), TransformGetItemToIndex():
        return make_fx(fn, tracing_mode="fake")(*inputs)


def plan_key(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float) -> tuple[Any, ...]:
    return (q.device, q.shape[0], q.shape[1], k.shape[1], q.shape[2], v.shape[2], q.dtype, is_causal, scale)


def _build_isolated(
    kind: str, key: tuple[Any, ...], build: Callable[[], Callable[..., Any]], inputs: list[Tensor]
) -> Callable[..., Any]:
    """Trace and compile in a thread of its own. The op may first run inside another compiler's
    call (torch.compile's tracing context, an ambient fake or proxy mode, functorch levels): all of
    that is thread-local, so a fresh thread traces and compiles from a clean state."""
    from concurrent.futures import ThreadPoolExecutor

    # Detached: inputs that require grad would make inductor build a training graph, whose
    # autograd trace a build from inside a backward must not start.
    examples = [x.detach() for x in inputs]

    def work() -> Callable[..., Any]:
        from torch._inductor.compile_fx import compile_fx

        if examples[0].device.type == "cuda":
            torch.cuda.set_device(examples[0].device)  # the current device is per thread
        return compile_fx(trace(build(), examples), examples)

    try:
        with ThreadPoolExecutor(1, thread_name_prefix="usp-flex-build") as pool:
            return pool.submit(work).result()
    except Exception as exc:
        raise BuildError(f"cannot build the flex {kind} kernel for {key}: {exc}") from exc


_plans: dict[tuple[Any, ...], Callable[..., Any]] = {}
_lock = threading.Lock()


def _compiled(kind: str, key: tuple[Any, ...], build: Callable[[], Callable[..., Any]], inputs: list[Tensor]):
    with _lock:
        fn = _plans.get((kind, *key))
        if fn is None:
            fn = _build_isolated(kind, key, build, inputs)
            _plans[(kind, *key)] = fn
    return fn


_aranges: dict[tuple[Any, ...], Tensor] = {}


def _doc_ids(cu: Tensor, total: int) -> Tensor:
    """`usp_graph.flex.document_ids`, with the position vector cached per (device, T). Computed
    outside the compiled graph: a buffer of the mask function must be a graph input (inductor's
    flex lowering refuses one computed inside the graph)."""
    from ..flex import document_ids

    key = (cu.device, cu.dtype, total)
    pos = _aranges.get(key)
    if pos is None:
        pos = _aranges[key] = torch.arange(total, device=cu.device, dtype=cu.dtype)
    return document_ids(cu, total, positions=pos)


def flex_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu: Tensor, is_causal: bool, scale: float
) -> tuple[Tensor, Tensor]:
    """`(out_THK, lse_HT)` of attention within the documents `cu` (queries and keys share it)."""
    key = plan_key(q, k, v, is_causal, scale)
    inputs = [q.contiguous(), k.contiguous(), v.contiguous(), _doc_ids(cu, key[1])]
    fn = _compiled("fwd", key, lambda: _forward_graph(is_causal, scale, q.dtype), inputs)
    return fn(*inputs)


def flex_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu: Tensor,
    is_causal: bool,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    """`(dq, dk, dv)` from the forward's `out` and natural-log `lse`, by flex's backward kernel."""
    key = plan_key(q, k, v, is_causal, scale)
    inputs = [*(x.contiguous() for x in (dout, q, k, v, out, lse)), _doc_ids(cu, key[1])]
    fn = _compiled("bwd", key, lambda: _backward_graph(is_causal, scale, q.dtype), inputs)
    return fn(*inputs)
