"""Every front door asks one resolver which documents an attention call attends within
(`usp_graph.resolve`): each door gives each document's own result, or the same refusal.

Doors: eager ``attention_mode`` ("sdpa" model), eager ``documents`` ("usp" model), "usp" eager
(position ids), "usp" + plain ``torch.compile``, "usp" + backend usp under ``documents``, "sdpa" +
backend usp under ``documents``. Tiny random fp64 models, each document run alone as reference.

# B batch (rows), L tokens per row, N documents
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

pytest.importorskip("transformers")

import usp_graph  # noqa: E402, F401
from tests.realmodels import (  # noqa: E402
    grads,
    lm_forward,
    make_lm,
    make_sweep_model,
    max_err,
    packed_positions,
    per_document,
    weighted_loss,
)
from usp_graph import AttentionMetadata, attention_mode, documents  # noqa: E402
from usp_graph.resolve import UnsupportedAttention  # noqa: E402

LENGTHS = (5, 1, 9, 3, 14)
DOORS = ["attention_mode", "documents", "usp", "usp+compile", "usp+backend", "sdpa+backend"]


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _ids(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(seed))


def _door(door: str, model: torch.nn.Module, meta: AttentionMetadata):
    """(the model to call, the block to call it in) of `door`."""
    torch._dynamo.reset()
    if door != "attention_mode" and not door.startswith("sdpa"):
        model.set_attn_implementation("usp")
    if door == "attention_mode":
        return model, attention_mode(meta)
    if door == "documents":
        return model, documents(meta)
    if door == "usp":
        return model, contextlib.nullcontext()
    if door == "usp+compile":
        return torch.compile(model, backend="aot_eager"), contextlib.nullcontext()
    return torch.compile(model, backend="usp", options={"inner": "aot_eager"}), documents(meta)


@pytest.mark.parametrize("door", DOORS)
def test_each_door_gives_each_documents_own_result(door):
    ref, model = make_lm("mistral"), make_lm("mistral")  # a sliding window shorter than documents
    ids, pos = _ids(), packed_positions(LENGTHS)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    weighted_loss(expected).backward()
    run, block = _door(door, model, AttentionMetadata.from_lengths(LENGTHS))
    with block:
        out = lm_forward(run, ids, pos)
    weighted_loss(out).backward()
    assert max_err(out, expected) < 1e-10
    g, g_ref = grads(model), grads(ref)
    assert max(max_err(g[k], g_ref[k]) for k in g_ref) < 1e-10


@pytest.mark.parametrize("door", ["attention_mode", "documents", "usp+backend", "sdpa+backend"])
def test_metadata_of_another_batch_is_refused_on_every_door_that_takes_a_block(door):
    # Metadata left from the previous batch: the position ids of the call count other documents.
    # "usp" eager and compiled with backend usp used it (0.2 off); "sdpa" refused it.
    model = make_lm("llama")
    stale = AttentionMetadata.from_lengths(tuple(reversed(LENGTHS)))
    run, block = _door(door, model, stale)
    error = (ValueError, RuntimeError)
    with pytest.raises(error, match="position ids|documents"), block:
        lm_forward(run, _ids(), packed_positions(LENGTHS))


@pytest.mark.parametrize("impl", ["usp", "sdpa"])
def test_a_documents_block_under_another_compiler_is_refused_with_the_fix(impl):
    # Plain torch.compile ignored the block: every row was one document (0.2 off).
    model = make_lm("llama")
    model.set_attn_implementation(impl)
    torch._dynamo.reset()
    run = torch.compile(model, backend="aot_eager")
    with (
        pytest.raises(RuntimeError, match="backend=.usp."),
        documents(AttentionMetadata.from_lengths(LENGTHS)),
    ):
        lm_forward(run, _ids(), torch.arange(sum(LENGTHS))[None])
    torch._dynamo.reset()


@pytest.mark.parametrize("backend", ["usp", "aot_eager"])
@pytest.mark.parametrize("impl", ["usp", "sdpa"])
def test_attention_mode_around_a_compiled_model_is_refused_with_the_fix(impl, backend):
    model = make_lm("llama")
    model.set_attn_implementation(impl)
    torch._dynamo.reset()
    run = torch.compile(model, backend=backend)
    with (
        pytest.raises(RuntimeError, match="attention_mode.*documents"),
        attention_mode(AttentionMetadata.from_lengths(LENGTHS)),
    ):
        lm_forward(run, _ids(), packed_positions(LENGTHS))
    torch._dynamo.reset()


def _run(how: str, model: torch.nn.Module) -> torch.nn.Module:
    """`model` eager, or under plain torch.compile (Dynamo; aot_eager keeps eager's kernels)."""
    torch._dynamo.reset()
    return model if how == "eager" else torch.compile(model, backend="aot_eager")


@pytest.mark.parametrize("how", ["eager", "compile"])
@pytest.mark.parametrize("family", ["gpt_bigcode", "persimmon"])
def test_models_whose_attention_gets_no_position_ids_keep_documents_with_the_cache_on(family, how):
    # use_cache is the default of model(**batch) in eval; transformers then builds no packed mask
    # (compiled, 0.11 off: the position ids were read from the mask builder's frame in eager only).
    ref, model = make_sweep_model(family), make_sweep_model(family)
    ref.eval(), model.eval()
    model.set_attn_implementation("usp")
    ids, pos = _ids(2), packed_positions(LENGTHS)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    with torch.no_grad():
        assert max_err(lm_forward(_run(how, model), ids, pos, use_cache=True), expected) < 1e-10
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["eager", "compile"])
def test_a_model_whose_mask_and_attention_get_no_position_ids_keeps_documents(how):
    # ModernBERT reads its position ids for rotary angles only: neither its mask builder nor its
    # attention gets them, and "usp" attended the whole row (0.96 off, every "usp" door). An encoder
    # given its documents by position ids only: said once (its own SDPA attends the whole row).
    ref, model = make_sweep_model("modernbert"), make_sweep_model("modernbert")
    model.set_attn_implementation("usp")
    ids, pos = _ids(6), packed_positions(LENGTHS)
    expected = per_document(
        lambda s: ref(input_ids=ids[:, s], position_ids=pos[:, s]).last_hidden_state, LENGTHS
    )
    usp_graph.resolve._WARNED.discard("encoder")
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        out = _run(how, model)(input_ids=ids, position_ids=pos).last_hidden_state
    torch._dynamo.reset()
    assert max_err(out, expected) < 1e-10
    assert [w for w in seen if "attends bidirectionally" in str(w.message)]


def test_an_encoder_given_documents_only_by_position_ids_is_warned_about_once():
    model = make_lm("bert")
    model.set_attn_implementation("usp")
    usp_graph.resolve._WARNED.discard("encoder")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            lm_forward(model, _ids(), packed_positions(LENGTHS))
    said = [w for w in seen if "attends bidirectionally" in str(w.message)]
    assert len(said) == 1


def test_a_decoder_with_position_ids_is_not_warned_about():
    model = make_lm("llama")
    model.set_attn_implementation("usp")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        lm_forward(model, _ids(), packed_positions(LENGTHS))
    assert not [w for w in seen if "usp_graph" in str(w.message)]


def test_int64_cu_seq_lens_outside_int32_are_refused_before_the_cast():
    # 2**32 + 32 wrapped to 32 in int32: it passed the "ends at the token count" check.
    model = make_lm("llama")
    model.set_attn_implementation("usp")
    tokens = sum(LENGTHS)
    cu = torch.tensor([0, 5, 2**32 + tokens], dtype=torch.int64)
    with pytest.raises(UnsupportedAttention, match="outside int32"):
        model(input_ids=_ids(), cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=tokens, max_length_k=tokens)


def _bidirectional_mistral():
    model = make_lm("mistral")
    model.config.is_causal = False  # transformers then builds |q - k| <= w inside documents
    for layer in model.model.layers:
        layer.self_attn.is_causal = False
    return model


@pytest.mark.parametrize("how", ["eager", "compile"])
def test_the_window_comes_from_the_models_mask_where_it_says_more_than_the_layer(how):
    # A sliding-window decoder run bidirectionally: the mask keeps |q - k| <= w, the layer's
    # window read the flash way keeps |q - k| <= w - 1 (0.06 off, eager and then compiled).
    ref, model = _bidirectional_mistral(), _bidirectional_mistral()
    model.set_attn_implementation("usp")
    ids, pos = _ids(3), packed_positions(LENGTHS)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")  # bidirectional with documents from position ids: said once
        assert max_err(lm_forward(_run(how, model), ids, pos), expected) < 1e-10
    torch._dynamo.reset()


def test_a_window_that_lives_only_in_the_mask_is_kept():
    ref, model = make_lm("qwen2"), make_lm("qwen2")  # a sliding window on its second layer
    for layer in model.model.layers:  # the layers forget their window; the mask still has it
        layer.self_attn.sliding_window = None
    model.set_attn_implementation("usp")
    ids, pos = _ids(4), packed_positions(LENGTHS)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    assert max_err(lm_forward(model, ids, pos), expected) < 1e-10


def test_a_window_that_lives_only_in_the_mask_is_refused_compiled():
    # Compiled code cannot read the mask function's window: attention checks the one it chose
    # against the mask on the device, and refuses the call where they differ (never a wrong result).
    model = make_lm("qwen2")
    for layer in model.model.layers:
        layer.self_attn.sliding_window = None
    model.set_attn_implementation("usp")
    with pytest.raises(RuntimeError, match="another window than its layers"), torch.no_grad():
        lm_forward(_run("compile", model), _ids(4), packed_positions(LENGTHS))
    torch._dynamo.reset()


def test_a_model_that_reads_its_mask_itself_is_refused_with_the_reason():
    # Doge builds a dynamic mask from `attention_mask.dtype` and slices of it: an AttributeError
    # from inside the model before, now the reason and the fix.
    import transformers

    config = transformers.DogeConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="usp")
    with pytest.raises(UnsupportedAttention, match="reads its attention mask in its own code"):
        model(input_ids=_ids()[:, :10], position_ids=torch.arange(10)[None], use_cache=False)


def test_chunked_attention_compiled_with_flash_attention_kwargs_keeps_its_chunk_cuts():
    # The documents of cu_seq_lens_q/k replaced the mask's chunk cuts (0.2 off).
    from tests.realmodels import compile_usp
    from tests.test_hf import _llama4_chunked, chunked_as_the_model_masks

    ref, model = _llama4_chunked("sdpa"), _llama4_chunked("usp")
    ids, pos = _ids(5), packed_positions(LENGTHS)
    expected = chunked_as_the_model_masks(ref, ids, pos)
    cu = torch.tensor([0, *torch.tensor(LENGTHS).cumsum(0).tolist()], dtype=torch.int32)
    torch._dynamo.reset()
    out = compile_usp(model)(
        input_ids=ids, position_ids=pos, cu_seq_lens_q=cu, cu_seq_lens_k=cu, max_length_q=14, max_length_k=14,
        use_cache=False,
    ).logits  # fmt: skip
    assert max_err(out, expected) < 1e-10
    torch._dynamo.reset()


@pytest.mark.parametrize("rope_type", ["dynamic", "longrope"])
def test_rotary_scaling_from_the_row_length_is_warned_about_once(rope_type):
    from usp_graph import resolve

    layer = torch.nn.Module()
    layer.config = type("Config", (), {"rope_parameters": {"rope_type": rope_type, "factor": 2.0}})()
    resolve._WARNED.discard(f"rope:{rope_type}")
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        for _ in range(2):
            resolve.warn_where_unknown(layer, True, True)
    assert len([w for w in seen if "row's length" in str(w.message)]) == 1


@pytest.mark.parametrize(
    ("piece", "causal", "window", "holds"),
    [
        ("bidirectional", False, (4, 4), True),  # transformers' |q - k| <= w
        ("bidirectional", False, (3, 3), False),  # flash's reading of the layer's w: one short
        ("causal", True, (3, -1), True),  # k > q - w
        ("causal", True, (4, -1), False),
        ("causal", True, None, False),  # a window the layer does not hold (probed at w)
        ("full", True, None, True),
    ],
)
def test_the_compiled_window_check_reads_the_mask_function_inside_documents(piece, causal, window, holds):
    from transformers import masking_utils as mu

    from usp_graph.masks import check_mask_window

    w = 4
    fn = {
        "bidirectional": mu.sliding_window_bidirectional_mask_function(w),
        "causal": mu.sliding_window_causal_mask_function(w),
        "full": mu.causal_mask_function,
    }[piece]
    starts = torch.zeros(2, 16, dtype=torch.bool)
    starts[:, 0] = starts[0, 9] = starts[1, 3] = True  # documents of 9 and 7, 3 and 13 tokens
    check = lambda: check_mask_window(fn, starts, window, is_causal=causal, probe=w)  # noqa: E731
    if holds:
        check()
    else:
        with pytest.raises(RuntimeError, match="another window than its layers"):
            check()


def test_a_refused_forward_leaves_no_position_ids_behind():
    # The forward's position ids are kept for its mask builder while it runs: a refusal (here the
    # rules' hook, on the second call before the forward) must not leave them to the next forward.
    from usp_graph import resolve

    model = make_sweep_model("lfm2")  # short convolutions along the sequence: refused when packed
    model.set_attn_implementation("usp")
    for _ in range(2):
        with pytest.raises(ValueError, match="convolves along the sequence"):
            model(input_ids=_ids()[:, :10], position_ids=packed_positions((4, 6)), use_cache=False)
    assert resolve._FORWARD_POSITIONS == []
