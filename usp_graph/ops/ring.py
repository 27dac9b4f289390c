"""Ring attention on packed documents: ``usp::ring_attn_fwd`` / ``usp::ring_attn_bwd``.

# T local packed tokens, H query heads, G key/value heads, K head dim, R ring size, C chunks per rank

The global token stream is cut into equal chunks; ring rank r holds the C chunks
``chunk_ids[r*C:(r+1)*C]`` back to back (contiguous sharding, zigzag load balancing, and the
Ulysses-gathered chunks of 2-D USP are all just chunk lists). Global `cu_seqlens` stay global: for
every (query chunk, key chunk) pair the op derives that pair's document view by clamping, so
boundaries may change every step and documents may cross chunks.

Forward: K/V travel around the ring (rank r receives from r-1); at each step every local query
chunk attends the visiting key chunks, and partial outputs are merged by their log-sum-exp in fp32
(fp64 for fp64 inputs). A step runs one ``usp::varlen_fwd`` call per kernel-argument group (causal
flag, window; `_calls`), not one per (query chunk, key chunk) pair (issue 19): the group's views
go back to back, each view's documents separate sequences of the packed call. Windowless pairs
join into views over several chunks laid out in global order (`_views`), so a windowless step,
causal or not, zigzag or 2-D USP, is ONE call that computes each query row once. The step's
partial results are merged into the running result in one pass (`_merge_step`).
Backward: recompute against the global out/lse with ``usp::varlen_bwd``, the same calls; the
gradients go back to dq and to the dK/dV buffer by slice adds in a fixed order (bitwise repeatable;
no index_add). The dK/dV buffer travels with K/V and is carried home after the last step.

Causal pairs: a key chunk entirely before the query chunk is attended in full, the same chunk is
ordinary causal (equal lengths per document), a key chunk after the query chunk is skipped.

Sliding windows (`window_left/right`, keyword-only; `usp_graph.ops.window`): a pair whose chunks
lie farther apart than the window is skipped, one the window covers whole is attended in full,
and the same chunk runs the window as it is (its views of a document coincide). A pair the window
cuts has exactly one document with work (the one spanning from one chunk into the other), but its
views of that document end at positions that depend on the boundaries, and the kernel's window is
anchored at view ends (bottom-right). So the views are made to end at fixed chunk offsets, and the
window shifted by that fixed amount (`_pair_plan`):
- keys before the queries ("before"): the first m query rows that can reach the key chunk form
  one view for the document holding the chunk's first token; rows past that document's end are
  computed but dropped (out 0 / lse -inf forward, lse +inf and zero gradient backward);
- keys after the queries ("after"): n dummy query rows are appended, standing for the key chunk's  key chunk's
  first n positions with the gap between the chunks removed, so every query view ends where its
  key view ends; the dummy rows' outputs are dropped.

Faults (issue 31). Before the first hop, the ranks agree on every shape, dtype and argument that
the hops' sizes follow from (`_agree`, one small all-gather on CPU tensors): a rank whose K/V or
layout differs would make gloo abort the process or leave received rows unwritten; instead every
rank raises `CollectiveError`. A failed hop is a `CollectiveError` too, and an op that raises while
hops are in flight waits for them first, so no transfer outlives the op.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import registry
from ..distributed import CollectiveError, agree_sizes, record_sent, run_collective
from .boundaries import device_assert
from .boundaries import lse_dtype as _lse_dtype
from .define import define
from .window import NO_WINDOW, bounds

__all__ = ["ring_attn_fwd", "ring_attn_bwd", "pair_view"]

_NEG_INF = float("-inf")
_POS_INF = float("inf")


def _group(name: str):
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


def pair_view(cu: Tensor, q_start: int, k_start: int, chunk: int) -> tuple[Tensor, Tensor]:
    """Document boundaries of query chunk [q_start, q_start+chunk) against key chunk
    [k_start, k_start+chunk), both relative to their chunk; each runs 0..chunk."""
    return (
        (cu.clamp(q_start, q_start + chunk) - q_start),
        (cu.clamp(k_start, k_start + chunk) - k_start),
    )


def _pair_mode(qc: int, kc: int, is_causal: bool) -> str | None:
    """'full', 'causal' or None (skip) for query chunk qc against key chunk kc."""
    if not is_causal or kc < qc:
        return "full"
    if kc == qc:
        return "causal"
    return None


def _pair_plan(
    qc: int, kc: int, chunk: int, is_causal: bool, window: tuple[int, int]
) -> tuple[str, int, tuple[int, ...]] | None:
    """How query chunk qc attends key chunk kc under `window`: None (skip) or (kind, rows/keys,
    kernel window args). kind: 'full' | 'causal' (the windowless pair), 'same' (same chunk: the
    window as it is), 'before' (the first `m` query rows, kernel window (left - gap - m, -1)),
    'after' (the first `n` keys, kernel window (-1, right - gap)); gap: tokens between the chunks.
    """
    if window == NO_WINDOW:
        mode = _pair_mode(qc, kc, is_causal)
        return None if mode is None else (mode, chunk, ())
    left, right = bounds(window, is_causal)
    if kc == qc:
        return ("causal" if is_causal else "full"), chunk, window
    if kc < qc:  # every key precedes every query: only the left bound matters
        gap = (qc - kc - 1) * chunk
        if left == -1 or left >= gap + 2 * chunk - 1:  # farthest pair within the window
            return "full", chunk, ()
        if left <= gap:  # nearest pair (distance gap + 1) outside it
            return None
        m = min(chunk, left - gap)  # query rows r < left - gap reach the key chunk
        return "before", m, (left - gap - m, -1)
    if right == 0:  # every key follows every query
        return None
    gap = (kc - qc - 1) * chunk
    if right == -1 or right >= gap + 2 * chunk - 1:
        return "full", chunk, ()
    if right <= gap:
        return None
    n = min(chunk, right - gap)  # keys j < right - gap are reached by the chunk's last rows
    return "after", n, (-1, right - gap)


class _View:
    """One view of a step's kernel call (`_Call`), the same in forward and backward: the local
    query chunks `qis` (rows: their slices of the local q) against visiting key chunks (keys:
    slices of the visiting K/V), each list in global chunk order, so every document's queries and
    keys lie back to back. Windowless views take several chunks (`_views`); a windowed pair is
    one query chunk and one key chunk, with dummy: query rows appended after its rows ('after')
    and valid: bool (rows,) of the rows that belong to its document ('before'). window: the
    kernel's trailing window args; max_q: bound on the query views' lengths."""

    __slots__ = ("qis", "rows", "keys", "cu_q", "cu_k", "causal", "window", "max_q", "dummy", "valid")

    def __init__(self, qis, rows, keys, cu_q, cu_k, causal, window, max_q, dummy=0, valid=None):
        self.qis, self.rows, self.keys, self.cu_q, self.cu_k = qis, rows, keys, cu_q, cu_k
        self.causal, self.window, self.max_q, self.dummy, self.valid = causal, window, max_q, dummy, valid


def _chunks_view(cu: Tensor, starts: list[int], chunk: int) -> Tensor:
    """Document boundaries of the chunks starting at `starts` (global positions, ascending) laid
    back to back: each boundary counts the chunks' tokens before it."""
    view = cu.clamp(starts[0], starts[0] + chunk) - starts[0]
    for s in starts[1:]:
        view = view + (cu.clamp(s, s + chunk) - s)
    return view


def _views(q_ids, k_ids, chunk, cu, is_causal, max_seqlen, window=NO_WINDOW):
    """The views of one step, in a fixed order: every (local query chunk, visiting key chunk) pair
    with work (`_pair_plan`) is in exactly one.

    Windowless pairs ('full', and 'causal' on the diagonal) join across chunks, so each query row
    is in one windowless view per step: when the query and key chunks are the same set (a ring's
    first step) one view holds them all (plain causal or bidirectional attention over the chunks in
    global order); otherwise query chunks that attend the same key chunks in full share one view
    (keys repeat only across views with different key sets), and a query chunk with its own
    diagonal takes the keys below it and then its own, causal (bottom-right: each query sees every
    earlier key and its own chunk causally). Windowed pairs ('before', 'after', the diagonal under
    a window) stay one view each."""
    full: dict[int, list[int]] = {}  # query chunk -> key chunks it attends whole, no window
    diag: dict[int, int] = {}  # query chunk -> its own chunk among the keys, windowless causal
    windowed = []
    for qi, qc in enumerate(q_ids):
        for ki, kc in enumerate(k_ids):
            plan = _pair_plan(qc, kc, chunk, is_causal, window)
            if plan is None:
                continue
            if plan[2] == ():
                if plan[0] == "causal":
                    diag[qi] = ki
                else:
                    full.setdefault(qi, []).append(ki)
            else:
                windowed.append((qi, ki, plan))

    def by_id(ids, idx):
        return sorted(idx, key=lambda i: ids[i])

    def rows(ids, idx):
        return [slice(i * chunk, (i + 1) * chunk) for i in idx]

    def starts(ids, idx):
        return [ids[i] * chunk for i in idx]

    same_set = len(set(q_ids)) == len(q_ids) and sorted(q_ids) == sorted(k_ids)
    if window == NO_WINDOW and same_set:
        qis, kis = by_id(q_ids, range(len(q_ids))), by_id(k_ids, range(len(k_ids)))
        cu_v = _chunks_view(cu, starts(q_ids, qis), chunk)
        yield _View(qis, rows(q_ids, qis), rows(k_ids, kis), cu_v, cu_v, is_causal, (), max_seqlen)
    else:
        views: dict[tuple, list[int]] = {}  # (keys attended whole, own diagonal) -> query chunks
        for qi in range(len(q_ids)):
            if qi in full or qi in diag:
                kis = tuple(by_id(k_ids, full.get(qi, [])))
                views.setdefault((kis, diag.get(qi)), []).append(qi)  # a diagonal is one chunk's
        for (kis, d), qis in views.items():
            qis = by_id(q_ids, qis)
            kis = [*kis, d] if d is not None else list(kis)  # keys below a diagonal come first
            yield _View(qis, rows(q_ids, qis), rows(k_ids, kis), _chunks_view(cu, starts(q_ids, qis), chunk),
                        _chunks_view(cu, starts(k_ids, kis), chunk), d is not None, (), max_seqlen)  # fmt: skip
    for qi, ki, (kind, size, win) in windowed:
        q0, k0 = qi * chunk, ki * chunk
        qs, ks = q_ids[qi] * chunk, k_ids[ki] * chunk
        if kind == "before":
            # One view of `size` rows for the document that holds token qs (the only one with
            # keys in this chunk and queries in that one); its key view ends at the chunk end.
            cu_q = (cu > qs).to(cu.dtype) * size
            cu_k = cu.clamp(ks, ks + chunk) - ks
            doc_end = torch.where(cu > qs, cu, torch.iinfo(cu.dtype).max).amin()
            valid = torch.arange(qs, qs + size, device=cu.device) < doc_end
            yield _View([qi], [slice(q0, q0 + size)], [slice(k0, k0 + chunk)], cu_q, cu_k, False, win,
                        max(max_seqlen, size), valid=valid)  # fmt: skip
        elif kind == "after":
            # Dummy query rows stand for key positions ks .. ks+size-1 with the gap removed:
            # boundaries past the query chunk continue at row `chunk`.
            cu_q = (cu.clamp(qs, qs + chunk) - qs) + (cu.clamp(ks, ks + size) - ks)
            cu_k = cu.clamp(ks, ks + size) - ks
            yield _View([qi], [slice(q0, q0 + chunk)], [slice(k0, k0 + size)], cu_q, cu_k, False, win, max_seqlen,
                        dummy=size)  # fmt: skip
        else:  # the diagonal under a window: the window as it is
            cu_q, cu_k = pair_view(cu, qs, ks, chunk)
            yield _View([qi], [slice(q0, q0 + chunk)], [slice(k0, k0 + chunk)], cu_q, cu_k, kind == "causal", win,
                        max_seqlen)  # fmt: skip


class _Call:
    """One varlen kernel call of a ring step: the step's views with the same kernel arguments
    (`causal`, `window`), back to back. q_at / k_at: where each view's query rows (dummy rows
    included) and keys start in the call's inputs; cu_q / cu_k: every view's document boundaries
    in turn, shifted to those offsets (a view's first boundary, 0, is the previous view's last)."""

    __slots__ = ("views", "q_at", "k_at", "cu_q", "cu_k", "max_q", "causal", "window")

    def __init__(self, views: list[_View], causal: bool, window: tuple[int, int]):
        self.views, self.causal, self.window = views, causal, window
        self.q_at, self.k_at, cu_q, cu_k = [], [], [], []
        n_q = n_k = 0
        for i, p in enumerate(views):
            self.q_at.append(n_q)
            self.k_at.append(n_k)
            # Every view runs 0..its row (key) count: cu_q by the kernel's contract, cu_k because
            # the global boundaries end at the stream's end (`_check_ends`; a view clamps them).
            first = 0 if i == 0 else 1
            cu_q.append(p.cu_q[first:] + n_q)
            cu_k.append(p.cu_k[first:] + n_k)
            n_q += sum(map(_length, p.rows)) + p.dummy
            n_k += sum(map(_length, p.keys))
        self.cu_q = cu_q[0] if len(views) == 1 else torch.cat(cu_q)
        self.cu_k = cu_k[0] if len(views) == 1 else torch.cat(cu_k)
        self.max_q = max(p.max_q for p in views)


def _calls(views: list[_View]) -> list[_Call]:
    """The step's views grouped by kernel arguments, one `_Call` per group, in the order each
    group first appears (views keep their order within a group): a fixed order, so results are
    bitwise repeatable."""
    groups: dict[tuple[bool, tuple[int, ...]], list[_View]] = {}
    for p in views:
        groups.setdefault((p.causal, tuple(p.window) or NO_WINDOW), []).append(p)
    return [_Call(ps, causal, window) for (causal, window), ps in groups.items()]


def _length(s: slice) -> int:
    return s.stop - s.start


def _row_spans(call: _Call, *, masked: bool = False) -> list[tuple[slice, int, Tensor | None]]:
    """`_gather` spans of the call's query rows: each view's chunks, then its dummy rows;
    `masked`: with the rows of other documents of a 'before' view marked."""
    return [
        (sl, p.dummy if i == len(p.rows) - 1 else 0, p.valid if masked else None)
        for p in call.views
        for i, sl in enumerate(p.rows)
    ]


def _key_spans(call: _Call) -> list[tuple[slice, int, None]]:
    return [(sl, 0, None) for p in call.views for sl in p.keys]


def _row_places(call: _Call) -> list[tuple[int, slice, int]]:
    """(query chunk, local rows, where they start in the call's query rows) of every view's chunks."""
    places = []
    for p, at in zip(call.views, call.q_at, strict=True):
        for qi, sl in zip(p.qis, p.rows, strict=True):
            places.append((qi, sl, at))
            at += _length(sl)
    return places


def _key_places(call: _Call) -> list[tuple[slice, int]]:
    places = []
    for p, at in zip(call.views, call.k_at, strict=True):
        for sl in p.keys:
            places.append((sl, at))
            at += _length(sl)
    return places


def _gather(
    x: Tensor, spans: list[tuple[slice, int, Tensor | None]], *, dim: int = 0, fill: float = 0.0
) -> Tensor:
    """x's entries `sl` along `dim` (rows; columns of an (H, T) lse) for each (sl, pad, valid)
    of `spans`, entries where `valid` is False set to `fill`, then `pad` entries of `fill`; all
    back to back. A run of adjacent plain slices stays one view of x: a call over a rank's whole
    q, or over K/V chunks that lie in order, copies nothing."""
    pieces: list[Tensor] = []
    run: slice | None = None  # a pending view of x

    def flush() -> None:
        nonlocal run
        if run is not None:
            pieces.append(x.narrow(dim, run.start, _length(run)))
            run = None

    for sl, pad, valid in spans:
        if valid is not None:
            flush()
            keep = valid.view(-1, *([1] * (x.dim() - 1))) if dim == 0 else valid
            pieces.append(torch.where(keep, x.narrow(dim, sl.start, _length(sl)), fill))
        elif run is not None and run.stop == sl.start:
            run = slice(run.start, sl.stop)
        else:
            flush()
            run = sl
        if pad:
            flush()
            shape = list(x.shape)
            shape[dim] = pad
            pieces.append(x.new_full(shape, fill))
    flush()
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim)


def _add_rows(dst: Tensor, src: Tensor, spans: list[tuple[slice, int]]) -> None:
    """In place, in order: dst[sl] += src[at : at + len(sl)] for each (sl, at) of `spans`; a run
    that is adjacent in both is one add. Slice adds in a fixed order: deterministic on every
    device, unlike index_add_ on CUDA."""
    run: tuple[slice, int] | None = None
    for sl, at in spans:
        if run is not None and run[0].stop == sl.start and run[1] + _length(run[0]) == at:
            run = (slice(run[0].start, sl.stop), run[1])
            continue
        if run is not None:
            dst[run[0]].add_(src[run[1] : run[1] + _length(run[0])])
        run = (sl, at)
    if run is not None:
        dst[run[0]].add_(src[run[1] : run[1] + _length(run[0])])


def _agree(op_name: str, group, rank: int, size: int, tensors: dict[str, Tensor], rotated: list[Tensor],
           args: tuple) -> bool:  # fmt: skip
    """Agree with the ring, before the first hop, on everything the hops' sizes follow from: the
    shapes and dtypes of `tensors` and the op's arguments `args` must be the same on every rank,
    and each rank sends the `rotated` tensors' bytes to rank+1 and receives as many from rank-1.
    CPU tensors only (see `usp_graph.distributed.agree_sizes`); whether it ran."""
    if size == 1 or any(t.device.type != "cpu" for t in tensors.values()):
        return False
    key = (op_name, tuple((k, str(t.dtype), tuple(t.shape)) for k, t in tensors.items()), *args)
    nbytes = sum(t.numel() * t.element_size() for t in rotated)
    send, recv = [0] * size, [0] * size
    send[(rank + 1) % size] += nbytes
    recv[(rank - 1) % size] += nbytes
    agree_sizes(op_name, group, key, send, recv)
    return True


def _start_rotate(
    tensors: list[Tensor], group, rank: int, size: int, agreed: bool
) -> tuple[list, list[Tensor]]:
    """Start sending to rank+1 and receiving from rank-1 (ranks within `group`); compute overlaps
    the transfer until `_finish`. Receive buffers: written whole once the sizes were `agreed`,
    zero-filled otherwise (no bytes the allocator held before can reach a result)."""
    send_to = dist.get_global_rank(group, (rank + 1) % size)
    recv_from = dist.get_global_rank(group, (rank - 1) % size)
    alloc = torch.empty if agreed else torch.zeros
    received = [alloc(t.shape, dtype=t.dtype, device=t.device) for t in tensors]
    record_sent("usp::ring_attn", sum(t.numel() * t.element_size() for t in tensors))
    ops = []
    for t, r in zip(tensors, received, strict=True):
        ops.append(dist.P2POp(dist.isend, t.contiguous(), send_to, group))
        ops.append(dist.P2POp(dist.irecv, r, recv_from, group))
    return run_collective("usp::ring_attn", group, lambda: dist.batch_isend_irecv(ops)), received


def _finish(pending: tuple[list, list[Tensor]], group) -> list[Tensor]:
    works, received = pending
    for work in works:
        run_collective("usp::ring_attn", group, work.wait)
    return received


def _abandon(group, *pendings) -> None:
    """The op failed with hops in flight: wait for them (errors dropped; the op's own error is
    the one to report), so no transfer into or out of the op's buffers outlives it."""
    for pending in pendings:
        if pending is None:
            continue
        try:
            _finish(pending, group)
        except CollectiveError:
            pass


def _layout(q: Tensor, chunk_ids: list[int], chunks_per_rank: int, group_name: str):
    group = _group(group_name)
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    if len(chunk_ids) != size * chunks_per_rank:
        raise ValueError(
            f"chunk_ids has {len(chunk_ids)} entries; expected ring size {size} x {chunks_per_rank} chunks per rank"
        )
    if q.shape[0] % chunks_per_rank:
        raise ValueError(f"{q.shape[0]} local tokens do not split into {chunks_per_rank} equal chunks")
    chunk = q.shape[0] // chunks_per_rank
    ids = [chunk_ids[r * chunks_per_rank : (r + 1) * chunks_per_rank] for r in range(size)]
    return group, size, rank, chunk, ids


def _check_ends(cu: Tensor, total: int) -> None:
    """Assert, without a host sync, that the global boundaries start at 0 and reach the stream's
    end: then every view's boundaries run 0..its row and key counts, which packing several views
    into one call relies on (the kernel checks the call's boundaries, not where each view ends)."""
    ok = (cu[0] == 0) & (cu[-1] >= total)
    device_assert(ok, f"usp::ring_attn: cu_seqlens must run from 0 to the {total} tokens of the stream")


@define("usp::ring_attn_fwd")
def ring_attn_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    is_causal: bool,
    scale: float,
    chunk_ids: list[int],
    chunks_per_rank: int,
    group_name: str,
    *,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor]:
    """Ring attention forward over the group: `(out_THK, lse_HT)` for this rank's queries.

    `window_left/right`: a sliding window (flash's convention, -1 unbounded) over global positions
    within each document; keyword-only, so the positional arguments graphs name stay put."""
    group, size, rank, chunk, ids = _layout(q, chunk_ids, chunks_per_rank, group_name)
    window = (window_left, window_right)
    agreed = _agree("usp::ring_attn_fwd", group, rank, size, {"q": q, "k": k, "v": v, "cu_seqlens": cu_seqlens},
                    [k, v], (tuple(chunk_ids), chunks_per_rank, max_seqlen, is_causal, scale, window))  # fmt: skip
    acc = _lse_dtype(q.dtype)
    t, h, _ = q.shape
    out = torch.zeros(t, h, v.shape[-1], dtype=acc, device=q.device)
    lse = torch.full((h, t), _NEG_INF, dtype=acc, device=q.device)
    _check_ends(cu_seqlens, len(chunk_ids) * chunk)
    seen = [False] * len(ids[rank])  # query chunks that hold a partial result already
    kv = [k, v]
    pending = None
    try:
        for step in range(size):
            src = (rank - step) % size
            pending = _start_rotate(kv, group, rank, size, agreed) if step + 1 < size else None
            k_cur, v_cur = kv
            parts = []  # (query chunk, rows, o_p, lse_p) of every pair, for the step's merge
            for call in _calls(
                list(_views(ids[rank], ids[src], chunk, cu_seqlens, is_causal, max_seqlen, window))
            ):
                k_spans = _key_spans(call)
                o_c, lse_c = torch.ops.usp.varlen_fwd(
                    _gather(q, _row_spans(call)), _gather(k_cur, k_spans), _gather(v_cur, k_spans), call.cu_q,
                    call.cu_k, call.max_q, max_seqlen, call.causal, scale, *call.window,
                )  # fmt: skip
                for p, at in zip(call.views, call.q_at, strict=True):
                    if p.valid is not None:  # rows of other documents: no partial result
                        n = _length(p.rows[0])
                        o_c[at : at + n].masked_fill_(~p.valid.view(-1, 1, 1), 0.0)
                        lse_c[:, at : at + n].masked_fill_(~p.valid, _NEG_INF)
                for qi, rows, at in _row_places(call):
                    n = _length(rows)
                    parts.append((qi, rows, o_c[at : at + n], lse_c[:, at : at + n]))
            _merge_step(out, lse, parts, seen)
            if pending is not None:
                kv = _finish(pending, group)
    except BaseException:
        _abandon(group, pending)
        raise
    return out.to(q.dtype), lse.to(_lse_dtype(q.dtype))


def _merge_step(out: Tensor, lse: Tensor, parts: list[tuple], seen: list[bool]) -> None:
    """In place: the running (out, lse) <- its softmax-weighted union with one step's partial
    results `parts`, (query chunk, rows, o_p, lse_p) each; a chunk may get several in one step.

    A chunk's first partial result is copied: there is nothing to merge it with. The others are
    merged in one pass: one logsumexp over the stacked log-sum-exps (the small (H, T) side) gives
    every row's new lse and each partial's weight, the running output of the rows they touch is
    rescaled once, and each partial output is added with its weight (no full-size temporaries).
    Rows no partial touches keep their value (weight exp(0) = 1; no weight at all outside the
    touched span)."""
    later: list[tuple[int, slice, Tensor, Tensor]] = []  # (slot, rows, o_p, lse_p) to merge
    slots: dict[int, int] = {}  # query chunk -> partials of this step merged so far
    for qi, rows, o_p, lse_p in parts:
        if seen[qi]:
            later.append((slots.get(qi, 0), rows, o_p, lse_p))
            slots[qi] = slots.get(qi, 0) + 1
        else:
            out[rows].copy_(o_p)
            lse[:, rows].copy_(lse_p)
            seen[qi] = True
    if not later:
        return
    lo, hi = min(r.start for _, r, _, _ in later), max(r.stop for _, r, _, _ in later)
    # Slot 0: the running result; slot s + 1: the s-th partial of a chunk in this step (-inf
    # where a slot has none).
    lse_S = torch.full(
        (max(slots.values()) + 1, lse.shape[0], hi - lo), _NEG_INF, dtype=lse.dtype, device=lse.device
    )
    lse_S[0] = lse[:, lo:hi]
    for s, rows, _, lse_p in later:
        lse_S[s + 1, :, rows.start - lo : rows.stop - lo] = lse_p
    new = torch.logsumexp(lse_S, 0)
    safe = new.masked_fill(new == _NEG_INF, 0.0)  # rows with no key so far stay 0 / -inf
    w_S = torch.exp(lse_S - safe).transpose(1, 2).unsqueeze(-1)  # (slots, rows, H, 1)
    acc = out[lo:hi]
    acc.mul_(w_S[0])
    for s, rows, o_p, _ in later:
        r = slice(rows.start - lo, rows.stop - lo)
        acc[r].addcmul_(o_p, w_S[s + 1, r])
    lse[:, lo:hi] = new


@ring_attn_fwd.register_fake
def _(q, k, v, cu_seqlens, max_seqlen, is_causal, scale, chunk_ids, chunks_per_rank, group_name, *,
      window_left=-1, window_right=-1):  # fmt: skip
    t, h, _ = q.shape
    return q.new_empty(t, h, v.shape[-1]), q.new_empty(h, t, dtype=_lse_dtype(q.dtype))


@define("usp::ring_attn_bwd")
def ring_attn_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    cu_seqlens: Tensor,
    max_seqlen: int,
    is_causal: bool,
    scale: float,
    chunk_ids: list[int],
    chunks_per_rank: int,
    group_name: str,
    *,
    window_left: int = -1,
    window_right: int = -1,
) -> tuple[Tensor, Tensor, Tensor]:
    """Ring attention backward: `(dq, dk, dv)` for this rank's q and its own k/v."""
    group, size, rank, chunk, ids = _layout(q, chunk_ids, chunks_per_rank, group_name)
    window = (window_left, window_right)
    tensors = {"grad_out": grad_out, "q": q, "k": k, "v": v, "out": out, "lse": lse, "cu_seqlens": cu_seqlens}
    args = (tuple(chunk_ids), chunks_per_rank, max_seqlen, is_causal, scale, window)
    # Each hop moves K/V and the dK/dV carried with them (fp32/fp64 accumulators of K/V's shapes).
    acc = _lse_dtype(q.dtype)
    agreed = _agree("usp::ring_attn_bwd", group, rank, size, tensors, [k, v], args)
    _check_ends(cu_seqlens, len(chunk_ids) * chunk)
    dq = torch.zeros(q.shape, dtype=acc, device=q.device)
    k_cur, v_cur = k, v
    carried = None  # dK/dV of the visiting K/V accumulated by earlier ranks, in flight
    pending = None
    try:
        for step in range(size):
            src = (rank - step) % size
            # K/V of the next step travel while this step computes.
            pending = _start_rotate([k_cur, v_cur], group, rank, size, agreed) if step + 1 < size else None
            dk = torch.zeros(k.shape, dtype=acc, device=q.device)  # grads of the visiting K/V
            dv = torch.zeros(v.shape, dtype=acc, device=q.device)
            for call in _calls(
                list(_views(ids[rank], ids[src], chunk, cu_seqlens, is_causal, max_seqlen, window))
            ):
                # Rows of other documents ('before' pairs): lse +inf makes p = exp(s - inf) = 0, no gradient.
                q_spans, g_spans, k_spans = _row_spans(call), _row_spans(call, masked=True), _key_spans(call)
                g_q, g_k, g_v = torch.ops.usp.varlen_bwd(
                    _gather(grad_out, g_spans),
                    _gather(q, q_spans),
                    _gather(k_cur, k_spans),
                    _gather(v_cur, k_spans),
                    _gather(out, q_spans),
                    _gather(lse, g_spans, dim=1, fill=_POS_INF),
                    call.cu_q,
                    call.cu_k,
                    call.max_q,
                    max_seqlen,
                    call.causal,
                    scale,
                    *call.window,
                )
                for p, at in zip(call.views, call.q_at, strict=True):
                    if p.valid is not None:
                        g_q[at : at + _length(p.rows[0])].masked_fill_(~p.valid.view(-1, 1, 1), 0.0)
                _add_rows(dq, g_q, [(rows, at) for _, rows, at in _row_places(call)])
                k_places = _key_places(call)
                _add_rows(dk, g_k, k_places)
                _add_rows(dv, g_v, k_places)
            # dK/dV travel with their K/V, one hop behind: the buffers this rank receives now belong
            # to the K/V it just used (rank-1 used them one step earlier), and their transfer
            # overlapped this step's compute. After the last step the sum belongs to rank+1's own
            # K/V, so the last hop carries every dK/dV home.
            if carried is not None:
                dk_in, dv_in = _finish(carried, group)
                dk += dk_in
                dv += dv_in
            if size > 1:
                carried = _start_rotate([dk, dv], group, rank, size, agreed)
            if pending is not None:
                k_cur, v_cur = _finish(pending, group)
        if carried is not None:
            dk, dv = _finish(carried, group)
    except BaseException:
        _abandon(group, pending, carried)
        raise
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


@ring_attn_bwd.register_fake
def _(
    grad_out,
    q,
    k,
    v,
    out,
    lse,
    cu_seqlens,
    max_seqlen,
    is_causal,
    scale,
    chunk_ids,
    chunks_per_rank,
    group_name,
    *,
    window_left=-1,
    window_right=-1,
):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)  # contiguous, as the op


def _setup_context(ctx, inputs, keyword_only_inputs, output):
    q, k, v, cu, max_seqlen, is_causal, scale, chunk_ids, chunks_per_rank, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.args = (max_seqlen, is_causal, scale, chunk_ids, chunks_per_rank, group_name)
    left, right = keyword_only_inputs.get("window_left", -1), keyword_only_inputs.get("window_right", -1)
    # No window: no keyword arguments, so the backward node is exactly the windowless one.
    ctx.window = {} if (left, right) == NO_WINDOW else {"window_left": left, "window_right": right}
    ctx.set_materialize_grads(False)


def _backward(ctx, grad_out, grad_lse):
    if grad_lse is not None:
        raise NotImplementedError(
            "usp::ring_attn_fwd: a gradient through lse is not supported; use only its out"
        )
    q, k, v, out, lse, cu = ctx.saved_tensors
    if grad_out is None:
        return (None,) * 10
    max_seqlen, is_causal, scale, chunk_ids, chunks_per_rank, group_name = ctx.args
    dq, dk, dv = torch.ops.usp.ring_attn_bwd(
        grad_out, q, k, v, out, lse, cu, max_seqlen, is_causal, scale, chunk_ids, chunks_per_rank, group_name,
        **ctx.window,
    )  # fmt: skip
    return dq, dk, dv, None, None, None, None, None, None, None


# The rules themselves (backward ops, adjoints) are rows of usp_graph.registry.TABLE.
registry.implement(ring_attn_fwd, setup_context=_setup_context, backward=_backward)
