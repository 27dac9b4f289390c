"""What packed documents cannot be exact for: the one rule table every front door decides by.

# B batch rows, L tokens per row, P CP ranks, T packed tokens (B x L x P)

Eager `attention_mode` (its row tracker, `usp_graph.rows`, op by op on concrete tensors), the
compiled backend (`backend/compiler.py`, from Dynamo's graph and its example inputs), and
transformers' ``attn_implementation="usp"`` (the same row tracker around the model's forward)
each gather facts their own way, then decide by the functions here, and refuse with the errors
here, so one model gets one verdict on every door (issue 30: two implementations of one rule
drift apart; issue 37: a door that skipped the rules gave wrong results without a word).

`RULES` lists what packed documents (more than one document in a row, `one_document_per_row`) or a
rank's shard of a row cannot be exact for; each entry names what the model does, in the words of
its refusal (`refusal`):

- ``row_positions``: positions counted along the row by the model itself that an embedding looks
  up (`positions_count_along_row`: BART, OPT, GPT-2 without position ids, BERT's own table);
- ``positions_in_attention``: such positions reaching queries or keys (rotary positions of a
  decoder called without position ids);
- ``convolution``: a convolution along the sequence wider than one token (`convolution_length`:
  the short convolutions of hybrid models);
- ``contraction``: a matmul of two token-derived operands summing over the sequence
  (`contraction_length`: linear attention), never a per-token projection (`weight_dims`: MoE
  experts' weights selected per token);
- ``score_softmax`` / ``flex_attention``: attention computed without SDPA (`is_score_softmax`).

Beside them: `is_cross_attention` (which stream's documents a call takes) and
`sequence_join_length` (joint attention over concatenated streams, warned about).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

__all__ = [
    "INDEX_ARGUMENTS",
    "LAYOUT_OPS",
    "POSITIONS_IN_ATTENTION",
    "ROW_POSITIONS",
    "RULES",
    "SEQUENCE_CONTRACTION",
    "SEQUENCE_CONVOLUTION",
    "WEIGHT_LAYOUT_OPS",
    "WRITE_INDEX_ARGUMENTS",
    "Rule",
    "attention_without_sdpa_error",
    "contraction_length",
    "convolution_length",
    "counts_along_row",
    "finding",
    "is_cross_attention",
    "is_position_candidate",
    "is_row_length",
    "is_score_softmax",
    "joined_sequence_warning",
    "known_equal",
    "one_document_per_row",
    "positions_count_along_row",
    "refusal",
    "row_mixers_error",
    "sequence_join_length",
    "value_arguments",
    "weight_dims",
    "weight_dims_after",
]

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


def contraction_length(a_shape: Any, b_shape: Any, a_weight: int = 0, b_weight: int = 0) -> Any | None:
    """The length a matmul of two token-derived operands ((..., M, N) @ (..., N, P)) sums over, N.
    Under packed documents an N that is a token length of the call sums over every document of the
    row: linear attention (Sana's ReLU attention, k^T v over the tokens). Callers leave out
    products with a weight (a projection sums over features).

    `a_weight` / `b_weight`: how many trailing dims of each operand are a weight's own dims
    (`weight_dims`). A sum over one of them (a's last dim, b's second to last) is a projection
    computed per token with weights chosen per token (MoE experts' ``batched_mm``: the experts'
    weights gathered by each token's expert ids), never a sum over the sequence, whatever its size
    (4096 tokens on a 4096-wide model were refused as linear attention: issue 37)."""
    if a_shape is None or b_shape is None or len(a_shape) < 2 or len(b_shape) < 2:
        return None
    if a_weight >= 1 or b_weight >= 2:
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


# ------------------------------------------------------------------------------------------------
# Weights selected per token (MoE experts): which dims of a tensor are a weight's own, followed
# through the layout ops between the selection and the matmul. Both paths read them the same way:
# eager op by op (`usp_graph.rows`), compiled by walking the graph back (`sites.weight_dims_of`).

_SAME_LAYOUT = frozenset(
    {
        "contiguous",
        "clone",
        "to",
        "_to_copy",
        "detach",
        "alias",
        "float",
        "double",
        "half",
        "bfloat16",
        "type_as",
    }
)
_RESHAPES = frozenset(
    {"view", "reshape", "expand", "squeeze", "unsqueeze", "flatten", "unflatten", "view_as", "reshape_as",
     "expand_as"}
)  # fmt: skip
_SWAPS = frozenset({"transpose", "swapaxes", "swapdims"})
# The layout ops `weight_dims_after` follows weight dims through.
WEIGHT_LAYOUT_OPS = _SAME_LAYOUT | _RESHAPES | _SWAPS | {"permute"}


def weight_dims(name: str, source_shape: Any, index: Any, dim: Any = 0) -> int:
    """How many trailing dims of a read are the source's own when `name` selects the source's
    entries along dim 0 by one index tensor (``W[idx]``, ``index_select(W, 0, idx)``), the source
    being a weight (a parameter, or such a selection itself): all its dims but the first. 0 for any
    other read (`index`: the index argument as the call got it; its shape is not needed)."""
    if source_shape is None or len(source_shape) < 2 or dim != 0:
        return 0
    if name in ("getitem", "__getitem__", "index", "_unsafe_index"):
        items = index if isinstance(index, (tuple, list)) else (index,)
        if len(items) != 1 or not _is_index_tensor(items[0]):
            return 0
    elif name != "index_select":
        return 0
    return len(source_shape) - 1


def _is_index_tensor(x: Any) -> bool:
    val = x.meta.get("val", x.meta.get("example_value")) if hasattr(x, "meta") else x
    return isinstance(val, torch.Tensor) and not val.is_floating_point() and val.dtype != torch.bool


def weight_dims_after(name: str, weight: int, in_shape: Any, out_shape: Any, args: Sequence[Any] = ()) -> int:
    """`weight` trailing weight dims (`weight_dims`) of an input, after layout op `name` (0: none
    known after it): kept by copies, by reshapes that leave them as they were, by transposes and
    permutations among them."""
    if not weight or in_shape is None or out_shape is None:
        return 0
    if name in _SAME_LAYOUT:
        return weight
    rank = len(in_shape)
    if name in _RESHAPES:
        if len(out_shape) < weight or len(in_shape) < weight:
            return 0
        same = all(known_equal(a, b) for a, b in zip(in_shape[-weight:], out_shape[-weight:], strict=True))
        return weight if same else 0
    if name in _SWAPS and len(args) >= 3 and all(isinstance(d, int) for d in args[1:3]):
        inside = [(d % rank) >= rank - weight for d in args[1:3]] if rank else [False, False]
        return weight if inside[0] == inside[1] else 0
    if name == "permute" and len(args) >= 2:
        dims = args[1] if len(args) == 2 and isinstance(args[1], (tuple, list)) else args[1:]
        if len(dims) == rank and all(isinstance(d, int) for d in dims):
            tail = {d % rank for d in dims[rank - weight :]}
            return weight if tail == set(range(rank - weight, rank)) else 0
    return 0


# ------------------------------------------------------------------------------------------------
# When the rules apply, and the table of what they refuse.


def one_document_per_row(boundaries: Sequence[int], length: int) -> bool:
    """Whether document `boundaries` (cu_seqlens as ints: starts, then the total; unused slots
    repeat it) cut the stream exactly at its rows of `length` tokens (under context parallelism the
    global row): then each document is a whole row, which SDPA's own semantics already computes, and
    nothing along the row needs to restart. Anything else is packed (more than one document in a
    row, or one document over several rows) and the `RULES` apply."""
    cuts = sorted(set(int(b) for b in boundaries))
    if length <= 0 or not cuts:
        return False
    return cuts == list(range(0, cuts[-1] + 1, length))


@dataclass(frozen=True)
class Rule:
    """One thing packed documents cannot be exact for: `says` what the model does, in its refusal
    (`refusal`); `attention`: attention computed without SDPA (else: something that counts or
    mixes tokens along the row outside attention)."""

    name: str
    says: str
    attention: bool = False


RULES: dict[str, Rule] = {
    r.name: r
    for r in (
        Rule("row_positions", ROW_POSITIONS),
        Rule("positions_in_attention", POSITIONS_IN_ATTENTION),
        Rule("convolution", SEQUENCE_CONVOLUTION),
        Rule("contraction", SEQUENCE_CONTRACTION),
        Rule("score_softmax", "attention scores (matmul + softmax)", attention=True),
        Rule("flex_attention", "flex_attention", attention=True),
    )
}


def finding(rule: str, where: str) -> str:
    """What a door found, for its refusal: `where` (a node, an op) and what rule `rule` says it
    does (a KeyError for a rule not in `RULES`: every finding is one of the table's)."""
    return f"{where} {RULES[rule].says}".strip()


def refusal(who: str, found: Sequence[tuple[str, str]], *, cp: bool = False) -> ValueError:
    """The refusal of `found` ((rule, where) pairs) under packed documents or (`cp`) context
    parallelism, the same on every door: attention without SDPA first (the fix is the attention
    implementation), else what mixes tokens along the row."""
    attention = [finding(r, w) for r, w in found if RULES[r].attention]
    if attention:
        return attention_without_sdpa_error(who, attention)
    return row_mixers_error(who, sorted({finding(r, w) for r, w in found}), cp=cp)
