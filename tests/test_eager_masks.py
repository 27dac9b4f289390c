"""An SDPA call Dynamo leaves out of backend usp's graphs is named, never run on the (T, T) mask silently.

Outside a documents block backend usp keeps a model's own semantics, rewriting the SDPA calls it
compiles. A call Dynamo leaves out of its graphs runs eagerly on the mask a compiled graph built:
right numbers, quadratic memory, no varlen kernel. transformers' checkpointing with ``offload=True``
(transformers >= 5.23: its `save_on_cpu`, which Dynamo will not trace, breaks the graph at every
checkpointed layer) is one way there, a layer under `torch.compiler.disable` another. usp warns once
per process with Dynamo's own reason; inside a documents block the same call is refused, naming it.

# B batch, L sequence
"""

from __future__ import annotations

import importlib
import inspect
import warnings

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import usp_graph
from usp_graph import AttentionMetadata

transformers = pytest.importorskip("transformers")

from tests.realmodels import compile_usp, make_lm, max_err, packed_positions  # noqa: E402

# the module (usp_graph.backend.documents is also the name of its function `documents`)
documents_module = importlib.import_module("usp_graph.backend.documents")

LENGTHS = [5, 1, 7, 3]
EAGER_MASK = "scaled_dot_product_attention ran eagerly on the"


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(documents_module, "_eager_mask_warned", False, raising=False)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _usp_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if str(w.message).startswith("usp backend")]


def _offloaded(monkeypatch) -> nn.Module:
    """A tiny Llama ("sdpa") with transformers' checkpointing, its activations offloaded to the host."""
    import transformers.modeling_utils as modeling_utils

    model = make_lm("llama")
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is None or "offload" not in inspect.signature(enable).parameters:
        pytest.skip("this transformers has no activation_checkpointing_enable(offload=...)")
    # transformers pins the host copies, which needs an accelerator; the CPU keeps them unpinned (the
    # same `save_on_cpu` class, so Dynamo breaks at it as on a GPU).
    save_on_cpu = modeling_utils.save_on_cpu
    monkeypatch.setattr(
        modeling_utils, "save_on_cpu", lambda pin_memory, device_type: save_on_cpu(False, device_type)
    )
    enable(offload=True)
    model.train()
    return model


def _counted_varlen(monkeypatch) -> list[int]:
    from usp_graph.ops import varlen

    calls = [0]
    fwd = varlen._cpu_fwd

    def counted(*args):
        calls[0] += 1
        return fwd(*args)

    monkeypatch.setattr(varlen, "_cpu_fwd", counted)
    return calls


@pytest.fixture(scope="module")
def earlier_breaks() -> None:
    """Graph breaks of other code earlier in the process, more frequent than the model's own: what a
    message names is still the model's (the most recent since the last reset). Dynamo's counters
    keep them for the process: made once for the module."""

    def cut(i: int) -> None:  # a reason of its own for each i where graph_break takes a message
        if "msg" in inspect.signature(torch._dynamo.graph_break).parameters:
            torch._dynamo.graph_break(msg=f"earlier code {i}")
        else:
            torch._dynamo.graph_break()

    def broken(x: torch.Tensor) -> torch.Tensor:
        x = x + 1
        cut(0)
        x = x + 1
        cut(1)
        x = x + 1
        cut(2)
        x = x + 1
        cut(3)
        return x + 1

    torch._dynamo.reset()
    compiled = torch.compile(broken, backend="eager", dynamic=False)
    for n in range(8):  # a compile per shape: four reasons, 8 breaks each (the model makes fewer)
        compiled(torch.ones(n + 1))
    torch._dynamo.reset()


def test_offloaded_checkpointed_layers_left_out_of_the_graph_warn_once_with_dynamos_reason(
    monkeypatch, earlier_breaks
):
    model = _offloaded(monkeypatch)
    ids = torch.randint(0, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    pos = packed_positions(LENGTHS)
    with torch.no_grad():
        want = model(input_ids=ids, position_ids=pos, use_cache=False).logits
    varlen_calls = _counted_varlen(monkeypatch)
    compiled = compile_usp(model)
    for step in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = compiled(input_ids=ids, position_ids=pos, use_cache=False).logits
            out.sum().backward()
        named = [m for m in _usp_warnings(caught) if EAGER_MASK in m]
        if step == 0:  # every layer ran SDPA eagerly on the mask; the first such call says so
            assert len(named) == 1, _usp_warnings(caught)
            assert f"{tuple([1, 1, sum(LENGTHS), sum(LENGTHS)])} mask" in named[0]
            assert "save_on_cpu" in named[0], named[0]  # Dynamo's reason for the break
            assert 'attn_implementation="usp"' in named[0]
        else:
            assert named == []  # once per process
    assert varlen_calls[0] == 0  # the backend rewrote none of them: the model's own mask ran
    assert max_err(out.detach(), want) <= 1e-12  # correct, as the model computes it


def test_offloaded_checkpointed_layers_inside_documents_are_refused_with_dynamos_reason(
    monkeypatch, earlier_breaks
):
    model = _offloaded(monkeypatch)
    ids = torch.randint(0, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(0))
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=6)
    with pytest.raises(usp_graph.EagerAttentionError, match="save_on_cpu"), usp_graph.documents(meta):
        compile_usp(model)(input_ids=ids, position_ids=packed_positions(LENGTHS), use_cache=False)


class _MaskedLayers(nn.Module):
    """A boolean block-diagonal mask built once from packed position ids, then SDPA layers on it;
    `disable` leaves the second layer out of every graph."""

    def __init__(self, disable: bool) -> None:
        super().__init__()
        self.qkv = nn.ModuleList(nn.Linear(8, 24, dtype=torch.float64) for _ in range(2))
        self.disable = disable

    def layer(self, i: int, x_BLD: torch.Tensor, mask_11LL: torch.Tensor) -> torch.Tensor:
        b, length, d = x_BLD.shape
        q, k, v = self.qkv[i](x_BLD).view(b, length, 3, 2, -1).permute(2, 0, 3, 1, 4)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask_11LL)
        return x_BLD + out.transpose(1, 2).reshape(b, length, d)

    def forward(self, x_BLD: torch.Tensor, pos_BL: torch.Tensor) -> torch.Tensor:
        starts_BL = torch.cat([torch.ones_like(pos_BL[:, :1]), pos_BL[:, 1:] != pos_BL[:, :-1] + 1], 1)
        doc_BL = starts_BL.cumsum(-1)
        mask = (doc_BL[:, :, None] == doc_BL[:, None, :])[:, None]
        x = self.layer(0, x_BLD, mask)
        second = torch.compiler.disable(self.layer) if self.disable else self.layer
        return second(1, x, mask)


@pytest.mark.parametrize("disable", [True, False], ids=["a_layer_disabled", "every_layer_compiled"])
def test_an_sdpa_call_run_eagerly_on_a_usp_graphs_mask_is_named_and_a_compiled_one_is_not(
    disable, monkeypatch
):
    model = _MaskedLayers(disable)
    doc = packed_positions(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 8, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = compile_usp(model)(x, doc)
    named = [m for m in _usp_warnings(caught) if EAGER_MASK in m]
    assert len(named) == (1 if disable else 0), _usp_warnings(caught)
    assert max_err(out, model(x, doc)) <= 1e-12


def test_eager_sdpa_on_a_mask_no_usp_graph_built_is_not_named():
    """A plain eager model in the same process (a reference, say) keeps plain SDPA, silently."""
    model = _MaskedLayers(disable=True)
    doc = packed_positions(LENGTHS)
    x = torch.randn(1, sum(LENGTHS), 8, dtype=torch.float64)
    compile_usp(_MaskedLayers(disable=False))(x, doc)  # usp graphs with mask outputs exist in this process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model(x, doc)
    assert _usp_warnings(caught) == []
