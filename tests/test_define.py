"""`usp_graph.ops.define`: an op gets what `torch.library.custom_op` registers (schema, tags, the kernel
of every device, fake/meta, autograd), and its kernel runs without Dynamo until Dynamo is loaded."""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

import usp_graph.ops  # noqa: F401  (defines every usp op)
from usp_graph.ops.define import Op, define, op_for

KEYS = ("CPU", "CUDA", "Meta", "CompositeExplicitAutograd", "CompositeImplicitAutograd", "Autograd",
        "BackendSelect", "ADInplaceOrView")  # fmt: skip


def _registered(qualname: str) -> dict:
    ns, name = qualname.split("::")
    op = getattr(getattr(torch.ops, ns), name).default
    return {
        "schema": str(op._schema).split("(", 1)[1],
        "tags": sorted(map(str, op.tags)),
        "kernels": [k for k in KEYS if torch._C._dispatch_has_kernel_for_dispatch_key(qualname, k)],
        "fake": torch._library.simple_registry.singleton.find(qualname).fake_impl.kernel is not None,
    }


def _scaled(x: Tensor, k: int, scale: float, *, shift: int = 0) -> tuple[Tensor, Tensor]:
    return x * scale + shift, x.sum(0) * k


def _scaled_fake(x, k, scale, *, shift=0):
    return torch.empty_like(x), x.new_empty(x.shape[1:])


probe = define("usp_define_test::scaled")(_scaled)
probe.register_fake(_scaled_fake)
twin = torch.library.custom_op("usp_define_test::scaled_twin", mutates_args=())(_scaled)
twin.register_fake(_scaled_fake)


def test_define_registers_what_custom_op_registers():
    assert _registered("usp_define_test::scaled") == _registered("usp_define_test::scaled_twin")
    assert _registered("usp_define_test::scaled")["kernels"] == [
        "Meta",
        "CompositeExplicitAutograd",
        "Autograd",
    ]


def test_every_usp_op_is_a_defined_op_with_custom_ops_registrations():
    names = sorted(n for n in torch._C._dispatch_get_all_op_names() if n.startswith("usp::"))
    assert "usp::varlen_fwd" in names and "usp::wait" in names and "usp::halo_reduce" in names
    for name in names:
        assert isinstance(op_for(name), Op), name
        assert name not in torch._library.custom_ops.OPDEFS, f"{name} is defined with torch.library.custom_op"
        reg = _registered(name)
        assert reg["tags"] == ["Tag.pt2_compliant_tag"] and reg["fake"], (name, reg)
        assert reg["kernels"] == ["Meta", "CompositeExplicitAutograd", "Autograd"], (name, reg)


def test_a_defined_op_calls_like_its_function_and_holds_its_overload():
    x = torch.arange(6.0, dtype=torch.float64).view(3, 2)
    out, total = probe(x, 2, 0.5, shift=1)
    assert torch.equal(out, x * 0.5 + 1) and torch.equal(total, x.sum(0) * 2)
    assert probe.default is torch.ops.usp_define_test.scaled.default is probe._opoverload
    assert probe.__name__ == "_scaled" and probe._qualname == "usp_define_test::scaled"
    with torch.device("meta"):
        fake_out, fake_total = probe(torch.empty(3, 2), 2, 0.5)
    assert fake_out.shape == (3, 2) and fake_total.shape == (2,)


def test_differentiating_an_op_without_a_backward_raises_naming_it():
    x = torch.ones(3, 2, dtype=torch.float64, requires_grad=True)
    out, _ = probe(x, 2, 0.5)
    with pytest.raises(
        RuntimeError, match=r"backward through usp_define_test\.scaled\.default but no autograd"
    ):
        out.sum().backward()


@define("usp_define_test::double")
def double(x: Tensor) -> Tensor:
    return x * 2


double.register_fake(lambda x: torch.empty_like(x))


def test_a_backward_is_given_once_and_reaches_autograd():
    double.register_autograd(lambda ctx, g: g * 3, setup_context=lambda ctx, inputs, output: None)
    x = torch.ones(2, dtype=torch.float64, requires_grad=True)
    double(x).sum().backward()
    assert torch.equal(x.grad, torch.full((2,), 3.0, dtype=torch.float64))  # the given backward, not 2
    with pytest.raises(RuntimeError, match="already has a backward"):
        double.register_autograd(lambda ctx, g: g, setup_context=lambda ctx, inputs, output: None)


@define("usp_define_test::affine")
def affine(x: Tensor, a: float = 2.0, b: int = 1) -> Tensor:
    return x * a + b


affine.register_fake(lambda x, a=2.0, b=1: torch.empty_like(x))
_affine_seen: list = []


def _affine_setup(ctx, inputs, output):
    _affine_seen.append(inputs[1:])
    ctx.a = inputs[1]


def _affine_backward(ctx, g):
    _affine_seen.append(tuple(ctx.needs_input_grad))
    return g * ctx.a, None, None


affine.register_autograd(_affine_backward, setup_context=_affine_setup)


@define("usp_define_test::unwired")
def unwired(x: Tensor, scale: float = 1.0) -> Tensor:
    return x * scale


unwired.register_fake(lambda x, scale=1.0: torch.empty_like(x))


def test_a_positional_op_sees_its_defaults_and_only_its_own_inputs_in_its_rule():
    """usp's own autograd kernel (ops without keyword-only arguments) does what custom_op's does:
    setup_context gets the arguments the dispatcher dropped as defaults, the rule's
    needs_input_grad covers the arguments given (as custom_op's), the rule's gradient reaches the
    input, and without grad the kernel runs alone."""
    x = torch.arange(3.0, dtype=torch.float64, requires_grad=True)
    _affine_seen.clear()
    out = affine(x)
    assert torch.equal(out, x.detach() * 2 + 1)
    out.sum().backward()
    assert _affine_seen == [(2.0, 1), (True,)]
    assert torch.equal(x.grad, torch.full((3,), 2.0, dtype=torch.float64))
    _affine_seen.clear()
    affine(x, 3.0).sum().backward()  # a given argument, not its default
    assert _affine_seen == [(3.0, 1), (True, False)] and torch.equal(
        x.grad, torch.full((3,), 5.0, dtype=torch.float64)
    )
    _affine_seen.clear()
    with torch.no_grad():
        assert torch.equal(affine(x, 0.5, 4), x.detach() * 0.5 + 4)
    assert _affine_seen == []  # no setup_context without grad
    y = torch.ones(2, dtype=torch.float64, requires_grad=True)
    with pytest.raises(
        RuntimeError, match=r"backward through usp_define_test\.unwired\.default but no autograd"
    ):
        unwired(y).sum().backward()


def test_define_refuses_a_mutating_op():
    with pytest.raises(ValueError, match="mutates_args must be empty"):
        define("usp_define_test::bad", mutates_args=("x",))
    with pytest.raises(ValueError, match="usp ops are functional"):
        define("usp_define_test::bad_schema", schema="(Tensor(a!) x) -> ()")(lambda x: None)
    assert (
        "usp_define_test::bad_schema" not in torch._C._dispatch_get_all_op_names()
    )  # refused before defined


def test_a_kernel_that_returns_its_input_is_refused():
    same = define("usp_define_test::same", schema="(Tensor x) -> Tensor")(lambda x: x)
    with pytest.raises(RuntimeError, match="may not alias"):
        same(torch.ones(2))


def _recording_op(name: str):
    """An op adding 1 that records whether each run of its kernel was being compiled, and a Dynamo
    backend that keeps the graphs it is given."""
    ran: list[bool] = []
    op = define(f"usp_define_test::{name}", schema="(Tensor x) -> Tensor")(
        lambda x: ran.append(torch.compiler.is_compiling()) or x + 1
    )
    op.register_fake(lambda x: torch.empty_like(x))
    graphs: list[torch.fx.GraphModule] = []

    def backend(gm, example_inputs):
        graphs.append(gm)
        return gm

    return op, ran, graphs, backend


def test_a_compiled_caller_keeps_the_op_as_one_node_and_runs_its_kernel_in_eager():
    seen, ran, graphs, backend = _recording_op("seen")
    out = torch.compile(lambda x: seen(x) * 2, backend=backend, fullgraph=True)(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and ran == [False]
    targets = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.usp_define_test.seen.default in targets


def test_a_kernel_called_where_dynamo_watches_frames_is_not_compiled():
    # Eager code inside a compiled region (a frame Dynamo skips, calling the op): the kernel's frames
    # stay uncompiled, as under torch.compiler.disable; outside such a region nothing is switched.
    watched, ran, graphs, backend = _recording_op("watched")

    @torch._dynamo.disable(recursive=False)
    def skipped(x):
        return watched(x)

    torch._dynamo.reset()
    out = torch.compile(lambda x: skipped(x) * 2, backend=backend)(torch.zeros(3))
    assert torch.equal(out, torch.full((3,), 2.0)) and ran == [False]
    ops = [n.target for g in graphs for n in g.graph.nodes if n.op == "call_function"]
    assert torch.ops.aten.add.Tensor not in ops and "add" not in str(ops), ops
    assert torch.equal(watched(torch.zeros(2)), torch.ones(2)) and ran == [False, False]


class _Seen(torch.utils._python_dispatch.TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def test_a_call_under_a_dispatch_mode_reaches_it_below_autograd_and_matches_the_plain_call_bitwise():
    # The autograd kernel calls a plain call's kernel directly; anything else (here a mode) must still
    # see the op below autograd, forward and backward, and compute the same numbers.
    import usp_graph

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 1, 1, 9], dtype=torch.int32)
    grads = []
    for mode in (None, _Seen()):
        leaves = [x.clone().requires_grad_() for x in (q, k, v)]
        with mode or torch.autograd.graph.saved_tensors_hooks(lambda t: t, lambda t: t):
            out = usp_graph.varlen_attn(*leaves, cu, cu, 8, 8, is_causal=True)
            out.sum().backward()
        grads.append((out.detach(), *(x.grad for x in leaves)))
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
    assert "usp.varlen_fwd.default" in mode.ops and "usp.varlen_bwd.default" in mode.ops, mode.ops


def test_a_plain_differentiable_call_skips_torchs_python_apply_and_a_transform_still_takes_it(monkeypatch):
    # The autograd kernel of a plain call enters autograd through the C apply (torch's Python apply
    # would only unwrap dead functorch wrappers); under a functorch transform torch's apply still
    # decides (and refuses it for want of a setup_context staticmethod, as custom_op's does).
    import usp_graph

    applied: list[str] = []
    original = torch.autograd.Function.apply.__func__

    def counting(cls, *args, **kwargs):
        applied.append(cls.__name__)
        return original(cls, *args, **kwargs)

    monkeypatch.setattr(torch.autograd.Function, "apply", classmethod(counting))
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(9, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, 1, 1, 9], dtype=torch.int32)
    leaf = q.clone().requires_grad_()
    out = usp_graph.varlen_attn(leaf, k, v, cu, cu, 8, 8, is_causal=True)
    out.sum().backward()
    assert applied == [] and out.grad_fn is not None and leaf.grad is not None
    with torch.no_grad():
        assert torch.equal(out, usp_graph.varlen_attn(q, k, v, cu, cu, 8, 8, is_causal=True))
    with pytest.raises(RuntimeError, match="setup_context"):
        torch.func.grad(lambda x: usp_graph.varlen_attn(x, k, v, cu, cu, 8, 8, is_causal=True).sum())(q)
    assert applied == ["GeneratedBackwardFor_usp_varlen_fwd_default"], applied
