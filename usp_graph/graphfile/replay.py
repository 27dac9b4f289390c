"""The check a loaded graph passes before any of its ops runs on real data.

A graph file chooses a sequence of ops from the closed table (`optable`) and their arguments; the
loader already checked each call's argument types against the op's schema and refused in-place ops
on graph inputs. What only the actual inputs decide (sizes, strides, dtypes, devices) is checked
here: on the first call with a given input signature, every node runs on fake tensors with the
inputs' real sizes (no data is read or written), each op's own validator runs first
(`optable.validate`: explicit sizes and strides against the storage they view, indices of
``getitem``), and every tensor a node makes is bounded in size and must live on a device the inputs
use, and the intermediates alive at once are bounded too. Any refusal is a `GraphReplayError` naming the node, raised before the real graph runs; a
signature that passed is remembered (sizes, strides, dtypes, devices, and the values of non-tensor
inputs except ints only usp ops read, such as ``max_seqlen``), so replays with new document
boundaries and the same shapes pay for the check once.

`ReplayGraphModule` is what the loader returns: an `fx.GraphModule` whose calls go through this
check, run uninitialized allocations (``empty*``) zero-filled so that no bytes the allocator held
before can reach an output, and turn an op's failure during the run (a data-dependent index out of
range, say) into a `GraphReplayError` too. Calls save and restore the global RNG state.

Collectives (issue 31). Functional collectives (``_c10d_functional.*``) run through a twin that
first agrees on sizes with the other ranks (`usp_graph.distributed.agree_sizes`, CPU tensors), as
usp's own collectives do, so ranks replaying files or inputs that disagree get a `CollectiveError`
on every rank (raised as it is, not wrapped) instead of a gloo abort or a half-written buffer. A
replay that fails between an issued collective and its wait (``usp::*_start`` / ``usp::wait``,
``_c10d_functional.*`` / ``wait_tensor``) waits for what it issued before raising, so nothing stays
pending: no work, no buffers, no entry in the pending table.
"""

from __future__ import annotations

import contextvars
import logging
import os
from collections.abc import Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch.utils._pytree import tree_flatten

from ..distributed import CollectiveError, agree_sizes, resolve_group
from ..ops import collectives
from .errors import GraphReplayError
from .optable import COLLECTIVES, UNINITIALIZED, op_name, validate

__all__ = ["ReplayCheck", "ReplayGraphModule", "max_tensor_bytes"]

_ENV = "USP_GRAPHFILE_MAX_TENSOR_BYTES"
_DEFAULT_FLOOR = 1 << 28
PEAK_FACTOR = 4


def max_tensor_bytes(input_bytes: int) -> int:
    """The largest tensor one node may make: ``$USP_GRAPHFILE_MAX_TENSOR_BYTES`` if set, else
    ``max(256 MiB, 16 x the bytes of all inputs together)``. The graph's intermediates alive at
    once (beyond the inputs) may hold `PEAK_FACTOR` times that."""
    env = os.environ.get(_ENV)
    if env:
        try:
            value = int(env)
        except ValueError:
            raise ValueError(f"{_ENV}={env[:40]!r} is not a number of bytes") from None
        if value <= 0:
            raise ValueError(f"{_ENV}={value} must be positive")
        return value
    return max(_DEFAULT_FLOOR, 16 * input_bytes)


def _tensors(x: Any) -> Iterator[torch.Tensor]:
    leaves, _ = tree_flatten(x)
    return (t for t in leaves if isinstance(t, torch.Tensor))


def _signature(args: tuple[Any, ...], keyed: list[bool]) -> tuple[Any, ...]:
    key = []
    for a, k in zip(args, keyed, strict=False):
        if not k and isinstance(a, int) and not isinstance(a, bool):
            key.append(("int",))  # only read by usp ops (a max_seqlen): no size depends on its value
        elif isinstance(a, torch.Tensor):
            key.append(
                (
                    "t",
                    tuple(a.shape),
                    a.stride(),
                    a.storage_offset(),
                    a.untyped_storage().nbytes(),
                    a.dtype,
                    str(a.device),
                    a.layout,
                )
            )
        elif isinstance(a, (bool, int, float, str)) or a is None:
            key.append((type(a).__name__, a))
        else:
            key.append(("?", id(a)))
    return tuple(key)


def _is_usp_op(target: Any) -> bool:
    return isinstance(target, torch._ops.OpOverload) and target.namespace == "usp"


def _where(node: fx.Node) -> str:
    target = node.target if isinstance(node.target, str) else getattr(node.target, "__name__", node.target)
    return f"node {node.name!r} ({target})"


class ReplayCheck:
    """Fake-tensor propagation of one graph with the caller's input sizes (see the module doc)."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        self._passed: set[tuple[Any, ...]] = set()
        self._keyed = [
            not p.users or not all(_is_usp_op(u.target) for u in p.users)
            for p in gm.graph.find_nodes(op="placeholder")
        ]

    def __call__(self, args: tuple[Any, ...]) -> None:
        key = _signature(args, self._keyed)
        if key in self._passed:
            return
        self._propagate(args)
        self._passed.add(key)

    def _propagate(self, args: tuple[Any, ...]) -> None:
        # A refused op is reported once, as GraphReplayError; fake tensors would also log it.
        log = logging.getLogger("torch._subclasses.fake_tensor")
        level = log.level
        log.setLevel(logging.CRITICAL)
        try:
            self._fake_run(args)
        finally:
            log.setLevel(level)

    def _fake_run(self, args: tuple[Any, ...]) -> None:
        from torch._subclasses.fake_tensor import FakeTensorMode

        placeholders = list(self.gm.graph.find_nodes(op="placeholder"))
        if len(args) != len(placeholders):
            raise GraphReplayError(f"the graph takes {len(placeholders)} inputs, got {len(args)}")
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor) and (a.layout != torch.strided or a.is_nested or a.is_quantized):
                raise GraphReplayError(
                    f"input {i} ({placeholders[i].name}) is a {a.layout} tensor; graph files replay on "
                    "plain strided tensors"
                )
        input_bytes = sum(a.untyped_storage().nbytes() for a in args if isinstance(a, torch.Tensor))
        limit = max_tensor_bytes(input_bytes)
        devices = {a.device for a in args if isinstance(a, torch.Tensor)} | {torch.device("cpu")}
        mode = FakeTensorMode(allow_non_fake_inputs=False)
        env: dict[fx.Node, Any] = {}
        for p, a in zip(placeholders, args, strict=True):
            env[p] = mode.from_tensor(a) if isinstance(a, torch.Tensor) else a
        # Live bytes as the generated code frees them: a node's value dies after its last user.
        last_use: dict[fx.Node, fx.Node] = {}
        for node in self.gm.graph.nodes:
            for used in node.all_input_nodes:
                last_use[used] = node
        dying: dict[fx.Node, list[fx.Node]] = {}
        for used, user in last_use.items():
            dying.setdefault(user, []).append(used)
        holders: dict[int, int] = {}  # storage -> live nodes holding it
        sizes: dict[int, int] = {}
        owned: dict[fx.Node, list[int]] = {}
        live = 0
        inputs = {t.untyped_storage()._cdata for p in placeholders for t in _tensors(env[p])}
        for node in self.gm.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                break
            where = _where(node)
            try:
                if node.op == "get_attr":
                    value = mode.from_tensor(getattr(self.gm, node.target))
                else:
                    fargs = fx.node.map_arg(node.args, env.__getitem__)
                    fkwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
                    validate(node.target, fargs, fkwargs, where)
                    with mode:
                        value = node.target(*fargs, **fkwargs)
            except GraphReplayError:
                raise
            except Exception as e:  # noqa: BLE001 - any op failure on fake inputs refuses the graph
                raise GraphReplayError(
                    f"{where} cannot run on these inputs: {type(e).__name__}: {str(e)[:300]}; "
                    "nothing ran on the real inputs"
                ) from None
            for t in _tensors(value):
                nbytes = t.untyped_storage().nbytes() if t.layout == torch.strided else t.numel() * t.itemsize
                if nbytes > limit:
                    raise GraphReplayError(
                        f"{where} would make a tensor of {nbytes} bytes (shape {tuple(t.shape)}), over the "
                        f"limit of {limit} (256 MiB or 16x the inputs; set {_ENV} to raise it); nothing ran"
                    )
                if t.device not in devices:
                    raise GraphReplayError(
                        f"{where} would put a tensor on {t.device}, a device none of the inputs is on "
                        f"({', '.join(sorted(map(str, devices)))}); nothing ran"
                    )
                sid = t.untyped_storage()._cdata
                if sid in inputs or (node in owned and sid in owned[node]):
                    continue
                owned.setdefault(node, []).append(sid)
                if holders.get(sid, 0) == 0:
                    sizes[sid] = nbytes
                    live += nbytes
                holders[sid] = holders.get(sid, 0) + 1
            if live > PEAK_FACTOR * limit:
                raise GraphReplayError(
                    f"{where}: the graph would hold {live} bytes of intermediates at once, over "
                    f"{PEAK_FACTOR} x the per-tensor limit of {limit} (set {_ENV} to raise it); nothing ran"
                )
            env[node] = value
            for dead in dying.get(node, ()):
                for sid in owned.pop(dead, ()):
                    holders[sid] -= 1
                    if holders[sid] == 0:
                        live -= sizes.pop(sid)


def _zero_filled(op: torch._ops.OpOverload) -> Any:
    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        return op(*args, **kwargs).zero_()

    run.__name__ = f"zero_filled_{op.__name__.replace('.', '_')}"
    run.__qualname__ = run.__name__
    return run


_ZERO_FILLED: dict[Any, Any] = {}

# The functional collectives a replay issued: waited for if it fails before their wait_tensor.
_IN_FLIGHT: contextvars.ContextVar[list[torch.Tensor] | None] = contextvars.ContextVar(
    "usp_replay_c10d_in_flight", default=None
)
_WAIT = "_c10d_functional.wait_tensor.default"


def _splits(what: str, given: Sequence[Any], rows: int, world: int) -> list[int]:
    split = [int(v) for v in given]
    if not split:  # an even split
        if rows % world:
            raise ValueError(f"all_to_all_single: {rows} rows do not split evenly over {world} ranks")
        return [rows // world] * world
    if len(split) != world or any(v < 0 for v in split):
        raise ValueError(f"all_to_all_single: {what} {split} is not {world} sizes >= 0")
    return split


def _c10d_sizes(
    name: str, bound: dict[str, Any], world: int, me: int
) -> tuple[tuple[Any, ...], list[int], list[int]]:
    """(what every rank must share, elements sent to / received from each rank) of functional
    collective `name` called with `bound`. Bad values are a ValueError before any communication."""
    x = bound["input"]
    n, shape, op = x.numel(), tuple(x.shape), name.split(".")[1]
    if op == "all_reduce":
        return (op, bound["reduce_op"], shape), [n] * world, [n] * world
    if op == "all_gather_into_tensor":
        return (op, shape, bound["group_size"]), [n] * world, [n] * world
    if op == "reduce_scatter_tensor":
        if not shape or shape[0] % world:
            raise ValueError(f"reduce_scatter_tensor: shape {shape} does not split into {world} equal chunks")
        chunk = n // world
        return (op, bound["reduce_op"], shape, bound["group_size"]), [chunk] * world, [chunk] * world
    if op == "all_to_all_single":
        rows = shape[0] if shape else 0
        row = n // rows if rows else 0
        send = _splits("input_split_sizes", bound["input_split_sizes"], rows, world)
        recv = _splits("output_split_sizes", bound["output_split_sizes"], rows, world)
        if sum(send) != rows:
            raise ValueError(
                f"all_to_all_single: input_split_sizes {send} do not sum to the input's {rows} rows"
            )
        return (op, shape[1:]), [v * row for v in send], [v * row for v in recv]
    if op == "broadcast":
        src = bound["src"]
        if not 0 <= src < world:
            raise ValueError(f"broadcast: src={src} is not a rank of the {world}-rank group")
        send = [n if me == src and j != me else 0 for j in range(world)]
        recv = [n if j == src and me != src else 0 for j in range(world)]
        return (op, shape, src), send, recv
    raise AssertionError(f"no size rule for {name}")  # COLLECTIVES and this function list the same ops


def _checked_collective(target: torch._ops.OpOverload) -> Any:
    """`target` (a functional collective) after a size agreement with the other ranks; its result
    is remembered until the replay ends, to be waited for if the replay fails first."""
    from torch._subclasses.fake_tensor import is_fake

    name = op_name(target)
    params = list(target._schema.arguments)

    def run(*args: Any, **kwargs: Any) -> torch.Tensor:
        bound = {a.name: v for a, v in zip(params, args, strict=False)}
        bound.update(kwargs)
        x = bound.get("input")
        if isinstance(x, torch.Tensor) and not is_fake(x) and x.device.type == "cpu":
            pg = resolve_group(bound["group_name"])
            key, send, recv = _c10d_sizes(name, bound, pg.size(), pg.rank())
            item = x.element_size()
            agree_sizes(
                name, pg, (name, str(x.dtype), *key), [v * item for v in send], [v * item for v in recv]
            )
        out = target(*args, **kwargs)
        in_flight = _IN_FLIGHT.get()
        if in_flight is not None and not is_fake(out):
            in_flight.append(out)
        return out

    run.__name__ = f"checked_{name.replace('.', '_')}"
    run.__qualname__ = run.__name__
    return run


def _run_target(target: Any) -> Any:
    """What replay calls for `target`: itself; for an uninitialized allocation a zero-filling twin;
    for a functional collective a twin that agrees on sizes first (`_checked_collective`)."""
    if isinstance(target, torch._ops.OpOverload):
        name = op_name(target)
        if name in UNINITIALIZED:
            if target not in _ZERO_FILLED:
                _ZERO_FILLED[target] = _zero_filled(target)
            return _ZERO_FILLED[target]
        if name in COLLECTIVES and name != _WAIT:
            if target not in _ZERO_FILLED:
                _ZERO_FILLED[target] = _checked_collective(target)
            return _ZERO_FILLED[target]
    return target


def _finish_in_flight(before: frozenset[int], issued: Sequence[torch.Tensor]) -> None:
    """After a failed replay: wait for the collectives it issued and forget them (their errors are
    dropped: the replay's own error is the one to report)."""
    collectives.drain_pending(keep=before)
    for t in issued:
        try:
            torch.ops._c10d_functional.wait_tensor(t)
        except Exception:  # noqa: BLE001, S110 - a collective that failed has nothing left in flight
            pass


class ReplayGraphModule(fx.GraphModule):
    """A graph module rebuilt from a file. Its graph is the file's, for inspection and re-saving;
    calls run a copy in which uninitialized allocations are zero-filled, after the check
    (`ReplayCheck`), with the global RNG state restored afterwards, and an op failing during the
    run raises `GraphReplayError`."""

    def __init__(self, root: torch.nn.Module, graph: fx.Graph) -> None:
        super().__init__(root, graph)

    def recompile(self) -> Any:
        self.__dict__["_usp_runner"] = None  # the graph changed (process groups bound): rebuild the copy
        return super().recompile()

    def _runner(self) -> tuple[fx.GraphModule, ReplayCheck]:
        runner = self.__dict__.get("_usp_runner")
        if runner is None:
            graph = fx.Graph()
            env: dict[fx.Node, fx.Node] = {}
            out = graph.graph_copy(self.graph, env)
            graph.output(out)
            for node in graph.nodes:
                if node.op == "call_function":
                    node.target = _run_target(node.target)
            module = fx.GraphModule(self, graph)
            runner = (module, ReplayCheck(module))
            self.__dict__["_usp_runner"] = runner
        return runner

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if kwargs:
            raise GraphReplayError("a graph loaded from a file takes positional inputs only")
        module, check = self._runner()
        check(args)
        cuda = sorted({a.device.index or 0 for a in args if isinstance(a, torch.Tensor) and a.is_cuda})
        before = collectives.pending_keys()
        issued: list[torch.Tensor] = []
        token = _IN_FLIGHT.set(issued)
        try:
            with torch.random.fork_rng(devices=cuda):
                return module(*args)
        except CollectiveError:  # the ranks disagreed or a peer is gone: the same error on every rank
            _finish_in_flight(before, issued)
            raise
        except Exception as e:  # noqa: BLE001 - a data-dependent failure inside an op
            _finish_in_flight(before, issued)
            raise GraphReplayError(
                f"the graph failed while running on these inputs: {type(e).__name__}: {str(e)[:300]}"
            ) from e
        finally:
            _IN_FLIGHT.reset(token)
