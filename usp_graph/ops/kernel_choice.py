"""Which CUDA kernel runs ``usp::varlen_fwd`` / ``usp::varlen_bwd``: the policy, its setting,
and the first-call check of every fast kernel.

# T packed tokens, H query heads, G key/value heads, K head dim, Kv value head dim

Kernels: flash varlen (`flash_kernel`), cuDNN's ragged attention (`cudnn_kernel`, with the optional
``nvidia-cudnn-frontend`` package; every varlen form, 1.4-1.7x flash for forward+backward at
32K-256K tokens on the H200), flex_attention with a document block mask (`flex_kernel`;
deterministic backward, 4-19% faster than flash at 16K-128K tokens) for self-attention: queries and
keys share one ``cu_seqlens`` tensor and T is a multiple of 128. Other dtypes and head dims run the
math kernel (`math_kernel`).

`cuda_kernel("flash" | "flex" | "cudnn" | "auto")` or ``USP_CUDA_ATTENTION`` picks; "auto" (the
default) follows `AUTO_TABLE`. The choice depends on shapes, dtype and settings only, never on
boundary values, so a step runs the same kernels wherever it runs. cuDNN's and flex's first
forward and first backward per shape are checked against flash varlen on the same inputs; a
disagreement (or a graph that cannot be built) warns and moves that shape to flash for good.
Before any of them runs, the boundaries and max_seqlen are checked on the device and asserted
asynchronously (no host sync; `boundaries.checked_lengths`). The one exception: boundaries with a
slot per token (documents derived from position ids on the device) are cut to their documents by
one host read per boundary tensor, once per step (`_fitted`), for the kernels whose launch grid
grows with slots x max_seqlen (flash, cuDNN); flex reads its documents per token on the device and
takes them as they are, with no read. auto does not pick flex for that below 16K tokens: flex
builds its graphs per token count (about 20 s each), and the Trainer path's count changes with
every batch, for a step within 1.5% of flash's (H100, 8K tokens, BENCHMARKS.md 0j). Windows run on
cuDNN's diagonal band or flash's local-attention kernels (flex is windowless only), or the math
kernel.
"""

from __future__ import annotations

import contextlib
import math
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
from torch import Tensor

from ..metadata import fit_to_documents
from . import cudnn_kernel, flash_kernel, flex_kernel
from .boundaries import checked_lengths, per_boundaries, same_boundaries
from .flash_kernel import flash_ok
from .math_kernel import math_bwd, math_fwd
from .window import NO_WINDOW

__all__ = ["cuda_kernel", "CUDA_KERNELS", "AUTO_TABLE", "CHECK_TOL", "cuda_fwd", "cuda_bwd"]


CUDA_KERNELS = ("auto", "flash", "flex", "cudnn")
_ENV = "USP_CUDA_ATTENTION"


def _kernel_setting(value: str, where: str) -> str:
    if value not in CUDA_KERNELS:
        raise ValueError(f"{where} must be one of {', '.join(CUDA_KERNELS)}, got {value!r}")
    return value


_cuda_kernel = _kernel_setting(os.environ.get(_ENV, "auto"), _ENV)


@contextlib.contextmanager
def cuda_kernel(name: str) -> Iterator[None]:
    """Run CUDA varlen attention with kernel `name` inside the block: ``"flash"`` (flash varlen),
    ``"flex"`` (flex_attention with a document block mask, where it applies: self-attention in
    fp16/bf16; flash elsewhere), ``"cudnn"`` (cuDNN's ragged attention through the optional
    ``nvidia-cudnn-frontend`` package, where it applies: fp16/bf16 with K == Kv; flash elsewhere
    or without the package) or ``"auto"`` (the measured per-shape choice; the default). The
    process-wide default comes from ``USP_CUDA_ATTENTION``. Outputs agree within rounding across
    kernels; pick one for a run whose bits must match another run's."""
    global _cuda_kernel
    before, _cuda_kernel = _cuda_kernel, _kernel_setting(name, "cuda_kernel")
    try:
        yield
    finally:
        _cuda_kernel = before


def _flex_applies(q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor) -> bool:
    """Self-attention flex can run: shared boundaries, fp16/bf16, K == Kv a power of 2, and a
    token count that is a whole number of flex blocks (a ragged last block is not taken)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and 16 <= d <= 256
        and d & (d - 1) == 0
        and q.shape[0] > 0
        and q.shape[0] % flex_kernel.BLOCK_SIZE == 0
        and same_boundaries(q, k, cu_q, cu_k)
    )


def _cudnn_applies(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """cuDNN's ragged kernel can run: the package is installed, fp16/bf16, K == Kv, K % 8 == 0 and
    K <= 128 (a shape whose graph still fails to build runs flash, `_kernel_failed`)."""
    d = q.shape[-1]
    return (
        q.dtype in (torch.float16, torch.bfloat16)
        and d == v.shape[-1]
        and d % 8 == 0
        and d <= 128
        and q.shape[0] > 0
        and k.shape[0] > 0
        and cudnn_kernel.available()
    )


# The measured choice (tools/bench_cudnn_gpu.py and tools/bench_varlen_gpu.py on the H200,
# BENCHMARKS.md): rows (kernel, least token count, head dims) in order, the first whose kernel
# applies to the call wins; flash varlen where none does. Shapes and settings only, never boundary
# values. Through usp's op, cuDNN ran 1.4-1.7x flash varlen for fwd+bwd at 32K-256K tokens (head
# dims 64 and 128, MHA and GQA 16/4, causal and not) and at 16K with head dim 128; below that the
# op's host-side cost decides (4K: flash 1.6 ms, cuDNN 2.4 ms per fwd+bwd; 16K with head dim 64:
# flash ahead). flex measured faster than flash at T >= 16K with head dim 128, and runs there when
# the cuDNN package is absent. Below 16K it was within 1.5% of flash + the host read on the Trainer
# path (8K, H100), not enough for a graph build per token count.
FLEX_MIN_TOKENS = 16384
FLEX_HEAD_DIMS = (128,)
AUTO_TABLE: tuple[tuple[str, int, tuple[int, ...]], ...] = (
    ("cudnn", 16384, (128,)),
    ("cudnn", 32768, (64,)),
    ("flex", FLEX_MIN_TOKENS, FLEX_HEAD_DIMS),
)


def _auto_kernels(q: Tensor) -> list[str]:
    """The measured table's kernels for this shape (token count, head dim), best first."""
    rows = [name for name, tokens, dims in AUTO_TABLE if q.shape[0] >= tokens and q.shape[-1] in dims]
    return [n for n in rows if n != "cudnn" or cudnn_kernel.available()] + ["flash"]


def _auto_kernel(q: Tensor) -> str:
    """The kernel measured fastest for this shape (token count, head dim), among those installed."""
    return _auto_kernels(q)[0]


# Shapes whose flex graphs failed to build: flash varlen runs them (warned once per shape).
_flex_broken: set[tuple[object, ...]] = set()
# Likewise for cuDNN (keyed by the forward graph's key, or the backward's for a backward failure).
_cudnn_broken: set[object] = set()
_cudnn_warned_missing = False


def _use_flex(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, is_causal: bool, scale: float
) -> bool:
    if _cuda_kernel in ("flash", "cudnn") or not _flex_applies(q, k, v, cu_q, cu_k):
        return False
    if flex_kernel.plan_key(q, k, v, is_causal, scale) in _flex_broken:
        return False
    return _cuda_kernel == "flex" or _auto_kernel(q) == "flex"


# What a missing cuDNN frontend costs (BENCHMARKS.md, H200, transformers Llama 4 layers at 128K
# tokens: the train step 546 ms with flex inside usp against 488 ms with cuDNN; attention alone
# 1.4-1.7x flash varlen for forward + backward at 32K-256K tokens).
_MISSING_CUDNN_COST = "about 1.1x slower per train step and 1.4-1.7x slower attention at 32K-256K tokens"


def _cudnn_would_run(q: Tensor, k: Tensor, v: Tensor) -> bool:
    """cuDNN would run this call if the package were installed (the setting or the table picks it)."""
    if _cuda_kernel in ("flash", "flex"):
        return False
    d = q.shape[-1]
    if q.dtype not in (torch.float16, torch.bfloat16) or d != v.shape[-1] or d % 8 or d > 128:
        return False
    return _cuda_kernel == "cudnn" or any(
        name == "cudnn" and q.shape[0] >= tokens and d in dims for name, tokens, dims in AUTO_TABLE
    )


# The plan keys of the calls seen, by everything they are made from (a step's layers, forward and
# backward, share one entry): building two keys per call was a tenth of a 4K-token call's host time.
_keys: dict[tuple[object, ...], tuple[cudnn_kernel.PlanKey, cudnn_kernel.PlanKey]] = {}


def _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right):
    square = same_boundaries(q, k, cu_q, cu_k)
    det = torch.are_deterministic_algorithms_enabled()
    seen = (q.shape, k.shape, q.dtype, q.device, cu_q.shape[0], max_q, max_k, is_causal, scale, left, right, square, det)  # fmt: skip
    keys = _keys.get(seen)
    if keys is None:
        if len(_keys) >= 256:
            _keys.clear()
        fwd = cudnn_kernel.plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, (left, right), square=square)
        bwd = cudnn_kernel.plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, (left, right), square=square,
                                    backward=True, deterministic=det)  # fmt: skip
        keys = _keys[seen] = (fwd, bwd)
    return (square, *keys)


def _use_cudnn(q: Tensor, k: Tensor, v: Tensor, keys: tuple[object, ...]) -> bool:
    """cuDNN for this call: asked for (or auto's first choice), applicable, and neither of this
    shape's graphs failed to build or disagreed with flash."""
    global _cudnn_warned_missing
    if _cuda_kernel in ("flash", "flex"):
        return False
    if not _cudnn_warned_missing and not cudnn_kernel.available() and _cudnn_would_run(q, k, v):
        # Once per process: the fastest kernel for this shape is missing, say what runs instead.
        _cudnn_warned_missing = True
        instead = (
            "flash varlen"
            if _cuda_kernel == "cudnn"
            else _auto_kernels(q)[0].replace("flash", "flash varlen")
        )
        warnings.warn(
            "usp_graph: cuDNN attention, the fastest kernel for this shape, needs the cuDNN frontend, which is not "
            f"installed (pip install 'usp_graph[cuda]', i.e. nvidia-cudnn-frontend); {instead} runs instead, "
            f"{_MISSING_CUDNN_COST}",
            RuntimeWarning,
            stacklevel=4,
        )
    if not _cudnn_applies(q, k, v) or any(key in _cudnn_broken for key in keys):
        return False
    return _cuda_kernel == "cudnn" or _auto_kernels(q)[0] == "cudnn"


def _kernel_failed(kernel: str, broken: set, key: object, reason: object) -> None:
    broken.add(key)
    warnings.warn(
        f"usp_graph: {reason}; flash varlen runs this shape instead",
        RuntimeWarning,
        stacklevel=4,
    )


def _flex_failed(q: Tensor, k: Tensor, v: Tensor, is_causal: bool, scale: float, reason: object) -> None:
    _kernel_failed("flex", _flex_broken, flex_kernel.plan_key(q, k, v, is_causal, scale), reason)


# Each fast kernel's first forward and first backward of each shape are checked against flash
# varlen on the same inputs (one sync, an extra output's memory, once per shape): a kernel that is
# wrong for a shape (torch 2.11's compiled flex backward was, for a ragged last block) then costs a
# warning and flash for that shape, never a wrong gradient, on whatever version runs it.
# bf16/fp16 flex, cuDNN and flash each agree with fp32 to ~3e-3; a broken kernel was off by ~70.
FLEX_CHECK_TOL = 2e-2
CHECK_TOL = FLEX_CHECK_TOL
_flex_checked: set[tuple[object, ...]] = set()
_cudnn_checked: set[tuple[object, ...]] = set()


def _disagreement(names: tuple[str, ...], got: tuple[Tensor, ...], ref: tuple[Tensor, ...]) -> str | None:
    """None if every `got` matches its `ref` (the same infinities and NaNs, finite entries within
    CHECK_TOL relative norm; see `_compare` for a reference holding a NaN), else what differs."""
    return _compare(names, got, ref)[0]


def _compare(
    names: tuple[str, ...], got: tuple[Tensor, ...], ref: tuple[Tensor, ...]
) -> tuple[str | None, bool]:
    """(`_disagreement`, whether the reference held a NaN). One host sync.

    A reference with a NaN anywhere had a NaN input: the kernels may then differ where either side
    is NaN (cuDNN's lse of a NaN query row is NaN, flash's -inf), so those entries are left out, and
    the check is not whole. Without one, a NaN the kernel made is a disagreement."""
    refs = [b.float() for b in ref]
    nan_input = torch.stack([b.isnan().any() for b in refs]).any()
    errs = []
    for a, b in zip(got, refs, strict=True):
        a = a.float()
        seen = ~(nan_input & (a.isnan() | b.isnan()))
        finite = torch.isfinite(b)
        # a NaN or an infinity where the other has none, or another infinity: no match
        other_inf = seen & ((torch.isfinite(a) != finite) | (~finite & (a != b)))
        keep = finite & seen
        diff = torch.where(keep, a - b, 0).norm() / torch.where(keep, b, 0).norm().clamp_min(1e-30)
        errs.append(torch.where(other_inf.any(), math.inf, diff))
    values = torch.stack([*errs, nan_input.to(errs[0].dtype)]).tolist()  # the one sync
    bad = [f"{n} rel err {e:.1e}" for n, e in zip(names, values, strict=False) if not e <= CHECK_TOL]
    return (", ".join(bad) if bad else None), bool(values[-1])


def _checked_or_flash(
    kernel: str, kind: str, names: tuple[str, ...], got: tuple[Tensor, ...], flash: Any, key: object,
    checked: set, broken: set, broken_key: object,
) -> tuple[Tensor, ...]:  # fmt: skip
    """`got` (`kernel`'s result) if this shape's `kind` kernel was checked already or agrees with
    `flash()` now; otherwise flash's result, with the shape moved to flash from then on."""
    if (kind, key) in checked:
        return got
    ref = flash()
    bad, saw_nan = _compare(names, got, ref)
    if bad is None:
        if not saw_nan:  # with NaN inputs only part was compared: check again on the next call
            checked.add((kind, key))
        return got
    _kernel_failed(
        kernel,
        broken,
        broken_key,
        f"the {kernel} {kind} kernel for {key} disagrees with flash varlen ({bad})",
    )
    return ref


def _flex_checked_or_flash(
    kind: str, names: tuple[str, ...], got: tuple[Tensor, ...], flash: Any, q: Tensor, k: Tensor, v: Tensor,
    is_causal: bool, scale: float,
) -> tuple[Tensor, ...]:  # fmt: skip
    key = flex_kernel.plan_key(q, k, v, is_causal, scale)
    return _checked_or_flash("flex", kind, names, got, flash, key, _flex_checked, _flex_broken, key)


def _cudnn_metadata(cu_q, cu_k, q, k, slots):
    h, g, d = q.shape[1], k.shape[1], q.shape[2]
    return per_boundaries(
        "cudnn", cu_q, cu_k, (h, g, d, slots), lambda: cudnn_kernel.slot_metadata(cu_q, cu_k, h, g, d, slots)
    )


# Boundaries with one slot per token (or more) are what documents derived from position ids on the
# device carry to be always enough (the "usp" attention implementation compiled without a
# documents block; the backend's default capacity): flash varlen and cuDNN launch blocks for every
# slot x max_seqlen, so such a call is cut to its documents by one host read per boundary tensor
# (once per step: every layer and the backward share the tensor). Not while a CUDA graph is being
# captured (no sync allowed), and not below FIT_MIN_TOKENS, where the empty slots cost less than
# the read.
FIT_MIN_TOKENS = 2048


def _fitted(cu_q: Tensor, cu_k: Tensor, t_q: int, max_q: int, max_k: int) -> tuple[Tensor, Tensor, int, int]:
    if cu_q is not cu_k or cu_q.shape[0] - 1 < t_q or t_q < FIT_MIN_TOKENS:
        return cu_q, cu_k, max_q, max_k
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return cu_q, cu_k, max_q, max_k
    top = max(max_q, max_k)
    cu, bound = per_boundaries("fit", cu_q, cu_k, (top,), lambda: fit_to_documents(cu_q, top))
    return cu, cu, min(bound, max_q), min(bound, max_k)  # never above a bound given: the check still sees it


def _cudnn_first(q: Tensor) -> bool:
    """cuDNN is tried first: asked for, or auto's first choice for this shape."""
    return _cuda_kernel == "cudnn" or (_cuda_kernel == "auto" and _auto_kernels(q)[0] == "cudnn")


def _flex_next(q, k, v, cu_q, cu_k, is_causal, scale, left, right) -> bool:
    """flex runs this call where cuDNN does not come first: windowless (flex's block masks know
    documents only; a window runs on flash's or cuDNN's local-attention kernels) and `_use_flex`."""
    return (left, right) == NO_WINDOW and _use_flex(q, k, v, cu_q, cu_k, is_causal, scale)


def cuda_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if not flash_ok(q, v):
        return math_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
    if cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape:
        cu_k = cu_q  # one tensor: one check
    checked_lengths(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)  # asserted on the device
    cudnn_first = _cudnn_first(q)
    flex = not cudnn_first and _flex_next(q, k, v, cu_q, cu_k, is_causal, scale, left, right)
    if not flex:  # flex takes the boundaries as they are; flash, should it run, cuts them then
        cu_q, cu_k, max_q, max_k = _fitted(cu_q, cu_k, q.shape[0], max_q, max_k)

    def flash() -> tuple[Tensor, Tensor]:
        cq, ck, mq, mk = _fitted(cu_q, cu_k, q.shape[0], max_q, max_k) if flex else (cu_q, cu_k, max_q, max_k)
        return flash_kernel.flash_fwd(q, k, v, cq, ck, mq, mk, is_causal, scale, left, right)

    if cudnn_first:
        square, key, bkey = _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        if _use_cudnn(q, k, v, (key, bkey)):
            try:
                got = cudnn_kernel.cudnn_fwd(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, (left, right),
                                             square=square, key=key,
                                             metadata=_cudnn_metadata(cu_q, cu_k, q, k, key.slots))  # fmt: skip
            except cudnn_kernel.BuildError as exc:
                _kernel_failed("cudnn", _cudnn_broken, key, exc)
            else:
                return _checked_or_flash("cudnn", "forward", ("out", "lse"), got, flash, key, _cudnn_checked,
                                         _cudnn_broken, key)  # fmt: skip
    if flex:
        try:
            got = flex_kernel.flex_fwd(q, k, v, cu_q, is_causal, scale)
        except flex_kernel.BuildError as exc:
            _flex_failed(q, k, v, is_causal, scale, exc)
        else:
            return _flex_checked_or_flash("forward", ("out", "lse"), got, flash, q, k, v, is_causal, scale)
    return flash()


def cuda_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left=-1, right=-1):
    if not flash_ok(q, v):
        return math_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
    if cu_q.data_ptr() == cu_k.data_ptr() and cu_q.shape == cu_k.shape:
        cu_k = cu_q
    checked_lengths(cu_q, cu_k, q.shape[0], k.shape[0], max_q, max_k)  # asserted on the device
    cudnn_first = _cudnn_first(q)
    flex = not cudnn_first and _flex_next(q, k, v, cu_q, cu_k, is_causal, scale, left, right)
    if not flex:  # flex takes the boundaries as they are; flash, should it run, cuts them then
        cu_q, cu_k, max_q, max_k = _fitted(cu_q, cu_k, q.shape[0], max_q, max_k)

    def flash() -> tuple[Tensor, Tensor, Tensor]:
        cq, ck, mq, mk = _fitted(cu_q, cu_k, q.shape[0], max_q, max_k) if flex else (cu_q, cu_k, max_q, max_k)
        return flash_kernel.flash_bwd(dout, q, k, v, out, lse, cq, ck, mq, mk, is_causal, scale, left, right)

    if cudnn_first:
        square, key, bkey = _cudnn_keys(q, k, cu_q, cu_k, max_q, max_k, is_causal, scale, left, right)
        if _use_cudnn(q, k, v, (key, bkey)):
            try:
                # Whole or in groups of KV heads (by the memory peak so far): each launch form is
                # checked against flash on its own first call. The gradients and cuDNN's float32
                # stats (two copies of lse) are still to come.
                coming = sum(x.numel() * x.element_size() for x in (q, k, v)) + 2 * 4 * lse.numel()
                groups = cudnn_kernel.backward_groups(bkey, q.device, coming)
                got = cudnn_kernel.cudnn_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, is_causal, scale,
                                             (left, right), square=square, key=bkey, groups=groups,
                                             metadata=_cudnn_metadata(cu_q, cu_k, q, k, bkey.slots))  # fmt: skip
            except cudnn_kernel.BuildError as exc:
                _kernel_failed("cudnn", _cudnn_broken, bkey, exc)
            else:
                return _checked_or_flash("cudnn", "backward", ("dq", "dk", "dv"), got, flash, (bkey, groups),
                                         _cudnn_checked, _cudnn_broken, bkey)  # fmt: skip
    if flex:
        try:
            got = flex_kernel.flex_bwd(dout, q, k, v, out, lse, cu_q, is_causal, scale)
        except flex_kernel.BuildError as exc:
            _flex_failed(q, k, v, is_causal, scale, exc)
        else:
            return _flex_checked_or_flash(
                "backward", ("dq", "dk", "dv"), got, flash, q, k, v, is_causal, scale
            )
    return flash()
