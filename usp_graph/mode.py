"""`attention_mode`: route every SDPA call through `sdpa_to_usp`, in eager."""

from __future__ import annotations

import contextlib
import math
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .graph_inputs import (
    LAYOUT_OPS,
    POSITIONS_IN_ATTENTION,
    ROW_POSITIONS,
    SEQUENCE_CONTRACTION,
    SEQUENCE_CONVOLUTION,
    attention_without_sdpa_error,
    contraction_length,
    convolution_length,
    counts_along_row,
    is_cross_attention,
    is_position_candidate,
    is_score_softmax,
    joined_sequence_warning,
    positions_count_along_row,
    row_mixers_error,
    sequence_join_length,
    value_arguments,
)
from .metadata import AttentionMetadata
from .sdpa import SDPA_OP, sdpa_to_usp

__all__ = ["attention_mode"]

# F.scaled_dot_product_attention is the C function itself; list both spellings in case a release
# wraps it in Python.
_SDPA_FUNCS = {F.scaled_dot_product_attention, torch._C._nn.scaled_dot_product_attention}


class _Streams:
    """Which tensors from outside the mode (not parameters) each tensor made inside it is computed
    from, by id. Kept beside the tensors, never on them (an attribute would travel with
    `torch.save`); an entry holds a weak reference, so a reused id is never mistaken."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        # Tensors from outside the mode are roots by storage, not by object: the chunks of one
        # fused projection computed before the block are views of one tensor, one stream (issue
        # 30: they were taken for cross-attention). A storage address is reused once freed, so an
        # entry holds a weak reference to the tensor whose storage it names.
        self._outside: dict[int, tuple[weakref.ref, int]] = {}
        self._minted = 0

    def of(self, t: torch.Tensor) -> frozenset[int] | None:
        """The roots of `t`, or None for a tensor from outside the mode."""
        entry = self.table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def inputs(self, values) -> frozenset[int]:
        found: set[int] = set()
        for x in values:
            if isinstance(x, torch.Tensor):
                r = self.of(x)
                if r is not None:
                    found |= r
                elif not isinstance(x, torch.nn.Parameter) and x.dim() > 0:  # scalars are no stream
                    found.add(self._outside_root(x))
            elif isinstance(x, (list, tuple)):
                found |= self.inputs(x)
        return frozenset(found)

    def _outside_root(self, x: torch.Tensor) -> int:
        base = x._base if x._base is not None else x
        try:
            ptr = base.untyped_storage().data_ptr()
        except (RuntimeError, NotImplementedError):  # no storage (a fake or functional tensor)
            return id(base)
        if ptr == 0:  # empty storage: nothing to share
            return id(base)
        entry = self._outside.get(ptr)
        if entry is not None and entry[0]() is not None:
            return entry[1]
        self._minted += 1
        root = -self._minted  # negative: never an id()
        try:
            self._outside[ptr] = (weakref.ref(base), root)
        except TypeError:
            return id(base)
        return root

    def note(self, t: Any, roots: frozenset[int]) -> None:
        if not isinstance(t, torch.Tensor) or isinstance(t, torch.nn.Parameter):
            return
        try:
            ref = weakref.ref(t)
        except TypeError:
            return
        old = self.of(t)
        self.table[id(t)] = (ref, roots | old if old is not None else roots)
        if len(self.table) > 4 * self._live + 1024:  # drop the entries of freed tensors
            self.table = {k: v for k, v in self.table.items() if v[0]() is not None}
            self._live = len(self.table)

    _live = 0


class _SDPAToUSP(TorchFunctionMode):
    def __init__(self, metadata: AttentionMetadata | None, cp, kv: AttentionMetadata | None = None) -> None:
        super().__init__()
        self.metadata = metadata
        self.kv = kv
        self.cp = cp
        self.calls = 0
        self.refused: ValueError | None = None  # a refusal found while Dynamo traced this mode
        # With documents, whether a call is cross-attention matters (its keys take other
        # documents), and eager has no graph to read it from: follow the data flow op by op.
        self.track = metadata is not None or cp is not None
        self.streams = _Streams()
        # Roots of self-attention calls routed with the query documents while key/value documents
        # differ: checked against the keys of each later cross-attention call (see _is_kv_stream).
        self._query_self: list[frozenset[int]] = []
        self._same = kv is None or metadata is None or _same_documents(metadata, kv)  # one check per block
        # Tensors moved by layout ops alone from tensors of unknown provenance (from outside the
        # block, parameters): they have none either (`graph_inputs.is_cross_attention`).
        self._layout_only = _Streams()
        # Under packed documents or CP, what counts or mixes tokens along a whole row outside
        # attention (described, with its sequence length) and the sequence lengths attention calls
        # ran on: the rules of `graph_inputs`, which the compiled backend applies to its graph
        # (backend/compiler.py `_row_position_embeddings`).
        # `_positions`: the row lengths of the positions counted along the row by the model
        # (`graph_inputs.positions_count_along_row`) a tensor is computed from; `_counting`: the
        # row lengths of the tensors from outside the block whose values count along their row
        # (the caller's position ids) a tensor is computed from.
        self._positions = _Streams()
        self._counting = _Streams()
        self._outside_counts: dict[int, tuple[weakref.ref, int | None]] = {}
        self._row_mixers: set[tuple[str, int]] = set()  # a set: bounded however long the block
        # Under packed documents: the sequence lengths of the concatenations along the sequence a
        # tensor is computed from (`graph_inputs.sequence_join_length`), put back in document
        # order by a reorder along it.
        self._joined = _Streams()
        self._joined_warned = False
        self._lengths: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.refused is not None:
            raise self.refused
        if torch.compiler.is_compiling() and func not in _SDPA_FUNCS and func is not SDPA_OP:
            # Dynamo traces this mode inside a function the model compiles itself (transformers
            # calls flex_attention through torch.compile): an error raised here would reach the
            # caller as "Unsupported: Observed exception", and the tracking reads values a trace
            # has none of. A refusal is kept and raised at the next call in eager (`refused`).
            if self.metadata is not None and getattr(func, "__name__", "") == "flex_attention":
                self.refused = attention_without_sdpa_error("the model", ["flex_attention"])
            return func(*args, **kwargs)
        if func in _SDPA_FUNCS:
            self.calls += 1
            return self._attention(*args, **kwargs)
        if func is SDPA_OP:  # SDPA with a window (`sdpa.windowed_sdpa`)
            self.calls += 1
            q, k, v, is_causal, scale, gqa, window = _bind_window_sdpa(args, kwargs)
            win = None if tuple(window) == (-1, -1) else tuple(window)
            return self._attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=gqa, window=win)
        if self.metadata is not None:
            self._refuse_other_attention(func, args, kwargs)
        out = func(*args, **kwargs)
        if self.track:
            roots = self.streams.inputs(args) | self.streams.inputs(kwargs.values())
            self._follow_rows(func, args, kwargs, out)
            if self.metadata is not None:
                self._follow_joins(func, args, kwargs, out)
            name = getattr(func, "__name__", "")
            unknown = name in LAYOUT_OPS and all(
                self._provenance(t) is None for t in _tensors((*args, *kwargs.values()))
            )
            for t in out if isinstance(out, (tuple, list)) else (out,):
                self.streams.note(t, roots)
                if unknown:
                    self._layout_only.note(t, frozenset())
            if args and isinstance(args[0], torch.Tensor) and (name == "__setitem__" or _in_place(name)):
                # A write into a tensor (or a view of it: t[..., :k].copy_(x)) adds what it writes
                # to what the tensor, and the tensor it views, hold.
                target = args[0]
                while target is not None:
                    self.streams.note(target, roots)
                    target = target._base
        return out

    def _follow_rows(self, func, args, kwargs, out) -> None:
        """Record what counts or mixes tokens along the row (`graph_inputs.positions_count_along_row`,
        `graph_inputs.convolution_length`), and the facts those rules read."""
        tensors = list(_tensors((*args, *kwargs.values())))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        world = self.cp.world if self.cp is not None else 1
        counting = frozenset().union(*(self._counting_lengths(t) for t in tensors))
        # Positions reach a result through its values, not through an index it selects by.
        values = _tensors(value_arguments(getattr(func, "__name__", ""), args, kwargs, _shape))
        positions = frozenset().union(*(r for r in map(self._positions.of, values) if r is not None))
        for t in outs:
            if counting:
                self._counting.note(t, counting)
            if positions:
                self._positions.note(t, positions)
            if (
                not isinstance(t, torch.nn.Parameter)
                and is_position_candidate(tuple(t.shape), t.is_floating_point())
                and positions_count_along_row(t, counting, world)
            ):
                self._positions.note(t, frozenset({int(t.shape[-1])}))
        if func in _EMBEDDINGS:
            index = args[0] if args else kwargs.get("input")
            if isinstance(index, torch.Tensor) and index.dim() > 0:
                if positions_count_along_row(index, self._counting_lengths(index), world):
                    self._mixes(f"an embedding {ROW_POSITIONS}", index.shape[-1])
        elif func in _CONV1D:
            x, w = (args + (None, None))[:2]
            w = kwargs.get("weight", w)
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor):
                length = convolution_length(tuple(x.shape), tuple(w.shape))
                if length is not None:
                    self._mixes(f"conv1d {SEQUENCE_CONVOLUTION}", length)
        elif func in _MATMUL and len(args) >= 2:
            a, b = args[:2]
            if (
                isinstance(a, torch.Tensor)
                and isinstance(b, torch.Tensor)
                and a.dim() >= 2
                and b.dim() >= 3  # a batched product: a projection's weight is 2-D
                and self.streams.of(a) is not None  # both computed inside the block (not weights)
                and self.streams.of(b) is not None
            ):
                length = contraction_length(tuple(a.shape), tuple(b.shape))
                if length is not None:
                    what = f"a matmul {SEQUENCE_CONTRACTION}"
                    lead = math.prod(int(d) for d in a.shape[:-2])
                    # Summed over the packed stream's length, into a result with none (k^T v: (K, K));
                    # q @ k^T sums over the head dim into (L, L), which the softmax rule reads.
                    if self._fits_stream(int(length), lead) and not any(
                        self._fits_stream(int(n), lead) for n in (a.shape[-2], b.shape[-1])
                    ):
                        raise row_mixers_error("the model", [what], cp=self.cp is not None)
                    self._mixes(what, length)

    def _follow_joins(self, func, args, kwargs, out) -> None:
        """Record the concatenations along the sequence a result is computed from."""
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
        if not outs:
            return
        joined = frozenset().union(
            *(j for j in map(self._joined.of, _tensors((*args, *kwargs.values()))) if j is not None)
        )
        if func in _CAT:
            pieces = args[0] if args else kwargs.get("tensors", ())
            dim = args[1] if len(args) > 1 else kwargs.get("dim", 0)
            if (
                isinstance(dim, int)
                and pieces
                and all(isinstance(t, torch.Tensor) and t.dim() == outs[0].dim() for t in pieces)
            ):
                length = sequence_join_length(tuple(outs[0].shape), dim, [t.shape[dim] for t in pieces])
                if length is not None:
                    joined = joined | {int(length)}
        elif joined and func in _REORDER:
            x = args[0] if args else kwargs.get("input")
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            if isinstance(x, torch.Tensor) and isinstance(dim, int):
                joined = joined - {int(x.shape[dim])}  # reordered along that sequence: document order
        elif joined and getattr(func, "__name__", "") == "__getitem__" and len(args) > 1:
            index = args[1] if isinstance(args[1], tuple) else (args[1],)
            if any(isinstance(i, torch.Tensor) and not i.dtype == torch.bool for i in index):
                joined = frozenset()  # an index tensor reorders: the caller put it in document order
        if joined:
            for t in outs:
                self._joined.note(t, joined)

    def _fits_stream(self, length: int, lead: int) -> bool:
        """Whether `length` tokens per row, over `lead` leading entries (rows, or rows x heads),
        is the packed stream of the documents: B rows of `length` (x P ranks) tokens."""
        if self.metadata is None or length < 1:
            return False
        world = self.cp.world if self.cp is not None else 1
        rows, extra = divmod(self.metadata.total_tokens, length * world)
        return not extra and rows >= 1 and lead % rows == 0

    def _counting_lengths(self, t: torch.Tensor) -> frozenset[int]:
        """The row lengths of the tensors from outside the block whose values count along their row
        that `t` is computed from (itself, when it is one)."""
        made = self._counting.of(t)
        if made is not None:
            return made
        if self.streams.of(t) is not None or isinstance(t, torch.nn.Parameter) or t.is_floating_point():
            return frozenset()
        entry = self._outside_counts.get(id(t))
        if entry is None or entry[0]() is not t:
            try:
                entry = (weakref.ref(t), t.shape[-1] if counts_along_row(t) else None)
            except TypeError:
                return frozenset()
            if len(self._outside_counts) > 1024:
                self._outside_counts = {k: v for k, v in self._outside_counts.items() if v[0]() is not None}
            self._outside_counts[id(t)] = entry
        return frozenset() if entry[1] is None else frozenset({int(entry[1])})

    def _provenance(self, t: torch.Tensor) -> frozenset[int] | None:
        """The roots `graph_inputs.is_cross_attention` reads: None for a tensor from outside the
        block, or moved from such tensors by layout ops alone."""
        if self._layout_only.of(t) is not None:
            return None
        return self.streams.of(t)

    def _refuse_other_attention(self, func, args, kwargs) -> None:
        """Under packed documents, attention not computed by SDPA (`graph_inputs.is_score_softmax`,
        flex_attention) is refused before it runs: it would attend across the documents."""
        name = getattr(func, "__name__", "")
        if name == "flex_attention":
            raise attention_without_sdpa_error("the model", ["flex_attention"])
        if func not in _SOFTMAX:
            return
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if not isinstance(x, torch.Tensor) or not isinstance(dim, int):
            return
        if x.dim() < 3:
            return
        world = self.cp.world if self.cp is not None else 1
        n = int(x.shape[-2])
        # A token length of the packed stream: B rows of n (x P ranks) tokens, the scores' leading
        # dims B x heads ((B, H, n, m) or heads folded in: (B * H, n, m)).
        rows, extra = divmod(self.metadata.total_tokens, n * world) if n else (0, 1)
        lead = math.prod(int(d) for d in x.shape[:-2])
        if extra or rows < 1 or lead % rows:
            return
        # keys of a packed key/value stream (attention_mode(meta, kv=...)): its per-row length
        kv_lengths = (
            [self.kv.total_tokens // rows] if self.kv is not None and self.kv.total_tokens % rows == 0 else []
        )
        if is_score_softmax(tuple(x.shape), dim, [n], kv_lengths):
            raise attention_without_sdpa_error(
                "the model", [f"a softmax over {tuple(x.shape)} attention scores (matmul + softmax)"]
            )

    def _mixes(self, what: str, length: int) -> None:
        self._row_mixers.add((what, int(length)))
        self._check_rows()

    def _check_rows(self) -> None:
        found = sorted({what for what, n in self._row_mixers if n in self._lengths})
        if found:
            raise row_mixers_error("the model", found, cp=self.cp is not None)

    def _attention(self, query, key, value, *args, **kwargs):
        if self.track:
            self._lengths.update(
                int(x.shape[-2]) for x in (query, key) if isinstance(x, torch.Tensor) and x.dim() >= 2
            )
            self._check_rows()
            if any(
                isinstance(x, torch.Tensor) and x.dim() >= 2 and x.shape[-2] in (self._positions.of(x) or ())
                for x in (query, key)
            ):
                raise row_mixers_error(
                    "the model", [f"the model {POSITIONS_IN_ATTENTION}"], cp=self.cp is not None
                )
        if self.metadata is not None and not self._joined_warned:
            for x in (query, key):
                j = self._joined.of(x) if isinstance(x, torch.Tensor) and x.dim() >= 2 else None
                if j and int(x.shape[-2]) in j:
                    self._joined_warned = True
                    where = (
                        f"a concatenation along the sequence ({int(x.shape[-2])} tokens) reaches attention"
                    )
                    warnings.warn(joined_sequence_warning("the model", [where]), UserWarning, stacklevel=3)
                    break
        extra = {}
        if self.track and self._is_cross(query, key):
            if self.metadata is None:  # under CP: one document per (global) row of both streams
                b = query.shape[0]
                metadata = AttentionMetadata.per_sample(b, query.shape[-2] * self.cp.world)
                kv = AttentionMetadata.per_sample(b, key.shape[-2])
                out = sdpa_to_usp(
                    query, key, value, *args, **kwargs, metadata=metadata, cp=self.cp, kv_metadata=kv
                )
                self.streams.note(out, self.streams.inputs((query, key, value)))
                return out
            if self.kv is None:
                raise ValueError(
                    "attention_mode(metadata): this SDPA call is cross-attention (its keys are not computed from "
                    "everything its queries are), so the query documents cannot apply to its keys; give the "
                    "key/value stream's documents too: attention_mode(metadata, kv=kv_metadata)"
                )
            self._check_kv_stream(key)
            extra["kv_metadata"] = self.kv
        elif self.kv is not None and self.metadata is not None:
            if self._is_kv_stream(query):
                # Self-attention on the key/value stream (an encoder's): its own documents, and under
                # context parallelism that stream is replicated, not sharded.
                out = sdpa_to_usp(query, key, value, *args, **kwargs, metadata=self.kv)
                self.streams.note(out, self.streams.inputs((query, key, value)))
                return out
            if not self._same:
                self._query_self.append(self.streams.inputs((query, key)))
        out = sdpa_to_usp(query, key, value, *args, **kwargs, metadata=self.metadata, cp=self.cp, **extra)
        if self.track:
            self.streams.note(out, self.streams.inputs((query, key, value)))
        return out

    def _is_kv_stream(self, query) -> bool:
        """A self-attention call on the key/value stream: eager cannot see the cross-attention that
        comes later, so it goes by token count, where only the key/value documents fit."""
        world = self.cp.world if self.cp is not None else 1
        tokens = query.shape[0] * query.shape[-2]
        return tokens == self.kv.total_tokens and tokens * world != self.metadata.total_tokens

    def _check_kv_stream(self, key) -> None:
        """Refuse a cross-attention call whose keys come from a stream that an earlier self-attention
        call attended with the query documents (equal token counts made the two look alike)."""
        k_roots = self.streams.inputs((key,))
        if any(r and r <= k_roots for r in self._query_self):
            raise ValueError(
                "attention_mode(metadata, kv=kv): a self-attention call on the key/value stream of this "
                "cross-attention (an encoder's) ran with the query documents, because both streams have the same "
                "token count and eager cannot tell them apart before the cross-attention; use "
                "torch.compile(model, backend='usp') under usp_graph.documents(metadata, kv=kv), which reads the "
                "streams from the graph, or give the two streams different token counts"
            )

    def _is_cross(self, query, key) -> bool:
        """`graph_inputs.is_cross_attention`, on the provenance followed op by op (the compiled
        backend reads it from the graph: `sites.is_cross_attention`)."""
        return is_cross_attention(
            self._provenance(query), self._provenance(key), query.shape[-2], key.shape[-2]
        )


def _bind_window_sdpa(args, kwargs) -> list:
    schema = SDPA_OP._schema
    bound = []
    for i, arg in enumerate(schema.arguments):
        if i < len(args):
            bound.append(args[i])
        elif arg.name in kwargs:
            bound.append(kwargs[arg.name])
        else:
            bound.append(arg.default_value)
    return bound


_EMBEDDINGS = {F.embedding, torch.embedding}
_SOFTMAX = {F.softmax, torch.softmax, torch.Tensor.softmax, torch._softmax, torch.special.softmax}
_CONV1D = {F.conv1d, torch.conv1d}
_MATMUL = {torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.bmm, torch.Tensor.bmm}
_CAT = {torch.cat, torch.concat, torch.concatenate}
_REORDER = {
    torch.index_select,
    torch.Tensor.index_select,
    torch.gather,
    torch.Tensor.gather,
    torch.take_along_dim,
}


def _tensors(values):
    for x in values:
        if isinstance(x, torch.Tensor):
            yield x
        elif isinstance(x, (list, tuple)):
            yield from _tensors(x)


def _shape(x: Any) -> tuple[int, ...] | None:
    return tuple(x.shape) if isinstance(x, torch.Tensor) else None


def _in_place(name: str) -> bool:
    return name.endswith("_") and not name.endswith("__")


def _same_documents(a: AttentionMetadata, b: AttentionMetadata) -> bool:
    return a.cu_seqlens.shape == b.cu_seqlens.shape and bool(
        torch.equal(a.cu_seqlens, b.cu_seqlens.to(a.cu_seqlens.device))
    )


@contextlib.contextmanager
def attention_mode(
    metadata: AttentionMetadata | None = None, *, cp=None, kv: AttentionMetadata | None = None
) -> Iterator[_SDPAToUSP]:
    """Run every `F.scaled_dot_product_attention` call inside through `sdpa_to_usp`.

    `metadata=None`: one document per batch row (SDPA's own semantics). With metadata, each call's
    `B * L` tokens (row-major) are the packed stream it describes and documents are isolated.
    With `cp` (a `usp_graph.ContextParallel`), SDPA inputs are this rank's sequence shards and
    `metadata` describes the global stream of all ranks' tokens.
    `kv`: the documents of the key/value stream of cross-attention calls (document i of the
    queries attends document i of the keys; same capacity). A call is cross-attention when its
    keys are not computed from everything its queries are computed from (followed op by op while
    metadata is given); under metadata, such a call without `kv` raises instead of attending with
    the query documents.
    Under metadata (or `cp`), what would silently cross documents (or shards) is refused with a
    ValueError, by the rules the compiled backend applies too (`usp_graph.graph_inputs`): attention
    computed without SDPA, positions the model counts along the row itself (not the position ids
    passed in) that it embeds or that reach queries or keys, convolutions along the sequence.
    The yielded object counts the calls it routed (`.calls`).
    """
    if metadata is not None and not isinstance(metadata, AttentionMetadata):
        raise TypeError(
            f"metadata must be a usp_graph.AttentionMetadata or None, got {type(metadata).__name__}"
        )
    if cp is not None:
        from .cp import ContextParallel

        if not isinstance(cp, ContextParallel):
            raise TypeError(f"cp must be a usp_graph.ContextParallel or None, got {type(cp).__name__}")
    if kv is not None:
        if not isinstance(kv, AttentionMetadata):
            raise TypeError(f"kv must be a usp_graph.AttentionMetadata or None, got {type(kv).__name__}")
        if metadata is None:
            raise ValueError("attention_mode(None, kv=...): key/value documents need query documents too")
    mode = _SDPAToUSP(metadata, cp, kv)
    with mode, _recompute_checkpoints_in(mode):
        yield mode
    if mode.refused is not None:
        raise mode.refused


def _in_mode(mode: TorchFunctionMode):
    """A context that enters `mode` unless it is already active (a recompute inside the block)."""
    from torch.overrides import _get_current_function_mode_stack

    if any(m is mode for m in _get_current_function_mode_stack()):
        return contextlib.nullcontext()
    return mode


@contextlib.contextmanager
def _recompute_checkpoints_in(mode: _SDPAToUSP) -> Iterator[None]:
    """Activation checkpoints started inside the block recompute under `mode` in backward.

    `torch.utils.checkpoint` reruns a region's forward when backward needs its activations,
    after the `attention_mode` block has usually closed: the rerun would call plain SDPA, save
    other tensors than the forward did and fail with a CheckpointError (or, worse, attend across
    documents). While the block is open, checkpoint's two entry points (module globals it looks up
    at every call) are wrapped so that the rerun enters the same mode: non-reentrant checkpoints
    get it as their recompute context (after the user's own `context_fn`), reentrant ones run the
    region's function inside it. Nothing else about checkpointing changes."""
    import torch.utils.checkpoint as ckpt

    generator = getattr(ckpt, "_checkpoint_without_reentrant_generator", None)
    function = getattr(ckpt, "CheckpointFunction", None)
    if generator is None or function is None:  # another torch layout: leave checkpoint alone
        yield
        return

    def nonreentrant(fn, preserve, context_fn, determinism_check, debug, *rest, **kwargs):
        if debug:  # checkpoint's debug mode refuses a context_fn of its own
            return generator(fn, preserve, context_fn, determinism_check, debug, *rest, **kwargs)

        def with_mode():
            forward_ctx, recompute_ctx = context_fn()
            return forward_ctx, _Both(recompute_ctx, lambda: _in_mode(mode))

        return generator(fn, preserve, with_mode, determinism_check, debug, *rest, **kwargs)

    class _Reentrant:
        @staticmethod
        def apply(run_function, preserve_rng_state, *args):
            def run_in_mode(*a):
                with _in_mode(mode):
                    return run_function(*a)

            return function.apply(run_in_mode, preserve_rng_state, *args)

    ckpt._checkpoint_without_reentrant_generator = nonreentrant
    ckpt.CheckpointFunction = _Reentrant
    try:
        yield
    finally:
        ckpt._checkpoint_without_reentrant_generator = generator
        ckpt.CheckpointFunction = function


class _Both:
    """Enter `first`, then the context `second()` makes (at entry, not before)."""

    def __init__(self, first, second) -> None:
        self.first, self.second = first, second

    def __enter__(self) -> None:
        self.stack = contextlib.ExitStack()
        self.stack.enter_context(self.first)
        self.stack.enter_context(self.second())

    def __exit__(self, *exc) -> bool | None:
        return self.stack.__exit__(*exc)
