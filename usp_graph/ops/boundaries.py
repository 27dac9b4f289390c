"""Document boundaries of a varlen call, checked for every kernel; the lse dtype.

# T packed tokens, N document slots (cu_seqlens has N + 1 entries)

On the host (`doc_bounds`): the CPU and math kernels read the boundaries anyway, so they check
them there and raise a ValueError naming the slot. On the device (`checked_lengths`): the CUDA
kernels must not sync, so a few tiny kernels compute the verdict and an asynchronous assertion
fires when it is false (issue 17), once per boundary tensor and version.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch import Tensor

__all__ = [
    "lse_dtype",
    "doc_bounds",
    "documents_of",
    "same_boundaries",
    "boundaries_ok",
    "assert_boundaries",
    "checked_lengths",
    "per_boundaries",
    "device_assert",
    "device_message",
    "vouch_checked",
    "DEVICE_MESSAGE_BYTES",
]


def lse_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def doc_bounds(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> list[tuple[int, int, int, int]]:
    """Per-document (q start, q end, k start, k end), with the checks the CUDA kernel cannot afford."""
    bq, bk = cu_q.tolist(), cu_k.tolist()
    if len(bq) != len(bk):
        raise ValueError(
            f"cu_seqlens_q has {len(bq)} entries but cu_seqlens_k has {len(bk)}; they must match"
        )
    for name, b, total, bound in (("cu_seqlens_q", bq, t_q, max_q), ("cu_seqlens_k", bk, t_k, max_k)):
        if name == "cu_seqlens_q" and (b[0] != 0 or b[-1] != total):
            raise ValueError(f"{name} must run from 0 to the token count {total}, got {b[0]}..{b[-1]}")
        if b[0] < 0 or b[-1] > total:  # keys before cu_seqlens_k[0] or after its end are unused
            raise ValueError(f"{name} must stay within 0..{total} (the key count), got {b[0]}..{b[-1]}")
        for i in range(1, len(b)):
            if b[i] < b[i - 1]:
                raise ValueError(f"{name} must be non-decreasing: {name}[{i}] = {b[i]} < {b[i - 1]}")
            if b[i] - b[i - 1] > bound:
                raise ValueError(
                    f"document {i - 1} has {b[i] - b[i - 1]} tokens in {name}, more than its max_seqlen={bound}"
                )
    return [(bq[i], bq[i + 1], bk[i], bk[i + 1]) for i in range(len(bq) - 1)]


def same_boundaries(q: Tensor, k: Tensor, cu_q: Tensor, cu_k: Tensor) -> bool:
    """Self-attention: queries and keys share one boundary tensor (the same memory, so the same
    values, known without a sync) and one token count; cu_q runs 0..T, so every key is in use."""
    return q.shape[0] == k.shape[0] and cu_q.shape == cu_k.shape and cu_q.data_ptr() == cu_k.data_ptr()


# ------------------------------------------------------------------------------------------------
# Kernel preconditions on the device (issue 17): a max_seqlen below the longest document, or
# boundaries outside the tensors, would make flash and cuDNN compute a silently wrong result (flash
# bf16 was off by 4.66 at T=512, documents [300, 212], max_seqlen=64). Reading the boundaries on the
# host would sync every call; instead a few tiny kernels compute the verdict and an asynchronous
# assertion stops the process (a device-side assert) when it is false.


def boundaries_ok(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(ok, lengths_q, lengths_k): `ok` a 0-d bool tensor on the boundaries' device, true iff cu_q
    runs 0..t_q, cu_k stays in 0..t_k, both are non-decreasing, and no document is longer than its
    max_seqlen; the per-slot lengths (int32 `(N,)`) as a by-product."""
    if cu_q is cu_k:  # one boundary tensor (self-attention)
        lens = torch.diff(cu_q)
        ends = torch.stack((cu_q[0], cu_q[-1] - t_q))
        lo, hi = torch.aminmax(lens)
        return (ends == 0).all() & (lo >= 0) & (hi <= min(max_q, max_k)), lens, lens
    lens = torch.diff(torch.stack((cu_q, cu_k)), dim=1)
    lo, hi = torch.aminmax(lens, dim=1)
    # cu_q[0] == 0, cu_q[-1] == t_q, cu_k[0] >= 0, cu_k[-1] <= t_k, lengths in 0..max, in one tensor
    viol = torch.stack((cu_q[0].abs(), (cu_q[-1] - t_q).abs(), -cu_k[0], cu_k[-1] - t_k, -lo[0], -lo[1], hi[0] - max_q, hi[1] - max_k))  # fmt: skip
    return (viol <= 0).all(), lens[0], lens[1]


# torch._assert_async(t, message) on CUDA refuses a message of 255 bytes or more ("Message length
# must be smaller than 255": the whole call fails, assertion true or not), on MPS one of 250 or more;
# the CPU takes any length.
DEVICE_MESSAGE_BYTES = 249


def device_message(message: str) -> str:
    """`message` as `device_assert` hands it to ``torch._assert_async``: quotes, backslashes and
    newlines replaced (inductor pastes the text between double quotes into generated C++ unescaped:
    a double quote or a backslash failed every inductor compile of the call on the CPU backend),
    and cut to `DEVICE_MESSAGE_BYTES` (ending in "...") should it still be longer: an assertion that
    holds must never fail on its message. The project's messages fit (a test reads them all)."""
    text = message.replace('"', "'").replace("\\", "/").replace("\n", " ")
    data = text.encode()
    if len(data) <= DEVICE_MESSAGE_BYTES:
        return text
    return data[: DEVICE_MESSAGE_BYTES - 3].decode(errors="ignore") + "..."


def device_assert(ok: Tensor, message: str) -> None:
    """``torch._assert_async(ok, message)`` (no host sync) with a message every device and inductor
    take (`device_message`). Keep `message` under `DEVICE_MESSAGE_BYTES` bytes with its numbers
    filled in: the reason and the fix, short."""
    torch._assert_async(ok, device_message(message))


def assert_boundaries(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> tuple[Tensor, Tensor]:
    """Assert `boundaries_ok` without a host sync (a failure is a device-side assert at the next
    sync on CUDA); returns the per-slot lengths as `(N, 1, 1, 1)`."""
    ok, lens_q, lens_k = boundaries_ok(cu_q, cu_k, t_q, t_k, max_q, max_k)
    device_assert(
        ok,
        f"usp::varlen: cu_seqlens must run 0..{t_q} (queries) / within 0..{t_k} (keys), non-decreasing, "
        f"with no document longer than max_seqlen_q={max_q} / max_seqlen_k={max_k}",
    )
    return lens_q.view(-1, 1, 1, 1), lens_k.view(-1, 1, 1, 1)


# The checks and what the cuDNN kernel derives from the boundaries are the same for every layer of a
# step (one boundary tensor, forward and backward): computed once per boundary tensor object and
# version. A hit needs the very same tensor objects (weak references, so a new tensor at a reused
# address misses) at the same version (an in-place write misses); inference tensors, which track
# no version, and calls during CUDA graph capture (whose kernels must be in the graph) never hit.
_BOUNDARY_CACHE_SIZE = 64
_boundary_cache: dict[tuple[object, ...], tuple[Any, Any, tuple[int, int], object]] = {}


def per_boundaries(name: str, cu_q: Tensor, cu_k: Tensor, settings: tuple[object, ...], compute: Any) -> Any:
    """`compute()`, or what it returned for these boundary tensors (same objects, same versions)
    and `settings` before."""
    try:
        versions = (cu_q._version, cu_k._version)
    except RuntimeError:  # an inference tensor
        return compute()
    if cu_q.is_cuda and torch.cuda.is_current_stream_capturing():
        return compute()
    key = (name, id(cu_q), id(cu_k), *settings)
    hit = _boundary_cache.get(key)
    if hit is not None and hit[0]() is cu_q and hit[1]() is cu_k and hit[2] == versions:
        return hit[3]
    value = compute()
    if len(_boundary_cache) >= _BOUNDARY_CACHE_SIZE:
        for k in [k for k, e in _boundary_cache.items() if e[0]() is None or e[1]() is None]:
            del _boundary_cache[k]
        if len(_boundary_cache) >= _BOUNDARY_CACHE_SIZE:
            _boundary_cache.clear()
    _boundary_cache[key] = (weakref.ref(cu_q), weakref.ref(cu_k), versions, value)
    return value


# `documents_of`'s walks: (boundary tensors, settings) -> (weak references, copies of their values
# when walked, the documents). A hit needs the very same tensor objects holding the same values: a
# buffer refilled where no version counter sees it (numpy, ``.data``) is walked again.
_walked: dict[tuple[object, ...], tuple[Any, Any, Tensor, Tensor, list[tuple[int, int, int, int]]]] = {}


def documents_of(
    cu_q: Tensor, cu_k: Tensor, t_q: int, t_k: int, max_q: int, max_k: int
) -> list[tuple[int, int, int, int]]:
    """`doc_bounds` without the documents a kernel skips (no query or no key), walked once per
    boundary tensor and values: the CPU and math kernels walk the boundaries at every call, and
    boundaries with a slot per token (documents from position ids in a compiled graph) made each
    call walk T + 1 slots in Python; every layer and the backward share the tensor. Comparing the
    values costs one C pass (and the walk syncs a CUDA tensor anyway)."""
    key = (id(cu_q), id(cu_k), t_q, t_k, max_q, max_k)
    hit = _walked.get(key)
    if (
        hit is not None
        and hit[0]() is cu_q
        and hit[1]() is cu_k
        and torch.equal(hit[2], cu_q)
        and (cu_k is cu_q or torch.equal(hit[3], cu_k))
    ):
        return hit[4]
    docs = [d for d in doc_bounds(cu_q, cu_k, t_q, t_k, max_q, max_k) if d[1] > d[0] and d[3] > d[2]]
    if len(_walked) >= _BOUNDARY_CACHE_SIZE:
        _walked.clear()
    snap_q = cu_q.detach().clone()
    snap_k = snap_q if cu_k is cu_q else cu_k.detach().clone()
    _walked[key] = (
        weakref.ref(cu_q, lambda _, key=key: _walked.pop(key, None)),
        weakref.ref(cu_k),
        snap_q,
        snap_k,
        docs,
    )
    return docs  # (the entry, its copies included, goes with cu_q)


def vouch_checked(cu: Tensor, tokens: int, bound: int, lengths: Tensor) -> None:
    """Record self-attention boundaries `cu` of `tokens` tokens as checked, with their per-slot
    `lengths`: the caller read them on the host and knows they run 0..tokens, never decrease and hold
    no document longer than `bound`, so `checked_lengths` launches no check kernels for them (kernels
    the GPU would wait for right after that read)."""
    shaped = lengths.view(-1, 1, 1, 1)
    per_boundaries("check", cu, cu, (tokens, tokens, bound, bound), lambda: (shaped, shaped))


def checked_lengths(cu_q, cu_k, t_q, t_k, max_q, max_k):
    return per_boundaries(
        "check", cu_q, cu_k, (t_q, t_k, max_q, max_k),
        lambda: assert_boundaries(cu_q, cu_k, t_q, t_k, max_q, max_k),
    )  # fmt: skip
