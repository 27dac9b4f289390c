"""Which CUDA attention kernel a step ran: a helper the GPU benchmarks share.

It wraps, for one call of the step, the module globals through which usp's varlen ops reach their
CUDA kernels (`usp_graph.ops.varlen._cuda_fwd/_cuda_bwd`, kept as globals for this) and flex's
entry points, and reads the cuDNN kernel's own execution count. ``host_reads``: the host reads that
cut boundaries with a slot per token to their documents (`kernel_choice._fitted`), each a sync. The
ops have no public hook for this; a profiler trace gives the op calls but not which kernel each one
chose."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from usp_graph.ops import cudnn_kernel, flex_kernel, kernel_choice, varlen


def kernel_calls(step: Callable[[], Any]) -> tuple[Any, dict[str, int]]:
    """Run `step` once; return its result and the attention kernel calls it made: all CUDA
    forward/backward calls of usp's varlen op, and those of them that ran the flex or the cuDNN
    kernel (so a table row says which kernel it timed)."""
    counts = {
        "fwd": 0,
        "bwd": 0,
        "flex_fwd": 0,
        "flex_bwd": 0,
        "cudnn_fwd": 0,
        "cudnn_bwd": 0,
        "host_reads": 0,
    }
    runs = dict(cudnn_kernel._runs)
    saved = varlen._cuda_fwd, varlen._cuda_bwd, flex_kernel.flex_fwd, flex_kernel.flex_bwd
    fit = kernel_choice.fit_to_documents

    def counted(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any) -> Any:
            counts[name] += 1
            return fn(*args)

        return run

    varlen._cuda_fwd, varlen._cuda_bwd = counted("fwd", saved[0]), counted("bwd", saved[1])
    flex_kernel.flex_fwd, flex_kernel.flex_bwd = counted("flex_fwd", saved[2]), counted("flex_bwd", saved[3])
    kernel_choice.fit_to_documents = counted("host_reads", fit)
    try:
        result = step()
    finally:
        varlen._cuda_fwd, varlen._cuda_bwd, flex_kernel.flex_fwd, flex_kernel.flex_bwd = saved
        kernel_choice.fit_to_documents = fit
    counts["cudnn_fwd"] = cudnn_kernel._runs["fwd"] - runs["fwd"]
    counts["cudnn_bwd"] = cudnn_kernel._runs["bwd"] - runs["bwd"]
    return result, counts
