"""A training recipe: a transformers causal LM on packed documents, context parallel (usp_graph),
data parallel or FSDP2, activation checkpointing, compile, checkpoints that resume on any layout.

    torchrun --nproc-per-node 4 -m usp_graph.train --dp 2 --cp 2 --fsdp --steps 20
    usp-graph train --steps 5                     # one process (CP 1), the same loop

# B batch rows (1 per replica), L tokens per row (--seq-len), P CP ranks, D data-parallel replicas

Layout: the ranks form a ``(dp, cp)`` mesh (``dp_shard`` with --fsdp, else ``dp_replicate``).
Each data-parallel replica trains on its own packed row of `--seq-len` tokens; the row's documents
(`AttentionMetadata`, global) are the same on its CP ranks, and each CP rank holds 1/P of the row.
The loss is the token mean over every rank's tokens; gradients are summed over all ranks exactly
once (FSDP2's reduce-scatter with `usp_graph.fsdp.prepare`, or an ordered all-reduce without it),
so the step is the single-process step on the global batch.

Data: synthetic documents with log-normal lengths (`usp_graph.testing.lognormal_lengths`) and
random tokens, a pure function of (seed, step, replica); or `--text FILE`, byte-level tokens
(ids 0-255), documents separated by blank lines, packed back to back into rows (a document cut
by a row end continues, from position 0, in the next). A one-byte document has no next byte to
predict: a text whose documents are all that short is refused, and a step whose rows hold no
target at all (tiny --seq-len) has loss 0 and zero gradients, not 0/0.

Checkpoints (`usp_graph.train_checkpoint`): the full model and optimizer state as raw tensor bytes
and a JSON index, written atomically by rank 0, read by every rank without pickle (resuming a
checkpoint cannot run code). The step saved is the data position too, so `--resume` continues with
the batches the uninterrupted run would have seen; a resume must train past the checkpoint's step.
A resume keeps the checkpoint's AdamW settings unless a flag says otherwise (``--lr``); the model
and ``--dtype`` must be the checkpoint's (``--resume``'s help lists the rest).

Every flag and file is checked before the process group starts (`check_args`), and the model
once more through usp's attention before the first step (`_probe`: what usp refuses only when
attention runs): a bad one is a one-line error and exit status 2, before any step runs.

Nothing but the standard library is imported at module load: ``usp-graph --help`` stays fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import stat
import sys
import tempfile
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["add_arguments", "check_args", "main", "run"]

CHECKPOINT_POLICIES = ("full", "save_attention", "recompute_attention")
DTYPES = ("float32", "bfloat16", "float64")
# --text is read whole (and marked per byte): bounded, so /dev/zero or a huge file is an error.
MAX_TEXT_BYTES = 1 << 30
MAX_CONFIG_BYTES = 16 << 20
# Each row's seed is (seed * 1_000_003 + step) * 4099 + replica: with seed < 2**32 and step <= 2**40
# it stays below 2**64 (torch's seed range); a checkpoint's step is below --steps, so bounded too.
MAX_STEPS = 1 << 40


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The recipe's flags (shared by ``python -m usp_graph.train`` and ``usp-graph train``)."""
    p.add_argument("--model", metavar="PATH", help="a local transformers model directory (config.json, "
                   "weights if present); default: a tiny random Llama built from transformers.LlamaConfig")  # fmt: skip
    p.add_argument("--text", metavar="FILE", help="train on a local text file (byte-level tokens, documents "
                   "separated by blank lines); default: synthetic documents")  # fmt: skip
    p.add_argument(
        "--cp-strategy", default="ulysses", help="allgather_kv, ulysses, ring or usp (default ulysses)"
    )
    p.add_argument(
        "--cp",
        type=int,
        default=None,
        help="context-parallel degree (default: WORLD / dp, or 2 when WORLD is even)",
    )
    p.add_argument("--dp", type=int, default=None, help="data-parallel degree (default: WORLD / cp)")
    p.add_argument("--ulysses-degree", type=int, default=None, help="strategy usp: ranks per Ulysses group")
    p.add_argument(
        "--fsdp", action="store_true", help="FSDP2: shard parameters over dp x cp (usp_graph.fsdp)"
    )
    p.add_argument("--checkpoint", nargs="?", const="full", default=None, choices=CHECKPOINT_POLICIES,
                   help="activation checkpointing of every decoder block; optional policy: full (default), "
                   "save_attention, recompute_attention")  # fmt: skip
    p.add_argument(
        "--compile", action="store_true", help='torch.compile(backend="usp") instead of eager attention_mode'
    )
    p.add_argument(
        "--steps", type=int, default=10, help="train until this step (a resumed run counts from its step)"
    )
    p.add_argument(
        "--seq-len", type=int, default=256, help="tokens per packed row of one replica (global, before CP)"
    )
    p.add_argument(
        "--mean-doc-len",
        type=float,
        default=None,
        help="synthetic mean document length (default seq-len / 8)",
    )
    p.add_argument("--lr", type=float, default=None,
                   help="AdamW's learning rate (default 1e-3; with --resume, the checkpoint's unless given)")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", default="float32", choices=DTYPES, help="parameter dtype (default float32)")
    p.add_argument(
        "--save", metavar="DIR", help="save model, optimizer, step and data position to DIR/step_N at the end"
    )
    p.add_argument(
        "--save-every", type=int, default=0, metavar="N", help="also save every N steps (with --save)"
    )
    p.add_argument("--resume", metavar="DIR", help="continue from a checkpoint: a --save DIR (its newest step_N) "
                   "or one step_N directory. Flags given override the checkpoint's: --lr, the layout (--dp, --cp, "
                   "--cp-strategy, --ulysses-degree, --fsdp, --checkpoint, --compile), --steps. The model (--model) "
                   "and --dtype must match it (checked); AdamW's other settings come from it. The same --seed, "
                   "--seq-len, --mean-doc-len, --text and --dp continue the uninterrupted run's batches")  # fmt: skip
    p.add_argument(
        "--metrics", metavar="FILE", help="append one JSON line per step (step, loss, tokens_per_s)"
    )
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of a progress bar")
    return p


def build_parser() -> argparse.ArgumentParser:
    return add_arguments(
        argparse.ArgumentParser(prog="python -m usp_graph.train", description=__doc__.split("\n")[0])
    )


class UsageError(ValueError):
    """A bad flag combination; the message says what to change."""


# ---- flags and files, checked before anything starts ----------------------------------------------


def _world() -> int:
    """The number of ranks this run will have: torchrun's WORLD_SIZE, else 1 (as `_init_distributed`)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    if "RANK" not in os.environ:
        return 1
    try:
        return int(os.environ["WORLD_SIZE"])
    except (KeyError, ValueError):
        raise UsageError("RANK is set but WORLD_SIZE is not an int: launch with torchrun") from None


def _writable_dir_for(path: str, flag: str) -> None:
    """`path` can become (or is) a directory this process can write in; else UsageError."""
    full = os.path.abspath(path)
    if os.path.lexists(full) and not os.path.isdir(full):
        raise UsageError(f"{flag} {path}: exists and is not a directory")
    probe = full
    while not os.path.lexists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        raise UsageError(f"{flag} {path}: {probe} is not a directory, so {path} cannot be created")
    if not os.access(probe, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {path}: no permission to write in {probe}")
    # Permissions do not show a read-only or special file system (or root's access): create the
    # directory now and write a file in it, so a save cannot fail only after every step trained.
    try:
        os.makedirs(full, exist_ok=True)
        fd, name = tempfile.mkstemp(prefix=".probe.", dir=full)
        os.close(fd)
        os.remove(name)
    except OSError as e:
        raise UsageError(f"{flag} {path}: cannot write there ({e.strerror or e})") from None


def check_args(args: argparse.Namespace):
    """Check every flag and file that can be checked before the process group starts.

    Returns ``(dp, cp, resume index or None)``; raises `UsageError` with what to change. Runs on
    every rank, reads at most the checkpoint's JSON index (bounded), and starts nothing."""
    from .cp.table import STRATEGIES
    from .train_checkpoint import CheckpointError, find, read_index

    for flag in ("model", "text", "save", "resume", "metrics"):
        if getattr(args, flag) == "":
            raise UsageError(f"--{flag} needs a path, got an empty string")
    if not 1 <= args.steps <= MAX_STEPS:
        raise UsageError(f"--steps must be in [1, 2**40], got {args.steps}")
    if args.save_every < 0:
        raise UsageError(f"--save-every must be >= 0, got {args.save_every}")
    if args.save_every and not args.save:
        raise UsageError("--save-every needs --save DIR")
    if args.lr is not None and not (math.isfinite(args.lr) and args.lr >= 0):
        raise UsageError(f"--lr must be a finite number >= 0, got {args.lr}")
    if args.mean_doc_len is not None and not (math.isfinite(args.mean_doc_len) and args.mean_doc_len >= 1):
        raise UsageError(f"--mean-doc-len must be a finite number >= 1 (tokens), got {args.mean_doc_len}")
    if not 0 <= args.seed < 2**32:
        raise UsageError(f"--seed must be in [0, 2**32), got {args.seed}")
    runs = [s for s in STRATEGIES if s != "halo"]  # halo needs a document length cap
    if args.cp_strategy not in runs:
        why = (
            " (halo needs a cap on document length, which the recipe's data has not)"
            if args.cp_strategy == "halo"
            else ""
        )
        raise UsageError(f"--cp-strategy must be one of {', '.join(runs)}; got {args.cp_strategy!r}{why}")
    world = _world()
    dp, cp = _degrees(args, world)
    if args.seq_len % cp or args.seq_len < 2 * cp:
        raise UsageError(f"--seq-len {args.seq_len} must be a multiple of --cp {cp} (and >= 2 x it)")
    if args.ulysses_degree is not None:
        if args.cp_strategy != "usp":
            raise UsageError(f"--ulysses-degree applies to --cp-strategy usp only (got {args.cp_strategy})")
        if args.ulysses_degree < 1 or cp % args.ulysses_degree:
            raise UsageError(f"--ulysses-degree {args.ulysses_degree} must divide --cp {cp}")
    if args.model is not None:
        config = os.path.join(args.model, "config.json")
        if not os.path.isdir(args.model):
            raise UsageError(
                f"--model {args.model}: not a directory (give a local transformers model directory)"
            )
        if not os.path.isfile(config):
            raise UsageError(
                f"--model {args.model}: no config.json there (give a transformers model directory)"
            )
        if os.path.getsize(config) > MAX_CONFIG_BYTES:
            raise UsageError(f"--model {args.model}: config.json is larger than {MAX_CONFIG_BYTES:,} bytes")
        _check_model_config(args.model)
    if args.text is not None:
        try:
            st = os.stat(args.text)
        except OSError as e:
            raise UsageError(f"--text {args.text}: {e.strerror or e}") from None
        if not stat.S_ISREG(st.st_mode):
            raise UsageError(f"--text {args.text}: not a regular file (give a text file)")
        if st.st_size > MAX_TEXT_BYTES:
            raise UsageError(
                f"--text {args.text}: {st.st_size:,} bytes, over the recipe's {MAX_TEXT_BYTES:,}"
            )
    if args.metrics is not None:
        if os.path.isdir(args.metrics):
            raise UsageError(f"--metrics {args.metrics}: a directory; give a file to append JSON lines to")
        parent = os.path.dirname(os.path.abspath(args.metrics))
        if not os.path.isdir(parent):
            raise UsageError(f"--metrics {args.metrics}: {parent} is not a directory")
    index = None
    if args.resume is not None:
        try:
            index = read_index(find(args.resume))
        except CheckpointError as e:
            raise UsageError(str(e)) from None
        if index.step >= args.steps:
            raise UsageError(
                f"--resume {args.resume} holds step {index.step}; --steps {args.steps} must be greater "
                "(it is the step to train until, counted from the start)"
            )
    if args.save is not None:
        _writable_dir_for(args.save, "--save")
        _check_save_steps(args, index.step if index is not None else 0)
    if args.metrics is not None:
        _check_metrics_reads_nothing(args, index)
    return dp, cp, index


def _check_metrics_reads_nothing(args: argparse.Namespace, index) -> None:
    """--metrics (appended to) is none of the files the run reads: the text, the model's files, the
    checkpoint resumed (same file by device and inode: links and other spellings too)."""
    from .train_checkpoint import DATA, INDEX

    inputs = [args.text] if args.text else []
    if args.model:
        inputs += [os.path.join(args.model, name) for name in sorted(os.listdir(args.model))]
    if index is not None:
        inputs += [os.path.join(index.path, INDEX), os.path.join(index.path, DATA)]
    if not os.path.exists(args.metrics):  # a file made by the run is none of its inputs
        return
    for path in inputs:
        try:
            same = os.path.samefile(args.metrics, path)
        except OSError:  # an input that is not there (a dangling link): not this file
            continue
        if same:
            raise UsageError(f"--metrics {args.metrics} is {path}, which the run reads; give another file")


def _saves_step(args: argparse.Namespace, start: int, step: int) -> bool:
    """The run that starts after `start` saves ``step_{step}`` (the last step, and every --save-every)."""
    return start < step <= args.steps and (
        step == args.steps or (args.save_every > 0 and step % args.save_every == 0)
    )


def _check_save_steps(args: argparse.Namespace, start: int) -> None:
    """No ``step_N`` the run will save is taken by something other than a directory (a save would
    fail only after the steps before it trained). Reads the directory once: the steps saved may be
    many more than the names in it."""
    for name in sorted(os.listdir(args.save)):
        full, n = os.path.join(args.save, name), name.removeprefix("step_")
        if n.isascii() and n.isdigit() and name == f"step_{int(n)}" and _saves_step(args, start, int(n)):
            if not os.path.isdir(full):
                raise UsageError(
                    f"--save {args.save}: {full} exists and is not a directory (the run saves there)"
                )


def _attention_dropouts(config: dict[str, Any], where: str = "") -> list[str]:
    """`name=value` of every attention dropout above 0 in a config's dict (nested configs too: text
    configs, MPT's attn_config): names holding "att" and "dropout" or "pdrop"."""
    found = []
    for key, value in config.items():
        name = str(key)  # id2label's keys are ints
        if isinstance(value, dict):
            found += _attention_dropouts(value, f"{where}{name}.")
        elif "att" in name and ("dropout" in name or "pdrop" in name):
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0:
                found.append(f"{where}{name}={value}")
    return found


def _check_model_config(path: str) -> None:
    """The model's config loads, names a causal LM whose class "usp" accepts (hf.py's own check),
    and asks for no dropout inside attention. What "usp" refuses only when attention is called
    (softcapping, sinks, a mask beyond documents, row mixers) `_probe` finds before the first step."""
    import transformers

    try:
        config = transformers.AutoConfig.from_pretrained(path)
    except Exception as e:  # noqa: BLE001 - any failure to read it is the user's file to fix
        raise UsageError(
            f"--model {path}: transformers cannot read its config.json ({type(e).__name__}: {e})"
        ) from None
    dropouts = _attention_dropouts(config.to_dict())
    if dropouts:
        raise UsageError(
            f"--model {path}: the config asks for dropout inside attention ({', '.join(dropouts)}), which usp "
            "does not run; set it to 0.0 in config.json for training with the recipe"
        )
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    from .hf import UnsupportedAttention, _refuse_own_attention

    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except KeyError:
        raise UsageError(
            f"--model {path}: transformers has no causal LM for model_type {config.model_type!r} (the recipe "
            "trains AutoModelForCausalLM models)"
        ) from None
    try:  # the refusal attn_implementation="usp" makes when the model is built
        _refuse_own_attention(cls)
    except UnsupportedAttention as e:
        raise UsageError(f"--model {path}: {e}") from None


# ---- distributed setup ----------------------------------------------------------------------------


def _init_distributed():
    """(device, launched by torchrun): NCCL on GPUs, gloo on CPU; one process without torchrun."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        cuda = torch.cuda.is_available() and dist.get_backend() == "nccl"
        return torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"), False
    single = "RANK" not in os.environ  # a plain `python -m usp_graph.train`: a group of one, no rendezvous
    group = {"store": dist.HashStore(), "rank": 0, "world_size": 1} if single else {}
    if torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", device_id=device, **group)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo", **group)
    return device, True


def _degrees(args, world: int) -> tuple[int, int]:
    dp, cp = args.dp, args.cp
    for flag, n in (("--dp", dp), ("--cp", cp)):
        if n is not None and n < 1:
            raise UsageError(f"{flag} must be >= 1, got {n}")
    if cp is None:
        cp = world // dp if dp else (2 if world % 2 == 0 else 1)
    if dp is None:
        dp = world // cp if cp and world % cp == 0 else 0
    if dp < 1 or cp < 1 or dp * cp != world:
        given = ", ".join(f"{f} {n}" for f, n in (("--dp", args.dp), ("--cp", args.cp)) if n is not None)
        raise UsageError(f"--dp x --cp must multiply to the {world} ranks launched (given: {given})")
    return dp, cp


def _context_parallel(args, mesh):
    """The CP plan over the mesh's ``cp`` dimension (flags already checked by `check_args`)."""
    from .cp import ContextParallel

    extra: dict[str, Any] = {}
    if args.cp_strategy == "usp":
        u = args.ulysses_degree or (2 if mesh["cp"].size() % 2 == 0 else 1)
        extra["ulysses_degree"] = u
        return ContextParallel("usp", group=mesh["cp"].get_group(), **extra)
    return ContextParallel(args.cp_strategy, mesh=mesh["cp"])


class _DataParallel:
    """Without FSDP: full parameters on every rank; gradients summed over every rank in rank order."""

    def __init__(self, group) -> None:
        self.group = group

    def token_mean(self, loss_sum, num_tokens):
        from .cp.context import token_mean

        return token_mean(loss_sum, num_tokens, self.group)

    def global_sum(self, x):
        from .cp.context import _ordered_sum

        return _ordered_sum(x.detach(), self.group)

    def reduce_grads(self, params) -> None:
        import torch

        from .distributed import all_reduce_sum_ordered

        params = [p for p in params if p.requires_grad]
        if not params or self.group.size() == 1:
            return
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        for p, g in zip(params, all_reduce_sum_ordered(grads, self.group), strict=True):
            p.grad = g


# ---- model ----------------------------------------------------------------------------------------


# transformers' attention implementation "usp" (usp_graph.hf): no mask built, GQA without repeated
# K/V heads, sliding windows from each layer; inside the step's attention_mode(meta, cp=cp) it takes
# the global documents, the same on every CP rank (transformers' own "sdpa" would build a mask
# from this rank's shard of the position ids).
ATTENTION = "usp"


def _register_attention() -> None:
    from .hf import register

    register()


def _model(args, dtype, device):
    import torch
    import transformers

    _register_attention()
    if args.model:
        if not os.path.isdir(args.model):
            raise UsageError(
                f"--model {args.model}: not a directory (give a local transformers model directory)"
            )
        config = transformers.AutoConfig.from_pretrained(args.model)
        weights = any(f.endswith((".safetensors", ".bin")) for f in os.listdir(args.model))
        torch.manual_seed(args.seed)
        if weights:
            model = transformers.AutoModelForCausalLM.from_pretrained(
                args.model, attn_implementation=ATTENTION, dtype=dtype
            )
        else:
            model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=ATTENTION)
    else:
        config = transformers.LlamaConfig(
            vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=max(args.seq_len, 64), tie_word_embeddings=False,
        )  # fmt: skip
        torch.manual_seed(args.seed)
        model = transformers.LlamaForCausalLM._from_config(config, attn_implementation=ATTENTION)
    model = model.to(device=device, dtype=dtype)
    if args.text and model.config.vocab_size < 256:
        raise UsageError(
            f"--text uses byte-level ids 0-255, but the model's vocab_size is {model.config.vocab_size}"
        )
    return model


# ---- data -----------------------------------------------------------------------------------------


class _Data:
    """Packed rows: `row(step, replica)` -> (input_ids_1L, position_ids_1L, labels_1L, lengths)."""

    def __init__(self, args, vocab: int, replicas: int) -> None:
        self.seq_len, self.seed, self.vocab, self.replicas = args.seq_len, args.seed, vocab, replicas
        self.mean = args.mean_doc_len or max(2.0, args.seq_len / 8)
        self.docs: list[bytes] | None = None
        if args.text:
            from .train_checkpoint import CheckpointError, read_regular_file

            try:  # non-blocking, regular files only, bounded: a FIFO or /dev/zero is an error
                raw = read_regular_file(args.text, MAX_TEXT_BYTES, "--text")
            except CheckpointError as e:
                raise UsageError(str(e)) from None
            docs = [d.strip() for d in raw.replace(b"\r\n", b"\n").split(b"\n\n")]
            self.docs = [d for d in docs if d]
            if not self.docs:
                raise UsageError(f"--text {args.text}: no text in the file")
            if max(len(d) for d in self.docs) < 2:
                raise UsageError(f"--text {args.text}: every document is one byte long, so nothing is "
                                 "predicted (a token's target is the next byte of its document)")  # fmt: skip
            self.stream = b"".join(self.docs)
            self.starts = bytearray(len(self.stream))  # 1 where a document starts (bounded: a byte per byte)
            at = 0
            for d in self.docs:
                self.starts[at] = 1
                at += len(d)

    def row(self, step: int, replica: int):
        import torch

        from .testing import lognormal_lengths

        n = self.seq_len
        if self.docs is None:
            seed = (self.seed * 1_000_003 + step) * 4099 + replica
            lengths = lognormal_lengths(n, self.mean, seed=seed)
            ids = torch.randint(0, self.vocab, (n,), generator=torch.Generator().manual_seed(seed))
        else:  # rows follow each other through the byte stream, wrapping at its end
            total = len(self.stream)
            start = ((step * self.replicas + replica) * n) % total
            ids_list, lengths, cur = [], [], 0
            for i in range(n):
                at = (start + i) % total
                if i > 0 and self.starts[at]:
                    lengths.append(cur)
                    cur = 0
                ids_list.append(self.stream[at])
                cur += 1
            lengths.append(cur)
            ids = torch.tensor(ids_list, dtype=torch.long)
        pos = torch.cat([torch.arange(k) for k in lengths])
        labels = torch.full((n,), -100, dtype=torch.long)
        at = 0
        for k in lengths:  # token t predicts t + 1 within its document
            labels[at : at + k - 1] = ids[at + 1 : at + k]
            at += k
        return ids[None], pos[None], labels[None], lengths


# ---- checkpoints (format and atomic writes: usp_graph.train_checkpoint) ----------------------------


def _agree(ok: bool, device) -> bool:
    """True on every rank when `ok` is True on every rank (so a failure on one stops them all)."""
    import torch
    import torch.distributed as dist

    flag = torch.tensor([1 if ok else 0], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _save(root: str, model, opt, step: int, device) -> str:
    """Every rank gathers the full state (FSDP2 shards it); rank 0 writes ``root/step_{step}``."""
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from .train_checkpoint import CheckpointError, save_state

    msd, osd = get_state_dict(model, opt, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    error, path = None, os.path.join(root, f"step_{step}")
    if dist.get_rank() == 0:
        try:
            path = save_state(root, step, msd, osd)
        except CheckpointError as e:
            error = str(e)
    if not _agree(error is None, device):
        raise UsageError(error or f"--save {root}: rank 0 could not write step_{step} (its message says why)")
    return path


def _load(index, model, opt) -> int:
    """Every rank reads the full state of `index` and keeps its own shard; returns the step."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

    from .train_checkpoint import CheckpointError, read_state

    # Names, dtypes, global shapes and param groups from the live (possibly sharded) model and
    # optimizer: nothing is gathered, and the optimizer has no state yet.
    live_msd, live_osd = get_state_dict(model, opt)
    expect = {k: (v.dtype, tuple(v.shape)) for k, v in live_msd.items()}
    state_keys = {
        "step": "step",
        "exp_avg": "param",
        "exp_avg_sq": "param_nonnegative",
    }  # AdamW's, amsgrad off
    try:
        msd, osd = read_state(index, expect, groups=live_osd["param_groups"], state_keys=state_keys)
    except CheckpointError as e:
        raise UsageError(str(e)) from None
    options = StateDictOptions(full_state_dict=True)
    set_state_dict(model, opt, model_state_dict=msd, optim_state_dict=osd, options=options)
    return index.step


def _open_metrics(path: str):
    """Open for appending without blocking (a FIFO with no reader is an error, not a hang)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NONBLOCK, 0o644)
    except OSError as e:
        why = "a FIFO with no reader" if e.errno == 6 else (e.strerror or str(e))  # ENXIO
        raise UsageError(f"--metrics {path}: {why}") from None
    os.set_blocking(fd, True)
    return os.fdopen(fd, "a")


# ---- the loop -------------------------------------------------------------------------------------


def _capacity(docs: int) -> int:
    """Document slots for a step with `docs` documents: a power of two (at least 16), so a compiled
    step sees few capacities (each is a shape) and kernels do not loop over one slot per token."""
    return max(16, 1 << (docs - 1).bit_length())


class _Progress:
    """A progress bar on rank 0: tqdm when installed (a transformers dependency), else one line per step."""

    def __init__(self, total: int, initial: int, enabled: bool, plain: bool) -> None:
        self.enabled, self.bar = enabled, None
        if enabled and not plain:
            try:
                from tqdm import tqdm
            except ImportError:
                tqdm = None
            if tqdm is not None:
                self.bar = tqdm(total=total, initial=initial, desc="train", unit="step", dynamic_ncols=True)

    def update(self, step: int, total: int, loss: float, tps: float) -> None:
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(f"loss {loss:.4f}, {tps:,.0f} tok/s", refresh=False)
            self.bar.update(1)
        else:
            print(f"step {step}/{total}  loss {loss:.6f}  {tps:,.0f} tok/s", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


def _probe(model, args, device) -> None:
    """One forward of two short documents through the recipe's attention door (`attention_mode`,
    or `documents` with --compile, run eagerly), without context parallelism, gradients or a draw
    from the random generators: what usp refuses for this model only when attention is called
    (hf.py's refusals: softcapping, sinks, dropout inside attention, a mask beyond documents;
    attention_mode's rules: row mixers, positions counted along the row) is a `UsageError` (exit 2)
    before the first step, with usp's own reason, instead of a traceback at step 1."""
    import torch

    from . import AttentionMetadata, attention_mode, documents
    from .backend.documents import EagerAttentionError

    lengths = [3, 2]
    ids = torch.ones(1, sum(lengths), dtype=torch.long, device=device)
    pos = torch.cat([torch.arange(k) for k in lengths])[None].to(device)
    meta = AttentionMetadata.from_lengths(
        lengths, max_docs=_capacity(2), max_seqlen=max(lengths), device=device
    )

    def forward(door) -> None:
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), torch.no_grad(), door:
            model(input_ids=ids, position_ids=pos, use_cache=False)

    try:
        try:
            forward(documents(meta) if args.compile else attention_mode(meta))
        except EagerAttentionError:  # an SDPA call outside transformers' attention interface: compiled
            forward(attention_mode(meta))  # code rewrites it, eager documents(...) cannot; attention_mode can
    except (ValueError, NotImplementedError) as e:
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"--model {args.model or '(the default Llama)'}: {first[:400]}") from None


class _Job:
    """What the steps run with: built once every rank has its process group (`_setup`)."""

    def __init__(self, args, dp: int, cp_degree: int, device) -> None:
        import torch.distributed as dist

        self.args, self.dp, self.cp_degree, self.device = args, dp, cp_degree, device
        self.world, self.rank = dist.get_world_size(), dist.get_rank()
        self.model: Any = None
        self.run_model: Any = None
        self.opt: Any = None
        self.plan: Any = None
        self.cp: Any = None
        self.start, self.replica = 0, 0


def _build_model(args, dtype, device):
    """`_model`, with transformers' errors for a malformed model directory as one line."""
    try:
        return _model(args, dtype, device)
    except (OSError, ValueError) as e:
        if not args.model or isinstance(e, UsageError):
            raise
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"--model {args.model}: {first[:300]}") from None


def _setup(args, dp: int, cp_degree: int, index, device) -> _Job:
    """Mesh, CP plan, model (probed), checkpointing, FSDP2 or data parallel, AdamW, compile, resume."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from .checkpointing import checkpoint_blocks
    from .fsdp import prepare

    job = _Job(args, dp, cp_degree, device)
    dims = ("dp_shard" if args.fsdp else "dp_replicate", "cp")
    mesh = init_device_mesh(device.type, (dp, cp_degree), mesh_dim_names=dims)
    job.cp = _context_parallel(args, mesh)
    model = job.model = _build_model(args, getattr(torch, args.dtype), device)
    _probe(model, args, device)
    if args.checkpoint:
        checkpoint_blocks(model, policy=args.checkpoint)
    if args.fsdp:
        job.plan = prepare(model, mesh, job.cp)
    else:
        job.plan = _DataParallel(
            mesh._flatten("dp_replicate_cp").get_group() if job.world > 1 else dist.group.WORLD
        )
    job.opt = torch.optim.AdamW(model.parameters(), lr=args.lr if args.lr is not None else 1e-3)
    job.run_model = torch.compile(model, backend="usp", options={"cp": job.cp}) if args.compile else model
    if index is not None:
        job.start = _load(index, model, job.opt)
        if args.lr is not None:  # an explicit --lr overrides the checkpoint's
            for group in job.opt.param_groups:
                group["lr"] = args.lr
    job.replica = mesh.get_coordinate()[0]
    return job


def _describe(job: _Job) -> str:
    args, model = job.args, job.model
    return (
        f"usp_graph.train: {type(model).__name__} ({sum(p.numel() for p in model.parameters()):,} params, "
        f"{args.dtype}) on {job.world} {job.device.type} rank(s): dp {job.dp} x cp {job.cp_degree} "
        f"({args.cp_strategy}), {'FSDP2' if args.fsdp else 'replicated'}, checkpoint {args.checkpoint or 'off'}, "
        f"{'compiled' if args.compile else 'eager'}; {args.seq_len} tokens per row, {job.dp * args.seq_len} per "
        f"step; steps {job.start + 1}..{args.steps}; lr {job.opt.param_groups[0]['lr']:g}"
    )


def _train_step(job: _Job, data: _Data, step: int) -> float:
    """One step on this rank's shard of its replica's row; returns the global token-mean loss."""
    import torch
    import torch.nn.functional as F

    from . import AttentionMetadata, attention_mode, documents

    args, device, cp, plan = job.args, job.device, job.cp, job.plan
    ids, pos, labels, lengths = data.row(step, job.replica)
    meta = AttentionMetadata.from_lengths(
        lengths, max_docs=_capacity(len(lengths)), max_seqlen=args.seq_len, device=device
    )
    local = [cp.shard(x, 1).to(device) for x in (ids, pos, labels)]
    with documents(meta) if args.compile else attention_mode(meta, cp=cp):
        logits = job.run_model(input_ids=local[0], position_ids=local[1], use_cache=False).logits
    flat = local[2].flatten()
    loss_sum = F.cross_entropy(
        logits.flatten(0, 1).to(torch.promote_types(logits.dtype, torch.float32)),
        flat,
        ignore_index=-100,
        reduction="sum",
    )
    # The token mean over every rank's targets (`plan.token_mean`'s value, bitwise: integer
    # counts sum exactly), with at least one target: a step whose rows hold none (only
    # one-token documents) has loss 0 and zero gradients, not 0/0 = nan.
    targets = plan.global_sum((flat != -100).sum().to(torch.float64))
    loss = loss_sum / targets.clamp_min(1).to(loss_sum.dtype)
    job.opt.zero_grad(set_to_none=True)
    loss.backward()
    plan.reduce_grads(job.model.parameters())
    job.opt.step()
    return plan.global_sum(loss).item()  # a host sync: the step is done


def _train(job: _Job, data: _Data) -> float:
    """Steps start + 1 .. --steps, with progress, metrics and the --save-every saves; the last loss."""
    args = job.args
    progress = _Progress(args.steps, job.start, job.rank == 0, args.no_progress)
    log = _open_metrics(args.metrics) if args.metrics and job.rank == 0 else None
    loss_value = math.nan
    for step in range(job.start, args.steps):
        t0 = time.perf_counter()
        loss_value = _train_step(job, data, step)
        tps = job.dp * args.seq_len / (time.perf_counter() - t0)
        progress.update(step + 1, args.steps, loss_value, tps)
        if log is not None:
            try:
                log.write(json.dumps({"step": step + 1, "loss": loss_value, "tokens_per_s": tps}) + "\n")
                log.flush()
            except OSError as e:  # a full disk, /dev/full, a reader that went away
                raise UsageError(f"--metrics {args.metrics}: {e.strerror or e}") from None
        if args.save and step + 1 < args.steps and _saves_step(args, job.start, step + 1):
            _save(args.save, job.model, job.opt, step + 1, job.device)
    progress.close()
    if log is not None:
        log.close()
    return loss_value


def _compiled_checkpoints(args: argparse.Namespace) -> contextlib.AbstractContextManager:
    """--compile --checkpoint: each checkpointed block compiles whole. transformers >= 5.25 breaks
    Dynamo's graph at every checkpointed layer (`usp_graph.checkpointing`), which would run the
    layers' attention eagerly, outside backend usp and its context parallelism; the setting that
    compiles them is exact for that break (docs/transformers-and-trainer.md)."""
    if not (args.compile and args.checkpoint):
        return contextlib.nullcontext()
    import torch._dynamo

    return torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)


def run(args: argparse.Namespace) -> int:
    """Train as `args` says; returns a process exit code."""
    import torch.distributed as dist

    dp, cp_degree, index = check_args(args)
    data = _Data(args, 256, dp)  # reads --text now (its vocabulary is set once the model is built)
    device, owns_group = _init_distributed()
    try:
        job = _setup(args, dp, cp_degree, index, device)
        data.vocab = job.model.config.vocab_size
        if job.rank == 0:
            print(_describe(job), flush=True)
        with _compiled_checkpoints(args):
            loss_value = _train(job, data)
        if args.save:
            where = _save(args.save, job.model, job.opt, args.steps, device)
            if job.rank == 0:
                print(f"saved step {args.steps} to {where}", flush=True)
        if job.rank == 0:
            print(f"done: step {args.steps}, loss {loss_value:.6f}", flush=True)
        return 0
    finally:
        if owns_group and dist.is_initialized():
            dist.destroy_process_group()


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return run(args)
    except UsageError as e:
        print(f"usp_graph.train: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
