"""Document metadata as inputs of a Dynamo graph, and the values each call feeds them.

# B batch rows, L sequence length of an attention call, P CP ranks, N1 cu_seqlens entries (max_docs + 1)

Dynamo never sees the metadata. The backend appends two placeholders to its copy of the graph
(made by `usp_graph.graph_inputs`, as the tracer's are): ``cu_seqlens_N1`` (int32, its length a
fresh symbol N1) and ``max_seqlen`` (a fresh SymInt), both of the graph's ShapeEnv and both
created DYNAMIC, so no value or capacity is baked in and no Dynamo guard can mention them (they
have no Dynamo source; `check_not_guarded` makes sure). The rewrite pass wires every attention
site to them. At run time `MetadataFeed` supplies them from the innermost
`usp_graph.documents(...)` block, or, outside any block, the per-row metadata
``cu = [0, L*P, 2*L*P, ..., B*L*P]``, ``max_seqlen = L*P``, built by the function `sdpa_to_usp`
uses for ``metadata=None`` (`graph_inputs.per_row_cu_seqlens`), so both modes share one compiled
graph and match eager bit for bit.

That needs every rewritten site of the graph to have the same (B, L); a graph whose sites differ
is rewritten with per-row metadata computed inside the graph, and refuses `documents(...)`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import sympy
import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import ShapeEnv, statically_known_true

from .. import graph_inputs
from ..graph_inputs import (
    MetadataInputs,
    attention_without_sdpa_error,
    call_tokens,
    check_token_count,
    joined_sequence_warning,
    metadata_values,
    per_row_cu_seqlens,
    row_mixers_error,
)
from ..metadata import AttentionMetadata, fit_to_documents
from ..passes.base import PASS_META
from ..rules import one_document_per_row
from ..sites import AttentionSite
from .documents import current_documents, current_kv_documents

__all__ = ["MetadataInputs", "MetadataFeed", "add_metadata_inputs", "shared_rows", "check_not_guarded"]

PASS_NAME = "usp_backend"


def _fit_on_host(cu: torch.Tensor) -> bool:
    """Whether documents derived from position ids are cut to their count and longest one (one host
    read per call): on accelerators, where unused slots and an over-long bound cost kernel work."""
    return cu.device.type not in ("cpu", "meta")


def _rows(site: AttentionSite) -> tuple[Any, Any]:
    """(B, L) of a site: (B, H, L, K) or (B, L, K) query."""
    q = site.q_shape
    assert q is not None and len(q) in (3, 4), q
    return q[0], q[-2]


def shared_rows(sites: Sequence[AttentionSite]) -> tuple[Any, Any] | None:
    """The (B, L) every site has (ints or SymInts), or None when they provably may differ."""
    b0, l0 = _rows(sites[0])
    for site in sites[1:]:
        b, length = _rows(site)
        if not (statically_known_true(b == b0) and statically_known_true(length == l0)):
            return None
    return b0, l0


def _hint(x: Any) -> int:
    if isinstance(x, torch.SymInt):
        return int(x.node.hint)
    return int(x)


def add_metadata_inputs(
    gm: fx.GraphModule,
    *,
    shape_env: ShapeEnv,
    fake_mode: Any,
    device: torch.device,
    capacity: int,
    max_seqlen: int,
    kv_max_seqlen: int | None = None,
) -> MetadataInputs:
    """Append ``cu_seqlens_N1`` / ``max_seqlen`` placeholders, tagged as the rewrite pass expects;
    with `kv_max_seqlen`, also ``cu_seqlens_kv_N1`` / ``max_seqlen_kv`` (cross-attention key
    documents, the same capacity: document i of the queries attends document i of the keys).

    `capacity` (cu_seqlens entries) and the max_seqlens are only hints for the fresh symbols
    (`usp_graph.graph_inputs` makes them, as it does for the tracer and the rewrite pass).
    """
    assert fake_mode.shape_env is shape_env, "the metadata symbols belong to the graph's ShapeEnv"
    values = metadata_values(
        fake_mode, max_seqlen=max_seqlen, capacity=capacity, device=device, kv_max_seqlen=kv_max_seqlen
    )
    made = graph_inputs.add_metadata_inputs(gm, values, meta={PASS_META: PASS_NAME})
    for node in made.nodes:
        # AOTAutograd asks every placeholder of a Dynamo graph for its source; these have none
        # (like the intermediate inputs of DDPOptimizer's split graphs).
        node._dynamo_source = None
    return made


_INT32_MAX = 2**31 - 1


def is_index_bound(expr: sympy.Basic) -> bool:
    """True for ``s <= C`` / ``s < C`` with a constant C >= 2**31 - 1: what a code generator adds
    to index a tensor of symbolic size with 32-bit integers. Document metadata always satisfies it
    (cu_seqlens is int32, so neither its length nor max_seqlen can pass 2**31 - 1), so it does not
    specialize the compiled code."""
    if isinstance(expr, (sympy.Ge, sympy.Gt)):
        expr = expr.reversed
    if not isinstance(expr, (sympy.Le, sympy.Lt)):
        return False
    bound = expr.rhs - (1 if isinstance(expr, sympy.Lt) else 0)
    return bool(expr.lhs.is_Symbol and bound.is_number and bound >= _INT32_MAX)


def check_not_guarded(shape_env: ShapeEnv, symbols: frozenset[sympy.Symbol], graph: str) -> None:
    """Fail the compile if anything guarded on (or specialized) a metadata symbol.

    Dynamo cannot check such a guard (the metadata is not one of its inputs), so the compiled
    code would silently assume, e.g., a fixed capacity.
    """
    for guard in shape_env.guards:
        hit = guard.expr.free_symbols & symbols
        if hit and not is_index_bound(guard.expr):
            raise AssertionError(
                f"graph {graph}: compiling added the guard {guard.expr} on document metadata input(s) "
                f"{sorted(map(str, hit))}; metadata must stay dynamic (report this as a usp_graph bug)"
            )
    for sym in symbols:
        if sym in shape_env.replacements:
            raise AssertionError(
                f"graph {graph}: metadata input {sym} was specialized to {shape_env.replacements[sym]} "
                "(report this as a usp_graph bug)"
            )


class _SizeEval:
    """Evaluates a size expression of the graph's symbols from the actual arguments of a call."""

    def __init__(self, values: Sequence[Any], shape_env: ShapeEnv | None) -> None:
        self.env = shape_env
        self.where: dict[sympy.Symbol, tuple[int, int | None]] = {}
        for i, v in enumerate(values):
            if isinstance(v, torch.SymInt):
                self._note(v, i, None)
            elif isinstance(v, torch.Tensor):
                for d, s in enumerate(v.shape):
                    if isinstance(s, torch.SymInt):
                        self._note(s, i, d)

    def _expr(self, s: torch.SymInt) -> sympy.Expr:
        expr = s.node.expr
        return self.env.replace(expr) if self.env is not None else expr

    def _note(self, s: torch.SymInt, i: int, d: int | None) -> None:
        expr = self._expr(s)
        if isinstance(expr, sympy.Symbol):
            self.where.setdefault(expr, (i, d))

    def compile(self, x: Any, what: str) -> Callable[[Sequence[Any]], int]:
        if not isinstance(x, torch.SymInt):
            value = int(x)
            return lambda args: value
        expr = self._expr(x)
        if expr.is_Integer:
            value = int(expr)
            return lambda args: value
        missing = expr.free_symbols - self.where.keys()
        if missing:
            raise NotImplementedError(
                f"the {what} of the attention calls is {expr}, and {sorted(map(str, missing))} is not the size of "
                "any graph input, so it cannot be read at run time; mark those dims static (torch._dynamo.mark_static)"
            )
        where = [(sym, self.where[sym]) for sym in expr.free_symbols]
        if isinstance(expr, sympy.Symbol):
            ((_, (i, d)),) = where
            return (lambda args: int(args[i])) if d is None else (lambda args: int(args[i].shape[d]))

        def value_of(args: Sequence[Any]) -> int:
            subs = {
                sym: sympy.Integer(int(args[i]) if d is None else int(args[i].shape[d]))
                for sym, (i, d) in where
            }
            return int(expr.xreplace(subs))

        return value_of


class MetadataFeed:
    """The metadata arguments of one call of a compiled graph (read from `documents`).

    mode: ``"inputs"`` (the graph takes cu_seqlens/max_seqlen), ``"per_row"`` (sites differ in
    (B, L): per-row metadata is computed inside the graph; `documents` is refused) or ``"none"``
    (no rewritten attention: `documents` does not matter).
    """

    def __init__(
        self,
        *,
        graph: str,
        mode: str,
        rows: tuple[Any, Any] | None,
        values: Sequence[Any],
        shape_env: ShapeEnv | None,
        world: int,
        device: torch.device | None,
        kept: Sequence[AttentionSite],
        row_positions: Sequence[str] = (),
        other_attention: Sequence[str] = (),
        joined: Sequence[str] = (),
        positions: int | None = None,
        positions_by: str = "mask",
        capacity: int | None = None,
        kv_length: Any = None,
        cross: Sequence[str] = (),
        cp: Any = None,
    ) -> None:
        self.graph = graph
        self.mode = mode
        self.world = world
        self.device = device
        self.kept = [f"{s.name} ({s.reason})" for s in kept]
        self.row_positions = list(row_positions)
        self.other_attention = list(other_attention)
        self.joined = list(joined)
        self._per_row: dict[tuple[int, int], tuple[torch.Tensor, int]] = {}  # (b, span) -> (cu, span)
        self.batch = self.length = self.kv_length = None
        # positions: the index of the argument whose position ids define the documents outside
        # any `documents` block (a mask built from them, or the "documents" option), else None.
        self.positions = positions
        self.positions_by = positions_by
        self.capacity = capacity
        self.cross = list(cross)
        self.cp = cp
        if mode == "inputs":
            assert rows is not None
            sizes = _SizeEval(values, shape_env)
            self.batch = sizes.compile(rows[0], "batch size")
            self.length = sizes.compile(rows[1], "sequence length")
            if kv_length is not None:
                self.kv_length = sizes.compile(kv_length, "key/value length of cross-attention")

    def _one_document_per_row(self, meta: AttentionMetadata | None, args: Sequence[Any]) -> bool:
        """Whether this call's documents (the block's, else those of its position ids) are its rows
        (`rules.one_document_per_row`): one host read, made only where a rule would refuse."""
        if self.mode != "inputs" or self.cp is not None:
            return False
        if meta is not None:
            return one_document_per_row(meta.cu_seqlens.tolist(), self.length(args))
        pos = args[self.positions] if self.positions is not None else None
        if not isinstance(pos, torch.Tensor) or pos.dim() != 2 or pos.shape[-1] < 1:
            return False
        return bool((pos[:, 1:] == pos[:, :-1] + 1).all())

    def __call__(self, args: Sequence[Any]) -> tuple[Any, ...]:
        meta = current_documents()
        if meta is not None:
            if self.kept:
                raise ValueError(
                    f"documents(...) is active, but compiled graph {self.graph} kept SDPA call(s) it could not rewrite "
                    f"({'; '.join(self.kept)}); they would attend across documents. Remove what blocks the rewrite "
                    "or call this function outside documents(...)"
                )
            if self.mode == "per_row":
                raise ValueError(
                    f"documents(...) is active, but the attention calls of compiled graph {self.graph} differ in batch "
                    "size or sequence length, so one packed token stream cannot describe them; call it outside "
                    "documents(...) (one document per batch row)"
                )
        # One document per row (`rules.one_document_per_row`) is exact whatever the graph computes
        # along its rows; its values are read only where a rule would refuse.
        per_row = (self.other_attention or self.row_positions) and self._one_document_per_row(meta, args)
        packed = not per_row and (meta is not None or (self.mode == "inputs" and self.positions is not None))
        if self.other_attention and ((meta is not None and not per_row) or self.cp is not None):
            raise attention_without_sdpa_error(f"compiled graph {self.graph}", self.other_attention)
        if self.joined and meta is not None:
            import warnings

            warnings.warn(
                joined_sequence_warning(f"compiled graph {self.graph}", self.joined),
                UserWarning,
                stacklevel=2,
            )
            self.joined = []  # once per graph
        if self.row_positions and (packed or self.cp is not None):
            raise row_mixers_error(f"compiled graph {self.graph}", self.row_positions, cp=self.cp is not None)
        if self.mode != "inputs":
            return ()
        b, length = self.batch(args), self.length(args)
        kv = current_kv_documents() if meta is not None else None
        if self.kv_length is not None:
            if meta is not None and kv is None:
                raise ValueError(
                    f"documents(...) is active, but compiled graph {self.graph} has cross-attention call(s) "
                    f"({', '.join(self.cross)}) whose keys come from another stream; give that stream's documents "
                    "too: documents(meta, kv=kv_meta)"
                )
            kv_fed = self._kv_fed(args, b, kv)
        else:
            kv_fed = ()
        if meta is None and self.positions is not None:
            if kv_fed:
                raise ValueError(
                    f"compiled graph {self.graph} reads its query documents from position ids and has cross-attention; "
                    "give both streams' documents with documents(meta, kv=kv_meta)"
                )
            from ..masks import cu_seqlens_from_positions

            pos = args[self.positions].expand(b, length)
            if self.cp is not None:
                # Each rank holds a shard of the position ids; the documents are the global ones.
                # One all-gather of B x L integers per call (on the device, no host sync).
                with torch.no_grad():
                    pos = self.cp.unshard(pos, dim=1)
            cu = cu_seqlens_from_positions(pos, self.capacity)
            cu = cu.to(self.device) if self.device is not None else cu
            if self.capacity is None and _fit_on_host(cu):
                return fit_to_documents(cu, length * self.world)  # one host read: tight slots and bound
            return (cu, length * self.world)
        if meta is None:
            return (*self._rows(b, length * self.world), *kv_fed)
        if self.kv_length is None and kv is not None:
            meta = self._stream_of_self_attention_graph(meta, kv, b, length)
        tokens = call_tokens(b, length, self.world)
        across = f" x {self.world} CP ranks" if self.world > 1 else ""
        check_token_count(
            tokens,
            meta.total_tokens,
            lambda: (
                f"documents(...) metadata describes {meta.total_tokens} tokens, but the attention calls of compiled "
                f"graph {self.graph} see {tokens} (batch {b} x length {length}{across}); give metadata for this "
                "call's packed tokens"
            ),
        )
        return (*self._on_device(meta), *kv_fed)

    def _stream_of_self_attention_graph(
        self, meta: AttentionMetadata, kv: AttentionMetadata, b: int, length: int
    ) -> AttentionMetadata:
        """The documents of a graph with self-attention only, under `documents(meta, kv=kv)`.

        A graph break can put an encoder (the key/value stream of an encoder-decoder) in a graph of
        its own, with no cross-attention to tell its stream by data flow: the token count decides,
        and where both streams would fit it is refused rather than guessed."""
        if kv is meta or kv.cu_seqlens is meta.cu_seqlens:
            return meta
        tokens = call_tokens(b, length, self.world)
        fits_query, fits_kv = tokens == meta.total_tokens, b * length == kv.total_tokens
        if fits_kv and (fits_query or self.world > 1):
            why = (
                "both streams have that many tokens"
                if fits_query
                else "under context parallelism the key/value stream is replicated, but this graph was sharded"
            )
            raise ValueError(
                f"documents(meta, kv=kv): compiled graph {self.graph} has self-attention and no cross-attention, so "
                f"whether its {tokens} tokens are the query stream or the key/value stream (an encoder's) cannot be "
                f"read from the graph, and {why}; keep the encoder and the decoder in one graph (no graph break "
                "between them) or give the two streams different token counts"
            )
        return kv if fits_kv else meta

    def _rows(self, b: int, span: int) -> tuple[torch.Tensor, int]:
        """One document of `span` tokens per row: ``cu = [0, span, ..., b * span]``, cached."""
        fed = self._per_row.get((b, span))
        if fed is None:
            if len(self._per_row) >= 64:  # dynamic shapes: keep the cache small
                self._per_row.clear()
            cu = per_row_cu_seqlens(b, span, device=self.device)  # what sdpa_to_usp builds for no metadata
            fed = self._per_row[(b, span)] = (cu, span)
        return fed

    def _on_device(self, meta: AttentionMetadata) -> tuple[torch.Tensor, Any]:
        cu = meta.cu_seqlens
        if self.device is not None and cu.device != self.device:
            cu = cu.to(self.device, non_blocking=True)
        return cu, meta.max_seqlen

    def _kv_fed(self, args: Sequence[Any], b: int, kv: AttentionMetadata | None) -> tuple[Any, ...]:
        """Key documents of the cross-attention calls: `kv`, or one document per row."""
        assert self.kv_length is not None
        length = self.kv_length(args)
        if kv is None:
            return self._rows(b, length)
        tokens = call_tokens(b, length)
        check_token_count(
            tokens,
            kv.total_tokens,
            lambda: (
                f"documents(..., kv=...) describes {kv.total_tokens} key/value tokens, but the cross-attention calls "
                f"of compiled graph {self.graph} see {tokens} (batch {b} x length {length})"
            ),
        )
        return self._on_device(kv)


def metadata_hints(rows: tuple[Any, Any], world: int) -> tuple[int, int]:
    """(capacity, max_seqlen) hints for the metadata symbols: the documents block active while
    compiling, else the per-row metadata of the example call."""
    meta: AttentionMetadata | None = current_documents()
    if meta is not None and isinstance(meta.max_seqlen, int):
        return meta.cu_seqlens.numel(), meta.max_seqlen
    b, length = _hint(rows[0]), _hint(rows[1])
    return b + 1, length * world
