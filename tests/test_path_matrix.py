"""The path matrix at CPU size (`tools/bench_paths_gpu.py` is the H200 one): every way a transformers user
reaches usp, with and without transformers' activation checkpointing, gives each document's own loss and
gradients (fp64, the model's own ``labels=`` loss), and every attention call of it runs as usp's varlen
op, inside checkpointed layers too (their recompute in backward included).

Paths: ``usp_plain`` (``attn_implementation="usp"`` + a plain ``torch.compile``: documents from the
position ids, the Trainer / TRL path; aot_eager stands in for inductor on the CPU), ``usp_collator``
(the same with ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``'s ``cu_seq_lens_q/k``
and ``max_length_q/k`` in the batch), ``usp_backend``
(``"usp"`` + ``backend="usp"`` under ``documents(meta)``) and ``sdpa_backend`` (``"sdpa"`` + backend usp
under ``documents(meta)``). The flex peer has no CPU backward.
"""

from __future__ import annotations

import contextlib
import copy
import warnings

import pytest
import torch

from tests.realmodels import checkpoint_layers
from tests.reference import rel_err

transformers = pytest.importorskip("transformers")

LENGTHS = [5, 2, 7, 3]
LAYERS = 2
PATHS = ["usp_plain", "usp_collator", "usp_backend", "sdpa_backend"]
PLAIN = ("usp_plain", "usp_collator")  # plain torch.compile: documents from the batch itself
SIDE_EFFECT_SETTING = "skip_fwd_side_effects_in_bwd_under_checkpoint"


def _model(attn: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=LAYERS, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation=attn,
    )  # fmt: skip
    model = transformers.LlamaForCausalLM(config).double()
    model.train()
    return model


def _batch():
    ids = torch.randint(0, 64, (1, sum(LENGTHS)), generator=torch.Generator().manual_seed(1))
    pos = torch.cat([torch.arange(n) for n in LENGTHS])[None]
    labels = ids.clone()
    starts = torch.tensor([0, *LENGTHS[:-1]]).cumsum(0)
    labels[0, starts] = -100  # the model shifts labels: a document's last token predicts no next document
    return ids, pos, labels


def _flash_kwargs() -> dict:
    """What ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)`` adds to the batch."""
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    return {
        "cu_seq_lens_q": cu,
        "cu_seq_lens_k": cu,
        "max_length_q": max(LENGTHS),
        "max_length_k": max(LENGTHS),
    }


def _each_document_alone(model) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The token-mean loss over all documents, each run alone through `model`, and its grads."""
    ids, _, _ = _batch()
    model.zero_grad(set_to_none=True)
    total, count, start = 0.0, sum(n - 1 for n in LENGTHS), 0
    for n in LENGTHS:
        doc = ids[:, start : start + n]
        total = total + model(input_ids=doc, labels=doc, use_cache=False).loss * (n - 1)
        start += n
    loss = total / count
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _checkpoint(model) -> None:
    checkpoint_layers(model, use_reentrant=False)


class _VarlenCalls:
    """Counts the CPU kernel calls of usp's varlen op (forward, recompute and backward)."""

    def __init__(self, monkeypatch) -> None:
        from usp_graph.ops import varlen

        self.fwd = self.bwd = 0
        fwd, bwd = varlen._cpu_fwd, varlen._cpu_bwd

        def counted_fwd(*args):
            self.fwd += 1
            return fwd(*args)

        def counted_bwd(*args):
            self.bwd += 1
            return bwd(*args)

        monkeypatch.setattr(varlen, "_cpu_fwd", counted_fwd)
        monkeypatch.setattr(varlen, "_cpu_bwd", counted_bwd)


def _compiled(path: str, model, reports: list):
    if path in PLAIN:
        return torch.compile(model, backend="aot_eager")  # the attention function runs in Dynamo's graph
    return torch.compile(model, backend="usp", options={"on_compile": reports.append})


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointed"])
@pytest.mark.parametrize("path", PATHS)
def test_every_path_gives_each_documents_own_loss_and_grads_and_runs_usp_attention(
    path, checkpointing, monkeypatch
):

    # transformers >= 5.25 breaks the graph at every checkpointed layer without this (see
    # usp_graph.checkpointing: the `kernels` wrapper's set-and-restore); older versions need nothing.
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True):
        _check_path(path, checkpointing, monkeypatch)


def _check_path(path: str, checkpointing: bool, monkeypatch) -> None:
    from usp_graph import AttentionMetadata, documents

    torch._dynamo.reset()
    attn = "sdpa" if path == "sdpa_backend" else "usp"
    model = _model(attn)
    ref_loss, ref_grads = _each_document_alone(copy.deepcopy(model).to(torch.float64))
    if checkpointing:
        _checkpoint(model)
    reports: list = []
    compiled = _compiled(path, model, reports)
    ids, pos, labels = _batch()
    meta = AttentionMetadata.from_lengths(LENGTHS, max_docs=6)
    extra = _flash_kwargs() if path == "usp_collator" else {}
    with documents(meta) if path not in PLAIN else contextlib.nullcontext():
        loss = compiled(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **extra).loss
    loss.backward()
    assert rel_err(loss.detach(), ref_loss) <= 1e-6  # Llama's RMSNorm computes in fp32
    for name, g in ref_grads.items():
        assert rel_err(model.get_parameter(name).grad, g) <= 1e-6, name
    # every attention call of a step runs usp's varlen op: forward, its recompute when checkpointed,
    # backward (counted on the second step: the first of a plain compile also runs one eager forward
    # under the row rules, usp_graph.hf_rows, without grad)
    calls = _VarlenCalls(monkeypatch)
    with documents(meta) if path not in PLAIN else contextlib.nullcontext():
        again = compiled(input_ids=ids, position_ids=pos, labels=labels, use_cache=False, **extra).loss
    again.backward()
    assert torch.equal(again.detach(), loss.detach())
    assert (calls.fwd, calls.bwd) == (LAYERS * (2 if checkpointing else 1), LAYERS), (calls.fwd, calls.bwd)
    if reports:
        assert sum(len(r.rewritten) for r in reports) == LAYERS and all(r.kept == () for r in reports)
        assert sum(r.checkpointed for r in reports) == (LAYERS if checkpointing else 0)
    torch._dynamo.reset()


def test_checkpointed_regions_dynamo_leaves_out_are_reported_with_the_fix():
    """Where Dynamo breaks the graph at a checkpointed region (transformers >= 5.25: the `kernels`
    attention wrapper's side effect), usp never sees that region's attention: the backend says so,
    naming the setting that compiles it; where it does not break, every site is rewritten, silently."""
    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        _check_report()


def _side_effect_breaks_seen() -> int:
    """Dynamo reset, and the side-effect breaks of earlier tests in this process counted and marked
    seen (warned about, silently): a test's own breaks are those above the returned count."""
    from usp_graph import checkpointing

    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        checkpointing.warn_side_effect_breaks()
    return checkpointing.side_effect_breaks()


def _check_report() -> None:
    from usp_graph import checkpointing

    before = _side_effect_breaks_seen()
    model = _model("sdpa")
    _checkpoint(model)
    reports: list = []
    compiled = _compiled("sdpa_backend", model, reports)
    ids, pos, labels = _batch()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compiled(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    said = [str(w.message) for w in caught if SIDE_EFFECT_SETTING in str(w.message)]
    breaks = checkpointing.side_effect_breaks() - before
    assert bool(said) == (breaks > 0), (breaks, said)
    if breaks:
        assert sum(r.checkpointed for r in reports) == 0 and "run eagerly" in said[0]
    else:
        assert sum(r.checkpointed for r in reports) == LAYERS
    torch._dynamo.reset()


def test_checkpointed_regions_dynamo_leaves_out_of_a_plain_compile_are_reported_once():
    """The Trainer / TRL path (``"usp"`` + a plain ``torch.compile``) with checkpointing, where Dynamo
    breaks the graph at each checkpointed region: the regions' attention runs as usp's in eager
    (each document's own loss and grads), and the first eager call after the breaks says so once,
    naming the setting that compiles them; the next step adds no word."""
    from usp_graph import checkpointing

    with torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=False):
        before = _side_effect_breaks_seen()
        model = _model("usp")
        ref_loss, ref_grads = _each_document_alone(copy.deepcopy(model))
        _checkpoint(model)
        compiled = torch.compile(model, backend="aot_eager")
        ids, pos, labels = _batch()
        said = []
        for _ in range(2):
            model.zero_grad(set_to_none=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = compiled(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss
                loss.backward()
            said.append([str(w.message) for w in caught if SIDE_EFFECT_SETTING in str(w.message)])
        breaks = checkpointing.side_effect_breaks() - before
        assert rel_err(loss.detach(), ref_loss) <= 1e-6
        for name, g in ref_grads.items():
            assert rel_err(model.get_parameter(name).grad, g) <= 1e-6, name
        assert len(said[0]) == (1 if breaks else 0) and said[1] == [], (breaks, said)
        if breaks:
            assert "run eagerly" in said[0][0] and 'attn_implementation="usp" attends' in said[0][0]
        torch._dynamo.reset()


def test_the_collator_path_compiles_once_for_batches_of_other_longest_documents():
    """`DataCollatorWithFlattening(return_flash_attn_kwargs=True)` hands each batch its longest
    document as an int (``max_length_q/k``), which usp never reads: a batch of the same shapes with
    another longest document reuses the compiled graphs (usp's row-rule hook used to hand the ints to
    Dynamo, which guarded on their values and recompiled for each new one)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    model = _model("usp")
    compiled = torch.compile(model, backend="aot_eager")
    graphs = []
    for lengths in ([5, 2, 7, 3], [3, 3, 3, 8], [4, 4, 4, 5], [1, 1, 1, 14]):
        ids = torch.randint(0, 64, (1, sum(lengths)), generator=torch.Generator().manual_seed(len(graphs)))
        cu = torch.tensor([0, *lengths]).cumsum(0).to(torch.int32)
        batch = {
            "input_ids": ids, "position_ids": torch.cat([torch.arange(n) for n in lengths])[None], "labels": ids,
            "cu_seq_lens_q": cu, "cu_seq_lens_k": cu, "max_length_q": max(lengths), "max_length_k": max(lengths),
        }  # fmt: skip
        loss = compiled(**batch, use_cache=False).loss
        assert rel_err(loss.detach(), model(**batch, use_cache=False).loss.detach()) <= 1e-12
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[1:] == graphs[:1] * 3, graphs
    torch._dynamo.reset()


def test_the_compiled_paths_check_runs_no_loss():
    # The first compiled call's row check (one eager forward without grad) leaves out the model's
    # own loss and all logits but the last token's: a transformers loss upcasts the whole row's
    # logits to float32, which at 256K tokens was more memory than the training step's peak (an
    # out-of-memory error on an H100).
    from usp_graph import hf_rows

    model = _model("usp")
    seen: list[tuple[set, bool]] = []

    def record(module, args, kwargs):
        if getattr(hf_rows._ENTERED, "checking", False):
            seen.append((set(kwargs), torch.is_grad_enabled()))

    model.register_forward_pre_hook(record, with_kwargs=True)
    ids, pos, labels = _batch()
    torch._dynamo.reset()
    out = torch.compile(model, backend="aot_eager")(
        input_ids=ids, position_ids=pos, labels=labels, use_cache=False
    )
    assert seen and all("labels" not in keys and not grad for keys, grad in seen), seen
    assert {"position_ids", "logits_to_keep"} <= seen[0][0]
    loss, _ = _each_document_alone(_model("sdpa"))
    assert torch.allclose(out.loss, loss, rtol=1e-9, atol=0)


def test_a_compiled_models_row_check_runs_one_forward_for_it_and_its_inner_model(monkeypatch):
    # The check's forward of the causal LM runs its inner model (which carries the hooks too) under
    # the same rules: the inner model's own traced hook takes that verdict, not a second forward.
    from usp_graph import hf_rows

    calls: list[type] = []
    check = hf_rows._check_forward
    monkeypatch.setattr(
        hf_rows, "_check_forward", lambda model, *a: calls.append(type(model)) or check(model, *a)
    )
    model = _model("usp")
    assert getattr(model.model, "_usp_row_rules", False)  # the inner model is hooked as well
    ids, pos, labels = _batch()
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="aot_eager")
    for _ in range(2):
        compiled(input_ids=ids, position_ids=pos, labels=labels, use_cache=False).loss.backward()
    assert calls == [type(model)], calls
    torch._dynamo.reset()


def test_the_row_checks_inputs_keep_an_encoder_decoders_labels_and_a_given_logits_to_keep():
    from types import SimpleNamespace

    from usp_graph.hf_rows import _check_inputs

    class NoLogitsArg(torch.nn.Module):
        config = SimpleNamespace(is_encoder_decoder=False)

        def forward(self, input_ids, labels=None):
            return input_ids

    class Seq2Seq(NoLogitsArg):
        config = SimpleNamespace(is_encoder_decoder=True)

    given = {"input_ids": 1, "labels": 2, "num_items_in_batch": 3}
    assert _check_inputs(NoLogitsArg(), given) == {"input_ids": 1}
    assert _check_inputs(Seq2Seq(), given) == given  # its decoder's inputs come from the labels
    llama = _model("usp")
    assert _check_inputs(llama, given) == {"input_ids": 1, "logits_to_keep": 1}
    assert _check_inputs(llama, {**given, "logits_to_keep": 5})["logits_to_keep"] == 5
