"""The ``torch.compile`` backend ``"usp"`` (DESIGN.md, building block 8).

    import torch, usp_graph
    compiled = torch.compile(model, backend="usp", options={"inner": "aot_eager"})
    with usp_graph.documents(metadata):       # packed documents; omit for one document per row
        loss = loss_fn(compiled(batch))

- `usp_backend`: the backend function; registered as ``"usp"`` through the entry point
  ``torch_dynamo_backends`` (so ``backend="usp"`` works without importing usp_graph) and by
  `register` when usp_graph is imported.
- `UspOptions`: ``options={...}`` parsed (``cp``, ``inner``, ``dump_dir``, ``verify``, ``disable``,
  ``dump_passes``, ``on_compile``, ``documents``, ``max_docs``).
- `backend_pipeline`: the backend's passes, a `usp_graph.passes.Pipeline` (``print`` it for the
  names that options ``disable`` and ``dump_passes`` take).
- `documents`: per-call document metadata, fed to the compiled graphs as inputs (no recompile).
- `CompileReport`: what one compile did (``options["on_compile"]``).
"""

from __future__ import annotations

import warnings
from importlib.metadata import EntryPoint

from .compiler import BACKEND_NAME, CompileReport, usp_backend
from .documents import EagerAttentionError, current_documents, documents
from .options import DEFAULT_INNER, INNER_COMPILERS, UspOptions
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

ENTRY_POINT = "usp_graph.backend:usp_backend"


def register() -> None:
    """Register `usp_backend` as ``torch.compile(backend="usp")`` (idempotent).

    Skipped when torch has already discovered usp_graph's own entry point: torch registers what
    the entry point loads, on first lookup, and that load may be the very import running this
    (a second registration would then be a duplicate-name error inside torch).
    """
    import torch._dynamo
    from torch._dynamo.backends import registry

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
