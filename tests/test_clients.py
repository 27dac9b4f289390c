"""Trainer and TRL as supported paths: ``model.compile(backend="usp")`` before handing the model over.

transformers' `Trainer` with `DataCollatorWithFlattening` and TRL's `SFTTrainer` with
``padding_free=True`` pack a batch's documents into one row whose position ids restart at 0 per
document. Each step's loss and every gradient (taken just before the optimizer step) must equal
the per-document reference: every document of that step's batch run alone through an uncompiled
copy of the model holding the same parameters, the token losses summed over the batch's
predicted tokens (fp64, CPU, tiny random-init Llama). Every step is checked, not only the first,
so the optimizer moved parameters too.

``TrainingArguments(torch_compile=True, torch_compile_backend="usp")`` fails inside accelerate
(it accepts its own backend names only); the README says so and what to do instead, and
`test_trainer_torch_compile_backend_usp_is_refused_by_accelerate` keeps that sentence true.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F

transformers = pytest.importorskip("transformers")

VOCAB = 64
# 8 documents, all 8 in each step's row (one epoch per step, shuffled): two steps with different
# boundaries and one token count, so one compile serves both.
LENGTHS = [5, 9, 1, 7, 12, 3, 6, 8]
# The model is fp64, but transformers' causal LM loss upcasts logits with `.float()`: the loss and
# the gradient through it are computed in fp32, so the comparison is at fp32's tolerance. Documents
# attending across each other miss it by orders of magnitude (loss ~1e-3, grads ~1, issue 30).
TOL = 1e-6


def _model() -> torch.nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=64, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).double()


def _documents() -> list[dict[str, list[int]]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(2, VOCAB, (n,), generator=gen).tolist()} for n in LENGTHS]


class _Steps(transformers.TrainerCallback):
    """Each step's gradients, just before the optimizer uses them."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model, self.grads = model, []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.grads.append({n: p.grad.detach().clone() for n, p in self.model.named_parameters()})


def _recording(trainer_cls):
    """`trainer_cls` that records each step's batch, parameters (before the step) and loss."""

    class Recording(trainer_cls):
        record: list

        def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
            # (a model the Trainer compiled is an OptimizedModule: its names start with _orig_mod.)
            params = {n.removeprefix("_orig_mod."): p.detach().clone() for n, p in model.named_parameters()}
            out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
            loss = out[0] if return_outputs else out
            self.record.append((dict(inputs), params, loss.detach().clone()))
            return out

    Recording.record = []
    return Recording


def _per_document(reference: torch.nn.Module, inputs, params) -> tuple[torch.Tensor, dict]:
    """Loss and grads of the batch with every document run alone through `reference`."""
    reference.load_state_dict(params)  # every parameter, by the reference's own names
    reference.zero_grad(set_to_none=True)
    ids, pos, labels = inputs["input_ids"][0], inputs["position_ids"][0], inputs["labels"][0]
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), ids.numel()]
    total = torch.zeros((), dtype=torch.float32)
    for s, e in zip(starts, starts[1:], strict=False):
        logits = reference(input_ids=ids[None, s:e]).logits[0]
        logits = logits.float()  # as transformers' ForCausalLMLoss
        total = total + F.cross_entropy(logits[:-1], labels[s + 1 : e], ignore_index=-100, reduction="sum")
    loss = total / (labels[1:] != -100).sum()
    loss.backward()
    return loss.detach(), {n: p.grad for n, p in reference.named_parameters()}


def _compile(model: torch.nn.Module) -> list:
    """The README's recipe, with a hook that tells what the backend compiled."""
    reports: list = []
    model.compile(backend="usp", options={"on_compile": reports.append})
    return reports


def _check(
    trainer_cls, callback: _Steps, reference: torch.nn.Module, reports: list, rewritten: int = 1
) -> None:
    # The attention ran as usp varlen ops, with nothing left as SDPA, compiled once for both steps'
    # boundaries (other graphs are the pieces of the forward around graph breaks, no attention).
    assert not any(r.kept for r in reports), reports
    assert len([r for r in reports if r.rewritten]) == rewritten, reports
    record = trainer_cls.record
    assert len(record) == len(callback.grads) == 2
    for (inputs, params, loss), grads in zip(record, callback.grads, strict=True):
        assert (inputs["position_ids"] == 0).sum() == len(LENGTHS)  # packed documents in one row
        ref_loss, ref_grads = _per_document(reference, inputs, params)
        loss_err = abs(loss.item() - ref_loss.item()) / abs(ref_loss.item())
        grad_err = {
            n: ((grads[n] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
            for n, g in ref_grads.items()
        }
        print(
            f"{trainer_cls.__base__.__name__}: loss {loss_err:.1e}, grads {max(grad_err.values()):.1e} (relative)"
        )
        assert loss_err <= TOL
        assert max(grad_err.values()) <= TOL, grad_err


def _args(cls, tmp_path, **extra):
    return cls(
        output_dir=str(tmp_path), per_device_train_batch_size=len(LENGTHS), max_steps=2, learning_rate=1e-2,
        max_grad_norm=0.0, use_cpu=True, report_to=[], save_strategy="no", logging_steps=100,
        disable_tqdm=True, seed=0, **extra,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("attention", "collator"),
    [("sdpa", {}), ("usp", {"return_flash_attn_kwargs": True})],
    ids=["sdpa", "usp_with_flash_attention_kwargs"],
)
def test_trainer_with_flattening_collator_trains_each_document_alone(tmp_path, attention, collator):
    """ "sdpa": the backend reads the documents from the mask transformers builds from the position
    ids. "usp" with the collator's flash-attention kwargs (a flash-attention user's setup): the
    attention takes them from cu_seq_lens_q/k, and needs no rewrite."""
    model = _model()
    reference = copy.deepcopy(model)
    model.set_attn_implementation(attention)
    reports = _compile(model)
    trainer_cls = _recording(transformers.Trainer)
    steps = _Steps(model)
    trainer = trainer_cls(
        model=model,
        args=_args(transformers.TrainingArguments, tmp_path),
        train_dataset=_documents(),
        data_collator=transformers.DataCollatorWithFlattening(**collator),
        callbacks=[steps],
    )
    trainer.train()
    assert all(("cu_seq_lens_q" in inputs) == bool(collator) for inputs, _, _ in trainer_cls.record)
    _check(trainer_cls, steps, reference, reports, rewritten=1 if attention == "sdpa" else 0)


def _tokenizer():
    """A word-level tokenizer over the tiny vocabulary, built here (no download)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel

    vocab = {"<pad>": 0, "<eos>": 1, **{f"t{i}": i for i in range(2, VOCAB)}}
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(WordLevel(vocab, unk_token="<pad>")), pad_token="<pad>", eos_token="<eos>"
    )


# transformers >= 5.25 (its `kernels` attention wrapper) breaks Dynamo's graph at each checkpointed
# layer unless this is set; usp warns with this fix (usp_graph.checkpointing, tests/test_path_matrix.py)
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_trl_sft_padding_free_trains_each_document_alone(tmp_path):
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = _model()
    reference = copy.deepcopy(model)
    reports = _compile(model)
    trainer_cls = _recording(trl.SFTTrainer)
    steps = _Steps(model)
    trainer = trainer_cls(
        model=model,
        args=_args(trl.SFTConfig, tmp_path, padding_free=True, max_length=None, bf16=False),
        train_dataset=datasets.Dataset.from_list(_documents()),
        processing_class=_tokenizer(),
        callbacks=[steps],
    )
    trainer.train()
    _check(trainer_cls, steps, reference, reports)


def test_trainer_torch_compile_backend_usp_is_refused_by_accelerate(tmp_path):
    """The README's "Trainer and TRL" says this fails in accelerate; if accelerate starts
    accepting other backends, this test says to update it."""
    args = _args(transformers.TrainingArguments, tmp_path, torch_compile=True, torch_compile_backend="usp")
    with pytest.raises(ValueError, match="'USP' is not a valid DynamoBackend"):
        transformers.Trainer(model=_model(), args=args)


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_the_trainer_path_as_a_user_writes_it_trains_each_document_alone(tmp_path, checkpointing):
    """``attn_implementation="usp"``, the flattening collator's position ids alone and the
    Trainer's own ``torch_compile=True`` (aot_eager standing in for inductor on the CPU), with
    transformers' checkpointing off and on: the documents come from the position ids inside the
    compiled graph (or the eager layers Dynamo leaves out of it)."""
    model = _model()
    reference = copy.deepcopy(model)
    model.set_attn_implementation("usp")
    trainer_cls = _recording(transformers.Trainer)
    steps = _Steps(model)
    ckpt = {}
    if checkpointing:
        fields = transformers.TrainingArguments.__dataclass_fields__
        ckpt = {
            "activation_checkpointing"
            if "activation_checkpointing" in fields
            else "gradient_checkpointing": True
        }
    args = _args(
        transformers.TrainingArguments,
        tmp_path,
        torch_compile=True,
        torch_compile_backend="aot_eager",
        **ckpt,
    )
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=_documents(),
        data_collator=transformers.DataCollatorWithFlattening(),
        callbacks=[steps],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers >= 5.25's checkpointing: usp names the Dynamo setting
        trainer.train()
    assert all("cu_seq_lens_q" not in inputs for inputs, _, _ in trainer_cls.record)
    _check(trainer_cls, steps, reference, [], rewritten=0)


@pytest.mark.parametrize(
    "packing",
    [{"padding_free": True, "max_length": None}, {"packing": True, "max_length": 32}],
    ids=["padding_free", "bfd_packing"],
)
def test_trl_with_its_own_compile_and_default_checkpointing_trains_each_document_alone(tmp_path, packing):
    """TRL as a user writes it: ``attn_implementation="usp"``, ``torch_compile=True`` and TRL's
    defaults otherwise (its gradient checkpointing on), packed padding-free by the collator
    (``padding_free=True``) or by TRL's own packing (``packing=True``: best-fit decreasing, whole
    documents per row of ``max_length``, position ids restarting per document, padding-free)."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    model = _model()
    reference = copy.deepcopy(model)
    model.set_attn_implementation("usp")
    trainer_cls = _recording(trl.SFTTrainer)
    steps = _Steps(model)
    args = _args(
        trl.SFTConfig, tmp_path, bf16=False, torch_compile=True, torch_compile_backend="aot_eager", **packing
    )
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(_documents()),
        processing_class=_tokenizer(),
        callbacks=[steps],
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # transformers >= 5.25's checkpointing: usp names the Dynamo setting
        trainer.train()
    _check(trainer_cls, steps, reference, [], rewritten=0)


def test_trl_wrapped_packing_with_padding_is_refused_with_trls_own_fix(tmp_path):
    """``packing_strategy="wrapped"`` without ``padding_free`` pads its last row: refused, naming the
    setting that packs it padding-free instead of attending the padding."""
    trl = pytest.importorskip("trl")
    datasets = pytest.importorskip("datasets")
    from usp_graph.hf import UnsupportedAttention

    model = _model()
    model.set_attn_implementation("usp")
    args = _args(trl.SFTConfig, tmp_path, packing=True, packing_strategy="wrapped", max_length=32, bf16=False)
    trainer = trl.SFTTrainer(
        model=model,
        args=args,
        train_dataset=datasets.Dataset.from_list(_documents()),
        processing_class=_tokenizer(),
    )
    with pytest.raises(UnsupportedAttention, match=r"SFTConfig\(padding_free=True\)"):
        trainer.train()
