"""transformers attention implementation ``"usp"``: varlen attention within packed documents, and
no mask built for it.

# B batch, H query heads, G key/value heads, L sequence, K head dim, T packed tokens (B * L)

    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="usp")   # or from_config,
    model.set_attn_implementation("usp")                                           # or later

Registered with transformers' ``AttentionInterface`` and ``AttentionMaskInterface`` (when
transformers' modeling code is imported, or at ``import usp_graph`` if it already was), so
transformers builds no (T, T) mask: the mask builder of ``"usp"`` returns None after checking that
nothing would be lost (`usp_mask`). Each attention call asks `usp_graph.resolve` which documents
it attends within (one precedence table for every door: an active ``attention_mode``, an active
``documents`` block, flash-attention's ``cu_seq_lens_q/k``, ``position_ids``, the model's mask's
document starts, else one document per row); a block the active compiler would ignore (any
backend but usp, or ``attention_mode`` around compiled code) fails the call with the fix, and
block metadata that contradicts the call's position ids is refused, as on the "sdpa" door.

Causal or bidirectional from the module (``module.is_causal``, or the ``is_causal`` transformers
passes), a sliding window from the model's mask where eager code can read it (`_mask_window`),
else from the layer (the ``sliding_window`` transformers passes, else ``module.sliding_window``;
flash-attention's reading: ``window - 1`` keys back, and forward too when bidirectional; compiled
and bidirectional, transformers' mask rule ``|q - k| <= config.sliding_window``), which compiled
code checks against the mask function on the device (`masks.check_mask_window`),
grouped-query attention without repeating K/V. Refused with the reason: a padding mask or a 4-D
mask (pack the documents instead), a mask function beyond documents, causal and windows
(multimodal blocks, chunked attention in eager), model code that reads the mask itself, a KV
cache (query and key lengths differ), logit softcapping, attention sinks, a position bias,
dropout inside attention.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import re
import sys
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from . import resolve
from .checkpointing import note_eager_attention
from .masks import check_mask_window, document_starts, positions_mask
from .ops.boundaries import device_assert
from .resolve import ROUTED, DocumentStarts, UnsupportedAttention, documents_for_call
from .resolve import refuse as _refuse
from .sdpa import _is_tracing, sdpa_to_usp, windowed_sdpa

__all__ = ["ATTENTION", "register", "usp_attention_forward", "usp_mask"]

ATTENTION = "usp"


# ------------------------------------------------------------------------------------------------
# The attention function.


def usp_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    **kwargs: Any,
) -> tuple[Tensor, None]:
    """transformers' attention interface: (B, H, L, K) query, (B, G, L, K) key/value ->
    ((B, L, H, K) output, None)."""
    if not torch.compiler.is_compiling():  # a region Dynamo left out of a compiled model says so
        note_eager_attention()
    mask_starts = mask_window = mask_function = None
    if isinstance(attention_mask, DocumentStarts):
        mask_starts, mask_window = attention_mask.starts, attention_mask.window
        mask_function, attention_mask = attention_mask.mask_function, None
    cross = query.shape[2] != key.shape[2] and torch.compiler.is_compiling() and resolve.block_active()
    _refuse_what_usp_does_not_compute(module, query, key, attention_mask, dropout, kwargs, cross=cross)
    if cross:  # backend usp under documents(meta, kv=kv_meta) tells cross-attention from the graph
        resolve.refuse_unhonoured(query)
        out = F.scaled_dot_product_attention(
            query, key, value, scale=scaling, enable_gqa=key.shape[1] != query.shape[1]
        )
        return out.transpose(1, 2).contiguous(), None
    b, h, length, _ = query.shape
    is_causal = kwargs.get("is_causal")
    is_causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = _window(module, kwargs, is_causal, mask_window, unread=mask_function is not None)
    if mask_function is not None:  # compiled: the window was chosen without reading the mask's
        probe = getattr(getattr(module, "config", None), "sliding_window", None)
        probe = probe if isinstance(probe, int) and not isinstance(probe, bool) and probe > 0 else None
        check_mask_window(mask_function, mask_starts, window, is_causal=is_causal, probe=probe)
    gqa = key.shape[1] != h
    metadata = documents_for_call(
        module, kwargs, b, length, mask_starts=mask_starts, like=query, is_causal=is_causal
    )
    if metadata is ROUTED and torch.compiler.is_compiling() and kwargs.get("position_ids") is not None:
        # Backend usp applies the block's documents. Given as the mask transformers would build
        # from the position ids, the rewrite also checks that they count the block's documents,
        # as on the "sdpa" door (`masks.check_positions_match`); the mask is read, never computed.
        mask = positions_mask(kwargs["position_ids"].expand(b, length), is_causal=is_causal, window=window)
        out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling, enable_gqa=gqa)
    elif metadata is ROUTED:  # attention_mode, backend usp or usp_graph's tracer applies the documents
        out = windowed_sdpa(
            query, key, value, is_causal=is_causal, scale=scaling, enable_gqa=gqa, window=window
        )
    else:
        out = sdpa_to_usp(
            query, key, value, is_causal=is_causal, scale=scaling, enable_gqa=gqa, metadata=metadata,
            window=window,
        )  # fmt: skip
    return out.transpose(1, 2).contiguous(), None


def _refuse_what_usp_does_not_compute(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    attention_mask: Any,
    dropout: float,
    kwargs: dict[str, Any],
    *,
    cross: bool = False,
) -> None:
    """A mask, logit softcapping, sinks, a position bias, dropout, a KV cache (query and key lengths
    differ, unless `cross`: cross-attention backend usp rewrites): refused with the fix."""
    if attention_mask is not None:
        raise _refuse(
            f"an attention mask of shape {tuple(attention_mask.shape)} reached attention (a 4-D mask passed to the "
            "model, or a mask another implementation built)",
            "pack the documents into rows and pass position_ids (e.g. DataCollatorWithFlattening) or use "
            "usp_graph.documents(...), and pass no attention_mask",
        )
    for name, what in (
        ("softcap", "logit softcapping"),
        ("s_aux", "attention sinks"),
        ("sinks", "attention sinks"),
        ("position_bias", "an additive position bias"),
    ):
        if kwargs.get(name) is not None:
            raise _refuse(
                f"{what} ({name}=...) is not supported",
                'use attn_implementation="eager" (or "sdpa" where the model offers it)',
            )
    if dropout and module.training:
        raise _refuse(
            f"dropout inside attention ({dropout}) is not supported",
            "set the model's attention_dropout to 0.0 for training",
        )
    lq, lk = query.shape[2], key.shape[2]
    if lq != lk and not cross:
        raise _refuse(
            f"query length {lq} != key length {lk}: a KV cache from earlier steps (generation)",
            'usp attends within the packed documents of one forward pass; generate with model.set_attn_implementation("sdpa")',
        )


def _window(
    module: torch.nn.Module,
    kwargs: dict[str, Any],
    is_causal: bool,
    mask_window: tuple[int, int] | None = None,
    *,
    unread: bool = False,
) -> tuple[int, int] | None:
    """flash-attention's window of the call: the model's mask's where it was read (`_mask_window`:
    what "sdpa" computes, also where the layer holds no window, or, bidirectional, counts one less),
    else the layer's: transformers' ``sliding_window`` w keeps keys fewer than w tokens back (and,
    bidirectional, fewer than w ahead): ``(w - 1, w - 1)``."""
    if mask_window is not None:
        left, right = mask_window
        return (left, -1) if is_causal else (left, left if right == -1 else right)
    sw = kwargs["sliding_window"] if "sliding_window" in kwargs else getattr(module, "sliding_window", None)
    if sw is None:
        return None
    if isinstance(sw, bool) or not isinstance(sw, int) or sw < 1:
        raise _refuse(f"sliding_window={sw!r} is not a positive int", "fix the model config's sliding_window")
    configured = getattr(getattr(module, "config", None), "sliding_window", None)
    if unread and not is_causal and isinstance(configured, int) and not isinstance(configured, bool):
        # Compiled, the mask unread: transformers' bidirectional window mask keeps |q - k| <=
        # config.sliding_window (`sliding_window_bidirectional_overlay`); attention checks it.
        return (configured, configured)
    return (sw - 1, -1) if is_causal else (sw - 1, sw - 1)


# ------------------------------------------------------------------------------------------------
# The mask builder: no mask, after checking that none is needed.

# The pieces of transformers' mask functions that describe documents, causality and windows,
# which the attention above computes from its own inputs (by qualified name, as
# transformers.masking_utils defines them). Any other piece (multimodal blocks, chunked
# attention, a user's function) would be lost, and is refused.
_KNOWN_MASK_PIECES = {
    "causal_mask_function",
    "bidirectional_mask_function",
    "and_masks.<locals>.and_mask",
    "sliding_window_overlay.<locals>.inner_mask",
    "sliding_window_bidirectional_overlay.<locals>.inner_mask",
    "packed_sequence_mask_function.<locals>.inner_mask",
    "remap_positions_for_packed_sequence.<locals>.inner_mask",
    "add_offsets_to_mask_function.<locals>.inner_mask",
    "padding_mask_function.<locals>.inner_mask",
}


def _unknown_pieces(fn: Any, seen: set[int] | None = None) -> list[str]:
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return []
    seen.add(id(fn))
    if isinstance(fn, (list, tuple)):
        return [x for f in fn for x in _unknown_pieces(f, seen)]
    if not callable(fn):
        return []
    name = getattr(fn, "__qualname__", type(fn).__qualname__)
    if name not in _KNOWN_MASK_PIECES:
        return [name]
    found = []
    for cell in getattr(fn, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if callable(inner) or isinstance(inner, (list, tuple)):
            found.extend(_unknown_pieces(inner, seen))
    return found


# transformers' window pieces: name -> the flash-attention window of its ``sliding_window`` w.
_WINDOW_PIECES = {
    "sliding_window_overlay.<locals>.inner_mask": lambda w: (w - 1, -1),  # kv > q - w
    "sliding_window_bidirectional_overlay.<locals>.inner_mask": lambda w: (w, w),  # |q - kv| <= w
}


def _mask_window(fn: Any, seen: set[int] | None = None) -> tuple[int, int] | None:
    """The window a mask function's own pieces hold (eager: Dynamo cannot read closure cells), or
    None when it holds none. Of two windows, the narrower (the mask ANDs them)."""
    seen = set() if seen is None else seen
    if id(fn) in seen:
        return None
    seen.add(id(fn))
    if isinstance(fn, (list, tuple)):
        found = [w for f in fn if (w := _mask_window(f, seen)) is not None]
        return min(found, default=None)
    code, cells = getattr(fn, "__code__", None), getattr(fn, "__closure__", None) or ()
    if code is None:
        return None
    values = {}
    for name, cell in zip(code.co_freevars, cells, strict=False):
        try:
            values[name] = cell.cell_contents
        except ValueError:  # an empty cell
            continue
    piece = _WINDOW_PIECES.get(getattr(fn, "__qualname__", ""))
    w = values.get("sliding_window")
    if piece is not None and isinstance(w, int) and not isinstance(w, bool) and w >= 1:
        return piece(w)
    found = [
        w
        for v in values.values()
        if (callable(v) or isinstance(v, (list, tuple))) and (w := _mask_window(v, seen))
    ]
    return min(found, default=None)


def usp_mask(
    batch_size: int,
    q_length: int | None = None,
    kv_length: int | None = None,
    q_offset: Any = 0,
    kv_offset: Any = 0,
    mask_function: Any = None,
    attention_mask: Tensor | None = None,
    **kwargs: Any,
) -> None:
    """transformers' mask interface for "usp": builds nothing. Refuses a padding mask with a
    padded token (checked on the device under compile, no host sync) and a mask function that
    says more than documents, causality and a window."""
    # Dynamo cannot read a closure's cells (it would break the graph here), so compiled code does not
    # check the mask function: a model whose mask says more (multimodal blocks) is refused in eager
    # only; the README says so.
    compiling = torch.compiler.is_compiling()
    if not compiling:
        resolve._READ.clear()  # a new forward: documents are read again from its tensors
        resolve._CHECKED.clear()
    unknown = _unknown_pieces(mask_function) if mask_function is not None and not compiling else []
    if unknown:
        raise _refuse(
            f"the model's mask holds {', '.join(sorted(set(unknown)))}, beyond documents, causality and a sliding "
            "window (e.g. multimodal blocks or chunked attention)",
            'use attn_implementation="sdpa" for this model',
        )
    if attention_mask is not None and isinstance(attention_mask, Tensor) and attention_mask.dim() == 2:
        message = (
            'attn_implementation="usp": the attention_mask pads tokens; usp attends within packed documents: '
            "pack them into rows and pass position_ids (DataCollatorWithFlattening; TRL: SFTConfig(padding_free=True)), "
            "without an attention_mask"
        )
        if compiling or _is_tracing(attention_mask):
            device_assert(attention_mask.bool().all(), message)
        elif not bool(attention_mask.bool().all()):
            raise UnsupportedAttention(message)
    device = kwargs.get("device")
    if device is None and isinstance(kwargs.get("cache_position"), Tensor):
        device = kwargs["cache_position"].device
    read = _mask_starts(batch_size, q_length, kv_length, q_offset, kv_offset, mask_function, device)
    if read is not None and not compiling:
        read.window = _mask_window(mask_function)
    elif read is not None:  # Dynamo cannot read the closure: attention checks its window against it
        read.mask_function = mask_function
    # The forward's position ids cut the documents too: with a cache passed, transformers leaves them
    # out of the mask function (`resolve.forward_positions`), eager and compiled alike.
    pos = None if read is None else resolve.forward_positions()
    if pos is not None and pos.dim() == 2 and pos.shape[-1] == q_length and pos.shape[0] in (1, batch_size):
        pos_starts = document_starts(pos.expand(batch_size, q_length)).reshape(read.starts.shape)
        read = DocumentStarts(
            read.starts | pos_starts.to(read.starts.device), read.window, read.mask_function
        )
    return read


def _mask_starts(
    batch_size: Any,
    q_length: Any,
    kv_length: Any,
    q_offset: Any,
    kv_offset: Any,
    mask_function: Any,
    device: Any,
) -> DocumentStarts | None:
    """`DocumentStarts` of a self-attention mask (query and key lengths equal, no offset), or None
    where it cannot be read (cross-attention, a cache, no device given, a mask function that does
    not take index tensors)."""
    if (
        mask_function is None
        or device is None
        or not all(isinstance(n, (int, torch.SymInt)) for n in (batch_size, q_length, kv_length))
        or q_length != kv_length
        or q_length < 1
        or not (isinstance(q_offset, int) and isinstance(kv_offset, int) and q_offset == kv_offset == 0)
    ):
        return None
    rows = torch.arange(batch_size, device=device)[:, None]
    heads = torch.zeros(1, 1, dtype=torch.long, device=device)
    queries = torch.arange(1, q_length, device=device)[None, :]
    try:  # can each token see the one before it?
        sees = mask_function(rows, heads, queries, queries - 1)
    except Exception:  # noqa: BLE001 - a mask function written for vmap only: nothing read
        return None
    if not isinstance(sees, Tensor):
        return None
    sees = torch.as_tensor(sees, device=device).bool().expand(batch_size, q_length - 1)
    first = torch.ones(batch_size, 1, dtype=torch.bool, device=device)
    return DocumentStarts(torch.cat([first, ~sees], dim=1))


# ------------------------------------------------------------------------------------------------
# Registration.


def register() -> None:
    """Register ``"usp"`` with transformers (idempotent). Runs by itself when transformers'
    modeling code is imported after usp_graph, or at ``import usp_graph`` after it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from .hf_rows import with_row_rules

    AttentionInterface.register(ATTENTION, with_row_rules(usp_attention_forward))
    AttentionMaskInterface.register(ATTENTION, usp_mask)
    _guard_model_classes()


def _calls_attention_interface(cls: type) -> bool:
    """Whether `cls`'s modeling code calls transformers' attention interface: transformers' own
    reading of the class's module (`_can_set_attn_implementation`), else the module's source names
    the interface's table. Decided per class, never by a list of families: a family that moves to
    the interface (Falcon in transformers 5) runs under "usp" from then on."""
    import inspect

    can_set = getattr(cls, "_can_set_attn_implementation", None)
    if callable(can_set):
        return bool(can_set())
    module = sys.modules.get(cls.__module__)
    try:
        source = inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return True  # unreadable (a notebook's class): let transformers decide
    has_attention_class = re.search(r"^class \w*Attention\w*\(nn\.Module\):", source, re.MULTILINE)
    return "ALL_ATTENTION_FUNCTIONS" in source or has_attention_class is None


# The oldest transformers release on which "usp" was checked to attend exactly the documents each
# model's own mask describes (tests/test_hf.py and the doors' tests; docs/transformers-and-trainer.md).
# On 5.0 usp read some models' masks and arguments as later releases pass them and attended the
# wrong documents without a word (GPT-BigCode, Persimmon: 0.11 off the documents run alone).
OLDEST_TRANSFORMERS = (5, 17)


def _refuse_old_transformers() -> None:
    import transformers

    version = getattr(transformers, "__version__", "")
    parts = re.match(r"(\d+)\.(\d+)", version)
    if parts is None or (int(parts[1]), int(parts[2])) >= OLDEST_TRANSFORMERS:
        return  # a release this new, or a build without a release number
    oldest = ".".join(map(str, OLDEST_TRANSFORMERS))
    raise _refuse(
        f"transformers {version} is older than {oldest}, the oldest release usp was checked on (older ones pass "
        "masks and attention arguments that usp reads differently, and some models would attend the wrong "
        "documents)",
        f"upgrade it (pip install -U 'transformers>={oldest}'), or keep this model on attn_implementation=\"sdpa\"",
    )


def _refuse_own_attention(cls: type) -> None:
    """A model class whose attention layers do not call transformers' attention interface
    (Bloom and MPT with ALiBi, GPT-Neo, ...) would never run usp: it would take usp's "no mask"
    for its own attention (wrong without a word) or fail looking the name up."""
    if not _calls_attention_interface(cls):
        raise _refuse(
            f"{cls.__name__} computes attention in its own code, not through transformers' attention interface, "
            "so usp would not run (and its attention would get no mask)",
            'load it with one of its own implementations (e.g. attn_implementation="eager")',
        )


def _guard_model_classes() -> None:
    """Refuse "usp" where transformers checks a model's attention implementation (at construction,
    from_pretrained and set_attn_implementation): see `_refuse_own_attention`. Left out quietly on
    a transformers without that check."""
    from transformers import PreTrainedModel

    check = getattr(PreTrainedModel, "_check_and_adjust_attn_implementation", None)
    if check is None or getattr(check, "_usp_guard", False):
        return

    def checked(self, attn_implementation, *args, **kwargs):
        if attn_implementation == ATTENTION:
            _refuse_old_transformers()
            _refuse_own_attention(type(self))
            from .hf_rows import install_row_rules

            # first: its hook pushes before the rules' hook may refuse, and pops after (always called)
            resolve.install_forward_positions(self)  # the mask builder's position ids (`usp_mask`)
            install_row_rules(self)  # packed documents: the rules of usp_graph.rules, as on every door
        return check(self, attn_implementation, *args, **kwargs)

    checked._usp_guard = True  # type: ignore[attr-defined]
    PreTrainedModel._check_and_adjust_attn_implementation = checked


_HOOKED = "transformers.modeling_utils"


class _RegisterAfterImport(importlib.abc.MetaPathFinder):
    """Registers "usp" right after transformers' modeling code is imported, so that
    ``from_pretrained(..., attn_implementation="usp")`` works with no call beyond ``import
    usp_graph``, and usp_graph never imports transformers itself (seconds, for those without it)."""

    def find_spec(self, fullname, path, target=None):
        if fullname != _HOOKED:
            return None
        if self in sys.meta_path:
            sys.meta_path.remove(self)  # once; the other finders find the module itself
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_register(module):
            exec_module(module)
            _register_quietly()

        spec.loader.exec_module = exec_and_register
        return spec


def _register_quietly() -> None:
    try:
        register()
    except Exception as e:  # noqa: BLE001 - another transformers layout must not break its import
        import warnings

        warnings.warn(
            f'usp_graph could not register attn_implementation="usp" with transformers ({e!r}); '
            "call usp_graph.hf.register() to see why",
            stacklevel=2,
        )


def install() -> None:
    """Register now if transformers' modeling code is loaded, else when it is."""
    if _HOOKED in sys.modules:
        _register_quietly()
    elif not any(isinstance(f, _RegisterAfterImport) for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterAfterImport())
