"""Dynamo's function marks, set without importing Dynamo: `import usp_graph` and eager code stay free
of the compiler (torch's own decorators import ``torch._dynamo`` and inductor with it, ~1 s, only to
set a mark that Dynamo reads when it traces a call). tests/test_imports.py checks both marks against
torch's decorators."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any

__all__ = ["assume_constant_result", "disable"]


def assume_constant_result(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.assume_constant_result`: Dynamo runs `fn` on the host while it traces and
    takes its result as a constant of the graph."""
    fn._dynamo_marked_constant = True  # type: ignore[attr-defined]
    return fn


def disable(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`torch.compiler.disable`: Dynamo breaks the graph at a call of `fn` and runs it in eager, and
    frames `fn` calls are not compiled. Dynamo reads the mark when it traces the call; torch's own
    wrapper (which turns compilation off inside the call) is made at the first call once Dynamo is
    loaded. Before that nothing can compile a frame of the call, so `fn` runs as it is and the call
    imports nothing (the usp ops' kernels carry this mark: `usp_graph.ops.define`)."""
    wrapped: Callable[..., Any] | None = None
    callback: Callable[[], Any] | None = None

    @functools.wraps(fn)
    def call(*args: Any, **kwargs: Any) -> Any:
        nonlocal wrapped, callback
        if wrapped is None:
            if "torch._dynamo" not in sys.modules:
                return fn(*args, **kwargs)
            import torch

            wrapped = torch.compiler.disable(fn)
            callback = torch._C._dynamo.eval_frame.get_eval_frame_callback
        if callback() is None:
            # No frame is being watched (eager code, or a compiled graph's own call): torch's
            # wrapper would switch nothing off and back, a few microseconds per call.
            return fn(*args, **kwargs)
        return wrapped(*args, **kwargs)

    call._torchdynamo_disable = True  # type: ignore[attr-defined]
    return call
