"""attn_implementation="usp" under plain torch.compile (the Trainer / TRL path) adds no graph break:
the row rules' pre-hook (usp_graph/hf_rows.py) gets its verdict while Dynamo traces, so a training
step is one graph as with "sdpa", fullgraph=True compiles, and a refused model is still refused.

# T packed tokens (one row)
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.realmodels import make_lm, make_sweep_model, packed_positions  # noqa: E402

LENGTHS = (5, 3, 4)
T = sum(LENGTHS)
IDS = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(0))
POS = packed_positions(LENGTHS)
ROW = r"packed documents, but the model counts or mixes tokens along the whole row outside attention"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama(impl: str):
    model = make_lm("llama")
    model.set_attn_implementation(impl)
    return model


def _each_document_alone(model) -> torch.Tensor:
    """The logits of each document run alone through `model` (an uncompiled "sdpa" copy)."""
    parts, start = [], 0
    with torch.no_grad():
        for n in LENGTHS:
            s = slice(start, start + n)
            parts.append(model(input_ids=IDS[:, s], position_ids=POS[:, s], use_cache=False).logits)
            start += n
    return torch.cat(parts, 1)


def _breaks_of_two_training_steps(impl: str) -> int:
    from torch._dynamo.utils import counters

    counters.clear()
    model = _llama(impl)
    model.train()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        compiled(input_ids=IDS, position_ids=POS, labels=IDS, use_cache=False).loss.backward()
    if impl == "usp":
        assert model._usp_row_verdicts == {("position_ids",): None}  # the rules ran
    return sum(counters["graph_break"].values())


def test_usp_under_plain_compile_breaks_the_graph_no_more_than_sdpa():
    """Two training steps with packed position ids: as many graph breaks as "sdpa" (none; the
    pre-hook's eager check broke the graph 8 times here)."""
    assert _breaks_of_two_training_steps("usp") == _breaks_of_two_training_steps("sdpa") == 0


def test_usp_compiles_with_fullgraph_and_gives_each_documents_own_result():
    model = _llama("usp")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        got = [compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits for _ in range(2)]
    want = _each_document_alone(_llama("sdpa"))
    assert model._usp_row_verdicts == {("position_ids",): None}
    assert all((g - want).abs().max() <= 1e-10 for g in got)


@pytest.mark.parametrize("form", ["model.compile", "a compiled caller"])
def test_usp_compiles_with_fullgraph_where_the_hook_is_traced_inside_the_caller(form):
    """model.compile() (in place: Dynamo compiles the module's call, hooks included) and a compiled
    function that calls the model trace the pre-hook inside their frame: one graph too."""
    model = _llama("usp")
    if form == "model.compile":
        model.compile(backend="aot_eager", fullgraph=True)
        run = model
    else:

        @torch.compile(backend="aot_eager", fullgraph=True)
        def run(**kwargs):
            return model(**kwargs)

    with torch.no_grad():
        got = run(input_ids=IDS, position_ids=POS, use_cache=False).logits
    assert model._usp_row_verdicts == {("position_ids",): None}
    assert (got - _each_document_alone(_llama("sdpa"))).abs().max() <= 1e-10


@pytest.mark.parametrize("fullgraph", [False, True])
def test_a_model_the_rules_refuse_is_refused_under_plain_compile_every_call(fullgraph):
    """LFM2 convolves along the row: packed documents are refused under plain torch.compile as in
    eager, at the first call and the next. Under fullgraph=True torch reports any exception the
    traced code raises as its own error, which carries the rules' message."""
    model = make_sweep_model("lfm2")
    model.set_attn_implementation("usp")
    compiled = torch.compile(model, backend="aot_eager", fullgraph=fullgraph)
    error = torch._dynamo.exc.Unsupported if fullgraph else ValueError
    for _ in range(2):
        with pytest.raises(error, match=ROW + r".*convolves along the sequence"):
            compiled(input_ids=IDS, position_ids=POS, use_cache=False)
    assert isinstance(model._usp_row_verdicts[("position_ids",)], ValueError)


def test_a_compiled_varlen_call_asks_autocast_on_the_host(monkeypatch):
    """usp's varlen op asks whether the device has autocast; torch 2.11's Dynamo cannot trace that
    builtin and broke the graph at every attention call of a compiled model on the GPU (13 breaks
    at 8K). Made untraceable here, the question is still answered on the host: no break."""
    from torch._dynamo.utils import counters

    from usp_graph.ops import varlen

    untraceable = torch._dynamo.disable(torch.amp.is_autocast_available)
    monkeypatch.setattr(torch.amp, "is_autocast_available", untraceable)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, 2, 8, generator=gen, dtype=torch.float64) for _ in range(3))
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)

    def attend(q, k, v):
        return varlen.varlen_attn(q, k, v, cu, cu, max(LENGTHS), max(LENGTHS), is_causal=True)

    counters.clear()
    got = torch.compile(attend, backend="aot_eager")(q, k, v)
    assert sum(counters["graph_break"].values()) == 0
    assert torch.equal(got, attend(q, k, v))
