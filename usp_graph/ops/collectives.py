"""Context-parallel collectives: the ``usp::all_to_all``, ``usp::all_gather``, ``usp::reduce_scatter`` ops.

# P ranks in the group, r this rank, B batch, H heads, L sequence, K head dim

Each op takes its process group as a name (`usp_graph.distributed.group_name`), so a graph holding
it can be serialized and replayed. Every op is linear and its backward rule is its adjoint *op*, so a
traced joint graph shows the adjoint collective as a node:

    all_to_all(x, sd, gd, ss, gs)   --backward-->  all_to_all(dy, gd, sd, gs, ss)
    all_gather(x, dim)              --backward-->  reduce_scatter(dy, dim)
    reduce_scatter(x, dim)          --backward-->  all_gather(dy, dim)

Semantics (rank r of P):
- all_to_all: split x along scatter_dim into P pieces of ``scatter_sizes`` (piece j goes to rank j),
  receive one piece from every rank j and concatenate them along gather_dim in rank order. The
  piece from rank j is ``gather_sizes[j]`` long along gather_dim and, when scatter_dim != gather_dim,
  ``scatter_sizes[r]`` long along scatter_dim; so with distinct dims every rank passes the same
  (global) ``scatter_sizes`` and ``gather_sizes[r] == x.shape[gather_dim]``, while with equal dims
  ``gather_sizes[j]`` is what rank j's ``scatter_sizes[r]`` says. The Ulysses pattern is
  ``x_BHlK -> x_BhLK`` (scatter heads, gather sequence) and back with the dims and sizes swapped.
- all_gather: concatenate every rank's x (same shape everywhere) along dim in rank order.
- reduce_scatter: sum x over ranks and keep this rank's chunk (x.shape[dim] / P) along dim.

Determinism: all_to_all and all_gather only move data. reduce_scatter receives every rank's chunk
(an all_to_all) and adds them in rank order 0..P-1 on each rank, so its bits do not depend on the
backend's reduction order (gloo's reduce_scatter/all_reduce pick their own).

Issue + wait (`usp_graph.passes.overlap` lowers each op to these after autograd, so independent
compute can run while the data travels):

    all_to_all(x, ...)        ==  wait(all_to_all_start(x, ...), gather_dim, False)
    all_gather(x, dim, ...)   ==  wait(all_gather_start(x, dim, ...), dim, False)
    reduce_scatter(x, dim, ...) == wait(reduce_scatter_start(x, dim, ...), dim, True)

A ``*_start`` op launches the collective asynchronously and returns the receive buffer (rows of
the gathered dim first; for reduce_scatter one block per source rank); ``usp::wait`` waits for it
and lays the result out as the synchronous op does (the same bits: the same data moves, the same
rank-order sum). The ``*_start`` ops copy their input when the send buffer would alias it, so a
compiler that reuses the input's memory after its last use cannot change what is sent. The
registry lists them as the async forms of their collective's row (`usp_graph.registry`).

Implementation: ``torch.distributed.all_to_all_single`` / ``all_gather_into_tensor`` on flat,
contiguous buffers (both work on gloo and NCCL, even and uneven); each piece is sent laid out with
gather_dim first, so the received buffer is already the concatenation along gather_dim. Outputs are
contiguous (the fake impls promise that layout). A backend failure (a peer raised, exited, or did
not arrive within the group's timeout) becomes `usp_graph.distributed.CollectiveError`.

Sizes (issue 31): on CPU tensors every op first runs `usp_graph.distributed.agree_sizes` (one small
all-gather), so ranks that disagree on what they send and receive get a `CollectiveError` on every
rank before any payload moves (gloo would abort the process, or leave part of a receive buffer
unwritten). Receive buffers are then written whole; device tensors skip the agreement (it would add
a host sync per collective) and get zero-filled receive buffers instead, so a short send there
leaves zeros, never the allocator's old bytes.

Pending work: an issued collective is recorded until its wait. `pending_count` says how many are in
flight and `drain_pending` finishes (waits for) and forgets them: a graph replay that fails between
an issue and its wait drains what it issued, and the process drains everything at exit, so no
collective is still running while the interpreter and the process groups are torn down.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor

from .. import registry
from ..distributed import (
    CollectiveError,
    agree_sizes,
    all_gather_into,
    ordered_sum,
    record_sent,
    resolve_group,
    run_collective,
)
from ..distributed import group_name as _group_name
from ..dynamo_marks import assume_constant_result
from .define import define

__all__ = [
    "all_gather",
    "all_gather_start_op",
    "drain_pending",
    "pending_count",
    "all_to_all_start_op",
    "reduce_scatter_start_op",
    "wait_op",
    "wait_args",
    "all_gather_op",
    "all_to_all",
    "all_to_all_op",
    "reduce_scatter",
    "reduce_scatter_op",
]

IntLike = int | torch.SymInt


# ------------------------------------------------------------------------------------------------
# Argument checks, shared by the public wrappers and the real kernels (an op called directly is
# checked too). They run before any communication, so a bad argument never reaches the backend.


def _norm_dim(name: str, dim: object, ndim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int):
        raise TypeError(f"{name} must be an int, got {type(dim).__name__}")
    if not -ndim <= dim < ndim:
        valid = f"{-ndim}..{ndim - 1}" if ndim else "none: x is 0-dimensional"
        raise ValueError(f"{name}={dim} is out of range for x with {ndim} dims (valid: {valid})")
    return dim % ndim


def _check_sizes(name: str, sizes: object, world: int) -> list[IntLike]:
    if isinstance(sizes, (Tensor, str)) or not isinstance(sizes, Sequence):
        raise TypeError(f"{name} must be a list of ints (one per rank), got {type(sizes).__name__}")
    sizes = list(sizes)
    if len(sizes) != world:
        raise ValueError(
            f"{name} has {len(sizes)} entries but the group has {world} ranks; give one per rank"
        )
    for i, s in enumerate(sizes):
        if isinstance(s, bool) or not isinstance(s, (int, torch.SymInt)):
            raise TypeError(f"{name}[{i}] must be an int, got {type(s).__name__}")
        if isinstance(s, int) and s < 0:
            raise ValueError(f"{name}[{i}] must be >= 0, got {s}")
    return sizes


def _check_eq(lhs: IntLike, rhs: IntLike, message: str) -> None:
    if isinstance(lhs, int) and isinstance(rhs, int):
        if lhs != rhs:
            raise ValueError(message)
    else:  # symbolic sizes while tracing: a guard/runtime assert instead of a Python bool
        torch._check(lhs == rhs, lambda: message)


def _check_tensor(x: object) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")


def _check_group_size(group_size: object, pg: dist.ProcessGroup) -> None:
    if isinstance(group_size, bool) or not isinstance(group_size, int):
        raise TypeError(f"group_size must be an int, got {type(group_size).__name__}")
    if group_size != pg.size():
        raise ValueError(f"group_size={group_size} but process group {pg.group_name!r} has {pg.size()} ranks")


def _check_all_to_all(
    x: Tensor,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[IntLike],
    gather_sizes: Sequence[IntLike],
    world: int,
    rank: int,
) -> tuple[int, int, list[IntLike], list[IntLike]]:
    _check_tensor(x)
    sd = _norm_dim("scatter_dim", scatter_dim, x.dim())
    gd = _norm_dim("gather_dim", gather_dim, x.dim())
    ss = _check_sizes("scatter_sizes", scatter_sizes, world)
    gs = _check_sizes("gather_sizes", gather_sizes, world)
    _check_eq(
        sum(ss),
        x.shape[sd],
        f"scatter_sizes {ss} sum to {sum(ss)} but x has {x.shape[sd]} along scatter_dim={sd} "
        f"(x shape {tuple(x.shape)})",
    )
    if sd != gd:
        _check_eq(
            gs[rank],
            x.shape[gd],
            f"gather_sizes[{rank}] (this rank's own piece) is {gs[rank]} but x has {x.shape[gd]} along "
            f"gather_dim={gd} (x shape {tuple(x.shape)}); gather_sizes lists every rank's length along gather_dim",
        )
    return sd, gd, ss, gs


def _all_to_all_shape(
    shape: Sequence[IntLike], sd: int, gd: int, ss: Sequence[IntLike], gs: Sequence[IntLike], group_name: str
) -> list[IntLike]:
    # Here, not at import: symbolic_shapes brings sympy, which only a trace (already holding it) needs.
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    out = list(shape)
    if sd != gd:
        if all(statically_known_true(s == ss[0]) for s in ss):
            out[sd] = ss[0]  # even split: no need to know the rank (fake tracing without a group works)
        else:
            out[sd] = ss[resolve_group(group_name).rank()]
    out[gd] = sum(gs)
    return out


# ------------------------------------------------------------------------------------------------
# Launch and finish, shared by the synchronous ops and their issue/wait forms: the same buffers,
# the same collective call, the same layout of the result, so both give the same bits.

# Collectives in flight: receive buffer's storage -> (work, op name, group, receive, send buffer).
# A ``*_start`` op adds its entry, ``usp::wait`` pops it; the send buffer is kept alive until then.
_PENDING: dict[int, tuple[Any, str, dist.ProcessGroup, Tensor, Tensor]] = {}


def _storage(t: Tensor) -> int:
    return t.untyped_storage()._cdata


def _own(send: Tensor, x: Tensor) -> Tensor:
    """`send`, copied when it shares memory with the op's input `x` (an issued collective reads it
    after the op returned, when a compiler may already have reused x's memory)."""
    return send.clone() if send.numel() and _storage(send) == _storage(x) else send


def pending_count() -> int:
    """How many issued collectives (``usp::*_start``) are in flight, not yet finished by a wait."""
    return len(_PENDING)


def pending_keys() -> frozenset[int]:
    """The in-flight collectives now, to `drain_pending` only those issued after this point."""
    return frozenset(_PENDING)


def drain_pending(keep: frozenset[int] = frozenset()) -> list[CollectiveError]:
    """Wait for every in-flight issued collective not in `keep` and forget it; returns the errors
    the waits raised (a failed collective is forgotten too). Waiting, not just dropping: the
    peers posted the same collective, so it completes, and its buffers are no longer written once
    this returns. A peer that is gone costs at most the group's timeout."""
    errors = []
    for key in [k for k in _PENDING if k not in keep]:
        work, op_name, pg = _PENDING.pop(key)[:3]
        try:
            run_collective(op_name, pg, work.wait)
        except CollectiveError as e:
            errors.append(e)
    return errors


def _drain_at_exit() -> None:
    """Called by `usp_graph.distributed`'s exit handler before it destroys the process groups: an
    issued collective must not still be running while its group and the interpreter go away."""
    try:
        drain_pending()
    except Exception:  # noqa: BLE001 - at exit, nothing is left to report to
        _PENDING.clear()


def _agree(op_name: str, pg: dist.ProcessGroup, x: Tensor, key: tuple[Any, ...], send: Sequence[int],
           recv: Sequence[int]) -> bool:  # fmt: skip
    """`agree_sizes` on element counts `send`/`recv` of x's dtype, for CPU tensors; whether it ran
    (a receive buffer that was agreed on is written whole; one that was not is zero-filled)."""
    if x.device.type != "cpu":
        return False
    item = x.element_size()
    agree_sizes(
        op_name, pg, (op_name, str(x.dtype), *key), [n * item for n in send], [n * item for n in recv]
    )
    return True


def _recv_buffer(like: Tensor, shape: Sequence[int], agreed: bool) -> Tensor:
    return like.new_empty(shape) if agreed else like.new_zeros(shape)


def _launch(op_name: str, pg: dist.ProcessGroup, recv: Tensor, send: Tensor, call: Callable[[bool], Any],
            issue: bool) -> Tensor:  # fmt: skip
    """Run ``call(async_op)``: blocking, or (issue) started and recorded for `wait_op`."""
    work = run_collective(op_name, pg, lambda: call(issue))
    if issue:
        _PENDING[_storage(recv)] = (work, op_name, pg, recv, send)
    return recv


def _a2a_launch(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name, issue):
    """Start (issue) or run the all-to-all; returns the receive buffer, (sum(gather_sizes), *rest):
    the pieces concatenated along gather_dim, laid out with gather_dim first."""
    pg = resolve_group(group_name)
    rank = pg.rank()
    sd, gd, ss, gs = _check_all_to_all(
        x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, pg.size(), rank
    )
    out_shape = _all_to_all_shape(x.shape, sd, gd, ss, gs, group_name)
    if sd == gd:  # pieces are consecutive rows once the dim is in front
        send = x.movedim(gd, 0).contiguous().view(-1)
        row_in = math.prod(x.shape[d] for d in range(x.dim()) if d != gd)
        send_splits = [s * row_in for s in ss]
    else:  # each piece laid out gather_dim first, so the receiver's buffer is the concatenation
        pieces = x.split(ss, dim=sd)
        send = torch.cat([p.movedim(gd, 0).reshape(-1) for p in pieces])
        send_splits = [p.numel() for p in pieces]
    if issue:
        send = _own(send, x)
    rest = [out_shape[d] for d in range(x.dim()) if d != gd]
    row = math.prod(rest)
    recv_splits = [g * row for g in gs]
    # Every rank must share the dims other than the two exchanged ones; the sizes along those two
    # are what the per-rank byte counts check.
    shared = tuple(x.shape[d] for d in range(x.dim()) if d not in (sd, gd))
    agreed = _agree("usp::all_to_all", pg, x, (x.dim(), sd, gd, shared), send_splits, recv_splits)
    recv = _recv_buffer(x, (sum(gs) * row,), agreed)
    record_sent("usp::all_to_all", (sum(send_splits) - send_splits[rank]) * x.element_size())
    _launch(
        "usp::all_to_all",
        pg,
        recv,
        send,
        lambda a: dist.all_to_all_single(recv, send, recv_splits, send_splits, group=pg, async_op=a),
        issue,
    )
    return recv.view(sum(gs), *rest)


def _gather_launch(x, dim, group_size, group_name, issue):
    """Start or run the all-gather; returns (group_size * x.shape[dim], *rest): dim first."""
    pg = resolve_group(group_name)
    _check_tensor(x)
    d = _norm_dim("dim", dim, x.dim())
    _check_group_size(group_size, pg)
    x_m = x.movedim(d, 0).contiguous()
    if issue:
        x_m = _own(x_m, x)
    n = x.numel()
    agreed = _agree("usp::all_gather", pg, x, (d, tuple(x.shape)), [n] * group_size, [n] * group_size)
    out = _recv_buffer(x_m, (group_size * x_m.shape[0], *x_m.shape[1:]), agreed)
    if x.numel():  # every rank has the same shape (agreed above), so all skip together
        record_sent("usp::all_gather", x.numel() * x.element_size() * (group_size - 1))
        _launch("usp::all_gather", pg, out, x_m, lambda a: all_gather_into(out, x_m, pg, async_op=a), issue)
    return out


def _scatter_launch(x, dim, group_size, group_name, issue):
    """Start or run the reduce-scatter's exchange; returns (group_size, n, *rest): block j came
    from rank j (n = x.shape[dim] / group_size)."""
    pg = resolve_group(group_name)
    _check_tensor(x)
    d = _norm_dim("dim", dim, x.dim())
    _check_group_size(group_size, pg)
    if x.shape[d] % group_size:
        raise ValueError(
            f"x has {x.shape[d]} along dim={d}, not divisible by the group's {group_size} ranks "
            f"(x shape {tuple(x.shape)})"
        )
    x_m = x.movedim(d, 0).contiguous()  # chunk j (rows j*n:(j+1)*n) goes to rank j
    if issue:
        x_m = _own(x_m, x)
    n = x.numel() // group_size
    agreed = _agree("usp::reduce_scatter", pg, x, (d, tuple(x.shape)), [n] * group_size, [n] * group_size)
    recv = _recv_buffer(x_m, x_m.shape, agreed)
    if x.numel():
        record_sent("usp::reduce_scatter", x.numel() * x.element_size() * (group_size - 1) // group_size)
        _launch(
            "usp::reduce_scatter", pg, recv, x_m,
            lambda a: dist.all_to_all_single(recv, x_m, group=pg, async_op=a), issue,
        )  # fmt: skip
    return recv.view(group_size, x_m.shape[0] // group_size, *x_m.shape[1:])


def _finish(recv: Tensor, dim: int, reduce: bool) -> Tensor:
    """The collective's result from its receive buffer: the blocks summed in rank order (reduce),
    then the leading dim moved to `dim`; contiguous, and never `recv` itself."""
    x = ordered_sum(recv.unbind(0)) if reduce else recv
    out = x.movedim(0, dim).contiguous()
    return out.clone() if _storage(out) == _storage(recv) else out


def _moved_shape(shape: Sequence[IntLike], dim: int) -> list[IntLike]:
    out = list(shape)
    first = out.pop(0)
    out.insert(dim, first)
    return out


# ------------------------------------------------------------------------------------------------
# The ops.


@define(
    "usp::all_to_all",
    schema="(Tensor x, int scatter_dim, int gather_dim, SymInt[] scatter_sizes, SymInt[] gather_sizes, "
    "str group_name) -> Tensor",
)
def all_to_all_op(
    x: Tensor,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[int],
    gather_sizes: Sequence[int],
    group_name: str,
) -> Tensor:
    """All-to-all along (scatter_dim, gather_dim) with per-rank sizes. See the module docstring."""
    recv = _a2a_launch(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name, False)
    return _finish(recv, gather_dim % x.dim(), False)


@all_to_all_op.register_fake
def _(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name):
    sd = _norm_dim("scatter_dim", scatter_dim, x.dim())
    gd = _norm_dim("gather_dim", gather_dim, x.dim())
    return x.new_empty(_all_to_all_shape(x.shape, sd, gd, scatter_sizes, gather_sizes, group_name))


@define(
    "usp::all_gather",
    schema="(Tensor x, int dim, int group_size, str group_name) -> Tensor",
)
def all_gather_op(x: Tensor, dim: int, group_size: int, group_name: str) -> Tensor:
    """Concatenate every rank's x along dim in rank order."""
    out = _gather_launch(x, dim, group_size, group_name, False)
    return _finish(out, dim % x.dim(), False)


@all_gather_op.register_fake
def _(x, dim, group_size, group_name):
    d = _norm_dim("dim", dim, x.dim())
    shape = list(x.shape)
    shape[d] = shape[d] * group_size
    return x.new_empty(shape)


@define(
    "usp::reduce_scatter",
    schema="(Tensor x, int dim, int group_size, str group_name) -> Tensor",
)
def reduce_scatter_op(x: Tensor, dim: int, group_size: int, group_name: str) -> Tensor:
    """Sum x over ranks (in rank order) and keep this rank's chunk along dim."""
    recv = _scatter_launch(x, dim, group_size, group_name, False)
    return _finish(recv, dim % x.dim(), True)


@reduce_scatter_op.register_fake
def _(x, dim, group_size, group_name):
    d = _norm_dim("dim", dim, x.dim())
    shape = list(x.shape)
    shape[d] = shape[d] // group_size
    return x.new_empty(shape)


# ------------------------------------------------------------------------------------------------
# Issue + wait forms (graphs get them from `usp_graph.passes.overlap`, after autograd).


@define(
    "usp::all_to_all_start",
    schema="(Tensor x, int scatter_dim, int gather_dim, SymInt[] scatter_sizes, SymInt[] gather_sizes, "
    "str group_name) -> Tensor",
)
def all_to_all_start_op(
    x: Tensor,
    scatter_dim: int,
    gather_dim: int,
    scatter_sizes: Sequence[int],
    gather_sizes: Sequence[int],
    group_name: str,
) -> Tensor:
    """Start `all_to_all_op`; ``usp::wait(recv, gather_dim, False)`` gives its result."""
    return _a2a_launch(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name, True)


@all_to_all_start_op.register_fake
def _(x, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name):
    sd = _norm_dim("scatter_dim", scatter_dim, x.dim())
    gd = _norm_dim("gather_dim", gather_dim, x.dim())
    shape = _all_to_all_shape(x.shape, sd, gd, scatter_sizes, gather_sizes, group_name)
    return x.new_empty([shape[gd]] + [s for d, s in enumerate(shape) if d != gd])


@define(
    "usp::all_gather_start",
    schema="(Tensor x, int dim, int group_size, str group_name) -> Tensor",
)
def all_gather_start_op(x: Tensor, dim: int, group_size: int, group_name: str) -> Tensor:
    """Start `all_gather_op`; ``usp::wait(recv, dim, False)`` gives its result."""
    return _gather_launch(x, dim, group_size, group_name, True)


@all_gather_start_op.register_fake
def _(x, dim, group_size, group_name):
    d = _norm_dim("dim", dim, x.dim())
    return x.new_empty([x.shape[d] * group_size] + [s for i, s in enumerate(x.shape) if i != d])


@define(
    "usp::reduce_scatter_start",
    schema="(Tensor x, int dim, int group_size, str group_name) -> Tensor",
)
def reduce_scatter_start_op(x: Tensor, dim: int, group_size: int, group_name: str) -> Tensor:
    """Start `reduce_scatter_op`; ``usp::wait(recv, dim, True)`` gives its result."""
    return _scatter_launch(x, dim, group_size, group_name, True)


@reduce_scatter_start_op.register_fake
def _(x, dim, group_size, group_name):
    d = _norm_dim("dim", dim, x.dim())
    return x.new_empty([group_size, x.shape[d] // group_size] + [s for i, s in enumerate(x.shape) if i != d])


@define("usp::wait", schema="(Tensor recv, int dim, bool reduce) -> Tensor")
def wait_op(recv: Tensor, dim: int, reduce: bool) -> Tensor:
    """Wait for the collective a ``*_start`` op issued into `recv` and return its result: the
    blocks of `recv` summed in rank order (`reduce`, reduce_scatter), the leading dim moved to `dim`."""
    _check_tensor(recv)
    if not isinstance(reduce, bool):
        raise TypeError(f"reduce must be a bool, got {type(reduce).__name__}")
    if recv.dim() < (2 if reduce else 1):
        raise ValueError(f"recv of shape {tuple(recv.shape)} is not a collective's receive buffer")
    d = _norm_dim("dim", dim, recv.dim() - reduce)
    entry = _PENDING.pop(_storage(recv), None)
    if entry is not None:
        work, op_name, pg = entry[:3]
        run_collective(op_name, pg, work.wait)
    return _finish(recv, d, reduce)


@wait_op.register_fake
def _(recv, dim, reduce):
    shape = list(recv.shape[1:] if reduce else recv.shape)
    return recv.new_empty(_moved_shape(shape, _norm_dim("dim", dim, len(shape))))


def wait_args(op: Any, args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[int, bool]:
    """(dim, reduce): the `wait_op` arguments that finish collective `op` called with `args`."""
    bound = {**dict(zip(_ARG_NAMES[op], args, strict=False)), **kwargs}
    if op is torch.ops.usp.all_to_all.default:
        return bound["gather_dim"], False
    return bound["dim"], op is torch.ops.usp.reduce_scatter.default


_ARG_NAMES = {
    torch.ops.usp.all_to_all.default: (
        "x",
        "scatter_dim",
        "gather_dim",
        "scatter_sizes",
        "gather_sizes",
        "group_name",
    ),
    torch.ops.usp.all_gather.default: ("x", "dim", "group_size", "group_name"),
    torch.ops.usp.reduce_scatter.default: ("x", "dim", "group_size", "group_name"),
}


# ------------------------------------------------------------------------------------------------
# Backward rules: each is the adjoint op.


def _all_to_all_setup(ctx, inputs, output):
    _, scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name = inputs
    ctx.args = (scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name)


def _all_to_all_backward(ctx, grad):
    scatter_dim, gather_dim, scatter_sizes, gather_sizes, group_name = ctx.args
    dx = torch.ops.usp.all_to_all(grad, gather_dim, scatter_dim, gather_sizes, scatter_sizes, group_name)
    return dx, None, None, None, None, None


def _dim_group_setup(ctx, inputs, output):
    _, dim, group_size, group_name = inputs
    ctx.args = (dim, group_size, group_name)


def _all_gather_backward(ctx, grad):
    return torch.ops.usp.reduce_scatter(grad, *ctx.args), None, None, None


def _reduce_scatter_backward(ctx, grad):
    return torch.ops.usp.all_gather(grad, *ctx.args), None, None, None


# The rules themselves (backward ops, adjoints) are rows of usp_graph.registry.TABLE.
registry.implement(all_to_all_op, setup_context=_all_to_all_setup, backward=_all_to_all_backward)
registry.implement(all_gather_op, setup_context=_dim_group_setup, backward=_all_gather_backward)
registry.implement(reduce_scatter_op, setup_context=_dim_group_setup, backward=_reduce_scatter_backward)
for _op in (all_to_all_start_op, all_gather_start_op, reduce_scatter_start_op, wait_op):
    registry.implement_issue(_op)


# ------------------------------------------------------------------------------------------------
# Public wrappers.


@assume_constant_result
def _group_info(group: dist.ProcessGroup | str | None) -> tuple[str, int, int]:
    """(name, size, this rank's index) of `group`. A constant to Dynamo, so the wrappers trace with
    ``fullgraph=True`` (it cannot trace the group lookup itself)."""
    name = _group_name(group)
    pg = resolve_group(name)
    return name, pg.size(), pg.rank()


def all_to_all(
    x: Tensor,
    scatter_dim: int,
    gather_dim: int,
    *,
    scatter_sizes: Sequence[int] | None = None,
    gather_sizes: Sequence[int] | None = None,
    group: dist.ProcessGroup | str | None = None,
) -> Tensor:
    """Scatter x along `scatter_dim` to the ranks of `group`, gather their pieces along `gather_dim`.

    Ulysses: ``all_to_all(x_BHlK, 1, 2)`` -> x_BhLK (h = H/P, L = P*l), and
    ``all_to_all(x_BhLK, 2, 1)`` back. `scatter_sizes` (one per rank) default to an even split;
    `gather_sizes` default to every rank having x's shape and the same split (with distinct dims:
    ``[x.shape[gather_dim]] * P``; with equal dims: ``[scatter_sizes[r]] * P``). Pass both for
    uneven layouts; the module docstring says how they must agree across ranks. `group`: a
    ProcessGroup, its name, or None for the default group. Differentiable (backward: the same
    all-to-all with dims and sizes swapped).
    """
    _check_tensor(x)
    name, world, rank = _group_info(group)
    sd = _norm_dim("scatter_dim", scatter_dim, x.dim())
    gd = _norm_dim("gather_dim", gather_dim, x.dim())
    if scatter_sizes is None:
        n = x.shape[sd]
        if n % world != 0:
            raise ValueError(
                f"x has {n} along scatter_dim={sd}, not divisible by the group's {world} ranks; pass "
                "scatter_sizes (and gather_sizes) for an uneven split"
            )
        scatter_sizes = [n // world] * world
    ss = _check_sizes("scatter_sizes", scatter_sizes, world)
    if gather_sizes is None:
        gather_sizes = [x.shape[gd]] * world if sd != gd else [ss[rank]] * world
    sd, gd, ss, gs = _check_all_to_all(x, sd, gd, ss, gather_sizes, world, rank)
    return torch.ops.usp.all_to_all(x, sd, gd, ss, gs, name)


def all_gather(x: Tensor, dim: int, *, group: dist.ProcessGroup | str | None = None) -> Tensor:
    """Concatenate every rank's x (same shape on all ranks) along `dim` in rank order.

    Differentiable (backward: reduce_scatter of the gradient, summed over ranks in rank order).
    """
    _check_tensor(x)
    name, world, _ = _group_info(group)
    d = _norm_dim("dim", dim, x.dim())
    return torch.ops.usp.all_gather(x, d, world, name)


def reduce_scatter(x: Tensor, dim: int, *, group: dist.ProcessGroup | str | None = None) -> Tensor:
    """Sum x over the ranks of `group` (in rank order) and return this rank's chunk along `dim`.

    x.shape[dim] must be divisible by the group size. Differentiable (backward: all_gather).
    """
    _check_tensor(x)
    name, world, _ = _group_info(group)
    d = _norm_dim("dim", dim, x.dim())
    n = x.shape[d]
    if isinstance(n, int) and n % world:
        raise ValueError(
            f"x has {n} along dim={d}, not divisible by the group's {world} ranks (x shape {tuple(x.shape)})"
        )
    return torch.ops.usp.reduce_scatter(x, d, world, name)
