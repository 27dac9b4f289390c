"""What a graph file says about a graph's inputs and node metadata: `InputSpec` (defined in
`usp_graph.signature`, the one input record of traced and loaded train steps), the roles and kinds
an input can have, and the shape each kept metadata key must have.

The node format itself (one JSON object per line in the file):

    {"name": "varlen_fwd", "op": "call_function", "target": "usp.varlen_fwd.default",
     "args": [{"node": "view_6"}, {"node": "view_7"}, {"node": "view_8"}, {"node": "cu_seqlens_N1"},
              {"node": "cu_seqlens_N1"}, {"node": "max_seqlen"}, {"node": "max_seqlen"}, true, 0.3535533905932738],
     "meta": {"usp_pass": "rewrite_sdpa", "usp_phase": "forward", "usp_site": "scaled_dot_product_attention",
              "source": "/work/main/usp_graph/models/llama.py:120 in forward",
              "val": [{"tensor": {"dtype": "float32", "shape": ["T", 4, 8], "device": "cpu"}},
                      {"tensor": {"dtype": "float32", "shape": [4, "T"], "device": "cpu"}}]}}

op is one of placeholder, call_function, get_attr (a tensor constant stored in the file) and
output; call_module / call_method never appear (they would reach arbitrary attributes). Kept
metadata: ``usp_*`` keys (NODE_META lists those with a required shape), ``source`` (the innermost
user frame, ``file:line in function``) and ``val``: dtype, shape (symbolic dims as expressions over
named symbols) and device; the reader rebuilds fake tensors from it (strides are not kept).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from ..signature import KINDS, ROLES, Dim, InputSpec

__all__ = ["InputSpec", "ROLES", "KINDS", "NODE_META", "GRAPH_META", "Dim"]

IDENT = re.compile(r"[A-Za-z_][A-Za-z0-9_]{0,199}")
SOURCE = re.compile(r'(?P<file>[^"\n\r]{1,500}):(?P<line>\d{1,7}) in (?P<fn>[^\s"]{1,200})')
META_KEY = re.compile(r"usp_[A-Za-z0-9_]{1,60}")
OPS = ("placeholder", "call_function", "get_attr", "output")


def _is_str(v: Any) -> bool:
    return isinstance(v, str)


def _is_opt_str(v: Any) -> bool:
    return v is None or isinstance(v, str)


def _is_input_tag(v: Any) -> bool:
    return (
        isinstance(v, dict)
        and v.get("kind") in ("param", "buffer", "batch", "cu_seqlens", "max_seqlen")
        and isinstance(v.get("name"), str)
        and set(v) <= {"kind", "name", "trainable"}
        and isinstance(v.get("trainable", False), bool)
    )


def _is_rows(*cols: Callable[[Any], bool]) -> Callable[[Any], bool]:
    def check(v: Any) -> bool:
        return isinstance(v, list) and all(
            isinstance(r, list) and len(r) == len(cols) and all(c(x) for c, x in zip(cols, r, strict=True))
            for r in v
        )

    return check


# Metadata the passes and the inspector read, with the shape they expect; other usp_* keys are kept
# as plain JSON data.
NODE_META: dict[str, Callable[[Any], bool]] = {
    "usp_pass": _is_str,
    "usp_phase": lambda v: v in ("forward", "backward", "input"),
    "usp_site": _is_str,
    "usp_fwd_node": _is_str,
    "usp_requires_grad": lambda v: isinstance(v, bool),
    "usp_input": _is_input_tag,
}
GRAPH_META: dict[str, Callable[[Any], bool]] = {
    "usp_outputs": lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v),
    "usp_sites": _is_rows(_is_str, _is_opt_str),
    "usp_skipped": _is_rows(_is_str, _is_opt_str, _is_opt_str),
}
