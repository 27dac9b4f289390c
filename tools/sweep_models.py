"""Sweep transformers model families under backend "usp" on packed documents (CPU, fp64, tiny).

    python tools/sweep_models.py                     # every family of tests/realmodels.SWEEP_SPECS
    python tools/sweep_models.py --families phi3,t5  # some
    python tools/sweep_models.py --cp ulysses        # context parallelism on 2 gloo ranks
    python tools/sweep_models.py --doors usp         # only the doors table (below)

Each family is built from a config (no download), fp64, SDPA attention, dropout zeroed, training
mode, and runs on 2 rows x 16 tokens of packed documents (positions restart at 0 per document;
no document crosses a row). Checks, each printed as ok / FAIL / refused / ERR / - (skipped):

- packed: ``torch.compile(model, backend="usp")`` under ``documents(meta)`` with
  ``use_cache=False`` vs every document run alone through the plain model: the output and every
  parameter grad of a linear loss within the family's fp64 tolerance (`SweepSpec.tol`).
- bitwise: the same compiled call vs eager ``attention_mode(meta)``: output and grads equal.
- ckpt: transformers' checkpointing (``activation_checkpointing_enable()``), compiled again: matches each document alone and
  rewrote as many attention calls as without checkpointing, keeping none as SDPA. Under Dynamo's
  ``skip_fwd_side_effects_in_bwd_under_checkpoint`` (`CHECKPOINT_SETTING`, as the suite runs it):
  without it, transformers >= 5.25 breaks Dynamo's graph at the checkpointed layers of families
  whose attention the ``kernels`` package wraps, and usp refuses them with that fix named
  (``tests/test_documents_checkpointing.py`` checks the refusal).
- dumps: the packed compile ran with option ``dump_dir``: every graph it made wrote its graph
  file (``summary.json`` records no failure; joint, forward and backward of each trained graph).
- eager / flex: the family built with ``attn_implementation="eager"`` and ``"flex_attention"``
  (attention computed without SDPA; flex in fp32: transformers compiles it with inductor, which
  has no fp64 CPU kernel), forward under packed documents, compiled and eager ``attention_mode``:
  refused, or each document's own result ("n/a": the family has no such implementation). A cell
  names both paths when their verdicts differ.
- no position_ids: the family called without ``position_ids`` under packed documents, compiled
  and eager (positions the model counts itself): refused, or each document's own result ("-": the
  forward takes none, so the packed check already ran without them).

The doors table (``--doors usp``, or doors of it by name): every front door a transformers user
takes, each cell the output and every parameter grad against each document alone, or a refusal.
Columns (`DOORS`): attn_implementation "usp" in eager, under plain ``torch.compile`` (Dynamo with
aot_eager) and under backend usp, with the documents in packed position ids ("pos",
``DataCollatorWithFlattening``'s default), in flash-attention's ``cu_seq_lens_q/k`` next to them
("flash") or in a ``documents(meta)`` block; "sdpa" + backend usp with position ids only ("sdpa"
under ``documents`` is the packed column above). "-": the forward takes no position ids (or no
flash kwargs); "model's own": "sdpa" without a block gives the plain model's result, whose mask
ignores the position ids (it attends the whole row, with or without usp).

``--cp ulysses`` (or any strategy) checks context parallelism instead, on 2 gloo ranks: the rows
sharded over the ranks, eager, compiled, and compiled with gradient checkpointing, against every
document alone in one process.

"refused": the backend raised its own ValueError saying why packed documents cannot run (the
message follows the table), never a wrong result; "ERR": any other exception.

Encoder-decoders (kind "seq2seq"): source and target documents pair up (document i of the
target reads document i of the source): ``documents(target_meta, kv=source_meta)``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import sys
import tempfile
import time
import traceback
import warnings

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import torch  # noqa: E402

import usp_graph  # noqa: E402
from tests.realmodels import (  # noqa: E402
    SWEEP_SPECS,
    VOCAB,
    checkpoint_layers,
    grads,
    make_sweep_model,
    max_err,
    packed_positions,
    weighted_loss,
)
from usp_graph import AttentionMetadata  # noqa: E402

ROWS, LENGTH = 2, 16
SOURCE = (5, 1, 6, 4, 9, 7)  # 2 x 16 tokens, a length-1 document, documents longer than the window
TARGET = (3, 2, 1, 4, 6, 4)  # seq2seq targets: 2 x 10 tokens, document i reads source document i
TARGET_ROW = 10
MAX_DOCS = 8


class Batch:
    """One packed batch of a family: model inputs, documents, and per-document slices."""

    def __init__(self, kind: str, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.kind = kind
        self.ids = torch.randint(1, VOCAB, (ROWS, LENGTH), generator=gen)
        self.pos = packed_positions(SOURCE).view(ROWS, LENGTH)
        self.meta = AttentionMetadata.from_lengths(SOURCE, max_docs=MAX_DOCS)
        if kind == "seq2seq":
            self.tgt = torch.randint(1, VOCAB, (ROWS, TARGET_ROW), generator=gen)
            self.tgt_pos = packed_positions(TARGET).view(ROWS, TARGET_ROW)
            self.tgt_meta = AttentionMetadata.from_lengths(TARGET, max_docs=MAX_DOCS)

    def documents(self):
        if self.kind == "seq2seq":
            return usp_graph.documents(self.tgt_meta, kv=self.meta)
        return usp_graph.documents(self.meta)

    def attention_mode(self):
        if self.kind == "seq2seq":
            return usp_graph.attention_mode(self.tgt_meta, kv=self.meta)
        return usp_graph.attention_mode(self.meta)


def _takes(model, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def forward(model, kind: str, ids, pos, tgt=None, tgt_pos=None, *, takes=None, extra=None) -> torch.Tensor:
    """The tensor the loss reads: logits (decoder), last hidden state (encoder), or the decoder's
    last hidden state next to the encoder's (seq2seq, concatenated on the token axis). `extra`:
    more keyword inputs (flash-attention's ``cu_seq_lens_q/k``)."""
    takes = takes or (lambda n: _takes(model, n))
    kw = {"position_ids": pos} if takes("position_ids") else {}
    kw.update(extra or {})
    if kind == "decoder":
        return model(input_ids=ids, use_cache=False, **kw).logits
    if kind == "encoder":
        return model(input_ids=ids, **kw).last_hidden_state
    if takes("decoder_position_ids"):
        kw["decoder_position_ids"] = tgt_pos
    out = model(input_ids=ids, decoder_input_ids=tgt, use_cache=False, **kw)
    return torch.cat([out.last_hidden_state, out.encoder_last_hidden_state], 1)


def alone(model, batch: Batch, takes) -> tuple[torch.Tensor, dict]:
    """Output and grads with every document run alone through the plain model."""
    ids, pos = batch.ids.reshape(1, -1), batch.pos.reshape(1, -1)
    starts = [0]
    for n in SOURCE:
        starts.append(starts[-1] + n)
    dec, enc = [], []
    if batch.kind == "seq2seq":
        tgt, tgt_pos = batch.tgt.reshape(1, -1), batch.tgt_pos.reshape(1, -1)
        t0 = 0
        for i in range(len(SOURCE)):
            s = slice(starts[i], starts[i + 1])
            t = slice(t0, t0 + TARGET[i])
            t0 += TARGET[i]
            out = forward(model, "seq2seq", ids[:, s], pos[:, s], tgt[:, t], tgt_pos[:, t], takes=takes)
            dec.append(out[:, : TARGET[i]])
            enc.append(out[:, TARGET[i] :])
        out = torch.cat(
            [torch.cat(dec, 1).view(ROWS, TARGET_ROW, -1), torch.cat(enc, 1).view(ROWS, LENGTH, -1)], 1
        )
    else:
        for i in range(len(SOURCE)):
            s = slice(starts[i], starts[i + 1])
            dec.append(forward(model, batch.kind, ids[:, s], pos[:, s], takes=takes))
        out = torch.cat(dec, 1).view(ROWS, LENGTH, -1)
    weighted_loss(out).backward()
    return out.detach(), grads(model)


def packed(fn, model, batch: Batch, block, takes) -> tuple[torch.Tensor, dict]:
    with block:
        out = forward(
            fn,
            batch.kind,
            batch.ids,
            batch.pos,
            getattr(batch, "tgt", None),
            getattr(batch, "tgt_pos", None),
            takes=takes,
        )
    weighted_loss(out).backward()
    return out.detach(), grads(model)


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".replace("\n", " ")
    return text[:300]


def _verdict(run, ref_out: torch.Tensor, tol: float) -> tuple:
    """("ok" | "FAIL", max err of the output vs each document alone) or ("ERR", message)."""
    try:
        with torch.no_grad():
            out = run()
        err = max_err(out, ref_out)
        return ("ok" if err <= tol else "FAIL", err)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return ("ERR", _short(_own_error(exc)))


def _own_error(exc: BaseException) -> BaseException:
    """usp_graph's ValueError behind what torch.compile (or a compiled function the model calls,
    transformers' flex_attention) raised, else `exc` itself."""
    seen, todo = set(), [exc]
    while todo:
        e = todo.pop(0)
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ValueError):
            return e
        todo += [getattr(e, "inner_exception", None), e.__cause__, e.__context__]
    return exc


def _both_paths(model, batch: Batch, takes, ref_out: torch.Tensor, tol: float) -> dict:
    """The forward under packed documents, compiled (``documents``) and eager (``attention_mode``)."""
    torch._dynamo.reset()
    args = (batch.ids, batch.pos, getattr(batch, "tgt", None), getattr(batch, "tgt_pos", None))
    fn = torch.compile(model, backend="usp", options={"inner": "aot_eager"})
    out = {}
    for path, call, block in (("compiled", fn, batch.documents), ("eager", model, batch.attention_mode)):

        def run(call=call, block=block):
            with block():
                return forward(call, batch.kind, *args, takes=takes)

        out[path] = _verdict(run, ref_out, tol)
    torch._dynamo.reset()
    return out


def without_sdpa(name: str, impl: str, batch: Batch, ref_out: torch.Tensor, tol: float) -> dict | None:
    """Family `name` built with attention computed without SDPA (``attn_implementation=impl``),
    under packed documents on both paths; None where the family has no such implementation."""
    try:
        model = make_sweep_model(name)
        model.set_attn_implementation(impl)
    except Exception:  # noqa: BLE001 - the family does not offer `impl`
        return None
    if model.config._attn_implementation != impl:  # kept its own (Falcon warns and stays on SDPA)
        return None
    if impl == "flex_attention":
        # transformers compiles flex_attention with inductor, whose CPU kernel has no fp64
        model, tol = model.float(), max(tol, 1e-5)
    model.train()
    return _both_paths(model, batch, lambda n, m=model: _takes(m, n), ref_out, tol)


def without_position_ids(model, batch: Batch, ref_out: torch.Tensor, tol: float) -> dict:
    """The family called without position ids (its own positions) under packed documents."""
    takes = lambda n, m=model: _takes(m, n) and not n.endswith("position_ids")  # noqa: E731
    return _both_paths(model, batch, takes, ref_out, tol)


# The front doors of the ``--doors usp`` table: column -> (attention implementation, how the model
# runs, where the documents come from). "compile" is plain ``torch.compile`` (Dynamo with
# aot_eager: the doors decide while Dynamo traces; inductor only changes the kernels); "backend"
# is backend usp. Documents: "pos" packed position ids (``DataCollatorWithFlattening``'s default,
# the Trainer/TRL padding-free path), "flash" flash-attention's ``cu_seq_lens_q/k`` next to them
# (its ``return_flash_attn_kwargs=True``), "documents" a ``documents(meta)`` block.
DOORS = {
    "usp eager pos": ("usp", "eager", "pos"),
    "usp eager flash": ("usp", "eager", "flash"),
    "usp eager documents": ("usp", "eager", "documents"),
    "usp compile pos": ("usp", "compile", "pos"),
    "usp compile flash": ("usp", "compile", "flash"),
    "usp backend pos": ("usp", "backend", "pos"),
    "usp backend flash": ("usp", "backend", "flash"),
    "usp backend documents": ("usp", "backend", "documents"),
    "sdpa backend pos": ("sdpa", "backend", "pos"),
}


def _takes_kwargs(model) -> bool:
    return any(p.kind is p.VAR_KEYWORD for p in inspect.signature(model.forward).parameters.values())


def door_cell(name: str, door: str, batch: Batch, ref_out: torch.Tensor, ref: dict, tol: float):
    """One cell of the doors table: family `name` through `door` (`DOORS`) on the packed batch,
    output and every parameter grad against each document alone; None where the door does not
    apply (the forward takes no position ids, or no flash-attention kwargs)."""
    impl, how, given = DOORS[door]
    torch._dynamo.reset()
    try:
        model = make_sweep_model(name)
        model.set_attn_implementation(impl)
    except ValueError as exc:  # "usp" refused at construction (a model computing attention itself)
        return ("ERR", _short(exc))
    model.train()
    takes = lambda n, m=model: _takes(m, n)  # noqa: E731
    if given != "documents" and not takes("position_ids"):
        return None  # no documents reach the model without a block
    extra = None
    if given == "flash":
        if not _takes_kwargs(model):
            return None
        cu = batch.meta.cu_seqlens[: len(SOURCE) + 1]
        extra = {
            "cu_seq_lens_q": cu,
            "cu_seq_lens_k": cu,
            "max_length_q": max(SOURCE),
            "max_length_k": max(SOURCE),
        }
    if how == "eager":
        fn = model
    elif how == "compile":
        fn = torch.compile(model, backend="aot_eager")
    else:
        fn = torch.compile(model, backend="usp", options={"inner": "aot_eager"})
    block = batch.documents() if given == "documents" else contextlib.nullcontext()
    args = (batch.ids, batch.pos, getattr(batch, "tgt", None), getattr(batch, "tgt_pos", None))
    try:
        with block:
            out = forward(fn, batch.kind, *args, takes=takes, extra=extra)
        weighted_loss(out).backward()
        err = max(max_err(out.detach(), ref_out), max_err(grads(model), ref))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        return ("ERR", _short(_own_error(exc)))
    finally:
        torch._dynamo.reset()
    if err > tol and impl == "sdpa" and given != "documents":
        # No block: backend usp keeps the model's own semantics. A model whose mask ignores the
        # position ids attends the whole row with or without usp (no documents were said).
        with torch.no_grad():
            own = forward(model, batch.kind, *args, takes=takes)
        if max_err(out.detach(), own) <= tol:
            return ("MODEL", err)
    return ("ok" if err <= tol else "FAIL", err)


def sweep_doors(name: str, doors: list[str]) -> dict:
    """The doors table's row of family `name`."""
    spec = SWEEP_SPECS[name]
    row: dict = {"family": name, "kind": spec.kind, "tol": spec.tol}
    try:
        model = make_sweep_model(name)
        model.train()
        batch = Batch(spec.kind, seed=2)
        ref_out, ref = alone(model, batch, lambda n, m=model: _takes(m, n))
    except Exception as exc:  # noqa: BLE001 - reported in the table
        row["build"] = _short(exc)
        return row
    row["doors"] = {door: door_cell(name, door, batch, ref_out, ref, spec.tol) for door in doors}
    return row


def doors_table(rows: list[dict], doors: list[str]) -> str:
    """The ``--doors usp`` table: ok / FAIL max err / refused / ERR / - (the door gets no documents
    from this family's forward) / model's own ("sdpa" without a block: the result of the plain
    model, whose mask ignores the position ids); each refusal's and crash's message follows."""
    lines = ["| family | kind | " + " | ".join(doors) + " |", "| --- " * (len(doors) + 2) + "|"]
    notes = []
    for r in rows:
        if "build" in r:
            lines.append(f"| {r['family']} | {r['kind']} |" + " ERR |" * len(doors))
            notes.append(f"{r['family']}: build: {r['build']}")
            continue
        cells = [r["doors"].get(d) for d in doors]
        lines.append(
            f"| {r['family']} | {r['kind']} | " + " | ".join(_door_cell_text(c) for c in cells) + " |"
        )
        for door, cell in zip(doors, cells, strict=True):
            if cell is not None and cell[0] == "MODEL":
                notes.append(
                    f"{r['family']}: {door}: the plain model's own result (it attends the whole row)"
                )
            elif cell is not None and cell[0] != "ok":
                notes.append(
                    f"{r['family']}: {door}: {cell[1] if cell[0] == 'ERR' else f'max err {cell[1]:.1e}'}"
                )
    return "\n".join(lines + [""] + notes)


def _door_cell_text(value) -> str:
    if value is None:
        return "-"
    if value[0] == "MODEL":
        return "model's own"
    cell = _cell(value)
    return "ok" if cell.startswith("ok") else cell


def dumps_written(root: str) -> tuple:
    """("ok", graph files written) when every graph of a compile dump wrote its graph files
    (joint, forward and backward of a trained graph), else ("FAIL", what is missing)."""
    written, missing = 0, []
    for graph_dir in sorted((p for p in os.scandir(root) if p.is_dir()), key=lambda p: p.name):
        summary = os.path.join(graph_dir.path, "summary.json")
        if not os.path.exists(summary):
            missing.append(f"{graph_dir.name}: no summary.json")
            continue
        with open(summary) as f:
            manifest = json.load(f)
        files = manifest.get("graph_files", {})
        for what, error in manifest.get("failed", {}).items():
            missing.append(f"{graph_dir.name}: {what}: {error}")
        for graph, entry in files.items():
            if entry.get("error") is not None:
                missing.append(f"{graph_dir.name}: {graph}: {entry['error']}")
            elif not os.path.exists(os.path.join(graph_dir.path, entry.get("file", f"{graph}.uspg"))):
                missing.append(f"{graph_dir.name}: {graph}: file absent")
            else:
                written += 1
        trained = "joint" in manifest.get("graphs", {})
        for graph in ("joint", "forward", "backward") if trained else ():
            if graph not in files:
                missing.append(f"{graph_dir.name}: no {graph} graph file")
    if not written:
        missing.append("no graph file")
    return ("FAIL", "; ".join(missing)) if missing else ("ok", written)


def sweep_one(name: str) -> dict:
    """Run the three checks on family `name`; a dict of results."""
    spec = SWEEP_SPECS[name]
    row: dict = {"family": name, "kind": spec.kind, "tol": spec.tol}
    torch._dynamo.reset()
    try:
        model = make_sweep_model(name)
    except Exception as exc:  # noqa: BLE001 - reported in the table
        row["build"] = _short(exc)
        return row
    model.train()
    takes = lambda n, m=model: _takes(m, n)  # noqa: E731 - the compiled wrapper hides the signature
    row["position_ids"] = takes("position_ids")
    batch = Batch(spec.kind, seed=2)
    try:
        ref_out, ref = alone(model, batch, takes)
    except Exception as exc:  # noqa: BLE001
        row["build"] = "the plain model (each document alone): " + _short(exc)
        return row

    row["eager_flex"] = [
        without_sdpa(name, impl, batch, ref_out, spec.tol) for impl in ("eager", "flex_attention")
    ]
    row["no_pos"] = without_position_ids(model, batch, ref_out, spec.tol) if takes("position_ids") else None
    reports: list = []
    dump_dir = tempfile.mkdtemp(prefix=f"usp_sweep_{name}_")
    options = {"inner": "aot_eager", "on_compile": reports.append, "dump_dir": dump_dir}
    fn = torch.compile(model, backend="usp", options=options)
    try:
        out, got = packed(fn, model, batch, batch.documents(), takes)
        err = max(max_err(out, ref_out), max_err(got, ref))
        row["packed"] = ("ok" if err <= spec.tol else "FAIL", err)
        row["sites"] = sum(len(r.rewritten) for r in reports)
        row["kept"] = [k for r in reports for k in r.kept]
        row["dumps"] = dumps_written(dump_dir)
    except Exception as exc:  # noqa: BLE001
        row["packed"] = ("ERR", _short(exc))
        row["trace"] = traceback.format_exc()
        return row
    try:
        eager_out, eager = packed(model, model, batch, batch.attention_mode(), takes)
        same = torch.equal(out, eager_out) and eager.keys() == got.keys()
        same = same and all(torch.equal(got[n], eager[n]) for n in eager)
        row["bitwise"] = ("ok" if same else "FAIL", 0.0 if same else max_err(got, eager))
    except Exception as exc:  # noqa: BLE001
        row["bitwise"] = ("ERR", _short(exc))
    if not model.supports_gradient_checkpointing:
        row["ckpt_why"] = f"{type(model).__name__} does not support gradient checkpointing"
        return row
    try:
        torch._dynamo.reset()
        checkpoint_layers(model)
        model.train()
        ck_reports: list = []
        fn = torch.compile(
            model, backend="usp", options={"inner": "aot_eager", "on_compile": ck_reports.append}
        )
        out, got = packed(fn, model, batch, batch.documents(), takes)
        err = max(max_err(out, ref_out), max_err(got, ref))
        sites = sum(len(r.rewritten) for r in ck_reports)
        kept = [k for r in ck_reports for k in r.kept]
        ok = err <= spec.tol and sites == row["sites"] and not kept
        row["ckpt"] = ("ok" if ok else "FAIL", err)
        if not ok:
            row["ckpt_why"] = f"err {err:.1e}, rewrote {sites} of {row['sites']} sites, kept {kept}"
    except Exception as exc:  # noqa: BLE001
        row["ckpt"] = ("ERR", _short(exc))
    return row


# Dynamo's setting that compiles transformers >= 5.25's checkpointed layers whole (the docstring's
# ckpt), where this torch has it.
CHECKPOINT_SETTING = (
    {"skip_fwd_side_effects_in_bwd_under_checkpoint": True}
    if hasattr(torch._dynamo.config, "skip_fwd_side_effects_in_bwd_under_checkpoint")
    else {}
)


def cp_rank(rank: int, world: int, names: list[str], strategy: str) -> dict:
    """One rank of ``--cp``: each family's rows sharded over the ranks (documents cross the shard
    boundary), eager ``attention_mode(meta, cp=cp)`` and compiled with option ``cp`` under
    ``documents(meta)``, against every document run alone in one process: this rank's output
    shard and every parameter grad (summed over the ranks); "ckpt": compiled again with gradient
    checkpointing. {family: {"eager"|"compiled"|"ckpt": cell}}."""
    from usp_graph import ContextParallel

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    for key, value in CHECKPOINT_SETTING.items():  # this rank's own process
        setattr(torch._dynamo.config, key, value)
    cp = ContextParallel(strategy)
    rows: dict = {}
    for name in names:
        spec = SWEEP_SPECS[name]
        torch._dynamo.reset()
        try:
            model = make_sweep_model(name)
            model.train()
            takes = lambda n, m=model: _takes(m, n)  # noqa: E731
            batch = Batch(spec.kind, seed=2)
            ref_out, ref = alone(model, batch, takes)
        except Exception as exc:  # noqa: BLE001 - reported in the table
            rows[name] = {"build": _short(exc)}
            continue
        weight = torch.randn(ref_out.shape, generator=torch.Generator().manual_seed(123), dtype=ref_out.dtype)
        cells = {}
        for how in ("eager", "compiled", "ckpt"):
            model.zero_grad(set_to_none=True)
            if how == "ckpt":  # compiled again, with transformers' gradient checkpointing
                if not model.supports_gradient_checkpointing:
                    continue
                torch._dynamo.reset()
                checkpoint_layers(model)
                model.train()
            if how == "eager":
                fn, block = model, usp_graph.attention_mode(batch.meta, cp=cp)
            else:
                options = {"inner": "aot_eager", "cp": cp}
                fn, block = (
                    torch.compile(model, backend="usp", options=options),
                    usp_graph.documents(batch.meta),
                )
            try:
                with block:
                    out = forward(fn, spec.kind, cp.shard(batch.ids, 1), cp.shard(batch.pos, 1), takes=takes)
                (out * cp.shard(weight, 1)).sum().backward()
                cp.reduce_grads(model.parameters())
                err = max(max_err(out.detach(), cp.shard(ref_out, 1)), max_err(grads(model), ref))
                cells[how] = ("ok" if err <= spec.tol else "FAIL", err)
            except Exception as exc:  # noqa: BLE001
                # torch.compile wraps the backend's own error (BackendCompilerFailed)
                cause = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
                cells[how] = ("ERR", _short(cause))
        rows[name] = cells
    return rows


def cp_table(strategy: str, ranks: list[dict]) -> str:
    """The ``--cp`` table: a cell per family and path, the worse of the two ranks."""
    lines = [
        f"| family | eager CP ({strategy}, 2 ranks) | compiled CP | compiled CP + ckpt |",
        "| --- | --- | --- | --- |",
    ]
    notes = []
    for name in ranks[0]:
        rows = [r[name] for r in ranks]
        if any("build" in r for r in rows):
            lines.append(f"| {name} | ERR | ERR | ERR |")
            notes.append(f"{name}: build: {rows[0].get('build')}")
            continue
        cells = []
        for how in ("eager", "compiled", "ckpt"):
            values = [r[how] for r in rows if how in r]
            if not values:
                cells.append("-")
                continue
            bad = [v for v in values if v[0] != "ok"]
            worst = bad[0] if bad else max(values, key=lambda v: v[1])
            cells.append(_cell(worst))
            if worst[0] == "ERR":
                notes.append(f"{name}: {how}: {worst[1]}")
        lines.append(f"| {name} | {' | '.join(cells)} |")
    return "\n".join(lines + [""] + sorted(set(notes)))


def _cell(value) -> str:
    if value is None:
        return "-"
    status, detail = value
    if status == "ERR":
        # usp_graph's own refusals are ValueErrors that say why; anything else is a crash
        return "refused" if detail.startswith(("ValueError:", "UnsupportedAttention:")) else "ERR"
    return f"{status} {detail:.1e}"


def _short_cell(value) -> str:
    """A cell of the new columns: refused / ok / FAIL err / ERR."""
    if value is None:
        return "-"
    cell = _cell(value)
    return "ok" if cell.startswith("ok") else cell


def _paths_cell(paths: dict | None, *, missing: str = "-") -> str:
    """Compiled's verdict, and eager's beside it when its class differs."""
    if paths is None:
        return missing
    compiled, eager = _short_cell(paths.get("compiled")), _short_cell(paths.get("eager"))
    same = compiled.split()[0] == eager.split()[0]
    return compiled if same else f"{compiled} (eager: {eager})"


def _paths_notes(family: str, column: str, paths: dict | None) -> list[str]:
    notes = []
    for path, value in (paths or {}).items():
        if value is not None and (value[0] == "FAIL" or (value[0] == "ERR" and _cell(value) == "ERR")):
            notes.append(f"{family}: {column} ({path}): {value[1]}")
    return notes


def table(rows: list[dict]) -> str:
    head = (
        "| family | kind | packed (max err) | bitwise | ckpt (max err) | sites | tol "
        "| eager / flex attention | no position_ids | dumps |"
    )
    lines = [head, "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    notes = []
    for r in rows:
        if "build" in r:
            lines.append(f"| {r['family']} | {r['kind']} | ERR | - | - | - | - | - | - | - |")
            notes.append(f"{r['family']}: build: {r['build']}")
            continue
        bit = r.get("bitwise")
        bit_cell = "-" if bit is None else ("ok" if bit[0] == "ok" else bit[0])
        impls = r.get("eager_flex") or [None, None]
        impl_cell = " / ".join(_paths_cell(p, missing="n/a") for p in impls)
        dumps = r.get("dumps")
        dump_cell = "-" if dumps is None else dumps[0]
        lines.append(
            f"| {r['family']} | {r['kind']} | {_cell(r.get('packed'))} | {bit_cell} | {_cell(r.get('ckpt'))} "
            f"| {r.get('sites', '-')} | {r['tol']:.0e} | {impl_cell} | {_paths_cell(r.get('no_pos'))} | {dump_cell} |"
        )
        for key in ("packed", "bitwise", "ckpt"):
            v = r.get(key)
            if v is not None and v[0] == "ERR":
                notes.append(f"{r['family']}: {key}: {v[1]}")
        for impl, paths in zip(("eager", "flex_attention"), impls, strict=True):
            notes += _paths_notes(r["family"], f'attn_implementation="{impl}"', paths)
        notes += _paths_notes(r["family"], "no position_ids", r.get("no_pos"))
        if dumps is not None and dumps[0] != "ok":
            notes.append(f"{r['family']}: dumps: {dumps[1]}")
        if r.get("ckpt_why"):
            notes.append(f"{r['family']}: ckpt: {r['ckpt_why']}")
        if r.get("kept"):
            notes.append(f"{r['family']}: kept as SDPA: {r['kept']}")
        if not r.get("position_ids", True):
            notes.append(f"{r['family']}: forward takes no position_ids")
    return "\n".join(lines + [""] + notes)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--families", default=None, help="comma-separated names (default: all)")
    parser.add_argument("--trace", action="store_true", help="print the traceback of each exception")
    parser.add_argument(
        "--cp", default=None, metavar="STRATEGY",
        help="instead: context parallelism over 2 gloo ranks with this strategy (decoders and encoders)",
    )  # fmt: skip
    parser.add_argument(
        "--doors", default="classic,usp",
        help='comma-separated: "classic" (the table of backend usp under documents and its checks), "usp" '
        '(every door of the doors table), or doors of it by name (dashes for spaces: usp-compile-pos)',
    )  # fmt: skip
    args = parser.parse_args(argv)
    wanted = [d.strip().replace("-", " ") for d in args.doors.split(",") if d.strip()]
    doors = [d for d in DOORS if "usp" in wanted or d in wanted]
    bad = [d for d in wanted if d not in ("classic", "usp") and d not in DOORS]
    if bad:
        parser.error(
            f"--doors {bad}: each one of classic, usp, {', '.join(d.replace(' ', '-') for d in DOORS)}"
        )
    names = args.families.split(",") if args.families else list(SWEEP_SPECS)
    unknown = [n for n in names if n not in SWEEP_SPECS]
    if unknown:
        parser.error(f"unknown families {unknown}; one of {sorted(SWEEP_SPECS)}")
    if args.cp is not None:
        from usp_graph.cp import STRATEGIES
        from usp_graph.launch import run_ranks

        if args.cp not in STRATEGIES:
            parser.error(f"--cp {args.cp!r}: one of {sorted(STRATEGIES)}")
        names = [n for n in names if SWEEP_SPECS[n].kind != "seq2seq"]
        from tools import sweep_models  # ranks unpickle the function by this module's name, not __main__

        ranks = run_ranks(sweep_models.cp_rank, 2, names, args.cp, timeout=3600)
        print(cp_table(args.cp, ranks))
        return 0
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore")
    import transformers

    transformers.logging.set_verbosity_error()
    rows, door_rows = [], []
    with torch._dynamo.config.patch(recompile_limit=64, cache_size_limit=64, **CHECKPOINT_SETTING):
        for name in names:
            if doors:
                t0 = time.perf_counter()
                with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
                    door_rows.append(sweep_doors(name, doors))
                cells = door_rows[-1].get("doors", {})
                print(f"{name} doors: {[_door_cell_text(c) for c in cells.values()]} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)  # fmt: skip
            if "classic" not in wanted:
                continue
            t0 = time.perf_counter()
            with contextlib.redirect_stderr(open(os.devnull, "w")):  # noqa: SIM115
                row = sweep_one(name)
            row["seconds"] = time.perf_counter() - t0
            rows.append(row)
            print(
                f"{name}: {row.get('packed')} {row.get('bitwise')} {row.get('ckpt')} {row.get('dumps')} "
                f"{[_paths_cell(p, missing='n/a') for p in row.get('eager_flex') or ()]} "
                f"{_paths_cell(row.get('no_pos'))} ({row['seconds']:.1f} s)",
                flush=True,
            )
            if args.trace and row.get("trace"):
                print(row["trace"])
    if rows:
        print()
        print(table(rows))
    if door_rows:
        print()
        print(doors_table(door_rows, doors))
    return 0


if __name__ == "__main__":
    sys.exit(main())
