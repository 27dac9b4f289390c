"""Defines the package's ops on torch's dispatcher without Dynamo: `define` is `torch.library.custom_op`
for this package, registering what it registers, made the older way (`torch.library.Library`).

Why not `custom_op`: it wraps every kernel in ``torch._disable_dynamo``, which imports ``torch._dynamo``
(and with it the ``torch._inductor`` package, ~1 s) at the op's first call, so eager attention and a
graph file's replay would pay for the compiler. Here the kernel carries Dynamo's disable mark
(`usp_graph.dynamo_marks.disable`), which turns compilation off inside the kernel once Dynamo is loaded
and costs nothing before.

An op gets what ``custom_op(name, mutates_args=(), schema=...)`` gives it: its schema (given, or
inferred from the annotations by `torch.library.infer_schema`) with the ``pt2_compliant_tag``; the
function as the kernel of every device (``CompositeExplicitAutograd``), checked not to return an
alias of an input; a fake/meta implementation (`Op.register_fake`); and an autograd kernel that
raises until a backward is given (`Op.register_autograd`, which `usp_graph.registry` calls), lean
where the op's arguments allow (`_autograd_kernel`).
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch._library import autograd as _autograd
from torch._library import utils as _utils

from ..dynamo_marks import disable

__all__ = ["Op", "define", "op_for"]

# One FRAGMENT library per namespace, alive as long as the process: dropping a Library unregisters
# its ops.
_LIBRARIES: dict[str, torch.library.Library] = {}
# qualified name -> its Op (`op_for`).
_OPS: dict[str, Op] = {}


def _library(namespace: str) -> torch.library.Library:
    lib = _LIBRARIES.get(namespace)
    if lib is None:
        lib = _LIBRARIES[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return lib


def _plain_keysets() -> tuple[torch._C.DispatchKeySet, ...]:
    """The keysets below Autograd of a call on plain CPU or CUDA tensors with no mode, transform or
    subclass in play (with and without ADInplaceOrView, which inference tensors lack): there the
    redispatch can only reach the op's own kernel."""
    keys = torch._C.DispatchKey
    view = torch._C.DispatchKeySet(keys.ADInplaceOrView)
    dense = (torch._C.DispatchKeySet(keys.CUDA), torch._C.DispatchKeySet(keys.CPU))
    return (*(d | view for d in dense), *dense)  # the common case first: `in` compares in order


_PLAIN = _plain_keysets()
# The C apply under torch's Python `Function.apply` (None on a torch without it: every call then
# takes torch's apply).
_C_APPLY = getattr(torch._C, "_FunctionBase", object).__dict__.get("apply")


def _autograd_kernel(op: torch._ops.OpOverload, info: Op) -> Callable[..., Any]:
    """The op's Autograd kernel: what `custom_op`'s (``torch._library.autograd.make_autograd_impl``)
    does for an op with positional arguments only, without its per-call costs (0.1 ms of a
    4K-token attention call's 0.45 ms on the H200 went to re-reading the schema to fill in the
    defaults the dispatcher dropped: tools/profile_varlen_host.py). Ops with keyword-only
    arguments or lists of tensors take torch's."""
    schema = op._schema
    arguments = list(schema.arguments)
    # (usp ops are functional, so none has out=; `Op` checks)
    if any(a.kwarg_only for a in arguments) or any(
        "List[" in str(a.type) and "Tensor" in str(a.type) for a in (*arguments, *schema.returns)
    ):
        return _autograd.make_autograd_impl(op, info)
    # The dispatcher drops trailing arguments equal to their defaults: setup_context sees them all.
    defaults = tuple(a.default_value if a.has_default_value() else None for a in arguments)
    after_autograd = torch._C._after_autograd_keyset
    kernel = info._plain_kernel

    def below(keyset: torch._C.DispatchKeySet, args: tuple[Any, ...]) -> Any:
        # Plain tensors, nothing traced: the op's kernel is all the redispatch would reach, so it is
        # called without the second dispatcher trip (a short CUDA call is host-bound:
        # tools/profile_varlen_host.py). Anything else (a mode, a fake or functional tensor, a
        # transform) goes through the dispatcher.
        keyset = keyset & after_autograd
        with torch._C._AutoDispatchBelowAutograd():
            if keyset in _PLAIN:
                return kernel(*args)
            return op.redispatch(keyset, *args)

    def forward(ctx: Any, keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        result = below(keyset, args)
        if info._setup_context_fn:
            info._setup_context_fn(ctx=ctx, inputs=args + defaults[len(args) :], output=result)
        return result

    def backward(ctx: Any, *grads: Any) -> Any:
        if info._backward_fn is None:
            raise RuntimeError(
                f"Trying to backward through {op} but no autograd formula was registered. "
                "Please use register_autograd to add one."
            )
        needs = ctx.needs_input_grad
        ctx.needs_input_grad = needs[1:]  # the rule sees the op's own inputs
        try:
            result = info._backward_fn(ctx, *grads)
        finally:
            ctx.needs_input_grad = needs
        return (None, *result) if isinstance(result, tuple) else (None, result)

    generated = type(
        f"GeneratedBackwardFor_{op._namespace}_{op._opname}_{op._overloadname}",
        (torch.autograd.Function,),
        {"forward": staticmethod(forward), "backward": staticmethod(backward)},
    )

    # torch's Python `Function.apply` only unwraps dead functorch wrappers before the C apply when
    # no transform is active: a plain call enters the C apply itself (a few us of a short call).
    plain_apply = _C_APPLY.__get__(None, generated) if _C_APPLY is not None else None

    def autograd_impl(keyset: torch._C.DispatchKeySet, *args: Any) -> Any:
        if torch._C.is_grad_enabled() and torch._C._any_requires_grad(*args):
            if (
                plain_apply is not None
                and keyset & after_autograd in _PLAIN
                and not torch._C._are_functorch_transforms_active()
            ):
                return plain_apply(keyset, *args)
            return generated.apply(keyset, *args)
        return below(keyset, args)

    return autograd_impl


class Op:
    """One op: callable like the function it was defined from, with the surface of `custom_op`'s
    ``CustomOpDef`` the package uses (``register_fake``, ``register_autograd``, ``_opoverload``,
    ``_qualname``) and the ``default`` overload graphs hold."""

    def __init__(self, qualname: str, fn: Callable[..., Any], schema: str) -> None:
        namespace, name = qualname.split("::")
        self._qualname, self._name, self._init_fn = qualname, name, fn
        if not _utils.is_functional_schema(torch._C.parse_schema(name + schema)):
            raise ValueError(f"{qualname}: usp ops are functional; {schema} mutates or aliases an input")
        self._lib = _library(namespace)
        self._lib.define(name + schema, tags=(torch.Tag.pt2_compliant_tag,))
        self._opoverload: torch._ops.OpOverload = getattr(getattr(torch.ops, namespace), name).default
        self._plain_kernel = self._kernel(fn)
        self._lib.impl(name, self._plain_kernel, "CompositeExplicitAutograd")
        # Read at each backward: `register_autograd` fills them in later (custom_op does the same).
        self._backward_fn: Callable[..., Any] | None = None
        self._setup_context_fn: Callable[..., Any] | None = None
        self._lib.impl(name, _autograd_kernel(self._opoverload, self), "Autograd", with_keyset=True)
        functools.update_wrapper(self, fn)
        _OPS[qualname] = self

    def _kernel(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        marked = disable(fn)

        def kernel(*args: Any, **kwargs: Any) -> Any:
            result = marked(*args, **kwargs)
            _utils._c_check_aliasing_constraint(
                self._name, args, kwargs, result, lambda: inspect.getmodule(fn)
            )
            return result

        return kernel

    @property
    def default(self) -> torch._ops.OpOverload:
        return self._opoverload

    def register_fake(self, fn: Callable[..., Any], /) -> Callable[..., Any]:
        """Register `fn` as the op's fake (and meta) implementation; usable as a decorator."""
        torch.library.register_fake(self._qualname, fn, lib=self._lib)
        return fn

    def register_autograd(
        self, backward: Callable[..., Any], /, *, setup_context: Callable[..., Any]
    ) -> None:
        """Give the op its backward, as `torch.library.register_autograd` does (once per op)."""
        if self._backward_fn is not None:
            raise RuntimeError(f"{self._qualname} already has a backward")
        self._backward_fn, self._setup_context_fn = backward, setup_context

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._opoverload(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<Op({self._qualname})>"


def define(
    qualname: str, *, schema: str | None = None, mutates_args: tuple[str, ...] = ()
) -> Callable[[Callable[..., Any]], Op]:
    """Decorator: the function becomes op `qualname` (``"usp::varlen_fwd"``), as with
    ``torch.library.custom_op(qualname, mutates_args=..., schema=...)``."""
    if mutates_args:
        raise ValueError(
            f"{qualname}: usp ops are functional; mutates_args must be empty, got {mutates_args}"
        )

    def wrap(fn: Callable[..., Any]) -> Op:
        return Op(qualname, fn, schema or torch.library.infer_schema(fn, mutates_args=()))

    return wrap


def op_for(qualname: str) -> Op | None:
    """The `Op` defined here under `qualname`, or None (an op defined another way)."""
    return _OPS.get(qualname)
