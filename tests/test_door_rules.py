"""Every door x every rule: what packed documents cannot be exact for (`usp_graph.rules`) gets the
same refusal on every front door, and one document per row runs on each (issue 37: the "usp"
attention implementation ran such models without a word, 0.37-0.76 off).

Doors: eager `attention_mode(meta)`; attn_implementation="usp" in eager under `documents(meta)`, and
with the documents in its own inputs (flash-attention kwargs, packed position ids), eager and
under plain `torch.compile`; backend usp under `documents(meta)` with "usp" and with "sdpa".

# B batch (1), L tokens (12), T packed tokens
"""

from __future__ import annotations

import functools

import pytest
import torch

pytest.importorskip("transformers")

from tests.realmodels import compile_usp, make_lm, make_sweep_model, packed_positions  # noqa: E402
from usp_graph import AttentionMetadata, attention_mode, documents  # noqa: E402

LENGTHS = (5, 3, 4)
T = sum(LENGTHS)
META = AttentionMetadata.from_lengths(LENGTHS)
CU = META.cu_seqlens
IDS = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(0))
POS = packed_positions(LENGTHS)

ROW = r"packed documents, but (the model|compiled graph \S+) counts or mixes tokens along the whole row outside attention"

# rule -> (model, whether the caller passes packed position ids (else none), the refusal)
RULES = {
    # GPT-2 called without position ids embeds an arange over the row
    "row_positions": ("gpt2", False, ROW + r".*looks up positions that count along the row"),
    # Llama called without position ids counts its rotary positions along the row
    "positions_in_attention": (
        "llama",
        False,
        ROW + r".*counts positions along the row that reach the queries",
    ),
    # LFM2's short convolutions along the sequence (a hybrid model; position ids passed)
    "convolution": ("lfm2", True, ROW + r".*convolves along the sequence"),
}


def _model(name: str, impl: str):
    model = make_sweep_model(name) if name == "lfm2" else make_lm(name)
    model.set_attn_implementation(impl)
    return model


def _meta(packed):
    """The documents a door is given: the packed ones, none, or `packed` itself (metadata)."""
    return META if packed is True else (packed or None)


def _inputs(positions: bool, packed=True) -> dict:
    """The model's inputs: with `positions`, the packed documents' position ids (or, not packed,
    0..L-1: one document per row)."""
    pos = POS if packed is True else torch.arange(T)[None]
    return {"input_ids": IDS, "use_cache": False, **({"position_ids": pos} if positions else {})}


def _own_documents(positions: bool) -> dict:
    """The documents in the model's own inputs: packed position ids, else flash-attention kwargs."""
    if positions:
        return {}  # the position ids of `_inputs` already say them
    longest = max(LENGTHS)
    return {"cu_seq_lens_q": CU, "cu_seq_lens_k": CU, "max_length_q": longest, "max_length_k": longest}


def _attention_mode(name, positions, packed):
    with attention_mode(_meta(packed)):
        return _model(name, "sdpa")(**_inputs(positions, packed)).logits


def _documents_usp(name, positions, packed):
    with documents(_meta(packed)):
        return _model(name, "usp")(**_inputs(positions, packed)).logits


def _usp_own_inputs(name, positions, packed):
    extra = _own_documents(positions) if packed is True else {}
    inputs = _inputs(positions, packed)
    return _model(name, "usp")(**inputs, **extra).logits


def _usp_plain_compile(name, positions, packed):
    extra = _own_documents(positions) if packed is True else {}
    inputs = _inputs(positions, packed)
    return torch.compile(_model(name, "usp"), backend="aot_eager")(**inputs, **extra).logits


def _backend_usp(impl):
    def run(name, positions, packed):
        compiled = compile_usp(_model(name, impl))
        with documents(_meta(packed)):
            return compiled(**_inputs(positions, packed)).logits

    return run


DOORS = {
    "attention_mode": _attention_mode,
    "usp_eager_documents": _documents_usp,
    "usp_eager_own_inputs": _usp_own_inputs,
    "usp_plain_compile": _usp_plain_compile,
    "backend_usp_with_usp": _backend_usp("usp"),
    "backend_usp_with_sdpa": _backend_usp("sdpa"),
}


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_door_refuses_what_packed_documents_cannot_be_exact_for(door, rule):
    name, positions, refusal = RULES[rule]
    torch._dynamo.reset()
    try:
        with pytest.raises(ValueError, match=refusal):
            DOORS[door](name, positions, True)
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("door", sorted(DOORS))
@pytest.mark.parametrize("rule", sorted(RULES))
def test_every_door_runs_one_document_per_row(door, rule):
    """The same models and doors without packed documents: SDPA's own result, fp64."""
    name, positions, _ = RULES[rule]
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = DOORS[door](name, positions, False)
            want = _model(name, "sdpa")(**_inputs(positions, False)).logits
    finally:
        torch._dynamo.reset()
    assert (got - want).abs().max() <= 1e-10


def test_a_verdict_under_plain_compile_is_kept_and_a_passing_model_runs_each_document():
    """Under plain torch.compile a "usp" model gets its verdict from one eager forward under the
    rules; a model that passes (Llama given packed position ids) gives each document's own result."""
    torch._dynamo.reset()
    model = _model("llama", "usp")
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        got = compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits
        parts, start = [], 0
        for n in LENGTHS:
            s = slice(start, start + n)
            parts.append(model(input_ids=IDS[:, s], position_ids=POS[:, s], use_cache=False).logits)
            start += n
    torch._dynamo.reset()
    assert (got - torch.cat(parts, 1)).abs().max() <= 1e-10
    assert model._usp_row_verdicts == {("position_ids",): None}


@pytest.mark.parametrize(
    "door", ["attention_mode", "usp_eager_documents", "backend_usp_with_usp", "backend_usp_with_sdpa"]
)
def test_documents_that_are_the_rows_run_on_every_door_that_takes_metadata(door):
    """Metadata of one document per row is SDPA's own semantics: GPT-2 counting its positions along
    the row is exact then, and runs (it was refused by eager attention_mode and backend usp)."""
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            got = DOORS[door]("gpt2", False, AttentionMetadata.per_sample(1, T))
            want = _model("gpt2", "sdpa")(**_inputs(False)).logits
    finally:
        torch._dynamo.reset()
    assert (got - want).abs().max() <= 1e-10


def test_an_eager_usp_model_is_checked_once_per_kind_of_documents():
    """The rules run over the first packed forward of a "usp" model; its verdict is kept for the
    kind of documents given (position ids here), so later forwards run untracked, or refused."""
    torch._dynamo.reset()
    model = _model("llama", "usp")
    with torch.no_grad():
        first = model(input_ids=IDS, position_ids=POS, use_cache=False).logits
        assert model._usp_row_verdicts == {("position_ids",): None}
        again = model(input_ids=IDS, position_ids=POS, use_cache=False).logits
    assert torch.equal(first, again)
    hybrid = _model("lfm2", "usp")
    for _ in range(2):
        with pytest.raises(ValueError, match=RULES["convolution"][2]):
            hybrid(input_ids=IDS, position_ids=POS, use_cache=False)
    assert isinstance(hybrid._usp_row_verdicts[("position_ids",)], ValueError)


def _with_fused_loss(model):
    """`model` with its forward patched as a client fuses its loss into it (TRL's fused LM head): a
    keyword that takes the labels the model's own forward never sees, failing without them."""
    original = model.forward

    @functools.wraps(type(model).forward)
    def forward(*args, fused_loss=False, labels=None, **kwargs):
        out = original(*args, **kwargs)
        if fused_loss:
            out.fused = out.logits[:, :-1].logsumexp(-1).sum() + labels[:, 1:].sum()  # None: TypeError
        return out

    model.forward = forward
    return model


@pytest.mark.parametrize("compiled", ["plain_compile", "backend_usp"])
def test_a_forward_that_needs_the_labels_left_out_of_the_check_is_checked_on_its_inputs_as_given(compiled):
    """Compiled (plain torch.compile, or backend usp without a documents block), the check's
    forward leaves out the loss's inputs; a client's patched forward that needs them is checked
    again with them (it failed inside Dynamo, issue 38): a model that passes gives each document's
    own result, a hybrid model is refused."""
    labels = torch.randint(0, 64, (1, T), generator=torch.Generator().manual_seed(1))

    def compile_(m):
        return torch.compile(m, backend="aot_eager") if compiled == "plain_compile" else compile_usp(m)

    torch._dynamo.reset()
    try:
        model = _with_fused_loss(_model("llama", "usp"))
        with torch.no_grad():
            got = compile_(model)(
                input_ids=IDS, position_ids=POS, use_cache=False, labels=labels, fused_loss=True
            ).logits
            parts, start = [], 0
            for n in LENGTHS:
                s = slice(start, start + n)
                parts.append(model(input_ids=IDS[:, s], position_ids=POS[:, s], use_cache=False).logits)
                start += n
        assert (got - torch.cat(parts, 1)).abs().max() <= 1e-10
        assert model._usp_row_verdicts == {("position_ids",): None}
        torch._dynamo.reset()
        hybrid = compile_(_with_fused_loss(_model("lfm2", "usp")))
        with pytest.raises(ValueError, match=RULES["convolution"][2]):
            hybrid(input_ids=IDS, position_ids=POS, use_cache=False, labels=labels, fused_loss=True)
    finally:
        torch._dynamo.reset()
