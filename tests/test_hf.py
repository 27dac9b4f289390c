"""transformers' attention implementation "usp" (`usp_graph.hf`): each document's own result from
the position ids, an active documents/attention_mode block, eager and compiled; refusals with
the reason. Tiny random models, fp64, against each document run alone through the plain model.

# B batch (rows), L tokens per row, N documents
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
import warnings
from unittest import mock

import pytest
import torch

pytest.importorskip("transformers")

import usp_graph  # noqa: E402
from tests.realmodels import (  # noqa: E402
    LM_SPECS,
    compile_usp,
    grads,
    lm_forward,
    make_lm,
    max_err,
    packed_positions,
    per_document,
    weighted_loss,
)
from usp_graph import AttentionMetadata, attention_mode, documents  # noqa: E402
from usp_graph.hf import UnsupportedAttention, usp_mask  # noqa: E402
from usp_graph.ops import boundaries  # noqa: E402

# One row with a length-1 document and documents longer than the sliding window (4 tokens).
LENGTHS = (5, 1, 9, 3, 14)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _models(name: str):
    """(reference with "sdpa", the same weights with "usp")."""
    ref = make_lm(name)
    usp = make_lm(name)
    usp.set_attn_implementation("usp")
    assert usp.config._attn_implementation == "usp"
    return ref, usp


def _batch(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 64, (1, sum(LENGTHS)), generator=gen)
    return ids, packed_positions(LENGTHS)


def _reference(model, ids, pos):
    out = per_document(lambda s: lm_forward(model, ids[:, s], pos[:, s]), LENGTHS)
    weighted_loss(out).backward()
    return out.detach(), grads(model)


def _assert_each_documents_own(name, model, out, ref_out, ref_grads):
    """`out`'s loss backward, then output and grads within the family's tolerance of `_reference`."""
    weighted_loss(out).backward()
    tol = LM_SPECS[name].tol
    assert max_err(out, ref_out) <= tol
    assert max_err(grads(model), ref_grads) <= tol * 100
    torch._dynamo.reset()


def _run(model, ids, pos):
    out = lm_forward(model, ids, pos)
    weighted_loss(out).backward()
    return out.detach(), grads(model)


@pytest.mark.parametrize("name", list(LM_SPECS))
def test_eager_usp_attends_within_the_documents_of_the_position_ids(name):
    ref_model, model = _models(name)
    ids, pos = _batch()
    ref_out, ref_grads = _reference(ref_model, ids, pos)
    out, got = _run(model, ids, pos)
    tol = LM_SPECS[name].tol
    assert max_err(out, ref_out) <= tol
    assert max_err(got, ref_grads) <= tol * 100


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_positions_restarting_elsewhere_than_0_are_documents_as_transformers_reads_them(path):
    """Packed position ids that restart at 1, 2 or jump (not the padding-free convention, which
    restarts at 0): transformers' own "sdpa" reads a document wherever a position is not its
    predecessor's + 1, and so must "usp" (it attended across them, silently, when it split at 0s)."""
    ref_model, model = _models("llama")
    ids, _ = _batch(4)
    pos = torch.cat([torch.arange(n) + s for n, s in zip(LENGTHS, (1, 1, 7, 2, 3), strict=True)])[None]
    ref_out, ref_grads = _reference(ref_model, ids, pos)
    sdpa_out = lm_forward(ref_model, ids, pos).detach()  # transformers' own packed-sequence mask
    ref_model.zero_grad(set_to_none=True)
    assert max_err(sdpa_out, ref_out) <= 1e-12
    run = compile_usp(model) if path == "compiled" else model
    out = lm_forward(run, ids, pos)
    weighted_loss(out).backward()
    assert max_err(out, ref_out) <= 1e-10
    assert max_err(grads(model), ref_grads) <= 1e-8
    torch._dynamo.reset()


def _flattened(ids, *, return_position_ids: bool = True) -> dict:
    """The batch transformers' DataCollatorWithFlattening(return_flash_attn_kwargs=True) makes of
    the documents of `ids` (LENGTHS): flash-attention's cu_seq_lens_q/k and max_length_q/k."""
    import transformers

    collate = transformers.DataCollatorWithFlattening(
        return_flash_attn_kwargs=True, return_position_ids=return_position_ids
    )
    docs = per_document(lambda s: ids[:, s], LENGTHS)
    starts = [0, *torch.tensor(LENGTHS).cumsum(0).tolist()]
    batch = collate([{"input_ids": docs[0, a:b].tolist()} for a, b in zip(starts, starts[1:], strict=False)])
    batch.pop("labels", None)
    return batch


def _forward(model, batch: dict) -> torch.Tensor:
    if model.config.model_type == "bert":
        return model(**batch).last_hidden_state
    return model(**batch, use_cache=False).logits


@pytest.mark.parametrize("name,path", [("llama", "eager"), ("llama", "compiled"), ("bert", "eager")])
def test_flash_attention_kwargs_of_the_flattening_collator_are_the_documents(name, path):
    """DataCollatorWithFlattening(return_flash_attn_kwargs=True) hands transformers cu_seq_lens_q/k,
    which it passes to attention: "usp" attends within them, as flash-attention does, also where
    the model keeps the position ids from its attention layers (BERT: per row before)."""
    ref_model, model = _models(name)
    ids, pos = _batch(5)
    ref_out, ref_grads = _reference(ref_model, ids, pos)
    batch = _flattened(ids)
    assert torch.equal(batch["position_ids"], pos) and batch["cu_seq_lens_q"].tolist()[-1] == sum(LENGTHS)
    out = _forward(compile_usp(model) if path == "compiled" else model, batch)
    _assert_each_documents_own(name, model, out, ref_out, ref_grads)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_flash_attention_kwargs_give_documents_where_attention_gets_no_position_ids(path):
    """ModernBERT keeps the position ids from its attention layers but hands them the collator's
    cu_seq_lens_q/k: with them each document gets its own result (as with flash-attention); without
    them, from the position ids its forward was given (read by the "usp" model's forward hook; an
    encoder given documents that way is warned about once), each document's own result too."""
    from tests.realmodels import make_sweep_model

    ref, model = make_sweep_model("modernbert"), make_sweep_model("modernbert")
    model.set_attn_implementation("usp")
    ids, pos = _batch(7)
    ids = ids.clamp(min=1)  # 0 is ModernBERT's padding id
    flash = {k: v for k, v in _flattened(ids).items() if k not in ("input_ids", "position_ids")}
    ref_out = per_document(
        lambda s: ref(input_ids=ids[:, s], position_ids=pos[:, s]).last_hidden_state, LENGTHS
    )
    weighted_loss(ref_out).backward()
    ref_grads = grads(ref)
    run = compile_usp(model) if path == "compiled" else model
    out = run(input_ids=ids, position_ids=pos, **flash).last_hidden_state
    weighted_loss(out).backward()
    assert max_err(out, ref_out) <= 1e-10
    assert max_err(grads(model), ref_grads) <= 1e-8
    with torch.no_grad():
        assert max_err(run(input_ids=ids, position_ids=pos).last_hidden_state, ref_out) <= 1e-10
        bad = torch.tensor([0, 5, 9], dtype=torch.int32)  # not the call's 32 tokens
        error = UnsupportedAttention if path == "eager" else RuntimeError  # compiled: checked on the device
        with pytest.raises(error, match="does not describe the"):
            run(input_ids=ids, position_ids=pos, cu_seq_lens_q=bad, cu_seq_lens_k=bad)
    torch._dynamo.reset()


def test_flash_attention_kwargs_are_read_once_per_forward_in_eager(monkeypatch):
    import usp_graph.resolve as hf

    _, model = _models("llama")
    batch = _flattened(_batch(8)[0])
    reads = []
    read = hf._flash_boundaries
    monkeypatch.setattr(hf, "_flash_boundaries", lambda *a: reads.append(1) or read(*a))
    _forward(model, batch)
    assert model.config.num_hidden_layers > 1 and len(reads) == 1


@pytest.mark.parametrize("source", ["position_ids", "flash_kwargs"])
def test_a_buffer_refilled_in_place_between_forwards_is_read_again(source):
    # A loader that reuses one buffer and refills it where no version counter sees it (numpy,
    # .data): the second forward must attend with the second batch's documents, not the first's.
    _, model = _models("llama")
    ids = _batch(9)[0]
    first, second = _flattened(ids), _flattened(ids)
    second["position_ids"] = packed_positions(list(reversed(LENGTHS)))
    second["cu_seq_lens_q"] = second["cu_seq_lens_k"] = torch.tensor(
        [0, *torch.tensor(list(reversed(LENGTHS))).cumsum(0).tolist()], dtype=torch.int32
    )
    if source == "position_ids":
        first = second = {"input_ids": ids}
        buffer = packed_positions(LENGTHS)
        with torch.no_grad():
            before = model(input_ids=ids, position_ids=buffer, use_cache=False).logits
            buffer.data.copy_(packed_positions(list(reversed(LENGTHS))))
            after = model(input_ids=ids, position_ids=buffer, use_cache=False).logits
            fresh = model(input_ids=ids, position_ids=buffer.clone(), use_cache=False).logits
    else:
        batch = dict(first)
        with torch.no_grad():
            before = _forward(model, batch)
            for name in ("position_ids", "cu_seq_lens_q"):
                batch[name].data.copy_(second[name])
            batch["cu_seq_lens_k"] = batch["cu_seq_lens_q"]
            after = _forward(model, batch)
            fresh = _forward(
                model, {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
            )
    assert not torch.equal(before, after) and torch.equal(after, fresh)


def test_a_documents_block_checks_a_position_buffer_refilled_between_forwards():
    # Inside usp_graph.documents(meta) eager attention checks that the call's position ids count the
    # block's documents, once per forward; a buffer refilled where no version counter sees it is
    # checked again, and a block that no longer describes it is refused.
    _, model = _models("llama")
    ids = _batch(9)[0]
    buffer = packed_positions(LENGTHS)
    with torch.no_grad(), documents(AttentionMetadata.from_lengths(LENGTHS)):
        model(input_ids=ids, position_ids=buffer, use_cache=False)
        buffer.data.copy_(packed_positions(list(reversed(LENGTHS))))
        with pytest.raises(UnsupportedAttention, match="count other documents than the active"):
            model(input_ids=ids, position_ids=buffer, use_cache=False)
        buffer.data.copy_(packed_positions(LENGTHS))
        buffer.data[0, 3] = -1
        with pytest.raises(UnsupportedAttention, match="negative position"):
            model(input_ids=ids, position_ids=buffer, use_cache=False)


def test_eager_usp_runs_under_inference_mode():
    # Inference tensors keep no version counter: the read cache must not ask for one.
    _, model = _models("llama")
    ids = _batch(10)[0]
    with torch.no_grad():
        expected = model(input_ids=ids, position_ids=packed_positions(LENGTHS), use_cache=False).logits
        flash = _forward(model, _flattened(ids))
    with torch.inference_mode():
        made_inside = model(input_ids=ids, position_ids=packed_positions(LENGTHS), use_cache=False).logits
        flash_inside = _forward(model, _flattened(ids))
        own_positions = model(input_ids=ids[:, :5], use_cache=False).logits  # the model counts them
    assert torch.equal(made_inside, expected) and torch.equal(flash_inside, flash)
    assert own_positions.shape[1] == 5


def test_eager_position_ids_give_their_documents_and_a_negative_position_is_refused():
    """The eager read of the documents (one transfer of starts and the negative flag): random
    lengths with length-1 documents, on 1 and 2 rows, and cut also at the model's mask starts."""
    import usp_graph.resolve as hf

    gen = torch.Generator().manual_seed(11)
    for rows in (1, 2):
        lengths = [int(n) for n in torch.randint(1, 9, (7,), generator=gen)] + [1, 1]
        pos = packed_positions(lengths).repeat(rows, 1)
        meta = hf._positions_eager(pos, rows, pos.shape[1])
        expected = [0, *torch.tensor(lengths * rows).cumsum(0).tolist()]
        assert meta.cu_seqlens.dtype == torch.int32 and meta.cu_seqlens.tolist() == expected
        assert meta.max_seqlen == max(lengths) and meta.total_tokens == rows * sum(lengths)
        starts = torch.zeros(rows, pos.shape[1], dtype=torch.bool)
        starts[:, 3] = True  # a cut inside the first document (a chunk of chunked attention)
        cut = hf._positions_eager(pos, rows, pos.shape[1], starts).cu_seqlens.tolist()
        assert cut == sorted(set(expected) | {3 + r * sum(lengths) for r in range(rows)})
        # The boundaries were checked where they were read: the kernels' check is recorded, not run
        # again, with each document's length (`checked_lengths` would launch kernels on a GPU).
        t = rows * sum(lengths)
        with mock.patch.object(boundaries, "assert_boundaries", side_effect=AssertionError("checked twice")):
            lens_q, lens_k = boundaries.checked_lengths(
                meta.cu_seqlens, meta.cu_seqlens, t, t, max(lengths), max(lengths)
            )
        assert lens_q is lens_k and lens_q.flatten().tolist() == lengths * rows
        # The model's mask's starts alone: where every row starts, and refused where token 0 starts none.
        alone = hf._positions_eager(None, rows, pos.shape[1], starts | (pos == 0))
        assert alone.cu_seqlens.tolist() == cut
        assert alone.max_seqlen == int(torch.tensor(cut).diff().max())
        starts[:, 0] = False
        with pytest.raises(ValueError, match="must start at 0"):
            hf._positions_eager(None, rows, pos.shape[1], starts)
    _, model = _models("llama")
    ids = _batch(12)[0]
    bad = packed_positions(LENGTHS)
    bad[0, 5] = -1
    with pytest.raises(UnsupportedAttention, match="negative position"):
        model(input_ids=ids, position_ids=bad, use_cache=False)


def test_flash_attention_kwargs_that_disagree_with_the_position_ids_are_refused():
    _, model = _models("llama")
    ids, _ = _batch(6)
    batch = _flattened(ids)
    batch["position_ids"] = torch.arange(sum(LENGTHS))[None]  # counted along the row: other documents
    with pytest.raises(UnsupportedAttention, match="count other documents than cu_seq_lens_q"):
        _forward(model, batch)
    batch = _flattened(ids)
    batch["position_ids"] = batch["position_ids"].clone()
    batch["position_ids"][0, 2] = -1  # read with the boundaries, in the same transfer
    with pytest.raises(UnsupportedAttention, match="negative position"):
        _forward(model, batch)
    batch = _flattened(ids)
    batch["cu_seq_lens_q"] = batch["cu_seq_lens_k"] = torch.tensor([0, 5, 9], dtype=torch.int32)
    with pytest.raises(UnsupportedAttention, match="does not describe the 32 tokens"):
        _forward(model, batch)
    for q, k, words in (
        (batch["cu_seq_lens_q"].double(), None, "must be a 1-D integer tensor"),
        (torch.tensor([0, 32], dtype=torch.int32), torch.tensor([0, 16, 32], dtype=torch.int32), "differ"),
    ):
        with pytest.raises(UnsupportedAttention, match=words):
            _forward(model, {**batch, "cu_seq_lens_q": q, "cu_seq_lens_k": k})
    q, k = torch.tensor([0, 16, 32], dtype=torch.int32), torch.tensor([0, 8, 32], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seq_lens_q and cu_seq_lens_k differ"):  # a device assert
        _forward(model, {**batch, "cu_seq_lens_q": q, "cu_seq_lens_k": k})
    with pytest.raises(RuntimeError, match="does not describe"):  # compiled: checked on the device
        _forward(compile_usp(model), batch)
    torch._dynamo.reset()


@pytest.mark.parametrize("name", ["llama", "mistral"])
def test_eager_usp_under_attention_mode_and_documents_takes_their_documents(name):
    ref_model, model = _models(name)
    ids, pos = _batch(1)
    ref_out, ref_grads = _reference(ref_model, ids, pos)
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=8)
    one_row = torch.arange(sum(LENGTHS))[None]  # positions that say nothing of the documents
    for block in (attention_mode(meta), documents(meta)):
        with block:
            out = lm_forward(model, ids, pos)
            weighted_loss(out).backward()
        assert max_err(out, ref_out) <= 1e-10
        assert max_err(grads(model), ref_grads) <= 1e-8
    # The block's documents decide, not the position ids: positions counting along the whole row
    # (rotary is relative: the same within each document) still give each document's result,
    # and without the block they make one document of the row.
    with attention_mode(meta) as mode:
        out = lm_forward(model, ids, one_row)
    assert mode.calls == 2
    assert max_err(out, ref_out) <= 1e-8
    assert max_err(lm_forward(model, ids, one_row), ref_out) > 1e-3


@pytest.mark.parametrize(
    "name,block", [("mistral", True), ("gemma3", False), ("bert", True), ("llama", False)]
)
def test_compiled_usp_gives_each_documents_own_result(name, block):
    ref_model, model = _models(name)
    ids, pos = _batch(2)
    ref_out, ref_grads = _reference(ref_model, ids, pos)
    compiled = compile_usp(model)
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=8)
    with documents(meta) if block else contextlib.nullcontext():
        out = lm_forward(compiled, ids, pos)
        _assert_each_documents_own(name, model, out, ref_out, ref_grads)


@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_a_train_step_leaves_no_tensor_in_a_reference_cycle(path):
    """Between two of Python's full collections only reference counting frees memory: a tensor a
    step leaves in a reference cycle (an exception kept with its frames, a closure holding itself)
    stays until then, and at long context that was gigabytes of the step's gradients."""
    import gc

    _, model = _models("llama")
    ids, pos = _batch(3)
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=8)
    run = compile_usp(model) if path == "compiled" else model

    def step() -> None:
        with documents(meta):
            weighted_loss(lm_forward(run, ids, pos)).backward()

    step()  # compiles
    gc.collect()
    # The tensors alive before the steps stay alive through them: what ends in a cycle is what the
    # steps made. Earlier tests' compiles leave structures of fake tensors that a step can release
    # (a cache that drops an entry), collected here as cycles the steps did not make.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # isinstance on a deprecated torch alias warns
        before = [o for o in gc.get_objects() if isinstance(o, torch.Tensor)]
    gc.disable()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        step()
        step()
        gc.collect()
        cycled = [o for o in gc.garbage if isinstance(o, torch.Tensor)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
        gc.enable()
        del before
    assert not cycled, [(tuple(t.shape), t.dtype) for t in cycled[:8]]
    torch._dynamo.reset()


def test_grouped_query_attention_reaches_the_kernel_without_repeated_heads(monkeypatch):
    _, model = _models("llama")
    seen = []
    real = usp_graph.hf.sdpa_to_usp

    def spy(q, k, v, *a, **kw):
        seen.append((q.shape[1], k.shape[1], kw.get("enable_gqa")))
        return real(q, k, v, *a, **kw)

    monkeypatch.setattr(usp_graph.hf, "sdpa_to_usp", spy)
    ids, pos = _batch()
    lm_forward(model, ids, pos)
    assert seen and all(s == (4, 2, True) for s in seen), seen


def test_no_mask_is_built_for_usp(monkeypatch):
    import transformers.masking_utils as mu

    _, model = _models("llama")
    called = []
    monkeypatch.setattr(mu, "sdpa_mask", lambda *a, **k: called.append(1))
    ids, pos = _batch()
    lm_forward(model, ids, pos)
    assert not called


def test_a_padding_mask_is_refused_and_an_all_ones_mask_is_not():
    _, model = _models("llama")
    ids = torch.randint(0, 64, (2, 8))
    mask = torch.ones(2, 8, dtype=torch.long)
    model(input_ids=ids, attention_mask=mask)
    mask[1, :3] = 0
    with pytest.raises(UnsupportedAttention, match="pads tokens"):
        model(input_ids=ids, attention_mask=mask)
    with pytest.raises(UnsupportedAttention, match="4-D mask"):
        model(input_ids=ids, attention_mask=torch.ones(2, 1, 8, 8, dtype=torch.bool))


def test_generation_with_a_kv_cache_is_refused_with_the_fix():
    _, model = _models("llama")
    with pytest.raises(UnsupportedAttention, match='set_attn_implementation\\("sdpa"\\)'):
        model.generate(torch.randint(0, 64, (1, 5)), max_new_tokens=2, do_sample=False)


def test_mask_functions_beyond_documents_causality_and_windows_are_refused():
    import transformers.masking_utils as mu

    usp_mask(1, 8, 8, mask_function=mu.and_masks(mu.causal_mask_function, mu.sliding_window_overlay(3)))
    blocks = mu.blockwise_overlay(torch.zeros(1, 8, dtype=torch.long))
    for fn in (
        mu.or_masks(mu.causal_mask_function, blocks),
        mu.chunked_causal_mask_function(4, torch.zeros(1)),
    ):
        with pytest.raises(UnsupportedAttention, match="beyond documents"):
            usp_mask(1, 8, 8, mask_function=fn)


def test_softcapping_is_refused():
    import transformers

    cfg = transformers.Gemma2Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8,
    )  # fmt: skip
    model = transformers.Gemma2ForCausalLM._from_config(cfg, attn_implementation="usp")
    with pytest.raises(UnsupportedAttention, match="softcapping"):
        model(input_ids=torch.randint(0, 64, (1, 6)))


@pytest.mark.slow
@pytest.mark.parametrize("order", ["usp_graph first", "transformers first"])
def test_attn_implementation_usp_needs_nothing_but_import_usp_graph(order):
    imports = (
        "import usp_graph, transformers" if order == "usp_graph first" else "import transformers, usp_graph"
    )
    code = (
        f"{imports}\n"
        "cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,"
        " num_attention_heads=4, num_key_value_heads=2)\n"
        "m = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation='usp')\n"
        "import torch; m(input_ids=torch.zeros(1, 4, dtype=torch.long))\n"
        "print(m.config._attn_implementation)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "usp"


@pytest.mark.slow
def test_reading_a_long_mask_takes_no_memory_quadratic_in_tokens():
    """Eager reading of a concrete (1, 1, T, T) mask: peak memory beyond the mask itself stays far
    below one more copy of it (an int64 row sum would be 8 x T^2 bytes, a uint8 copy T^2)."""
    code = """
import resource, torch
from usp_graph import sdpa
T = 8192
seg = torch.arange(T) // 700
mask = ((seg[:, None] == seg[None, :]) & torch.ones(T, T, dtype=torch.bool).tril())[None, None]
torch.zeros(1 << 20).sum()  # warm the allocator
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
causal, window, meta = sdpa._read_mask(mask, None, 1, 4, T, T)
again = sdpa._read_mask(mask, None, 1, 4, T, T)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert causal and window is None and meta.cu_seqlens.numel() == 13, (causal, window, meta)
assert again[2] is meta  # read once
print((after - before) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    assert grown < 8192 * 8192 // 4, f"peak memory grew {grown} bytes reading a {8192 * 8192}-byte mask"


def _repeat_kv_step(name: str, monkeypatch=None, read_repeated: bool | None = None):
    """The compiled (aot_eager) and eager attention_mode step of sweep family `name` on a packed
    row, and the sites the backend rewrote; `read_repeated` forces the backend's choice."""
    from tests.realmodels import make_sweep_model
    from usp_graph.backend import compiler, pipeline

    if read_repeated is not None:
        monkeypatch.setattr(
            compiler,
            "CompileContext",
            lambda **kw: pipeline.CompileContext(**{**kw, "read_repeated": read_repeated}),
        )
    torch._dynamo.reset()
    model = make_sweep_model(name) if name != "llama" else make_lm("llama")
    ids, pos = _batch(3)
    ids = ids % model.config.vocab_size
    reports: list = []
    compiled = compile_usp(model, on_compile=reports.append)
    out = lm_forward(compiled, ids, pos)
    weighted_loss(out).backward()
    got = grads(model)
    model.zero_grad(set_to_none=True)
    with attention_mode():
        ref = lm_forward(model, ids, pos)
        weighted_loss(ref).backward()
    torch._dynamo.reset()
    [report] = reports
    return (out, got), (ref.detach(), grads(model)), report.rewritten


def _bitwise(a, b) -> bool:
    return (
        torch.equal(a[0], b[0])
        and a[1].keys() == b[1].keys()
        and all(torch.equal(a[1][k], b[1][k]) for k in a[1])
    )


@pytest.mark.parametrize("name", ["llama", "exaone4"])
def test_under_aot_eager_repeated_kv_heads_stay_repeated_and_the_step_is_eager_bitwise(name):
    """transformers' "sdpa" repeats K/V heads itself when it hands SDPA a mask. The bitwise inner
    compiler keeps the repeat, as eager attention_mode sees it: reading the G-head tensors gives
    the same values, but the gradient reaching them has another layout, and a K norm's weight
    gradient (exaone4) then summed in another order (1 ulp in fp64)."""
    compiled, eager, rewritten = _repeat_kv_step(name)
    assert len(rewritten) == 2 and all("gqa=True" not in s for s in rewritten), rewritten
    assert _bitwise(compiled, eager)


def test_the_fast_inner_compiler_reads_kv_heads_before_the_repeat(monkeypatch):
    """With inner="inductor" the rewrite reads the G-head K/V with enable_gqa (the kernel and
    the saved activations hold G heads: sdpa + usp's 64K peak 45.1 -> 43.3 GiB on the H200); the
    values stay eager's (checked here through aot_eager with the choice forced)."""
    compiled, eager, rewritten = _repeat_kv_step("llama", monkeypatch, read_repeated=True)
    assert all("x(1, 2, 32, 8)x(1, 2, 32, 8)" in s and "gqa=True" in s for s in rewritten), rewritten
    assert _bitwise(compiled, eager)


def test_the_backend_reads_before_the_repeat_for_inductor_only():
    from usp_graph.backend import UspOptions, compiler

    graph = torch.fx.GraphModule(torch.nn.Module(), torch.fx.Graph())
    for inner, reads in (("inductor", True), ("aot_eager", False)):
        assert compiler._Compile(graph, [], UspOptions(inner=inner)).ctx.read_repeated is reads


def test_device_assert_messages_compile_under_inductor():
    # inductor pastes an async assert's message into generated C++ between double quotes,
    # unescaped: attn_implementation="usp" in a message failed every inductor compile of a "usp"
    # model given an all-ones attention_mask or flash-attention kwargs (CppCompileError).
    from usp_graph.ops.boundaries import device_assert

    def f(x):
        device_assert((x > 0).all(), 'attn_implementation="usp": a \\ backslash,\na newline')
        return x * 2

    compiled = torch.compile(f, backend="inductor", dynamic=False)
    assert torch.equal(compiled(torch.ones(4)), torch.full((4,), 2.0))
    with pytest.raises(RuntimeError, match="attn_implementation='usp': a / backslash, a newline"):
        compiled(-torch.ones(4))


def _calls_attention_interface(model_class) -> bool:
    """Whether `model_class`'s modeling code calls transformers' attention interface (read from its
    source, the way transformers itself decides whether an implementation can be set)."""
    import inspect

    source = inspect.getsource(sys.modules[model_class.__module__])
    return "ALL_ATTENTION_FUNCTIONS" in source


@pytest.mark.parametrize(
    ("version", "refused"), [("5.0.0", True), ("5.16.3", True), ("5.17.0", False), ("6.1.0.dev0", False)]
)
def test_usp_is_refused_on_a_transformers_older_than_it_was_checked_on(monkeypatch, version, refused):
    # transformers 5.0 passed GPT-BigCode's and Persimmon's masks so that usp attended across
    # documents (0.11 off) without a word: releases before the oldest checked one are refused.
    model = make_lm("llama")  # first: the model's import replaces transformers' lazy module
    monkeypatch.setattr(sys.modules["transformers"], "__version__", version)
    if refused:
        with pytest.raises(
            UnsupportedAttention, match=r"older than 5\.17.*pip install -U 'transformers>=5\.17'"
        ):
            model.set_attn_implementation("usp")
        assert model.config._attn_implementation == "sdpa"  # left as it was
    else:
        model.set_attn_implementation("usp")
        assert model.config._attn_implementation == "usp"


@pytest.mark.parametrize("family", ["bloom", "falcon"])
def test_a_model_that_computes_attention_itself_is_refused_and_one_that_calls_the_interface_runs(family):
    # Bloom (ALiBi) took usp's "no mask" for its own attention: causal no more, wrong without a
    # word; Falcon failed with KeyError('usp') in its own table of attention classes until its
    # modeling code called transformers' attention interface (transformers 5.x): then it runs
    # under "usp", each document its own.
    import transformers

    config = {
        "bloom": lambda: transformers.BloomConfig(n_layer=1, hidden_size=32, n_head=4, vocab_size=64),
        "falcon": lambda: transformers.FalconConfig(
            num_hidden_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=64
        ),
    }[family]()
    cls = transformers.AutoModelForCausalLM._model_mapping[type(config)]
    if not _calls_attention_interface(cls):
        with pytest.raises(UnsupportedAttention, match="computes attention in its own code"):
            transformers.AutoModelForCausalLM.from_config(config, attn_implementation="usp")
        return
    torch.manual_seed(0)
    ref = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").double()
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="usp").double()
    model.load_state_dict(ref.state_dict())
    ids, pos = _batch(5)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    assert max_err(lm_forward(model, ids, pos), expected) < 1e-10


@pytest.mark.parametrize("family", ["persimmon", "gpt_bigcode"])
@pytest.mark.parametrize("path", ["eager", "compiled"])
def test_documents_come_from_the_mask_where_attention_gets_no_position_ids(family, path):
    # These models build transformers' packed-document mask from the position ids but do not
    # pass the ids on to attention: usp took the row as one document (0.1-0.2 off each document
    # alone). The mask builder now reads where the mask separates neighbours (O(T)) and hands that
    # to attention in place of a mask.
    from tests.realmodels import make_sweep_model

    ref, model = make_sweep_model(family), make_sweep_model(family)
    model.set_attn_implementation("usp")
    ids = _batch(11)[0]
    pos = packed_positions(LENGTHS)
    expected = per_document(lambda s: lm_forward(ref, ids[:, s], pos[:, s]), LENGTHS)
    weighted_loss(expected).backward()
    run = model if path == "eager" else compile_usp(model)
    out = lm_forward(run, ids, pos)  # use_cache=False: transformers builds the packed mask then
    weighted_loss(out).backward()
    assert max_err(out, expected) < 1e-10
    g, g_ref = grads(model), grads(ref)
    assert g.keys() == g_ref.keys() and max(max_err(g[k], g_ref[k]) for k in g) < 1e-10


def test_the_mask_builder_reads_document_starts_in_linear_memory():
    from transformers.masking_utils import and_masks, causal_mask_function, packed_sequence_mask_function

    doc_ids = torch.tensor([[0, 0, 1, 2, 2, 2], [0, 1, 1, 1, 1, 3]])
    fn = and_masks(causal_mask_function, packed_sequence_mask_function(doc_ids))
    starts = usp_mask(2, 6, 6, mask_function=fn, device=torch.device("cpu")).starts
    assert starts.tolist() == [
        [True, False, True, True, False, False],
        [True, True, False, False, False, True],
    ]
    assert usp_mask(2, 6, 4, mask_function=fn, device=torch.device("cpu")) is None  # not self-attention


def test_an_encoder_decoder_is_refused_where_eager_cannot_tell_its_streams_apart():
    # BART hands every attention call (encoder, decoder, cross) the same position ids: the
    # decoder was attended with the source's documents (0.5 off); and eager documents(kv=...)
    # applied the target's documents to every call.
    from tests.realmodels import make_sweep_model

    model = make_sweep_model("bart_nopos")
    model.set_attn_implementation("usp")
    src, tgt = torch.randint(1, 64, (2, 16)), torch.randint(1, 64, (2, 16))
    pos = packed_positions((5, 1, 6, 4, 9, 7)).view(2, 16)
    with pytest.raises(UnsupportedAttention, match="encoder-decoder model"):
        model(input_ids=src, decoder_input_ids=tgt, position_ids=pos, use_cache=False)
    meta = AttentionMetadata.from_lengths((4, 4, 4, 4, 8, 8))
    with documents(meta, kv=AttentionMetadata.from_lengths((5, 1, 6, 4, 9, 7))):
        with pytest.raises(UnsupportedAttention, match="cannot tell cross-attention calls"):
            model(input_ids=src, decoder_input_ids=tgt, use_cache=False)


def _llama4_chunked(attn: str):
    import transformers

    config = transformers.Llama4TextConfig(
        vocab_size=64, max_position_embeddings=64, hidden_size=32, intermediate_size=64,
        intermediate_size_mlp=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        head_dim=8, num_local_experts=2, attention_chunk_size=4, no_rope_layers=[1, 1],
        interleave_moe_layer_step=1, attention_dropout=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.Llama4ForCausalLM._from_config(config, attn_implementation=attn).double().train()


def chunked_as_the_model_masks(ref, ids_BL, pos_BL):
    """What the model's own (SDPA) attention gives on the packed row: usp attends where the model's
    mask says. transformers >= 5.23 restarts the chunks at each document (each document then reads
    as if run alone); before, its packed mask counted them along the row (0.25 off the documents
    run alone), and usp follows the mask either way."""
    return lm_forward(ref, ids_BL, pos_BL)


def test_chunked_attention_compiled_is_cut_at_the_chunks_and_refused_inside_a_block():
    # Compiled code cannot read the chunked piece of Llama 4's mask function (eager refuses it): the
    # chunks were lost, 0.25 off on a single document. The mask builder's DocumentStarts now cut the
    # documents at the chunks; inside documents(...) the block's documents would replace them.
    ref, model = _llama4_chunked("sdpa"), _llama4_chunked("usp")
    ids, pos = _batch(12)[0], packed_positions(LENGTHS)
    expected = chunked_as_the_model_masks(ref, ids, pos)
    compiled = compile_usp(model)
    assert max_err(lm_forward(compiled, ids, pos), expected) < 1e-10
    with documents(AttentionMetadata.from_position_ids(pos)):
        with pytest.raises(UnsupportedAttention, match="chunked attention"):
            lm_forward(compiled, ids, pos)
