"""`tools/bench_trainer_gpu.py` at CPU size: transformers' own Trainer over the same batches on each
row, every document alone (each row's loss the same), and the batches it draws."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

TOOLS = Path(__file__).resolve().parent.parent / "tools"


@pytest.fixture
def bench(monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(TOOLS))  # the tools import each other by module name
    import bench_trainer_gpu

    return bench_trainer_gpu


def test_batches_hold_their_documents_in_exactly_the_tokens_asked(bench):
    for tokens, docs in ((8192, 8), (256, 8), (9, 9), (100, 1)):
        for seed in range(5):
            lengths = bench.batch_lengths(tokens, docs, seed)
            assert len(lengths) == docs and sum(lengths) == tokens and min(lengths) >= 1, lengths
            assert lengths == bench.batch_lengths(tokens, docs, seed)
    assert len(set(map(tuple, (bench.batch_lengths(8192, 8, s) for s in range(5))))) == 5
    with pytest.raises(ValueError, match="1 <= documents <= tokens"):
        bench.batch_lengths(4, 5, 0)


def test_the_trainer_rows_train_on_the_same_batches_to_the_same_loss(bench, tmp_path):
    out = tmp_path / "trainer.jsonl"
    assert bench.main(["--device", "cpu", "--quick", "--rows", "usp,usp_collator", "--json", str(out)]) == 0
    rows = {r["row"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"usp", "usp_collator"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens"] == 256 and r["documents"] == 8 and len(r["ms_each"]) == 3, r
        assert all(ms > 0 for ms in r["ms_each"]), r
    # documents from the position ids, or from the collator's cu_seq_lens: the same attention
    assert rows["usp"]["loss"] == pytest.approx(rows["usp_collator"]["loss"], rel=1e-6)


def test_python_holders_names_who_holds_a_tensor_and_leaves_out_the_excluded(monkeypatch):
    monkeypatch.syspath_prepend(str(TOOLS))
    import torch
    from mem_peak import python_holders

    class Cache:
        pass

    from torch._subclasses.fake_tensor import FakeTensorMode

    held, known = Cache(), torch.zeros(2**20 + 5)  # sizes no other test's tensors have
    held.logits = {"last": torch.zeros(2**20 + 7)}
    with FakeTensorMode():  # a compile's fake tensor claims a size and holds no memory
        held.fake = torch.zeros(2**20 + 9)
    lines = python_holders(2**22, exclude=[known], device="cpu")
    assert not any(line.startswith("(1048585,)") for line in lines), lines
    ours = lines.index("(1048583,) torch.float32 (0.004 GiB)")
    assert "<- dict ['last']" in lines[ours + 1] and lines[ours + 2].strip().endswith("Cache"), lines
    assert not any(line.startswith("(1048581,)") for line in lines), lines
    again = python_holders(2**22, exclude=[known, held.logits["last"]], device="cpu")
    assert not any(line.startswith("(1048583,)") for line in again), again
