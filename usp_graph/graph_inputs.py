"""Document metadata as the inputs of attention: the per-row default, the token-count check, and
the FX placeholders that carry ``cu_seqlens`` / ``max_seqlen`` into a graph.

# B batch rows, L sequence length of an attention call, P CP ranks, N1 cu_seqlens entries (max_docs + 1)

Eager (`sdpa_to_usp`), the tracer (`trace_train_step`), the rewrite pass (`rewrite_sdpa` on a
graph without metadata inputs) and the compile backend (its per-call feed) all take their metadata
inputs from here, so they name, tag, size and check them one way:

- `per_row_cu_seqlens`: one document per batch row, ``[0, L, 2L, ..., B*L]``. The backend feeds a
  compiled graph exactly the tensor `sdpa_to_usp` builds for ``metadata=None``, which is what lets
  both share one graph and match eager bit for bit.
- `check_token_count`: an attention call's ``B * L * P`` tokens (`call_tokens`) must be the
  metadata's ``total_tokens``.
- `metadata_values` + `add_metadata_inputs`: fake values on the graph's ShapeEnv and the
  placeholders ``cu_seqlens_N1`` (int32) and ``max_seqlen`` (a SymInt of its own, never
  specialized, even at 0 or 1), with cross-attention's ``cu_seqlens_kv_N1`` / ``max_seqlen_kv``.
  The capacity is static for a traced train step (part of the graph) and a fresh symbol for the
  compile backend (no capacity baked into compiled code).

Placeholder names and ``meta["usp_input"]`` tags are what graph files record; they never change.

The rules every front door decides packed documents by (`is_cross_attention`,
`positions_count_along_row`, ...) live in `usp_graph.rules`; they are re-exported here under their
old names.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.fx as fx

if TYPE_CHECKING:  # annotations only: sympy costs 0.3 s at import
    import sympy

from .metadata import AttentionMetadata
from .rules import (  # noqa: F401 - re-exported: the rules' old home
    INDEX_ARGUMENTS,
    LAYOUT_OPS,
    POSITIONS_IN_ATTENTION,
    ROW_POSITIONS,
    SEQUENCE_CONTRACTION,
    SEQUENCE_CONVOLUTION,
    WRITE_INDEX_ARGUMENTS,
    attention_without_sdpa_error,
    contraction_length,
    convolution_length,
    counts_along_row,
    is_cross_attention,
    is_position_candidate,
    is_row_length,
    is_score_softmax,
    joined_sequence_warning,
    known_equal,
    positions_count_along_row,
    row_mixers_error,
    sequence_join_length,
    value_arguments,
)

__all__ = [
    "INDEX_ARGUMENTS",
    "WRITE_INDEX_ARGUMENTS",
    "INPUT_META",
    "MetadataInputs",
    "MetadataValues",
    "LAYOUT_OPS",
    "POSITIONS_IN_ATTENTION",
    "ROW_POSITIONS",
    "SEQUENCE_CONTRACTION",
    "SEQUENCE_CONVOLUTION",
    "add_metadata_inputs",
    "attention_without_sdpa_error",
    "call_tokens",
    "check_token_count",
    "convolution_length",
    "counts_along_row",
    "find_kv_metadata_inputs",
    "find_metadata_inputs",
    "is_cross_attention",
    "is_position_candidate",
    "is_row_length",
    "is_score_softmax",
    "known_equal",
    "metadata_symint",
    "metadata_values",
    "per_row_cu_seqlens",
    "positions_count_along_row",
    "row_mixers_error",
    "static_metadata_values",
    "value_arguments",
]

# Placeholder tag: {"kind": "param" | "buffer" | "batch" | "cu_seqlens" | "max_seqlen"
# | "cu_seqlens_kv" | "max_seqlen_kv", "name": ..., ...}
INPUT_META = "usp_input"

# Metadata input kind -> placeholder name (the _N1 suffix: N1 = max_docs + 1 entries).
PLACEHOLDER_NAMES = {
    "cu_seqlens": "cu_seqlens_N1",
    "max_seqlen": "max_seqlen",
    "cu_seqlens_kv": "cu_seqlens_kv_N1",
    "max_seqlen_kv": "max_seqlen_kv",
}


# ---- values: per-row boundaries and the token count -----------------------------------------------


def per_row_cu_seqlens(batch: Any, length: Any, *, device: torch.device | None = None) -> torch.Tensor:
    """One document of `length` tokens per row of a `batch`-row call: ``[0, L, ..., B*L]``, int32.

    ``arange(B + 1) * L``, not ``arange(0, B*L + 1, L)``: a zero-length row is valid (step 0 is not).
    `batch` / `length` may be SymInts (inside a trace the ops are recorded as they run in eager)."""
    return torch.arange(batch + 1, dtype=torch.int32, device=device) * length


def call_tokens(batch: Any, length: Any, world: Any = 1) -> Any:
    """The packed tokens an attention call's metadata describes: ``B * L * P`` (under CP the call
    holds one of P sequence shards of the global stream). Ints, SymInts or sympy expressions."""
    return batch * length * world


def check_token_count(tokens: Any, described: Any, message: Callable[[], str]) -> None:
    """ValueError(message()) when an attention call's `tokens` differ from the `described` total of
    its metadata. Symbolic sizes on either side are not checked here: a traced train step records
    the expression and checks it at replay (`usp_graph.signature.TrainStep`)."""
    if isinstance(tokens, int) and isinstance(described, int) and tokens != described:
        raise ValueError(message())


# ---- fake values and placeholders -----------------------------------------------------------------


def metadata_symint(shape_env: Any, hint: int, name: str, *, zero_one: bool = True) -> torch.SymInt:
    """A fresh backed SymInt on `shape_env` for metadata input `name`: DYNAMIC, so no value is baked
    in; `zero_one`: not specialized at 0 or 1 either (a max_seqlen may be either)."""
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    source = ConstantSource(name)
    extra = {"do_not_specialize_zero_one": True} if zero_one else {}
    sym = shape_env.create_symbol(hint, source, dynamic_dim=DimDynamic.DYNAMIC, **extra)
    return shape_env.create_symintnode(sym, hint=hint, source=source)


@dataclass
class MetadataValues:
    """Fake values of the metadata inputs, in placeholder order (the key documents' pair only for
    cross-attention), and the fresh symbols they introduced."""

    cu_seqlens: torch.Tensor
    max_seqlen: torch.SymInt
    kv: tuple[torch.Tensor, torch.SymInt] | None = None
    symbols: frozenset[sympy.Symbol] = frozenset()

    def named(self) -> list[tuple[str, Any]]:
        """``(kind, value)`` per input, in placeholder order."""
        out: list[tuple[str, Any]] = [("cu_seqlens", self.cu_seqlens), ("max_seqlen", self.max_seqlen)]
        if self.kv is not None:
            out += [("cu_seqlens_kv", self.kv[0]), ("max_seqlen_kv", self.kv[1])]
        return out


def metadata_values(
    fake_mode: Any,
    *,
    max_seqlen: int,
    cu_seqlens: torch.Tensor | None = None,
    capacity: int | None = None,
    device: torch.device | None = None,
    kv_max_seqlen: int | None = None,
) -> MetadataValues:
    """Fake metadata values on `fake_mode`'s ShapeEnv; `max_seqlen` (and `kv_max_seqlen`) are hints
    for fresh symbols.

    cu_seqlens: a concrete tensor whose capacity becomes static (a traced train step: capacity is part
    of the graph, its device is the tensor's). Else `capacity` (cu_seqlens entries) is the hint of a
    fresh symbol N1 and the tensor is made on `device` (the compile backend). `kv_max_seqlen`: also
    the key documents of cross-attention, with the same capacity (document i of the queries attends
    document i of the keys).
    """
    env = fake_mode.shape_env
    symbols: set[sympy.Symbol] = set()

    def symint(hint: int, name: str, *, zero_one: bool = True) -> torch.SymInt:
        s = metadata_symint(env, hint, name, zero_one=zero_one)
        symbols.add(s.node.expr)
        return s

    ms = symint(max_seqlen, "max_seqlen")
    if cu_seqlens is not None:
        cu = fake_mode.from_tensor(cu_seqlens, static_shapes=True)
        size: Any = cu_seqlens.numel()
        device = cu_seqlens.device
    else:
        assert capacity is not None, "metadata_values needs cu_seqlens or a capacity"
        # capacity >= 2 always (AttentionMetadata checks it), so the default [2, inf) range is exact
        # and `numel() < 2` needs no guard.
        size = symint(capacity, "cu_seqlens_capacity", zero_one=False)
        with fake_mode:
            cu = torch.empty(size, dtype=torch.int32, device=device)
    kv = None
    if kv_max_seqlen is not None:
        kv_ms = symint(kv_max_seqlen, "max_seqlen_kv")
        with fake_mode:
            kv = (torch.empty(size, dtype=torch.int32, device=device), kv_ms)
    return MetadataValues(cu, ms, kv, frozenset(symbols))


@dataclass
class MetadataInputs:
    """The placeholders `add_metadata_inputs` made, their fake values and their symbols (the key
    documents' pair only with cross-attention)."""

    cu_seqlens: fx.Node
    max_seqlen: fx.Node
    cu_value: torch.Tensor
    max_value: torch.SymInt
    symbols: frozenset[sympy.Symbol]
    kv_values: tuple[torch.Tensor, torch.SymInt] | None = None
    nodes: tuple[fx.Node, ...] = ()

    @property
    def values(self) -> list[Any]:
        return [self.cu_value, self.max_value, *(self.kv_values or ())]


def add_metadata_inputs(
    gm: fx.GraphModule, values: MetadataValues, *, meta: Mapping[str, Any] | None = None
) -> MetadataInputs:
    """Append the metadata placeholders (``cu_seqlens_N1``, ``max_seqlen``, and for cross-attention
    ``cu_seqlens_kv_N1``, ``max_seqlen_kv``) after the graph's last input, each with its fake value
    (``val`` and Dynamo's ``example_value``) and its ``meta["usp_input"]`` tag; `meta`: more node
    metadata for each (who made it)."""
    graph = gm.graph
    placeholders = list(graph.find_nodes(op="placeholder"))
    made: list[fx.Node] = []
    for kind, val in values.named():
        if made:
            where = graph.inserting_after(made[-1])
        elif placeholders:
            where = graph.inserting_after(placeholders[-1])
        else:
            where = graph.inserting_before(next(iter(graph.nodes), None))
        with where:
            node = graph.placeholder(PLACEHOLDER_NAMES[kind])
        node._rename(node.target)  # FX lower-cases placeholder names; keep the _N1 suffix
        node.meta.update({"val": val, "example_value": val, INPUT_META: {"kind": kind, "name": kind}})
        node.meta.update(meta or {})
        made.append(node)
    return MetadataInputs(
        made[0], made[1], values.cu_seqlens, values.max_seqlen, values.symbols, values.kv, tuple(made)
    )


def _placeholders_of(gm: fx.GraphModule, kinds: tuple[str, ...]) -> dict[str, fx.Node]:
    found = {}
    for node in gm.graph.find_nodes(op="placeholder"):
        kind = node.meta.get(INPUT_META, {}).get("kind")
        if kind in kinds:
            found[kind] = node
    return found


def find_metadata_inputs(gm: fx.GraphModule) -> tuple[fx.Node | None, fx.Node | None]:
    """The graph's ``cu_seqlens`` / ``max_seqlen`` placeholders (tagged ``meta["usp_input"]``), or
    (None, None); ValueError for a graph with only one of them."""
    found = _placeholders_of(gm, ("cu_seqlens", "max_seqlen"))
    if len(found) == 1:
        raise ValueError(
            "the graph has only one of the cu_seqlens / max_seqlen inputs; it needs both or neither"
        )
    return found.get("cu_seqlens"), found.get("max_seqlen")


def find_kv_metadata_inputs(gm: fx.GraphModule) -> tuple[fx.Node | None, fx.Node | None]:
    """The graph's ``cu_seqlens_kv_N1`` / ``max_seqlen_kv`` placeholders (cross-attention key
    documents), or (None, None)."""
    found = _placeholders_of(gm, ("cu_seqlens_kv", "max_seqlen_kv"))
    return found.get("cu_seqlens_kv"), found.get("max_seqlen_kv")


def static_metadata_values(
    fake_mode: Any, metadata: AttentionMetadata, *, device: Any = None
) -> MetadataValues:
    """`metadata_values` for a concrete `metadata` (static capacity), its boundaries on `device`
    (default: where they are)."""
    cu = metadata.cu_seqlens
    if device is not None and cu.device != device:
        cu = cu.to(device)
    return metadata_values(fake_mode, max_seqlen=metadata.max_seqlen, cu_seqlens=cu)
