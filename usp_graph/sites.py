"""Attention sites: every form of SDPA in an FX graph, normalized to one `AttentionSite` record.

# B batch, H query heads, G key/value heads, L sequence, K head dim

The rewrite, the verify pass, the compile backend and the CLI all look for attention through
`find_sites`, so they agree on what an attention call is and on why one cannot be rewritten.
Forms recognized (``AttentionSite.form``):

- ``"torch"``: ``torch._C._nn.scaled_dot_product_attention`` / ``F.scaled_dot_product_attention``
  call_function nodes, as Dynamo hands them to a backend (fake values in ``meta["example_value"]``);
- ``"aten"``: ``aten.scaled_dot_product_attention.default`` (pre-dispatch make_fx, torch.export);
- ``"flash_cpu"``, ``"flash"``, ``"efficient"``, ``"cudnn"``, ``"overrideable"``: the post-dispatch
  kernels of plain make_fx / AOTAutograd graphs. They return tuples; only their output 0 may be
  used for the site to be rewritable (an inference graph). In a joint graph their logsumexp feeds
  the backward kernel: such a site is reported, never rewritten (rewrite before differentiating).
"""

from __future__ import annotations

import operator
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from .masks import MaskForm, mask_form
from .rules import LAYOUT_OPS, WEIGHT_LAYOUT_OPS, known_equal, weight_dims, weight_dims_after
from .rules import is_cross_attention as cross_attention_rule
from .sdpa import SDPA_OP

__all__ = [
    "AttentionSite",
    "find_sites",
    "source_location",
    "node_value",
    "SDPA_FORMS",
    "body_call",
    "ancestors",
]

_aten = torch.ops.aten

# target -> form. Torch-level functions take SDPA's Python signature; aten ops are bound by schema.
SDPA_FORMS: dict[Any, str] = {
    torch._C._nn.scaled_dot_product_attention: "torch",
    F.scaled_dot_product_attention: "torch",
    _aten.scaled_dot_product_attention.default: "aten",
    _aten._scaled_dot_product_flash_attention_for_cpu.default: "flash_cpu",
    _aten._scaled_dot_product_flash_attention.default: "flash",
    _aten._scaled_dot_product_efficient_attention.default: "efficient",
    _aten._scaled_dot_product_cudnn_attention.default: "cudnn",
    _aten._scaled_dot_product_fused_attention_overrideable.default: "overrideable",
    SDPA_OP: "window",  # usp_graph::sdpa: SDPA with a sliding window (sdpa.windowed_sdpa)
}

# Forms whose node returns the attention output itself (the post-dispatch kernels return tuples).
_SINGLE_OUTPUT = ("torch", "aten", "window")

# Torch-level SDPA has the aten op's argument names; bind both through its schema.
_SDPA_SCHEMA = _aten.scaled_dot_product_attention.default._schema


def node_value(node: Any) -> Any:
    """The fake value a node carries: make_fx's ``meta["val"]`` or Dynamo's ``meta["example_value"]``."""
    if not isinstance(node, fx.Node):
        return node
    if "val" in node.meta:
        return node.meta["val"]
    return node.meta.get("example_value")


_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_DOCUMENTS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "backend", "documents.py")
_FRAME = re.compile(r'File "(?P<file>[^"]+)", line (?P<line>\d+), in (?P<fn>\S+)')


def source_location(node: fx.Node) -> str | None:
    """``file:line in function`` of the innermost frame of ``node.meta["stack_trace"]``, if recorded."""
    trace = node.meta.get("stack_trace")
    if not trace:
        return None
    frames = _FRAME.findall(trace)
    if not frames:
        return None
    # The innermost frame outside torch itself (the model line, not nn/modules/linear.py) and
    # outside usp_graph's eager-SDPA check (backend/documents.py), which stands in for SDPA.
    user = [f for f in frames if not f[0].startswith(_TORCH_DIR) and f[0] != _DOCUMENTS_FILE]
    file, line, fn = (user or frames)[-1]
    return f"{file}:{line} in {fn}"


@dataclass(eq=False)
class AttentionSite:
    """One SDPA call, whatever form the graph spells it in.

    node: the attention node. query/key/value/attn_mask: its input nodes (or None for no mask).
    form: see the module docstring. q_shape/k_shape/v_shape: sizes, possibly symbolic (None when
    the graph carries no fake values). rewritable/reason: whether `sdpa_to_usp` can replace it, and
    why not. source: ``file:line in function`` from the node's stack trace.
    """

    node: fx.Node
    form: str
    query: fx.Node
    key: fx.Node
    value: fx.Node
    attn_mask: Any
    dropout_p: Any
    is_causal: Any
    scale: Any
    enable_gqa: bool
    q_shape: tuple[Any, ...] | None
    k_shape: tuple[Any, ...] | None
    v_shape: tuple[Any, ...] | None
    dtype: torch.dtype | None
    rewritable: bool = True
    reason: str | None = None
    source: str | None = None
    extra_outputs: tuple[fx.Node, ...] = field(default=(), repr=False)
    window: tuple[int, int] | None = None
    mask_form: MaskForm | None = None
    cross: bool = False
    regions: tuple[fx.Node, ...] = field(default=(), repr=False)
    kv_stream: bool = False
    # The (B, H, L, K) key and value a model repeated from G heads itself (transformers' repeat_kv
    # when it hands SDPA a mask): the site reads their G-head sources with enable_gqa instead, and
    # the rewrite drops the repeats once nothing reads them.
    repeated: tuple[fx.Node, ...] = field(default=(), repr=False)

    @property
    def name(self) -> str:
        return self.node.name

    @property
    def output_is_tuple(self) -> bool:
        """Post-dispatch kernels return tuples; the attention output is their item 0."""
        return self.form not in _SINGLE_OUTPUT

    def describe(self) -> str:
        """One line: name, form, shapes, flags, where it comes from and, if kept, why."""
        shapes = "x".join(str(tuple(s)) for s in (self.q_shape, self.k_shape, self.v_shape) if s is not None)
        flags = f"causal={self.is_causal} gqa={self.enable_gqa} scale={self.scale}"
        if self.window is not None:
            flags += f" window={self.window}"
        if self.mask_form is not None:
            flags += f" mask={self.mask_form.kind}"
        if self.cross:
            flags += " cross"
        if self.kv_stream:
            flags += " kv-stream"
        where = f" at {self.source}" if self.source else ""
        why = "" if self.rewritable else f" [not rewritten: {self.reason}]"
        return f"{self.name} ({self.form}) {shapes} {flags}{where}{why}"


def _bind(node: fx.Node, schema: torch._C.FunctionSchema) -> dict[str, Any]:
    """Arguments of `node` by schema name, defaults filled in."""
    bound: dict[str, Any] = {}
    for i, arg in enumerate(schema.arguments):
        if i < len(node.args):
            bound[arg.name] = node.args[i]
        elif arg.name in node.kwargs:
            bound[arg.name] = node.kwargs[arg.name]
        elif arg.has_default_value():
            bound[arg.name] = arg.default_value
        else:
            bound[arg.name] = None
    return bound


def _shape(node: Any) -> tuple[Any, ...] | None:
    val = node_value(node)
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


_known_equal = known_equal


def _site(node: fx.Node, form: str, read_masks: bool = True) -> AttentionSite:
    schema = _SDPA_SCHEMA if form == "torch" else node.target._schema
    a = _bind(node, schema)
    mask = a.get("attn_mask", a.get("attn_bias"))
    q, k, v = a["query"], a["key"], a["value"]
    qs, ks, vs = _shape(q), _shape(k), _shape(v)
    enable_gqa = bool(a.get("enable_gqa", False))
    if form not in _SINGLE_OUTPUT and qs is not None and ks is not None:
        # Post-dispatch kernels have no flag: differing head counts are GQA (the CPU kernel's native form).
        enable_gqa = len(qs) == 4 and len(ks) == 4 and not _known_equal(qs[1], ks[1])
    qval = node_value(q)
    site = AttentionSite(
        node=node,
        form=form,
        query=q,
        key=k,
        value=v,
        attn_mask=mask,
        dropout_p=a.get("dropout_p", 0.0),
        is_causal=a.get("is_causal", False),
        scale=a.get("scale"),
        enable_gqa=enable_gqa,
        q_shape=qs,
        k_shape=ks,
        v_shape=vs,
        dtype=qval.dtype if isinstance(qval, torch.Tensor) else None,
        source=source_location(node),
    )
    if site.output_is_tuple:
        # An unused getitem of another output is harmless (make_fx emits one per output).
        site.extra_outputs = tuple(
            u for u in node.users if not (u.target is operator.getitem and (u.args[1] == 0 or not u.users))
        )
    if form in _SINGLE_OUTPUT:
        _read_through_repeated_heads(site)
    if form == "window" and tuple(a["window"]) != (-1, -1):
        site.window = tuple(a["window"])
    site.reason = _why_not(site, a, read_masks)
    site.rewritable = site.reason is None
    return site


_RESHAPES = {"reshape", "view", "_unsafe_view", "unsqueeze", "getitem", "expand"}


def _op_base(node: fx.Node) -> str:
    """The op's name without overload or namespace (``reshape`` for ``aten.reshape.default``)."""
    if node.op == "call_method":
        return str(node.target)
    target = node.target
    name = getattr(target, "__name__", str(target))
    if isinstance(target, torch._ops.OpOverload):
        name = target._schema.name.split("::")[-1]
    return name.split(".")[0]


def _unrepeated(node: Any) -> tuple[fx.Node, Any] | None:
    """(source, repeats) when `node` (B, G*R, L, K) is `source` (B, G, L, K) with each head repeated
    R times in place (head h is source head h // R: enable_gqa's grouping), as transformers'
    ``repeat_kv`` builds it: a (B, G, 1, L, K) view, expanded to (B, G, R, L, K), reshaped."""
    if not isinstance(node, fx.Node) or node.op not in ("call_method", "call_function"):
        return None
    out = _shape(node)
    if out is None or len(out) != 4 or _op_base(node) not in ("reshape", "view", "_unsafe_view"):
        return None
    expanded = node.args[0] if node.args else None
    if not isinstance(expanded, fx.Node) or _op_base(expanded) != "expand":
        return None
    x5 = _shape(expanded)
    one = expanded.args[0] if expanded.args else None
    if x5 is None or len(x5) != 5 or not isinstance(one, fx.Node) or _op_base(one) not in _RESHAPES:
        return None
    y5 = _shape(one)
    sources = [n for n in one.all_input_nodes if isinstance(node_value(n), torch.Tensor)]
    if y5 is None or len(y5) != 5 or len(sources) != 1:
        return None
    src = sources[0]
    s4 = _shape(src)
    if s4 is None or len(s4) != 4:
        return None
    b, g, r, length, k = x5
    same = all(
        _known_equal(p, q)
        for p, q in (
            (y5[0], b), (y5[1], g), (y5[2], 1), (y5[3], length), (y5[4], k),
            (s4[0], b), (s4[1], g), (s4[2], length), (s4[3], k),
            (out[0], b), (out[1], g * r), (out[2], length), (out[3], k),
        )
    )  # fmt: skip
    return (src, r) if same else None


def _read_through_repeated_heads(site: AttentionSite) -> None:
    """Let the site read K/V before a model repeated their heads (same result: enable_gqa groups
    query heads exactly as the repeat did), so the kernel and the saved activations hold G heads."""
    k, v = _unrepeated(site.key), _unrepeated(site.value)
    if k is None or v is None or not _known_equal(k[1], v[1]) or _known_equal(k[1], 1):
        return
    site.repeated = (site.key, site.value)
    site.key, site.value = k[0], v[0]
    site.k_shape, site.v_shape = _shape(site.key), _shape(site.value)
    site.enable_gqa = True


def _why_not(site: AttentionSite, bound: dict[str, Any], read_masks: bool = True) -> str | None:
    """Why `sdpa_to_usp` cannot stand in for this site (None: it can)."""
    for name in ("dropout_p", "is_causal", "scale"):
        if isinstance(getattr(site, name), fx.Node):
            return f"{name} is computed in the graph; usp_graph needs it to be a constant"
    if site.dropout_p:
        return f"dropout_p={site.dropout_p}: dropout inside attention is not supported"
    if bound.get("return_debug_mask"):
        return "return_debug_mask=True: the debug mask has no varlen equivalent"
    if site.extra_outputs:
        used = ", ".join(u.name for u in site.extra_outputs)
        return (
            f"outputs other than the attention output are used (by {used}): a joint graph; rewrite "
            "the forward graph before differentiating it"
        )
    if site.q_shape is None or site.k_shape is None or site.v_shape is None:
        return "the graph carries no fake values (meta['val'] / meta['example_value']) for q, k, v"
    for name, s in (("query", site.q_shape), ("key", site.k_shape), ("value", site.v_shape)):
        if len(s) not in (3, 4):
            return f"{name} has shape {s}; usp_graph rewrites (B, H, L, K) or (B, L, K) attention"
    if not (len(site.q_shape) == len(site.k_shape) == len(site.v_shape)):
        return f"query, key, value ranks differ: {site.q_shape}, {site.k_shape}, {site.v_shape}"
    if site.dtype is not None and not site.dtype.is_floating_point:
        return f"query dtype {site.dtype} is not floating point"
    site.cross = is_cross_attention(site.query, site.key)
    if not site.cross and not _known_equal(site.q_shape[-2], site.k_shape[-2]):
        return (
            f"query length {site.q_shape[-2]} is not provably the key length {site.k_shape[-2]}, and the "
            "keys come from the query's own inputs (not cross-attention): a KV cache is not supported"
        )
    if site.attn_mask is not None:
        if not read_masks:
            return "attn_mask not read (find_sites(read_masks=False): the graph is not run)"
        why = _mask_why_not(site)
        if why is not None:
            return why
    if len(site.q_shape) == 4:
        h, g = site.q_shape[1], site.k_shape[1]
        if not _known_equal(h, g):
            if not site.enable_gqa:
                return f"query has {h} heads and key {g} without enable_gqa"
            if isinstance(h, int) and isinstance(g, int) and (g == 0 or h % g):
                return f"enable_gqa needs query heads ({h}) divisible by key/value heads ({g})"
    return None


def _mask_why_not(site: AttentionSite) -> str | None:
    """Read the site's mask as a band inside documents (`masks.mask_form`), or say why not."""
    assert site.q_shape is not None and site.k_shape is not None
    if site.is_causal:
        return "attn_mask and is_causal=True were both given"
    if site.cross:
        return "attn_mask on cross-attention (e.g. a padding mask of the conditioning); pass kv document metadata instead"
    if not isinstance(site.attn_mask, fx.Node):
        return f"attn_mask is the constant {site.attn_mask!r}"
    b, length = _int(site.q_shape[0]), _int(site.q_shape[-2])
    if b is None or length is None:
        return "attn_mask on a call whose batch or length has no example value"
    mask = site.attn_mask
    while mask.op == "placeholder" and isinstance(mask.meta.get("usp_outer"), fx.Node):
        mask = mask.meta["usp_outer"]  # a checkpointed region's input: read the mask where it is made
    form = mask_form(mask, batch=b, length=length)
    if isinstance(form, str):
        return f"attn_mask is not a document mask: {form}"
    site.mask_form = form
    site.is_causal = form.is_causal
    site.window = form.extra_window
    return None


def _int(x: Any) -> int | None:
    if isinstance(x, torch.SymInt):
        hint = x.node.hint
        return int(hint) if hint is not None else None
    return int(x)


def _strip_layout(node: Any) -> Any:
    """The node `node` moves or copies through layout ops alone (`graph_inputs.LAYOUT_OPS`), into
    the outer graph from a checkpointed region's inputs."""
    while isinstance(node, fx.Node):
        if node.op == "placeholder" and isinstance(node.meta.get("usp_outer"), fx.Node):
            node = node.meta["usp_outer"]
            continue
        if node.op not in ("call_function", "call_method"):
            break
        name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
        if isinstance(node.target, torch._ops.OpOverload):
            name = node.target._opname
        if name not in LAYOUT_OPS or not node.args or not isinstance(node.args[0], fx.Node):
            break
        node = node.args[0]
    return node


# A Dynamo source that is an argument of the compiled frame, reached by indexing only
# (L['x'], L['kwargs']['position_ids'], L['args'][1]): data. Anything reached through an attribute
# (a module's parameter, buffer or plain float attribute that automatic dynamic turned into an
# input) or a global is model state.
_ARGUMENT = re.compile(r"^L\['[^']+'\](\[[^\]]+\])*$")


def is_weight(node: fx.Node) -> bool:
    """A placeholder that holds model state (a parameter, buffer or module attribute) rather than
    data of the call: Dynamo's sources, make_fx's input tags. Scalars (0-dim) count as state too."""
    tag = node.meta.get("usp_input", {}).get("kind")
    if tag is not None:
        return tag in ("param", "buffer")
    val = node_value(node)
    if isinstance(val, torch.nn.Parameter) or (isinstance(val, torch.Tensor) and val.dim() == 0):
        return True
    source = getattr(node, "_dynamo_source", None)
    if source is None:
        return False
    text = getattr(source, "name", None)
    text = text() if callable(text) else (text or "")
    return not _ARGUMENT.match(text)


def weight_dims_of(node: Any) -> int:
    """How many trailing dims of `node` are a weight's own (`rules.weight_dims`: a parameter
    selected per token by an index, MoE experts' ``W[expert_ids]``), read back from the graph
    through layout ops (`rules.weight_dims_after`); eager `attention_mode` follows the same op by
    op (`rows.RowTracker.weight_dims`)."""
    val = node_value(node)
    if not isinstance(node, fx.Node) or not isinstance(val, torch.Tensor):
        return 0
    if node.op == "get_attr" or (node.op == "placeholder" and is_weight(node)):
        return val.dim()
    if node.op == "placeholder":
        outer = node.meta.get("usp_outer")
        return weight_dims_of(outer) if isinstance(outer, fx.Node) else 0
    name = _op_name(node) if node.op in ("call_function", "call_method") else ""
    if not node.args or not (name in WEIGHT_LAYOUT_OPS or name in ("getitem", "__getitem__", "index_select")):
        return 0
    source = node.args[0]
    sval = node_value(source)
    if not isinstance(sval, torch.Tensor):
        return 0
    if name == "index_select":
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
    else:
        dim, index = 0, node.args[1] if len(node.args) > 1 else None
    inner = weight_dims_of(source)
    found = weight_dims(name, tuple(sval.shape), index, dim) if inner == sval.dim() else 0
    if not found and name in WEIGHT_LAYOUT_OPS:
        found = weight_dims_after(name, inner, tuple(sval.shape), tuple(val.shape), node.args)
    return found


def ancestors(nodes, inputs: Any = None) -> list[fx.Node]:
    """Every node the `nodes` are computed from (themselves included), through the bodies of
    higher-order ops to the outer call's arguments (``meta["usp_outer"]``). `inputs(node)`: the
    arguments to follow (default: all of the node's inputs)."""
    seen: dict[fx.Node, None] = {}
    stack = list(nodes)
    while stack:
        n = stack.pop()
        if not isinstance(n, fx.Node) or n in seen:
            continue
        seen[n] = None
        outer = n.meta.get("usp_outer") if n.op == "placeholder" else None
        if isinstance(outer, fx.Node):
            stack.append(outer)
        stack.extend(n.all_input_nodes if inputs is None else inputs(n))
        stack.extend(writes_into(n))
    return list(seen)


def stream_inputs(node: fx.Node) -> frozenset[fx.Node]:
    """The tensor inputs of the graph (not weights, not sizes) that `node` is computed from.

    Through the body of a higher-order op (activation checkpointing) the body's placeholders stand
    for the outer call's arguments (``meta["usp_outer"]``, set by `find_sites`)."""
    seen: set[fx.Node] = set()
    found: set[fx.Node] = set()
    stack = [node]
    while stack:
        n = stack.pop()
        if n in seen:
            continue
        seen.add(n)
        if n.op == "placeholder":
            outer = n.meta.get("usp_outer")
            if isinstance(outer, fx.Node):
                stack.append(outer)
            elif isinstance(node_value(n), torch.Tensor) and not is_weight(n):
                found.add(n)
            continue
        stack.extend(n.all_input_nodes)
        stack.extend(writes_into(n))
    return frozenset(found)


def _op_name(node: fx.Node) -> str:
    if node.op == "call_method":
        return str(node.target)
    if isinstance(node.target, torch._ops.OpOverload):
        return node.target._opname
    return getattr(node.target, "__name__", "")


def writes_into(node: fx.Node) -> list[fx.Node]:
    """In-place writes into `node` or a view of it (``t[..., :k].copy_(x)``, ``t[i] = x``): what
    they write is part of what `node` holds (DeepSeek's MLA assembles its keys this way)."""
    writes, seen, stack = [], set(), [node]
    while stack:
        alias = stack.pop()
        if alias in seen:
            continue
        seen.add(alias)
        for user in alias.users:
            if user.op not in ("call_function", "call_method") or not user.args or user.args[0] is not alias:
                continue
            name = _op_name(user)
            if user.target is operator.setitem or (name.endswith("_") and not name.endswith("__")):
                writes.append(user)
            elif name in LAYOUT_OPS:
                stack.append(user)
    return writes


def provenance(node: Any) -> frozenset[fx.Node] | None:
    """The data inputs of the graph `node` is computed from (`stream_inputs`), or None when it is an
    input itself through layout ops only (its provenance is unknown): the facts
    `graph_inputs.is_cross_attention` decides from, read from the graph."""
    if not isinstance(node, fx.Node) or _strip_layout(node).op == "placeholder":
        return None
    return stream_inputs(node)


def is_cross_attention(query: Any, key: Any) -> bool:
    """Whether the keys come from another token stream than the queries, by data flow: the graph's
    reading of `graph_inputs.is_cross_attention` (eager `attention_mode` reads it op by op)."""
    if not isinstance(query, fx.Node) or not isinstance(key, fx.Node):
        return False
    qv, kv = node_value(query), node_value(key)
    if not isinstance(qv, torch.Tensor) or not isinstance(kv, torch.Tensor):
        return False
    return cross_attention_rule(provenance(query), provenance(key), qv.shape[-2], kv.shape[-2])


# Higher-order ops whose first argument is a body graph called with the remaining arguments
# (activation checkpointing as Dynamo traces `torch.utils.checkpoint`, and plain wrapping). Sites in
# their bodies are found and rewritten like any other; what they read is threaded in as operands.
_BODY_OPS = ("tag_activation_checkpoint", "wrap")


def body_call(node: fx.Node) -> fx.GraphModule | None:
    """The body GraphModule `node` calls with ``node.args[1:]``, when it is such a higher-order op."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.HigherOrderOperator):
        return None
    if node.target.name() not in _BODY_OPS or not node.args or not isinstance(node.args[0], fx.Node):
        return None
    body_ref = node.args[0]
    root = node.graph.owning_module
    if body_ref.op != "get_attr" or root is None:
        return None
    body = getattr(root, body_ref.target, None)
    return body if isinstance(body, fx.GraphModule) else None


def find_sites(gm: fx.GraphModule | fx.Graph, *, read_masks: bool = True) -> list[AttentionSite]:
    """Every SDPA call of the graph, in graph order, as `AttentionSite` records; the calls inside
    the bodies of checkpointed regions too (after the region's other sites, in body order).

    `read_masks`: read each ``attn_mask`` by running its subgraph on probe inputs
    (`masks.mask_form`). Pass False for a graph from an untrusted file (verify, inspect): a site
    with a mask is then reported as not rewritable, and nothing of the graph runs."""
    graph = gm.graph if isinstance(gm, fx.GraphModule) else gm
    sites = []
    for node in graph.nodes:
        if node.op != "call_function":
            continue
        body = body_call(node)
        if body is not None:
            sites.extend(_body_sites(node, body, read_masks))
            continue
        if isinstance(node.target, torch._ops.HigherOrderOperator) and _has_sdpa(node):
            sites.append(_hidden_site(node))
            continue
        try:
            form = SDPA_FORMS.get(node.target)
        except TypeError:  # an unhashable target
            form = None
        if form is not None:
            sites.append(_site(node, form, read_masks))
    _mark_kv_streams(sites)
    return sites


def _mark_kv_streams(sites: Sequence[AttentionSite]) -> None:
    """Mark self-attention on the key/value stream of a cross-attention site (``kv_stream``).

    An encoder-decoder computes its encoder's self-attention from the source tokens alone, and
    the decoder's cross-attention reads keys from them: that self-attention belongs to the
    conditioning stream, whose documents are `documents(meta, kv=kv_meta)`'s `kv`, not the
    query stream's. Decided by data flow like `is_cross_attention`: a self-attention site whose
    queries and keys are computed only from inputs the keys of some cross-attention site come from."""
    cross_keys = [stream_inputs(s.key) for s in sites if s.cross]
    if not cross_keys:
        return
    for site in sites:
        if site.cross or site.form == "hidden":
            continue
        own = stream_inputs(site.query) | stream_inputs(site.key)
        site.kv_stream = bool(own) and any(own <= keys for keys in cross_keys)


def _body_sites(call: fx.Node, body: fx.GraphModule, read_masks: bool) -> list[AttentionSite]:
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    operands = list(call.args[1:])
    for p, arg in zip(placeholders, operands, strict=False):
        p.meta["usp_outer"] = arg if isinstance(arg, fx.Node) else None
    sites = find_sites(body, read_masks=read_masks)
    if len(placeholders) != len(operands):
        for site in sites:
            site.rewritable = False
            site.reason = f"inside {call.name}, whose body takes {len(placeholders)} inputs for {len(operands)} operands"
    for site in sites:
        site.regions = (call, *site.regions)
    return sites


def _has_sdpa(node: fx.Node) -> bool:
    root = node.graph.owning_module
    for arg in node.args:
        if isinstance(arg, fx.Node) and arg.op == "get_attr" and root is not None:
            sub = getattr(root, arg.target, None)
            if isinstance(sub, fx.GraphModule) and find_sites(sub, read_masks=False):
                return True
    return False


def _hidden_site(node: fx.Node) -> AttentionSite:
    """A higher-order op usp_graph does not enter, with SDPA inside: reported, never ignored."""
    val = node_value(node)
    return AttentionSite(
        node=node,
        form="hidden",
        query=node,
        key=node,
        value=node,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
        q_shape=None,
        k_shape=None,
        v_shape=None,
        dtype=getattr(val, "dtype", None),
        rewritable=False,
        reason=f"attention inside the higher-order op {node.target.name()}, which usp_graph does not rewrite into",
        source=source_location(node),
    )


def describe_sites(sites: Sequence[AttentionSite]) -> str:
    """One line per site (see `AttentionSite.describe`)."""
    return "\n".join(s.describe() for s in sites)
