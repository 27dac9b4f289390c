"""Which argument of the compiled function a Dynamo graph input is, by the name the user knows.

Option ``documents="position_ids"`` names an argument of the model. Dynamo's placeholders carry
a source that says where each value came from; this module reads it structurally:

- ``L['position_ids']`` (a named parameter of the compiled frame) -> ``position_ids``;
- ``L['kwargs']['position_ids']``, ``L['batch']['position_ids']`` (``**kwargs``, a dict argument)
  -> ``position_ids``;
- ``L['args'][3]`` (a positional argument caught by a decorator's ``*args``: transformers wraps
  many ``forward`` methods so) -> the name of the parameter it binds to in the module's
  ``forward``, the module being ``args[0]`` or the wrapper's own ``self``, read from the frame
  Dynamo is compiling;
- anything else is no argument: a size of one (``L['kwargs']['position_ids'].size()[1]``, the
  SymInt Dynamo adds once shapes are dynamic: issue 30), a parameter, a buffer, an attribute.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx

__all__ = ["argument_name", "find_argument", "argument_names"]


def _wrapped_module(tx: Any, local: str) -> tuple[torch.nn.Module, int] | None:
    """(the module whose ``forward`` the frame wraps, the index in ``*local`` of its first own
    argument): ``wrapper(*args, **kwargs)`` with the module as ``args[0]``, or ``wrapper(self,
    *args, **kwargs)`` with ``local`` the frame's ``*args`` (transformers uses both)."""
    values = tx.f_locals.get(local)
    if not isinstance(values, tuple):
        return None
    if values and isinstance(values[0], torch.nn.Module):
        return values[0], 1
    code, owner = tx.f_code, tx.f_locals.get("self")
    if isinstance(owner, torch.nn.Module) and code.co_flags & inspect.CO_VARARGS:
        if code.co_varnames[code.co_argcount + code.co_kwonlyargcount] == local:
            return owner, 0
    return None


def _positional_name(local: str, index: int) -> str | None:
    """The parameter name that positional argument `index` of the frame's ``*local`` binds to, when
    the frame wraps an `nn.Module`'s ``forward`` (a decorator's ``*args``: `_wrapped_module`)."""
    try:  # the frame being compiled; Dynamo's own state, so any failure is "unknown", never a guess
        from torch._dynamo.symbolic_convert import InstructionTranslator

        found = _wrapped_module(InstructionTranslator.current_tx(), local)
    except Exception:
        return None
    if found is None:
        return None
    module, first = found
    try:
        params = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
    i = index - first
    return positional[i] if 0 <= i < len(positional) else None


def argument_name(source: Any) -> str | None:
    """The name of the argument a placeholder's Dynamo `source` is (module docstring), or None."""
    from torch._dynamo.source import DictGetItemSource, GetItemSource, LocalSource

    if isinstance(source, LocalSource):
        return source.local_name
    if isinstance(source, DictGetItemSource) and isinstance(source.index, str):
        base = source.base
        while isinstance(base, (DictGetItemSource, GetItemSource)):  # nested dicts / lists of dicts
            base = base.base
        return source.index if isinstance(base, LocalSource) else None
    if (
        isinstance(source, GetItemSource)
        and isinstance(source.base, LocalSource)
        and isinstance(source.index, int)
        and not source.index_is_slice
    ):
        return _positional_name(source.base.local_name, source.index)
    return None


def find_argument(gm: fx.GraphModule, name: str) -> fx.Node | None:
    """The placeholder of `gm` that is the argument `name` (a tensor), or None."""
    for p in gm.graph.find_nodes(op="placeholder"):
        if argument_name(getattr(p, "_dynamo_source", None)) == name and isinstance(
            p.meta.get("example_value"), torch.Tensor
        ):
            return p
    return None


def argument_names(gm: fx.GraphModule) -> list[str]:
    """The names of `gm`'s tensor arguments (for messages), parameters and buffers left out."""
    names = []
    for p in gm.graph.find_nodes(op="placeholder"):
        name = argument_name(getattr(p, "_dynamo_source", None))
        if name is not None and isinstance(p.meta.get("example_value"), torch.Tensor) and name not in names:
            names.append(name)
    return names
