# B batch, T packed tokens, D model dim
"""Graph files: save -> load (fresh processes, fresh ranks) -> replay bitwise equal to eager; bad and
hostile files refused before anything runs; loaded graphs validate inputs like traced ones."""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.fx.experimental.proxy_tensor import make_fx

import usp_graph.signature
from tests.test_trace import (
    FLUX,
    FLUX_DYNAMIC,
    _adamw_steps,
    _assert_same_history,
    _bad_inputs,
    assert_bitwise,
    eager_step,
    llama_inputs,
    llama_model,
)
from usp_graph import AttentionMetadata, attention_mode, trace_train_step
from usp_graph.graphfile import (
    CorruptGraphFileError,
    DisallowedTargetError,
    FingerprintError,
    GraphFileError,
    GraphFileSchemaError,
    GraphFileVersionError,
    GraphFileVersionWarning,
    InputSpec,
    ProcessGroupMismatchError,
    load,
    load_graph_module,
    loads,
    loads_graph_module,
    save,
    save_graph_module,
)
from usp_graph.graphfile.document import dumps, fingerprint
from usp_graph.models import Flux, flux_loss, llama_loss, make_flux_batch
from usp_graph.sites import source_location

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LLAMA_DOCS = [[5, 7, 3], [2, 9, 4, 6], [20], [1, 1, 8, 3, 2, 7], [11, 4], [3, 3, 3, 3, 3, 3, 3, 3], [9, 0, 6],
              [16, 1], [2, 2], [4, 13, 5]]  # fmt: skip
FLUX_SIZES = [(4, 9), (3, 6), (6, 12), (2, 4), (5, 15), (4, 9), (7, 3), (3, 9), (2, 2), (6, 6)]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    # Tiny ops on a shared 2-core machine: thread hand-offs cost more than the math (a 32x32 linear
    # took 15 ms on 2 threads, 0.1 ms on 1). Bitwise claims hold at any fixed thread count.
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def llama_traced():
    model = llama_model()
    batch, meta = llama_inputs([5, 7, 3], seed=0)
    return model, trace_train_step(model, llama_loss, batch, meta)


@pytest.fixture(scope="module")
def llama_file(llama_traced, tmp_path_factory):
    path = tmp_path_factory.mktemp("graphs") / "llama.uspg"
    save(llama_traced[1], path)
    return path


def _doc(path) -> dict:
    return json.loads(open(path, "rb").read())


def _write(doc: dict, path, *, refingerprint: bool = True) -> None:
    if refingerprint:
        doc["fingerprint"] = fingerprint(doc)
    with open(path, "w") as f:
        f.write(dumps(doc))


# ---- bitwise: fresh process ---------------------------------------------------------------------

# Runs in a fresh interpreter: only torch and usp_graph, no model code. Inputs and results travel as
# torch.save files of plain tensors.
_CHILD = r"""
import sys, torch
from usp_graph import AttentionMetadata, load
torch.set_num_threads(int(sys.argv[3]))
out = []
for job in torch.load(sys.argv[1]):
    step = load(job["graph"])
    params = {n: torch.nn.Parameter(t.clone()) for n, t in job["params"].items()}
    opt = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
    history = []
    for batch, (cu, max_seqlen, total) in job["inputs"]:
        loss, grads = step.replay(params, batch, AttentionMetadata(cu, max_seqlen, total))
        for n, p in params.items():
            p.grad = grads[n]
        norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads.values()]))
        opt.step()
        history.append((loss, norm, {n: g.clone() for n, g in grads.items()},
                        {n: p.detach().clone() for n, p in params.items()}))
    out.append(history)
torch.save(out, sys.argv[2])
"""


def _flux_setup():
    torch.manual_seed(5)
    model = Flux(FLUX)
    gen = torch.Generator().manual_seed(6)
    batch = make_flux_batch(FLUX, 2, 4, 9, generator=gen, grid_width=3)
    graph = trace_train_step(
        model, flux_loss, batch, AttentionMetadata.per_sample(2, 13), dynamic=FLUX_DYNAMIC
    )
    inputs = [
        (make_flux_batch(FLUX, 2, t, i, generator=gen, grid_width=3), AttentionMetadata.per_sample(2, t + i))
        for t, i in FLUX_SIZES
    ]
    return model, graph, inputs


def _llama_setup():
    model = llama_model(seed=4)
    batch, meta = llama_inputs([5, 7, 3], seed=10)
    graph = trace_train_step(model, llama_loss, batch, meta)
    inputs = [llama_inputs(lengths, seed=20 + i, max_seqlen=24) for i, lengths in enumerate(LLAMA_DOCS)]
    return model, graph, inputs


def _ten_steps(setup, loss_fn) -> dict:
    """A traced step, its 10 inputs, and 10 AdamW steps driven by eager attention_mode and by the
    traced graph's replay (the tests below compare them, then the graph's file, here and fresh)."""
    model, graph, inputs = setup()
    return {
        "model": model,
        "graph": graph,
        "inputs": inputs,
        "loss_fn": loss_fn,
        "eager": _adamw_steps(copy.deepcopy(model), loss_fn, inputs),
        "replayed": _adamw_steps(copy.deepcopy(model), loss_fn, inputs, replay_fn=graph.replay),
    }


# Traced once per module: each is a few seconds of symbolic tracing.
@pytest.fixture(scope="module")
def llama_ten_steps():
    return _ten_steps(_llama_setup, llama_loss)


@pytest.fixture(scope="module")
def flux_ten_steps():
    return _ten_steps(_flux_setup, flux_loss)


def test_llama_10_adamw_steps_replayed_equal_eager_bitwise(llama_ten_steps):
    _assert_same_history(llama_ten_steps["eager"], llama_ten_steps["replayed"])


def test_flux_10_adamw_steps_replayed_equal_eager_bitwise(flux_ten_steps):
    assert len(flux_ten_steps["graph"].sites) == FLUX.n_double + FLUX.n_single
    _assert_same_history(flux_ten_steps["eager"], flux_ten_steps["replayed"])


def test_llama_and_flux_loaded_in_a_fresh_process_replay_10_adamw_steps_bitwise_equal_to_eager(
    tmp_path, llama_ten_steps, flux_ten_steps
):
    jobs, expected = [], []
    for name, run in (("llama", llama_ten_steps), ("flux", flux_ten_steps)):
        model, graph, inputs, loss_fn = run["model"], run["graph"], run["inputs"], run["loss_fn"]
        assert len({m.total_tokens for _, m in inputs}) > 5  # token counts change step to step
        path = tmp_path / f"{name}.uspg"
        save(graph, path)
        eager = run["eager"]
        loaded_here = _adamw_steps(copy.deepcopy(model), loss_fn, inputs, replay_fn=load(path).replay)
        _assert_same_history(eager, run["replayed"])
        _assert_same_history(eager, loaded_here)
        expected.append(eager)
        jobs.append(
            {
                "graph": str(path),
                "params": {n: p.detach().clone() for n, p in model.named_parameters()},
                "inputs": [(b, (m.cu_seqlens, m.max_seqlen, m.total_tokens)) for b, m in inputs],
            }
        )
    torch.save(jobs, tmp_path / "jobs.pt")
    proc = subprocess.run(
        [
            sys.executable,
            "-c",
            _CHILD,
            str(tmp_path / "jobs.pt"),
            str(tmp_path / "out.pt"),
            str(torch.get_num_threads()),
        ],
        capture_output=True,
        text=True,
        timeout=600,  # a hang guard only: a loaded machine may take minutes
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    fresh = torch.load(tmp_path / "out.pt")
    for eager, replayed in zip(expected, fresh, strict=True):
        _assert_same_history(eager, replayed)


def test_a_loaded_graph_replays_new_boundaries_like_the_traced_one(llama_traced, llama_file):
    model, graph = llama_traced
    step = load(llama_file)
    batch, meta = llama_inputs([2, 8, 1, 6, 4], seed=30, max_seqlen=12)
    params = dict(model.named_parameters())
    loss, grads = step.replay(params, batch, meta)
    ref_loss, ref_grads = eager_step(copy.deepcopy(model), llama_loss, batch, meta)
    assert torch.equal(loss, ref_loss) and torch.equal(loss, graph.replay(params, batch, meta)[0])
    assert_bitwise(grads, ref_grads, "grad")
    assert step.graph_module.code == graph.graph_module.code


# ---- structure kept -----------------------------------------------------------------------------


def test_loaded_graph_keeps_inputs_symbols_sites_and_node_metadata(llama_traced, llama_file):
    _, graph = llama_traced
    step = load(llama_file)
    s, t = step.signature, graph.signature
    assert s.params == t.params and s.batch == t.batch and s.trainable == t.trainable
    assert s.batch_spec == t.batch_spec and s.max_docs == t.max_docs and s.ranges == t.ranges
    assert sorted(s.symbols) == ["T", "max_seqlen"]
    assert [x.name for x in step.sites] == [x.name for x in graph.sites] and step.skipped == ()
    roles = [i.role for i in step.file.inputs]
    assert roles == ["parameter"] * len(t.params) + ["batch"] * 3 + ["metadata"] * 2
    # One input record: the traced signature's entries are the file's inputs (placeholder names aside).
    assert usp_graph.InputSpec is InputSpec is usp_graph.signature.InputSpec
    assert t.params + t.buffers + t.batch == tuple(replace(i, node=None) for i in step.file.inputs[:-2])
    assert step.file.inputs[-1].value == "max_seqlen" and step.file.inputs[-4].shape == (1, "T")
    old = {n.name: n for n in graph.graph_module.graph.nodes}
    for node in step.graph_module.graph.nodes:
        ref = old[node.name]
        assert node.target == ref.target, node.name
        for key in ("usp_pass", "usp_phase", "usp_fwd_node", "usp_site"):
            assert node.meta.get(key) == ref.meta.get(key), (node.name, key)
        ref_val, val = ref.meta.get("val"), node.meta.get("val")
        if isinstance(ref_val, torch.Tensor):
            assert val.dtype == ref_val.dtype and len(val.shape) == len(ref_val.shape)
            assert [str(d).replace(str(t.symbols["T"]), "T") for d in ref_val.shape] == [
                str(d).replace(str(step.file.symbols["T"]), "T") for d in val.shape
            ]
    varlen = next(n for n in step.graph_module.graph.nodes if n.name == "varlen_fwd")
    assert source_location(varlen) == source_location(old["varlen_fwd"])


def test_save_load_save_is_byte_identical(llama_file, tmp_path):
    again = tmp_path / "again.uspg"
    save(load(llama_file, values=True), again)
    assert open(again, "rb").read() == open(llama_file, "rb").read()


def test_file_is_readable_json_with_one_node_per_line(llama_file):
    text = open(llama_file).read()
    line = next(x for x in text.splitlines() if '"name": "varlen_fwd"' in x).strip().rstrip(",")
    node = json.loads(line)
    assert node["target"] == "usp.varlen_fwd.default" and node["meta"]["usp_phase"] == "forward"
    assert node["args"][3] == {"node": "cu_seqlens_N1"} and node["args"][7] is True
    assert node["meta"]["val"][0]["tensor"]["shape"] == ["T", 4, 8]
    doc = json.loads(text)
    assert doc["format_version"] == 1 and doc["versions"]["torch"] == torch.__version__
    assert doc["fingerprint"] == fingerprint(doc)


# ---- replay validates before running ------------------------------------------------------------


def test_loaded_graph_rejects_bad_inputs_with_the_traced_graphs_messages(llama_file):
    # The same model/inputs test_trace checks against a freshly traced graph.
    step = load(llama_file)
    for args, error, message in _bad_inputs(llama_model()):
        with pytest.raises(error, match=message):
            step.replay(*args)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)


def _guarded_graph(path):
    """A tiny traced step whose trace recorded guards (T even, T >= 4), saved to `path`."""

    def step(model, batch):
        x = batch["x"]
        return model.lin(x[:4] if x.shape[0] % 2 == 0 else x).sum()

    model = _Tiny()
    graph = trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6]))
    save(graph, path)
    return model, graph


def test_recorded_guards_and_ranges_survive_the_file(tmp_path):
    model, graph = _guarded_graph(tmp_path / "g.json")
    loaded = load(tmp_path / "g.json")
    params = dict(model.named_parameters())
    loss, _ = loaded.replay(params, {"x": torch.ones(10, 4)}, AttentionMetadata.from_lengths([10]))
    assert torch.equal(loss, model.lin(torch.ones(4, 4)).sum().detach())
    for n, message in ((9, r"these inputs \(T=9, max_seqlen=9\) break an assumption made while tracing"),
                       (2, r"batch\['x'\] dim 0 = 2, but the graph was traced for T >= 4")):  # fmt: skip
        args = (params, {"x": torch.randn(n, 4)}, AttentionMetadata.from_lengths([n]))
        with pytest.raises(ValueError, match=message) as traced_error:
            graph.replay(*args)
        with pytest.raises(ValueError, match=message) as loaded_error:
            loaded.replay(*args)
        assert str(loaded_error.value) == str(traced_error.value)


def test_a_recorded_guard_that_cannot_be_evaluated_is_a_clear_error_not_a_sympy_crash(tmp_path):
    # Well-formed and re-fingerprinted, but no tracer writes it: 8 // (T - 10) divides by zero at T=10.
    model, _ = _guarded_graph(tmp_path / "g.json")
    doc = _doc(tmp_path / "g.json")
    doc["guards"][0][0] = ["Eq", ["FloorDiv", 8, ["Add", "T", -10]], 0]
    _write(doc, tmp_path / "hostile.json")
    loaded = load(tmp_path / "hostile.json")
    args = (dict(model.named_parameters()), {"x": torch.ones(10, 4)}, AttentionMetadata.from_lengths([10]))
    with pytest.raises(
        ValueError, match=r"cannot be evaluated for these inputs \(ZeroDivisionError.*damaged"
    ):
        loaded.replay(*args)


def test_a_file_over_the_size_limit_is_refused_before_it_is_read(tmp_path, monkeypatch):
    from usp_graph.graphfile import document

    path = tmp_path / "big.json"
    path.write_bytes(b"{" + b" " * 4096 + b"}")
    monkeypatch.setattr(document, "MAX_FILE_BYTES", 1024)
    for fn in (load, load_graph_module):
        with pytest.raises(
            CorruptGraphFileError, match=r"over the 0 MiB a graph file may be .*MAX_FILE_BYTES"
        ):
            fn(path)


class WithBuffer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.register_buffer("scale", torch.tensor([2.0, 3.0, 0.5, -1.0]))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale * torch.tensor([1.0, float("inf"), 1.0, 1.0]).clamp(max=2.0)


def test_buffers_and_tensor_constants_travel_in_the_file(tmp_path):
    torch.manual_seed(11)
    model = WithBuffer()
    step = lambda m, b: m(b["x"]).square().mean()
    graph = trace_train_step(model, step, {"x": torch.randn(6, 4)}, AttentionMetadata.from_lengths([6]))
    assert any(n.op == "get_attr" for n in graph.graph_module.graph.nodes)
    save(graph, tmp_path / "b.json")
    loaded = load(tmp_path / "b.json")
    x = torch.randn(9, 4)
    args = (dict(model.named_parameters()), {"x": x}, AttentionMetadata.from_lengths([9]))
    assert torch.equal(loaded.replay(*args)[0], graph.replay(*args)[0])
    assert torch.equal(loaded.buffers["scale"], model.scale)
    save(graph, tmp_path / "nb.json", include_buffers=False)
    with pytest.raises(ValueError, match=r"buffers do not match the traced model: missing 'scale'"):
        load(tmp_path / "nb.json").replay(*args)
    assert torch.equal(
        load(tmp_path / "nb.json").replay(*args, buffers={"scale": model.scale})[0], graph.replay(*args)[0]
    )


# ---- lower level: any FX graph ------------------------------------------------------------------


def test_forward_and_backward_graphs_of_a_compile_backend_round_trip(tmp_path):
    from functorch.compile import aot_function, make_boxed_func

    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    def fn(x, w, cu):
        return torch.ops.usp.varlen_fwd(x @ w, x, x, cu, cu, 4, 4, True, 0.5)[0].sin().sum()

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)
    x, w = torch.randn(7, 2, 4, requires_grad=True), torch.randn(4, 4, requires_grad=True)
    out = aot_function(fn, fw_compiler=keep, bw_compiler=keep)(x, w, cu)
    out.backward()
    assert len(graphs) == 2
    for stage, gm in zip(("forward", "backward"), graphs, strict=True):
        save_graph_module(gm, tmp_path / f"{stage}.json", meta={"stage": stage})
        f = load_graph_module(tmp_path / f"{stage}.json")
        assert f.kind == "graph_module" and f.meta == {"stage": stage}
        assert [n.target for n in f.graph_module.graph.nodes] == [n.target for n in gm.graph.nodes]
        args = [torch.randn(i.shape, dtype=i.dtype) if i.dtype.is_floating_point else torch.tensor([0, 3, 7], dtype=torch.int32)
                for i in f.inputs]  # fmt: skip
        expected, got = gm(*args), f(*args)
        for a, b in zip(expected, got, strict=True):
            assert (a is None and b is None) or torch.equal(a, b)
        with pytest.raises(ValueError, match=r"input '\w+' has dtype torch.float64"):
            f(*[a.double() if a.is_floating_point() else a for a in args])


def test_a_symbolic_graph_module_checks_named_dims_and_expressions(tmp_path):
    def fn(x, y):
        return torch.cat([x, y]) * 2

    gm = make_fx(fn, tracing_mode="symbolic")(torch.randn(3, 4), torch.randn(5, 4))
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    syms = {"A": placeholders[0].meta["val"].shape[0], "B": placeholders[1].meta["val"].shape[0]}
    inputs = [InputSpec("x", "batch", "tensor", torch.float32, ("A", 4), torch.device("cpu")),
              InputSpec("y", "batch", "tensor", torch.float32, ("B", 4), torch.device("cpu"))]  # fmt: skip
    save_graph_module(gm, tmp_path / "s.json", inputs=inputs, symbols=syms)
    f = load_graph_module(tmp_path / "s.json")
    assert [i.shape for i in f.inputs] == [("A", 4), ("B", 4)]
    out_val = list(f.graph_module.graph.nodes)[-2].meta["val"]
    assert str(out_val.shape[0]) == str(f.symbols["A"] + f.symbols["B"])
    x, y = torch.randn(6, 4), torch.randn(2, 4)
    assert torch.equal(f(x, y), fn(x, y))
    with pytest.raises(ValueError, match=r"input 'y' dim 1 is 5, the graph was saved for 4"):
        f(x, torch.randn(2, 5))
    with pytest.raises(TypeError, match=r"input 'x' must be a torch.Tensor"):
        f(3, y)


def test_inspection_reads_a_loaded_graph_like_a_traced_one(llama_traced, llama_file):
    from usp_graph.analysis import summarize

    _, graph = llama_traced
    f = load_graph_module(llama_file)
    a = summarize(
        graph.graph_module,
        symbols={"T": graph.graph_module.graph.find_nodes(op="placeholder")[-4].meta["val"].shape[1]},
    )
    b = summarize(f.graph_module, symbols=f.symbols)
    assert a["inputs"] == b["inputs"]
    assert len(a["attention"]) == len(b["attention"]) if "attention" in a else True


def test_save_refuses_graphs_a_file_cannot_hold(tmp_path):
    class M(nn.Module):
        def forward(self, x):
            return x.relu()

    gm = torch.fx.symbolic_trace(M())  # call_method node
    with pytest.raises(ValueError, match=r"call_method node; graph files hold placeholder, call_function"):
        save_graph_module(gm, tmp_path / "x.json")
    gm = torch.fx.symbolic_trace(lambda x: torch.relu(x))  # a torch function, not an op overload
    with pytest.raises(ValueError, match=r"not in the graph-file allowlist"):
        save_graph_module(gm, tmp_path / "x.json")
    with pytest.raises(TypeError, match=r"save takes a TrainStepGraph"):
        save(gm, tmp_path / "x.json")


# ---- bad files ----------------------------------------------------------------------------------


def test_truncated_file_is_refused_as_truncated(llama_file):
    data = open(llama_file, "rb").read()
    for cut in (10, len(data) // 3, len(data) - 3):
        with pytest.raises(CorruptGraphFileError, match=r"ends early \(truncated"):
            loads(data[:cut])
    with pytest.raises(CorruptGraphFileError, match=r"not UTF-8"):
        loads(data[:100] + b"\xff\xfe" + data[102:])
    with pytest.raises(CorruptGraphFileError, match=r"not a usp_graph graph file"):
        loads(b'{"nodes": []}')


def test_bit_flips_are_refused(llama_file):
    data = bytearray(open(llama_file, "rb").read())
    inside_value = data.index(b'"aten.mm.default"') + 8  # 'm' -> 'l': still JSON, other content
    flipped = bytearray(data)
    flipped[inside_value] ^= 0x01
    with pytest.raises(FingerprintError, match=r"does not match its fingerprint"):
        loads(bytes(flipped))
    structural = bytearray(data)
    structural[data.index(b'"graph": {') + 9] ^= 0x40  # '{' -> ';'
    with pytest.raises(CorruptGraphFileError, match=r"invalid JSON"):
        loads(bytes(structural))


def test_wrong_format_version_is_refused_before_anything_else(llama_file, tmp_path):
    doc = _doc(llama_file)
    doc["format_version"] = 2
    _write(doc, tmp_path / "v2.json", refingerprint=False)
    with pytest.raises(
        GraphFileVersionError,
        match=r"format version 2; this usp_graph reads version 1 only: a newer usp_graph wrote it",
    ):
        load(tmp_path / "v2.json")
    doc["format_version"] = "1"
    _write(doc, tmp_path / "v1s.json")
    with pytest.raises(GraphFileVersionError, match=r"re-save the graph"):
        load(tmp_path / "v1s.json")


def test_edited_content_without_a_new_fingerprint_is_refused(llama_file, tmp_path):
    doc = _doc(llama_file)
    node = next(n for n in doc["graph"]["nodes"] if n.get("target") == "usp.varlen_fwd.default")
    node["args"][8] = 1.0  # a different softmax scale
    _write(doc, tmp_path / "edited.json", refingerprint=False)
    with pytest.raises(FingerprintError, match=r"modified or damaged after it was written"):
        load(tmp_path / "edited.json")
    _write(doc, tmp_path / "edited.json")  # re-fingerprinted: the hash only guards against accidents
    load(tmp_path / "edited.json")


HOSTILE = [
    ("builtins.exec", lambda marker: [f"open({str(marker)!r}, 'w').write('pwned')"]),
    ("eval", lambda marker: [f"open({str(marker)!r}, 'w').write('pwned')"]),
    ("builtins.eval", lambda marker: [f"open({str(marker)!r}, 'w').write('pwned')"]),
    ("os.system", lambda marker: [f"touch {marker}"]),
    ("subprocess.run", lambda marker: [["touch", str(marker)]]),
    ("posix.system", lambda marker: [f"touch {marker}"]),
    ("aten.from_file.default", lambda marker: [str(marker)]),
]


def _inject(doc: dict, node: dict) -> None:
    nodes = doc["graph"]["nodes"]
    first_op = next(i for i, n in enumerate(nodes) if n["op"] != "placeholder")
    nodes.insert(first_op, node)


@pytest.mark.parametrize(("target", "make_args"), HOSTILE, ids=[t for t, _ in HOSTILE])
def test_a_node_outside_the_allowlist_is_refused_and_nothing_runs(llama_file, tmp_path, target, make_args):
    marker = tmp_path / "marker"
    doc = _doc(llama_file)
    _inject(doc, {"name": "evil", "op": "call_function", "target": target, "args": make_args(marker)})
    path = tmp_path / "evil.json"
    _write(doc, path)  # passes the hash check: only the allowlist stands in the way
    for loader in (load, load_graph_module):
        with pytest.raises(
            DisallowedTargetError, match=r"graph.nodes\[\d+\] \(evil\): .*(not allowed|denied)"
        ):
            loader(path)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("edit", "error"),
    [
        (
            lambda d, m: d["graph"]["nodes"][0].update(name=f"x=__import__('os').system('touch {m}')"),
            r"is not an identifier",
        ),
        (
            lambda d, m: d["graph"]["nodes"][0].update(target=f"x=__import__('os').system('touch {m}')"),
            r"a placeholder's target is its name",
        ),
        (
            lambda d, m: _inject(
                d,
                {
                    "name": "evil",
                    "op": "call_method",
                    "target": "__reduce__",
                    "args": [{"node": "in_input_ids"}],
                },
            ),
            r"call_module/call_method are never allowed",
        ),
        (
            lambda d, m: _inject(d, {"name": "evil", "op": "call_module", "target": "os", "args": []}),
            r"call_module/call_method are never allowed",
        ),
        (
            lambda d, m: d["graph"]["nodes"][40]["meta"].update(
                source=f'x.py:1 in f\nimport os; os.system("touch {m}")'
            ),
            r"a source location is 'file:line in function'",
        ),
        (
            lambda d, m: _inject(d, {"name": "evil", "op": "get_attr", "target": "__class__"}),
            r"reads constant '__class__', which the file does not hold",
        ),
        (
            lambda d, m: _inject(
                d, {"name": "evil", "op": "call_function", "target": "aten.__dict__.default"}
            ),
            r"is not an op name",
        ),
    ],
    ids=["node-name", "placeholder-target", "call_method", "call_module", "source", "get_attr", "dunder-op"],
)
def test_code_never_comes_from_names_targets_or_sources(llama_file, tmp_path, edit, error):
    marker = tmp_path / "marker"
    doc = _doc(llama_file)
    edit(doc, marker)
    _write(doc, tmp_path / "evil.json")
    with pytest.raises(GraphFileError, match=error):
        step = load(tmp_path / "evil.json")
        step.graph_module.recompile()
    assert not marker.exists()


def test_an_unknown_op_or_arguments_that_break_its_schema_are_refused(llama_file, tmp_path):
    for mutate, error in (
        (
            lambda n: n.update(target="aten.no_such_op.default"),
            r"op aten.no_such_op does not exist in this torch",
        ),
        (lambda n: n.update(target="aten.mm.no_such_overload"), r"has no overload 'no_such_overload'"),
        (lambda n: n["args"].append(3), r"aten.mm.default takes at most 2 positional arguments, got 3"),
        (lambda n: n["args"].pop(), r"aten.mm.default is missing its argument 'mat2'"),
        (lambda n: n.update(kwargs={"alpha": 1}), r"aten.mm.default has no argument 'alpha'"),
        (lambda n: n["args"].__setitem__(1, "text"), r"argument 'mat2' must be Tensor, got str"),
        (
            lambda n: n["args"].__setitem__(1, {"node": "nowhere"}),
            r"refers to node 'nowhere', which is not defined before it",
        ),
    ):
        doc = _doc(llama_file)
        mutate(next(n for n in doc["graph"]["nodes"] if n.get("target") == "aten.mm.default"))
        _write(doc, tmp_path / "bad.json")
        with pytest.raises(GraphFileSchemaError, match=error):
            load(tmp_path / "bad.json")


def test_another_torch_version_warns_or_is_refused_when_strict(llama_file, tmp_path):
    doc = _doc(llama_file)
    doc["versions"]["torch"] = "2.99.0"
    _write(doc, tmp_path / "old.json")
    with pytest.warns(GraphFileVersionWarning, match=r"written with torch '2.99.0' .* re-trace and re-save"):
        load(tmp_path / "old.json")
    with pytest.raises(GraphFileVersionError, match=r"refused because strict_versions=True"):
        load(tmp_path / "old.json", strict_versions=True)


def test_load_of_a_plain_graph_module_file_points_to_load_graph_module(tmp_path):
    gm = make_fx(lambda x: x * 2)(torch.randn(2))
    save_graph_module(gm, tmp_path / "g.json")
    with pytest.raises(
        GraphFileError,
        match=r"holds a graph_module, not a train step; load it with usp_graph.load_graph_module",
    ):
        load(tmp_path / "g.json")
    assert loads_graph_module(open(tmp_path / "g.json", "rb").read()).kind == "graph_module"


# ---- context parallel: per-rank files, fresh ranks ----------------------------------------------

CP_STRATEGIES = ["allgather_kv", "ulysses", "ring", "usp", "halo"]
CP_LLAMA = dict(vocab_size=64, dim=32, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64)


def _cp(strategy):
    from usp_graph import ContextParallel

    if strategy == "halo":  # documents of up to 17 tokens (16 or 18 tokens per rank below)
        return ContextParallel("halo", max_document_len=17)
    return ContextParallel(strategy, ulysses_degree=1 if strategy == "usp" else None)


def _cp_step(m, b):  # a per-rank loss: no eager c10d call in the traced step
    logits = m(b["input_ids"], b["position_ids"])
    return F.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=-100, reduction="sum")


def _cp_inputs(lengths, seed, cp):
    from usp_graph.models import LlamaConfig

    batch, meta = llama_inputs(lengths, seed=seed, config=LlamaConfig(**CP_LLAMA))
    return {k: cp.shard(v, 1) for k, v in batch.items()}, meta


def _cp_model():
    from usp_graph.models import LlamaConfig

    return llama_model(LlamaConfig(**CP_LLAMA), seed=9)


def _cp_trace_save_and_eager(rank: int, world: int, folder: str) -> dict:
    """Ranks that trace (boundaries A), save their file, and run eager CP with boundaries B."""
    out = {}
    for strategy in CP_STRATEGIES:
        cp = _cp(strategy)
        model = _cp_model()
        graph = trace_train_step(model, _cp_step, *_cp_inputs([9, 7, 11, 5], 50, cp), cp=cp)
        save(graph, os.path.join(folder, f"{strategy}.rank{rank}.uspg"))
        local, meta = _cp_inputs([3, 17, 1, 4, 6, 5], 51, cp)  # 32 -> 36 tokens, new boundaries
        model.zero_grad(set_to_none=True)
        with attention_mode(meta, cp=cp):
            loss = _cp_step(model, local)
        loss.backward()
        out[strategy] = (loss.detach(), {n: p.grad for n, p in model.named_parameters()})
    return out


def _cp_load_and_replay(rank: int, world: int, folder: str) -> dict:
    """Fresh ranks: groups created by the same ContextParallel calls, after an extra group that
    shifts every group name; load this rank's file, replay boundaries B."""
    import torch.distributed as dist

    dist.new_group([0, 1])  # names now differ from the tracing job's
    out = {}
    for strategy in CP_STRATEGIES:
        cp = _cp(strategy)
        step = load(os.path.join(folder, f"{strategy}.rank{rank}.uspg"))
        local, meta = _cp_inputs([3, 17, 1, 4, 6, 5], 51, cp)
        loss, grads = step.replay(dict(_cp_model().named_parameters()), local, meta)
        out[strategy] = (loss, grads, step.file.bind_groups())
    params = dict(_cp_model().named_parameters())
    args = _cp_inputs([3, 17, 1, 4, 6, 5], 51, _cp("usp"))
    path = os.path.join(folder, f"usp.rank{rank}.uspg")
    (pair,) = [g.name for g in load(path).file.world.groups if g.ranks == (0, 1)]
    # An explicit mapping wins over the rank-list search; it must span the recorded ranks.
    out["explicit"] = load(path, groups={pair: dist.group.WORLD}).replay(params, *args)
    out["explicit_mapping"] = load(path, groups={pair: dist.group.WORLD}).bind_groups()[pair]
    singles = [dist.new_group([r]) for r in range(world)]  # new_group is collective: all ranks, all groups
    for name, file, groups in (
        ("wrong_rank", f"ulysses.rank{1 - rank}.uspg", None),
        ("wrong_group", f"usp.rank{rank}.uspg", {pair: singles[rank]}),
    ):
        try:
            load(os.path.join(folder, file), groups=groups).replay(params, *args)
            out[name] = None
        except ProcessGroupMismatchError as e:
            out[name] = str(e)
    return out


def test_cp_graphs_saved_per_rank_replay_in_fresh_ranks_bitwise_equal_to_eager_cp(tmp_path):
    from tests.dist import run_ranks

    eager = run_ranks(_cp_trace_save_and_eager, 2, str(tmp_path))
    replayed = run_ranks(_cp_load_and_replay, 2, str(tmp_path))
    for rank in range(2):
        for strategy in CP_STRATEGIES:
            ref_loss, ref_grads = eager[rank][strategy]
            loss, grads, mapping = replayed[rank][strategy]
            assert torch.equal(loss, ref_loss), (rank, strategy)
            assert_bitwise(grads, ref_grads, f"rank {rank} {strategy} grad")
            assert mapping, (rank, strategy)  # the graph had groups and they were bound
            if strategy == "usp":  # recorded names were taken by other groups; ranks decided
                assert any(k != v for k, v in mapping.items()), mapping
        assert (
            f"saved by rank {1 - rank} of a world of 2, but this process is rank {rank}"
            in replayed[rank]["wrong_rank"]
        )
        assert f"is over ranks [{rank}], but the graph's group" in replayed[rank]["wrong_group"]
        loss, grads = replayed[rank]["explicit"]
        assert torch.equal(loss, eager[rank]["usp"][0]) and replayed[rank]["explicit_mapping"] == "0"
        assert_bitwise(grads, eager[rank]["usp"][1], f"rank {rank} usp (explicit groups) grad")
    # Inspection needs no process group; replay does, and says how to get one.
    step = load(tmp_path / "usp.rank0.uspg")
    assert step.file.world.size == 2 and {g.ranks for g in step.file.world.groups} == {(0,), (0, 1)}
    batch, meta = _cp_inputs_single([3, 17, 1, 4, 6, 5], 51)
    with pytest.raises(
        ProcessGroupMismatchError, match=r"call torch.distributed.init_process_group\(\.\.\., world_size=2\)"
    ):
        step.replay(dict(_cp_model().named_parameters()), batch, meta)


def _cp_inputs_single(lengths, seed):
    from usp_graph.models import LlamaConfig

    batch, meta = llama_inputs(lengths, seed=seed, config=LlamaConfig(**CP_LLAMA))
    return {k: v[:, : v.shape[1] // 2] for k, v in batch.items()}, meta
