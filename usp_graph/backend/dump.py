"""``dump_dir``: what the ``usp`` backend writes for each graph it compiles.

One directory per compiled graph, ``<dump_dir>/<NNN>_frame<F>_<C>/`` (NNN counts the backend's
compiles in this process; F/C is Dynamo's compile id), holding:

- ``dynamo.txt``: the graph Dynamo handed over; ``rewritten.txt``: after the rewrite pass, each
  node annotated with the pass that made it;
- ``joint.txt`` (training), ``forward.txt``, ``backward.txt`` or ``inference.txt``: AOTAutograd's
  graphs (the joint carries ``usp_phase`` / ``usp_fwd_node`` tags); ``backward.txt`` appears when
  AOTAutograd compiles the backward, which may be at the first backward call;
- ``NN_<pass>.before.txt`` / ``.after.txt``: with option ``dump_passes``, each named pass's graph
  before and after it ran (NN: its place in `usp_graph.backend.backend_pipeline`);
- ``<name>.uspg``: the AOTAutograd graphs as graph files (``save_graph_module``; the metadata
  symbols named ``N1`` and ``max_seqlen``); ``forward.uspg``'s nodes are named as in the joint, and
  ``backward.uspg``'s ``usp_fwd_node`` tags name them, which is how ``usp-graph inspect`` pairs a
  forward site with its backward across the two files;
- ``summary.json`` (``"format": "usp_graph.compile_dump"``, ``"version": 1``), the manifest:
  attention sites (rewritten or kept, with the reason), metadata inputs, CP plan, op and collective
  counts per graph and phase, the files above, and ``"failed"``: each file that could not be
  written, with the error (the compile goes on; ``usp-graph inspect`` then exits non-zero). It is
  rewritten whenever a graph arrives.
"""

from __future__ import annotations

import itertools
import json
import os
import re
import warnings
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import sympy
import torch
import torch.fx as fx

from .. import registry
from ..graphfile.document import SUFFIX
from ..passes.base import graph_text
from ..passes.provenance import PHASE_META
from ..sites import AttentionSite, node_value

__all__ = ["GraphDump", "FORMAT", "VERSION", "Manifest", "ManifestError", "SiteRecord", "read_manifest"]

FORMAT = "usp_graph.compile_dump"
VERSION = 1
_COUNTER = itertools.count()


def _op_name(target: Any) -> str:
    if isinstance(target, torch._ops.OpOverload):
        return f"{target.namespace}.{target._schema.name.split('::')[1]}.{target._overloadname}"
    return getattr(target, "__qualname__", None) or getattr(target, "__name__", None) or str(target)


def _phase(node: fx.Node, by_phase: bool) -> str:
    return node.meta.get(PHASE_META, "all") if by_phase else "all"


def _op_counts(gm: fx.GraphModule, by_phase: bool) -> dict[str, dict[str, int]]:
    """Per phase (``"all"`` unless `by_phase`): op name -> count."""
    out: dict[str, Counter] = {}
    for node in gm.graph.nodes:
        if node.op in ("call_function", "call_method", "call_module"):
            phase = _phase(node, by_phase)
            out.setdefault(phase, Counter())[_op_name(node.target)] += 1
    return {phase: dict(sorted(c.items())) for phase, c in out.items()}


def _collectives(gm: fx.GraphModule, by_phase: bool) -> dict[str, dict[str, int]]:
    rules = registry.rules()
    coll = {op for op, r in rules.items() if r.kind == "collective"}
    out: dict[str, Counter] = {}
    for node in gm.graph.nodes:
        target = registry.canonical(node.target) if node.op == "call_function" else None
        if target in coll:  # an issued collective (the overlap pass) counts as its collective
            out.setdefault(_phase(node, by_phase), Counter())[_op_name(target)] += 1
    return {phase: dict(sorted(c.items())) for phase, c in out.items()}


def usp_op_counts(gm: fx.GraphModule, *, phase: str | None = None) -> dict[str, dict[str, int]]:
    """Per phase (the node's ``usp_phase`` tag, or `phase` for all): usp op name -> count."""
    out: dict[str, Counter] = {}
    for node in gm.graph.nodes:
        t = node.target
        if (
            node.op == "call_function"
            and isinstance(t, torch._ops.OpOverload)
            and t.namespace == registry.NAMESPACE
        ):
            out.setdefault(phase or node.meta.get(PHASE_META, "all"), Counter())[_op_name(t)] += 1
    return {p: dict(sorted(c.items())) for p, c in out.items()}


def _shape(s: Any) -> list[str] | None:
    return None if s is None else [str(d) for d in s]


def site_record(site: AttentionSite, rewritten: bool) -> dict[str, Any]:
    return {
        "name": site.name,
        "form": site.form,
        "q_shape": _shape(site.q_shape),
        "k_shape": _shape(site.k_shape),
        "v_shape": _shape(site.v_shape),
        "dtype": str(site.dtype) if site.dtype is not None else None,
        "is_causal": site.is_causal if isinstance(site.is_causal, bool) else str(site.is_causal),
        "scale": site.scale if isinstance(site.scale, (int, float, type(None))) else str(site.scale),
        "enable_gqa": site.enable_gqa,
        "source": site.source,
        "rewritten": rewritten,
        "reason": site.reason,
    }


# AOTAutograd graphs are the ones a graph file can hold (aten and usp ops only); Dynamo's graph
# calls torch functions and modules.
AOT_GRAPHS = ("joint", "forward", "backward", "inference")


def _label(compile_id: Any) -> str:
    text = re.sub(r"[^0-9A-Za-z]+", "_", str(compile_id)).strip("_") if compile_id is not None else "x"
    return f"{next(_COUNTER):03d}_frame{text}"


class GraphDump:
    """The dump directory of one compiled graph.

    Writing a file never fails the compile: a file that cannot be written is named, with the
    error, in summary.json's ``"failed"`` (``{file name: "Error: message"}``) and warned about;
    ``usp-graph inspect`` exits non-zero on such a dump and says which file.
    """

    def __init__(self, root: Path, compile_id: Any, summary: dict[str, Any]) -> None:
        self.dir = Path(root) / _label(compile_id)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.summary: dict[str, Any] = {"format": FORMAT, "version": VERSION, **summary}
        self.summary.setdefault("graphs", {})
        self.summary.setdefault("graph_files", {})
        self.summary.setdefault("failed", {})

    def graph(self, name: str, gm: fx.GraphModule, inputs: list[dict[str, Any]] | None = None) -> None:
        """Write `gm` as ``<name>.txt`` (and, for AOTAutograd graphs, a graph file) and refresh summary.json.

        inputs: one ``{"name", "role"[, "trainable"]}`` per placeholder (roles as graph files name
        them: parameter, buffer, batch, metadata, tangent, input), for AOTAutograd graphs.
        """
        try:
            self.summary["graphs"][name] = self._entry(name, gm, inputs)
        except Exception as e:
            self._fail(f"{name} (summary.json entry)", e)
            self.summary["graphs"][name] = {"text": f"{name}.txt", "error": _error(e)}
        try:
            (self.dir / f"{name}.txt").write_text(graph_text(gm))
        except Exception as e:
            self._fail(f"{name}.txt", e)
        if name in AOT_GRAPHS:
            self.summary["graph_files"][name] = self._graph_file(name, gm, inputs)
        self.write()

    def _entry(self, name: str, gm: fx.GraphModule, inputs: list[dict[str, Any]] | None) -> dict[str, Any]:
        placeholders = list(gm.graph.find_nodes(op="placeholder"))
        described = [
            {"node": p.name, **(inputs[i] if inputs else {}), "value": _describe(node_value(p))}
            for i, p in enumerate(placeholders)
        ]
        return {
            "text": f"{name}.txt",
            "nodes": len(gm.graph.nodes),
            # Only the joint graph is split by phase; forward/backward graphs keep the joint's tags.
            "ops": _op_counts(gm, name == "joint"),
            "collectives": _collectives(gm, name == "joint"),
            "inputs": described,
        }

    def _graph_file(
        self, name: str, gm: fx.GraphModule, inputs: list[dict[str, Any]] | None
    ) -> dict[str, Any]:
        from ..graphfile import InputSpec as input_spec
        from ..graphfile import save_graph_module as save

        path = self.dir / f"{name}{SUFFIX}"
        try:
            specs = symbols = None
            if inputs is not None:
                placeholders = list(gm.graph.find_nodes(op="placeholder"))
                specs = [_spec(input_spec, p, i) for p, i in zip(placeholders, inputs, strict=True)]
                symbols = _metadata_symbols(placeholders, inputs)
            save(
                gm,
                path,
                inputs=specs,
                symbols=symbols,
                meta={"compile_dump": self.summary.get("graph"), "graph": name},
            )
        except Exception as e:  # a dump must never fail the compile; it says why the file is missing
            self._fail(path.name, e)
            return {"file": None, "error": _error(e)}
        self.summary["failed"].pop(path.name, None)
        return {"file": path.name, "error": None}

    def _fail(self, what: str, e: Exception) -> None:
        self.summary["failed"][what] = _error(e)
        warnings.warn(f"usp backend: could not write {self.dir / what}: {_error(e)}", stacklevel=3)

    def update(self, **fields: Any) -> None:
        self.summary.update(fields)
        self.write()

    def write(self) -> None:
        from ..graphfile.document import write_atomic

        # Atomic: `usp-graph inspect` may read the manifest while a lazily compiled backward rewrites it.
        try:
            write_atomic(self.dir / "summary.json", json.dumps(self.summary, indent=1, default=str) + "\n")
        except Exception as e:
            warnings.warn(
                f"usp backend: could not write {self.dir / 'summary.json'}: {_error(e)}", stacklevel=2
            )


def _error(e: BaseException) -> str:
    return f"{type(e).__name__}: {e}"


def _metadata_symbols(placeholders: list[fx.Node], inputs: list[dict[str, Any]]) -> dict[str, Any]:
    """Readable names for the metadata symbols (``N1``: cu_seqlens entries, ``max_seqlen``), so a
    graph file says ``N1 - 1`` documents rather than ``$s99 - 1``."""
    out: dict[str, Any] = {}
    for p, info in zip(placeholders, inputs, strict=True):
        if info.get("role") != "metadata":
            continue
        v = node_value(p)
        if info.get("name") == "cu_seqlens" and isinstance(v, torch.Tensor) and v.dim() == 1:
            v, name = v.shape[0], "N1"
        else:
            name = info.get("name")
        if isinstance(v, torch.SymInt) and isinstance(v.node.expr, sympy.Symbol) and name not in out:
            out[name] = v
    return out


def _spec(input_spec: Any, node: fx.Node, info: dict[str, Any]) -> Any:
    v = node_value(node)
    trainable = info.get("trainable") if info["role"] == "parameter" else None
    if isinstance(v, torch.Tensor):
        return input_spec(
            info["name"], info["role"], "tensor", v.dtype, tuple(v.shape), v.device, trainable=trainable
        )
    if isinstance(v, torch.SymInt):
        return input_spec(info["name"], info["role"], "symint", value=v)
    kind = {bool: "bool", int: "int", float: "float", type(None): "none"}.get(type(v), "any")
    return input_spec(info["name"], info["role"], kind)


def _describe(v: Any) -> str:
    if isinstance(v, torch.Tensor):
        return f"{str(v.dtype).removeprefix('torch.')}{[str(d) for d in v.shape]}"
    return str(v)


# ---- reading a manifest back (``usp-graph inspect`` / ``verify`` on a dump directory) -------------


class ManifestError(ValueError):
    """A summary.json that says it is a compile dump's manifest but does not hold one (one line:
    the file, the field, what it must be)."""


@dataclass(frozen=True)
class SiteRecord:
    """One attention site as the manifest records it (`site_record`): what inspect shows of it."""

    name: str
    source: str
    rewritten: bool
    reason: str | None
    q_shape: tuple[int | str, ...] | None
    is_causal: bool | str | None


@dataclass(frozen=True)
class Manifest:
    """What inspect reads of a summary.json: the compiled graph's name, its attention sites, and
    what was not written: `failed` {file: error}, `graph_files` {graph: (file or None, error or None)}."""

    graph: str | None
    sites: tuple[SiteRecord, ...]
    failed: dict[str, str]
    graph_files: dict[str, tuple[str | None, str | None]]


# A manifest records a handful of sites and graphs; a file listing more is not one of ours.
_MAX_ENTRIES = 100_000


def _want(where: str, what: str, got: Any) -> ManifestError:
    shown = type(got).__name__ if isinstance(got, (dict, list)) else repr(got)[:40]
    return ManifestError(f"{where} must be {what}, got {shown}")


def _str(v: Any, where: str, *, optional: bool = False) -> str | None:
    if v is None and optional:
        return None
    if not isinstance(v, str):
        raise _want(where, "a string" + (" or null" if optional else ""), v)
    return v


def _entries(v: Any, kind: type, where: str) -> Any:
    if not isinstance(v, kind):
        raise _want(where, "an object" if kind is dict else "a list", v)
    if len(v) > _MAX_ENTRIES:
        raise ManifestError(f"{where} has {len(v)} entries; a compile dump's manifest has a handful")
    return v


def _site(r: Any, where: str) -> SiteRecord:
    if not isinstance(r, dict):
        raise _want(where, "a site record (an object)", r)
    rewritten = r.get("rewritten")
    if not isinstance(rewritten, bool):
        raise _want(f"{where}.rewritten", "true or false", rewritten)
    shape = r.get("q_shape")
    if shape is not None:
        _entries(shape, list, f"{where}.q_shape")
        for i, d in enumerate(shape):
            if (
                isinstance(d, bool)
                or not isinstance(d, (int, str))
                or (isinstance(d, int) and not 0 <= d < 2**63)
            ):
                raise _want(f"{where}.q_shape[{i}]", "a size (an int >= 0 or a symbolic size's text)", d)
    causal = r.get("is_causal")
    if causal is not None and not isinstance(causal, (bool, str)):
        raise _want(f"{where}.is_causal", "true, false, a text or null", causal)
    return SiteRecord(
        name=_str(r.get("name"), f"{where}.name"),  # type: ignore[arg-type]
        source=_str(r.get("source"), f"{where}.source", optional=True) or "",
        rewritten=rewritten,
        reason=_str(r.get("reason"), f"{where}.reason", optional=True),
        q_shape=None if shape is None else tuple(shape),
        is_causal=causal,
    )


def _or(v: Any, empty: Any) -> Any:
    return empty if v is None else v


def decode_manifest(data: Any, source: str) -> Manifest | None:
    """A parsed summary.json -> its `Manifest`, or None when it is not a compile dump's manifest
    (no ``"format": FORMAT``). ManifestError (naming `source` and the field) for one that says it
    is but holds something else where inspect reads: every field is checked here, once."""
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        return None
    try:
        if data.get("version") != VERSION:
            raise ManifestError(
                f"version {str(data.get('version'))[:20]!r}: this usp_graph reads version {VERSION} manifests; "
                "inspect the dump with the usp_graph that wrote it, or compile again"
            )
        sites = tuple(
            _site(r, f"sites[{i}]") for i, r in enumerate(_entries(_or(data.get("sites"), []), list, "sites"))
        )
        failed = {
            _str(k, "failed (a file name)"): _str(v, f"failed[{k[:40]!r}]")
            for k, v in _entries(_or(data.get("failed"), {}), dict, "failed").items()
        }
        graph_files = {}
        for name, entry in _entries(_or(data.get("graph_files"), {}), dict, "graph_files").items():
            where = f"graph_files[{name[:40]!r}]"
            if not isinstance(entry, dict):
                raise _want(where, 'an object {"file": name or null, "error": text or null}', entry)
            file = _str(entry.get("file"), f"{where}.file", optional=True)
            if file is not None and (not file or os.sep in file or "\0" in file or file in (".", "..")):
                raise _want(f"{where}.file", "a file name in the dump's folder", file)
            graph_files[name] = (file, _str(entry.get("error"), f"{where}.error", optional=True))
        graph = _str(data.get("graph"), "graph", optional=True)
    except ManifestError as e:
        raise ManifestError(f"{source}: not a readable compile dump manifest: {e}") from None
    return Manifest(graph=graph, sites=sites, failed=failed, graph_files=graph_files)  # type: ignore[arg-type]


def read_manifest(folder: str | os.PathLike[str]) -> Manifest | None:
    """The `Manifest` of the compiled graph dumped in `folder` (None where the folder has no
    summary.json, or one that is not a compile dump's). ManifestError for an unreadable one:
    not a regular file (a FIFO is refused, not waited on), over the graph file size limit, not
    JSON, or holding something else than a manifest where inspect reads."""
    from ..graphfile.document import MAX_FILE_BYTES, open_regular

    path = os.path.join(os.fspath(folder), "summary.json")
    if not os.path.lexists(path):
        return None
    try:
        with open_regular(path) as fh:
            data = fh.read(MAX_FILE_BYTES + 1)
        if len(data) > MAX_FILE_BYTES:
            raise ValueError(f"over {MAX_FILE_BYTES} bytes: not a compile dump's manifest")
        parsed = json.loads(data)
    except (OSError, ValueError, RecursionError) as e:
        raise ManifestError(f"{path}: {e}") from None
    return decode_manifest(parsed, path)
