"""Train-step graph files: `save(TrainStepGraph, path)` and `load(path) -> LoadedTrainStep`.

A train-step file is a graph file of kind ``"train_step"``: the joint graph, its inputs in the
tracer's order (parameters, buffers, batch tensors, then the metadata ``cu_seqlens`` and
``max_seqlen``), the symbol constraints the trace recorded (ranges, guards, and per attention site
the token count that must equal ``metadata.total_tokens``), the batch's pytree structure, the
metadata capacity, buffer values, and the attention sites rewritten / kept.

`LoadedTrainStep` and `TrainStepGraph` are both a `usp_graph.signature.TrainStep`: the same input
spec (`GraphSignature`) and the same replay input check (`TrainStep.flat_inputs`), so a loaded
graph refuses exactly what a freshly traced one refuses, with the same messages.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from ..signature import GraphSignature, TrainStep, flatten_batch
from . import document
from .errors import GraphFileError, GraphFileSchemaError
from .reader import GraphFile, read_document
from .specs import InputSpec
from .values import decode_device, decode_tensor_data, encode_tensor_data
from .writer import build_document

if TYPE_CHECKING:
    from ..trace import TrainStepGraph

__all__ = ["save", "load", "loads", "LoadedTrainStep", "SavedSite"]


@dataclass(frozen=True)
class SavedSite:
    """An attention site as the file keeps it: name, SDPA form, source location, and (for a site
    kept as SDPA) why it was not rewritten."""

    name: str
    form: str | None
    source: str | None
    reason: str | None = None


# ---- batch structure ------------------------------------------------------------------------------

_LEAF = "*"


def _encode_tree(spec: pytree.TreeSpec) -> Any:
    skeleton = pytree.tree_unflatten([_LEAF] * spec.num_leaves, spec)

    def enc(x: Any) -> Any:
        if x is None:
            return None
        if isinstance(x, str) and x == _LEAF:
            return _LEAF
        if type(x) is dict:
            if not all(isinstance(k, str) for k in x):
                raise ValueError("batch dicts must have str keys to be saved")
            return {"dict": [[k, enc(v)] for k, v in x.items()]}
        if type(x) is list:
            return {"list": [enc(v) for v in x]}
        if type(x) is tuple:
            return {"tuple": [enc(v) for v in x]}
        raise ValueError(
            f"the batch holds a {type(x).__name__}; graph files keep batches of dicts, lists and tuples of "
            "tensors (convert it before tracing)"
        )

    return enc(skeleton)


def _decode_tree(data: Any, where: str, depth: int = 0) -> Any:
    if depth > 32:
        raise GraphFileSchemaError(f"{where}: batch structure nested too deep")
    if data is None or data == _LEAF:
        return data
    if not isinstance(data, dict) or len(data) != 1:
        raise GraphFileSchemaError(f'{where}: a batch node is "*", null or one of dict/list/tuple')
    ((tag, items),) = data.items()
    if not isinstance(items, list):
        raise GraphFileSchemaError(f"{where}.{tag[:20]}: expected a list")
    if tag == "dict":
        out = {}
        for i, kv in enumerate(items):
            if not isinstance(kv, list) or len(kv) != 2 or not isinstance(kv[0], str) or kv[0] in out:
                raise GraphFileSchemaError(f"{where}.dict[{i}]: entries are distinct [str key, value]")
            out[kv[0]] = _decode_tree(kv[1], f"{where}.dict[{i}]", depth + 1)
        return out
    if tag in ("list", "tuple"):
        seq = [_decode_tree(v, f"{where}.{tag}[{i}]", depth + 1) for i, v in enumerate(items)]
        return seq if tag == "list" else tuple(seq)
    raise GraphFileSchemaError(f"{where}: unknown batch node {tag[:20]!r}")


# ---- saving ---------------------------------------------------------------------------------------


def save(
    graph: TrainStepGraph | LoadedTrainStep,
    path: str | os.PathLike[str],
    *,
    meta: Mapping[str, Any] | None = None,
    include_buffers: bool = True,
) -> str:
    """Write a traced (or loaded) train step to `path` (one file per rank for CP graphs); returns
    the fingerprint. Saving a graph loaded with ``values=True`` reproduces its file byte for byte.

    meta: JSON-plain data kept with the file. include_buffers: store the traced model's buffer
    values, so replay can default to them as `TrainStepGraph.replay` does (else replay needs
    ``buffers=``). A CP graph records its process groups by global ranks (see
    `usp_graph.graphfile.groups`); save it on its rank, with torch.distributed initialized.
    """
    from ..trace import TrainStepGraph  # the tracer, here only: loading a file never imports it

    if not isinstance(graph, (TrainStepGraph, LoadedTrainStep)):
        raise TypeError(
            f"save takes a TrainStepGraph from usp_graph.trace_train_step (or a loaded one), got {type(graph).__name__}; "
            "use usp_graph.save_graph_module for other FX graphs"
        )
    s = graph.signature
    inputs = list(s.params + s.buffers + s.batch) + [
        InputSpec("cu_seqlens", "metadata", "tensor", torch.int32, (s.max_docs + 1,), s.metadata_device),
        InputSpec("max_seqlen", "metadata", "symint", value="max_seqlen"),
    ]

    def section(expr: Any) -> dict[str, Any]:
        return {
            "batch_tree": _encode_tree(s.batch_spec),
            "max_docs": s.max_docs,
            "metadata_device": str(s.metadata_device),
            "token_checks": [[site, source, expr(e)] for site, source, e in s.token_checks],
            "sites": [[x.name, x.form, x.source, None] for x in graph.sites],
            "skipped": [[x.name, x.form, x.source, x.reason] for x in graph.skipped],
            "buffers": {n: encode_tensor_data(t) for n, t in graph.buffers.items()}
            if include_buffers
            else None,
        }

    decision = getattr(graph, "cp_decision", None)
    if decision is not None and "cp_decision" not in (meta or {}):
        meta = {**(meta or {}), "cp_decision": decision}  # what ContextParallel("auto") chose, for inspect
    doc = build_document(
        graph.graph_module,
        kind="train_step",
        inputs=inputs,
        symbols=s.symbols,
        guards=s.guards,
        ranges=s.ranges,
        meta=meta,
        section=section,
    )
    document.write_atomic(path, document.dumps(doc))
    return doc["fingerprint"]


# ---- loading --------------------------------------------------------------------------------------


@dataclass(eq=False)
class LoadedTrainStep(TrainStep):
    """A train step loaded from a graph file; replays like the `TrainStepGraph` it was saved from
    (the one `TrainStep.replay`: same checks and messages; a CP graph binds its process groups
    before its first run).

    graph_module / signature / buffers: as on `TrainStepGraph`. sites / skipped: `SavedSite`
    records. file: the underlying `GraphFile` (inputs, symbols, versions, fingerprint, process
    groups, caller meta).
    """

    graph_module: fx.GraphModule
    signature: GraphSignature
    buffers: dict[str, torch.Tensor]
    sites: tuple[SavedSite, ...]
    skipped: tuple[SavedSite, ...]
    file: GraphFile
    groups: Mapping[str, Any] | None = None

    def __repr__(self) -> str:
        s = self.signature
        where = f" from {self.file.path}" if self.file.path else ""
        return (
            f"LoadedTrainStep({len(s.params)} params ({len(s.trainable)} trainable), batch "
            f"[{', '.join(t.describe() for t in s.batch)}], max_docs={s.max_docs}, "
            f"{len(self.sites)} attention sites rewritten, {len(self.skipped)} kept, "
            f"{len(self.graph_module.graph.nodes)} nodes{where})"
        )

    @property
    def fingerprint(self) -> str:
        return self.file.fingerprint

    def bind_groups(self, groups: Mapping[str, Any] | None = None) -> dict[str, str]:
        """Bind a CP graph's process groups now (else the first replay does); see `GraphFile.bind_groups`."""
        return self.file.bind_groups(groups if groups is not None else self.groups)

    def _before_run(self) -> None:
        """`TrainStep.replay`'s hook between validating the inputs and running the graph: a CP graph
        binds its process groups here (first call)."""
        self.bind_groups()


def _schema(where: str, msg: str) -> GraphFileSchemaError:
    return GraphFileSchemaError(f"{where}: {msg}")


def _as_tensor_spec(spec: InputSpec, where: str, *, named_dims: bool) -> InputSpec:
    """A file's parameter / buffer / batch input as a `GraphSignature` entry (checked: a tensor,
    dims ints or, for the batch, dim names); the same record a trace builds, placeholder name dropped."""
    if spec.kind != "tensor":
        raise _schema(where, f"input {spec.name!r} must be a tensor")
    for d in spec.shape or ():
        if not isinstance(d, int) and not (named_dims and isinstance(d, str)):
            raise _schema(where, f"input {spec.name!r} has dim {d}, which a {spec.role} cannot have")
    return replace(spec, node=None)


def _site(item: Any, where: str, kept: bool) -> SavedSite:
    if not isinstance(item, list) or len(item) != 4 or not isinstance(item[0], str):
        raise _schema(where, "a site is [name, form, source, reason]")
    if not all(x is None or isinstance(x, str) for x in item[1:]):
        raise _schema(where, "site form, source and reason are strings or null")
    return SavedSite(item[0], item[1], item[2], item[3] if kept else None)


def _train_step_inputs(
    f: GraphFile, max_docs: int, metadata_device: torch.device
) -> tuple[tuple[InputSpec, ...], tuple[InputSpec, ...], tuple[InputSpec, ...], tuple[str, ...]]:
    """(parameters, buffers, batch, trainable names): the inputs in that order, then the two
    metadata inputs (cu_seqlens and the symint max_seqlen), each dim a declared symbol."""
    by_role: dict[str, list[InputSpec]] = {"parameter": [], "buffer": [], "batch": [], "metadata": []}
    order = list(by_role)
    last = 0
    for i, spec in enumerate(f.inputs):
        if spec.role not in by_role or order.index(spec.role) < last:
            raise _schema(f"inputs[{i}]", "train-step inputs are parameters, buffers, batch, then metadata")
        last = order.index(spec.role)
        by_role[spec.role].append(spec)
    meta_in = by_role["metadata"]
    if (
        len(meta_in) != 2
        or meta_in[0].name != "cu_seqlens"
        or meta_in[0].kind != "tensor"
        or meta_in[0].dtype != torch.int32
        or meta_in[0].shape != (max_docs + 1,)
        or meta_in[0].device != metadata_device
        or meta_in[1].name != "max_seqlen"
        or meta_in[1].kind != "symint"
        or meta_in[1].value != "max_seqlen"
    ):
        raise _schema(
            "inputs",
            f"a train step ends with cu_seqlens (int32, ({max_docs + 1},), on {metadata_device}) and the "
            "symint max_seqlen",
        )
    params = tuple(_as_tensor_spec(s, f"inputs[{s.name}]", named_dims=False) for s in by_role["parameter"])
    bufs = tuple(_as_tensor_spec(s, f"inputs[{s.name}]", named_dims=False) for s in by_role["buffer"])
    batch = tuple(_as_tensor_spec(s, f"inputs[{s.name}]", named_dims=True) for s in by_role["batch"])
    for what, specs in (("parameter", params), ("buffer", bufs), ("batch", batch)):
        names = [s.name for s in specs]
        if len(set(names)) != len(names):
            raise _schema("inputs", f"{what} names repeat")
    trainable = tuple(s.name for s in by_role["parameter"] if s.trainable)
    for name in ["max_seqlen"] + [d for s in batch for d in s.shape if isinstance(d, str)]:
        if name not in f.dims:
            raise _schema("inputs", f"dim {name!r} has no entry in the file's symbols")
    return params, bufs, batch, trainable


def _token_checks(raw_checks: Any, f: GraphFile, where: str) -> list[tuple[str, str | None, Any]]:
    """The per-site token-count checks: [site, source, expression over the symbols] each."""
    token_checks = []
    if not isinstance(raw_checks, list):
        raise _schema(where, "a list")
    for i, item in enumerate(raw_checks):
        w = f"{where}[{i}]"
        if (
            not isinstance(item, list)
            or len(item) != 3
            or not isinstance(item[0], str)
            or not (item[1] is None or isinstance(item[1], str))
        ):
            raise _schema(w, "a token check is [site, source, expression]")
        token_checks.append((item[0], item[1], f.expr(item[2], w)))
    return token_checks


def _buffer_values(raw: Any, bufs: tuple[InputSpec, ...], where: str) -> dict[str, torch.Tensor]:
    """The saved buffer values (None: the file holds none), each matching its input spec."""
    buffers: dict[str, torch.Tensor] = {}
    if raw is not None:
        if not isinstance(raw, dict) or list(raw) != [b.name for b in bufs]:
            raise _schema(where, f"values for exactly the buffers {[b.name for b in bufs][:5]}")
        for spec in bufs:
            t = decode_tensor_data(raw[spec.name], f"{where}[{spec.name!r}]")
            if tuple(t.shape) != spec.shape or t.dtype != spec.dtype:
                raise _schema(
                    f"{where}[{spec.name!r}]",
                    f"value {tuple(t.shape)} {t.dtype} does not match its input spec",
                )
            buffers[spec.name] = t
    return buffers


def _check_train_step_graph(gm: fx.GraphModule, trainable: tuple[str, ...], *, verify: bool) -> None:
    """The graph outputs (loss, one grad per trainable parameter), its usp_* metadata is well formed,
    and (when `verify`) it passes usp_graph's verify pass."""
    out_node = gm.graph.find_nodes(op="output")[0]
    outputs = out_node.args[0]
    if not isinstance(outputs, (tuple, list)) or len(outputs) != 1 + len(trainable):
        raise _schema(
            "graph", f"a train step outputs (loss, one grad per trainable parameter: {len(trainable)})"
        )
    names = gm.meta.get("usp_outputs")
    if names is not None and names != ["loss"] + [f"grad:{n}" for n in trainable]:
        raise _schema("graph.meta.usp_outputs", "does not name (loss, grads of the trainable parameters)")
    for key in ("usp_sites", "usp_skipped"):
        v = gm.meta.get(key)
        if v is not None and not (
            isinstance(v, list) and all(isinstance(x, list) and x and isinstance(x[0], str) for x in v)
        ):
            raise _schema(f"graph.meta.{key}", "a list of [name, ...] entries")
    if verify:
        from ..passes.verify import VerifyError
        from ..passes.verify import verify as verify_graph

        try:
            verify_graph(gm)
        except VerifyError as e:
            raise _schema("graph", f"fails usp_graph's verify pass: {e}") from None


def _train_step(f: GraphFile, *, groups: Mapping[str, Any] | None, verify: bool) -> LoadedTrainStep:
    sec = f.section
    where = "train_step"
    allowed = {"batch_tree", "max_docs", "metadata_device", "token_checks", "sites", "skipped", "buffers"}
    if set(sec) != allowed:
        raise _schema(where, f"fields must be {sorted(allowed)}, got {sorted(str(k)[:40] for k in sec)}")
    max_docs = sec["max_docs"]
    if isinstance(max_docs, bool) or not isinstance(max_docs, int) or not 1 <= max_docs < 2**31:
        raise _schema(f"{where}.max_docs", "a positive int")
    metadata_device = decode_device(sec["metadata_device"], f"{where}.metadata_device")

    params, bufs, batch, trainable = _train_step_inputs(f, max_docs, metadata_device)

    skeleton = _decode_tree(sec["batch_tree"], f"{where}.batch_tree")
    leaves, batch_spec = pytree.tree_flatten(skeleton)
    if not all(x == "*" for x in leaves):
        raise _schema(f"{where}.batch_tree", 'leaves are "*"')
    tree_names, _, _ = flatten_batch(skeleton)
    if tree_names != [s.name for s in batch]:
        raise _schema(
            f"{where}.batch_tree",
            f"leaves {tree_names[:5]} do not match the batch inputs {[s.name for s in batch][:5]}",
        )

    token_checks = _token_checks(sec["token_checks"], f, f"{where}.token_checks")
    sites = sec["sites"]
    skipped = sec["skipped"]
    if not isinstance(sites, list) or not isinstance(skipped, list):
        raise _schema(where, "sites and skipped are lists")

    buffers = _buffer_values(sec["buffers"], bufs, f"{where}.buffers")

    gm = f.graph_module
    _check_train_step_graph(gm, trainable, verify=verify)

    signature = GraphSignature(
        params=params,
        trainable=trainable,
        buffers=bufs,
        batch=batch,
        batch_spec=batch_spec,
        max_docs=max_docs,
        metadata_device=metadata_device,
        symbols=dict(f.dims),
        ranges=dict(f.ranges),
        guards=tuple(f.guards),
        token_checks=tuple(token_checks),
    )
    return LoadedTrainStep(
        graph_module=gm,
        signature=signature,
        buffers=buffers,
        sites=tuple(_site(x, f"{where}.sites[{i}]", False) for i, x in enumerate(sites)),
        skipped=tuple(_site(x, f"{where}.skipped[{i}]", True) for i, x in enumerate(skipped)),
        file=f,
        groups=groups,
    )


def loads(
    data: bytes,
    *,
    groups: Mapping[str, Any] | None = None,
    strict_versions: bool = False,
    values: bool = True,
    verify: bool = True,
    source: str = "graph file",
) -> LoadedTrainStep:
    """`load` from bytes already in memory."""
    doc = document.parse(data, source=source)
    f = read_document(doc, source=source, values=values, strict_versions=strict_versions)
    if f.kind != "train_step":
        raise GraphFileError(
            f"{source} holds a {f.kind}, not a train step; load it with usp_graph.load_graph_module"
        )
    return _train_step(f, groups=groups, verify=verify)


def load(
    path: str | os.PathLike[str],
    *,
    groups: Mapping[str, Any] | None = None,
    strict_versions: bool = False,
    values: bool = True,
    verify: bool = True,
) -> LoadedTrainStep:
    """Load a train-step graph file; ``.replay(params, batch, metadata)`` as on the traced graph.

    groups: ``{recorded group name: ProcessGroup or live name}`` overrides for a CP graph (by
    default each recorded group binds to the live group over the same global ranks, at the first
    replay). strict_versions: refuse instead of warn on another torch/usp_graph version. values:
    rebuild fake ``meta["val"]`` values as the traced graph has them (for inspection; replay does not
    need them, ``values=False`` loads faster). verify:
    re-run usp_graph's verify pass on the loaded graph. Raises a `GraphFileError` subclass for any
    bad file; nothing in the file is executed or unpickled.
    """
    data = document.read_file(path)
    step = loads(
        data,
        groups=groups,
        strict_versions=strict_versions,
        values=values,
        verify=verify,
        source=os.fspath(path),
    )
    step.file.path = os.fspath(path)
    return step
