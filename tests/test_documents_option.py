"""``options={"documents": NAME}`` over changing token counts and however the argument is passed.

Issue 30: from the second token count on, Dynamo hands the backend the dynamic size of the position
ids as a graph input of its own (source ``L['kwargs']['position_ids'].size()[1]``), and the backend
took that SymInt for the argument; position ids given positionally to a decorated ``forward``
(transformers wraps many in a ``*args, **kwargs`` decorator) were named ``args``. Each form runs
three token counts (static, then dynamic shapes) against a reference: eager `attention_mode`
bitwise (the backend's aot_eager contract), or each document alone through the plain model.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from usp_graph import AttentionMetadata, attention_mode
from usp_graph.backend.arguments import argument_name

LENGTHS = ([5, 3, 8], [4, 1, 4, 8, 6], [7, 2, 9, 0, 4, 8])  # 16, 23, 30 tokens


def _positions(lengths: list[int]) -> torch.Tensor:
    return torch.cat([torch.arange(n) for n in lengths])[None]


def _wrapped(forward):
    """A decorator of the kind transformers puts on forward methods: it takes ``*args, **kwargs``."""

    @functools.wraps(forward)
    def wrapper(*args, **kwargs):
        return forward(*args, **kwargs)

    return wrapper


class TinyAttention(nn.Module):
    def __init__(self, width: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.embed = nn.Embedding(32, width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def attend(self, input_ids, position_ids):
        x = self.embed(input_ids) + position_ids[..., None].to(self.embed.weight.dtype) / 8
        b, n, _ = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, n, -1))


def _wrapped_method(forward):
    """The other kind (transformers 5.23's ``can_return_tuple``): ``wrapper(self, *args, **kwargs)``,
    the module a parameter of its own and ``args`` the forward's own positional arguments."""

    @functools.wraps(forward)
    def wrapper(self, *args, **kwargs):
        return forward(self, *args, **kwargs)

    return wrapper


class Plain(TinyAttention):
    def forward(self, input_ids, position_ids):
        return self.attend(input_ids, position_ids)


class Decorated(TinyAttention):
    @_wrapped
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.attend(input_ids, position_ids)


class MethodDecorated(TinyAttention):
    @_wrapped_method
    def forward(self, input_ids, attention_mask=None, position_ids=None):
        return self.attend(input_ids, position_ids)


FORMS = {
    "keyword": (Plain, lambda m, ids, pos: m(input_ids=ids, position_ids=pos)),
    "positional": (Plain, lambda m, ids, pos: m(ids, pos)),
    "decorated keyword": (Decorated, lambda m, ids, pos: m(input_ids=ids, position_ids=pos)),
    "decorated positional": (Decorated, lambda m, ids, pos: m(ids, None, pos)),
    "method-decorated positional": (MethodDecorated, lambda m, ids, pos: m(ids, None, pos)),
}


def _grads(model: nn.Module) -> list[torch.Tensor]:
    out = [p.grad.clone() for p in model.parameters()]
    model.zero_grad(set_to_none=True)
    return out


@pytest.mark.parametrize("form", FORMS, ids=list(FORMS))
def test_documents_option_over_three_token_counts_is_eager_bit_for_bit(form):
    cls, call = FORMS[form]
    torch.manual_seed(0)
    model = cls().double()
    reports: list = []
    compiled = torch.compile(
        model, backend="usp", options={"documents": "position_ids", "on_compile": reports.append}
    )
    for i, lengths in enumerate(LENGTHS):
        pos = _positions(lengths)
        ids = torch.randint(0, 32, pos.shape, generator=torch.Generator().manual_seed(i))
        with attention_mode(AttentionMetadata.from_position_ids(pos)):
            ref = call(model, ids, pos)
        ref.square().sum().backward()
        ref_grads = _grads(model)
        out = call(compiled, ids, pos)
        out.square().sum().backward()
        assert torch.equal(out, ref), (form, lengths)
        assert all(torch.equal(a, b) for a, b in zip(_grads(model), ref_grads, strict=True)), (form, lengths)
    # The first count, then one dynamic graph for every later count (one, when Dynamo already
    # marked the code object dynamic in an earlier test).
    assert len(reports) <= 2


def test_documents_option_on_transformers_llama_positional_matches_each_document_alone():
    """transformers' LlamaForCausalLM.forward is decorated (``*args, **kwargs``), so position ids
    given positionally arrive as ``L['args'][3]``; with ``use_cache=True`` no packed mask is built,
    so the documents come from the option alone."""
    transformers = pytest.importorskip("transformers")
    from tests.realmodels import grads, max_err, per_document, weighted_loss

    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).double()
    compiled = torch.compile(model, backend="usp", options={"documents": "position_ids"})
    for i, lengths in enumerate(LENGTHS):
        pos = _positions(lengths)
        ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(i))
        ref = per_document(
            lambda s, ids=ids, pos=pos: model(input_ids=ids[:, s], position_ids=pos[:, s]).logits,
            [n for n in lengths if n],
        )
        weighted_loss(ref).backward()
        ref_grads = grads(model)
        out = compiled(ids, None, pos, use_cache=True).logits
        weighted_loss(out).backward()
        assert max_err(out, ref) <= 1e-10, lengths
        assert max_err(grads(model), ref_grads) <= 1e-10, lengths


def test_a_size_of_an_argument_is_not_the_argument():
    from torch._dynamo.source import (
        DictGetItemSource,
        GetItemSource,
        LocalSource,
        TensorProperty,
        TensorPropertySource,
    )

    kw = DictGetItemSource(LocalSource("kwargs"), "position_ids")
    assert argument_name(LocalSource("position_ids")) == "position_ids"
    assert argument_name(kw) == "position_ids"
    assert argument_name(DictGetItemSource(DictGetItemSource(LocalSource("batch"), "x"), "position_ids")) == (
        "position_ids"
    )
    assert argument_name(TensorPropertySource(kw, TensorProperty.SIZE, 1)) is None
    assert argument_name(GetItemSource(LocalSource("args"), 2)) is None  # no frame being compiled
