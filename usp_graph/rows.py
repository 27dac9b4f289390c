"""The row tracker: what eager code computes along the packed row, followed op by op.

# B batch rows, L tokens per row, P CP ranks, T packed tokens (B x L x P)

Eager has no graph to read the data flow from, so `RowTracker` follows it through every torch
call of a forward (fed by a `TorchFunctionMode`: `attention_mode`'s, or `RowRules` around the
forward of a transformers model with ``attn_implementation="usp"``: `usp_graph.hf_rows`) and gathers the facts the
rules of `usp_graph.rules` decide by: which outside tensors each tensor is computed from (cross- or
self-attention), positions counted along the row, convolutions and contractions along the
sequence, attention computed without SDPA, streams concatenated along the sequence. It refuses
with `rules.refusal` when the documents are packed (`rules.one_document_per_row` is false for the
row length of an attention call) or under context parallelism; one document per row is exact and
runs.
"""

from __future__ import annotations

import math
import warnings
import weakref
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .metadata import AttentionMetadata
from .rules import (
    LAYOUT_OPS,
    WEIGHT_LAYOUT_OPS,
    counts_along_row,
    is_cross_attention,
    is_position_candidate,
    is_score_softmax,
    joined_sequence_warning,
    one_document_per_row,
    positions_count_along_row,
    refusal,
    sequence_join_length,
    value_arguments,
    weight_dims,
    weight_dims_after,
)
from .rules import contraction_length as _contraction_length
from .rules import convolution_length as _convolution_length

__all__ = ["RowRules", "RowTracker", "active_row_rules"]


class _Streams:
    """Which tensors from outside the tracking (not parameters) each tensor made inside it is
    computed from, by id. Kept beside the tensors, never on them (an attribute would travel with
    `torch.save`); an entry holds a weak reference, so a reused id is never mistaken."""

    def __init__(self) -> None:
        self.table: dict[int, tuple[weakref.ref, frozenset[int]]] = {}
        # Tensors from outside are roots by storage, not by object: the chunks of one fused
        # projection computed before the block are views of one tensor, one stream (issue 30: they
        # were taken for cross-attention). A storage address is reused once freed, so an entry holds
        # a weak reference to the tensor whose storage it names.
        self._outside: dict[int, tuple[weakref.ref, int]] = {}
        self._minted = 0
        self._live = 0

    def of(self, t: torch.Tensor) -> frozenset[int] | None:
        """The roots of `t`, or None for a tensor from outside."""
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


class Provenance:
    """Which outside tensors each tensor is computed from (`_Streams`), and which are only moved
    by layout ops from tensors of unknown provenance (from outside, parameters), which have none
    either: the facts `rules.is_cross_attention` reads."""

    def __init__(self) -> None:
        self.streams = _Streams()
        self._layout_only = _Streams()

    def follow(self, name: str, args, kwargs, out) -> None:
        roots = self.streams.inputs(args) | self.streams.inputs(kwargs.values())
        unknown = name in LAYOUT_OPS and all(
            self.provenance(t) is None for t in _tensors((*args, *kwargs.values()))
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

    def provenance(self, t: torch.Tensor) -> frozenset[int] | None:
        """The roots `rules.is_cross_attention` reads: None for a tensor from outside, or moved from
        such tensors by layout ops alone."""
        if self._layout_only.of(t) is not None:
            return None
        return self.streams.of(t)

    def is_cross(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        """`rules.is_cross_attention`, on the provenance followed op by op (the compiled backend
        reads it from the graph: `sites.is_cross_attention`)."""
        return is_cross_attention(
            self.provenance(query), self.provenance(key), query.shape[-2], key.shape[-2]
        )


class _Weights:
    """How many trailing dims of a tensor are a weight's own (`rules.weight_dims`: a parameter
    selected per token, MoE experts' weights), by id, followed through layout ops."""

    def __init__(self) -> None:
        self._table: dict[int, tuple[weakref.ref, int]] = {}

    def of(self, t: torch.Tensor) -> int:
        """How many trailing dims of `t` are a weight's own (`rules.weight_dims`): a parameter
        selected per token (MoE experts' weights), through layout ops."""
        if isinstance(t, torch.nn.Parameter):
            return t.dim()
        entry = self._table.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else 0

    def follow(self, name: str, args, kwargs, out) -> None:
        if not isinstance(out, torch.Tensor) or not args or not isinstance(args[0], torch.Tensor):
            return
        source = args[0]
        if name == "index_select":
            dim = args[1] if len(args) > 1 else kwargs.get("dim")
            index = args[2] if len(args) > 2 else kwargs.get("index")
        else:
            dim, index = 0, args[1] if len(args) > 1 else None
        found = 0
        if self.of(source) == source.dim():  # a parameter, or a whole weight moved
            found = weight_dims(name, tuple(source.shape), index, dim)
        if not found and name in WEIGHT_LAYOUT_OPS:
            found = weight_dims_after(name, self.of(source), tuple(source.shape), tuple(out.shape), args)
        if found:
            try:
                self._table[id(out)] = (weakref.ref(out), found)
            except TypeError:
                return
            if len(self._table) > 1024:
                self._table = {k: v for k, v in self._table.items() if v[0]() is not None}


class RowTracker:
    """The facts of `usp_graph.rules`, gathered op by op (`before` / `after` each torch call,
    `attention` at each attention call), and the refusals they lead to.

    `metadata`: the documents of the packed stream (None: one document per row, where nothing is
    refused but under `cp`); `cp`: a `usp_graph.ContextParallel` (each rank holds a shard of every
    row: always refused); `kv`: the key/value stream's documents of cross-attention."""

    def __init__(
        self,
        metadata: AttentionMetadata | None,
        cp: Any = None,
        kv: AttentionMetadata | None = None,
        *,
        who: str = "the model",
    ) -> None:
        self.metadata, self.cp, self.kv, self.who = metadata, cp, kv, who
        self.world = cp.world if cp is not None else 1
        self.flow = Provenance()
        self.streams = self.flow.streams
        self.weights = _Weights()
        # `_positions`: the row lengths of the positions counted along the row by the model
        # (`rules.positions_count_along_row`) a tensor is computed from; `_counting`: the row
        # lengths of the tensors from outside whose values count along their row (the caller's
        # position ids) a tensor is computed from.
        self._positions = _Streams()
        self._counting = _Streams()
        self._outside_counts: dict[int, tuple[weakref.ref, int | None]] = {}
        # What counts or mixes tokens along a whole row outside attention, (rule, where, length): a
        # set, bounded however long the block.
        self._row_mixers: set[tuple[str, str, int]] = set()
        # The concatenations along the sequence a tensor is computed from (`rules.sequence_join_length`).
        self._joined = _Streams()
        self._joined_warned = False
        # The sequence lengths of the attention calls whose rows hold packed documents.
        self._lengths: set[int] = set()
        self._cuts: list[int] | None = None
        self.refused: ValueError | None = None  # the last refusal raised

    # ---- when the rules apply ----------------------------------------------------------------

    def packed(self, length: int) -> bool:
        """Whether rows of `length` tokens (this rank's) hold packed documents: always under context
        parallelism (a shard of the row), never without documents."""
        if self.cp is not None:
            return True
        if self.metadata is None:
            return False
        # No values to read (a meta model's shape check): the rules apply.
        if self.metadata.cu_seqlens.is_meta:
            return True
        if self._cuts is None:  # one host read per tracker
            self._cuts = self.metadata.cu_seqlens.tolist()
        return not one_document_per_row(self._cuts, int(length) * self.world)

    def _refuse(self, found: list[tuple[str, str]]) -> ValueError:
        self.refused = refusal(self.who, found, cp=self.cp is not None)
        return self.refused

    # ---- each torch call ---------------------------------------------------------------------

    def before(self, func, args, kwargs) -> None:
        """Under packed documents, attention not computed by SDPA (`rules.is_score_softmax`,
        flex_attention) is refused before it runs: it would attend across the documents."""
        if self.metadata is None:
            return
        name = getattr(func, "__name__", "")
        if name == "flex_attention":
            q = args[0] if args else kwargs.get("query")
            length = q.shape[-2] if isinstance(q, torch.Tensor) and q.dim() >= 2 else 0
            if not length or self.packed(length):
                raise self._refuse([("flex_attention", "")])
            return
        if func not in _SOFTMAX:
            return
        x = args[0] if args else kwargs.get("input")
        dim = args[1] if len(args) > 1 else kwargs.get("dim", -1)
        if not isinstance(x, torch.Tensor) or not isinstance(dim, int) or x.dim() < 3:
            return
        n = int(x.shape[-2])
        # A token length of the packed stream: B rows of n (x P ranks) tokens, the scores' leading
        # dims B x heads ((B, H, n, m) or heads folded in: (B * H, n, m)).
        rows, extra = divmod(self.metadata.total_tokens, n * self.world) if n else (0, 1)
        lead = math.prod(int(d) for d in x.shape[:-2])
        if extra or rows < 1 or lead % rows:
            return
        # keys of a packed key/value stream (attention_mode(meta, kv=...)): its per-row length
        kv_lengths = (
            [self.kv.total_tokens // rows] if self.kv is not None and self.kv.total_tokens % rows == 0 else []
        )
        if is_score_softmax(tuple(x.shape), dim, [n], kv_lengths) and self.packed(n):
            raise self._refuse([("score_softmax", f"a softmax over {tuple(x.shape)}")])

    def after(self, func, args, kwargs, out) -> None:
        """Follow `out` of `func(*args, **kwargs)`: what it is computed from."""
        name = getattr(func, "__name__", "")
        self._follow_rows(func, args, kwargs, out)
        self.weights.follow(name, args, kwargs, out)
        if self.metadata is not None:
            self._follow_joins(func, args, kwargs, out)
        self.flow.follow(name, args, kwargs, out)

    def _follow_rows(self, func, args, kwargs, out) -> None:
        """Record what counts or mixes tokens along the row (`rules.positions_count_along_row`,
        `rules.convolution_length`, `rules.contraction_length`), and the facts those rules read."""
        tensors = list(_tensors((*args, *kwargs.values())))
        outs = [t for t in (out if isinstance(out, (tuple, list)) else (out,)) if isinstance(t, torch.Tensor)]
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
                and positions_count_along_row(t, counting, self.world)
            ):
                self._positions.note(t, frozenset({int(t.shape[-1])}))
        if func in _EMBEDDINGS:
            index = args[0] if args else kwargs.get("input")
            if isinstance(index, torch.Tensor) and index.dim() > 0:
                if positions_count_along_row(index, self._counting_lengths(index), self.world):
                    self._mixes("row_positions", "an embedding", index.shape[-1])
        elif func in _CONV1D:
            x, w = (args + (None, None))[:2]
            w = kwargs.get("weight", w)
            if isinstance(x, torch.Tensor) and isinstance(w, torch.Tensor):
                length = _convolution_length(tuple(x.shape), tuple(w.shape))
                if length is not None:
                    self._mixes("convolution", "conv1d", length)
        elif func in _MATMUL and len(args) >= 2:
            self._follow_matmul(*args[:2])

    def _follow_matmul(self, a: Any, b: Any) -> None:
        if not (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dim() >= 2
            and b.dim() >= 3  # a batched product: a projection's weight is 2-D
            and self.streams.of(a) is not None  # both computed inside the block (not weights)
            and self.streams.of(b) is not None
        ):
            return
        length = _contraction_length(tuple(a.shape), tuple(b.shape), self.weights.of(a), self.weights.of(b))
        if length is None:
            return
        lead = math.prod(int(d) for d in a.shape[:-2])
        # Summed over the packed stream's length, into a result with none (k^T v: (K, K));
        # q @ k^T sums over the head dim into (L, L), which the softmax rule reads.
        if self._fits_stream(int(length), lead) and not any(
            self._fits_stream(int(n), lead) for n in (a.shape[-2], b.shape[-1])
        ):
            raise self._refuse([("contraction", "a matmul")])
        self._mixes("contraction", "a matmul", length)

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
        is the packed stream of the documents: B rows of `length` (x P ranks) tokens, packed."""
        if self.metadata is None or length < 1:
            return False
        rows, extra = divmod(self.metadata.total_tokens, length * self.world)
        return not extra and rows >= 1 and lead % rows == 0 and self.packed(length)

    def _counting_lengths(self, t: torch.Tensor) -> frozenset[int]:
        """The row lengths of the tensors from outside whose values count along their row that `t`
        is computed from (itself, when it is one)."""
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

    def is_cross(self, query: torch.Tensor, key: torch.Tensor) -> bool:
        return self.flow.is_cross(query, key)

    def _mixes(self, rule: str, where: str, length: int) -> None:
        self._row_mixers.add((rule, where, int(length)))
        self._check_rows()

    def _check_rows(self) -> None:
        found = sorted({(rule, where) for rule, where, n in self._row_mixers if n in self._lengths})
        if found:
            raise self._refuse(found)

    # ---- each attention call -----------------------------------------------------------------

    def attention(self, query: Any, key: Any) -> None:
        """An attention call on `query` / `key` ((..., L, K)): its rows take the documents, so what
        mixes tokens along rows of its length, or positions counted along them reaching it, is
        refused when they are packed; joint attention is warned about."""
        pair = [x for x in (query, key) if isinstance(x, torch.Tensor) and x.dim() >= 2]
        self._lengths.update(n for n in {int(x.shape[-2]) for x in pair} if self.packed(n))
        self._check_rows()
        if any(x.shape[-2] in (self._positions.of(x) or ()) and self.packed(x.shape[-2]) for x in pair):
            raise self._refuse([("positions_in_attention", "the model")])
        if self.metadata is None or self._joined_warned:
            return
        for x in pair:
            j = self._joined.of(x)
            if j and int(x.shape[-2]) in j:
                self._joined_warned = True
                where = f"a concatenation along the sequence ({int(x.shape[-2])} tokens) reaches attention"
                warnings.warn(joined_sequence_warning(self.who, [where]), UserWarning, stacklevel=4)
                return


class RowRules(TorchFunctionMode):
    """Runs a `RowTracker` over every torch call inside, for a door that computes attention
    itself (transformers' ``attn_implementation="usp"``): the attention function reports each
    call (`active_row_rules().attention(...)`) and runs untracked (`paused`)."""

    def __init__(self, tracker: RowTracker, *, key: tuple[str, ...] = ()) -> None:
        super().__init__()
        self.tracker = tracker
        self.key = key  # the kinds of documents its verdict is kept for (`_verdict_key`)
        self.paused = False

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.paused or torch.compiler.is_compiling():
            return func(*args, **kwargs)
        self.tracker.before(func, args, kwargs)
        out = func(*args, **kwargs)
        self.tracker.after(func, args, kwargs, out)
        return out


def active_row_rules() -> RowRules | None:
    """The innermost active `RowRules`, or None."""
    from torch.overrides import _get_current_function_mode_stack

    for m in reversed(_get_current_function_mode_stack()):
        if isinstance(m, RowRules):
            return m
    return None


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
