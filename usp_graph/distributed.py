"""Process groups by name, collective error reporting, and a deterministic gradient all-reduce.

Ops take their process group as a ``str`` name (a ProcessGroup object cannot be a custom-op argument
or live in a serialized graph); `group_name` turns a group into that name and `resolve_group` turns
it back, with `ValueError`s that say what to do when torch.distributed is not initialized or the
name is unknown.

Faults. A rank whose peer raised, exited or never entered a collective does not hang: gloo gives up
after the process group's timeout and raises, and usp ops re-raise that as `CollectiveError` naming
the op, the group, the rank and the timeout. The timeout is the one the group was created with:
``init_process_group(timeout=...)`` for the default group and ``new_group(timeout=...)`` for a
subgroup. A subgroup does NOT inherit the default group's timeout (torch 2.13 gives it the backend
default, 30 min); pass ``timeout=`` to ``new_group`` too. A peer that exits is usually noticed at
once (gloo sees the closed connection); a peer that is alive but absent costs the full timeout.
After such an error the group is unusable: tear the job down.

Size agreement (issue 31). gloo aborts the whole process (SIGABRT, not a Python error) when a rank
sends more bytes than its peer posted for, and silently leaves the tail of the receive buffer
untouched when it sends fewer. So before any payload moves, every usp collective on CPU tensors
runs `agree_sizes`: one all-gather of a fixed-length int64 header per rank (a digest of what every
rank must share, such as the op, dtype and trailing shape, then the bytes it will send to and
receive from each rank). Its length depends only on the group size, so the header exchange itself
can never disagree; every rank then sees every rank's header and reaches the same verdict, so a
disagreement is a `CollectiveError` on EVERY rank, never a signal, a hang or garbage. The cost is
one small extra round trip per collective (measured: tests/test_collective_faults.py's docstring);
device tensors skip it (reading the verdict back would add a host sync to every step).
"""

from __future__ import annotations

import atexit
import contextlib
import datetime
import gc
import hashlib
import sys
import types
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "CollectiveError",
    "agree_sizes",
    "all_gather_into",
    "gather_ints",
    "all_reduce_sum_ordered",
    "group_name",
    "group_timeout",
    "ordered_sum",
    "resolve_group",
    "run_collective",
]

_T = TypeVar("_T")


class CollectiveError(RuntimeError):
    """A collective failed on this rank (a peer raised, exited, or timed out); the group is unusable."""


def _require_initialized() -> None:
    if not dist.is_available():
        raise ValueError("torch.distributed is not available in this torch build; collectives need it")
    if not dist.is_initialized():
        raise ValueError(
            "torch.distributed is not initialized; call torch.distributed.init_process_group(...) "
            "(e.g. backend='gloo' on CPU) before using a process group"
        )


def _known_group_names() -> list[str]:
    try:
        return sorted(str(n) for n in dist.distributed_c10d._world.pg_names.values())
    except Exception:  # private bookkeeping; only used to improve an error message
        return []


def resolve_group(name: str) -> dist.ProcessGroup:
    """The ProcessGroup registered under `name` (see `group_name`)."""
    if not isinstance(name, str):
        raise TypeError(
            f"group name must be a str (see usp_graph.distributed.group_name), got {type(name).__name__}"
        )
    if not dist.is_available() or not dist.is_initialized():
        _require_initialized()
    try:
        return dist.distributed_c10d._resolve_process_group(name)
    except RuntimeError:
        raise ValueError(
            f"unknown process group name {name!r}; known groups: {_known_group_names()}. Pass "
            "group_name(group) of a live group (a destroyed group's name is no longer registered)"
        ) from None


def group_name(group: dist.ProcessGroup | str | None = None) -> str:
    """The name under which ops find `group` (None: the default world group; a str is checked)."""
    if isinstance(group, str):
        resolve_group(group)
        return group
    _require_initialized()
    if group is None:
        group = dist.group.WORLD
    if not isinstance(group, dist.ProcessGroup):
        raise TypeError(f"group must be a ProcessGroup, a group name or None, got {type(group).__name__}")
    return group.group_name


def _as_group(group: dist.ProcessGroup | str | None) -> dist.ProcessGroup:
    return resolve_group(group_name(group))


def group_timeout(group: dist.ProcessGroup | str | None = None) -> datetime.timedelta | None:
    """The timeout after which `group`'s collectives give up (None where it cannot be read)."""
    pg = _as_group(group)
    try:
        return pg._get_backend(torch.device("cpu")).options._timeout
    except Exception:  # private accessor; gloo has it, other backends may not
        return None


def run_collective(op_name: str, pg: dist.ProcessGroup, call: Callable[[], _T]) -> _T:
    """Run `call` (a blocking torch.distributed collective on `pg`), turning a backend failure into a
    `CollectiveError` that says which op, group and rank failed and which timeout applied."""
    try:
        return call()
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        timeout = group_timeout(pg)
        raise CollectiveError(
            f"{op_name} on process group {pg.group_name!r} failed on rank {pg.rank()} of {pg.size()}: "
            f"{e}\nA peer rank raised, exited, passed mismatched sizes, or did not enter this collective "
            f"within the group's timeout ({timeout}). The timeout is the one the group was created "
            "with: init_process_group(timeout=...) for the default group, new_group(timeout=...) for a "
            "subgroup (subgroups do not inherit it). Check the other ranks' errors; this group is now "
            "unusable."
        ) from e


# "usp_size" in ASCII: a peer whose header lacks it is running some other collective here.
_MAGIC = int.from_bytes(b"usp_size", "big") & ((1 << 63) - 1)


def _digest(key: tuple[Any, ...]) -> int:
    """A process-independent 63-bit digest of `key` (Python's str hashes are salted per process)."""
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big") >> 1


def _verdict(rows: list[list[int]], world: int) -> str | None:
    """What is wrong with the ranks' headers (the same text on every rank), or None."""
    for j, row in enumerate(rows):
        if row[0] != _MAGIC:
            return (
                f"rank {j} entered a different collective at this point (its data is not a usp size "
                "header): the ranks called collectives in different orders"
            )
    wrong = []
    for src in range(world):
        for dst in range(world):
            sent, expected = rows[src][2 + dst], rows[dst][2 + world + src]
            if sent != expected:
                wrong.append(f"rank {src} sends {sent} bytes to rank {dst}, which expects {expected}")
    if wrong:
        more = f" (and {len(wrong) - 4} more)" if len(wrong) > 4 else ""
        return "; ".join(wrong[:4]) + more
    differ = [j for j, row in enumerate(rows) if row[1] != rows[0][1]]
    if differ:
        return (
            f"rank(s) {differ} called this collective with a different op, dtype, dims or shape than "
            "rank 0 (everything but the per-rank sizes must match)"
        )
    return None


def agree_sizes(
    op_name: str,
    pg: dist.ProcessGroup,
    key: tuple[Any, ...],
    send_bytes: Sequence[int],
    recv_bytes: Sequence[int],
) -> None:
    """Check, before any payload moves, that every rank of `pg` calls the same collective (`key`:
    what must be equal on every rank, e.g. op, dtype, dims and trailing shape) and that what each
    rank sends to each other rank is exactly what that rank will receive from it.

    send_bytes[j] / recv_bytes[j]: bytes this rank sends to / receives from group rank j. One
    all-gather of ``2 + 2 * P`` int64 per rank (a length every rank agrees on whatever it was
    called with). Raises `CollectiveError` on every rank, with the same reason, on a disagreement;
    a peer that is gone or never arrives fails it as any collective does (`run_collective`)."""
    world = pg.size()
    if len(send_bytes) != world or len(recv_bytes) != world:  # internal: callers build one per rank
        raise AssertionError(f"{op_name}: {len(send_bytes)}/{len(recv_bytes)} sizes for {world} ranks")
    header = [_MAGIC, _digest(key), *map(int, send_bytes), *map(int, recv_bytes)]
    if world == 1:
        rows = [header]
    else:
        mine = torch.tensor(header, dtype=torch.int64)
        gathered = mine.new_empty(world * mine.numel())  # every byte is written: same length everywhere
        run_collective(f"{op_name} (size agreement)", pg, lambda: all_gather_into(gathered, mine, pg))
        rows = gathered.view(world, -1).tolist()
    problem = _verdict(rows, world)
    if problem is not None:
        raise CollectiveError(
            f"{op_name} on process group {pg.group_name!r}: the ranks disagree on the sizes of this "
            f"collective, so nothing was sent (every rank raises this): {problem}. This rank "
            f"(rank {pg.rank()} of {world}) called it with {_describe(key)}, sending "
            f"{list(send_bytes)} and receiving {list(recv_bytes)} bytes per rank."
        )


def _describe(key: tuple[Any, ...]) -> str:
    text = repr(key)
    return text if len(text) <= 300 else text[:300] + "...)"


# "usp_ints": the header of `gather_ints`, as long as a size header so that either can meet the other.
_MAGIC_INTS = int.from_bytes(b"usp_ints", "big") & ((1 << 63) - 1)


def gather_ints(op_name: str, pg: dist.ProcessGroup, values: Sequence[int]) -> list[list[int]]:
    """Every rank's `values` (at most 2 x group size of them, as many on every rank), rank-ordered.

    For checks that ranks agree before anything sized by those values moves. The exchange has the
    length of `agree_sizes`'s header whatever the values, so a rank that is elsewhere (in another
    check, or in a collective's size agreement) meets it without a size mismatch, and every rank
    raises `CollectiveError` instead; a peer that raised, exited or never came is one too."""
    world = pg.size()
    if world == 1:
        return [list(map(int, values))]
    if len(values) > 2 * world:  # internal: the callers send one or two values
        raise AssertionError(f"{op_name}: {len(values)} values do not fit a header of {world} ranks")
    header = [_MAGIC_INTS, _digest((op_name,)), *map(int, values)]
    header += [0] * (2 + 2 * world - len(header))
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else None
    mine = torch.tensor(header, dtype=torch.int64, device=device)
    gathered = mine.new_empty(world * mine.numel())
    run_collective(op_name, pg, lambda: all_gather_into(gathered, mine, pg))
    rows = gathered.view(world, -1).tolist()
    elsewhere = [j for j, row in enumerate(rows) if row[0] != _MAGIC_INTS or row[1] != header[1]]
    if elsewhere:
        raise CollectiveError(
            f"{op_name} on process group {pg.group_name!r}: rank(s) {elsewhere} entered another collective "
            "at this point: the ranks called collectives in different orders (every rank raises this)"
        )
    return [row[2 : 2 + len(values)] for row in rows]


def all_gather_into(output: Tensor, input: Tensor, group: dist.ProcessGroup, async_op: bool = False) -> Any:
    """All-gather of `input` into `output` (rank-ordered concatenation along dim 0); blocking, or
    started (`async_op`: returns the work to wait on).

    ``all_gather_single`` where this torch has it (``all_gather_into_tensor`` now warns that it is
    deprecated), ``all_gather_into_tensor`` on older releases (torch 2.11 has no ``all_gather_single``).
    """
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(output, input, group=group, async_op=async_op)


def ordered_sum(parts: Sequence[Tensor]) -> Tensor:
    """((parts[0] + parts[1]) + parts[2]) + ...: a fixed left fold, so the bits depend only on the
    values and their order (a tree or backend-chosen reduction order would not be reproducible)."""
    acc = parts[0].clone()
    for p in parts[1:]:
        acc.add_(p)
    return acc


@torch.no_grad()
def all_reduce_sum_ordered(
    tensors: Sequence[Tensor], group: dist.ProcessGroup | str | None = None
) -> list[Tensor]:
    """Sum each tensor over the ranks of `group`, adding in rank order 0..P-1; returns new tensors.

    Bitwise reproducible and identical on every rank (gloo's all_reduce picks its own reduction order).
    Tensors are packed into one all_gather per (device, dtype), so it costs P times their memory;
    every rank must pass tensors of the same shapes, dtypes and order. Inputs are not modified.
    """
    if isinstance(tensors, Tensor):
        raise TypeError("tensors must be a sequence of tensors; wrap a single tensor in a list")
    for i, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise TypeError(f"tensors[{i}] must be a Tensor, got {type(t).__name__}")
    pg = _as_group(group)
    world = pg.size()
    buckets: dict[tuple[torch.device, torch.dtype], list[int]] = {}
    for i, t in enumerate(tensors):
        buckets.setdefault((t.device, t.dtype), []).append(i)
    out: list[Any] = [None] * len(tensors)
    for idx in buckets.values():  # insertion order: the same on every rank
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in idx])
        if flat.device.type == "cpu":  # same shapes everywhere, or an error on every rank (not SIGABRT)
            nbytes = flat.numel() * flat.element_size()
            key = ("all_reduce_sum_ordered", str(flat.dtype), tuple(tuple(tensors[i].shape) for i in idx))
            agree_sizes("all_reduce_sum_ordered", pg, key, [nbytes] * world, [nbytes] * world)
        # Written whole once the sizes were agreed; zero-filled where they could not be (device).
        alloc = flat.new_empty if flat.device.type == "cpu" else flat.new_zeros
        gathered_PN = alloc(world * flat.numel())
        run_collective(
            "all_reduce_sum_ordered",
            pg,
            lambda g=gathered_PN, f=flat: all_gather_into(g, f, pg),
        )
        total = ordered_sum(gathered_PN.view(world, -1).unbind(0))
        for i, piece in zip(idx, total.split([tensors[i].numel() for i in idx]), strict=True):
            out[i] = piece.view(tensors[i].shape)
    return out


# ---- a clean exit --------------------------------------------------------------------------------


def _exit_cleanly() -> None:
    """At interpreter exit: finish the issued collectives still in flight, destroy the process
    groups (every subgroup, then the default group: torch's order), drop the references torch's own
    modules bound to them at import (`_release_import_time_defaults`), then free what only reference
    cycles still hold, while the interpreter is whole.

    Why (issue 37): `destroy_process_group` only forgets a group; its C++ object, with gloo's worker
    and TCP loop threads, goes when its last Python reference does. A group still referenced at
    exit outlives the interpreter's own teardown: its destructor never runs, and its threads were
    still running while ``exit()`` destroyed the C++ statics and the peer rank closed its sockets;
    now and then a rank that had trained correctly died there with "terminate called without an
    active exception". What kept it: reference cycles (an autograd graph's saved context, any
    closure), which the interpreter's teardown does not all collect, and defaults that torch
    modules imported after ``init_process_group`` evaluated to the group. Dropping both here
    destroys the group on the main thread, its threads joined, before anything else is torn down.
    usp's own long-lived objects hold no group (`ContextParallel` holds it weakly; `attention_mode`'s
    checkpoint wrappers keep no block's mode once it closed). A group the program itself still
    refers to at exit (a ProcessGroup in a global) stays alive: delete that reference first. gloo
    only: destroying an NCCL group at exit can block on its peers."""
    collectives = sys.modules.get("usp_graph.ops.collectives")
    if collectives is not None:
        collectives._drain_at_exit()
    try:
        if dist.is_available():
            groups = []
            if dist.is_initialized() and dist.get_backend() == "gloo":
                groups = list(dist.distributed_c10d._world.pg_map)
                dist.destroy_process_group()
            # The groups destroyed here, and those the program destroyed itself before exit.
            _release_import_time_defaults(groups + _destroyed_group_defaults())
            del groups
    except Exception:  # noqa: BLE001, S110 - at exit, nothing is left to report to
        pass
    gc.collect()


def _release_import_time_defaults(groups: list[dist.ProcessGroup]) -> None:
    """Set to None the default arguments of torch.distributed's functions that are one of `groups`.

    Some torch modules write ``group=group.WORLD`` as a default (``torch.distributed.nn.functional``,
    the ZeRO optimizer's helpers, the sharded grad scaler): evaluated at import, it is the default
    group itself when the module is imported after ``init_process_group``, and for good. torch
    imports such modules lazily (Dynamo imports ``torch.distributed.nn`` through FSDP, and torch
    imports Dynamo at the first ``torch.utils.checkpoint`` call or ``torch.compile``), so in a
    typical job they hold the default group past ``destroy_process_group``. None is the value
    they have when imported before ``init_process_group`` (the default group, looked up per call).
    A tuple of defaults holds no object the garbage collector tracks, so ``gc.get_referrers``
    does not see this reference."""
    ids = {id(g) for g in groups}

    def released(values):
        return type(values)(None if id(v) in ids else v for v in values)

    for fn in _distributed_functions():
        if fn.__defaults__ and any(id(v) in ids for v in fn.__defaults__):
            fn.__defaults__ = released(fn.__defaults__)
        kw = fn.__kwdefaults__
        if kw and any(id(v) in ids for v in kw.values()):
            fn.__kwdefaults__ = {k: None if id(v) in ids else v for k, v in kw.items()}


def _distributed_functions() -> Iterator[Any]:
    """The Python functions of the loaded ``torch.distributed`` modules (`_functions_of`)."""
    for name, module in list(sys.modules.items()):
        if module is not None and (name == "torch.distributed" or name.startswith("torch.distributed.")):
            yield from _functions_of(module)


def _destroyed_group_defaults() -> list[Any]:
    """Process groups that defaults of torch.distributed's functions hold and that are no longer
    live (``destroy_process_group`` ran, here or in the program)."""
    live = {id(g) for g in dist.distributed_c10d._world.pg_map}
    found = []
    for fn in _distributed_functions():
        for v in (*(fn.__defaults__ or ()), *(fn.__kwdefaults__ or {}).values()):
            if issubclass(type(v), dist.ProcessGroup) and id(v) not in live:
                found.append(v)
    return found


def _functions_of(module: Any) -> Iterator[Any]:
    """The Python functions `module` defines: at its top level and in the classes it defines. Read
    through `type()` alone: some values warn when an attribute is read (``torch.distributed.reduce_op``)."""
    for obj in list(vars(module).values()):
        kind = type(obj)
        if kind is types.FunctionType and obj.__module__ == module.__name__:
            yield obj
        elif issubclass(kind, type) and obj.__module__ == module.__name__:
            for member in list(vars(obj).values()):
                if type(member) in (staticmethod, classmethod):
                    member = member.__func__
                if type(member) is types.FunctionType:
                    yield member


atexit.register(_exit_cleanly)


# ---- communication accounting ---------------------------------------------------------------------

_BYTE_COUNTERS: list[dict[str, int]] = []


@contextlib.contextmanager
def count_bytes_sent() -> Iterator[dict[str, int]]:
    """Count the bytes this rank sends to other ranks inside the block, per usp op.

    Filled by the ops themselves (all-to-all: the pieces for other ranks; all-gather: the shard to
    each of the P-1 others; reduce-scatter: the P-1 chunks for others; ring: every hop's tensors)."""
    counts: dict[str, int] = {}
    _BYTE_COUNTERS.append(counts)
    try:
        yield counts
    finally:
        _BYTE_COUNTERS.remove(counts)


def record_sent(op_name: str, nbytes: int) -> None:
    for counts in _BYTE_COUNTERS:
        counts[op_name] = counts.get(op_name, 0) + int(nbytes)
