"""The recipe's checkpoints and bad input (issue 31): a checkpoint is read without pickle (a crafted
one runs nothing), saves are atomic (an interrupted save leaves the previous checkpoint loadable),
a resume never relabels weights, and every bad flag or file is a one-line error with exit status 2
before any step runs. Most checks call the recipe in-process; two subprocesses check the exit code.
"""

from __future__ import annotations

import json
import math
import os
import pickle
import subprocess
import sys

import pytest
import torch

from usp_graph import train_checkpoint as tc
from usp_graph.train import UsageError, _Data, build_parser, check_args, main


def _args(*argv: str):
    return build_parser().parse_args(list(argv))


class _RunsCommand:
    """Unpickling this runs a shell command that creates `marker` (what a hostile .metadata does)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _state(scale: float = 1.0):
    """A small full state dict pair in the shape `get_state_dict(..., full_state_dict=True)` gives."""
    w, b = torch.arange(6, dtype=torch.float32).reshape(2, 3) * scale, torch.ones(2, dtype=torch.float64)
    msd = {"lin.weight": w, "lin.bias": b}
    osd = {
        "state": {"lin.weight": {"step": torch.tensor(3.0), "exp_avg": w * 0.5, "exp_avg_sq": w * w}},
        "param_groups": [
            {"lr": 1e-3, "betas": (0.9, 0.999), "foreach": None, "params": ["lin.weight", "lin.bias"]}
        ],
    }
    return msd, osd


EXPECT = {"lin.weight": (torch.float32, (2, 3)), "lin.bias": (torch.float64, (2,))}


GROUPS = _state()[1]["param_groups"]
STATE_KEYS = {"step": "step", "exp_avg": "param", "exp_avg_sq": "param_nonnegative"}


def _read(path: str, expect=EXPECT, groups=GROUPS):
    return tc.read_state(tc.read_index(path), expect, groups=groups, state_keys=STATE_KEYS)


# ---- bad flags and files: one line, exit 2, before anything starts ------------------------------------


@pytest.fixture
def files(tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "file").write_text("x")
    (tmp_path / "empty_model").mkdir()
    for name, config in {
        "gpt2": '{"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2}',  # attn_pdrop: 0.1 by default
        "bert_like": '{"model_type": "llama", "attention_dropout": 0.2, "hidden_size": 32}',
        "broken": '{"model_type": "llama", ',
        "bloom": '{"model_type": "bloom", "n_layer": 1, "hidden_size": 32, "n_head": 2}',
        "t5": '{"model_type": "t5", "d_model": 32}',
    }.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(config)
    (tmp_path / "dir").mkdir()
    return tmp_path


BAD = [
    (["--lr", "nan"], "--lr must be a finite number"),
    (["--lr", "inf"], "--lr must be a finite number"),
    (["--lr", "-1"], "--lr must be a finite number >= 0"),
    (["--mean-doc-len", "nan"], "--mean-doc-len must be a finite number"),
    (["--mean-doc-len", "0.5"], "--mean-doc-len must be a finite number >= 1"),
    (["--cp-strategy", "usp", "--ulysses-degree", "3"], "--ulysses-degree 3 must divide --cp 1"),
    (["--ulysses-degree", "2"], "--ulysses-degree applies to --cp-strategy usp only"),
    (["--seed", "-1"], "--seed must be in"),
    (["--save-every", "-1"], "--save-every must be >= 0"),
    (["--steps", str(2**40 + 1)], "--steps must be in [1, 2**40]"),
    (["--save", ""], "--save needs a path"),
    (["--resume", ""], "--resume needs a path"),
    (["--save", "{t}/file"], "exists and is not a directory"),
    (["--save", "/proc/usp_graph_test/ck"], "cannot write there"),
    (["--save", "{t}/file/sub"], "is not a directory, so"),
    (["--metrics", "{t}/dir"], "a directory; give a file"),
    (["--metrics", "{t}/nowhere/m.jsonl"], "is not a directory"),
    (["--text", "{t}/fifo"], "not a regular file"),
    (["--text", "/dev/zero"], "not a regular file"),
    (["--text", "{t}/dir"], "not a regular file"),
    (["--text", "{t}/missing"], "No such file"),
    (["--model", "{t}/empty_model"], "no config.json there"),
    (["--model", "{t}/file"], "not a directory"),
    (["--model", "{t}/gpt2"], "dropout inside attention (attn_pdrop=0.1)"),
    (["--model", "{t}/bert_like"], "dropout inside attention (attention_dropout=0.2)"),
    (["--model", "{t}/broken"], "transformers cannot read its config.json"),
    (["--model", "{t}/bloom"], "BloomForCausalLM computes attention in its own code"),
    (["--model", "{t}/t5"], "transformers has no causal LM for model_type 't5'"),
    (["--cp-strategy", "halo"], "must be one of allgather_kv, ulysses, ring, usp; got 'halo' (halo needs"),
    (["--cp-strategy", "auto"], "must be one of allgather_kv, ulysses, ring, usp; got 'auto'"),
    (["--cp", "0"], "--cp must be >= 1, got 0"),
    (["--dp", "0"], "--dp must be >= 1, got 0"),
    (["--cp", "3"], "--dp x --cp must multiply to the 1 ranks launched (given: --cp 3)"),
    (["--resume", "{t}/missing"], "no such directory"),
    (["--resume", "{t}/dir"], "no checkpoint there"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[" ".join(a) for a, _ in BAD])
def test_a_bad_flag_or_file_is_one_line_and_exit_2_before_anything_runs(argv, message, files, capsys):
    argv = [a.replace("{t}", str(files)) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1, err


def test_text_larger_than_the_cap_is_refused_without_reading_it(tmp_path, monkeypatch):
    import usp_graph.train as train

    path = tmp_path / "big.txt"
    path.write_bytes(b"ab" * 64)
    monkeypatch.setattr(train, "MAX_TEXT_BYTES", 100)
    with pytest.raises(UsageError, match="over the recipe's 100"):
        check_args(_args("--text", str(path)))
    with pytest.raises(UsageError, match="larger than 100 bytes"):  # the read itself is bounded too
        _Data(_args("--text", str(path)), vocab=256, replicas=1)


def test_text_of_only_one_byte_documents_is_refused(tmp_path):
    path = tmp_path / "ones.txt"
    path.write_text("a\n\nb\n\nc")
    with pytest.raises(UsageError, match="every document is one byte long"):
        _Data(_args("--text", str(path)), vocab=256, replicas=1)


def test_a_metrics_fifo_without_reader_is_an_error_not_a_hang(tmp_path):
    from usp_graph.train import _open_metrics

    os.mkfifo(tmp_path / "fifo")
    with pytest.raises(UsageError, match="a FIFO with no reader"):
        _open_metrics(str(tmp_path / "fifo"))


# ---- checkpoints never run code -----------------------------------------------------------------------


def test_a_pickled_dcp_checkpoint_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    for where in (tmp_path / "ck", tmp_path / "root" / "step_4"):
        where.mkdir(parents=True)
        (where / ".metadata").write_bytes(pickle.dumps(_RunsCommand(str(marker))))
        (where / "__0_0.distcp").write_bytes(b"\0" * 16)
    for ck in ("ck", "root"):
        assert main(["--resume", str(tmp_path / ck), "--steps", "9"]) == 2
        err = capsys.readouterr().err
        assert "its .metadata is a pickle" in err and err.count("\n") == 1, err
    assert not marker.exists()


def test_checkpoint_bytes_are_never_unpickled(tmp_path):
    """A checkpoint whose tensor bytes are a pickle that runs a command loads as numbers."""
    marker = tmp_path / "pwned"
    osd = {"state": {}, "param_groups": [{"lr": 1e-3, "params": ["w"]}]}
    path = tc.save_state(str(tmp_path), 1, {"w": torch.zeros(256, dtype=torch.uint8)}, osd)
    with open(os.path.join(path, tc.DATA), "r+b") as f:
        f.write(pickle.dumps(_RunsCommand(str(marker))).ljust(256, b"."))
    msd, _ = _read(path, {"w": (torch.uint8, (256,))}, [{"lr": 1e-3, "params": ["w"]}])
    assert bytes(msd["w"].tolist()).startswith(b"\x80") and not marker.exists()


# ---- saves are atomic ---------------------------------------------------------------------------------


def _interrupt_after_first_item(monkeypatch, exc=RuntimeError):
    calls = []
    real = tc._write_item

    def write(f, t):
        if calls:
            raise exc("interrupted")
        calls.append(1)
        return real(f, t)

    monkeypatch.setattr(tc, "_write_item", write)


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_an_interrupted_save_leaves_the_previous_checkpoint_loadable(tmp_path, monkeypatch, exc):
    tc.save_state(str(tmp_path), 2, *_state(1.0))
    tc.save_state(str(tmp_path), 4, *_state(2.0))
    _interrupt_after_first_item(monkeypatch, exc)
    for step in (4, 6):  # rewriting step_4 in place, and a new step_6
        with pytest.raises(exc, match="interrupted"):
            tc.save_state(str(tmp_path), step, *_state(3.0))
    assert sorted(os.listdir(tmp_path)) == ["step_2", "step_4"]  # no partial copy left behind
    assert tc.find(str(tmp_path)).endswith("step_4")
    msd, osd = _read(str(tmp_path / "step_4"))
    ref_msd, ref_osd = _state(2.0)
    assert torch.equal(msd["lin.weight"], ref_msd["lin.weight"]) and msd["lin.bias"].dtype == torch.float64
    assert torch.equal(osd["state"]["lin.weight"]["exp_avg_sq"], ref_osd["state"]["lin.weight"]["exp_avg_sq"])
    assert osd["param_groups"][0]["betas"] == (0.9, 0.999)


@pytest.mark.parametrize("swap", [True, False], ids=["renameat2 exchange", "move aside"])
def test_a_save_replaces_a_checkpoint_of_the_same_step_whole(tmp_path, monkeypatch, swap):
    if not swap:
        monkeypatch.setattr(tc, "_exchange", lambda a, b: False)
    tc.save_state(str(tmp_path), 4, *_state(1.0))
    tc.save_state(str(tmp_path), 4, *_state(5.0))
    assert os.listdir(tmp_path) == ["step_4"]
    assert torch.equal(_read(str(tmp_path / "step_4"))[0]["lin.weight"], _state(5.0)[0]["lin.weight"])


# ---- a checkpoint is decoded against a schema, then against the model ---------------------------------


def test_a_truncated_checkpoint_is_one_line_exit_2(tmp_path, capsys):
    path = tc.save_state(str(tmp_path), 1, *_state())
    data = os.path.join(path, tc.DATA)
    os.truncate(data, os.path.getsize(data) - 1)
    assert main(["--resume", str(tmp_path), "--steps", "2"]) == 2
    err = capsys.readouterr().err
    assert "truncated" in err and err.count("\n") == 1, err


def _mutated(tmp_path, mutate) -> str:
    path = tc.save_state(str(tmp_path), 1, *_state())
    with open(os.path.join(path, tc.INDEX)) as f:
        doc = json.load(f)
    mutate(doc)
    with open(os.path.join(path, tc.INDEX), "w") as f:
        f.write(doc if isinstance(doc, str) else json.dumps(doc))
    return path


MALFORMED = {
    "not an index": lambda d: d.clear() or d.update(x=1),
    "bad dtype": lambda d: d["model"]["lin.bias"].update(dtype="object"),
    "negative dim": lambda d: d["model"]["lin.bias"].update(shape=[-2]),
    "bool offset": lambda d: d["model"]["lin.bias"].update(offset=True),
    "huge shape": lambda d: d["model"]["lin.bias"].update(shape=[2**40]),
    "overlap": lambda d: d["model"]["lin.bias"].update(offset=0),
    "step 0": lambda d: d.update(step=0),
    "step float": lambda d: d.update(step=4.0),
    "version": lambda d: d.update(version=2),
    "groups": lambda d: d.update(param_groups=[{"params": "lin.weight"}]),
    "group value": lambda d: d["param_groups"][0].update(lr={"x": 1}),
    "extra key": lambda d: d["model"]["lin.bias"].update(code="os.system"),
    "lr overflow": lambda d: d["param_groups"][0].update(lr=1e999),
    "optim str": lambda d: d["optim"]["lin.weight"].update(step="3"),
}


@pytest.mark.parametrize("name", MALFORMED)
def test_a_malformed_index_is_a_checkpoint_error(tmp_path, name):
    path = _mutated(tmp_path, MALFORMED[name])
    with pytest.raises(tc.CheckpointError, match="--resume"):
        tc.read_index(path)


@pytest.mark.parametrize("name", [tc.INDEX, tc.DATA])
def test_checkpoint_files_that_are_fifos_or_devices_are_refused_without_blocking(tmp_path, name):
    path = tc.save_state(str(tmp_path), 1, *_state())
    os.remove(os.path.join(path, name))
    os.mkfifo(os.path.join(path, name))
    with pytest.raises(tc.CheckpointError, match="not a regular file"):
        tc.read_index(path)
    os.remove(os.path.join(path, name))
    os.symlink("/dev/zero", os.path.join(path, name))
    with pytest.raises(tc.CheckpointError, match="not a regular file"):
        tc.read_index(path)


@pytest.mark.parametrize("text", ['{"step": NaN}', "[" * 100_000, "\xff\xfe", ""])
def test_index_text_that_is_not_json_is_a_checkpoint_error(tmp_path, text):
    path = tc.save_state(str(tmp_path), 1, *_state())
    with open(os.path.join(path, tc.INDEX), "w", encoding="latin-1") as f:
        f.write(text)
    with pytest.raises(tc.CheckpointError, match="not valid JSON|not a usp_graph.train"):
        tc.read_index(path)


@pytest.mark.parametrize(
    ("expect", "message"),
    [
        ({"lin.weight": (torch.float32, (2, 3))}, "not this model's checkpoint"),
        ({**EXPECT, "lin.weight": (torch.float32, (3, 2))}, "has shape"),
        ({**EXPECT, "lin.bias": (torch.float32, (2,))}, "the model's is float32"),
    ],
)
def test_a_checkpoint_of_another_model_is_refused_before_its_bytes_are_read(tmp_path, expect, message):
    path = tc.save_state(str(tmp_path), 1, *_state())
    with pytest.raises(tc.CheckpointError, match=message):
        _read(path, expect)


def _optim_mutated(tmp_path, mutate) -> str:
    msd, osd = _state()
    mutate(osd)
    return tc.save_state(str(tmp_path), 1, msd, osd)


OPTIM_WRONG = {
    "lr a string": (lambda o: o["param_groups"][0].update(lr="0.1"), "optimizer option 'lr'"),
    "betas of 3": (lambda o: o["param_groups"][0].update(betas=(0.9, 0.9, 0.9)), "optimizer option 'betas'"),
    "an option less": (lambda o: o["param_groups"][0].pop("foreach"), "differ from AdamW's"),
    "other params": (lambda o: o["param_groups"][0].update(params=["lin.weight"]), "other parameters"),
    "two groups": (
        lambda o: o["param_groups"].append(dict(o["param_groups"][0])),
        "2 optimizer param groups",
    ),
    "state key missing": (lambda o: o["state"]["lin.weight"].pop("exp_avg"), "optimizer state of lin.weight"),
    "step a vector": (lambda o: o["state"]["lin.weight"].update(step=torch.zeros(2)), "'step' of lin.weight"),
    "exp_avg float64": (
        lambda o: o["state"]["lin.weight"].update(exp_avg=torch.zeros(2, 3, dtype=torch.float64)),
        "'exp_avg' of lin.weight",
    ),
    "state of a stranger": (lambda o: o["state"].update(other={}), "not an optimized parameter"),
}


@pytest.mark.parametrize("name", OPTIM_WRONG)
def test_optimizer_state_unlike_adamws_is_refused_before_any_step(tmp_path, name):
    mutate, message = OPTIM_WRONG[name]
    path = _optim_mutated(tmp_path, mutate)
    with pytest.raises(tc.CheckpointError, match=message):
        _read(path)


def _adamw(step: float = 1.0):
    """A real AdamW's full state after one step (every option torch's AdamW keeps), and its groups."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(0)
    lin = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2)
    lin(torch.ones(1, 3)).sum().backward()
    opt.step()
    msd, osd = get_state_dict(lin, opt, options=StateDictOptions(full_state_dict=True))
    for state in osd["state"].values():
        state["step"] = torch.tensor(step)
    expect = {k: (v.dtype, tuple(v.shape)) for k, v in msd.items()}
    return msd, osd, expect, [dict(g, params=list(g["params"])) for g in osd["param_groups"]]


def _group(**options):
    return lambda o: o["param_groups"][0].update(options)


def _state_of_weight(**entries):
    return lambda o: o["state"]["weight"].update(entries)


# An edited checkpoint's optimizer state: each refused by the reader, in one line, before a step.
EDITED = {
    "amsgrad": (_group(amsgrad=True), "option 'amsgrad' is True; the recipe's AdamW runs with False"),
    "capturable": (
        _group(capturable=True),
        "option 'capturable' is True; the recipe's AdamW runs with False",
    ),
    "maximize": (_group(maximize=True), "option 'maximize' is True"),
    "foreach a string": (_group(foreach="yes"), "option 'foreach' is 'yes'"),
    "a 400-digit lr": (
        _group(lr=10**400),
        "option 'lr' must be a number >= 0, got 1000000000000000000000000000",
    ),
    "a negative lr": (_group(lr=-0.1), "option 'lr' must be a number >= 0, got -0.1"),
    "lr a bool": (_group(lr=True), "option 'lr' must be a number >= 0, got True"),
    "lr a string": (_group(lr="0.1"), "option 'lr' must be a number >= 0"),
    "beta above 1": (
        _group(betas=(0.9, 1.5)),
        "option 'betas' must be two numbers in [0, 1), got [0.9, 1.5]",
    ),
    "beta of 1": (_group(betas=(1.0, 0.999)), "option 'betas' must be two numbers in [0, 1)"),
    "a negative beta": (_group(betas=(-0.1, 0.999)), "option 'betas' must be two numbers in [0, 1)"),
    "three betas": (_group(betas=(0.9, 0.9, 0.9)), "option 'betas' must be two numbers in [0, 1)"),
    "eps 0": (_group(eps=0.0), "option 'eps' must be a number > 0, got 0.0"),
    "a negative eps": (_group(eps=-1e-8), "option 'eps' must be a number > 0"),
    "a negative weight_decay": (_group(weight_decay=-0.01), "option 'weight_decay' must be a number >= 0"),
    "step -1": (_state_of_weight(step=torch.tensor(-1.0)), "optimizer 'step' of weight is -1.0, not a whole"),
    "step 1.5": (_state_of_weight(step=torch.tensor(1.5)), "optimizer 'step' of weight is 1.5, not a whole"),
    "step past the checkpoint's": (_state_of_weight(step=torch.tensor(2.0)), "not a whole number in [0, 1]"),
    "step nan": (_state_of_weight(step=torch.tensor(math.nan)), "optimizer 'step' of weight is nan"),
    "step a number": (_state_of_weight(step=-1), "optimizer 'step' of weight is -1.0, not a whole"),
    "step a 400-digit number": (_state_of_weight(step=10**400), "'step': must be a tensor entry or a finite"),
    "step a string": (_state_of_weight(step="3"), "'step': must be a tensor entry or a finite number"),
    "exp_avg inf": (
        _state_of_weight(exp_avg=torch.full((2, 3), math.inf)),
        "optimizer 'exp_avg' of weight holds values that are not finite",
    ),
    "exp_avg_sq negative": (
        _state_of_weight(exp_avg_sq=torch.full((2, 3), -1.0)),
        "optimizer 'exp_avg_sq' of weight holds negative values",
    ),
}


def _edited_checkpoint(tmp_path, mutate) -> str:
    """A checkpoint written as the recipe writes it, of an edited AdamW state."""
    msd, osd, _, _ = _adamw()
    mutate(osd)
    return tc.save_state(str(tmp_path), 1, msd, osd)


@pytest.mark.parametrize("name", EDITED)
def test_an_edited_optimizer_state_is_refused_by_the_reader_in_one_line(tmp_path, name):
    mutate, message = EDITED[name]
    path = _edited_checkpoint(tmp_path, mutate)
    _, _, expect, groups = _adamw()
    with pytest.raises(tc.CheckpointError) as e:
        tc.read_state(tc.read_index(path), expect, groups=groups, state_keys=STATE_KEYS)
    assert message in str(e.value) and "\n" not in str(e.value), str(e.value)


def test_an_unedited_adamw_state_reads_back_as_saved(tmp_path):
    path = _edited_checkpoint(tmp_path, lambda o: None)
    msd, osd, expect, groups = _adamw()
    got_msd, got_osd = tc.read_state(tc.read_index(path), expect, groups=groups, state_keys=STATE_KEYS)
    assert got_osd["param_groups"] == groups
    assert all(torch.equal(got_msd[k], v) for k, v in msd.items())
    assert all(
        torch.equal(got_osd["state"][p][k], v) for p, st in osd["state"].items() for k, v in st.items()
    )


def test_an_lr_beyond_a_float_in_the_index_text_is_refused(tmp_path):
    path = _edited_checkpoint(tmp_path, _group(lr=12345.0))
    index = os.path.join(path, tc.INDEX)
    with open(index) as f:
        text = f.read()
    with open(index, "w") as f:
        f.write(text.replace("12345.0", "1e999"))
    with pytest.raises(tc.CheckpointError, match=r"option 'lr' must be a number >= 0, got inf"):
        tc.read_index(path)


def test_resume_to_a_step_not_past_the_checkpoint_is_refused(tmp_path, capsys):
    tc.save_state(str(tmp_path / "ck"), 4, *_state())
    for steps in ("2", "4"):
        assert main(["--resume", str(tmp_path / "ck"), "--steps", steps, "--save", str(tmp_path / "ck")]) == 2
        err = capsys.readouterr().err
        assert f"holds step 4; --steps {steps} must be greater" in err and err.count("\n") == 1, err
    assert os.listdir(tmp_path / "ck") == ["step_4"]


def test_save_every_checks_every_step_directory_it_would_write_before_training(tmp_path):
    save = tmp_path / "ck"
    save.mkdir()
    for name in ("step_3", "step_04", "step_12", "notes"):  # none is a directory the run writes
        (save / name).write_text("x")
    argv = ["--save", str(save), "--save-every", "2", "--steps", "7"]
    check_args(_args(*argv))  # it writes step_2, step_4, step_6 and step_7
    (save / "step_4").write_text("x")
    with pytest.raises(UsageError, match=r"step_4 exists and is not a directory \(the run saves there\)"):
        check_args(_args(*argv))
    tc.save_state(str(tmp_path / "from"), 4, *_state())  # resumed after step 4: step_4 is not written
    check_args(_args(*argv, "--resume", str(tmp_path / "from")))


def test_metrics_naming_a_file_the_run_reads_is_refused(tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("some text")
    os.symlink(text, tmp_path / "link.jsonl")
    path = tc.save_state(str(tmp_path / "ck"), 1, *_state())
    for argv in (
        ["--text", str(text), "--metrics", str(text)],
        ["--text", str(text), "--metrics", str(tmp_path / "link.jsonl")],
        ["--resume", str(tmp_path / "ck"), "--metrics", os.path.join(path, tc.INDEX)],
    ):
        with pytest.raises(UsageError, match="which the run reads; give another file"):
            check_args(_args(*argv))
    check_args(_args("--text", str(text), "--metrics", str(tmp_path / "m.jsonl")))
    assert text.read_text() == "some text"


def test_a_resume_takes_the_checkpoints_lr_unless_lr_is_given():
    assert _args().lr is None and _args("--lr", "0.5").lr == 0.5
    assert (
        "--lr" in build_parser().format_help()
        and "the checkpoint's unless given" in build_parser().format_help()
    )


# ---- end to end, one process --------------------------------------------------------------------------


def _metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


@pytest.mark.slow
def test_one_process_resume_is_bitwise_and_labels_the_step_it_trained(tmp_path):
    common = ["--seq-len", "16", "--no-progress", "--dtype", "float64", "--steps", "3"]
    full, again = tmp_path / "full", tmp_path / "again"
    assert (
        main([*common, "--save", str(full), "--save-every", "2", "--metrics", str(tmp_path / "full.jsonl")])
        == 0
    )
    assert main([*common, "--resume", str(full / "step_2"), "--save", str(again),
                 "--metrics", str(tmp_path / "resumed.jsonl")]) == 0  # fmt: skip
    assert sorted(os.listdir(full)) == ["step_2", "step_3"] and os.listdir(again) == ["step_3"]
    assert tc.read_index(str(again / "step_3")).step == 3
    steps_full, resumed = _metrics(tmp_path / "full.jsonl"), _metrics(tmp_path / "resumed.jsonl")
    assert [m["step"] for m in resumed] == [3] and resumed[0]["loss"] == steps_full[2]["loss"]
    assert (full / "step_3" / tc.DATA).read_bytes() == (again / "step_3" / tc.DATA).read_bytes()


@pytest.mark.slow
def test_resume_with_lr_trains_with_that_lr(tmp_path):
    common = ["--seq-len", "16", "--no-progress", "--dtype", "float64"]
    assert main([*common, "--steps", "1", "--save", str(tmp_path / "a"), "--lr", "0.01"]) == 0
    for lr, out in ((None, "kept"), ("0.25", "given")):
        flags = [] if lr is None else ["--lr", lr]
        assert main([*common, "--steps", "2", "--resume", str(tmp_path / "a"), "--save", str(tmp_path / out),
                     *flags]) == 0  # fmt: skip
    kept, given = (tc.read_index(str(tmp_path / d / "step_2")) for d in ("kept", "given"))
    assert kept.param_groups[0]["lr"] == 0.01 and given.param_groups[0]["lr"] == 0.25
    # the step itself ran with it: AdamW's first moves are about lr per element
    start, _ = _read_model(tmp_path / "a" / "step_1")
    for index, lr in ((kept, 0.01), (given, 0.25)):
        end, _ = _read_model(tmp_path / os.path.basename(os.path.dirname(index.path)) / "step_2")
        moved = max((end[k] - start[k]).abs().max().item() for k in start)
        assert 0.5 * lr < moved < 2.5 * lr, (lr, moved)


def _read_model(path):
    index = tc.read_index(str(path))
    expect = {k: (getattr(torch, r.dtype), r.shape) for k, r in index.model.items()}
    groups = [dict(g) for g in index.param_groups]
    keys = {"step": "step", "exp_avg": "param", "exp_avg_sq": "param_nonnegative"}
    return tc.read_state(index, expect, groups=groups, state_keys=keys)


@pytest.mark.slow
def test_an_edited_checkpoint_is_one_line_exit_2_before_any_step(tmp_path, capsys):
    common = ["--seq-len", "16", "--no-progress", "--dtype", "float64"]
    assert main([*common, "--steps", "1", "--save", str(tmp_path / "a")]) == 0
    index = tmp_path / "a" / "step_1" / tc.INDEX
    doc = json.loads(index.read_text())
    doc["param_groups"][0]["amsgrad"] = True
    index.write_text(json.dumps(doc))
    capsys.readouterr()
    metrics = tmp_path / "m.jsonl"
    assert main([*common, "--steps", "2", "--resume", str(tmp_path / "a"), "--metrics", str(metrics)]) == 2
    err = capsys.readouterr().err
    assert "optimizer option 'amsgrad' is True" in err and err.count("\n") == 1, err
    assert not metrics.exists() or metrics.read_text() == ""


GEMMA2_SOFTCAP = {
    "model_type": "gemma2", "vocab_size": 256, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
    "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 16, "attn_logit_softcapping": 50.0,
    "max_position_embeddings": 64,
}  # fmt: skip


@pytest.mark.slow
def test_a_model_usp_refuses_when_attention_runs_is_one_line_exit_2_before_any_step(tmp_path, capsys):
    (tmp_path / "gemma2").mkdir()
    (tmp_path / "gemma2" / "config.json").write_text(json.dumps(GEMMA2_SOFTCAP))
    metrics = tmp_path / "m.jsonl"
    for extra in ([], ["--compile"]):
        argv = ["--model", str(tmp_path / "gemma2"), "--seq-len", "16", "--steps", "1", "--no-progress"]
        assert main([*argv, *extra, "--metrics", str(metrics)]) == 2, extra
        err = capsys.readouterr().err
        assert "logit softcapping (softcap=...) is not supported" in err and err.count("\n") == 1, err
        assert not metrics.exists() or metrics.read_text() == ""


@pytest.mark.slow
def test_a_metrics_write_that_fails_is_one_line_exit_2(capsys):
    assert main(["--seq-len", "8", "--steps", "1", "--no-progress", "--metrics", "/dev/full"]) == 2
    assert "--metrics /dev/full: No space left on device" in capsys.readouterr().err


@pytest.mark.slow
def test_a_step_with_no_target_has_loss_0_not_nan(tmp_path):
    # Stream "abc" (documents a | bc), rows of 2 bytes: "ab" and "ca" hold no pair within a
    # document (loss 0, zero gradients), "bc" does.
    text = tmp_path / "t.txt"
    text.write_text("a\n\nbc")
    metrics = tmp_path / "m.jsonl"
    argv = ["--text", str(text), "--seq-len", "2", "--steps", "3", "--no-progress", "--metrics", str(metrics)]
    assert main(argv) == 0
    losses = [m["loss"] for m in _metrics(metrics)]
    assert losses[:2] == [0.0, 0.0] and math.isfinite(losses[2]) and losses[2] > 0


# ---- the exit status, through the command line --------------------------------------------------------


@pytest.mark.slow
def test_the_command_line_exits_2_with_one_line(tmp_path):
    os.mkfifo(tmp_path / "fifo")
    cmd = [sys.executable, "-m", "usp_graph", "train", "--text", str(tmp_path / "fifo")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)  # open() or read() would hang
    assert done.returncode == 2 and "not a regular file" in done.stderr, done.stderr
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr, done.stderr


def _save_and_load_on_ranks(rank, world_size, tmp):
    """Rank 0 writes, every rank reads; a save that fails on rank 0 fails on every rank."""
    from usp_graph.train import _load, _save

    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.ones(1, 3)).sum().backward()
    opt.step()
    _save(os.path.join(tmp, "ok"), model, opt, 1, torch.device("cpu"))
    if rank == 0:
        os.makedirs(os.path.join(tmp, "bad"))
        open(os.path.join(tmp, "bad", "step_1"), "w").close()  # noqa: SIM115 (a file where step_1 goes)
    torch.distributed.barrier()
    try:
        _save(os.path.join(tmp, "bad"), model, opt, 1, torch.device("cpu"))
        failed = None
    except UsageError as e:
        failed = str(e)
    fresh = torch.nn.Linear(3, 2)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=5.0)
    step = _load(tc.read_index(tc.find(os.path.join(tmp, "ok"))), fresh, fresh_opt)
    same = all(torch.equal(a, b) for a, b in zip(model.parameters(), fresh.parameters(), strict=True))
    moments = fresh_opt.state[fresh.weight]["exp_avg"].equal(opt.state[model.weight]["exp_avg"])
    return {"failed": failed, "step": step, "same": same and moments, "lr": fresh_opt.param_groups[0]["lr"]}


@pytest.mark.slow
def test_rank_0_writes_every_rank_reads_and_a_failed_save_fails_every_rank(tmp_path):
    from tests.dist import run_ranks

    r0, r1 = run_ranks(_save_and_load_on_ranks, 2, str(tmp_path))
    assert "exists and is not a directory" in r0["failed"] and "rank 0 could not write step_1" in r1["failed"]
    assert r0["step"] == r1["step"] == 1 and r0["same"] and r1["same"] and r0["lr"] == r1["lr"] == 1e-2
    assert os.listdir(tmp_path / "ok") == ["step_1"]


class _DirectSDPA(torch.nn.Module):
    """A model whose attention calls SDPA itself, outside transformers' attention interface."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(8, 8)

    def forward(self, input_ids, position_ids, use_cache):
        x = self.emb(input_ids)[:, None]  # (B, 1, L, K)
        return torch.nn.functional.scaled_dot_product_attention(x, x, x, is_causal=True)


@pytest.mark.parametrize("compile_flag", [[], ["--compile"]], ids=["eager", "compile"])
def test_the_probe_passes_a_model_whose_sdpa_compiled_code_rewrites(compile_flag):
    from usp_graph.backend.documents import EagerAttentionError
    from usp_graph.train import _probe

    args = _args(*compile_flag)
    if compile_flag:  # eager documents(...) alone refuses it; the probe then asks attention_mode
        from usp_graph import AttentionMetadata, documents

        meta = AttentionMetadata.from_lengths([3, 2], max_docs=4)
        with pytest.raises(EagerAttentionError), documents(meta):
            _DirectSDPA()(torch.ones(1, 5, dtype=torch.long), None, False)
    _probe(_DirectSDPA(), args, torch.device("cpu"))
