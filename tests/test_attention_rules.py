"""One rule, two paths: what eager `attention_mode` and the compiled backend refuse under packed
documents must be the same verdict for the same model (issue 30). Here: attention computed without
SDPA (transformers' "eager" matmul + softmax), which usp cannot rewrite and which would attend
across the documents.

# B batch, L tokens per row
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from tests.realmodels import compile_usp, make_lm  # noqa: E402
from usp_graph import AttentionMetadata, attention_mode, documents  # noqa: E402

LENGTHS = (3, 1, 4)
POS = torch.cat([torch.arange(n) for n in LENGTHS])[None]
IDS = torch.arange(sum(LENGTHS))[None] % 64
META = AttentionMetadata.from_lengths(LENGTHS, max_docs=4)


def _model(impl: str):
    model = make_lm("llama")
    model.set_attn_implementation(impl)
    return model


def _eager(model, packed: bool):
    with attention_mode(META if packed else None):
        return model(input_ids=IDS, position_ids=POS, use_cache=False).logits


def _compiled(model, packed: bool):
    compiled = compile_usp(model)
    if packed:
        with documents(META):
            return compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits
    return compiled(input_ids=IDS, position_ids=POS, use_cache=False).logits


# (attn_implementation, packed documents) -> refused?
TABLE = [
    ("eager", True, True),
    ("eager", False, False),
    ("sdpa", True, False),
    ("usp", True, False),
]


@pytest.mark.parametrize("path", [_eager, _compiled], ids=["eager", "compiled"])
@pytest.mark.parametrize("impl,packed,refused", TABLE)
def test_attention_without_sdpa_gets_the_same_verdict_eager_and_compiled(path, impl, packed, refused):
    torch._dynamo.reset()
    model = _model(impl)
    if refused:
        with pytest.raises(
            ValueError, match='without scaled_dot_product_attention.*attn_implementation="usp"'
        ):
            path(model, packed)
    else:
        assert path(model, packed).shape == (1, sum(LENGTHS), 64)
    torch._dynamo.reset()


def test_flex_attention_under_packed_documents_is_refused_in_eager():
    model = _model("flex_attention")
    with pytest.raises(Exception, match="without scaled_dot_product_attention"), torch.no_grad():
        _eager(model, True)


def _bert(path, positions: bool):
    model = make_lm("bert")
    kwargs = {"position_ids": POS} if positions else {}
    if path == "eager":
        with attention_mode(META):
            return model(input_ids=IDS, **kwargs).last_hidden_state
    with documents(META):
        return compile_usp(model)(input_ids=IDS, **kwargs).last_hidden_state


@pytest.mark.parametrize("path", ["eager", "compiled"])
@pytest.mark.parametrize("positions", [False, True], ids=["own_position_table", "position_ids"])
def test_positions_from_the_models_own_table_get_the_same_verdict_eager_and_compiled(path, positions):
    """BERT called without position_ids embeds a slice of its position_ids buffer: positions that
    count along the packed row, not per document. Refused under packed documents on both paths;
    with position_ids (and its zero token_type_ids buffer) it runs."""
    torch._dynamo.reset()
    if positions:
        assert _bert(path, True).shape == (1, sum(LENGTHS), 32)
    else:
        with pytest.raises(ValueError, match="position table"):
            _bert(path, False)
    torch._dynamo.reset()
