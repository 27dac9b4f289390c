"""Document masks: what an SDPA ``attn_mask`` means, decided by what the graph computes.

# B batch, H heads, L sequence (queries = keys), T packed tokens (B * L), N document slots

Libraries build the document mask themselves. transformers, in its training path
(``use_cache=False``), derives a packed-sequence mask from ``position_ids`` (a new document starts
where a position is not its predecessor + 1), ANDs it with causal or a sliding window, and hands
SDPA a ``(B, 1, L, L)`` boolean mask. usp_graph cannot rewrite "some mask"; it can rewrite a band
inside documents: ``window = (left, right)`` in flash-attention's convention (query q sees key k
of its own document iff ``q - left <= k <= q + right``, -1 meaning unbounded; causal is right 0).

`mask_form` decides, for a mask node of an FX graph, which of these it is:

- ``rows``: the mask does not depend on any input's values and is the band of one document per
  batch row (a causal or sliding-window mask built from ``arange``): the site is SDPA with
  ``is_causal``/a window, and the active document metadata applies, as for a mask-free call;
- ``positions``: the mask is the band inside the documents of an integer input (the position ids):
  documents are where positions count up by one. The rewrite uses the active metadata and checks,
  inside the graph, that it describes the same documents (`check_positions_match`); outside any
  `documents(...)` block the metadata is derived from the positions themselves
  (`cu_seqlens_from_positions`), on their device, with no host sync.

The decision evaluates the mask's own subgraph (everything it computes from, nothing else) on
probe inputs: one document per row (which fixes the band), then random document layouts with
length-1 documents and positions that restart at 0 or elsewhere. A mask that depends on anything
else (a padding mask, a float tensor, a learned bias) or that matches neither form on every probe
is refused with the reason, never reinterpreted.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

from .ops.boundaries import device_assert

__all__ = [
    "MaskForm",
    "mask_form",
    "keep_of",
    "Rows",
    "read_rows",
    "band_of",
    "is_band",
    "segments_of_positions",
    "document_starts",
    "cu_seqlens_from_positions",
    "check_positions_match",
    "positions_mask",
    "documents_of_mask",
    "check_mask_window",
]

UNBOUNDED = -1
_FORM_META = "usp_mask_form"


@dataclass(frozen=True)
class MaskForm:
    """What a mask computes: a band ``window`` inside the documents of ``kind``.

    kind: ``"rows"`` (one document per batch row whatever the inputs) or ``"positions"``
    (documents are the runs of `positions` that count up by one). window: (left, right), -1
    unbounded. positions: the graph input the documents come from (``"positions"`` only).
    """

    kind: str
    window: tuple[int, int]
    positions: fx.Node | None = None

    @property
    def is_causal(self) -> bool:
        return self.window[1] == 0

    @property
    def extra_window(self) -> tuple[int, int] | None:
        """The window beyond plain causal/bidirectional attention, or None when there is none."""
        left, right = self.window
        if left == UNBOUNDED and right in (UNBOUNDED, 0):
            return None
        return (left, UNBOUNDED if right == 0 else right)


# ------------------------------------------------------------------------------------------------
# Masks as tensors: bands inside documents.


# Masks are read in blocks of query rows: a (B, L, L) mask at 128K tokens is 16 GiB of bytes, and
# any whole-mask temporary (a bool copy of a float mask, an int64 row sum) multiplies that. One
# block holds about this many elements (16 MiB of bytes) whatever L is: O(L) extra memory for L up
# to 16M tokens, and few enough blocks that per-op overhead stays small (16 at 16K tokens).
_BLOCK_ELEMS = 1 << 24


def _keep_block(mask: Tensor) -> Tensor | None:
    """The boolean "may attend" of a block of an SDPA mask, or None when it is not a pure mask.

    A float mask qualifies when every entry is 0 (attend) or -inf / the dtype's lowest value
    (transformers' eager masks): such a bias removes the key exactly, as long as every query row
    keeps one key, which a band that contains the diagonal guarantees."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    zero = mask == 0
    dropped = (mask == float("-inf")) | (mask == torch.finfo(mask.dtype).min)
    if not bool((zero | dropped).all()):
        return None
    return zero


def keep_of(mask: Tensor) -> Tensor | None:
    """The boolean "may attend" of an SDPA mask (the mask itself when it is boolean), or None when
    it is not a pure mask (see `_keep_block`). A float mask is checked in blocks of rows, but the
    result is a whole boolean mask: readers of large masks use `read_rows`, which never makes one."""
    if mask.dtype == torch.bool:
        return mask
    if not mask.is_floating_point():
        return None
    if mask.dim() == 0 or mask.numel() == 0:
        return _keep_block(mask)
    rows = mask.reshape(-1, mask.shape[-1]) if mask.dim() > 1 else mask.reshape(1, -1)
    step = max(1, _BLOCK_ELEMS // max(1, rows.shape[-1]))
    for r0 in range(0, rows.shape[0], step):
        if _keep_block(rows[r0 : r0 + step]) is None:
            return None
    return mask == 0


@dataclass(frozen=True)
class Rows:
    """What a (B, L, L) mask keeps, per query row, in O(B L) memory: the first and last key it
    keeps, and whether its keys are exactly that run (at least one key, no holes)."""

    first: Tensor
    last: Tensor
    run: Tensor

    @property
    def length(self) -> int:
        return self.first.shape[-1]


def read_rows(mask_BLL: Tensor) -> Rows | None:
    """`Rows` of a boolean or 0/-inf mask (any strides, e.g. broadcast), or None when it is not a
    pure mask. Reads the mask once, in blocks of query rows: extra memory is one block
    (`_BLOCK_ELEMS` elements), never a whole-mask copy (an int64 row sum of a 128K-token mask
    would be 128 GiB)."""
    b, lq, lk = mask_BLL.shape
    if lq == 0 or b == 0:
        empty = torch.zeros(b, lq, dtype=torch.int64, device=mask_BLL.device)
        return Rows(empty, empty, empty.bool())
    step = max(1, _BLOCK_ELEMS // max(1, b * lk))
    parts = []
    for r0 in range(0, lq, step):
        keep = _keep_block(mask_BLL[:, r0 : r0 + step])
        if keep is None:
            return None
        parts.append(_block_rows(keep))
    return Rows(*(torch.cat(x, 1) for x in zip(*parts, strict=True)))


_BYTE_ONES = 0x0101010101010101  # eight kept keys, as the bytes of one int64 word


def _block_rows(keep: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(first, last, run) of each row of a boolean (..., L) block.

    A boolean row whose bytes can be read eight at a time (contiguous keys, L a multiple of 8) is
    read as int64 words: the nonzero words locate the run, the all-kept words between its ends
    prove it has no holes, and only the two end words are read byte by byte. Eight times fewer
    elements than reading bytes, which matters at 128K tokens (a (T, T) mask is 16 GiB)."""
    lk = keep.shape[-1]
    words = _as_words(keep)
    if words is None:
        return _byte_rows(keep.view(torch.uint8))
    nz = words != 0
    nz8 = nz.view(torch.uint8)
    n = words.shape[-1]
    fw = nz8.argmax(-1)
    lw = n - 1 - nz8.flip(-1).argmax(-1)
    nonzero = nz8.sum(-1, dtype=torch.int32)
    full = (words == _BYTE_ONES).view(torch.uint8).sum(-1, dtype=torch.int32)
    end_bytes = keep.view(torch.uint8).unflatten(-1, (n, 8))
    first_word = end_bytes.gather(-2, fw[..., None, None].expand(*fw.shape, 1, 8)).squeeze(-2)
    last_word = end_bytes.gather(-2, lw[..., None, None].expand(*lw.shape, 1, 8)).squeeze(-2)
    f_first, f_last, f_run = _byte_rows(first_word)
    l_first, l_last, l_run = _byte_rows(last_word)
    first, last = fw * 8 + f_first, lw * 8 + l_last
    one_word = fw == lw
    # The end words are runs that reach, respectively, the word's end and its start (or the one
    # word is a run); every word between them is all kept, and no other word is nonzero.
    ends_ok = torch.where(one_word, f_run, f_run & l_run & (f_last == 7) & (l_first == 0))
    between = (lw - fw - 1).clamp(min=0).to(torch.int32)
    inner_full = full - (first_word.sum(-1) == 8).int() - ((last_word.sum(-1) == 8) & ~one_word).int()
    run = (nonzero > 0) & ends_ok & (nonzero == (lw - fw + 1)) & (inner_full == between)
    del lk
    return first, last, run


def _as_words(keep: Tensor) -> Tensor | None:
    if keep.dtype != torch.bool or keep.shape[-1] % 8 or keep.shape[-1] == 0 or keep.stride(-1) != 1:
        return None
    if keep.storage_offset() % 8 or any(
        st % 8 for st, sz in zip(keep.stride()[:-1], keep.shape[:-1], strict=True) if sz > 1
    ):
        return None
    try:
        return keep.view(torch.int64)
    except RuntimeError:
        return None


def _byte_rows(k8: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    lk = k8.shape[-1]
    first = k8.argmax(-1)  # the first maximal value: the first kept key
    last = lk - 1 - k8.flip(-1).argmax(-1)
    count = k8.sum(-1, dtype=torch.int32)
    return first, last, (count > 0) & (count == last - first + 1)


def _rows_of(mask: Tensor | Rows) -> Rows | None:
    return mask if isinstance(mask, Rows) else read_rows(mask)


def segments_of_positions(pos_BL: Tensor) -> Tensor:
    """Document index of every token, (B, L): a document starts at each row start and wherever a
    position is not its predecessor + 1 (transformers' `find_packed_sequence_indices` rule)."""
    b, length = pos_BL.shape
    if length == 0:
        return pos_BL.new_zeros(b, 0, dtype=torch.int64)
    step = pos_BL[:, 1:] != pos_BL[:, :-1] + 1
    start = torch.cat([torch.ones(b, 1, dtype=torch.bool, device=pos_BL.device), step], 1)
    return start.long().cumsum(1) - 1


def _document_bounds(doc_BL: Tensor) -> tuple[Tensor, Tensor]:
    """First and last index of each token's document (documents are contiguous runs of ids)."""
    b, length = doc_BL.shape
    idx = torch.arange(length, device=doc_BL.device).expand(b, length)
    new = torch.ones_like(doc_BL, dtype=torch.bool)
    new[:, 1:] = doc_BL[:, 1:] != doc_BL[:, :-1]
    start = torch.where(new, idx, 0).cummax(-1).values
    end_flag = torch.ones_like(new)
    end_flag[:, :-1] = new[:, 1:]
    end = torch.where(end_flag, idx, length).flip(-1).cummin(-1).values.flip(-1)
    return start, end


def is_band(keep_BLL: Tensor | Rows, doc_BL: Tensor, window: tuple[int, int]) -> bool:
    """Whether the mask (or its `Rows`) is exactly the band `window` inside the documents `doc_BL`."""
    rows = _rows_of(keep_BLL)
    if rows is None:
        return False
    if rows.first.numel() == 0:
        return True
    start, end = _document_bounds(doc_BL.expand(rows.first.shape))
    q = torch.arange(rows.length, device=rows.first.device)
    left, right = window
    want_first = start if left == UNBOUNDED else torch.maximum(start, q - left)
    want_last = end if right == UNBOUNDED else torch.minimum(end, q + right)
    return bool((rows.run & (rows.first == want_first) & (rows.last == want_last)).all())


def band_of(keep_BLL: Tensor | Rows, doc_BL: Tensor | None = None) -> tuple[int, int] | None:
    """The window of a mask (or its `Rows`) inside the documents `doc_BL` (default: one per row),
    or None when the mask is no band inside them.

    Bounds that reach every document's ends are unbounded: in a document of n tokens a window of
    n - 1 or more cannot be told from none, and attends the same keys."""
    rows = _rows_of(keep_BLL)
    if rows is None:
        return None
    length = rows.length
    if doc_BL is None:
        doc_BL = torch.zeros(rows.first.shape, dtype=torch.long, device=rows.first.device)
    doc_BL = doc_BL.expand(rows.first.shape)
    if length == 0 or rows.first.numel() == 0:
        return (UNBOUNDED, UNBOUNDED)
    q = torch.arange(length, device=rows.first.device)
    if not bool((rows.run & (rows.first <= q) & (rows.last >= q)).all()):
        return None  # a band is one run of keys holding the diagonal; this is some other mask
    left, right = int((q - rows.first).max()), int((rows.last - q).max())
    start, end = _document_bounds(doc_BL)
    longest = int((end - start).max())  # the longest document, minus one
    window = (UNBOUNDED if left >= longest else left, UNBOUNDED if right >= longest else right)
    return window if is_band(rows, doc_BL, window) else None


def documents_of_mask(keep_BLL: Tensor | Rows) -> Tensor:
    """The finest contiguous documents a (B, L, L) band mask (or its `Rows`) respects: token t
    starts one when no query before t sees a key from t on and no query from t on sees a key before
    t. (For a mask that is no band the result is some split that `band_of` then refuses.)"""
    rows = _rows_of(keep_BLL)
    if rows is None:
        raise ValueError("documents_of_mask: the mask is neither boolean nor 0/-inf")
    b, length = rows.first.shape
    if length == 0:
        return torch.zeros(b, 0, dtype=torch.long, device=rows.first.device)
    t = torch.arange(length, device=rows.first.device)
    reach_before = torch.cat(
        [torch.full((b, 1), -1, device=t.device), rows.last.cummax(-1).values[:, :-1]], 1
    )
    reach_after = rows.first.flip(-1).cummin(-1).values.flip(-1)
    start = (reach_before < t) & (reach_after >= t)
    start[:, :1] = True
    return start.long().cumsum(1) - 1


# ------------------------------------------------------------------------------------------------
# Documents from position ids, inside a graph (fixed shapes, no host sync).


def document_starts(pos_BL: Tensor) -> Tensor:
    """(T,) bool: token t starts a document: a row start, or a position that is not its
    predecessor's + 1 (a restart at 0 or anywhere else: transformers' reading of packed position
    ids, `masking_utils.find_packed_sequence_indices`)."""
    b, length = pos_BL.shape
    flat = pos_BL.reshape(-1)
    if flat.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool, device=flat.device)
    # Token 0 starts one; so does each later token whose position is not its predecessor's + 1 (and,
    # with several rows, each row's first token). Few kernels: each is a launch in eager attention.
    later = flat[1:] != flat[:-1] + 1
    if b > 1:
        later = later | (torch.arange(1, flat.shape[0], device=flat.device) % length == 0)
    return torch.cat([torch.ones(1, dtype=torch.bool, device=flat.device), later])


def positions_mask(pos_BL: Tensor, *, is_causal: bool, window: tuple[int, int] | None = None) -> Tensor:
    """(B, 1, L, L) bool: the band (causal, or `window` in flash-attention's convention) inside the
    documents `pos_BL` counts: the mask transformers builds from packed position ids. Only for a
    graph that backend usp rewrites: it reads the mask's form (`mask_form`, at a probe length)
    and checks the active metadata against these positions (`check_positions_match`); the (L, L)
    mask itself is never computed."""
    b, length = pos_BL.shape
    seg_BL = segments_of_positions(pos_BL)
    keep = seg_BL[:, :, None] == seg_BL[:, None, :]
    idx = torch.arange(length, device=pos_BL.device)
    back = idx[:, None] - idx[None, :]  # q - k
    left, right = window if window is not None else (UNBOUNDED, UNBOUNDED)
    if is_causal:
        keep = keep & (back >= 0)
    elif right != UNBOUNDED:
        keep = keep & (back >= -right)
    if left != UNBOUNDED:
        keep = keep & (back <= left)
    return keep[:, None]


def check_mask_window(
    mask_function: Any,
    starts_BL: Tensor,
    window: tuple[int, int] | None,
    *,
    is_causal: bool,
    probe: int | None,
) -> None:
    """Assert on the device that a model's mask function (transformers' ``mask_function(batch, head,
    q, kv)``) keeps the band `window` inside the documents `starts_BL` cuts: at distance ``left``
    a key is kept and at ``left + 1`` cut (and ahead, bidirectional, at ``right`` and ``right + 1``);
    with no window, that nothing is cut at distance `probe` (a window the layer does not hold).
    O(B x L): neighbours at a few distances, never (L, L). For compiled code, where the window is
    chosen without reading the mask function (Dynamo cannot read its closure)."""
    b, length = starts_BL.shape
    if window is None:
        distances = [(probe, True), (-probe, True)][: 1 if is_causal else 2] if probe else []
    else:
        left, right = window
        distances = [] if left < 0 else [(left, True), (left + 1, False)]
        if not is_causal and right >= 0:
            distances += [(-right, True), (-right - 1, False)]
    distances = [(d, kept) for d, kept in distances if d != 0 and abs(d) < length]
    if not distances:
        return
    device = starts_BL.device
    doc_BL = starts_BL.long().cumsum(1)
    rows = torch.arange(b, device=device)[:, None]
    heads = torch.zeros(1, 1, dtype=torch.long, device=device)
    q = torch.arange(length, device=device)[None, :]
    bad = torch.zeros((), dtype=torch.bool, device=device)
    for d, kept in distances:
        kv = q - d
        inside = (kv >= 0) & (kv < length)
        kv = kv.clamp(0, length - 1)
        same = inside & (doc_BL.gather(1, kv.expand(b, length)) == doc_BL)
        sees = torch.as_tensor(mask_function(rows, heads, q, kv), device=device).bool().expand(b, length)
        bad = bad | (same & (sees != kept)).any()
    device_assert(
        ~bad,
        'attn_implementation="usp": the model\'s mask holds another window than its layers (compiled code '
        'cannot read the mask\'s own); use attn_implementation="sdpa" for this model',
    )


def cu_seqlens_from_positions(pos_BL: Tensor, capacity: int | None = None) -> Tensor:
    """int32 `cu_seqlens` of the documents of `pos_BL`, with `capacity` entries (default T + 1,
    always enough); unused slots repeat T. Fixed shape, computed on `pos_BL`'s device.

    A capacity below the document count leaves the last documents out of the result;
    `check_positions_match` in the graph then fails the step."""
    return cu_seqlens_from_starts(document_starts(pos_BL), capacity)


def cu_seqlens_from_starts(starts_T: Tensor, capacity: int | None = None) -> Tensor:
    """int32 `cu_seqlens` of the documents whose first tokens `starts_T` marks ((T,) bool, token 0
    marked), with `capacity` entries (default T + 1); unused slots repeat T. No host read."""
    tokens = starts_T.shape[0]
    cap = tokens + 1 if capacity is None else capacity
    if tokens == 0:
        return torch.zeros(cap, dtype=torch.int32, device=starts_T.device)
    # Boundary s is the first token whose running count of starts exceeds s (slot s past the last
    # document: none, so T).
    counts = starts_T.cumsum(0)
    slots = torch.arange(1, cap + 1, device=starts_T.device)
    return torch.searchsorted(counts, slots, out_int32=True)


def starts_of_boundaries(cu_seqlens: Tensor, tokens: int) -> Tensor:
    """(tokens,) bool on the boundaries' device: the tokens where a document of `cu_seqlens` starts
    (empty documents and a capacity's repeated tail mark nothing more). No host read."""
    marks = torch.zeros(tokens + 1, dtype=torch.bool, device=cu_seqlens.device)
    return marks.scatter(0, cu_seqlens.long().clamp(0, tokens), True)[:tokens]


def check_positions_match(cu_seqlens_N1: Tensor, pos_BL: Tensor) -> None:
    """Fail the step (an async assert: no host sync on an accelerator) unless the documents of
    `cu_seqlens_N1` are exactly those `pos_BL` counts: the mask the model built from its position
    ids and the metadata usp_graph attends with must agree."""
    b, length = pos_BL.shape
    tokens = b * length
    cu = cu_seqlens_N1.to(pos_BL.device)
    ok = (
        torch.eq(starts_of_boundaries(cu, tokens), document_starts(pos_BL)).all()
        & (cu[-1] == tokens)
        & (cu[0] == 0)
    )
    device_assert(
        ok,
        "usp_graph: the document metadata does not describe the documents the position ids count (one "
        "starts where a position is not its predecessor + 1); build it with AttentionMetadata.from_position_ids",
    )


# ------------------------------------------------------------------------------------------------
# Mask nodes of an FX graph.


def _node_value(node: Any) -> Any:
    if not isinstance(node, fx.Node):
        return node
    return node.meta["val"] if "val" in node.meta else node.meta.get("example_value")


def _hint(x: Any) -> int:
    return int(x.node.hint) if isinstance(x, torch.SymInt) else int(x)


def _slice(out: fx.Node) -> tuple[list[fx.Node], list[fx.Node]] | str:
    """(nodes in graph order, leaf placeholders) of everything `out` is computed from."""
    seen: set[fx.Node] = set()
    stack = [out]
    while stack:
        node = stack.pop()
        if node in seen:
            continue
        seen.add(node)
        if node.op == "call_module":
            return f"the mask is computed by a submodule call ({node.target})"
        if node.op == "call_function" and isinstance(node.target, torch._ops.HigherOrderOperator):
            return f"the mask is computed inside {node.target}"
        stack.extend(node.all_input_nodes)
    order = [n for n in out.graph.nodes if n in seen]
    return order, [n for n in order if n.op == "placeholder"]


def _evaluator(gm: fx.GraphModule, nodes: list[fx.Node], leaves: list[fx.Node], out: fx.Node, sizes=None):
    """A GraphModule computing `out` from `leaves`; `sizes` maps integer constants of the nodes'
    arguments to others (the step's length to a probe length)."""

    def resize(a: Any) -> Any:
        if isinstance(a, (list, tuple)):
            return type(a)(resize(x) for x in a)
        if sizes and type(a) is int and a in sizes:
            return sizes[a]
        return a

    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    for leaf in leaves:
        env[leaf] = graph.placeholder(leaf.name)
    for node in nodes:
        if node.op == "placeholder":
            continue
        copy = graph.node_copy(node, lambda n: env[n])
        if sizes:
            copy.args, copy.kwargs = resize(copy.args), {k: resize(v) for k, v in copy.kwargs.items()}
        env[node] = copy
    graph.output(env[out])
    return fx.GraphModule(gm, graph)


# Masks are read at a probe length, never at the step's: the mask subgraph makes a (B, 1, L, L)
# tensor, 16 GiB at 128K tokens. The probe must exceed every window the subgraph can encode, so
# it is longer than every integer constant in it (transformers' sliding windows are constants);
# a mask needing a probe beyond `_PROBE_ELEMS` elements is evaluated at its own length only when
# that is as small.
_PROBE_MIN = 64
_PROBE_ELEMS = 1 << 26
# Constants this close to the step's length are that length plus an offset (a decomposed diff
# slices [1, L + 1)), and move with it to the probe.
_NEAR = 8


def _int_constants(nodes: list[fx.Node]) -> set[int]:
    found: set[int] = set()

    def walk(a: Any) -> None:
        if type(a) is int:
            found.add(a)
        elif isinstance(a, (list, tuple)):
            for x in a:
                walk(x)
        elif isinstance(a, dict):
            for x in a.values():
                walk(x)

    for node in nodes:
        if node.op == "call_function" or node.op == "call_method":
            walk(node.args)
            walk(node.kwargs)
    return found


def _moved(c: int, length: int, probe: int) -> int:
    """A constant near +-length, as it reads at the probe length (the same offset, the same sign)."""
    return (probe + abs(c) - length) * (1 if c >= 0 else -1)


def probe_length(nodes: list[fx.Node], batch: int, length: int) -> int | None:
    """The length to evaluate a mask subgraph at: `length` itself when small, else a probe longer
    than every other integer constant of the subgraph (so a window it encodes shows as a window);
    None when no probe within `_PROBE_ELEMS` elements is both."""
    consts = {abs(c) for c in _int_constants(nodes) if abs(abs(c) - length) > _NEAR}
    need = max(_PROBE_MIN, max(consts, default=0) + 3)
    if need >= length or batch * length * length <= _PROBE_ELEMS // 16:
        return length if batch * length * length <= _PROBE_ELEMS else None
    return need if batch * need * need <= _PROBE_ELEMS else None


def _probe_positions(b: int, length: int, device: torch.device, dtype: torch.dtype, seed: int) -> Tensor:
    """Positions of random documents per row: lengths 1.. (many 1s), restarting at 0 or elsewhere."""
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for _ in range(b):
        row: list[int] = []
        while len(row) < length:
            n = int(torch.randint(1, max(2, length // 3) + 1, (1,), generator=gen))
            if bool(torch.rand((), generator=gen) < 0.3):
                n = 1
            start = 0 if seed % 2 == 0 else int(torch.randint(0, 7, (1,), generator=gen))
            row.extend(range(start, start + n))
        rows.append(row[:length])
    return torch.tensor(rows, dtype=dtype).to(device)


def _as_keep_BLL(value: Any, b: int, length: int) -> Tensor | None:
    if not isinstance(value, Tensor):
        return None
    keep = keep_of(value)
    if keep is None:
        return None
    if keep.dim() == 2:
        keep = keep.unsqueeze(0)
    if keep.dim() == 4:
        if keep.shape[1] != 1 and keep.stride(1) != 0 and not bool((keep == keep[:, :1]).all()):
            return None  # differs per head: not a document mask
        keep = keep[:, 0]
    if keep.dim() != 3 or keep.shape[-2:] != (length, length):
        return None
    return keep.expand(b, length, length)


def mask_form(mask: fx.Node, *, batch: int, length: int) -> MaskForm | str:
    """What `mask` (an SDPA ``attn_mask`` node of a graph owned by a GraphModule) computes, for a
    call of `batch` rows of `length` queries and keys; a string says why it is no document mask.

    The result is cached on the node (one probe run per mask, however many layers share it)."""
    cached = mask.meta.get(_FORM_META)
    if cached is not None and cached[0] == (batch, length):
        return cached[1]
    form = _mask_form(mask, batch, length)
    mask.meta[_FORM_META] = ((batch, length), form)
    return form


def _mask_form(mask: fx.Node, batch: int, length: int) -> MaskForm | str:
    """`mask_form`, uncached: the mask's own subgraph, its leaves classified (`_mask_leaves`),
    evaluated at a probe length (`_probe`), its form read from the results (`_form_of_runs`)."""
    gm = mask.graph.owning_module
    if gm is None:
        return "the mask's graph has no module to evaluate it with"
    sliced = _slice(mask)
    if isinstance(sliced, str):
        return sliced
    nodes, leaves = sliced
    if any(n.op == "call_function" and n.target is operator.setitem for n in nodes):
        return "the mask is built by in-place assignment, which usp_graph does not evaluate"
    classified = _mask_leaves(leaves, batch, length)
    if isinstance(classified, str):
        return classified
    positions, fixed = classified
    probed = _probe(gm, nodes, leaves, mask, fixed, batch, length)
    if isinstance(probed, str):
        return probed
    evaluate, probe, resized = probed

    def run(pos: Tensor | None) -> Tensor | None:
        from torch._subclasses.fake_tensor import unset_fake_temporarily

        args = [pos if leaf is positions else fixed[leaf] for leaf in leaves]
        with unset_fake_temporarily(), torch.no_grad():
            try:
                return _as_keep_BLL(evaluate(*args), batch, probe)
            except Exception:  # noqa: BLE001 - any failure means: not a mask we can evaluate
                return None

    return _form_of_runs(run, positions, batch, probe, resized)


def _mask_leaves(
    leaves: list[fx.Node], batch: int, length: int
) -> tuple[fx.Node | None, dict[fx.Node, Any]] | str:
    """(the position ids input, the values of the other leaves), or why the mask depends on
    something that is not position ids (a padding mask, a float input, a mask made elsewhere)."""
    positions: fx.Node | None = None
    fixed: dict[fx.Node, Any] = {}
    for leaf in leaves:
        val = _node_value(leaf)
        if isinstance(val, torch.SymInt):
            fixed[leaf] = int(val.node.hint) if val.node.hint is not None else None
            if fixed[leaf] is None:
                return f"the mask depends on the size {leaf.name}, which has no example value"
        elif isinstance(val, (int, float, bool)):
            fixed[leaf] = val
        elif isinstance(val, Tensor):
            if "attention_mask" in leaf.name.lower():  # the caller's padding mask, by its argument's name
                return (
                    f"the mask depends on the padding attention_mask ({leaf.name}, {val.dtype}, "
                    f"{tuple(val.shape)}): usp_graph attends within packed documents and keeps no padding; pack "
                    "the documents into rows with position ids (e.g. DataCollatorWithFlattening; TRL: "
                    "SFTConfig(padding_free=True)) and pass no attention_mask"
                )
            if leaf.op == "placeholder" and val.dim() == 4 and _hint(val.shape[-1]) == length:
                return (
                    f"the mask depends on the values of input {leaf.name} ({val.dtype}, {tuple(val.shape)}), a mask "
                    "made outside this graph: by the caller (e.g. a padding mask), or in an earlier graph before a "
                    "graph break (e.g. a data-dependent loop "
                    "such as transformers' eager MoE experts; experts_implementation='batched_mm' or 'grouped_mm' "
                    "has none), so which documents it describes cannot be read; remove the graph break between "
                    "the mask and the attention, or pass position ids rather than a mask when packing documents"
                )
            if val.is_floating_point() or val.is_complex() or val.dtype == torch.bool:
                return (
                    f"the mask depends on the values of input {leaf.name} ({val.dtype}), not on position ids: a "
                    "bias or mask computed from other values (e.g. a relative position bias, or a mask made before "
                    "a graph break); usp_graph rewrites masks built from position ids only"
                )
            if positions is not None:
                return f"the mask depends on two integer inputs ({positions.name}, {leaf.name})"
            if val.dim() != 2 or _hint(val.shape[-1]) != length or _hint(val.shape[0]) not in (1, batch):
                return f"the mask depends on input {leaf.name} of shape {tuple(val.shape)}, not (B, L) position ids"
            positions = leaf
        else:
            return f"the mask depends on input {leaf.name}, which has no example value"
    return positions, fixed


def _probe(
    gm: fx.GraphModule,
    nodes: list[fx.Node],
    leaves: list[fx.Node],
    mask: fx.Node,
    fixed: dict[fx.Node, Any],
    batch: int,
    length: int,
) -> tuple[fx.GraphModule, int, bool] | str:
    """(an evaluator of the mask at the probe length, that length, whether it differs from the
    step's); `fixed` values near the step's length move with it."""
    probe = probe_length(nodes, batch, length)
    if probe is None:
        return (
            f"the mask holds a constant so large that no probe of at most {_PROBE_ELEMS} elements shows the window "
            f"it encodes (reading the mask at its {length} tokens would take {batch * length * length} bytes)"
        )
    sizes = None
    if probe != length:
        sizes = {c: _moved(c, length, probe) for c in _int_constants(nodes) if abs(abs(c) - length) <= _NEAR}
        sizes[length] = probe
    for leaf, value in fixed.items():
        if type(value) is int and abs(abs(value) - length) <= _NEAR and sizes:
            fixed[leaf] = _moved(value, length, probe)
    return _evaluator(gm, nodes, leaves, mask, sizes), probe, sizes is not None


def _form_of_runs(
    run: Any, positions: fx.Node | None, batch: int, length: int, resized: bool
) -> MaskForm | str:
    """The form of a mask `run(positions)` evaluates at `length` tokens: its band on one document
    per row, then on random document layouts (`_probe_positions`)."""
    pval = _node_value(positions) if positions is not None else None
    device = pval.device if pval is not None else torch.device("cpu")
    rows = _hint(pval.shape[0]) if pval is not None else batch
    dtype = pval.dtype if pval is not None else torch.int64
    base = torch.arange(length, dtype=dtype).expand(rows, length).to(device)
    keep = run(base if positions is not None else None)
    if keep is None:
        at = f" (evaluated at a probe length of {length} tokens)" if resized else ""
        return f"the mask could not be evaluated as a 0/-inf or boolean (B, 1, L, L) mask{at}"
    window = band_of(keep)
    if window is None:
        return "the mask is not causal, bidirectional or a sliding window within each row"
    if positions is None:
        return MaskForm("rows", window)
    as_rows = as_docs = True
    one_row = torch.zeros(batch, length, dtype=torch.long, device=device)
    for seed in range(4):
        pos = _probe_positions(rows, length, device, dtype, seed)
        keep = run(pos)
        if keep is None:
            return "the mask could not be evaluated on probe position ids"
        rows_read = read_rows(keep)
        as_rows = as_rows and is_band(rows_read, one_row, window)
        as_docs = as_docs and is_band(rows_read, segments_of_positions(pos.expand(batch, length)), window)
    if as_rows:
        return MaskForm("rows", window)
    if as_docs:
        return MaskForm("positions", window, positions)
    return (
        f"the mask computed from {positions.name} is neither a {window} band per row nor inside the documents "
        "those position ids count"
    )
