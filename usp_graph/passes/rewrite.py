"""The rewrite: each SDPA site -> `sdpa_to_usp`, re-traced in place.

# B batch, H query heads, G key/value heads, L sequence, K head dim, T packed tokens, N documents

Nothing here decides an op sequence: the ops that replace a site are whatever `sdpa_to_usp` runs
on the site's fake inputs (make_fx, pre-dispatch, symbolic), inlined. Eager `attention_mode` calls
the same function, which is why a replayed graph equals eager bit for bit.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.fx.experimental.proxy_tensor import make_fx

from .. import masks
from ..graph_inputs import (
    INPUT_META,
    add_metadata_inputs,
    call_tokens,
    find_kv_metadata_inputs,
    find_metadata_inputs,
    static_metadata_values,
)
from ..metadata import AttentionMetadata
from ..sdpa import sdpa_to_usp
from ..sites import AttentionSite, _shape, body_call, find_sites, node_value
from .base import PASS_META, PassContext, PassResult

__all__ = ["rewrite_sdpa", "metadata_inputs", "INPUT_META", "PASS_NAME"]

PASS_NAME = "rewrite_sdpa"
# INPUT_META (the placeholder tag) and the metadata placeholders live in usp_graph.graph_inputs.
kv_metadata_inputs = find_kv_metadata_inputs


def _usp_call(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_N1: torch.Tensor | None,
    max_seqlen: Any,
    *,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    cp: Any,
    window: tuple[int, int] | None = None,
    positions_BL: torch.Tensor | None = None,
    check_positions: bool = False,
    cu_seqlens_kv_N1: torch.Tensor | None = None,
    max_seqlen_kv: Any = None,
) -> torch.Tensor:
    world = getattr(cp, "world", 1)
    metadata = kv_metadata = None
    if cu_seqlens_N1 is None and positions_BL is not None:
        # The mask says: documents are the runs of these position ids. Derive them in the graph.
        b, length = q.shape[0], q.shape[-2]
        cu_seqlens_N1 = masks.cu_seqlens_from_positions(positions_BL.expand(b, length))
        max_seqlen = length
    elif check_positions:
        b, length = q.shape[0], q.shape[-2]
        masks.check_positions_match(cu_seqlens_N1, positions_BL.expand(b, length))
    if cu_seqlens_N1 is not None:
        # Metadata is global: under CP this call holds one of `cp.world` shards of the stream.
        metadata = AttentionMetadata(cu_seqlens_N1, max_seqlen, call_tokens(q.shape[0], q.shape[-2], world))
    if cu_seqlens_kv_N1 is not None:
        # Under CP the key/value stream of cross-attention is replicated (`cp.cross`), not sharded.
        kv_metadata = AttentionMetadata(cu_seqlens_kv_N1, max_seqlen_kv, call_tokens(k.shape[0], k.shape[-2]))
    kwargs: dict[str, Any] = {
        "is_causal": is_causal,
        "scale": scale,
        "enable_gqa": enable_gqa,
        "metadata": metadata,
    }
    # Keywords only when used: a graph made before they existed traces the same call.
    if cp is not None:
        kwargs["cp"] = cp
    if window is not None:
        kwargs["window"] = window
    if kv_metadata is not None:
        kwargs["kv_metadata"] = kv_metadata
    return sdpa_to_usp(q, k, v, **kwargs)


def _fake_mode(values: list[Any]):
    from torch._guards import detect_fake_mode

    return detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])


def metadata_inputs(
    gm: fx.GraphModule, *, metadata: AttentionMetadata | None = None, like: torch.Tensor | None = None
) -> tuple[fx.Node | None, fx.Node | None]:
    """The graph's ``cu_seqlens`` and ``max_seqlen`` placeholders, added if absent.

    Graphs from `trace_train_step` already have them (tagged ``meta["usp_input"]``). For any other
    graph (a Dynamo graph), `metadata` gives the capacity and a hint: ``cu_seqlens_N1`` becomes a
    tensor input of that fixed capacity and ``max_seqlen`` a SymInt input of the graph's ShapeEnv,
    so neither is ever baked in as a constant. Without either, (None, None): one document per row.
    Both are made by `usp_graph.graph_inputs`, as the tracer's and the compile backend's are.
    """
    cu, ms = find_metadata_inputs(gm)
    if cu is not None or metadata is None:
        return cu, ms
    if not isinstance(metadata, AttentionMetadata):
        raise TypeError(f"metadata must be a usp_graph.AttentionMetadata, got {type(metadata).__name__}")
    fake_mode = _fake_mode([like])
    if fake_mode is None or fake_mode.shape_env is None:
        raise ValueError(
            "the graph has no symbolic ShapeEnv, so max_seqlen cannot become a SymInt input; trace it "
            "with make_fx(..., tracing_mode='symbolic') or torch.compile (Dynamo always has one)"
        )
    values = static_metadata_values(fake_mode, metadata, device=like.device if like is not None else None)
    made = add_metadata_inputs(gm, values, meta={PASS_META: PASS_NAME})
    return made.cu_seqlens, made.max_seqlen


@dataclass
class _SiteInputs:
    """The graph nodes one rewritten site reads besides q, k, v (each None when unused)."""

    cu: fx.Node | None = None
    ms: fx.Node | None = None
    positions: fx.Node | None = None
    cu_kv: fx.Node | None = None
    ms_kv: fx.Node | None = None
    check_positions: bool = False

    def nodes(self) -> list[fx.Node]:
        return [n for n in (self.cu, self.ms, self.positions, self.cu_kv, self.ms_kv) if n is not None]


def _key(site: AttentionSite, inputs: _SiteInputs, cp: Any) -> tuple:
    vals = [node_value(n) for n in (site.query, site.key, site.value, *inputs.nodes())]
    shape = tuple(
        (str(v.shape), str(v.stride()), v.dtype, str(v.device)) if isinstance(v, torch.Tensor) else str(v)
        for v in vals
    )
    present = tuple(n is not None for n in (inputs.cu, inputs.positions, inputs.cu_kv))
    return (
        shape,
        site.is_causal,
        site.scale,
        site.enable_gqa,
        site.window,
        present,
        inputs.check_positions,
        id(cp),
    )


def _trace_site(site: AttentionSite, inputs: _SiteInputs, cp: Any) -> fx.GraphModule:
    kwargs = {
        "is_causal": bool(site.is_causal),
        "scale": site.scale,
        "enable_gqa": bool(site.enable_gqa),
        "cp": cp,
        "window": site.window,
        "check_positions": inputs.check_positions,
    }
    names = ["cu", "ms", "positions", "cu_kv", "ms_kv"]
    present = [name for name in names if getattr(inputs, name) is not None]

    def fn(q, k, v, *extra):
        got = dict(zip(present, extra, strict=True))
        return _usp_call(
            q,
            k,
            v,
            got.get("cu"),
            got.get("ms"),
            positions_BL=got.get("positions"),
            cu_seqlens_kv_N1=got.get("cu_kv"),
            max_seqlen_kv=got.get("ms_kv"),
            **kwargs,
        )

    vals = [node_value(n) for n in (site.query, site.key, site.value, *inputs.nodes())]
    return make_fx(fn, tracing_mode="symbolic", pre_dispatch=True)(*vals)


def _inline(graph: fx.Graph, sub: fx.GraphModule, inputs: list[fx.Node], site: AttentionSite) -> fx.Node:
    """Copy `sub`'s nodes in front of the site, its placeholders bound to `inputs`; its output node."""
    env: dict[fx.Node, fx.Node] = {}
    placeholders = list(sub.graph.find_nodes(op="placeholder"))
    assert len(placeholders) == len(inputs), (len(placeholders), len(inputs))
    env.update(zip(placeholders, inputs, strict=True))
    out = None
    with graph.inserting_before(site.node):
        for node in sub.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                out = env[node.args[0]]
                break
            new = graph.node_copy(node, lambda n: env[n])
            new.meta = dict(node.meta)
            new.meta[PASS_META] = PASS_NAME
            new.meta["usp_site"] = site.name
            if "stack_trace" in site.node.meta:
                new.meta["stack_trace"] = site.node.meta["stack_trace"]
            if "val" in new.meta and "example_value" in site.node.meta:
                new.meta["example_value"] = new.meta["val"]  # a Dynamo graph reads this key
            env[node] = new
    assert isinstance(out, fx.Node)
    return out


def _thread(
    node: fx.Node, regions: tuple[fx.Node, ...], done: dict[tuple[fx.Node, fx.Node], fx.Node]
) -> fx.Node:
    """`node` (of the outer graph) as seen inside the checkpointed regions `regions` (outermost
    first): appended to each region call's operands and to its body's placeholders, once. A node
    already inside one of the bodies (a mask's position ids the body takes itself) is threaded only
    through the regions nested in that body."""
    bodies = [body_call(call) for call in regions]
    for depth, body in enumerate(bodies):
        if body is not None and node.graph is body.graph:
            regions = regions[depth + 1 :]
            break
    for call in regions:
        if (call, node) in done:
            node = done[(call, node)]
            continue
        body = body_call(call)
        assert body is not None, call
        call.args = (*call.args, node)
        placeholders = list(body.graph.find_nodes(op="placeholder"))
        where = (
            body.graph.inserting_after(placeholders[-1])
            if placeholders
            else body.graph.inserting_before(next(iter(body.graph.nodes)))
        )
        with where:
            inner = body.graph.placeholder(node.name)
        for k in ("val", "example_value", INPUT_META):
            if k in node.meta:
                inner.meta[k] = node.meta[k]
        inner.meta["usp_outer"] = node
        inner.meta[PASS_META] = PASS_NAME
        done[(call, node)] = node = inner
    return node


def _drop_unused(node: fx.Node) -> None:
    """Erase `node` and what only it used, once nothing reads them: a recognised mask is a
    (B, 1, L, L) tensor, a gigabyte at 32K tokens, that must not be computed for nothing."""
    stack = [node]
    while stack:
        n = stack.pop()
        if n.users or n.graph.owning_module is None:
            continue
        pure_method = n.op == "call_method" and not str(n.target).endswith("_")  # x.to(...), not x.add_(...)
        if not (n.op == "call_function" or pure_method) or n.is_impure():
            continue
        inputs = n.all_input_nodes
        n.graph.erase_node(n)
        stack.extend(inputs)


def _prune_unused_operands(call: fx.Node) -> None:
    """Drop the operands of a checkpointed region whose body no longer reads them (a recognised
    mask handed to the region), and what computed only them outside: otherwise a (B, 1, L, L)
    mask would still be built every step to be passed in and ignored."""
    body = body_call(call)
    assert body is not None, call
    placeholders = list(body.graph.find_nodes(op="placeholder"))
    operands = list(call.args[1:])
    if len(placeholders) != len(operands):
        return
    keep = [not (not p.users and isinstance(a, fx.Node)) for p, a in zip(placeholders, operands, strict=True)]
    if all(keep):
        return
    call.args = (call.args[0], *(a for a, k in zip(operands, keep, strict=True) if k))
    for p, k in zip(placeholders, keep, strict=True):
        if not k:
            body.graph.erase_node(p)
    for a, k in zip(operands, keep, strict=True):
        if not k:
            _drop_unused(a)


def _replace_site(graph: fx.Graph, site: AttentionSite, out: fx.Node) -> None:
    node = site.node
    if site.output_is_tuple:
        for user in list(node.users):
            if user.target is operator.getitem and user.args[1] == 0:
                user.replace_all_uses_with(out)
            graph.erase_node(user)  # unused extra outputs (a site with used ones is not rewritable)
    else:
        node.replace_all_uses_with(out)
    graph.erase_node(node)


def keep_repeated_heads(sites: Any) -> None:
    """Sites that `find_sites` let read K/V before a model's repeat read the repeated K/V again
    (what eager `attention_mode` sees; see `rewrite_sdpa`'s `read_repeated`)."""
    for site in sites:
        if site.repeated:
            site.key, site.value = site.repeated
            site.k_shape, site.v_shape = _shape(site.key), _shape(site.value)
            site.enable_gqa, site.repeated = False, ()


def rewrite_sdpa(
    gm: fx.GraphModule,
    *,
    metadata: AttentionMetadata | None = None,
    cp: Any = None,
    positions: fx.Node | None = None,
    read_repeated: bool = True,
) -> PassResult:
    """SDPA(q_BHLK, k_BGLK, v_BGLK, is_causal, scale, enable_gqa)
    -> unpack(usp::varlen_fwd(pack(q), pack(k), pack(v), cu_seqlens_N1, cu_seqlens_N1, max_seqlen, max_seqlen))

    Each rewritable site (see `find_sites`) is replaced by the ops `sdpa_to_usp` runs on its fake
    inputs, with the graph's ``cu_seqlens_N1`` / ``max_seqlen`` inputs as its metadata (added by
    `metadata_inputs` when the graph lacks them), and `cp` forwarded when given. A site that cannot be
    rewritten stays SDPA and is returned in ``skipped`` with its reason.

    Why: varlen skips cross-document and padding work, its metadata is a graph input (boundaries
    change without retracing), and the ops it emits carry registered backward rules.

    A site whose mask is the band inside the documents of position ids (`masks.mask_form`) checks,
    in the graph, that the metadata describes those documents, or without metadata derives it from
    them. `positions` (a position-ids input of the graph) does the same for every self-attention site.

    `read_repeated`: a site whose K/V a model repeated from fewer heads reads them before the
    repeat (the kernel and its saved activations hold G heads). False keeps the repeat, as eager
    `attention_mode` sees it: the same values, but the gradient reaching the unrepeated K/V then
    has the repeat's layout, so a reduction over it (a K norm's weight gradient) adds in eager's
    order. The backend passes False for its bitwise inner compiler (aot_eager).

    matches: the number of sites rewritten.
    """
    sites = find_sites(gm)
    todo = [s for s in sites if s.rewritable]
    if not read_repeated:
        keep_repeated_heads(todo)
    cu = ms = None
    if todo:
        cu, ms = metadata_inputs(gm, metadata=metadata, like=node_value(todo[0].query))
    cu_kv, ms_kv = kv_metadata_inputs(gm)
    for site in todo:
        if site.cross and cu is not None and cu_kv is None:
            site.rewritable = False
            site.reason = (
                "cross-attention under document metadata needs the key/value stream's documents too "
                "(documents(meta, kv=kv_meta)); a graph input cu_seqlens_kv_N1 is missing"
            )
        elif site.kv_stream and cu is not None and cu_kv is None:
            site.rewritable = False
            site.reason = (
                "self-attention on the key/value stream of cross-attention (an encoder's) under document "
                "metadata needs that stream's documents (documents(meta, kv=kv_meta)); a graph input "
                "cu_seqlens_kv_N1 is missing"
            )
    todo = [s for s in sites if s.rewritable]
    skipped = tuple(s for s in sites if not s.rewritable)
    cache: dict[tuple, fx.GraphModule] = {}
    checked: set[tuple[fx.Node, fx.Node | None]] = set()
    threaded: dict[tuple[fx.Node, fx.Node], fx.Node] = {}
    for site in todo:
        site_cp = cp
        if site.kv_stream and cu is not None:
            # The key/value stream's own self-attention (an encoder's) takes its documents; under
            # context parallelism that stream is replicated on every rank (`cp.cross`), not sharded.
            inputs = _SiteInputs(cu=cu_kv, ms=ms_kv)
            site_cp = None
        else:
            inputs = _SiteInputs(cu=cu, ms=ms)
        form = site.mask_form
        pos = form.positions if form is not None and form.kind == "positions" else None
        if pos is None and positions is not None and not site.cross and not site.kv_stream:
            pos = positions
        if pos is not None:
            inputs.positions = pos
            # One check per graph and position-ids input: every site reads the same metadata.
            inputs.check_positions = inputs.cu is not None and cp is None and (pos, inputs.cu) not in checked
            checked.add((pos, inputs.cu))
        if site.cross and cu is not None:
            inputs.cu_kv, inputs.ms_kv = cu_kv, ms_kv
        key = _key(site, inputs, site_cp)
        if key not in cache:
            cache[key] = _trace_site(site, inputs, site_cp)
        extra = [_thread(n, site.regions, threaded) for n in inputs.nodes()]
        graph = site.node.graph
        out = _inline(graph, cache[key], [site.query, site.key, site.value, *extra], site)
        _replace_site(graph, site, out)
        if isinstance(site.attn_mask, fx.Node):
            _drop_unused(site.attn_mask)
        for repeated in site.repeated:  # K/V with repeated heads the site no longer reads
            _drop_unused(repeated)
    calls = {c: depth for s in todo for depth, c in enumerate(s.regions)}
    for call in sorted(calls, key=calls.get, reverse=True):  # innermost regions first
        _prune_unused_operands(call)
        body = body_call(call)
        body.graph.lint()
        body.recompile()
    gm.graph.lint()
    gm.recompile()
    gm.meta["usp_sites"] = [(s.name, s.source) for s in todo]
    gm.meta["usp_skipped"] = [(s.name, s.reason, s.source) for s in skipped]
    return PassResult(PASS_NAME, gm, len(todo), sites=tuple(todo), skipped=skipped)


def rewrite_pass(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return rewrite_sdpa(gm, metadata=ctx.metadata, cp=ctx.cp)
