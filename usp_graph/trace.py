"""The minimal train-step tracer and in-process replay.

# T packed tokens, N document capacity (max_docs), P parameters

`trace_train_step(model, step_fn, batch, metadata)` traces ``step_fn(model, batch) -> loss`` with
make_fx (pre-dispatch, so each SDPA call stays one node) on fake tensors, then runs the pass
pipeline (rewrite_sdpa -> joint -> verify) and returns a `TrainStepGraph` whose `replay` takes
real parameters, a batch and NEW metadata.

Graph inputs, in order: every parameter (``model.named_parameters()`` order), every buffer, the
batch's tensors (pytree order), ``cu_seqlens_N1``, ``max_seqlen`` (the last two made by
`usp_graph.graph_inputs`, as the rewrite pass and the compile backend make theirs). The input spec
and the replay input check are `usp_graph.signature`'s, shared with loaded graph files.

What is dynamic, and how:
- Token count(s): each batch dim listed in `dynamic` (default: every dim whose size is
  ``metadata.total_tokens``, named ``"T"``) is a backed SymInt of a ``ShapeEnv(duck_shape=False)``;
  one symbol per dim *name*, shared by every dim given that name. Every other dim is static, and
  no dim is merged with another because their sizes happen to be equal (no duck sizing).
  Anything derived (packed q/k/v, logits, the varlen op's T) is an expression of these symbols.
- ``max_seqlen``: a SymInt graph input with a symbol of its own (never specialized, even at 0 or
  1). Chosen over a tensor encoding because the varlen ops take SymInt max lengths and a tensor
  would force a device-to-host read per call on GPU; an int input costs nothing and changing it
  never retraces.
- ``cu_seqlens_N1``: an int32 tensor input of fixed capacity ``max_docs + 1``; values change
  freely, the capacity is part of the graph.
Guards the trace recorded on the symbols (and their value ranges) are kept and checked at replay.

Bitwise equality with eager `attention_mode` holds by construction: the rewrite inlines exactly the
ops `sdpa_to_usp` runs, the joint graph records the kernels eager autograd dispatches (forward op
by forward op, backward from the same registered rules, in the autograd engine's own order), and
replay runs those kernels on the real inputs.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx
from torch.utils import _pytree as pytree

from .graph_inputs import INPUT_META, add_metadata_inputs, static_metadata_values
from .metadata import AttentionMetadata
from .passes import Pipeline, PipelineRun, default_pipeline
from .passes.base import PASS_META, PassContext
from .signature import GraphSignature, InputSpec, TrainStep, flatten_batch, symbol_range
from .sites import AttentionSite

__all__ = ["trace_train_step", "TrainStepGraph", "GraphSignature"]


class _Step(nn.Module):
    """`step_fn(model, batch)` as a module, so `functional_call` can swap in fake parameters."""

    def __init__(self, model: nn.Module, step_fn: Callable[[nn.Module, Any], torch.Tensor]) -> None:
        super().__init__()
        self.model = model
        self.step_fn = step_fn

    def forward(self, batch: Any) -> torch.Tensor:
        return self.step_fn(self.model, batch)


def _ident(name: str) -> str:
    return re.sub(r"\W", "_", name)


def _dynamic_dims(
    names: list[str], leaves: list[torch.Tensor], metadata: AttentionMetadata, dynamic: Any, world: int
) -> list[dict[int, str]]:
    """Per batch tensor: {dim: dim name} of its dynamic dims."""
    dims: list[dict[int, str]] = [{} for _ in leaves]
    if dynamic is None:
        total = metadata.total_tokens // world
        for i, t in enumerate(leaves):
            dims[i] = {d: "T" for d, s in enumerate(t.shape) if s == total}
        if not any(dims):
            shapes = ", ".join(f"{n}{tuple(t.shape)}" for n, t in zip(names, leaves, strict=True))
            raise ValueError(
                f"no batch tensor has a dim of metadata.total_tokens={metadata.total_tokens}"
                f"{f' / {world} CP ranks' if world > 1 else ''} to make dynamic ({shapes}); "
                "name the token dims, e.g. dynamic={'tokens': {1: 'T'}}"
            )
        return dims
    if not isinstance(dynamic, Mapping):
        raise TypeError(
            f"dynamic must map batch keys to {{dim: name}} (or a dim index), got {type(dynamic).__name__}"
        )
    index = {n: i for i, n in enumerate(names)}
    for key, spec in dynamic.items():
        if key not in index:
            raise ValueError(
                f"dynamic names batch key {key!r}, which the batch does not have (keys: {names})"
            )
        t = leaves[index[key]]
        if isinstance(spec, int) and not isinstance(spec, bool):
            spec = {spec: "T"}
        if not isinstance(spec, Mapping):
            raise TypeError(f"dynamic[{key!r}] must be a dim index or a {{dim: name}} mapping, got {spec!r}")
        for d, name in spec.items():
            if isinstance(d, bool) or not isinstance(d, int) or not -t.dim() <= d < t.dim():
                raise ValueError(f"dynamic[{key!r}] names dim {d!r}, but {key} has shape {tuple(t.shape)}")
            if not isinstance(name, str) or not name.isidentifier() or name == "max_seqlen":
                raise ValueError(
                    f"dynamic[{key!r}][{d}]: dim names must be identifiers other than 'max_seqlen', got {name!r}"
                )
            dims[index[key]][d % t.dim()] = name
    return dims


def _check_sizes(names: list[str], leaves: list[torch.Tensor], dims: list[dict[int, str]]) -> dict[str, int]:
    sizes: dict[str, tuple[int, str]] = {}
    for name, t, ds in zip(names, leaves, dims, strict=True):
        for d, dim_name in ds.items():
            size = t.shape[d]
            where = f"batch[{name!r}] dim {d}"
            if size < 2:
                raise ValueError(
                    f"{where} is dynamic ({dim_name!r}) but has size {size} in the example batch; sizes 0 and 1 "
                    "are specialized by the tracer, so trace with an example of at least 2"
                )
            if dim_name in sizes and sizes[dim_name][0] != size:
                raise ValueError(
                    f"{where} has size {size} but dim {dim_name!r} is {sizes[dim_name][0]} in {sizes[dim_name][1]}; "
                    "dims sharing a name must be equal"
                )
            sizes.setdefault(dim_name, (size, where))
    return {k: v[0] for k, v in sizes.items()}


def _expr(x: Any) -> sympy.Expr:
    return x.node.expr if isinstance(x, torch.SymInt) else sympy.Integer(int(x))


def _check_no_input_mutation(gm: fx.GraphModule) -> None:
    inputs = set(gm.graph.find_nodes(op="placeholder"))
    for node in gm.graph.nodes:
        target = node.target
        if node.op != "call_function" or not isinstance(target, torch._ops.OpOverload):
            continue
        for i, arg in enumerate(target._schema.arguments):
            info = arg.alias_info
            value = node.args[i] if i < len(node.args) else node.kwargs.get(arg.name)
            if info is not None and info.is_write and isinstance(value, fx.Node) and value in inputs:
                raise ValueError(
                    f"the step mutates its input {value.name} in place ({target}); train-step graphs take "
                    "inputs read-only (buffer updates such as BatchNorm running stats are not supported)"
                )


@dataclass(eq=False)
class TrainStepGraph(TrainStep):
    """A traced, rewritten, differentiated and verified train step.

    graph_module: the joint graph, ``(params..., buffers..., batch..., cu_seqlens_N1, max_seqlen)
    -> (loss, *grads of trainable params)``. forward_graph: the rewritten forward graph.
    sites / skipped: attention sites rewritten / kept as SDPA (with reasons). run: each pass's
    result and any dumps. cp_decision: what ``ContextParallel("auto")`` chose and why
    (`usp_graph.cp.auto.Decision.as_dict`), saved with the graph and shown by inspect; None otherwise.
    """

    graph_module: fx.GraphModule
    forward_graph: fx.GraphModule
    signature: GraphSignature
    sites: tuple[AttentionSite, ...]
    skipped: tuple[AttentionSite, ...]
    run: PipelineRun
    buffers: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    cp_decision: dict | None = None

    def __repr__(self) -> str:
        s = self.signature
        dims = ", ".join(f"{k}={v}" for k, v in s.symbols.items())
        return (
            f"TrainStepGraph({len(s.params)} params ({len(s.trainable)} trainable), batch "
            f"[{', '.join(t.describe() for t in s.batch)}], max_docs={s.max_docs}, symbols {dims}, "
            f"{len(self.sites)} attention sites rewritten, {len(self.skipped)} kept, "
            f"{len(self.graph_module.graph.nodes)} nodes)"
        )


def _refuse_fsdp(model: nn.Module) -> None:
    """A traced train step takes whole parameters as graph inputs; FSDP2 holds shards and gathers
    them in module hooks, which a make_fx trace of fake parameters cannot run (issue 20)."""
    fsdp = getattr(getattr(torch.distributed, "fsdp", None), "FSDPModule", None)
    if fsdp is not None and any(isinstance(m, fsdp) for m in model.modules()):
        raise ValueError(
            "trace_train_step does not compose with FSDP2 (fully_shard): a traced step takes whole parameters "
            "as inputs, and FSDP2's hooks gather shards during forward and reduce-scatter grads during backward. "
            "Trace the unsharded model (and replay with gathered parameters), or train the sharded model "
            "with attention_mode / torch.compile(backend='usp') (usp_graph.fsdp.prepare)"
        )


def trace_train_step(
    model: nn.Module,
    step_fn: Callable[[nn.Module, Any], torch.Tensor],
    batch: Any,
    metadata: AttentionMetadata,
    *,
    dynamic: Mapping[str, int | Mapping[int, str]] | None = None,
    cp: Any = None,
    passes: Pipeline | None = None,
) -> TrainStepGraph:
    """Trace ``step_fn(model, batch) -> loss`` into a rewritten, differentiated, verified train step.

    batch: a pytree (dict) of tensors. metadata: the `AttentionMetadata` of the example batch; its
    capacity (max_docs) is fixed by the trace, its boundaries, token count and max_seqlen are not.
    dynamic: ``{batch key: {dim: dim name}}`` (or ``{key: dim}`` for a dim named ``"T"``); dims
    sharing a name share a symbol. Default: every dim of size ``metadata.total_tokens``, as "T".
    cp: a `usp_graph.ContextParallel`, forwarded to `sdpa_to_usp` (None: single process).
    passes: the `Pipeline` to run (default `default_pipeline()`; e.g. ``.disable("verify")``).
    """
    passes = _check_arguments(model, step_fn, metadata, passes)
    names, leaves, batch_spec = flatten_batch(batch)
    for name, leaf in zip(names, leaves, strict=True):
        if not isinstance(leaf, torch.Tensor):
            raise TypeError(
                f"batch[{name!r}] must be a tensor, got {type(leaf).__name__}; keep constants in step_fn"
            )
    if not leaves:
        raise ValueError("batch has no tensors")
    world = int(getattr(cp, "world", 1))  # under CP the batch holds this rank's 1/world of the tokens
    dims = _dynamic_dims(names, leaves, metadata, dynamic, world)
    fake = _FakeInputs.of(model, leaves, dims, _check_sizes(names, leaves, dims), metadata)
    env, syms = fake.env, fake.syms

    step = _Step(model, step_fn)
    state_names = ["model." + n for n, _ in fake.param_items] + ["model." + n for n, _ in fake.buffer_items]
    n_state, n_batch = len(state_names), len(leaves)

    def forward(*flat: Any) -> torch.Tensor:
        state = dict(zip(state_names, flat[:n_state], strict=True))
        b = pytree.tree_unflatten(list(flat[n_state : n_state + n_batch]), batch_spec)
        return torch.func.functional_call(step, state, (b,), strict=False)

    with torch.enable_grad():
        gm = make_fx(forward, tracing_mode="symbolic", pre_dispatch=True, record_stack_traces=True)(
            *fake.values
        )

    _tag_inputs(gm, fake.param_items, fake.buffer_items, names)
    add_metadata_inputs(gm, fake.meta_values, meta={PASS_META: "trace"})
    gm.recompile()
    _check_no_input_mutation(gm)
    _check_not_specialized(env, syms, names, dims)

    run = passes.run(gm, PassContext(cp=cp))
    _check_not_specialized(env, syms, names, dims)
    rewrite = next((r for r in run.results if r.name == "rewrite_sdpa"), None)
    sites = rewrite.sites if rewrite is not None else ()
    skipped = rewrite.skipped if rewrite is not None else ()

    symbols = {n: s.node.expr for n, s in syms.items()}
    symbols["max_seqlen"] = fake.meta_values.max_seqlen.node.expr
    signature = GraphSignature(
        params=tuple(_spec(n, "parameter", p, trainable=p.requires_grad) for n, p in fake.param_items),
        trainable=tuple(n for n, p in fake.param_items if p.requires_grad),
        buffers=tuple(_spec(n, "buffer", b) for n, b in fake.buffer_items),
        batch=tuple(
            _spec(n, "batch", t, shape=tuple(ds.get(d, s) for d, s in enumerate(t.shape)))
            for n, t, ds in zip(names, leaves, dims, strict=True)
        ),
        batch_spec=batch_spec,
        max_docs=metadata.max_docs,
        metadata_device=metadata.cu_seqlens.device,
        symbols=symbols,
        ranges={n: symbol_range(env, sym) for n, sym in symbols.items()},
        guards=_guards(env, symbols),
        token_checks=tuple(
            (s.name, s.source, env.replace(_expr(s.q_shape[0]) * _expr(s.q_shape[-2]) * world)) for s in sites
        ),
    )
    return TrainStepGraph(
        graph_module=run.gm,
        forward_graph=gm,
        signature=signature,
        sites=tuple(sites),
        skipped=tuple(skipped),
        run=run,
        buffers=dict(fake.buffer_items),
        cp_decision=decision.as_dict() if (decision := getattr(cp, "decision", None)) is not None else None,
    )


def _check_arguments(
    model: nn.Module, step_fn: Any, metadata: AttentionMetadata, passes: Pipeline | None
) -> Pipeline:
    """`trace_train_step`'s arguments checked; returns the pipeline to run."""
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    _refuse_fsdp(model)
    if not callable(step_fn):
        raise TypeError(f"step_fn must be callable as step_fn(model, batch) -> loss, got {step_fn!r}")
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be a usp_graph.AttentionMetadata, got {type(metadata).__name__}")
    if not isinstance(metadata.max_seqlen, int) or not isinstance(metadata.total_tokens, int):
        raise TypeError("metadata must hold concrete ints (max_seqlen, total_tokens), not symbolic sizes")
    passes = default_pipeline() if passes is None else passes
    if not isinstance(passes, Pipeline):
        raise TypeError(f"passes must be a usp_graph.passes.Pipeline, got {type(passes).__name__}")
    return passes


@dataclass
class _FakeInputs:
    """The trace's inputs as fake tensors: parameters and buffers with static shapes, the batch with
    one symbol per named dim (a ShapeEnv without duck sizing), the metadata's static values."""

    env: Any  # ShapeEnv
    syms: dict[str, Any]  # dim name -> SymInt
    meta_values: Any
    param_items: list[tuple[str, torch.Tensor]]
    buffer_items: list[tuple[str, torch.Tensor]]
    values: list[torch.Tensor]  # parameters, buffers, batch leaves

    @classmethod
    def of(
        cls,
        model: nn.Module,
        leaves: list[torch.Tensor],
        dims: list[dict[int, str]],
        sizes: dict[str, int],
        metadata: AttentionMetadata,
    ) -> _FakeInputs:
        from torch._dynamo.source import ConstantSource
        from torch._subclasses.fake_tensor import FakeTensorMode
        from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

        env = ShapeEnv(duck_shape=False)
        fake_mode = FakeTensorMode(shape_env=env)
        syms: dict[str, Any] = {}
        for dim_name, size in sizes.items():
            src = ConstantSource(f"dim_{dim_name}")
            syms[dim_name] = env.create_symintnode(
                env.create_symbol(size, src, dynamic_dim=DimDynamic.DYNAMIC), hint=size, source=src
            )
        meta_values = static_metadata_values(fake_mode, metadata)
        param_items = list(model.named_parameters())
        buffer_items = list(model.named_buffers())
        values = [fake_mode.from_tensor(p, static_shapes=True) for _, p in param_items]
        values += [fake_mode.from_tensor(b, static_shapes=True) for _, b in buffer_items]
        with fake_mode:
            values += [
                torch.empty(
                    [syms[ds[d]] if d in ds else s for d, s in enumerate(t.shape)],
                    dtype=t.dtype,
                    device=t.device,
                )
                for t, ds in zip(leaves, dims, strict=True)
            ]
        return cls(env, syms, meta_values, param_items, buffer_items, values)


_PREFIX = {"param": "p_", "buffer": "buf_", "batch": "in_"}


def _tag_inputs(
    gm: fx.GraphModule,
    param_items: list[tuple[str, torch.Tensor]],
    buffer_items: list[tuple[str, torch.Tensor]],
    batch_names: list[str],
) -> None:
    """Tag each placeholder with what it is (``meta["usp_input"]``) and give it a readable name
    (the metadata inputs come after them, from `graph_inputs.add_metadata_inputs`)."""
    tags = (
        [{"kind": "param", "name": n, "trainable": p.requires_grad} for n, p in param_items]
        + [{"kind": "buffer", "name": n} for n, _ in buffer_items]
        + [{"kind": "batch", "name": n} for n in batch_names]
    )
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(tags), (len(placeholders), len(tags))
    for node, tag in zip(placeholders, tags, strict=True):
        node.meta[INPUT_META] = tag
        node.meta[PASS_META] = "trace"
        node._rename(_PREFIX[tag["kind"]] + _ident(tag["name"]))
        node.target = node.name


def _spec(
    name: str,
    role: str,
    t: torch.Tensor,
    *,
    shape: tuple[int | str, ...] | None = None,
    trainable: bool | None = None,
) -> InputSpec:
    """A tensor input of the signature; `shape` defaults to the tensor's (all dims static)."""
    return InputSpec(
        name,
        role,
        "tensor",
        t.dtype,
        tuple(t.shape) if shape is None else shape,
        t.device,
        trainable=trainable,
    )


def _check_not_specialized(
    env: Any, syms: dict[str, Any], names: list[str], dims: list[dict[int, str]]
) -> None:
    for dim_name, sym in syms.items():
        value = env.replace(sym.node.expr)
        if value.is_number:
            where = [
                f"batch[{n!r}] dim {d}"
                for n, ds in zip(names, dims, strict=True)
                for d, x in ds.items()
                if x == dim_name
            ]
            raise ValueError(
                f"dynamic dim {dim_name!r} ({', '.join(where)}) was specialized to {value} while tracing: the step "
                "branches on it (a Python `if`, int() or .item() of a size); make that code size-agnostic or "
                "leave the dim static"
            )


def _guards(env: Any, symbols: dict[str, sympy.Symbol]) -> tuple[tuple[sympy.Basic, str], ...]:
    out = [(g.expr, str(getattr(g, "sloc", "") or "")) for g in env.guards]
    for sym in symbols.values():
        replaced = env.replace(sym)
        if replaced != sym:  # the trace proved this dim equal to an expression of others
            out.append((sympy.Eq(sym, replaced), "as a replacement"))
    return tuple(out)
