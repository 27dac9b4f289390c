"""Halo exchange along the packed token stream: ``usp::halo_exchange`` and its adjoint ``usp::halo_reduce``.

# B rows, L local row length, P ranks in the group, r this rank, W halo width

The packed global stream is B rows back to back, each row cut into P contiguous chunks, rank r
holding chunk r of every row (contiguous sharding). The chunk before (row b, chunk r) is
(row b, chunk r-1), and for r = 0 it is (row b-1, chunk P-1): a circular shift over the stream.

- ``halo_exchange(x, dim, before, after, max_seqlen, group)``: x is (B, ..., L, ...) with rows in
  dim 0 and the sequence in `dim`. Returns x with the last `before` tokens of the preceding chunk
  prepended and the first `after` tokens of the following chunk appended, along `dim`; tokens
  before the start or after the end of the stream are zeros. Each rank sends its tail to rank r+1
  and its head to rank r-1 (and rank P-1 <-> 0 across rows when B > 1).
  Document attention then needs nothing else when no document is longer than the halo plus one:
  the op refuses (`ValueError`, the same on every rank, before any communication) when
  ``max_seqlen > max(before, after) + 1``, since such a document could need keys past the halo.
- ``halo_reduce(dy, dim, before, after, group)``: the adjoint. The halo parts of dy go back to the
  ranks that own those tokens and are added there, tail first, then head (a fixed order, so the
  bits do not depend on arrival order); the middle part is this rank's own gradient.

Each is the other's registered backward, so a traced joint graph shows the adjoint as a node.

Faults (issue 31): before any halo moves, the ranks agree on the widths, rows, trailing shape and
dtype, and on the bytes each sends to and receives from its neighbours (`_swap`; one small
all-gather on CPU tensors), so a disagreement is a `CollectiveError` on every rank, not a gloo
abort or a halo of zeros where a neighbour's tokens belong.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import Tensor

from .. import registry
from ..distributed import agree_sizes, record_sent, resolve_group, run_collective
from .define import define

__all__ = ["halo_exchange", "halo_reduce"]


def _check(x: Tensor, dim: int, before: int, after: int) -> int:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dim() < 2:
        raise ValueError(f"x must have a row dim 0 and a sequence dim, got shape {tuple(x.shape)}")
    for name, value in (("dim", dim), ("before", before), ("after", after)):
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    d = dim % x.dim() if -x.dim() <= dim < x.dim() else None
    if d is None or d == 0:
        raise ValueError(f"dim={dim} must name a sequence dim of x (not the row dim 0); x has {x.dim()} dims")
    if before < 0 or after < 0:
        raise ValueError(f"halo widths must be >= 0, got before={before}, after={after}")
    return d


def _check_widths(n: int, before: int, after: int) -> None:
    if before > n or after > n:
        raise ValueError(
            f"a halo of {max(before, after)} tokens is wider than the {n} local tokens per row: a document "
            "would span more than two ranks; use fewer ranks, longer rows, or the ring / allgather_kv strategy"
        )


def _peers(rank: int, size: int, rows: int) -> tuple[int | None, int | None]:
    """(previous, next) rank along the stream; across the row boundary only when there are rows."""
    circular = rows > 1
    prev = rank - 1 if rank > 0 else (size - 1 if circular else None)
    nxt = rank + 1 if rank + 1 < size else (0 if circular else None)
    return prev, nxt


def _swap(pg, rank: int, send_next: Tensor | None, send_prev: Tensor | None, recv_prev: Tensor | None,
          recv_next: Tensor | None, prev: int | None, nxt: int | None, op_name: str,
          key: tuple) -> None:  # fmt: skip
    """Send `send_next` to the next rank and `send_prev` to the previous one; receive into
    `recv_prev` from the previous rank and `recv_next` from the next one. A peer that is this rank
    (one rank, several rows) is a local copy. `key`: what every rank must call this with alike;
    with more than one rank, every rank agrees on it and on the bytes first (`agree_sizes`)."""
    size = pg.size()
    bufs = [b for b in (send_next, send_prev, recv_prev, recv_next) if b is not None]
    if size > 1 and all(b.device.type == "cpu" for b in bufs):
        send, recv = [0] * size, [0] * size
        for buf, peer, into in ((send_next, nxt, send), (send_prev, prev, send), (recv_prev, prev, recv),
                                (recv_next, nxt, recv)):  # fmt: skip
            if buf is not None and peer is not None and peer != rank:
                into[peer] += buf.numel() * buf.element_size()
        agree_sizes(op_name, pg, (op_name, *key), send, recv)
    ops = []
    sent = 0
    for buf, peer, is_send in (
        (send_next, nxt, True),
        (recv_prev, prev, False),
        (send_prev, prev, True),
        (recv_next, nxt, False),
    ):
        if buf is None or peer is None or buf.numel() == 0:
            continue
        if peer == rank:
            continue  # handled below
        global_peer = dist.get_global_rank(pg, peer)
        if is_send:
            sent += buf.numel() * buf.element_size()
            ops.append(dist.P2POp(dist.isend, buf, global_peer, pg))
        else:
            ops.append(dist.P2POp(dist.irecv, buf, global_peer, pg))
    if nxt == rank and send_next is not None and recv_prev is not None:
        recv_prev.copy_(send_next)
    if prev == rank and send_prev is not None and recv_next is not None:
        recv_next.copy_(send_prev)
    record_sent(op_name, sent)
    if ops:

        def run() -> None:
            for work in dist.batch_isend_irecv(ops):
                work.wait()

        run_collective(op_name, pg, run)


def _shift_rows(x: Tensor, down: bool) -> Tensor:
    """Rows moved one place down (row b gets row b-1, row 0 zeros) or up."""
    zero = torch.zeros_like(x[:1])
    return torch.cat([zero, x[:-1]]) if down else torch.cat([x[1:], zero])


@define(
    "usp::halo_exchange",
    schema="(Tensor x, int dim, int before, int after, SymInt max_seqlen, str group_name) -> Tensor",
)
def halo_exchange(x: Tensor, dim: int, before: int, after: int, max_seqlen: int, group_name: str) -> Tensor:
    """x with `before` tokens of the preceding chunk and `after` of the following one attached."""
    d = _check(x, dim, before, after)
    if max_seqlen > max(before, after) + 1:
        raise ValueError(
            f"a document of up to {max_seqlen} tokens is longer than this halo allows "
            f"({max(before, after) + 1} tokens: the ContextParallel's max_document_len); raise "
            "max_document_len (more bytes per step) or use the ring / allgather_kv strategy"
        )
    pg = resolve_group(group_name)
    size, rank = pg.size(), pg.rank()
    x_m = x.movedim(d, 1)
    rows, n = x_m.shape[0], x_m.shape[1]
    _check_widths(n, before, after)
    prev, nxt = _peers(rank, size, rows)
    recv_b = x_m.new_zeros((rows, before, *x_m.shape[2:]))
    recv_a = x_m.new_zeros((rows, after, *x_m.shape[2:]))
    tail = x_m[:, n - before :].contiguous() if before else None
    head = x_m[:, :after].contiguous() if after else None
    _swap(
        pg, rank, tail if nxt is not None else None, head if prev is not None else None,
        recv_b if prev is not None and before else None, recv_a if nxt is not None and after else None,
        prev, nxt, "usp::halo_exchange", (str(x.dtype), x.dim(), d, before, after, rows, tuple(x_m.shape[2:])),
    )  # fmt: skip
    if rows > 1 and rank == 0 and before:  # rank P-1's tail of row b precedes row b+1 here
        recv_b = _shift_rows(recv_b, down=True)
    if rows > 1 and rank == size - 1 and after:  # rank 0's head of row b+1 follows row b here
        recv_a = _shift_rows(recv_a, down=False)
    return torch.cat([recv_b, x_m, recv_a], 1).movedim(1, d).contiguous()


@halo_exchange.register_fake
def _(x, dim, before, after, max_seqlen, group_name):
    d = _check(x, dim, before, after)
    shape = list(x.shape)
    shape[d] = shape[d] + before + after
    return x.new_empty(shape)


@define(
    "usp::halo_reduce",
    schema="(Tensor dy, int dim, int before, int after, str group_name) -> Tensor",
)
def halo_reduce(dy: Tensor, dim: int, before: int, after: int, group_name: str) -> Tensor:
    """Adjoint of `halo_exchange`: halo gradients go home and are added to their tokens."""
    d = _check(dy, dim, before, after)
    pg = resolve_group(group_name)
    size, rank = pg.size(), pg.rank()
    dy_m = dy.movedim(d, 1)
    rows, n = dy_m.shape[0], dy_m.shape[1] - before - after
    if n < 0:
        raise ValueError(
            f"dy has {dy_m.shape[1]} tokens along dim={d}, fewer than the halos ({before} + {after})"
        )
    _check_widths(n, before, after)
    prev, nxt = _peers(rank, size, rows)
    g_b = dy_m[:, :before]  # gradients of the previous chunk's tail
    g_a = dy_m[:, before + n :]  # gradients of the following chunk's head
    if rows > 1 and rank == 0 and before:  # row b's halo came from row b-1 of rank P-1
        g_b = _shift_rows(g_b, down=False)
    if rows > 1 and rank == size - 1 and after:
        g_a = _shift_rows(g_a, down=True)
    out = dy_m[:, before : before + n].clone()
    recv_tail = out.new_zeros((rows, before, *out.shape[2:])) if before and nxt is not None else None
    recv_head = out.new_zeros((rows, after, *out.shape[2:])) if after and prev is not None else None
    _swap(
        pg, rank, g_a.contiguous() if after and nxt is not None else None,
        g_b.contiguous() if before and prev is not None else None,
        recv_head, recv_tail, prev, nxt, "usp::halo_reduce",
        (str(dy.dtype), dy.dim(), d, before, after, rows, tuple(dy_m.shape[2:])),
    )  # fmt: skip
    if recv_tail is not None:
        out[:, n - before :] += recv_tail
    if recv_head is not None:
        out[:, :after] += recv_head
    return out.movedim(1, d).contiguous()


@halo_reduce.register_fake
def _(dy, dim, before, after, group_name):
    d = _check(dy, dim, before, after)
    shape = list(dy.shape)
    shape[d] = shape[d] - before - after
    return dy.new_empty(shape)


def _exchange_setup(ctx, inputs, output):
    _, dim, before, after, _, group_name = inputs
    ctx.args = (dim, before, after, group_name)


def _exchange_backward(ctx, grad):
    return torch.ops.usp.halo_reduce(grad, *ctx.args), None, None, None, None, None


def _reduce_setup(ctx, inputs, output):
    _, dim, before, after, group_name = inputs
    ctx.args = (dim, before, after, group_name)


def _reduce_backward(ctx, grad):
    dim, before, after, group_name = ctx.args
    # max_seqlen 0: the gradient's exchange attends nothing, so it has no document to check.
    return torch.ops.usp.halo_exchange(grad, dim, before, after, 0, group_name), None, None, None, None


# The rules themselves (backward ops, adjoints) are rows of usp_graph.registry.TABLE.
registry.implement(halo_exchange, setup_context=_exchange_setup, backward=_exchange_backward)
registry.implement(halo_reduce, setup_context=_reduce_setup, backward=_reduce_backward)
