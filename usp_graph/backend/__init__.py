"""The ``torch.compile`` backend ``"usp"`` (DESIGN.md, building block 8).

    import torch, usp_graph
    compiled = torch.compile(model, backend="usp", options={"inner": "aot_eager"})
    with usp_graph.documents(metadata):       # packed documents; omit for one document per row
        loss = loss_fn(compiled(batch))

- `usp_backend`: the backend function; registered as ``"usp"`` through the entry point
  ``torch_dynamo_backends`` (so ``backend="usp"`` works without importing usp_graph) and by
  `register` when usp_graph is imported without that entry point installed.
- `UspOptions`: ``options={...}`` parsed (``cp``, ``inner``, ``dump_dir``, ``verify``, ``disable``,
  ``dump_passes``, ``on_compile``, ``documents``, ``max_docs``).
- `backend_pipeline`: the backend's passes, a `usp_graph.passes.Pipeline` (``print`` it for the
  names that options ``disable`` and ``dump_passes`` take).
- `documents`: per-call document metadata, fed to the compiled graphs as inputs (no recompile).
- `CompileReport`: what one compile did (``options["on_compile"]``).

Importing this package is light: `documents` (which installs the guard on eager SDPA inside a
block) and `options` load with it; the compiler, its passes and Dynamo load at the first use of
`usp_backend`, `CompileReport` or `backend_pipeline` (torch's entry-point lookup is such a use).
"""

from __future__ import annotations

import importlib
import sys
import warnings
from importlib.metadata import EntryPoint, entry_points
from typing import TYPE_CHECKING, Any

from .documents import EagerAttentionError, current_documents, documents
from .options import DEFAULT_INNER, INNER_COMPILERS, UspOptions

if TYPE_CHECKING:
    from .compiler import CompileReport, usp_backend
    from .pipeline import backend_pipeline

__all__ = [
    "BACKEND_NAME",
    "CompileReport",
    "DEFAULT_INNER",
    "INNER_COMPILERS",
    "UspOptions",
    "backend_pipeline",
    "EagerAttentionError",
    "current_documents",
    "documents",
    "register",
    "usp_backend",
]

BACKEND_NAME = "usp"
ENTRY_POINT = "usp_graph.backend:usp_backend"
ENTRY_POINT_GROUP = "torch_dynamo_backends"

# The compile path, imported on first use (it brings torch._dynamo and the passes).
_LAZY = {"CompileReport": ".compiler", "usp_backend": ".compiler", "backend_pipeline": ".pipeline"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


def _entry_point_installed() -> bool:
    """Whether torch will find usp_graph's own entry point when it first looks ``"usp"`` up."""
    return any(
        ep.name == BACKEND_NAME and ep.value == ENTRY_POINT for ep in entry_points(group=ENTRY_POINT_GROUP)
    )


def register() -> None:
    """Register `usp_backend` as ``torch.compile(backend="usp")`` (idempotent).

    Skipped when torch will discover, or has discovered, usp_graph's own entry point: torch
    registers what the entry point loads, on first lookup, and that load may be the very import
    running this (a second registration would then be a duplicate-name error inside torch). Left
    to the entry point, ``import usp_graph`` imports no Dynamo; only a checkout without the entry
    point installed pays for it here.
    """
    if "torch._dynamo" not in sys.modules and _entry_point_installed():
        return
    import torch._dynamo
    from torch._dynamo.backends import registry

    from .compiler import usp_backend

    current = registry._COMPILER_FNS.get(BACKEND_NAME)
    if current is usp_backend:
        return
    if current is not None:
        # Not an error: importing usp_graph must not fail because another package took the name.
        warnings.warn(
            f"another torch.compile backend is already registered as {BACKEND_NAME!r} ({current!r}); "
            "usp_graph did not register its own: pass backend=usp_graph.usp_backend instead",
            stacklevel=2,
        )
        return
    found = registry._BACKENDS.get(BACKEND_NAME)
    if isinstance(found, EntryPoint) and found.value == ENTRY_POINT:
        return
    torch._dynamo.register_backend(usp_backend, name=BACKEND_NAME)
