"""Which argument of the compiled function a Dynamo graph input is, by the name the user knows.

Option ``documents="position_ids"`` names an argument of the model. Dynamo's placeholders carry
a source that says where each value came from; this module reads it structurally:

- ``L['position_ids']`` (a named parameter of the compiled frame) -> ``position_ids``;
- ``L['kwargs']['position_ids']``, ``L['batch']['position_ids']`` (``**kwargs``, a dict argument)
  -> ``position_ids``;
- ``L['args'][3]`` (a positional argument caught by a decorator's ``*args``: transformers wraps
  many ``forward`` methods so) -> the name of the parameter it binds to in ``args[0].forward``
  when ``args[0]`` is the module, read from the frame Dynamo is compiling;
- anything else is no argument: a size of one (``L['kwargs']['position_ids'].size()[1]``, the
  SymInt Dynamo adds once shapes are dynamic: issue 30), a parameter, a buffer, an attribute.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.fx as fx

__all__ = ["argument_name", "find_argument", "argument_names"]


def _positional_name(local: str, index: int) -> str | None:
    """The parameter name that positional argument `index` of the frame's ``*local`` binds to, when
    ``local[0]`` is an `nn.Module` whose ``forward`` the frame wraps (a decorator's ``*args``)."""
    try:  # the frame being compiled; Dynamo's own state, so any failure is "unknown", never a guess
        from torch._dynamo.symbolic_convert import InstructionTranslator

        values = InstructionTranslator.current_tx().f_locals.get(local)
    except Exception:
        return None
    if not isinstance(values, tuple) or not values or not isinstance(values[0], torch.nn.Module):
        return None
    if not 1 <= index < len(values):
        return None
    try:
        params = list(inspect.signature(values[0].forward).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = []
    for p in params:
        if p.kind == p.VAR_POSITIONAL:
            break
        if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            positional.append(p.name)
    return positional[index - 1] if index - 1 < len(positional) else None


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
