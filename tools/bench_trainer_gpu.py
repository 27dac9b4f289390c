"""transformers' own Trainer, as a user runs it, with usp's attention against flex_attention.

# T tokens per batch, k documents per batch

    PYTHONUNBUFFERED=1 python tools/bench_trainer_gpu.py --tokens 8192 --json $OUT/trainer.jsonl
    python tools/bench_trainer_gpu.py --device cpu --quick                 # smoke test

`bench_paths_gpu.py` times forward + backward in a loop of its own, which lets the host run steps
ahead of the GPU. A `Trainer` step does more, and synchronizes: it checks each micro-batch's loss
for NaN on the host (``logging_nan_inf_filter``, on by default), clips the gradients and steps the
optimizer. A host read inside the step (the Trainer path's cut of slot-per-token boundaries) costs
what it costs there, not in the loop. This tool runs the real loop: `transformers.Trainer` with
`DataCollatorWithFlattening` (padding-free, position ids restarting per document), the model's own
loss, ``torch_compile=True`` and ``bf16=True`` on CUDA (``--no-bf16``: off), every other argument at its default
(AdamW, gradient clipping at 1.0), ``gradient_checkpointing=True`` with ``--checkpointing``.

The model is `bench_paths_gpu`'s transformers Llama (hidden 2048, 4 layers, 16/4 heads). Each batch
holds k documents of log-normal lengths summing to exactly T tokens (k = T / the long-context
tables' mean document), drawn once and taken in order (a sequential sampler), so every row trains
on the same batches and compiles for one token count. Rows, each a fresh model with the same
weights, one after the other in this process:

- ``flex``: ``attn_implementation="flex_attention"`` (transformers builds its block mask from the
  position ids): the peer;
- ``usp``: ``attn_implementation="usp"`` (documents from the position ids inside the graph);
- ``usp_collator``: the same with ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``;
- ``usp_backend``: ``attn_implementation="usp"`` and ``model.compile(backend="usp")`` before the
  Trainer (accelerate refuses ``torch_compile_backend="usp"``), ``torch_compile=False``.

Each row: step time (CUDA events at each step's start, so a step's time runs to the next one's
start: data, host work and idle GPU included), median and mean over the steps after ``--warmup``,
peak memory over them (``left_gib``: what earlier rows left allocated when the row began, after
Dynamo's reset and a garbage collection), the Trainer's mean training loss and its relative
difference to flex's, the attention kernel calls and host reads of one step (`kernel_calls`),
Dynamo's graph breaks.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import tempfile
from typing import Any

import torch
from bench_long_gpu import _mean_doc
from harness import Results, add_json_arg
from hf_llama import add_size_args, hf_llama, use_quick_sizes
from kernel_calls import kernel_calls

ROWS = ("flex", "usp", "usp_collator", "usp_backend")
_ATTN = {"flex": "flex_attention", "usp": "usp", "usp_collator": "usp", "usp_backend": "usp"}


def batch_lengths(tokens: int, docs: int, seed: int) -> list[int]:
    """`docs` log-normal document lengths (log-sd 1) summing to exactly `tokens`, each at least 1."""
    if not 1 <= docs <= tokens:
        raise ValueError(f"need 1 <= documents <= tokens, got {docs} documents for {tokens} tokens")
    gen = torch.Generator().manual_seed(seed)
    draw = torch.empty(docs).log_normal_(0.0, 1.0, generator=gen)
    lengths = [1 + int(x) for x in (draw / draw.sum() * (tokens - docs)).floor().tolist()]
    lengths[-1] += tokens - sum(lengths)
    return lengths


def documents(tokens: int, docs: int, batches: int, vocab: int) -> list[dict[str, list[int]]]:
    """The training set: `batches` batches of `docs` documents of `tokens` tokens, in order."""
    gen = torch.Generator().manual_seed(0)
    return [
        {"input_ids": torch.randint(0, vocab, (n,), generator=gen).tolist()}
        for b in range(batches)
        for n in batch_lengths(tokens, docs, seed=b)
    ]


def _graph_breaks() -> int:
    from torch._dynamo.utils import counters

    return sum(counters["graph_break"].values())


def _trainer_class(tf: Any) -> Any:
    class Timed(tf.Trainer):
        """The Trainer in order (every row the same batches), counting one step's kernel calls."""

        counted_at = -1
        kernels: dict[str, int] | None = None
        traced_at = -1  # --memory-trace: this step's forward and backward under the allocator history
        memory_trace: dict[str, Any] | None = None

        def _get_train_sampler(self, *args: Any, **kwargs: Any) -> Any:
            return torch.utils.data.SequentialSampler(self.train_dataset)

        def training_step(self, *args: Any, **kwargs: Any) -> Any:
            if self.state.global_step == self.traced_at:
                from mem_peak import peak_live

                out: list[Any] = []
                self.memory_trace = peak_live(
                    lambda: out.append(super(Timed, self).training_step(*args, **kwargs))
                )
                return out[0]
            if self.state.global_step != self.counted_at:
                return super().training_step(*args, **kwargs)
            loss, self.kernels = kernel_calls(lambda: super(Timed, self).training_step(*args, **kwargs))
            return loss

    return Timed


def _callback(tf: Any, cuda: bool) -> Any:
    class Steps(tf.TrainerCallback):
        """A CUDA event (or the wall clock) at each step's start, and one at the last step's end."""

        def __init__(self) -> None:
            self.marks: list[Any] = []

        def _mark(self) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                self.marks.append(event)
            else:
                import time

                self.marks.append(time.perf_counter())

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._mark()

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if state.global_step == state.max_steps:  # the last step ends before the final logging
                self._mark()

        def step_ms(self) -> list[float]:
            pairs = zip(self.marks[:-1], self.marks[1:], strict=True)
            if cuda:
                torch.cuda.synchronize()
                return [round(a.elapsed_time(b), 2) for a, b in pairs]
            return [round((b - a) * 1e3, 2) for a, b in pairs]

    return Steps()


class _PeakAfter:
    """Resets the CUDA peak once the warm-up steps are done."""

    def __init__(self, tf: Any, warmup: int) -> None:
        outer = self

        class Reset(tf.TrainerCallback):
            def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
                if state.global_step == warmup and torch.cuda.is_available():
                    torch.cuda.synchronize()
                    torch.cuda.reset_peak_memory_stats()
                    outer.armed = True

        self.armed = False
        self.callback = Reset()


def _checkpointing(tf: Any, a: argparse.Namespace) -> dict[str, bool]:
    """``--checkpointing`` as TrainingArguments spells it (5.25 renamed gradient_ to activation_)."""
    if not a.checkpointing:
        return {}
    fields = tf.TrainingArguments.__dataclass_fields__
    return {
        "activation_checkpointing" if "activation_checkpointing" in fields else "gradient_checkpointing": True
    }


def run_row(row: str, a: argparse.Namespace, data: list[dict[str, list[int]]], docs: int) -> dict[str, Any]:
    import transformers as tf

    torch._dynamo.reset()
    gc.collect()
    cuda = a.device == "cuda"
    if cuda:
        torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated() if cuda else None  # what earlier rows left allocated
    if a.held_trace and cuda:
        from mem_peak import record_history

        record_history()
    model = hf_llama(a, _ATTN[row], tokens=a.tokens, device=a.device)
    reports: list[Any] = []
    if row == "usp_backend":
        model.compile(backend="usp", options={"on_compile": reports.append})
    collator = tf.DataCollatorWithFlattening(return_flash_attn_kwargs=row == "usp_collator")
    # --memory-trace traces one more step, after the timed ones
    steps = a.warmup + a.steps + (1 if a.memory_trace and cuda else 0)
    record: dict[str, Any] = {
        "row": row,
        "tokens": a.tokens,
        "documents": docs,
        "checkpointing": a.checkpointing,
    }
    if base is not None:
        record["left_gib"] = round(base / 2**30, 3)
    breaks = _graph_breaks()
    timer = _callback(tf, cuda)
    peak = _PeakAfter(tf, a.warmup)
    with tempfile.TemporaryDirectory() as out:
        args = tf.TrainingArguments(
            output_dir=out, per_device_train_batch_size=docs, max_steps=steps, report_to=[],
            save_strategy="no", logging_steps=steps, disable_tqdm=True, seed=0, dataloader_num_workers=0,
            bf16=cuda and not a.no_bf16, use_cpu=not cuda, torch_compile=cuda and row != "usp_backend", **_checkpointing(tf, a),
        )  # fmt: skip
        trainer = _trainer_class(tf)(
            model=model,
            args=args,
            train_dataset=data,
            data_collator=collator,
            callbacks=[timer, peak.callback],
        )
        trainer.counted_at = a.warmup - 1
        if a.memory_trace and cuda:
            trainer.traced_at = steps - 1
        try:
            result = trainer.train()
        except Exception as e:  # noqa: BLE001 - a row that fails is reported, the others still run
            record["error"] = f"{type(e).__name__}: {e}"[:1500]
            record["graph_breaks"] = _graph_breaks() - breaks
            return record
        if a.held_trace and cuda:
            from mem_peak import live_now, python_holders

            record["held"] = live_now(top=12)
            torch.cuda.memory._record_memory_history(enabled=None)
            print(f"  {row}: allocated after training, by allocation site")
            for g in record["held"]:
                print(f"    {g['gib']:7.3f} GiB {g['blocks']:4d}x  {g['site'][:150]}  [{g['owner']}]")
            state = [t for s in trainer.optimizer.state.values() for t in s.values() if torch.is_tensor(t)]
            known = [*model.parameters(), *(p.grad for p in model.parameters() if p.grad is not None), *state]
            record["holders"] = python_holders(16 * 2**20, exclude=known)
            print(f"  {row}: who in Python holds the other tensors of 16 MiB or more")
            for line in record["holders"]:
                print(f"    {line}")
    timed = timer.step_ms()[a.warmup : a.warmup + a.steps]
    record["ms_each"] = timed
    record["ms"] = round(statistics.median(timed), 2)
    record["mean_ms"] = round(statistics.fmean(timed), 2)
    record["tokens_per_s"] = round(a.tokens / (record["mean_ms"] / 1e3))
    if cuda and peak.armed:
        record["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
    record["loss"] = result.training_loss
    record["kernels"] = trainer.kernels
    if trainer.memory_trace is not None:
        from mem_peak import print_peak

        record["memory_trace"] = trainer.memory_trace
        print_peak(row, trainer.memory_trace)
    record["graph_breaks"] = _graph_breaks() - breaks
    if reports:
        record["sites_rewritten"] = sum(len(r.rewritten) for r in reports)
        record["sites_kept"] = sum(len(r.kept) for r in reports)
    if a.held_trace and cuda:
        # What Dynamo's compiled code and caches held: allocated once they are dropped, the model and
        # trainer still alive (what the next row's `left_gib` adds is what those held).
        torch._dynamo.reset()
        gc.collect()
        record["held_after_reset_gib"] = round(torch.cuda.memory_allocated() / 2**30, 3)
        print(f"  {row}: allocated once Dynamo's caches are dropped: {record['held_after_reset_gib']} GiB")
    return record


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", type=int, default=8192, help="tokens per batch (T)")
    p.add_argument(
        "--checkpointing", action="store_true", help="TrainingArguments(gradient_checkpointing=True)"
    )
    p.add_argument("--rows", default=",".join(ROWS))
    add_size_args(p)
    p.add_argument("--steps", type=int, default=20, help="timed optimizer steps")
    p.add_argument("--warmup", type=int, default=4, help="steps before the timed ones (compiling)")
    p.add_argument(
        "--memory-trace", action="store_true",
        help="the last step's forward and backward under the allocator history: what is alive at its peak (tools/mem_peak.py)",
    )  # fmt: skip
    p.add_argument(
        "--held-trace", action="store_true",
        help="allocator history from each row's start: what is allocated once its training ends, by allocation site, who in Python holds it (tools/mem_peak.py), and what stays allocated once Dynamo's caches are dropped",
    )  # fmt: skip
    p.add_argument(
        "--no-bf16", action="store_true",
        help="TrainingArguments(bf16=False) on CUDA too (the model stays bf16): no autocast and no float32 copy of the outputs from accelerate's ConvertOutputsToFp32",
    )  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes on any device (a smoke test)")
    add_json_arg(p)
    a = p.parse_args(argv)
    if a.quick:
        use_quick_sizes(a)
        a.tokens, a.steps, a.warmup = 256, 3, 1
    if a.steps < 1 or a.warmup < 1:
        p.error(f"--steps and --warmup: at least 1 each, got {a.steps} and {a.warmup}")
    rows = [r for r in a.rows.split(",") if r]
    for r in rows:
        if r not in ROWS:
            p.error(f"--rows: {r!r} is not one of {', '.join(ROWS)}")
    if a.device != "cuda" and "flex" in rows:
        rows.remove("flex")  # flex_attention has no CPU backward here
        print("flex: not run on the CPU (no backward there)")
    docs = max(1, a.tokens // _mean_doc(a.tokens))
    data = documents(a.tokens, docs, a.warmup + a.steps + 1, a.vocab)  # one batch more for --memory-trace
    import transformers as tf

    print(
        f"T={a.tokens} k={docs} checkpointing={a.checkpointing} torch {torch.__version__} transformers {tf.__version__}"
    )
    out = Results(a.json, bench="trainer", device=a.device)
    flex: dict[str, Any] | None = None
    for row in rows:
        record = run_row(row, a, data, docs)
        if row == "flex" and "error" not in record:
            flex = record
        if flex is not None and "error" not in record:
            record["x_flex"] = round(flex["ms"] / record["ms"], 3)
            record["x_flex_mean"] = round(flex["mean_ms"] / record["mean_ms"], 3)
            record["loss_rel_flex"] = abs(record["loss"] - flex["loss"]) / abs(flex["loss"])
            if "peak_gib" in record and "peak_gib" in flex:
                record["peak_x_flex"] = round(record["peak_gib"] / flex["peak_gib"], 3)
        shown = {k: v for k, v in record.items() if k != "ms_each"}
        print(f"  {row}: {shown}")
        out.write(settings={k: v for k, v in vars(a).items() if k != "json"}, **record)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
