"""What a train-step graph takes, and the one check of what it is given.

# T packed tokens, N document capacity (max_docs)

`GraphSignature` (with one `InputSpec` per tensor input) is the input spec of a train step: the
tracer (`trace_train_step` -> `TrainStepGraph`) builds it from the trace, a graph file
(`load` -> `LoadedTrainStep`) rebuilds it from the file. Both are a `TrainStep`, whose
`flat_inputs` is the only replay input check: a loaded graph refuses exactly what a freshly traced
one refuses, with the same messages. Plain data (sympy expressions over the dim symbols, no
ShapeEnv), so a serializer can write it out.

`InputSpec` is the one record of a graph input: the signature's parameters, buffers and batch
leaves, and every input a graph file describes (`usp_graph.graphfile` re-exports it).

Also here, for both sides: `flatten_batch` (the batch's leaves and their names), `symbol_range`
(a symbol's recorded value range) and `evaluate_recorded` (evaluating a recorded guard or size).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from .graph_inputs import check_token_count
from .metadata import AttentionMetadata

__all__ = [
    "Dim",
    "GraphSignature",
    "InputSpec",
    "KINDS",
    "ROLES",
    "TrainStep",
    "check_bindings",
    "evaluate_recorded",
    "flatten_batch",
    "symbol_range",
]


ROLES = ("parameter", "buffer", "batch", "metadata", "input", "tangent")
KINDS = ("tensor", "symint", "int", "float", "bool", "none", "any")

Dim = int | str | sympy.Expr


@dataclass(frozen=True)
class InputSpec:
    """One graph input: a train step's parameter, buffer or batch leaf, or any input of a graph file.

    name: what the caller calls it (a parameter name, a batch key, ``"cu_seqlens"``); role: one of
    ROLES; kind: ``"tensor"``, ``"symint"`` (a symbolic int such as ``max_seqlen``), ``"int"``,
    ``"float"``, ``"bool"``, ``"none"`` or ``"any"`` (not checked).
    dtype / shape / device: for tensors; each dim an int (static), a symbol name (``"T"``), or a
    sympy expression over symbols named like dims (``2*T``). value: for a symint, its symbol name or
    expression. trainable: for parameters. node: the placeholder's name in a graph file (filled in
    when saving or loading; None in a `GraphSignature`).
    """

    name: str
    role: str = "input"
    kind: str = "tensor"
    dtype: torch.dtype | None = None
    shape: tuple[Dim, ...] | None = None
    device: torch.device | None = None
    value: Dim | None = None
    trainable: bool | None = None
    node: str | None = None

    def describe(self) -> str:
        if self.kind == "tensor":
            shape = "(" + ", ".join(str(d) for d in self.shape or ()) + ")"
            dtype = str(self.dtype).removeprefix("torch.") if self.dtype else "?"
            return f"{self.role} {self.name}: {shape} {dtype} on {self.device}"
        return f"{self.role} {self.name}: {self.kind}" + (
            f" = {self.value}" if self.value is not None else ""
        )


@dataclass(frozen=True)
class GraphSignature:
    """Everything replay checks before running the graph.

    params / buffers / batch: tensor `InputSpec`s (roles ``parameter`` / ``buffer`` / ``batch``; a
    batch dim is an int or a dynamic dim's name, parameter and buffer dims are ints).
    symbols: dim name -> sympy symbol (``"max_seqlen"`` included). ranges: dim name -> (lo, hi),
    hi None for unbounded. guards: (expression that must hold, where it was recorded).
    token_checks: (site, source, expression of the tokens it attends over), equal to
    ``metadata.total_tokens`` at replay.
    """

    params: tuple[InputSpec, ...]
    trainable: tuple[str, ...]
    buffers: tuple[InputSpec, ...]
    batch: tuple[InputSpec, ...]
    batch_spec: pytree.TreeSpec
    max_docs: int
    metadata_device: torch.device
    symbols: dict[str, sympy.Symbol]
    ranges: dict[str, tuple[int, int | None]]
    guards: tuple[tuple[sympy.Basic, str], ...]
    token_checks: tuple[tuple[str, str | None, sympy.Expr], ...]


# ---- helpers both sides use -----------------------------------------------------------------------


def _path_name(path: tuple[Any, ...]) -> str:
    parts = []
    for key in path:
        for attr in ("key", "idx", "name"):
            if hasattr(key, attr):
                parts.append(str(getattr(key, attr)))
                break
        else:
            parts.append(str(key))
    return ".".join(parts)


def flatten_batch(batch: Any) -> tuple[list[str], list[Any], pytree.TreeSpec]:
    """The batch's leaves in pytree order, their dotted names (``"tokens"``, ``"pair.0"``) and the
    structure."""
    leaves_with_path, spec = pytree.tree_flatten_with_path(batch)
    names = [_path_name(p) for p, _ in leaves_with_path]
    return names, [v for _, v in leaves_with_path], spec


def symbol_range(env: Any, sym: sympy.Symbol) -> tuple[int, int | None]:
    """(lo, hi) of `sym`'s value range in ShapeEnv `env`, hi None for unbounded."""
    vr = env.var_to_range.get(sym)
    if vr is None:
        return (0, None)
    from torch.utils._sympy.numbers import int_oo

    lo = 0 if vr.lower in (-int_oo, -sympy.oo) else int(vr.lower)
    hi = None if vr.upper in (int_oo, sympy.oo) else int(vr.upper)
    return (lo, hi)


def evaluate_recorded(
    shown: str, where: str, fn: Callable[..., Any], *args: Any, error: type[Exception] = ValueError
) -> Any:
    """``fn(*args)`` for a recorded guard or size expression (`shown`, recorded at `where`). One that
    cannot be evaluated (a division by zero, a comparison sympy cannot decide) never comes from the
    tracer, only from a damaged or hand-edited graph file: `error` saying so, not a sympy crash."""
    try:
        return fn(*args)
    except (TypeError, ValueError, ArithmeticError, AttributeError) as e:
        raise error(
            f"the graph's recorded expression {shown} ({where}) cannot be evaluated for these inputs "
            f"({type(e).__name__}: {e}); the graph, or the file it was loaded from, is damaged"
        ) from None


# ---- the train step -------------------------------------------------------------------------------


class TrainStep:
    """A train-step graph and its input spec: what `TrainStepGraph` and `LoadedTrainStep` share.

    graph_module: ``(params..., buffers..., batch..., cu_seqlens_N1, max_seqlen) -> (loss, *grads of
    trainable params)``. signature: its `GraphSignature`. buffers: the buffer values replay defaults to.
    """

    graph_module: fx.GraphModule
    signature: GraphSignature
    buffers: dict[str, torch.Tensor]

    def replay(
        self,
        params: Mapping[str, torch.Tensor],
        batch: Any,
        metadata: AttentionMetadata,
        *,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """Run the train step: ``(loss, {param name: grad})`` for the trainable parameters.

        `params` keyed by ``model.named_parameters()`` names (frozen ones included), `batch` with
        the traced keys, `metadata` of the traced capacity (boundaries, token count and max_seqlen
        may differ). `buffers` default to the traced model's buffers. Inputs are validated first
        (`flat_inputs`); a mismatch raises ValueError/TypeError saying what to change.
        """
        flat = self.flat_inputs(params, batch, metadata, buffers=buffers)
        self._before_run()
        with torch.no_grad():
            out = self.graph_module(*flat)
        loss, grads = out[0], out[1:]
        return loss, dict(zip(self.signature.trainable, grads, strict=True))

    def _before_run(self) -> None:
        """What must happen between validating the inputs and running the graph (nothing here; a
        loaded CP graph binds its process groups)."""

    def flat_inputs(
        self,
        params: Mapping[str, torch.Tensor],
        batch: Any,
        metadata: AttentionMetadata,
        *,
        buffers: Mapping[str, torch.Tensor] | None = None,
    ) -> list[Any]:
        """The graph's positional inputs, after checking every one against the signature."""
        s = self.signature
        flat: list[Any] = []
        flat += _check_named("params", params, s.params, hint="pass dict(model.named_parameters())")
        flat += _check_named(
            "buffers",
            self.buffers if buffers is None else buffers,
            s.buffers,
            hint="pass dict(model.named_buffers())",
        )
        if not isinstance(metadata, AttentionMetadata):
            raise TypeError(f"metadata must be a usp_graph.AttentionMetadata, got {type(metadata).__name__}")
        names, leaves, spec = flatten_batch(batch)
        if spec != s.batch_spec:
            traced = [t.name for t in s.batch]
            missing = [n for n in traced if n not in names]
            extra = [n for n in names if n not in traced]
            raise ValueError(
                f"batch does not have the traced structure: missing {missing}, unexpected {extra} "
                f"(traced keys: {traced})"
            )
        bindings: dict[str, tuple[int, str]] = {}
        for t, spec_t in zip(leaves, s.batch, strict=True):
            where = f"batch[{spec_t.name!r}]"
            _check_tensor(where, t, spec_t)
            for d, (size, want) in enumerate(zip(t.shape, spec_t.shape, strict=True)):
                if isinstance(want, str):
                    if want in bindings and bindings[want][0] != size:
                        raise ValueError(
                            f"{where} dim {d} is {size} but dynamic dim {want!r} is {bindings[want][0]} from "
                            f"{bindings[want][1]}; dims sharing a name must be equal"
                        )
                    bindings.setdefault(want, (size, f"{where} dim {d}"))
        # The graph was traced on contiguous fake inputs, so its views assume contiguous strides; a
        # strided batch (e.g. ContextParallel.shard of a (B, L, ...) tensor) is copied first.
        flat += [t.contiguous() for t in leaves]
        if metadata.max_docs != s.max_docs:
            raise ValueError(
                f"metadata has capacity max_docs={metadata.max_docs} but the graph was traced with "
                f"max_docs={s.max_docs}; capacity is part of the graph: build the metadata with "
                f"max_docs={s.max_docs} (unused slots repeat the total) or retrace"
            )
        if metadata.cu_seqlens.device != s.metadata_device:
            raise ValueError(
                f"metadata.cu_seqlens is on {metadata.cu_seqlens.device} but the graph expects "
                f"{s.metadata_device}; use metadata.to({str(s.metadata_device)!r})"
            )
        if not isinstance(metadata.max_seqlen, int):
            raise TypeError(
                f"metadata.max_seqlen must be an int at replay, got {type(metadata.max_seqlen).__name__}"
            )
        bindings["max_seqlen"] = (metadata.max_seqlen, "metadata.max_seqlen")
        _check_symbols(s, bindings, metadata)
        flat += [metadata.cu_seqlens, metadata.max_seqlen]
        return flat


def _check_tensor(where: str, t: Any, spec: InputSpec) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{where} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != len(spec.shape):
        raise ValueError(
            f"{where} has shape {tuple(t.shape)}, expected {len(spec.shape)} dims like {spec.shape}"
        )
    for d, (size, want) in enumerate(zip(t.shape, spec.shape, strict=True)):
        if isinstance(want, int) and size != want:
            raise ValueError(
                f"{where} has shape {tuple(t.shape)}, traced {spec.shape}: dim {d} is static ({want}); only "
                "dims named in `dynamic` may change between steps"
            )
    if t.dtype != spec.dtype:
        raise ValueError(f"{where} has dtype {t.dtype}, the graph was traced with {spec.dtype}")
    if t.device != spec.device:
        raise ValueError(f"{where} is on {t.device}, the graph was traced on {spec.device}")


def _check_named(what: str, given: Any, specs: tuple[InputSpec, ...], *, hint: str) -> list[torch.Tensor]:
    if not isinstance(given, Mapping):
        raise TypeError(f"{what} must be a mapping of name -> tensor ({hint}), got {type(given).__name__}")
    want = [s.name for s in specs]
    missing = [n for n in want if n not in given]
    extra = [n for n in given if n not in set(want)]
    if missing or extra:

        def few(xs: list[str]) -> str:
            return ", ".join(repr(x) for x in xs[:3]) + (f" and {len(xs) - 3} more" if len(xs) > 3 else "")

        parts = ([f"missing {few(missing)}"] if missing else []) + (
            [f"unexpected {few(extra)}"] if extra else []
        )
        raise ValueError(f"{what} do not match the traced model: {'; '.join(parts)}; {hint}")
    out = []
    for spec in specs:
        t = given[spec.name]
        _check_tensor(f"{what}[{spec.name!r}]", t, spec)
        out.append(t)
    return out


def check_bindings(
    bound: Mapping[str, tuple[int, str]],
    *,
    symbols: Mapping[str, sympy.Symbol],
    ranges: Mapping[str, tuple[int, int | None]],
    guards: Sequence[tuple[sympy.Basic, str]],
    saved: bool = False,
    error: type[Exception] = ValueError,
) -> dict[sympy.Symbol, sympy.Integer]:
    """Check the sizes some inputs bind (``{dim name: (value, where it comes from)}``) against the
    recorded value ranges, then the recorded guards; returns ``{symbol: value}`` for further checks.

    The one check of recorded symbol constraints: train steps (traced or loaded) and graph files
    called directly (`GraphFile.check_inputs`, `saved=True`: messages speak of the saved graph).
    `error`: what a guard that cannot be evaluated raises (`evaluate_recorded`).
    """
    subs: dict[sympy.Symbol, sympy.Integer] = {}
    for name, (value, where) in bound.items():
        lo, hi = ranges.get(name, (0, None))
        if value < lo or (hi is not None and value > hi):
            if saved:
                raise ValueError(
                    f"{where} = {value}, but the graph was saved for {name} in [{lo}, {hi if hi is not None else 'inf'}]"
                )
            bound_text = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
            raise ValueError(f"{where} = {value}, but the graph was traced for {name} {bound_text}")
        if name in symbols:
            subs[symbols[name]] = sympy.Integer(value)
    show = str if saved else _shown_by_name(symbols)
    for expr, where in guards:
        result = evaluate_recorded(show(expr), where, expr.xreplace, subs, error=error)
        if result.free_symbols or evaluate_recorded(show(expr), where, bool, result, error=error):
            continue
        values = ", ".join(f"{n}={v}" for n, (v, _) in bound.items())
        if saved:
            raise ValueError(
                f"these inputs ({values}) break an assumption recorded with the graph: {expr} ({where})"
            )
        raise ValueError(
            f"these inputs ({values}) break an assumption made while tracing: {show(expr)} "
            f"(recorded {where}); retrace with an example that satisfies the new inputs' shapes"
        )
    return subs


def _shown_by_name(symbols: Mapping[str, sympy.Symbol]) -> Callable[[sympy.Basic], str]:
    """An expression as text, its symbols written by their dim names."""
    by_name = {sym: sympy.Symbol(n) for n, sym in symbols.items()}
    return lambda expr: str(expr.xreplace(by_name))


def _check_symbols(
    s: GraphSignature, bindings: dict[str, tuple[int, str]], metadata: AttentionMetadata
) -> None:
    subs = check_bindings(
        {n: bindings[n] for n in s.symbols if n in bindings},
        symbols=s.symbols,
        ranges=s.ranges,
        guards=s.guards,
    )
    show = _shown_by_name(s.symbols)
    for site, source, expr in s.token_checks:
        where = f"attention site {site}"
        tokens = evaluate_recorded(show(expr), where, expr.xreplace, subs)
        if tokens.free_symbols:
            continue
        n = evaluate_recorded(show(expr), where, int, tokens)
        check_token_count(n, metadata.total_tokens, partial(_token_mismatch, metadata, site, source, n))


def _token_mismatch(metadata: AttentionMetadata, site: str, source: str | None, tokens: int) -> str:
    at = f" at {source}" if source else ""
    return (
        f"metadata describes {metadata.total_tokens} tokens but attention site {site}{at} attends over "
        f"{tokens} tokens (batch * length) with this batch; build the metadata from this batch"
    )
