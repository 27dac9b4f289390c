"""The ``usp`` Dynamo backend: rewrite every SDPA, then AOTAutograd, then an inner compiler.

    torch.compile(model, backend="usp", options={"inner": "aot_eager", "cp": cp})

For each graph Dynamo hands over (one per frame, so one per side of a graph break):

1. copy it (Dynamo keeps using its own graph after the backend returns);
2. run the first stage of the backend's `Pipeline` (`pipeline.backend_pipeline`, the type the
   tracer runs: passes named, disable-able and dumpable through options ``disable`` and
   ``dump_passes``): ``rewrite_sdpa`` appends the document metadata inputs
   (`inputs.add_metadata_inputs`) when every attention site shares one (batch, length) and runs
   the shared rewrite (`rewrite_sdpa`, which calls `sdpa_to_usp`: the op sequence eager
   `attention_mode` runs), with `cp` forwarded; ``verify_rewrite`` verifies the rewritten graph
   (no SDPA left unless reported, every usp op has a rule);
3. AOTAutograd: the backward is whatever the ops' registered rules emit (``usp::varlen_bwd``,
   adjoint collectives); the pipeline's second stage runs on the joint graph before it is
   partitioned: ``joint`` tags it (provenance), ``verify`` verifies it;
4. the inner compiler (``aot_eager`` or ``inductor``) compiles forward and backward;
5. return a function that appends the metadata of the current `documents(...)` block (or the
   per-row metadata) to Dynamo's arguments at every call.
"""

from __future__ import annotations

import dataclasses
import operator
import re
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx

from ..checkpointing import warn_side_effect_breaks
from ..passes.base import PipelineRun, tag_nodes
from ..passes.rewrite import keep_repeated_heads
from ..rules import (
    POSITIONS_IN_ATTENTION,
    ROW_POSITIONS,
    SEQUENCE_CONTRACTION,
    SEQUENCE_CONVOLUTION,
    contraction_length,
    convolution_length,
    counts_along_row,
    is_position_candidate,
    is_row_length,
    is_score_softmax,
    positions_count_along_row,
    sequence_join_length,
    value_arguments,
)
from ..sites import (
    ancestors,
    body_call,
    find_sites,
    node_value,
    source_location,
    stream_inputs,
    weight_dims_of,
)
from .arguments import argument_names, find_argument
from .documents import mask_like, note_graph_masks
from .dump import AOT_GRAPHS, GraphDump, site_record, usp_op_counts
from .inputs import MetadataFeed, check_not_guarded, metadata_hints, shared_rows
from .joint import input_requires_grad
from .options import UspOptions
from .pipeline import GRAPH_STAGE, JOINT_STAGE, CompileContext

__all__ = ["usp_backend", "CompileReport"]


@dataclass(frozen=True)
class CompileReport:
    """What the backend did with one Dynamo graph (passed to ``options["on_compile"]``).

    graph: Dynamo's compile id (``"frame/compile"``). rewritten / kept: attention sites turned into
    usp ops / left as SDPA, as ``AttentionSite.describe()`` lines (kept ones say why).
    metadata: ``"inputs"`` (cu_seqlens/max_seqlen are graph inputs fed per call), ``"per_row"``
    (sites differ in batch/length: per-row metadata inside the graph, `documents` refused) or
    ``"none"`` (no attention rewritten). inner: the inner compiler ("auto" resolved). seconds: rewrite
    + AOTAutograd + inner compile (a backward compiled lazily is not included). dump: the dump directory
    or None. graphs: the graphs AOTAutograd made (``joint``, ``forward``, ``backward``, ``inference``) by the
    time the compile returned. usp_ops: per phase of the joint graph (``"forward"``/``"backward"``;
    ``"inference"`` without grad), usp op name -> count: the ops and adjoint collectives autograd
    emitted from the registered rules. passes: each pass of the backend's pipeline that ran by
    then -> its match count (``rewrite_sdpa``: sites rewritten; ``joint``: backward nodes
    attributed to a forward node; the verify passes: forward ops paired, as in the tracer).
    checkpointed: how many of the rewritten sites are inside checkpointed regions.
    """

    graph: str
    rewritten: tuple[str, ...]
    kept: tuple[str, ...]
    metadata: str
    inner: str
    cp: str | None
    seconds: float
    dump: str | None = None
    graphs: tuple[str, ...] = field(default=())
    usp_ops: dict[str, dict[str, int]] = field(default_factory=dict)
    passes: dict[str, int] = field(default_factory=dict)
    checkpointed: int = 0


def usp_backend(
    gm: fx.GraphModule,
    example_inputs: Sequence[Any],
    *,
    options: Mapping[str, Any] | UspOptions | None = None,
    **kwargs: Any,
) -> Callable[..., Any]:
    """The ``"usp"`` backend: ``torch.compile(model, backend="usp", options={...})``.

    Options (`UspOptions`): ``cp``, ``inner``, ``dump_dir``, ``verify``, ``disable``,
    ``dump_passes``, ``on_compile``, ``documents``, ``max_docs``.
    Per-call document boundaries come from `usp_graph.documents`.
    """
    if kwargs:
        raise TypeError(
            f"backend 'usp' takes its settings as options={{...}} (valid keys: {UspOptions.keys()}), not "
            f"{sorted(kwargs)}; torch.compile's mode= is not supported"
        )
    opts = UspOptions.parse(options)
    return _Compile(gm, list(example_inputs), opts).run()


def _copy(gm: fx.GraphModule) -> fx.GraphModule:
    """A new GraphModule over a copy of `gm`'s graph, keeping what AOTAutograd reads from Dynamo's."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    out = graph.graph_copy(gm.graph, env)
    graph.output(out)
    for old, new in env.items():
        if old.op == "placeholder":
            new._dynamo_source = getattr(old, "_dynamo_source", None)
    copy = fx.GraphModule(gm, graph)
    copy.meta.update(gm.meta)
    # Bodies of checkpointed regions are rewritten in place: give the copy its own.
    for name, sub in list(copy.named_children()):
        if isinstance(sub, fx.GraphModule):
            setattr(copy, name, _copy(sub))
    if hasattr(gm, "_param_name_to_source"):
        copy._param_name_to_source = gm._param_name_to_source
    return copy


def _fake_mode_and_env(values: Sequence[Any]):
    from torch._guards import TracingContext, detect_fake_mode

    fake_mode = detect_fake_mode([v for v in values if isinstance(v, torch.Tensor)])
    if fake_mode is None:
        ctx = TracingContext.try_get()
        fake_mode = ctx.fake_mode if ctx is not None else None
    if fake_mode is None or fake_mode.shape_env is None:
        raise ValueError(
            "the usp backend needs Dynamo's fake tensors and ShapeEnv; call it through torch.compile(backend='usp')"
        )
    return fake_mode, fake_mode.shape_env


class _Compile:
    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], opts: UspOptions) -> None:
        self.dynamo_gm = gm
        self.example_inputs = example_inputs
        self.opts = opts
        compile_id = gm.meta.get("dynamo_compile_id")
        self.name = str(compile_id) if compile_id is not None else "?"
        self.dump: GraphDump | None = None
        self.graphs: list[str] = []
        self.trained = False
        self.input_info: list[dict[str, Any]] = []
        self.requires_grad: list[bool] = []
        self.usp_ops: dict[str, dict[str, int]] = {}
        self.pipeline = opts.pipeline()
        self.inner = opts.inner_for(example_inputs)  # "auto": inductor on CUDA, else aot_eager
        # aot_eager promises eager attention_mode's bits: keep repeated K/V as eager sees them
        self.ctx = CompileContext(cp=opts.cp, read_repeated=self.inner != "aot_eager")
        self.passes: PipelineRun | None = None

    # -- hooks the inner compilers call ----------------------------------------------------------

    def on_joint(self, joint: fx.GraphModule) -> None:
        self.trained = True
        # AOTAutograd traced this graph: its nodes keep the tags provenance gives them, no usp_pass.
        self.pipeline.run(joint, self.ctx, only=JOINT_STAGE, into=self.passes, tag=False)
        self.usp_ops = usp_op_counts(joint)
        self._record("joint", joint)

    def on_graph(self, kind: str, gm: fx.GraphModule) -> None:
        if kind == "forward" and not self.trained:
            kind = "inference"
            self.usp_ops = usp_op_counts(gm, phase="inference")
        self.pipeline.run(gm, self.ctx, only=GRAPH_STAGE, into=self.passes, tag=False)
        self._record(kind, gm)

    def _record(self, name: str, gm: fx.GraphModule) -> None:
        self.graphs.append(name)
        if self.dump is not None:
            self.dump.graph(name, gm, _aot_inputs(gm, self.input_info) if name in AOT_GRAPHS else None)

    # -- the compile -----------------------------------------------------------------------------

    def run(self) -> Callable[..., Any]:
        """Rewrite Dynamo's graph (its sites, the documents it reads), compile it with the inner
        compiler, and wrap it with the feed of per-call metadata."""
        start = time.perf_counter()
        opts = self.opts
        gm = _copy(self.dynamo_gm)
        tag_nodes(gm, "trace")
        values = [node_value(p) for p in gm.graph.find_nodes(op="placeholder")]
        fake_mode, env = _fake_mode_and_env(values)
        world = opts.cp.world if opts.cp is not None else 1
        rewrite = self.pipeline.enabled("rewrite_sdpa")
        sites, todo, kept = self._sites(gm, rewrite)
        if opts.dump_dir is not None:
            self._start_dump(gm, sites)
        mode, rows, positions, cross, kv_length = self._plan_documents(gm, todo, world)
        ctx = self.ctx
        device = node_value(todo[0].query).device if todo else None
        ctx.shape_env, ctx.fake_mode, ctx.device, ctx.positions = env, fake_mode, device, positions
        if mode == "inputs":
            ctx.capacity, ctx.max_seqlen = metadata_hints(rows, world)
            ctx.kv_max_seqlen = _hint(kv_length) if kv_length is not None else None
        if self.dump is not None and self.pipeline.dump:
            self.pipeline = self.pipeline.with_dump(self.dump.dir, only=self.pipeline.dump)
        self.passes = self.pipeline.run(gm, ctx, only=["rewrite_sdpa"])
        if rewrite:
            assert self.passes.result("rewrite_sdpa").matches == len(todo), (self.passes.matches, len(todo))
        extra: list[Any] = ctx.metadata_inputs.values if ctx.metadata_inputs is not None else []
        symbols = ctx.metadata_inputs.symbols if ctx.metadata_inputs is not None else frozenset()
        names = ["cu_seqlens", "max_seqlen", "cu_seqlens_kv", "max_seqlen_kv"][: len(extra)]
        if self.dump is not None:
            self.dump.update(metadata={"mode": mode, "inputs": names})
            self.dump.graph("rewritten", gm)
        self.pipeline.run(gm, ctx, only=["verify_rewrite"], into=self.passes)

        inputs = self.example_inputs + extra
        self.input_info = _input_info(self.dynamo_gm, self.example_inputs) + [
            {"name": name, "role": "metadata"} for name in names
        ]
        # Primal i of the joint graph is input i (no parameters are lifted: Dynamo makes them inputs).
        self.requires_grad = input_requires_grad(inputs)
        ctx.requires_grad = self.requires_grad
        compiled = _INNER[self.inner](gm, inputs, self)
        if symbols:
            check_not_guarded(env, symbols, self.name)
        feed = MetadataFeed(
            graph=self.name,
            mode=mode,
            rows=rows,
            values=values,
            shape_env=env,
            world=world,
            device=device,
            kept=kept,
            row_positions=_row_position_embeddings(gm, todo, self.example_inputs, world=world),
            other_attention=_attention_without_sdpa(gm, todo),
            joined=_joined_sequences(gm, todo),
            positions=_placeholder_index(self.dynamo_gm, positions),
            positions_by=(
                f"option documents={opts.documents!r}"
                if opts.documents is not None
                else "the mask built from them"
            ),
            capacity=opts.max_docs + 1 if opts.max_docs is not None else None,
            kv_length=kv_length,
            cross=[s.name for s in cross],
            cp=opts.cp,
        )
        self._report(time.perf_counter() - start, todo, kept, mode)
        # The compiled function keeps this object (AOTAutograd compiles the backward later, through
        # its hooks): it must not keep the first call's tensors, the activations (and the autograd
        # graphs) Dynamo handed over as examples, for as long as the compiled graph lives.
        self.example_inputs = []
        return _with_metadata(compiled, feed, _mask_outputs(self.dynamo_gm))

    def _sites(self, gm: fx.GraphModule, rewrite: bool) -> tuple[list[Any], list[Any], list[Any]]:
        """(every attention site, those the rewrite replaces, those kept as SDPA: refused under CP,
        else warned about)."""
        sites = find_sites(gm)
        warn_side_effect_breaks()  # checkpointed regions Dynamo left out: usp never sees them
        if not self.ctx.read_repeated:  # described as the rewrite will run them
            keep_repeated_heads(sites)
        if not rewrite:  # reported like any site the rewrite cannot replace
            sites = [
                dataclasses.replace(s, rewritable=False, reason="pass rewrite_sdpa is disabled")
                for s in sites
            ]
        todo = [s for s in sites if s.rewritable]
        kept = [s for s in sites if not s.rewritable]
        if self.opts.cp is not None and kept:
            raise ValueError(
                "under context parallelism every SDPA must be rewritten (a plain SDPA would attend within this "
                "rank's shard only), but these cannot be: " + "; ".join(s.describe() for s in kept)
            )
        if kept:
            # Reported, not silent: these keep SDPA's one-document-per-row semantics.
            warnings.warn(
                f"usp backend: graph {self.name} keeps {len(kept)} SDPA call(s) as SDPA, and calling it inside "
                "usp_graph.documents(...) will raise: " + "; ".join(s.describe() for s in kept),
                stacklevel=3,
            )
        return sites, todo, kept

    def _start_dump(self, gm: fx.GraphModule, sites: list[Any]) -> None:
        opts = self.opts
        self.dump = GraphDump(
            opts.dump_dir,
            self.dynamo_gm.meta.get("dynamo_compile_id"),
            {
                "graph": self.name,
                "inner": self.inner,
                "verify": opts.verify,
                "cp": _cp_record(opts.cp),
                "sites": [site_record(s, s.rewritable) for s in sites],
            },
        )
        self.dump.graph("dynamo", gm)

    def _plan_documents(self, gm: fx.GraphModule, todo: list[Any], world: int):
        """How the compiled graph learns its documents: (mode: "inputs" (metadata as graph inputs),
        "per_row" or "none"; the shared rows; the position-ids input of option documents; the
        cross-attention sites; the key/value stream's length)."""
        # Self-attention on the key/value stream of cross-attention (an encoder's) takes that stream's
        # documents: its shape is the key stream's, not the queries'.
        query_stream = [s for s in todo if not s.kv_stream]
        rows = shared_rows(query_stream) if query_stream else None
        mode = "none" if not todo else ("inputs" if rows is not None else "per_row")
        positions = _positions_input(gm, query_stream, self.opts, self.name)
        if positions is not None and mode == "per_row":
            raise ValueError(
                f"graph {self.name}: its attention calls differ in batch size or length, so the documents of "
                f"{positions.name} cannot describe them all; call them with equal shapes or drop option 'documents'"
            )
        cross = [s for s in todo if s.cross]
        kv_length = _kv_length(cross, self.name) if cross and mode == "inputs" else None
        if kv_length is not None and not _kv_stream_rows_match(todo, rows[0], kv_length):
            mode = "per_row"  # documents(...) then raises, naming the shapes that differ
            kv_length = None
        return mode, rows, positions, cross, kv_length

    def _report(self, seconds: float, todo: list[Any], kept: list[Any], mode: str) -> None:
        """The `CompileReport` of this compile, to options ``on_compile`` (and the dump's manifest)."""
        opts = self.opts
        report = CompileReport(
            graph=self.name,
            rewritten=tuple(s.describe() for s in todo),
            kept=tuple(s.describe() for s in kept),
            metadata=mode,
            inner=self.inner,
            cp=repr(opts.cp) if opts.cp is not None else None,
            seconds=seconds,
            dump=str(self.dump.dir) if self.dump is not None else None,
            graphs=tuple(self.graphs),
            usp_ops=self.usp_ops,
            passes=self.passes.matches,
            checkpointed=sum(1 for s in todo if s.regions),
        )
        if self.dump is not None:
            self.dump.update(compile_seconds=seconds)
        if opts.on_compile is not None:
            opts.on_compile(report)


def _row_position_embeddings(
    gm: fx.GraphModule, sites: Sequence[Any], example_inputs: Sequence[Any] = (), *, world: int = 1
) -> list[str]:
    """What counts or mixes tokens along the whole row outside attention, which packed documents
    (and a rank's shard of the row) cannot restart, read from the graph for the rules of
    `usp_graph.graph_inputs` (eager `attention_mode` applies the same ones op by op):

    - an embedding lookup, its index as long as an attention call's sequence, whose values on the
      call's example inputs count along the row (`graph_inputs.positions_count_along_row`: arange,
      a cumsum of ones, a slice of the model's own position table, with any offset), unless an
      input they come from counts so itself (the caller's position ids);
    - a 1-D convolution with a kernel wider than one along such a sequence
      (`graph_inputs.convolution_length`: the short causal convolutions of hybrid models, LFM2's).

    `MetadataFeed` refuses them under packed documents and context parallelism. Described as
    ``name at file:line`` and what it does."""
    lengths = [s.q_shape[-2] for s in sites] + [s.k_shape[-2] for s in sites]
    graphs = _graphs_with_bodies(gm.graph)  # a checkpointed region's body hides its ops
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    concrete = _Concrete(dict(zip(placeholders, example_inputs, strict=False)) if example_inputs else {})
    found = []
    embeddings = [
        n for g in graphs for n in g.find_nodes(op="call_function", target=torch.nn.functional.embedding)
    ]
    for node in embeddings:
        index = node.args[0] if node.args else node.kwargs.get("input")
        val = node_value(index)
        if not isinstance(index, fx.Node) or not isinstance(val, torch.Tensor) or val.is_floating_point():
            continue
        if val.dim() == 0 or not is_row_length(val.shape[-1], lengths):
            continue
        passed = {x.shape[-1] for p in stream_inputs(index) if counts_along_row(x := concrete.input(p))}
        if positions_count_along_row(concrete(index), passed, world):
            where = source_location(node)
            found.append(f"{node.name}" + (f" at {where}" if where else "") + f" {ROW_POSITIONS}")
    found += _positions_in_attention(sites, concrete, world)
    convs = (torch.conv1d, torch.nn.functional.conv1d)
    for node in (n for g in graphs for n in g.nodes):
        if node.op != "call_function" or node.target not in convs or not node.args:
            continue
        x = node_value(node.args[0])
        w = node_value(node.args[1] if len(node.args) > 1 else node.kwargs.get("weight"))
        if not isinstance(x, torch.Tensor) or not isinstance(w, torch.Tensor):
            continue
        length = convolution_length(tuple(x.shape), tuple(w.shape))
        if length is not None and is_row_length(length, lengths):
            where = source_location(node)
            found.append(f"{node.name}" + (f" at {where}" if where else "") + f" {SEQUENCE_CONVOLUTION}")
    # a token length of the call: an attention site's, or dim 1 of a data input (as for attention
    # computed without SDPA): linear attention may be the only attention of the graph
    data_lengths = list(lengths) + [
        v.shape[1]
        for p in placeholders
        if isinstance(v := node_value(p), torch.Tensor) and v.dim() >= 2 and stream_inputs(p)
    ]
    matmuls = (torch.matmul, torch.bmm, operator.matmul)
    for node in (n for g in graphs for n in g.nodes):
        is_matmul = (node.op == "call_function" and node.target in matmuls) or (
            node.op == "call_method" and node.target in ("matmul", "bmm", "__matmul__")
        )
        if not is_matmul or len(node.args) < 2:
            continue
        a, b = node.args[:2]
        va, vb = node_value(a), node_value(b)
        if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
            continue
        if not (
            isinstance(va, torch.Tensor) and isinstance(vb, torch.Tensor) and va.dim() >= 2 and vb.dim() >= 3
        ):
            continue
        if not (stream_inputs(a) and stream_inputs(b)):  # both from the data, not a weight
            continue
        length = contraction_length(tuple(va.shape), tuple(vb.shape), weight_dims_of(a), weight_dims_of(b))
        if length is not None and is_row_length(length, data_lengths):
            where = source_location(node)
            found.append(f"{node.name}" + (f" at {where}" if where else "") + f" {SEQUENCE_CONTRACTION}")
    return found


class _Concrete:
    """Concrete values of small subgraphs, computed from the example inputs Dynamo compiles with
    (real tensors): what eager `attention_mode` sees as values, for the rules that read values
    (`graph_inputs.positions_count_along_row`). None where a value cannot be had cheaply and
    safely: an op writing in place, a higher-order op, a subgraph of more than `budget` nodes."""

    def __init__(self, examples: Mapping[fx.Node, Any], budget: int = 96) -> None:
        self.values: dict[fx.Node, Any] = {}
        for p, x in examples.items():
            if isinstance(x, torch.SymInt):
                x = _hint(x)
            self.values[p] = x
        self.budget = budget

    def input(self, node: fx.Node) -> Any:
        return self.values.get(node)

    def __call__(self, node: fx.Node) -> Any:
        try:
            with torch.no_grad():
                return self._eval(node, [self.budget])
        except Exception:  # no value: no evidence either way
            return None

    def _eval(self, node: Any, budget: list[int]) -> Any:
        if not isinstance(node, fx.Node):
            return node
        if node in self.values:
            return self.values[node]
        if node.op == "placeholder":
            outer = node.meta.get("usp_outer")
            if not isinstance(outer, fx.Node):
                raise LookupError(node.name)
            value = self._eval(outer, budget)
        elif node.op in ("call_function", "call_method"):
            budget[0] -= 1
            name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
            if budget[0] < 0 or isinstance(node.target, torch._ops.HigherOrderOperator):
                raise LookupError(node.name)
            if name.endswith("_") and not name.endswith("__"):
                raise LookupError(node.name)
            args = fx.node.map_arg(node.args, lambda n: self._eval(n, budget))
            kwargs = fx.node.map_arg(node.kwargs, lambda n: self._eval(n, budget))
            if node.op == "call_function":
                value = node.target(*args, **kwargs)
            else:
                value = getattr(args[0], node.target)(*args[1:], **kwargs)
        else:
            raise LookupError(node.name)
        self.values[node] = value
        return value


_SOFTMAX_TARGETS = {torch.softmax, torch.nn.functional.softmax, torch.special.softmax, torch._softmax}


def _attention_without_sdpa(gm: fx.GraphModule, sites: Sequence[Any]) -> list[str]:
    """Attention the graph computes without SDPA (`graph_inputs.is_score_softmax`: a softmax over
    (..., A, A) scores, A a sequence length of the call; flex_attention), which `MetadataFeed`
    refuses under packed documents and context parallelism: usp rewrites SDPA only. A sequence
    length is an attention site's, or dim 1 of an input of two or more dims (tokens, embeddings)."""
    lengths = [s.q_shape[-2] for s in sites]
    key_lengths = []  # keys onto another stream (a prompt's tokens, an encoder's states): batch inputs only
    for p in gm.graph.find_nodes(op="placeholder"):
        val = node_value(p)
        if isinstance(val, torch.Tensor) and val.dim() >= 2:
            lengths.append(val.shape[1])
            source = getattr(p, "_dynamo_source", None)
            text = getattr(source, "name", None)
            text = text() if callable(text) else (text or p.name)
            if (
                not isinstance(val, torch.nn.Parameter)
                and "._parameters[" not in text
                and "._buffers[" not in text
            ):
                key_lengths.append(val.shape[1])
    found = []
    for node in (n for g in _graphs_with_bodies(gm.graph) for n in g.nodes):
        where = source_location(node)
        at = f" at {where}" if where else ""
        if node.op == "call_function" and getattr(node.target, "__name__", "") == "flex_attention":
            found.append(f"{node.name}{at}: flex_attention")
            continue
        is_softmax = (node.op == "call_function" and node.target in _SOFTMAX_TARGETS) or (
            node.op == "call_method" and node.target == "softmax"
        )
        if not is_softmax or not node.args:
            continue
        x = node_value(node.args[0])
        dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", -1)
        if (
            isinstance(x, torch.Tensor)
            and isinstance(dim, int)
            and is_score_softmax(tuple(x.shape), dim, lengths, key_lengths)
        ):
            found.append(f"{node.name}{at}: a softmax over {tuple(x.shape)} attention scores")
    return found


_CAT_TARGETS = {torch.cat, torch.concat, torch.concatenate, torch.ops.aten.cat.default}
_REORDER_TARGETS = {torch.index_select, torch.gather, torch.take_along_dim}
_REORDER_METHODS = {"index_select", "gather"}


def _joined_sequences(gm: fx.GraphModule, sites: Sequence[Any]) -> list[str]:
    """Attention calls whose queries or keys are computed from token streams concatenated along
    the sequence (`graph_inputs.sequence_join_length`: joint attention) and not put back in
    document order after (an index_select / gather along that sequence, or indexing by a tensor),
    followed forward through the graph; `MetadataFeed` warns about them under packed documents.
    Eager `attention_mode` follows the same rule op by op."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    joined: dict[fx.Node, list[tuple[Any, fx.Node]]] = {}  # node -> [(joined length, the cat)]
    for node in gm.graph.nodes:
        inherited: list[tuple[Any, fx.Node]] = []
        for a in node.all_input_nodes:
            inherited += [j for j in joined.get(a, []) if all(j[1] is not c for _, c in inherited)]
        target, method = node.target, node.target if node.op == "call_method" else None
        if node.op == "call_function" and target in _CAT_TARGETS and node.args:
            pieces = node.args[0] if isinstance(node.args[0], (list, tuple)) else ()
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            out = node_value(node)
            vals = [node_value(p) for p in pieces]
            if (
                isinstance(out, torch.Tensor)
                and isinstance(dim, int)
                and all(isinstance(v, torch.Tensor) and v.dim() == out.dim() for v in vals)
            ):
                length = sequence_join_length(tuple(out.shape), dim, [v.shape[dim] for v in vals])
                if length is not None:
                    inherited.append((length, node))
        elif inherited and (
            (node.op == "call_function" and target in _REORDER_TARGETS) or method in _REORDER_METHODS
        ):
            x = node_value(node.args[0]) if node.args else None
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
            if isinstance(x, torch.Tensor) and isinstance(dim, int):
                inherited = [(n, c) for n, c in inherited if not statically_known_true(n == x.shape[dim])]
        elif inherited and node.op == "call_function" and target is operator.getitem and len(node.args) > 1:
            index = node.args[1] if isinstance(node.args[1], (list, tuple)) else (node.args[1],)
            if any(
                isinstance(i, fx.Node)
                and isinstance(v := node_value(i), torch.Tensor)
                and v.dtype != torch.bool
                for i in index
            ):
                inherited = []
        if inherited:
            joined[node] = inherited
    found = []
    for site in sites:
        for x, shape in ((site.query, site.q_shape), (getattr(site, "key", None), site.k_shape)):
            if x is None or shape is None:
                continue
            for length, cat in joined.get(x, []):
                if statically_known_true(length == shape[-2]):
                    where = source_location(cat)
                    found.append(
                        f"{cat.name}"
                        + (f" at {where}" if where else "")
                        + f" joins {length} tokens, attended by {site.name}"
                    )
    return sorted(set(found))


def _graphs_with_bodies(graph: fx.Graph) -> list[fx.Graph]:
    """`graph` and the bodies of the higher-order ops it calls (checkpointed regions), nested."""
    out, stack = [], [graph]
    while stack:
        g = stack.pop()
        out.append(g)
        for node in g.nodes:
            body = body_call(node)
            if body is not None:
                stack.append(body.graph)
    return out


def _positions_in_attention(sites: Sequence[Any], concrete: _Concrete, world: int) -> list[str]:
    """Positions counted along the row by the model (`graph_inputs.positions_count_along_row`, on
    the values `concrete` computes) that the queries or keys of an attention call are computed from:
    the rotary positions of a decoder called without position ids, counted over the packed row (or
    the rank's shard). Described as ``name at file:line``, the first node of each such chain."""
    lengths = [s.q_shape[-2] for s in sites] + [s.k_shape[-2] for s in sites]
    flagged: dict[fx.Node, None] = {}
    for n in _value_ancestors([x for site in sites for x in (site.query, site.key)]):  # one walk for all
        val = node_value(n)
        if not isinstance(val, torch.Tensor) or val.dim() == 0 or not is_row_length(val.shape[-1], lengths):
            continue
        if not is_position_candidate(tuple(val.shape), val.is_floating_point()):
            continue
        passed = {x.shape[-1] for p in stream_inputs(n) if counts_along_row(x := concrete.input(p))}
        if positions_count_along_row(concrete(n), passed, world):
            flagged[n] = None
    found = []
    for n in flagged:
        if any(a in flagged for a in _value_ancestors(n.all_input_nodes)):
            continue  # reported where the chain starts
        where = source_location(n)
        found.append(f"{n.name}" + (f" at {where}" if where else "") + f" {POSITIONS_IN_ATTENTION}")
    return found


def _value_inputs(n: fx.Node) -> list[Any]:
    """A node's arguments its values are computed from: not the index argument of a call that
    selects by it (`graph_inputs.value_arguments`)."""
    if n.op not in ("call_function", "call_method"):
        return n.all_input_nodes
    name = n.target if n.op == "call_method" else getattr(n.target, "__name__", "")
    if isinstance(n.target, torch._ops.OpOverload):
        name = n.target._opname
    found: list[Any] = []
    fx.node.map_arg(value_arguments(str(name), n.args, n.kwargs, _node_shape), found.append)
    return found


def _value_ancestors(nodes: Sequence[Any]) -> list[fx.Node]:
    """`sites.ancestors` through `_value_inputs`: what the values of `nodes` are computed from."""
    return ancestors(nodes, _value_inputs)


def _node_shape(x: Any) -> tuple[Any, ...] | None:
    val = node_value(x) if isinstance(x, fx.Node) else None
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _positions_input(gm: fx.GraphModule, sites: Sequence[Any], opts: UspOptions, name: str) -> fx.Node | None:
    """The placeholder whose position ids define documents outside `documents(...)`: the input
    that recognised masks are built from, or the argument named by option ``documents``."""
    from_masks = {
        _outermost(s.mask_form.positions)
        for s in sites
        if s.mask_form is not None and s.mask_form.kind == "positions"
    }
    named = None
    if opts.documents is not None and sites:
        named = find_argument(gm, opts.documents)
        if named is None:
            raise ValueError(
                f"option documents={opts.documents!r}: graph {name} has attention calls but no argument "
                f"{opts.documents!r} (arguments: {argument_names(gm)}); pass the position ids to the compiled "
                "function on every call, by that name (or positionally to a module's forward)"
            )
        val = node_value(named)
        if not isinstance(val, torch.Tensor) or val.is_floating_point() or val.dim() not in (1, 2):
            raise ValueError(
                f"option documents={opts.documents!r}: that argument must be integer position ids of shape (B, L) "
                f"or (L,), got {getattr(val, 'dtype', type(val).__name__)} {tuple(getattr(val, 'shape', ()))}"
            )
    found = from_masks | ({named} if named is not None else set())
    if len(found) > 1:
        raise ValueError(
            f"graph {name}: documents would come from several inputs ({sorted(n.name for n in found)}); usp_graph "
            "reads them from one position-ids input"
        )
    return next(iter(found), None)


def _outermost(node: fx.Node) -> fx.Node:
    """The graph's own node that a checkpointed region's body input stands for (each region's body
    takes the position ids as an input of its own: one input of the graph, not one per region)."""
    while node.op == "placeholder" and isinstance(node.meta.get("usp_outer"), fx.Node):
        node = node.meta["usp_outer"]
    return node


def _placeholder_index(gm: fx.GraphModule, node: fx.Node | None) -> int | None:
    if node is None:
        return None
    names = [p.name for p in gm.graph.find_nodes(op="placeholder")]
    return names.index(node.name)


def _hint(x: Any) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def _kv_stream_rows_match(sites: Sequence[Any], batch: Any, kv_length: Any) -> bool:
    """Every key/value-stream self-attention site has the cross-attention keys' (B, L)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return all(
        statically_known_true(s.q_shape[0] == batch) and statically_known_true(s.q_shape[-2] == kv_length)
        for s in sites
        if s.kv_stream
    )


def _kv_length(cross: Sequence[Any], name: str) -> Any:
    """The key length every cross-attention site shares (one conditioning stream)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    length = cross[0].k_shape[-2]
    for site in cross[1:]:
        if not statically_known_true(site.k_shape[-2] == length):
            raise ValueError(
                f"graph {name}: cross-attention calls read key streams of different lengths ({length} and "
                f"{site.k_shape[-2]}); usp_graph takes one key/value document set per graph (documents(meta, kv=...))"
            )
    return length


_PATH = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]")
_LOCAL = re.compile(r"^L\['(?:kwargs'\]\[')?([^']+)'\]$")  # L['x'] and L['kwargs']['x']


def _input_info(dynamo_gm: fx.GraphModule, example_inputs: Sequence[Any]) -> list[dict[str, Any]]:
    """What each of Dynamo's graph inputs is: a parameter (by its module path), a buffer, or batch."""
    out = []
    for p, x in zip(dynamo_gm.graph.find_nodes(op="placeholder"), example_inputs, strict=False):
        source = getattr(p, "_dynamo_source", None)
        text = getattr(source, "name", None)
        text = text() if callable(text) else (text or p.name)
        path = _PATH.findall(text)
        local = _LOCAL.match(text)
        info: dict[str, Any] = {"name": ".".join(path) if path else (local.group(1) if local else text)}
        if isinstance(x, torch.nn.Parameter) or "._parameters[" in text:
            info.update(role="parameter", trainable=bool(getattr(x, "requires_grad", False)))
        elif "._buffers[" in text:
            info["role"] = "buffer"
        else:
            info["role"] = "batch"
        out.append(info)
    return out


def _aot_inputs(gm: fx.GraphModule, info: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Name and role of each placeholder of an AOTAutograd graph: ``primals_N`` / ``argN_1`` are the
    backend's inputs, ``tangents_N`` the output gradients, anything else a saved activation."""
    out = []
    for p in gm.graph.find_nodes(op="placeholder"):
        m = re.fullmatch(r"primals_(\d+)|arg(\d+)_1", p.name)
        i = (int(m.group(1)) - 1 if m.group(1) else int(m.group(2))) if m else None
        if i is not None and 0 <= i < len(info):
            out.append(dict(info[i]))
        elif p.name.startswith("tangents_"):
            out.append({"name": p.name, "role": "tangent"})
        else:
            out.append({"name": p.name, "role": "input"})
    return out


def _cp_record(cp: Any) -> dict[str, Any] | None:
    if cp is None:
        return None
    return {
        "strategy": cp.strategy,
        "world": cp.world,
        "rank": cp.rank,
        "load_balance": cp.load_balance,
        "ulysses_degree": cp.ulysses_degree,
        "head_groups": getattr(cp, "head_groups", 1),
        "group": cp.group_name,
    }


def _mask_outputs(gm: fx.GraphModule) -> tuple[int, ...]:
    """Indices of the graph's outputs that may be attention masks (`documents.mask_like`): code
    after a graph break gets them, and an SDPA call there runs on them eagerly."""
    outputs = gm.graph.output_node().args[0]
    if not isinstance(outputs, (tuple, list)):
        return ()
    return tuple(i for i, n in enumerate(outputs) if isinstance(n, fx.Node) and mask_like(node_value(n)))


def _with_metadata(
    compiled: Callable[..., Any], feed: MetadataFeed, masks: tuple[int, ...] = ()
) -> Callable[..., Any]:
    """Dynamo's arguments -> the compiled graph's: its own plus the metadata of this call. The
    outputs at `masks` are marked as masks usp built (an eager SDPA on one is named)."""
    # Dynamo calls a backend's result with positional arguments, as is aot_module_simplified's
    # result called (whatever its copied `_boxed_call` attribute says).

    if masks:

        def usp_compiled(*args: Any) -> Any:
            out = compiled(*args, *feed(args))
            note_graph_masks(out, masks)
            return out

    else:

        def usp_compiled(*args: Any) -> Any:
            return compiled(*args, *feed(args))

    usp_compiled.feed = feed  # type: ignore[attr-defined]
    return usp_compiled


# -- inner compilers -------------------------------------------------------------------------------


def _aot_eager(gm: fx.GraphModule, inputs: list[Any], hooks: _Compile) -> Callable[..., Any]:
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    # Exactly torch's aot_eager (same partitioner, no decompositions), with the joint verified.
    def partition(joint: fx.GraphModule, joint_inputs: Any, **kwargs: Any) -> Any:
        hooks.on_joint(joint)
        return min_cut_rematerialization_partition(joint, joint_inputs, **kwargs)

    def forward(g: fx.GraphModule, ex: Any) -> Any:
        hooks.on_graph("forward", g)
        return boxed_nop(g, ex)

    def backward(g: fx.GraphModule, ex: Any) -> Any:
        hooks.on_graph("backward", g)
        return boxed_nop(g, ex)

    return aot_autograd(
        fw_compiler=forward, bw_compiler=backward, partition_fn=partition, keep_inference_input_mutations=True
    )(gm, inputs)


def _inductor(gm: fx.GraphModule, inputs: list[Any], hooks: _Compile) -> Callable[..., Any]:
    import torch._inductor.config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner_compile(g: fx.GraphModule, ex: Any, **kwargs: Any) -> Any:
        hooks.on_graph("backward" if kwargs.get("is_backward") else "forward", g)
        return compile_fx_inner(g, ex, **kwargs)

    def joint_pass(graph: fx.Graph | fx.GraphModule) -> None:
        # Inductor runs this on the joint graph, before its own joint passes and its partitioner.
        # Not a CustomGraphPass, so inductor's caches are bypassed: verify runs on every compile.
        hooks.on_joint(graph if isinstance(graph, fx.GraphModule) else graph.owning_module)

    # reorder_for_locality moves a node's only-used-here producers next to it: every issued
    # collective next to its wait, undoing the overlap pass.
    settings = {
        "reorder_for_locality": False,
        **dict(hooks.opts.inductor or ()),
        "joint_custom_pre_pass": joint_pass,
    }
    with inductor_config.patch(**settings):
        return compile_fx(gm, inputs, inner_compile=inner_compile)


_INNER: dict[str, Callable[[fx.GraphModule, list[Any], _Compile], Callable[..., Any]]] = {
    "aot_eager": _aot_eager,
    "inductor": _inductor,
}
