"""cuDNN ragged (THD) attention as a kernel behind ``usp::varlen_fwd`` / ``usp::varlen_bwd`` on CUDA.

# T packed tokens, H query heads, G key/value heads, K head dim, N document slots (cu has N + 1
# entries), S padded length (an upper bound on one document's length), P plan (a built graph)

Through NVIDIA's cuDNN frontend (``pip install usp_graph[cuda]``: ``nvidia-cudnn-frontend``, module
``cudnn``), imported lazily: without it `available()` is False and nothing here runs. The layout is
cuDNN's ragged one: a batch of N document slots padded to S, a padding mask (`seq_len_q/kv`,
int32 `(N, 1, 1, 1)`) and ragged offsets (int64 `(N + 1, 1, 1, 1)`, in elements: ``cu * H * K`` for
Q/O/dQ/dO, ``cu * G * K`` for K/V/dK/dV, ``cu * H`` for the stats), all computed on the device from
``cu_seqlens`` on every call. So the graphs depend on shapes and settings only (`PlanKey`): new
boundaries never rebuild one, and unused capacity (zero-length slots) costs nothing. The slot count
N, the padded length S and the backward's token bound (``max_total_seq_len``) are rounded up to the
next of 1, 2, 3, 4, 6, 8, 12, ... (powers of two and 1.5 times them; S at most the token count), and
the metadata is padded with empty slots to match (`slot_metadata`): a training run whose batches
each hold other documents, another count, another longest one and another token count, reuses a
handful of graphs instead of building two new ones (and checking them against flash) on every step. Empty slots and a longer S cost nothing measurable
(../shared/FACTS.md, "cuDNN ragged, second probe"). The deterministic backward keeps N and S exact:
its workspace grows with N x S^2.

What cuDNN leaves to its caller (seen on the H200, ../shared/FACTS.md, "cuDNN ragged, second probe"):
- rows of O / stats / dQ / dK / dV outside every document are left untouched, and so are O and
  stats of a document with queries but no keys: unless queries and keys share one boundary tensor
  (then every row lies in a document that has keys), O is pre-filled with 0, stats with -inf, and
  the gradients with 0;
- stats are the natural-log logsumexp, -inf for a row that sees no key (out 0 there), as usp's
  contract says; lse is ``(H, T)`` here and ``(T, H, 1)`` there (a transposing copy each way);
- the backward reads +inf stats as rows that add nothing; -inf (a row that sees no key) is
  passed as +inf, like the flash path does.

Masks: causal is bottom-right aligned (``diagonal_alignment.BOTTOM_RIGHT``, right bound 0); when
queries and keys share one boundary tensor the documents are square and top-left alignment (what
was measured fastest) is the same mask. A window ``(left, right)`` is cuDNN's diagonal band:
left bound ``left + 1`` (cuDNN counts the diagonal), right bound ``right``.

Determinism (H200, cuDNN 9.19): the forward and dK/dV of the default backward repeat bitwise; dQ
does not. With ``torch.use_deterministic_algorithms(True)`` the backward is built with
``use_deterministic_algorithm=True`` (bitwise, a few percent slower), whose workspace grows with
N x S^2: a plan needing more than `deterministic_workspace_limit()` bytes is refused
(`BuildError`), and the caller runs flash varlen (deterministic in that mode) instead. Not with
``warn_only=True``: torch 2.11's flash backward then keeps its non-deterministic algorithm and only
warns (tools/check_replay_gpu.py). A graph file replayed in deterministic mode equals the eager
step bitwise; with the default backward, only the loss is promised bitwise (BENCHMARKS.md).
"""

from __future__ import annotations

import dataclasses
import functools
import os
import threading
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
from torch import Tensor

from ..metadata import capacity_bucket
from .boundaries import per_boundaries

__all__ = [
    "BuildError",
    "PlanKey",
    "available",
    "module",
    "plan_key",
    "mask_settings",
    "ragged_offsets",
    "seq_lengths",
    "slot_metadata",
    "cudnn_fwd",
    "cudnn_bwd",
    "deterministic_workspace_limit",
    "backward_workspace_limit",
    "grouped_backward",
    "backward_groups",
]


class BuildError(RuntimeError):
    """A cuDNN graph for a shape could not be built (no engine supports it, or its workspace is over
    the limit); the cause is chained. The caller runs another kernel for that shape."""


@functools.cache
def module() -> ModuleType | None:
    """The cuDNN frontend module, or None when it is not installed or does not load (then every
    CUDA call runs the other kernels). Imported on first use, after torch has loaded libcudnn."""
    try:
        import cudnn
    except Exception:  # not installed, or its native library does not load
        return None
    return cudnn


def available() -> bool:
    return module() is not None


# ------------------------------------------------------------------------------------------------
# Plan keys: shapes and settings only.


@dataclass(frozen=True)
class PlanKey:
    """What a built graph depends on. Boundaries are runtime tensors and appear nowhere here."""

    device: int
    slots: int  # N document slots (cu_seqlens has N + 1 entries)
    s_q: int  # padded query length: max_seqlen_q, at most the query count
    s_k: int  # padded key length
    heads: int  # H
    kv_heads: int  # G
    head_dim: int  # K (== the value head dim: other shapes are not sent here)
    dtype: torch.dtype
    causal: bool
    window: tuple[int, int]  # (left, right), causality folded into right; (-1, -1): none
    square: bool  # queries and keys share one boundary tensor: top-left alignment, no pre-fill
    scale: float
    # the backward's only: max_total_seq_len_q/kv (token counts bucketed, rounded up to 64), determinism
    total_q: int = 0
    total_k: int = 0
    deterministic: bool = False


def _padded(bound: int, total: int, exact: bool = False) -> int:
    # S never needs to exceed the token count (a document cannot be longer); the deterministic
    # backward's workspace grows with S^2: exact there.
    bound = max(1, int(bound))
    return max(1, min(bound if exact else capacity_bucket(bound), int(total)))


def _round64(n: int) -> int:
    return max(64, (int(n) + 63) // 64 * 64)


def _device_index(device: torch.device) -> int:
    if device.index is not None:
        return device.index
    return torch.cuda.current_device() if device.type == "cuda" else -1


def plan_key(
    q: Tensor, k: Tensor, cu_q: Tensor, max_q: int, max_k: int, is_causal: bool, scale: float,
    window: tuple[int, int], *, square: bool, backward: bool = False, deterministic: bool = False,
) -> PlanKey:  # fmt: skip
    """The key of the forward (or, with `backward`, the backward) graph for these inputs."""
    left, right = window
    if (left, right) != (-1, -1) and is_causal:
        right = 0
    exact = backward and deterministic  # its workspace grows with N x S^2
    slots = cu_q.shape[0] - 1
    return PlanKey(
        device=_device_index(q.device),
        slots=slots if exact else capacity_bucket(slots),
        s_q=_padded(max_q, q.shape[0], exact),
        s_k=_padded(max_k, k.shape[0], exact),
        heads=q.shape[1],
        kv_heads=k.shape[1],
        head_dim=q.shape[2],
        dtype=q.dtype,
        causal=is_causal,
        window=(left, right),
        square=square,
        scale=float(scale),
        total_q=_round64(q.shape[0] if exact else capacity_bucket(q.shape[0])) if backward else 0,
        total_k=_round64(k.shape[0] if exact else capacity_bucket(k.shape[0])) if backward else 0,
        deterministic=deterministic if backward else False,
    )


def mask_settings(key: PlanKey) -> dict[str, Any]:
    """cuDNN's mask arguments as plain values: ``alignment`` ("top_left" | "bottom_right" | None),
    ``left_bound`` (cuDNN counts the diagonal: flash's left + 1) and ``right_bound`` (None:
    unbounded)."""
    left, right = key.window
    if (left, right) == (-1, -1):
        right = 0 if key.causal else -1
    if left < 0 and right < 0:
        return {"alignment": None, "left_bound": None, "right_bound": None}
    return {
        "alignment": "top_left" if key.square else "bottom_right",
        "left_bound": left + 1 if left >= 0 else None,
        "right_bound": right if right >= 0 else None,
    }


def _env_mb(name: str) -> int | None:
    """Environment variable `name` as a whole number of MiB, in bytes (None when unset)."""
    text = os.environ.get(name)
    if text is None:
        return None
    try:
        mb = int(text)
    except ValueError:
        mb = -1
    if mb < 0:
        raise ValueError(f"{name} must be a whole number of MiB (0 or more), got {text!r}")
    return mb * 2**20


def backward_workspace_limit() -> int:
    """Bytes the default backward's workspace may take before it runs in groups of KV heads
    (`grouped_backward`): ``USP_CUDNN_BACKWARD_WORKSPACE_MB``, by default 256 MiB. Without the
    setting, a backward over it still runs whole where its workspace fits under the memory peak the
    process already reached (`_under_peak`)."""
    env = _env_mb("USP_CUDNN_BACKWARD_WORKSPACE_MB")
    return env if env is not None else 256 * 2**20


# The caching allocator rounds a large block up to whole 2 MiB pages.
_ALLOCATOR_ROUNDING = 2 * 2**20


def _under_peak(nbytes: int, device: torch.device) -> bool:
    """`nbytes` more on `device` now would not raise the allocator's high-water mark
    (``torch.cuda.max_memory_allocated``): a train step's backward runs after its forward reached
    its peak (the logits and loss, or every layer's activations), so a workspace that fits beneath
    it costs no memory the step did not already need. Not while a CUDA graph is being captured."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return False
    needed = torch.cuda.memory_allocated(device) + nbytes + _ALLOCATOR_ROUNDING
    return needed <= torch.cuda.max_memory_allocated(device)


def deterministic_workspace_limit(device: int | None = None) -> int:
    """Bytes a deterministic backward plan may need: ``USP_CUDNN_DETERMINISTIC_WORKSPACE_MB``, or
    by default an eighth of the device's memory, at most 16 GiB (on the H200 the workspace was
    ~32 bytes x slots x S^2 at H=16: 14.5 GB for 27 slots of S=4096). Above it the plan is
    refused and flash varlen (deterministic in that mode) runs the shape."""
    env = _env_mb("USP_CUDNN_DETERMINISTIC_WORKSPACE_MB")
    if env is not None:
        return env
    total = torch.cuda.get_device_properties(device if device is not None else 0).total_memory
    return min(16 * 2**30, total // 8)


# ------------------------------------------------------------------------------------------------
# Graph building (cuDNN calls; CUDA only).

_Q, _K, _V, _O, _STATS, _DO, _DQ, _DK, _DV, _SEQ_Q, _SEQ_K, _OFF_Q, _OFF_K, _OFF_S = range(1, 15)


_lock = threading.RLock()  # cuDNN handles are not thread-safe; builds and launches take turns
_handles: dict[int, Any] = {}


def _handle(device: int) -> Any:
    h = _handles.get(device)
    if h is None:
        with torch.cuda.device(device):
            h = _handles[device] = module().create_handle()
    return h


def _mask_kwargs(cudnn: ModuleType, key: PlanKey) -> dict[str, Any]:
    m = mask_settings(key)
    if m["alignment"] is None:
        return {}
    kw: dict[str, Any] = {
        "diagonal_alignment": cudnn.diagonal_alignment.TOP_LEFT
        if m["alignment"] == "top_left"
        else cudnn.diagonal_alignment.BOTTOM_RIGHT
    }
    if m["left_bound"] is not None:
        kw["diagonal_band_left_bound"] = m["left_bound"]
    if m["right_bound"] is not None:
        kw["diagonal_band_right_bound"] = m["right_bound"]
    return kw


@dataclass
class _Plan:
    graph: Any
    workspace: int


def _build(kind: str, key: PlanKey, *, all_plans: bool = False) -> _Plan:
    """Build `kind`'s ("fwd" | "bwd") graph for `key` with the heuristics' first plan that builds
    (`all_plans`: every candidate plan built, for a tool that
    times them one by one with ``execute_plan_at_index``)."""
    cudnn = module()
    io = {torch.bfloat16: cudnn.data_type.BFLOAT16, torch.float16: cudnn.data_type.HALF}[key.dtype]
    f32, i32, i64 = cudnn.data_type.FLOAT, cudnn.data_type.INT32, cudnn.data_type.INT64
    n, sq, sk, h, g, d = key.slots, key.s_q, key.s_k, key.heads, key.kv_heads, key.head_dim
    q_dim, k_dim, s_dim = [n, h, sq, d], [n, g, sk, d], [n, h, sq, 1]
    # token-major (T, H, K) buffers; the batch stride is a placeholder under ragged offsets
    q_st, k_st, s_st = [sq * h * d, d, h * d, 1], [sk * g * d, d, g * d, 1], [sq * h, 1, h, 1]
    graph = cudnn.pygraph(
        handle=_handle(key.device), io_data_type=io, intermediate_data_type=f32, compute_data_type=f32
    )

    def tensor(name: str, uid: int, dim: list[int], stride: list[int], dtype: Any = io) -> Any:
        return graph.tensor(name=name, dim=dim, stride=stride, data_type=dtype, uid=uid)

    one = [1, 1, 1, 1]
    q, k, v = tensor("q", _Q, q_dim, q_st), tensor("k", _K, k_dim, k_st), tensor("v", _V, k_dim, k_st)
    seq_q, seq_k = (
        tensor("seq_q", _SEQ_Q, [n, 1, 1, 1], one, i32),
        tensor("seq_k", _SEQ_K, [n, 1, 1, 1], one, i32),
    )
    off_q = tensor("off_q", _OFF_Q, [n + 1, 1, 1, 1], one, i64)
    off_k = tensor("off_k", _OFF_K, [n + 1, 1, 1, 1], one, i64)
    off_s = tensor("off_s", _OFF_S, [n + 1, 1, 1, 1], one, i64)
    q.set_ragged_offset(off_q)
    k.set_ragged_offset(off_k)
    v.set_ragged_offset(off_k)
    common = dict(
        attn_scale=key.scale,
        use_padding_mask=True,
        seq_len_q=seq_q,
        seq_len_kv=seq_k,
        **_mask_kwargs(cudnn, key),
    )
    if kind == "fwd":
        o, stats = graph.sdpa(name="fwd", q=q, k=k, v=v, generate_stats=True, **common)
        o.set_uid(_O).set_output(True).set_dim(q_dim).set_stride(q_st).set_data_type(io)
        o.set_ragged_offset(off_q)
        stats.set_uid(_STATS).set_output(True).set_dim(s_dim).set_stride(s_st).set_data_type(f32)
        stats.set_ragged_offset(off_s)
    else:
        o, d_o = tensor("o", _O, q_dim, q_st), tensor("dO", _DO, q_dim, q_st)
        stats = tensor("stats", _STATS, s_dim, s_st, f32)
        o.set_ragged_offset(off_q)
        d_o.set_ragged_offset(off_q)
        stats.set_ragged_offset(off_s)
        extra: dict[str, Any] = dict(max_total_seq_len_q=key.total_q, max_total_seq_len_kv=key.total_k)
        if key.deterministic:
            extra["use_deterministic_algorithm"] = True
        dq, dk, dv = graph.sdpa_backward(
            name="bwd", q=q, k=k, v=v, o=o, dO=d_o, stats=stats, **common, **extra
        )
        for t, uid, dim, st, off in ((dq, _DQ, q_dim, q_st, off_q), (dk, _DK, k_dim, k_st, off_k), (dv, _DV, k_dim, k_st, off_k)):  # fmt: skip
            t.set_uid(uid).set_output(True).set_dim(dim).set_stride(st).set_data_type(io)
            t.set_ragged_offset(off)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    if key.deterministic:
        # The deterministic backward's workspace grows with N x S^2 (35 GB at 17 x 8192): refuse
        # plans over the limit before building them.
        graph.deselect_workspace_greater_than(deterministic_workspace_limit(key.device))
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL) if all_plans else graph.build_plans()
    workspace = int(graph.get_workspace_size())
    if key.deterministic and workspace > deterministic_workspace_limit(key.device):
        raise BuildError(f"deterministic backward workspace {workspace / 2**20:.0f} MiB is over the limit")
    return _Plan(graph, workspace)


_plans: dict[tuple[str, PlanKey], _Plan] = {}
_MAX_PLANS = 64
_builds = {"fwd": 0, "bwd": 0}  # graphs built in this process (tests and tools read it)
_runs = {"fwd": 0, "bwd": 0}  # graph executions in this process


def _built_off_stack(kind: str, key: PlanKey) -> _Plan:
    """`_build(kind, key)` on a thread of its own, so that no frame of the caller can outlive the call.

    cuDNN frontend 1.32 keeps an exception it caught (a heuristic mode that offered no engine, which
    the backward's mode A does) in a local of the frame that caught it: a reference cycle that
    keeps that frame and, through each frame's caller, the whole stack it was built on alive until
    Python's next full collection. Built inside the first backward, that stack held every gradient
    of the step (3.2 GiB more peak memory at 32K tokens, 5.8 at 64K, for as long as no full
    collection came: the whole run when the compiled graphs came from inductor's cache). On a
    thread of its own the cycle holds that thread's two frames."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            with torch.cuda.device(key.device):
                box["plan"] = _build(kind, key)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, raised there
            box["error"] = exc

    worker = threading.Thread(target=run, name="usp-cudnn-build", daemon=True)
    worker.start()
    worker.join()
    if "error" in box:
        raise box.pop("error")
    return box["plan"]


def _plan(kind: str, key: PlanKey) -> _Plan:
    plan = _plans.get((kind, key))
    if plan is None:
        with _lock:
            plan = _plans.get((kind, key))
            if plan is None:
                if module() is None:
                    raise BuildError(
                        "the cuDNN frontend (nvidia-cudnn-frontend, module cudnn) is not installed"
                    )
                try:
                    plan = _built_off_stack(kind, key)
                except BuildError:
                    raise
                except Exception as exc:
                    raise BuildError(f"cannot build the cuDNN {kind} graph for {key}: {exc}") from exc
                if len(_plans) >= _MAX_PLANS:  # the oldest graph goes (exact deterministic keys can pile up)
                    del _plans[next(iter(_plans))]
                _plans[(kind, key)] = plan
                _builds[kind] += 1
    return plan


# ------------------------------------------------------------------------------------------------
# Per-call metadata (device tensors, no host sync).

_factors: dict[tuple[Any, ...], Tensor] = {}


def ragged_offsets(cu_q: Tensor, cu_k: Tensor, h: int, g: int, d: int) -> tuple[Tensor, Tensor, Tensor]:
    """Ragged offsets in elements, int64 `(N + 1, 1, 1, 1)`: Q/O rows, K/V rows, stats rows."""
    key = (cu_q.device, h, g, d)
    fac = _factors.get(key)
    if fac is None:
        fac = _factors[key] = torch.tensor([[h * d], [g * d], [h]], dtype=torch.int64).to(cu_q.device)
    off = torch.stack((cu_q, cu_k, cu_q)).to(torch.int64) * fac  # (3, N + 1), one row per kind
    return tuple(off[i].view(-1, 1, 1, 1) for i in range(3))  # type: ignore[return-value]


def seq_lengths(cu_q: Tensor, cu_k: Tensor) -> tuple[Tensor, Tensor]:
    """Per-slot query and key lengths, int32 `(N, 1, 1, 1)` each."""
    if cu_q is cu_k:
        lens = torch.diff(cu_q).view(-1, 1, 1, 1)
        return lens, lens
    lens = torch.diff(torch.stack((cu_q, cu_k)), dim=1)
    return lens[0].view(-1, 1, 1, 1), lens[1].view(-1, 1, 1, 1)


def slot_metadata(
    cu_q: Tensor, cu_k: Tensor, h: int, g: int, d: int, slots: int
) -> tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]]:
    """`(seq_lengths(...), ragged_offsets(...))` padded to `slots` document slots (a `PlanKey`'s):
    the slots past cu_seqlens' own are empty (length 0, offsets repeating the last)."""
    seq_q, seq_k = seq_lengths(cu_q, cu_k)
    offsets = ragged_offsets(cu_q, cu_k, h, g, d)
    extra = slots - seq_q.shape[0]
    if extra < 0:
        raise ValueError(f"a graph for {slots} slots cannot run {seq_q.shape[0]} documents")
    if extra == 0:
        return (seq_q, seq_k), offsets
    zeros = seq_q.new_zeros(extra, 1, 1, 1)
    padded_q = torch.cat((seq_q, zeros))
    padded_k = padded_q if seq_k is seq_q else torch.cat((seq_k, zeros))
    offsets = tuple(torch.cat((off, off[-1:].expand(extra, 1, 1, 1))) for off in offsets)
    return (padded_q, padded_k), offsets  # type: ignore[return-value]


def _execute(plan: _Plan, key: PlanKey, pack: dict[int, Tensor], ws: Tensor | None = None) -> None:
    cudnn = module()
    if ws is None:
        ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=pack[_Q].device)
    with _lock:
        h = _handle(key.device)
        cudnn.set_stream(handle=h, stream=torch.cuda.current_stream(pack[_Q].device).cuda_stream)
        plan.graph.execute(pack, ws, handle=h)


# cuDNN's default backward holds a float32 workspace of T x H x K (the dQ accumulator) with as many
# K/V heads as query heads, and three times that with grouped K/V (dK and dV accumulated per query
# head): 1.5 GiB at 64K tokens with 16/4 heads, K = 128 (H200, cuDNN 9.19), which put a checkpointed
# train step's peak memory 4% over flex's (its backward holds none; BENCHMARKS.md 0f). The heads
# are independent, so a backward over that limit runs in groups of KV heads, each with its query
# heads, copied out to buffers of their own (sliced buffers kept the whole workspace: cuDNN sizes it
# by the buffers' strides): a graph of H / groups heads, its workspace 1 / groups. Groups cost time
# (64K tokens, 4 groups: 6.7 against 4.8 ms per call on an H100), so without a setting a backward
# whose whole workspace fits under the step's memory peak so far runs whole (`_under_peak`;
# BENCHMARKS.md 0l): where the peak lies elsewhere (the logits, with transformers 5.25's
# checkpointing) the step keeps flex's peak and ran 1.7% faster on an H100.
_grouped: dict[PlanKey, int] = {}


def _group_key(key: PlanKey, groups: int) -> PlanKey:
    return dataclasses.replace(key, heads=key.heads // groups, kv_heads=key.kv_heads // groups)


def grouped_backward(key: PlanKey) -> int:
    """How many groups of KV heads the backward of `key` runs in: 1, or the fewest (a divisor of G,
    at most G) whose graph's workspace is within `backward_workspace_limit()`, if that graph
    builds and its workspace is smaller. Never for the deterministic backward (its plans stay as
    they are). Decided once per key (building the graphs it compares)."""
    groups = _grouped.get(key)
    if groups is not None:
        return groups
    groups = 1
    if not key.deterministic and key.kv_heads > 1:
        workspace, limit = _plan("bwd", key).workspace, backward_workspace_limit()
        if workspace > limit:
            c = next(c for c in range(2, key.kv_heads + 1) if key.kv_heads % c == 0 and (workspace <= limit * c or c == key.kv_heads))  # fmt: skip
            try:
                if _plan("bwd", _group_key(key, c)).workspace < workspace:
                    groups = c
            except BuildError:
                pass
    if len(_grouped) >= 256:
        _grouped.clear()
    _grouped[key] = groups
    return groups


def backward_groups(key: PlanKey, device: torch.device, to_allocate: int = 0) -> int:
    """The groups the backward of `key` runs in now: `grouped_backward`'s, or 1 where no limit is
    set and the whole backward's workspace (and `to_allocate` bytes still to be allocated before
    it, the gradients) fits under the memory peak so far (`_under_peak`)."""
    groups = grouped_backward(key)
    if (
        groups > 1
        and _env_mb("USP_CUDNN_BACKWARD_WORKSPACE_MB") is None
        and _under_peak(_plan("bwd", key).workspace + to_allocate, device)
    ):
        return 1  # its whole workspace raises no peak: the faster launch
    return groups


def cudnn_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_q: Tensor, cu_k: Tensor, max_q: int, max_k: int, is_causal: bool,
    scale: float, window: tuple[int, int] = (-1, -1), *, square: bool, key: PlanKey | None = None,
    metadata: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None,
) -> tuple[Tensor, Tensor]:  # fmt: skip
    """`(out_THK, lse_HT)` by cuDNN's ragged forward. `square`: queries and keys share one boundary
    tensor (every row then lies in a document with keys). `key`: `plan_key(...)`, `metadata`:
    `slot_metadata(..., key.slots)`, when the caller has them already."""
    if key is None:
        key = plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, window, square=square)
    plan = _plan("fwd", key)
    t_q, h, d = q.shape
    q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    if metadata is None:
        metadata = slot_metadata(cu_q, cu_k, h, k.shape[1], d, key.slots)
    (seq_q, seq_k), (off_q, off_k, off_s) = metadata
    if square:
        out = torch.empty_like(q)
        stats = torch.empty(t_q, h, 1, dtype=torch.float32, device=q.device)
    else:  # rows cuDNN may leave untouched: out 0, lse -inf
        out = torch.zeros_like(q)
        stats = torch.full((t_q, h, 1), float("-inf"), dtype=torch.float32, device=q.device)
    pack = {_Q: q, _K: k, _V: v, _O: out, _STATS: stats, _SEQ_Q: seq_q, _SEQ_K: seq_k,
            _OFF_Q: off_q, _OFF_K: off_k, _OFF_S: off_s}  # fmt: skip
    _execute(plan, key, pack)
    _runs["fwd"] += 1
    return out, stats.view(t_q, h).t().contiguous()


def _grouped_launch(plan, key, i, hg, gg, inputs, grads, meta, ws, new) -> None:
    """Group `i` of a grouped backward: its query heads (`hg` of them) and KV heads (`gg`) copied to
    buffers of their own, one launch, its gradients copied into `grads`' slices. A function of its
    own so that one group's copies are freed before the next group's are made."""
    q, k, v, out, dout, stats = inputs
    qh, kh = slice(i * hg, (i + 1) * hg), slice(i * gg, (i + 1) * gg)
    gq, gout, gdout, gstats = (x[:, qh].contiguous() for x in (q, out, dout, stats))
    gk, gv = k[:, kh].contiguous(), v[:, kh].contiguous()
    gdq, gdk, gdv = new(gq), new(gk), new(gv)
    pack = {
        _Q: gq,
        _K: gk,
        _V: gv,
        _O: gout,
        _DO: gdout,
        _STATS: gstats,
        _DQ: gdq,
        _DK: gdk,
        _DV: gdv,
        **meta,
    }
    _execute(plan, key, pack, ws)
    dq, dk, dv = grads
    dq[:, qh], dk[:, kh], dv[:, kh] = gdq, gdk, gdv


def cudnn_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, cu_q: Tensor, cu_k: Tensor,
    max_q: int, max_k: int, is_causal: bool, scale: float, window: tuple[int, int] = (-1, -1), *, square: bool,
    key: PlanKey | None = None, metadata: tuple[tuple[Tensor, Tensor], tuple[Tensor, Tensor, Tensor]] | None = None,
    groups: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """`(dq, dk, dv)` by cuDNN's ragged backward from the forward's `out` and natural-log `lse_HT`
    (+inf rows add nothing; -inf rows see no key and add nothing either). The deterministic
    backward is built under `torch.use_deterministic_algorithms(True)`. `groups`: the launch's
    groups of KV heads (`backward_groups`), decided here when not given."""
    if key is None:
        det = torch.are_deterministic_algorithms_enabled()
        key = plan_key(q, k, cu_q, max_q, max_k, is_causal, scale, window, square=square, backward=True,
                       deterministic=det)  # fmt: skip
    t_q, h, d = q.shape
    q, k, v, out, dout = (x.contiguous() for x in (q, k, v, out, dout))
    stats = lse.float()
    if not square:  # with one boundary tensor every row sees a key: no -inf (a NaN stays NaN)
        stats = stats.masked_fill(lse == float("-inf"), float("inf"))
    stats = stats.t().contiguous().view(t_q, h, 1)
    if metadata is None:
        metadata = slot_metadata(cu_q, cu_k, h, k.shape[1], d, key.slots)
    (seq_q, seq_k), (off_q, off_k, off_s) = metadata
    new = torch.empty_like if square else torch.zeros_like  # rows outside every document: zero
    dq, dk, dv = new(q), new(k), new(v)
    if groups is None:
        groups = backward_groups(key, q.device)
    plan = _plan("bwd", key if groups == 1 else _group_key(key, groups))
    if groups == 1:
        pack = {_Q: q, _K: k, _V: v, _O: out, _DO: dout, _STATS: stats, _DQ: dq, _DK: dk, _DV: dv,
                _SEQ_Q: seq_q, _SEQ_K: seq_k, _OFF_Q: off_q, _OFF_K: off_k, _OFF_S: off_s}  # fmt: skip
        _execute(plan, key, pack)
    else:
        g = k.shape[1]
        hg, gg = h // groups, g // groups
        (seq_q, seq_k), (off_q, off_k, off_s) = per_boundaries(
            "cudnn",
            cu_q,
            cu_k,
            (hg, gg, d, key.slots),
            lambda: slot_metadata(cu_q, cu_k, hg, gg, d, key.slots),
        )
        meta = {_SEQ_Q: seq_q, _SEQ_K: seq_k, _OFF_Q: off_q, _OFF_K: off_k, _OFF_S: off_s}
        ws = torch.empty(max(plan.workspace, 1), dtype=torch.uint8, device=q.device)
        for i in range(groups):
            _grouped_launch(plan, key, i, hg, gg, (q, k, v, out, dout, stats), (dq, dk, dv), meta, ws, new)
    _runs["bwd"] += 1
    return dq, dk, dv
