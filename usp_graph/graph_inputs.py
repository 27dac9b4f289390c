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

It also holds the rules eager `attention_mode` and the compiled backend both decide by, each from
the facts it can read (values op by op in eager, the graph and Dynamo's example inputs compiled):
`is_cross_attention` (cross- or self-attention, on positive evidence only),
`positions_count_along_row` (positions counted along the row by the model itself),
`convolution_length` (a convolution along the sequence), `is_score_softmax` (attention computed
without SDPA), and the refusals they lead to (`row_mixers_error`, `attention_without_sdpa_error`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import sympy
import torch
import torch.fx as fx

from .metadata import AttentionMetadata

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


# ------------------------------------------------------------------------------------------------
# Rules both paths apply. Eager `attention_mode` (mode.py, op by op on concrete tensors) and the
# compiled backend (sites.py and backend/compiler.py, from the graph and Dynamo's example inputs)
# each gather the facts below their own way, then decide by these functions, so the same model gets
# the same verdict (issue 30: two implementations of one rule drift apart). tests/test_attention_rules.py
# runs one table of forms through both paths.

# Ops that move or copy a tensor without mixing its tokens with anything else. A query or key that is
# an input of the call (or a tensor from outside an attention_mode block) through these alone has no
# provenance either path can read: lengths decide (`is_cross_attention`).
LAYOUT_OPS = frozenset(
    {
        "view", "reshape", "transpose", "permute", "contiguous", "expand", "unsqueeze", "squeeze",
        "clone", "slice", "getitem", "__getitem__", "to", "_to_copy", "flatten", "unflatten", "alias",
        "t", "chunk", "split", "unbind", "narrow", "select", "movedim", "view_as", "reshape_as",
        "expand_as", "detach",
    }
)  # fmt: skip


def known_equal(a: Any, b: Any) -> bool:
    """a == b provably, ints or SymInts, without adding a guard to a shape environment."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return bool(statically_known_true(a == b))


def is_row_length(length: Any, lengths: Any) -> bool:
    """Whether `length` is provably one of `lengths` (the token lengths of the attention calls)."""
    return any(known_equal(length, n) for n in lengths)


def is_cross_attention(
    q_inputs: frozenset | None, k_inputs: frozenset | None, q_length: Any, k_length: Any
) -> bool:
    """Whether an attention call's keys come from another token stream than its queries.

    `q_inputs` / `k_inputs`: the inputs each is computed from (graph inputs that are data, or the
    tensors from outside an attention_mode block, by storage), or None where it is such an input
    itself through layout ops only (`LAYOUT_OPS`), whose provenance is unknown. Self-attention
    computes its keys from every input its queries come from (the token stream and what modulates
    it); keys from only part of them (a text encoder's states feeding a video model's queries) are
    cross-attention, whatever the lengths. Unknown provenance is no evidence: the lengths decide,
    the reading SDPA's own caller gives (issue 30: q, k, v cut from one fused projection were
    refused as cross-attention)."""
    if q_inputs is None or k_inputs is None:
        return not known_equal(q_length, k_length)
    return not q_inputs <= k_inputs


def convolution_length(x_shape: Any, w_shape: Any) -> Any | None:
    """The length a 1-D convolution (input (B, C, L), weight (O, C/groups, K)) mixes tokens along,
    when its kernel is wider than one (K not provably 1: a pointwise convolution mixes channels
    only); else None. A short causal convolution of a hybrid model (LFM2's, Mamba's) along a packed
    row mixes the end of one document into the next."""
    if w_shape is None or x_shape is None or len(w_shape) != 3 or len(x_shape) < 2:
        return None
    if known_equal(w_shape[-1], 1):
        return None
    return x_shape[-1]


def counts_along_row(values: Any) -> bool:
    """Values that count up by one along the whole last dim (0, 1, 2, ... or from any start), on
    every row: positions. Read on concrete values only (False for fake or meta tensors)."""
    if not isinstance(values, torch.Tensor) or values.is_complex() or values.dtype == torch.bool:
        return False
    if values.dim() == 0 or values.shape[-1] < 2:
        return False
    from torch._subclasses.fake_tensor import is_fake

    # Not `metadata._is_real`: the compile backend reads Dynamo's real example inputs while Dynamo
    # is compiling.
    if values.is_meta or is_fake(values) or type(values) is not torch.Tensor:
        return False
    if torch._C._functorch.is_functorch_wrapped_tensor(values):  # inside vmap / grad: no values
        return False
    if values.numel() == 0:
        return False
    if values.numel() > 4096:  # a cheap no for most tensors
        first = values.reshape(-1, values.shape[-1])[0, :2]
        if not bool(first[1] - first[0] == 1):
            return False
    return bool((values[..., 1:] - values[..., :-1] == 1).all())


def is_position_candidate(shape: Any, floating: bool) -> bool:
    """Whether a tensor may hold positions worth reading the values of: an integer tensor of at
    least one dim, its last two or more. Floating point tensors are never read: an ``arange`` of
    floats is what rotary embeddings count their frequencies with (over the head dim, which may
    be as long as the row: usp's Llama on a row of 4 tokens with head dim 8), and reading every
    float tensor would cost eager a pass over each."""
    return not floating and len(shape) > 0 and not (isinstance(shape[-1], int) and shape[-1] < 2)


def positions_count_along_row(values: Any, passed_lengths: Any, world: int = 1) -> bool:
    """Whether concrete `values` are positions counted along the row by the model itself, which
    packed documents (or a rank's shard of the row) cannot restart.

    Any source: ``arange`` over the row (BART, OPT, GPT-2 without position ids, the rotary
    positions of a decoder called without them), a ``cumsum`` of ones (RoBERTa's positions from
    input ids with no padding), a slice of the model's own position table (BERT's ``position_ids``
    buffer), each with any offset or expansion: the values count up by one along the whole row.
    `passed_lengths`: the row lengths of the inputs of the call they are computed from whose own
    values count along their row. Positions the caller passed are the caller's word and never
    refused: an input as long as the row, or under context parallelism (`world` ranks) as long as
    the global row, of which ``cp.shard`` takes this rank's part. A model's own table is longer
    than the row (BERT's: max_position_embeddings).

    Both paths refuse such positions when an embedding looks them up or an attention call's
    queries or keys are computed from them (rotary embeddings: relative in exact arithmetic, but
    computed in fp32 by transformers, and some scalings depend on the positions themselves)."""
    if not counts_along_row(values):
        return False
    length = values.shape[-1]
    return not any(n in (length, length * world) for n in passed_lengths)


# Arguments (by position, the tensor first, as both the function and the method forms take them)
# that index rather than compute. Writes place values at the index (a permutation's scatter, a
# static cache's cache_position): the index is never a value of the result. Reads select by it:
# a selection within the row (the source has a dim as long as the index: a packed layout's
# permutation) is no value either, but a lookup in a table (GPT-J's rotary sines by position) is.
INDEX_ARGUMENTS = {
    "index_select": 2, "gather": 2, "take": 1, "take_along_dim": 1, "getitem": 1, "__getitem__": 1,
    "index": 1, "_unsafe_index": 1,
}  # fmt: skip
WRITE_INDEX_ARGUMENTS = {
    "scatter": 2, "scatter_add": 2, "scatter_reduce": 2, "index_add": 2, "index_copy": 2, "index_fill": 2,
    "index_put": 1, "setitem": 1, "__setitem__": 1,
}  # fmt: skip


def value_arguments(
    name: str, args: Any, kwargs: Mapping[str, Any], shape_of: Callable[[Any], Any] = lambda x: None
) -> list[Any]:
    """The arguments of a call to `name` whose values flow into its result: all but the index
    argument of a write (`WRITE_INDEX_ARGUMENTS`), or of a read that selects within the row
    (`INDEX_ARGUMENTS`: the source, argument 0, has a dim as long as the index's last), positional
    or by keyword (``index``, ``indices``). `shape_of`: an argument's shape (None: unknown, then a
    read counts as a selection)."""
    in_place = name.endswith("_") and not name.endswith("__")  # index_copy_ indexes as index_copy
    key = name[:-1] if in_place else name
    skip = WRITE_INDEX_ARGUMENTS.get(key)
    if skip is None and key in INDEX_ARGUMENTS:
        skip = INDEX_ARGUMENTS[key]
        index = args[skip] if len(args) > skip else kwargs.get("index", kwargs.get("indices"))
        source, length = shape_of(args[0]) if args else None, _last_dim(index, shape_of)
        dim = _indexed_dim(key, args, kwargs, index, shape_of)
        if source is not None and length is not None:
            along = source if dim is None or not -len(source) <= dim < len(source) else (source[dim],)
            if not any(known_equal(d, length) for d in along):
                skip = None  # a lookup in a table: its values are the positions'
    out = [a for i, a in enumerate(args) if i != skip]
    out += [v for k, v in kwargs.items() if skip is None or k not in ("index", "indices")]
    return out


def _indexed_dim(key: str, args: Any, kwargs: Mapping[str, Any], index: Any, shape_of) -> int | None:
    """The dim of the source a read selects along (None: unknown, any dim may be)."""
    if key in ("index_select", "gather", "take_along_dim"):
        dim = args[1] if len(args) > 1 else kwargs.get("dim")
        return dim if isinstance(dim, int) else None
    if key in ("getitem", "__getitem__", "index", "_unsafe_index"):
        items = index if isinstance(index, (tuple, list)) else (index,)
        position = 0
        for item in items:
            if item is Ellipsis:
                return None
            if shape_of(item) is not None:
                return position
            if item is not None:  # None adds a dim to the result, none of the source's
                position += 1
    return None


def _last_dim(index: Any, shape_of: Callable[[Any], Any]) -> Any:
    """The last dim of the first tensor in an index (a tensor, or a tuple of them and slices)."""
    if isinstance(index, (tuple, list)):
        for item in index:
            found = _last_dim(item, shape_of)
            if found is not None:
                return found
        return None
    shape = shape_of(index)
    return shape[-1] if shape is not None and len(shape) > 0 else None


ROW_POSITIONS = (
    "looks up positions that count along the row (from arange, a cumsum or the model's own position table)"
)
POSITIONS_IN_ATTENTION = "counts positions along the row that reach the queries or keys"
SEQUENCE_CONVOLUTION = "convolves along the sequence"
SEQUENCE_CONTRACTION = "contracts over the sequence (linear attention: keys and values summed over the row)"


def contraction_length(a_shape: Any, b_shape: Any) -> Any | None:
    """The length a matmul of two token-derived operands ((..., M, N) @ (..., N, P)) sums over, N.
    Under packed documents an N that is a token length of the call sums over every document of the
    row: linear attention (Sana's ReLU attention, k^T v over the tokens). Callers leave out
    products with a weight (a projection sums over features)."""
    if a_shape is None or b_shape is None or len(a_shape) < 2 or len(b_shape) < 2:
        return None
    if not known_equal(a_shape[-1], b_shape[-2]):
        return None
    return a_shape[-1]


def row_mixers_error(who: str, found, *, cp: bool) -> ValueError:
    """The refusal of what counts or mixes tokens along a whole row outside attention (positions
    counted along the row, a convolution over the sequence: `found` describes each) when the row
    is not one sequence: packed documents, or (`cp`) one rank's shard of it. Eager
    `attention_mode` and the compiled backend both raise it."""
    where = "; ".join(found)
    if cp:
        return ValueError(
            f"context parallelism, but {who} counts or mixes tokens along the whole row outside attention ({where}): "
            "each rank holds only its shard of the row, so positions from arange restart at 0 on every rank and a "
            "convolution misses its neighbour's tokens; pass position_ids sharded with cp.shard (a model whose "
            "forward takes them), or run the model without context parallelism"
        )
    return ValueError(
        f"packed documents, but {who} counts or mixes tokens along the whole row outside attention ({where}), "
        "which would not restart at each document: positions counted along the row rather than the position ids "
        "passed in, or a convolution over the sequence; pass position_ids to a model whose forward takes them, or "
        "run it without packed documents (outside documents(...), attention_mode without metadata), one document "
        "per batch row"
    )


# ------------------------------------------------------------------------------------------------
# Attention computed without SDPA: one rule, read by eager `attention_mode` (op by op) and by the
# compiled backend (from the graph). usp_graph rewrites SDPA calls; a model that computes its
# attention another way (transformers' "eager" matmul + softmax, or flex_attention) would attend
# across packed documents under a `documents`/`attention_mode(metadata)` block, silently.


def is_score_softmax(shape, dim: int, lengths, key_lengths=()) -> bool:
    """A softmax over the last dim of (..., A, B) attention scores: A a token length of the call in
    `lengths`, and either B == A (self-attention: every query over every key of the row) or B in
    `key_lengths` (cross-attention onto a stream of another length whose documents are packed too,
    e.g. per-sample prompts: every query would see every sample's keys)."""
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    if len(shape) < 3 or dim not in (-1, len(shape) - 1):
        return False
    if not any(statically_known_true(shape[-2] == n) for n in lengths):
        return False
    if statically_known_true(shape[-1] == shape[-2]):
        return True
    return any(statically_known_true(shape[-1] == n) for n in key_lengths)


def sequence_join_length(out_shape, dim: int, sizes) -> Any | None:
    """The length of a concatenation that joins token streams along a sequence dimension, or
    None: a cat of two or more non-empty pieces along a dim that is neither the batch (0) nor the
    features (last) of a result with three or more dims ((B, L, D), (B, L, H, K) or (B, H, L, K)).
    Joint attention (diffusers' Flux, SD3, CogVideoX) puts every sample's text before every
    sample's image: under packed documents a sample is then not one run of the row, unless the
    joined sequence is put back in document order (an index_select / gather along it)."""
    rank = len(out_shape)
    if rank < 3:
        return None
    d = dim % rank
    if d in (0, rank - 1):
        return None
    if sum(1 for n in sizes if not known_equal(n, 0)) < 2:
        return None
    return out_shape[d]


def joined_sequence_warning(who: str, found) -> str:
    """The warning about attention over token streams concatenated along the sequence under
    packed documents (`sequence_join_length`), once per mode or compiled graph. Not a refusal:
    documents described in the joined order (a joint row split where the caller means) are exact;
    documents of whole samples ([text_i + image_i] per sample) are not, since the joined row holds
    every text before every image. Eager `attention_mode` and the compiled backend warn alike."""
    return (
        f"packed documents, and {who} attends over token streams concatenated along the sequence ({'; '.join(found)}): "
        "the documents apply to the joined order. Joint attention (Flux, SD3, CogVideoX) puts every sample's text "
        "before every sample's image, so metadata of whole samples (one document of text_i + image_i tokens each) "
        "lets the samples attend across each other: pack one sample per row, or put the joined row in document "
        "order (index_select along the sequence) before attention"
    )


def attention_without_sdpa_error(who: str, found) -> ValueError:
    """The refusal of attention computed without SDPA under packed documents (`found` describes
    each place). Eager `attention_mode` and the compiled backend both raise it."""
    return ValueError(
        f"packed documents, but {who} computes attention without scaled_dot_product_attention ({'; '.join(found)}): "
        "usp_graph rewrites SDPA calls only, so the documents would attend across each other; build the model with "
        'attn_implementation="usp" (or "sdpa"), or run it without packed documents (outside documents(...), '
        "attention_mode without metadata)"
    )
