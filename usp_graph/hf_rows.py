"""The rule table on transformers' ``attn_implementation="usp"``: its forward under the row tracker.

# B batch rows, L tokens per row, T packed tokens

"usp" computes attention itself, from documents it reads per call (position ids, flash-attention
kwargs, a `documents` block), so no `attention_mode` follows its forward. Here a forward pre-hook
(installed where hf.py checks a model's attention implementation) runs the model's forward under
`rows.RowRules` when it is called with packed documents (`forward_documents`), and the attention
function reports each call (`with_row_rules`): the same rules (`usp_graph.rules`) and refusals as
every other door. The verdict is kept on the model per kind of documents given (`_verdict_key`):
the first packed forward is followed op by op, later ones run as before. Under torch.compile (any
backend, fullgraph=True too) the hook adds no graph break: the verdict of a compiled forward comes
from one eager forward without grad under the rules (`_verdict_in_eager`), run on the host while
Dynamo traces the hook (`_verdict_while_tracing`, a constant of the trace), or in eager where
torch.compile(model) left the hook to eager.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import sys
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch

from . import dynamo_marks
from .metadata import AttentionMetadata
from .rows import RowRules, RowTracker, active_row_rules
from .rules import one_document_per_row

__all__ = ["forward_documents", "install_row_rules", "with_row_rules"]


def with_row_rules(attention: Callable[..., Any]) -> Callable[..., Any]:
    """`attention` (transformers' attention interface: module, query, key, value, ...) reporting
    each call to the active `RowRules` and running untracked inside it."""

    @functools.wraps(attention)
    def checked(module, query, key, value, *args, **kwargs):
        if torch.compiler.is_compiling():
            return attention(module, query, key, value, *args, **kwargs)
        mode = active_row_rules()
        if mode is None or mode.paused:
            return attention(module, query, key, value, *args, **kwargs)
        mode.tracker.attention(query, key)
        mode.paused = True
        try:
            out = attention(module, query, key, value, *args, **kwargs)
        finally:
            mode.paused = False
        mode.tracker.after(attention, (query, key, value), {}, out[0] if isinstance(out, tuple) else out)
        return out

    return checked


def forward_documents(args: tuple, kwargs: dict[str, Any]) -> AttentionMetadata | None:
    """The documents a transformers forward is called with, when they are packed (None: one
    document per row, or none given): an eager `documents(...)` block, flash-attention's
    ``cu_seq_lens_q``, or ``position_ids`` that restart within a row (transformers' reading,
    `masks.document_starts`). One host read of the position ids (or boundaries); input that the
    attention call refuses anyway (malformed ids) is left to it."""
    from .backend.documents import current_documents

    ids = kwargs.get("input_ids", args[0] if args else None)
    embeds = kwargs.get("inputs_embeds")
    row = ids if isinstance(ids, torch.Tensor) and ids.dim() == 2 else embeds
    length = int(row.shape[1]) if isinstance(row, torch.Tensor) and row.dim() >= 2 else None
    tokens = int(row.shape[0]) * length if length is not None else None
    meta = current_documents()
    cu = kwargs.get("cu_seq_lens_q")
    pos = kwargs.get("position_ids")
    if meta is None and isinstance(cu, torch.Tensor) and cu.dim() == 1 and not cu.is_floating_point():
        ends = cu.tolist()
        well_formed = ends and ends[0] == 0 and ends[-1] == tokens
        if well_formed and all(b >= a for a, b in zip(ends, ends[1:], strict=False)):
            meta = AttentionMetadata.from_lengths(
                [b - a for a, b in zip(ends, ends[1:], strict=False)] or [0]
            )
    elif meta is None and isinstance(pos, torch.Tensor) and pos.dim() == 2 and not pos.is_floating_point():
        if pos.shape[-1] > 1 and bool((pos[:, 1:] != pos[:, :-1] + 1).any()) and bool((pos >= 0).all()):
            rows = tokens // length if tokens and length == pos.shape[-1] else pos.shape[0]
            meta = AttentionMetadata.from_position_ids(pos.expand(rows, -1) if pos.shape[0] == 1 else pos)
        length = int(pos.shape[-1])
    if meta is None or length is None or one_document_per_row(meta.cu_seqlens.tolist(), length):
        return None
    return meta


# Per thread: the `RowRules` each forward of a "usp" model entered (None where it entered none).
_ENTERED = threading.local()


def install_row_rules(model: torch.nn.Module) -> None:
    """Run `model`'s forward under `RowRules` when it uses attn_implementation="usp" and is called
    with packed documents (`forward_documents`), in eager; once per model."""
    if getattr(model, "_usp_row_rules", False):
        return
    model.register_forward_pre_hook(_enter_row_rules, with_kwargs=True)
    model.register_forward_hook(_leave_row_rules, always_call=True)
    model._usp_row_rules = True
    _MODELS[id(model)] = model


# The models `install_row_rules` installed its hooks on, by id: `_verdict_while_tracing` finds the
# model there (a copy or an unpickled model, with the hooks but not here, is found at its first
# eager forward).
_MODELS: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_UNKNOWN_MODEL = "unknown model"


# transformers' flash-attention kwargs that usp never reads (it takes the documents from
# cu_seq_lens_q/k): left out of the verdict's inputs, or Dynamo would guard on each batch's longest
# document and recompile as it changes.
_UNREAD = frozenset({"max_length_q", "max_length_k"})


def _plain(value: Any) -> bool:
    """A value Dynamo can hand a constant function (`_verdict_while_tracing`)."""
    return value is None or isinstance(value, (torch.Tensor, bool, int, float, str))


def _enter_row_rules(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    if torch.compiler.is_compiling():
        # Dynamo traces this hook: as a frame of its own under torch.compile(model) (any backend), or
        # inlined where a compiled function calls the model. The documents would be read inside the
        # graph, where no rule applies: the verdict is a constant of the trace, from one eager
        # forward under the rules that Dynamo runs on the host while it traces (no graph break,
        # fullgraph=True holds), kept on the model.
        if kwargs.get("position_ids") is not None or kwargs.get("cu_seq_lens_q") is not None:
            # The model by its id (Dynamo hands a constant function tensors and constants only).
            inputs = {k: v for k, v in kwargs.items() if k not in _UNREAD and _plain(v)}
            refusal = _verdict_while_tracing(id(model), *[a if _plain(a) else None for a in args], **inputs)
            if refusal == _UNKNOWN_MODEL:  # not met in eager (a copy, unpickled): checked in eager
                _verdict_in_eager(model, args, kwargs)
            elif refusal is not None:
                raise ValueError(*refusal)
        return
    _MODELS[id(model)] = model
    if _in_optimized_module():
        # torch.compile(model) runs the hooks before the compiled frame; this one was left to eager.
        _verdict_in_eager(model, args, kwargs)
        return
    stack = _ENTERED.__dict__.setdefault("stack", [])
    mode = None
    stack.append(mode)
    if not _checks(model):
        return
    key, verdicts = _verdict_key(model, kwargs)
    if verdicts.get(key, False) is None:  # passed once under packed documents: not tracked again
        return
    meta = forward_documents(args, kwargs)
    if meta is None:
        return
    if isinstance(verdicts.get(key), ValueError):
        raise type(verdicts[key])(*verdicts[key].args)
    mode = stack[-1] = RowRules(RowTracker(meta), key=key)
    mode.__enter__()


def _leave_row_rules(model: torch.nn.Module, args: tuple, *rest: Any) -> None:
    """Leave the block `_enter_row_rules` entered; a forward that completed under it passed."""
    if torch.compiler.is_compiling() or _in_optimized_module():
        return
    stack = _ENTERED.__dict__.setdefault("stack", [])
    mode = stack.pop() if stack else None
    if mode is None:
        return
    mode.__exit__(None, None, None)
    verdicts = model.__dict__.setdefault("_usp_row_verdicts", {})
    if mode.tracker.refused is not None:
        verdicts[mode.key] = mode.tracker.refused
    elif sys.exc_info()[0] is None:  # called after a completed forward, not for an error in it
        verdicts[mode.key] = None
        _passed_inside(model, mode.key)


def _checks(model: torch.nn.Module) -> bool:
    """Whether a forward of `model` is one the rules check here: attention implementation "usp",
    not inside another check or an `attention_mode` block (which checks every call itself)."""
    return (
        getattr(getattr(model, "config", None), "_attn_implementation", None) == "usp"
        and active_row_rules() is None
        and not _in_attention_mode()
    )


def _verdict_key(model: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[tuple[str, ...], dict]:
    """The kinds of documents a forward is given (a `documents` block, position ids, flash kwargs),
    under which its verdict is kept on the model (None: passed; a ValueError: refused)."""
    from .backend.documents import current_documents

    kinds = [k for k in ("position_ids", "cu_seq_lens_q") if kwargs.get(k) is not None]
    if current_documents() is not None:
        kinds.append("documents")
    return tuple(sorted(kinds)), model.__dict__.setdefault("_usp_row_verdicts", {})


@dynamo_marks.disable
def _verdict_in_eager(model: torch.nn.Module, args: tuple, kwargs: dict[str, Any]) -> None:
    """The rules for a compiled forward of a "usp" model, in eager (Dynamo compiles none of the
    frames this calls; `_verdict_while_tracing` runs it while Dynamo traces). The first call with packed documents runs
    the forward once more in eager, without grad, under `RowRules`; its verdict (the refusal, or
    none) is kept on the model for the kinds of documents given (`_verdict_key`), shared with
    eager forwards, and every later packed call takes it: one host read of the documents per call
    until the model is known to pass."""
    if not _checks(model):
        return
    key, verdicts = _verdict_key(model, kwargs)
    if verdicts.get(key, False) is None:  # passed once under packed documents
        return
    meta = forward_documents(args, kwargs)
    if meta is None:
        return
    if key not in verdicts and not getattr(_ENTERED, "checking", False):
        _ENTERED.checking = True  # the check's own forward passes the compiled hooks: check once
        try:
            _check_forward(model, args, kwargs, meta, key)
            verdicts[key] = None
            _passed_inside(model, key)
        except ValueError as e:
            # Another refusal of eager code (a mask function eager can read and compiled code cannot,
            # e.g. Llama 4's chunks) stopped the check: the compiled call decides for itself.
            verdicts[key] = e if _is_row_refusal(e) else None
        finally:
            _ENTERED.checking = False
    if verdicts.get(key) is not None:
        raise type(verdicts[key])(*verdicts[key].args)


def _passed_inside(model: torch.nn.Module, key: tuple[str, ...]) -> None:
    """The hooked models inside `model` (a causal LM's base model) ran under the same rules in its
    check's forward: they pass for the same kinds of documents, without a forward of their own
    (their hooks are traced after the outer one's and would check again)."""
    for sub in model.modules():
        if sub is not model and getattr(sub, "_usp_row_rules", False):
            sub.__dict__.setdefault("_usp_row_verdicts", {}).setdefault(key, None)


def _check_forward(
    model: torch.nn.Module, args: tuple, kwargs: dict[str, Any], meta: AttentionMetadata, key
) -> None:
    """The check's forward: eager, without grad, under `RowRules`, on its own random numbers
    (dropout: the compiled step draws the same as without the check). Without the loss first
    (`_check_inputs`); a forward that fails for what that left out (a client's patched forward
    that needs the labels, such as TRL's fused LM head) runs again on the inputs as given."""
    cuda = sorted({p.device.index or 0 for p in model.parameters() if p.device.type == "cuda"})
    light = _check_inputs(model, kwargs)
    trimmed = light.keys() != kwargs.keys() or any(light[k] is not kwargs[k] for k in light)
    for inputs in (light, kwargs) if trimmed else (kwargs,):
        try:
            with torch.random.fork_rng(devices=cuda), torch.no_grad(), RowRules(RowTracker(meta), key=key):
                model._call_impl(*args, **inputs)  # eager: the hooks, not the compiled call
            return
        except Exception as e:
            if inputs is kwargs or (isinstance(e, ValueError) and _is_row_refusal(e)):
                raise


# What the check's forward leaves out: the model's own loss and the logits of all tokens but the
# last. The rules look at what mixes tokens along the row on the way to attention; the LM head and
# the loss work token by token. A transformers loss upcasts the whole row's logits to float32 (31
# GiB at 256K tokens and a 32K vocabulary: the check of a compiled first step ran out of memory on
# an H100 where the step itself fits), and without labels a model patched with a fused loss would
# make the logits its training step never makes. An encoder-decoder keeps its labels: it makes its
# decoder's inputs from them.
_LOSS_ONLY = frozenset({"labels", "num_items_in_batch"})


def _check_inputs(model: torch.nn.Module, kwargs: dict[str, Any]) -> dict[str, Any]:
    if getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return kwargs
    kept = {k: v for k, v in kwargs.items() if k not in _LOSS_ONLY}
    if "logits_to_keep" not in kept and _takes_logits_to_keep(type(model)):
        kept["logits_to_keep"] = 1
    return kept


@functools.cache
def _takes_logits_to_keep(cls: type) -> bool:
    """transformers' causal LMs take ``logits_to_keep`` (the LM head runs on the last tokens only)."""
    try:
        return "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


@dynamo_marks.assume_constant_result
def _verdict_while_tracing(model_id: int, *args: Any, **kwargs: Any) -> tuple | str | None:
    """`_verdict_in_eager` while Dynamo traces a "usp" model's pre-hook: Dynamo runs this on the
    host with the real tensors and takes the result as a constant of the trace: None (passes, or
    nothing to check), else the refusal's arguments, raised in the traced hook (`_UNKNOWN_MODEL`:
    the model is not in `_MODELS`)."""
    model = _MODELS.get(model_id)
    if model is None:
        return _UNKNOWN_MODEL
    try:
        with _eager_while_compiling():
            _verdict_in_eager(model, args, kwargs)
    except ValueError as e:
        return tuple(e.args)
    return None


@contextlib.contextmanager
def _eager_while_compiling() -> Iterator[None]:
    """`torch.compiler.is_compiling()` False: torch >= 2.13 holds it True for a whole compile, code
    that Dynamo runs on the host included, and the check's forward is eager code (transformers' and
    usp's own branches on it)."""
    old = getattr(torch.compiler, "_is_compiling_flag", None)
    if old is not None:
        torch.compiler._is_compiling_flag = False
    try:
        yield
    finally:
        if old is not None:
            torch.compiler._is_compiling_flag = old


def _in_optimized_module() -> bool:
    """Inside the call of a `torch.compile(model)` (Dynamo's own flag; False while Dynamo was never
    imported): Dynamo runs the model's hooks outside the compiled frame then."""
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    flag = getattr(eval_frame, "_is_in_optimized_module", None)
    return bool(flag()) if flag is not None else False


def _is_row_refusal(e: ValueError) -> bool:
    text = str(e)
    return "outside attention" in text or "without scaled_dot_product_attention" in text


def _in_attention_mode() -> bool:
    """An `attention_mode` block routes and tracks every call itself (while Dynamo traces, its
    modes are off the real stack, on the tracer's)."""
    from torch.overrides import _get_current_function_mode_stack

    from .mode import _SDPAToUSP

    modes = list(_get_current_function_mode_stack())
    tracer = sys.modules.get("torch._dynamo.symbolic_convert")  # Dynamo imported: maybe tracing
    try:
        stack = tracer.InstructionTranslator.current_tx().symbolic_torch_function_state.mode_stack
        modes += [getattr(m, "value", None) for m in stack]
    except Exception:  # noqa: BLE001 - not while Dynamo traces, or another torch layout
        pass
    return any(isinstance(m, _SDPAToUSP) for m in modes)
