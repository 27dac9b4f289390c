"""torch.compile dump_dir: every graph file writes, and `usp-graph inspect` reads a dump as a whole.

A dump holds one directory per compiled graph: forward.uspg and backward.uspg (the backward's
``usp_fwd_node`` tags name the forward's nodes), joint.uspg, and summary.json (the manifest,
which names any file that could not be written). The CLI runs in-process (`cli.main`).
"""

from __future__ import annotations

import json
import shutil
import time

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import usp_graph.graphfile
from tests.graph_docs import remove_backward_adjoint
from usp_graph import AttentionMetadata, ContextParallel, cli, documents
from usp_graph.graphfile import load_graph_module
from usp_graph.graphfile.values import decode_tensor_data, encode_tensor_data
from usp_graph.models import Llama, LlamaConfig, make_llama_batch

pytestmark = pytest.mark.timeout(120)

AOT_FILES = ("joint.uspg", "forward.uspg", "backward.uspg")


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny models: compiling is single-threaded Python, and idle OpenMP threads slow a 2-core box.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _fresh_dynamo() -> None:
    # Models of one class share code objects: without a reset Dynamo reuses an earlier test's
    # compile and the backend (so the dump) never runs.
    torch._dynamo.reset()


def _graph_dir(dump) -> object:
    (graph_dir,) = [p for p in dump.iterdir() if p.is_dir()]
    return graph_dir


def _inspect(capsys, *args: str) -> tuple[int, str, str]:
    rc = cli.main(list(args))
    out = capsys.readouterr()
    return rc, out.out, out.err


@pytest.fixture(scope="module")
def hf_llama_dump(tmp_path_factory):
    """A transformers Llama (its DynamicCache puts tensor constants in the graphs), compiled with
    a dump_dir, one forward with use_cache=True and one backward."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    dump = tmp_path_factory.mktemp("hf_llama_dump")
    _fresh_dynamo()
    compiled = torch.compile(model, backend="usp", options={"dump_dir": str(dump), "inner": "aot_eager"})
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    compiled(input_ids=ids, labels=ids, use_cache=True).loss.backward()
    _fresh_dynamo()
    return dump


@pytest.fixture(scope="module")
def cp_llama_dump(tmp_path_factory):
    """usp's Llama under Ulysses CP in a one-rank gloo world: real all_to_all collectives in the
    forward file and their adjoints in the backward file."""
    import torch.distributed as dist

    dump = tmp_path_factory.mktemp("cp_llama_dump")
    store = tmp_path_factory.mktemp("pg") / f"store{time.time_ns()}"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    try:
        config = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
        model = Llama(config)
        batch = make_llama_batch(config, [6, 1, 0, 9], generator=torch.Generator().manual_seed(0))
        meta = AttentionMetadata.from_position_ids(batch["position_ids"], max_docs=6)
        _fresh_dynamo()
        options = {"dump_dir": str(dump), "inner": "aot_eager", "cp": ContextParallel("ulysses")}
        compiled = torch.compile(model, backend="usp", options=options)
        with documents(meta):
            compiled(batch["input_ids"], batch["position_ids"]).sum().backward()
    finally:
        _fresh_dynamo()
        dist.destroy_process_group()
    return dump


def test_tensor_data_encodes_while_a_fake_mode_is_active():
    # AOTAutograd calls the dump hooks inside its FakeTensorMode; a real constant must still encode.
    real = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    with FakeTensorMode():
        data = encode_tensor_data(real)
    assert torch.equal(decode_tensor_data(data, "t"), real)


def test_a_fake_tensor_without_real_data_is_refused_by_name():
    with FakeTensorMode() as mode:
        fake = mode.from_tensor(torch.zeros(2))  # not a constant: no real data behind it
        with pytest.raises(ValueError, match=r"a fake tensor \(float32\[2\]\) has no data to save"):
            encode_tensor_data(fake)


def test_every_file_of_a_transformers_llama_dump_writes_and_loads(hf_llama_dump):
    graph_dir = _graph_dir(hf_llama_dump)
    manifest = json.loads((graph_dir / "summary.json").read_text())
    assert manifest["failed"] == {}
    assert {k: v["error"] for k, v in manifest["graph_files"].items()} == {
        "joint": None,
        "forward": None,
        "backward": None,
    }
    constants = 0
    for name in AOT_FILES:
        g = load_graph_module(graph_dir / name)
        constants += len(g.graph_module.graph.find_nodes(op="get_attr"))
    assert constants > 0  # the cache's tensor constants, the reason these files failed to write


def test_inspect_pairs_forward_sites_with_the_backward_file_and_reports_capacity(hf_llama_dump, capsys):
    rc, out, err = _inspect(capsys, "inspect", str(hf_llama_dump), "--json")
    assert rc == 0, err
    by_file = json.loads(out)
    forward = next(s for f, s in by_file.items() if f.endswith("forward.uspg"))
    backward_file = forward["compile_dump"]["backward_file"]
    assert backward_file.endswith("backward.uspg")
    assert forward["unpaired"] == [] and forward["pairing_checked"]
    assert [p["forward"] for p in forward["pairing"]] == ["varlen_fwd", "varlen_fwd_1"]
    backward = load_graph_module(backward_file).graph_module
    targets = {n.name: str(n.target) for n in backward.graph.nodes}
    for p in forward["pairing"]:
        (b,) = p["backward"]
        assert targets[b] == "usp.varlen_bwd.default", (p, targets.get(b))
    # capacity is dynamic in a compiled graph (cu_seqlens' length N1 is a symbol); the example had
    # one document per batch row: 1 row
    assert forward["metadata"]["capacity"] == "N1 - 1"
    assert forward["metadata"]["capacity_hint"] == 1

    rc, out, err = _inspect(capsys, "inspect", str(hf_llama_dump))
    assert rc == 0, err
    assert "MISSING" not in out
    assert "capacity N1 - 1 documents" in out and "1 in the example it was compiled with" in out


def test_inspect_of_a_lone_forward_file_does_not_report_its_backward_missing(hf_llama_dump, tmp_path, capsys):
    alone = tmp_path / "forward.uspg"
    shutil.copy(_graph_dir(hf_llama_dump) / "forward.uspg", alone)
    rc, out, err = _inspect(capsys, "inspect", str(alone), "--json")
    assert rc == 0, err
    s = json.loads(out)
    assert s["unpaired"] == [] and s["pairing"] == [] and not s["pairing_checked"]


def test_a_kept_sdpa_shows_in_inspect_with_its_reason_from_the_manifest(tmp_path, capsys):
    # GPT-2 trains with attention dropout: the SDPA is kept (and decomposes in AOTAutograd's graphs,
    # leaving no SDPA op to find), so the dump's manifest is what says it was there and why.
    transformers = pytest.importorskip("transformers")
    config = transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=64, n_positions=32, attn_implementation="sdpa"
    )
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config)
    ids = torch.randint(0, 64, (1, 12), generator=torch.Generator().manual_seed(0))
    _fresh_dynamo()
    try:
        compiled = torch.compile(
            model, backend="usp", options={"dump_dir": str(tmp_path), "inner": "aot_eager"}
        )
        with pytest.warns(UserWarning, match="keeps 1 SDPA call"):
            compiled(input_ids=ids, labels=ids).loss.backward()
    finally:
        _fresh_dynamo()
    for manifest in tmp_path.rglob("summary.json"):
        assert json.loads(manifest.read_text())["failed"] == {}, manifest
    rc, out, err = _inspect(capsys, "inspect", str(tmp_path), "--json")
    assert rc == 0, err
    kept = [
        a
        for f, s in json.loads(out).items()
        if f.endswith("forward.uspg")
        for a in s["attention"]
        if not a["rewritten"]
    ]
    assert len(kept) == 1 and "dropout" in kept[0]["reason"], kept


def test_a_file_that_failed_to_write_makes_inspect_and_verify_exit_1_naming_it(tmp_path, monkeypatch, capsys):
    real_save = usp_graph.graphfile.save_graph_module

    def save(gm, path, **kwargs):
        if str(path).endswith("forward.uspg"):
            raise OSError("disk full (simulated)")
        return real_save(gm, path, **kwargs)

    monkeypatch.setattr(usp_graph.graphfile, "save_graph_module", save)
    config = LlamaConfig(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)
    model = Llama(config)
    batch = make_llama_batch(config, [6, 1, 0, 9], generator=torch.Generator().manual_seed(0))
    _fresh_dynamo()
    try:
        compiled = torch.compile(
            model, backend="usp", options={"dump_dir": str(tmp_path), "inner": "aot_eager"}
        )
        with pytest.warns(UserWarning, match=r"could not write .*forward\.uspg: OSError: disk full"):
            compiled(batch["input_ids"], batch["position_ids"]).sum().backward()  # the compile goes on
    finally:
        _fresh_dynamo()
    graph_dir = _graph_dir(tmp_path)
    manifest = json.loads((graph_dir / "summary.json").read_text())
    assert manifest["failed"] == {"forward.uspg": "OSError: disk full (simulated)"}
    assert (graph_dir / "backward.uspg").is_file() and not (graph_dir / "forward.uspg").exists()

    rc, out, err = _inspect(capsys, "inspect", str(tmp_path))
    assert rc == 1
    assert f"could not write {graph_dir / 'forward.uspg'}: OSError: disk full (simulated)" in err
    assert "FAILED" in out
    rc, out, err = _inspect(capsys, "verify", str(tmp_path))
    assert rc == 1 and f"{graph_dir / 'forward.uspg'}: FAILED" in out


def test_a_dump_dir_verifies_with_collectives_paired_across_its_files(cp_llama_dump, capsys):
    rc, out, err = _inspect(capsys, "verify", str(cp_llama_dump))
    assert rc == 0, out + err
    rc, out, err = _inspect(capsys, "inspect", str(cp_llama_dump), "--json")
    forward = next(s for f, s in json.loads(out).items() if f.endswith("forward.uspg"))
    paired = {p["op"] for p in forward["pairing"]}
    assert paired == {"usp.all_to_all.default", "usp.varlen_fwd.default"}
    assert forward["unpaired"] == []


def test_an_unpaired_collective_in_a_dump_still_fails_verify(cp_llama_dump, tmp_path, capsys):
    dump = tmp_path / "dump"
    shutil.copytree(cp_llama_dump, dump)
    graph_dir = _graph_dir(dump)
    (graph_dir / "joint.uspg").unlink()  # only the forward and backward files remain to pair
    victim = remove_backward_adjoint(graph_dir / "backward.uspg", graph_dir / "backward.uspg")

    rc, out, err = _inspect(capsys, "verify", str(dump))
    assert rc == 1, out + err
    # the forward collective, issued (the overlap pass): all_to_all_3 -> all_to_all_3_start
    assert (
        f"{victim['meta']['usp_fwd_node']}_start (usp.all_to_all.default): no usp.all_to_all.default" in out
    )
