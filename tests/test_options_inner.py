"""Option ``inner`` of backend usp: ``"auto"`` (the default) is inductor for a graph on a CUDA device
and the bitwise aot_eager on the CPU; the explicit names stand for themselves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch._subclasses.fake_tensor import FakeTensorMode

from usp_graph import AttentionMetadata, attention_mode, documents
from usp_graph.backend import DEFAULT_INNER, UspOptions, compiler
from usp_graph.backend.options import resolve_inner


def _fake(device: str) -> torch.Tensor:
    with FakeTensorMode():
        return torch.empty(4, 8, device=device)  # a CPU build makes fake CUDA tensors too


def test_auto_is_the_default_and_picks_inductor_for_cuda_tensors_only():
    assert DEFAULT_INNER == "auto" and UspOptions().inner == "auto"
    cpu, cuda = _fake("cpu"), _fake("cuda")
    assert resolve_inner("auto", [cpu, 3, None]) == "aot_eager"
    assert resolve_inner("auto", [cpu, cuda]) == "inductor"  # any tensor on CUDA: the graph runs there
    assert resolve_inner("auto", []) == "aot_eager"
    for name in ("aot_eager", "inductor"):
        assert resolve_inner(name, [cuda]) == name and resolve_inner(name, [cpu]) == name


def test_the_backend_resolves_auto_per_graph_and_reads_kv_before_the_repeat_for_inductor_only():
    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    for inputs, inner in (([_fake("cuda")], "inductor"), ([_fake("cpu")], "aot_eager")):
        run = compiler._Compile(graph, inputs, UspOptions())
        assert run.inner == inner and run.ctx.read_repeated is (inner == "inductor")
    assert compiler._Compile(graph, [_fake("cuda")], UspOptions(inner="aot_eager")).inner == "aot_eager"


def test_inductor_settings_are_accepted_with_auto():
    opts = UspOptions.parse({"inductor": {"max_autotune": True}})
    assert opts.inner == "auto" and opts.inductor == (("max_autotune", True),)


def test_default_options_on_the_cpu_compile_with_aot_eager_bitwise_equal_to_eager():
    torch.manual_seed(0)
    proj = torch.nn.Linear(8, 8, dtype=torch.float64)

    def f(x):
        q = proj(x).view(1, 8, 2, 4).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q, is_causal=True).sum()

    reports: list = []
    compiled = torch.compile(f, backend="usp", options={"on_compile": reports.append})
    x = torch.randn(1, 8, 8, dtype=torch.float64)
    meta = AttentionMetadata.from_lengths([3, 5], max_docs=4)
    with documents(meta):
        loss = compiled(x)
    (grad,) = torch.autograd.grad(loss, proj.weight)
    with attention_mode(meta):
        ref = f(x)
    (ref_grad,) = torch.autograd.grad(ref, proj.weight)
    assert [r.inner for r in reports] == ["aot_eager"]
    assert torch.equal(loss, ref) and torch.equal(grad, ref_grad)
    torch._dynamo.reset()


@pytest.mark.parametrize("inner", ["eager", 1])
def test_a_bad_inner_names_the_choices(inner):
    with pytest.raises((ValueError, TypeError), match=r"\['auto', 'aot_eager', 'inductor'\]"):
        UspOptions.parse({"inner": inner})
