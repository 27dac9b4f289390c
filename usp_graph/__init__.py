"""usp_graph: SDPA -> varlen attention + context-parallel collectives, with registered backward rules.

Public entry points:
- `AttentionMetadata`: document boundaries of a packed token stream.
- `varlen_attn`: attention within documents of packed `(T, H, K)` tensors (ops ``usp::varlen_fwd/bwd``).
- `sdpa_to_usp`: the single function mapping one SDPA call to pack -> varlen -> unpack.
- `attention_mode`: route every SDPA call in a block through `sdpa_to_usp`.
- `registry`: the table of backward rules.
- `trace_train_step` -> `TrainStepGraph`: trace, rewrite, differentiate and verify a train step;
  `.replay(params, batch, metadata)` with new document boundaries.
- `find_sites` / `AttentionSite`: every SDPA form in an FX graph as one record.
- `default_pipeline` / `Pipeline` / `PassResult` / `VerifyError`: the pass pipeline (`usp_graph.passes`).
- `save` / `load` -> `LoadedTrainStep` (``.replay`` in any process), `save_graph_module` /
  `load_graph_module` -> `GraphFile` (any FX graph), `GraphFileError`: graph files (`usp_graph.graphfile`).
- `usp_backend` (``torch.compile(backend="usp")``), `UspOptions`, `documents`, `CompileReport`: the
  compile backend (`usp_graph.backend`).
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import TYPE_CHECKING, Any

from . import registry
from .backend import EagerAttentionError, UspOptions, documents
from .backend import register as _register_backend
from .metadata import AttentionMetadata
from .mode import attention_mode
from .ops.varlen import varlen_attn
from .sdpa import sdpa_to_usp
from .version import __version__

if TYPE_CHECKING:
    from .backend import CompileReport, usp_backend
    from .cp import ContextParallel
    from .graphfile import (
        GraphFile,
        GraphFileError,
        InputSpec,
        LoadedTrainStep,
        load,
        load_graph_module,
        save,
        save_graph_module,
    )
    from .passes import PassResult, Pipeline, VerifyError, default_pipeline
    from .sites import AttentionSite, find_sites
    from .trace import TrainStepGraph, trace_train_step

__all__ = [
    "AttentionMetadata",
    "ContextParallel",
    "attention_mode",
    "registry",
    "sdpa_to_usp",
    "varlen_attn",
    "__version__",
    "AttentionSite",
    "find_sites",
    "PassResult",
    "Pipeline",
    "VerifyError",
    "default_pipeline",
    "TrainStepGraph",
    "trace_train_step",
    "GraphFile",
    "GraphFileError",
    "InputSpec",
    "LoadedTrainStep",
    "load",
    "load_graph_module",
    "save",
    "save_graph_module",
    "CompileReport",
    "EagerAttentionError",
    "UspOptions",
    "documents",
    "usp_backend",
]

# Public names whose modules load on first use: the compiler (Dynamo, inductor, the passes), the
# tracer, graph files and context parallelism are not paid for by `import usp_graph`, by eager
# `attention_mode`, or by a process that only loads and replays a graph file (tests/test_imports.py).
_LAZY = {
    "CompileReport": ".backend",
    "usp_backend": ".backend",
    "ContextParallel": ".cp",
    "GraphFile": ".graphfile",
    "GraphFileError": ".graphfile",
    "InputSpec": ".graphfile",
    "LoadedTrainStep": ".graphfile",
    "load": ".graphfile",
    "load_graph_module": ".graphfile",
    "save": ".graphfile",
    "save_graph_module": ".graphfile",
    "PassResult": ".passes",
    "Pipeline": ".passes",
    "VerifyError": ".passes",
    "default_pipeline": ".passes",
    "AttentionSite": ".sites",
    "find_sites": ".sites",
    "TrainStepGraph": ".trace",
    "trace_train_step": ".trace",
}


def __getattr__(name: str) -> Any:
    """A lazy public name (`_LAZY`), or a submodule (``usp_graph.analysis``), imported on first use."""
    module = _LAZY.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module, __name__), name)
    elif importlib.util.find_spec(f"{__name__}.{name}") is not None:
        value = importlib.import_module(f"{__name__}.{name}")
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


# torch.compile(backend="usp") also works without the installed entry point once usp_graph is imported.
_register_backend()

# transformers' attn_implementation="usp" (usp_graph.hf), registered when transformers' modeling
# code loads (or now, if it has); usp_graph does not import transformers itself.
from . import hf as _hf  # noqa: E402

_hf.install()
