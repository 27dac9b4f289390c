"""Graph files: save a traced graph, load it in any process, replay it. No pickle, no exec.

    usp_graph.save(graph, "step.uspg")            # a TrainStepGraph (CP: one file per rank)
    step = usp_graph.load("step.uspg")            # in a fresh process
    loss, grads = step.replay(params, batch, metadata)   # validated first; new boundaries are fine

    usp_graph.save_graph_module(gm, "bwd.uspg", meta={"stage": "backward"})      # any FX graph
    f = usp_graph.load_graph_module("bwd.uspg")       # GraphFile: .graph_module, .inputs, ...

Where things live: `document` (JSON, fingerprint, format version), `writer` (FX graph -> document),
`reader` (document -> `GraphFile`: where a graph file is read and checked), `specs` (`InputSpec`,
the node format, kept metadata), `train_step` (`save` / `load`, `LoadedTrainStep`), `allowlist`
(what a node may call), `values` / `exprs` (argument and size-expression encodings), `groups` (CP
process groups), `errors`.

Format (version 1): one UTF-8 JSON document, pretty-printed with one node per line:

    format, format_version   "usp_graph.graphfile", 1
    kind                     "train_step" or "graph_module"
    versions                 torch, usp_graph and python versions of the writer
    symbols                  {name: {hint, min, max}}: the symbolic sizes (dims such as "T", "max_seqlen")
    guards                   [[condition, where recorded], ...]: constraints the trace recorded
    inputs                   one per placeholder: node, name, role (parameter | buffer | batch |
                             metadata | input | tangent), kind, dtype, shape (ints and expressions
                             over named symbols), device, trainable
    world                    null, or {size, rank, groups: [{name, ranks}]} for graphs with collectives
    graph                    {nodes: [...], meta: {usp_outputs, usp_sites, usp_skipped}}
    constants                tensor constants read by get_attr nodes (dtype, shape, base64 bytes)
    train_step               kind-specific: batch structure, max_docs, metadata device, per-site
                             token-count checks, sites, buffer values
    meta                     the caller's JSON-plain data
    fingerprint              "sha256:<hex>" over the canonical JSON of everything else

A node (`specs` has the node format, `values` the argument grammar, `exprs` the size expressions):

    {"name": "mm_3", "op": "call_function", "target": "aten.mm.default",
     "args": [{"node": "view_11"}, {"node": "t_3"}],
     "meta": {"usp_fwd_node": "linear_3", "usp_pass": "trace", "usp_phase": "forward",
              "usp_requires_grad": true, "source": "/work/main/usp_graph/models/llama.py:128 in forward",
              "val": {"tensor": {"dtype": "float32", "shape": ["T", 32], "device": "cpu"}}}}

Loading, in order: UTF-8 JSON (else `CorruptGraphFileError`; a truncated file says so), our format
and exactly format version 1 (else `GraphFileVersionError`: a newer file asks for a newer
usp_graph, an older one for a re-save), the fingerprint (else `FingerprintError`), then every
field. Each node's target is resolved against the allowlist only (`DisallowedTargetError` for
``builtins.exec``, ``os.system`` or anything else outside it) and its arguments are checked against
the op's schema; names, targets and sources must be plain identifiers / locations, so nothing from
the file reaches generated code except as data. All errors are `GraphFileError` (a ValueError).

Version policy. Format version: exact match or refuse (above). Torch / usp_graph version: a file
written by another version loads with a `GraphFileVersionWarning` saying to re-trace and re-save
(ops are still resolved and schema-checked against the running torch, so a changed or missing op
fails to load with a clear error; but bitwise equality with eager is only promised under the
writing versions). Pass ``strict_versions=True`` to refuse such files (`GraphFileVersionError`).

CP graphs: collectives name their process group; the file records each group's global ranks and
the writer's world size and rank, and replay binds them to this process's groups over the same
ranks (`groups` says how, and what a replaying job must do first).
"""

from __future__ import annotations

from .document import FORMAT, FORMAT_VERSION, SUFFIX
from .errors import (
    CorruptGraphFileError,
    DisallowedTargetError,
    FingerprintError,
    GraphFileError,
    GraphFileSchemaError,
    GraphFileVersionError,
    GraphFileVersionWarning,
    GraphReplayError,
    ProcessGroupMismatchError,
)
from .reader import GraphFile, load_graph_module, loads_graph_module
from .specs import InputSpec
from .train_step import LoadedTrainStep, SavedSite, load, loads, save
from .writer import save_graph_module

__all__ = [
    "FORMAT",
    "FORMAT_VERSION",
    "SUFFIX",
    "CorruptGraphFileError",
    "DisallowedTargetError",
    "FingerprintError",
    "GraphFile",
    "GraphFileError",
    "GraphFileSchemaError",
    "GraphFileVersionError",
    "GraphFileVersionWarning",
    "GraphReplayError",
    "InputSpec",
    "LoadedTrainStep",
    "ProcessGroupMismatchError",
    "SavedSite",
    "load",
    "load_graph_module",
    "loads",
    "loads_graph_module",
    "save",
    "save_graph_module",
]
