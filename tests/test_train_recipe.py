"""The training recipe (`usp_graph.train`, ``usp-graph train``): its data, its flags, and one run end
to end on 4 CPU ranks under torchrun (2 dp x 2 cp, FSDP2, activation checkpointing, a text file),
saved after step 1 and resumed: the resumed step 2 equals the uninterrupted one bitwise, and step
1's loss equals the single-process loss of the same global batch.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.slow

TEXT = "\n\n".join(
    [
        "Packed documents attend only within themselves.",
        "Context parallelism splits each row over ranks.",
        "FSDP2 shards parameters over the data and context ranks.",
        "A",
        "Activation checkpointing recomputes blocks in backward; the recompute runs the same collectives.",
    ]
)


def _args(*argv: str) -> argparse.Namespace:
    from usp_graph.train import build_parser

    return build_parser().parse_args(list(argv))


def test_synthetic_rows_are_packed_documents_and_a_function_of_step_and_replica():
    from usp_graph.train import _Data

    data = _Data(_args("--seq-len", "64"), vocab=256, replicas=2)
    ids, pos, labels, lengths = data.row(3, 1)
    assert ids.shape == pos.shape == labels.shape == (1, 64) and sum(lengths) == 64 and len(lengths) > 1
    at = 0
    for n in lengths:
        assert pos[0, at : at + n].tolist() == list(range(n))
        assert labels[0, at : at + n - 1].tolist() == ids[0, at + 1 : at + n].tolist()
        assert labels[0, at + n - 1].item() == -100  # nothing is predicted across a document boundary
        at += n
    again = data.row(3, 1)
    assert torch.equal(again[0], ids) and again[3] == lengths
    assert not torch.equal(data.row(3, 0)[0], ids) and not torch.equal(data.row(4, 1)[0], ids)


def test_text_rows_are_bytes_with_documents_at_blank_lines(tmp_path):
    from usp_graph.train import _Data

    path = tmp_path / "corpus.txt"
    path.write_text("ab\n\ncde\n\n\n\nf")
    data = _Data(_args("--seq-len", "4", "--text", str(path)), vocab=256, replicas=1)
    # The stream "abcdef" (documents ab | cde | f), rows of 4 bytes one after another, wrapping.
    ids, pos, labels, lengths = data.row(0, 0)
    assert bytes(ids[0].tolist()) == b"abcd" and lengths == [2, 2] and pos[0].tolist() == [0, 1, 0, 1]
    assert labels[0].tolist() == [ord("b"), -100, ord("d"), -100]
    ids, pos, _, lengths = data.row(1, 0)
    assert bytes(ids[0].tolist()) == b"efab" and lengths == [1, 1, 2] and pos[0].tolist() == [0, 0, 0, 1]


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--steps", "0"], "--steps must be in [1, 2**40]"),
        (["--save-every", "2"], "--save-every needs --save DIR"),
        (["--dp", "2"], "must multiply to the 1 ranks launched"),
        (["--cp-strategy", "zigzag"], "--cp-strategy must be one of"),
    ],
)
def test_bad_flags_exit_2_with_what_to_change(argv, message, capsys):
    from usp_graph.cli import main

    assert main(["train", *argv]) == 2
    assert message in capsys.readouterr().err


def _torchrun(*argv: str, ranks: int = 4) -> subprocess.CompletedProcess:
    run = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(ranks)]
    cmd = [*run, *argv]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)


def _metrics(path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f]


def _one_process_step1_loss(text: str) -> float:
    """Step 1's global loss without any parallelism: both replicas' rows, token mean, one process."""
    import torch.nn.functional as F

    from usp_graph import AttentionMetadata, attention_mode
    from usp_graph.train import _Data, _model

    args = _args("--text", text, "--seq-len", "32", "--dtype", "float64")
    model = _model(args, torch.float64, torch.device("cpu"))
    data = _Data(args, model.config.vocab_size, replicas=2)
    total, count = 0.0, 0
    for replica in range(2):
        ids, pos, labels, lengths = data.row(0, replica)
        with attention_mode(AttentionMetadata.from_lengths(lengths, max_docs=32, max_seqlen=32)):
            logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        total = total + F.cross_entropy(
            logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum"
        )
        count += int((labels != -100).sum())
    return float(total.detach() / count)


def test_recipe_on_4_cpu_ranks_saves_resumes_bitwise_and_matches_one_process(tmp_path):
    text = tmp_path / "corpus.txt"
    text.write_text(TEXT)
    ckpt = tmp_path / "ckpt"
    common = ["--dp", "2", "--cp", "2", "--fsdp", "--checkpoint", "--text", str(text), "--seq-len", "32",
              "--dtype", "float64", "--steps", "2", "--no-progress"]  # fmt: skip
    full = _torchrun("-m", "usp_graph", "train", *common, "--save", str(ckpt), "--save-every", "1",
                     "--metrics", str(tmp_path / "full.jsonl"))  # fmt: skip
    assert full.returncode == 0, full.stdout[-3000:] + full.stderr[-6000:]
    assert "dp 2 x cp 2 (ulysses), FSDP2, checkpoint full" in full.stdout, full.stdout
    assert "tok/s" in full.stdout and "step 2/2" in full.stdout, full.stdout
    assert (ckpt / "step_1" / "checkpoint.json").is_file() and (ckpt / "step_2" / "tensors.bin").is_file()

    resumed = _torchrun("-m", "usp_graph.train", *common, "--resume", str(ckpt / "step_1"),
                        "--metrics", str(tmp_path / "resumed.jsonl"))  # fmt: skip
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    steps_full, steps_resumed = _metrics(tmp_path / "full.jsonl"), _metrics(tmp_path / "resumed.jsonl")
    assert [m["step"] for m in steps_full] == [1, 2] and [m["step"] for m in steps_resumed] == [2]
    assert steps_resumed[0]["loss"] == steps_full[1]["loss"]  # bitwise: JSON floats round-trip exactly
    assert abs(steps_full[0]["loss"] - _one_process_step1_loss(str(text))) <= 1e-10


def test_a_local_model_directory_trains_in_one_process(tmp_path, capsys):
    import transformers

    from usp_graph.cli import main

    config = transformers.LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    config.save_pretrained(tmp_path / "model")
    metrics = tmp_path / "metrics.jsonl"
    argv = ["train", "--model", str(tmp_path / "model"), "--steps", "2", "--seq-len", "16", "--no-progress"]
    assert main([*argv, "--metrics", str(metrics)]) == 0
    out = capsys.readouterr().out
    assert "LlamaForCausalLM" in out and "dp 1 x cp 1" in out, out
    assert [m["step"] for m in _metrics(metrics)] == [1, 2]
    assert all(math.isfinite(m["loss"]) and m["tokens_per_s"] > 0 for m in _metrics(metrics))


def test_compiled_with_checkpointing_trains_as_the_eager_recipe(tmp_path):
    """``train --compile --checkpoint``, in one process and on 2 CP ranks: finite losses equal to the
    eager one-process recipe's (fp64). transformers >= 5.25 breaks Dynamo's graph at each
    checkpointed layer unless the recipe compiles them whole (`train._compiled_checkpoints`): under
    CP their attention would then run outside the backend's collectives."""
    from usp_graph.train import main

    common = ["--seq-len", "16", "--steps", "2", "--dtype", "float64", "--no-progress", "--checkpoint"]
    for name, extra in (("eager", []), ("compiled", ["--compile"])):
        assert main([*common, *extra, "--metrics", str(tmp_path / f"{name}.jsonl")]) == 0, name
    cp = _torchrun("-m", "usp_graph", "train", *common, "--compile", "--cp", "2",
                   "--metrics", str(tmp_path / "cp.jsonl"), ranks=2)  # fmt: skip
    assert cp.returncode == 0, cp.stdout[-3000:] + cp.stderr[-6000:]
    eager = _metrics(tmp_path / "eager.jsonl")
    for name in ("compiled", "cp"):
        got = _metrics(tmp_path / f"{name}.jsonl")
        assert [m["step"] for m in got] == [1, 2], name
        for a, b in zip(eager, got, strict=True):
            close = abs(a["loss"] - b["loss"]) <= 1e-10 * abs(a["loss"])
            assert math.isfinite(b["loss"]) and close, (name, a, b)
