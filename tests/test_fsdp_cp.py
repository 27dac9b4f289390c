"""FSDP2 x context parallelism on a DeviceMesh (`usp_graph.fsdp`) vs one process: 4 gloo ranks.

A 2 x 2 mesh ``(dp_shard, cp)``: two data-parallel replicas, each row split over two CP ranks;
FSDP2 shards over all four (``dp_shard_cp``). Three AdamW steps with document boundaries that
change every step; the global loss and every parameter must equal the single-process run on the
same global batch (fp64, <= 1e-10), eager and compiled, with and without activation checkpointing.
A run saved after step 2 (`torch.distributed.checkpoint`) and resumed continues bitwise.

# B batch, L tokens per replica row, P CP ranks, D data-parallel replicas
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.dist import run_ranks

pytestmark = pytest.mark.slow

ROW = 32  # tokens of one replica's row (global, before CP)
STEPS = 3
LR = 1e-2


def _config():
    from usp_graph.models import LlamaConfig

    return LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)


def _batch(step: int, replica: int):
    """Replica `replica`'s packed row at `step`: log-normal documents, new boundaries every step."""
    from usp_graph import AttentionMetadata
    from usp_graph.models import make_llama_batch
    from usp_graph.testing import lognormal_lengths

    lengths = lognormal_lengths(ROW, 6.0, seed=1000 * step + replica, empty=1, ones=1)
    batch = make_llama_batch(
        _config(), lengths, generator=torch.Generator().manual_seed(77 + 1000 * step + replica)
    )
    meta = AttentionMetadata.from_lengths(lengths, max_docs=16, max_seqlen=ROW)
    return batch, meta


def _model():
    from usp_graph.models import Llama

    torch.manual_seed(0)
    return Llama(_config()).double()


def _loss_sum(model, batch):
    logits = model(batch["input_ids"], batch["position_ids"])
    labels = batch["labels"].flatten()
    return F.cross_entropy(logits.flatten(0, 1), labels, ignore_index=-100, reduction="sum"), (
        labels != -100
    ).sum()


def _one_process(replicas: int) -> dict:
    """The reference: one process, the whole global batch (every replica's row), token-mean loss."""
    from usp_graph import attention_mode

    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(STEPS):
        sums, counts = [], []
        for d in range(replicas):
            batch, meta = _batch(step, d)
            with attention_mode(meta):
                s, n = _loss_sum(model, batch)
            sums.append(s)
            counts.append(n)
        loss = sum(sums) / sum(counts)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.detach())
    return {
        "losses": torch.stack(losses),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
    }


def _replica(mesh) -> int:
    """This rank's data-parallel replica: its coordinate over the mesh's non-CP dims."""
    coord, index = mesh.get_coordinate(), 0
    for name, c, size in zip(mesh.mesh_dim_names, coord, mesh.shape, strict=True):
        if name != "cp":
            index = index * size + c
    return index


def _fsdp_run(
    rank: int,
    world: int,
    *,
    shape: tuple[int, ...],
    names: tuple[str, ...],
    strategy: str = "ulysses",
    compile: bool = False,
    checkpoint: str | None = None,
    fold_cp: bool = True,
    steps: range = range(STEPS),
    save_dir: str | None = None,
    save_after: int | None = None,
    resume_dir: str | None = None,
) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh

    from usp_graph import ContextParallel, attention_mode, documents
    from usp_graph.checkpointing import checkpoint_blocks
    from usp_graph.fsdp import prepare

    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    cp = ContextParallel(strategy, mesh=mesh["cp"])
    model = _model()
    if checkpoint is not None:
        checkpoint_blocks(model, policy=checkpoint)
    plan = prepare(model, mesh, cp, fold_cp=fold_cp)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    run = torch.compile(model, backend="usp", options={"cp": cp}) if compile else model
    if resume_dir is not None:
        msd, osd = get_state_dict(model, opt)
        state = {"model": msd, "optim": osd}
        dcp.load(state, checkpoint_id=resume_dir)
        set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    replica = _replica(mesh)
    losses = []
    for step in steps:
        batch, meta = _batch(step, replica)
        local = {k: cp.shard(v, 1) for k, v in batch.items()}
        with documents(meta) if compile else attention_mode(meta, cp=cp):
            loss_sum, n = _loss_sum(run, local)
        loss = plan.token_mean(loss_sum, n)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        plan.reduce_grads(model.parameters())
        opt.step()
        losses.append(plan.global_sum(loss))
        if save_dir is not None and step == save_after:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd}, checkpoint_id=save_dir)
    params = {n: p.full_tensor().clone() for n, p in model.named_parameters()}
    grad_types = {type(p.grad).__name__ for p in model.parameters()}
    return {"losses": torch.stack(losses), "params": params, "grad_types": grad_types}


@pytest.fixture(scope="module")
def reference():
    return _one_process(replicas=2)


def _assert_matches(result: dict, ref: dict, steps=range(STEPS)) -> None:
    assert result["grad_types"] == {"DTensor"}, result["grad_types"]
    err = (result["losses"] - ref["losses"][steps.start : steps.stop]).abs().max().item()
    assert err <= 1e-10, (err, result["losses"], ref["losses"])
    for name, p in ref["params"].items():
        diff = (result["params"][name] - p).abs().max().item()
        assert diff <= 1e-10, (name, diff)


MESH_2D = {"shape": (2, 2), "names": ("dp_shard", "cp")}
EAGER = {
    "2d": {**MESH_2D},
    "2d_checkpoint": {**MESH_2D, "checkpoint": "full"},
    "2d_fsdp_over_dp_only": {**MESH_2D, "fold_cp": False},
    "2d_ring_save_attention": {**MESH_2D, "strategy": "ring", "checkpoint": "save_attention"},
    "3d_hsdp_recompute_attention": {
        "shape": (2, 1, 2),
        "names": ("dp_replicate", "dp_shard", "cp"),
        "checkpoint": "recompute_attention",
    },
}


def _refusals(rank: int, world: int) -> dict:
    """What `cp.reduce_grads` and `trace_train_step` say about an FSDP2-sharded model."""
    from torch.distributed.device_mesh import init_device_mesh

    from usp_graph import ContextParallel, trace_train_step
    from usp_graph.fsdp import prepare

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp_shard", "cp"))
    out = {}
    try:
        ContextParallel("ulysses", mesh=mesh)
    except ValueError as e:
        out["whole_mesh"] = str(e)
    try:
        prepare(_model(), mesh, ContextParallel("ulysses"))  # CP over all 4 ranks, not mesh["cp"]
    except ValueError as e:
        out["wrong_cp"] = str(e)
    cp = ContextParallel("ulysses", mesh=mesh["cp"])
    model = _model()
    plan = prepare(model, mesh, cp)
    try:
        cp.reduce_grads(model.parameters())
    except ValueError as e:
        out["reduce_grads"] = str(e)
    batch, meta = _batch(0, _replica(mesh))

    def step(m, b):
        return plan.token_mean(*_loss_sum(m, b))

    try:
        trace_train_step(model, step, {k: cp.shard(v, 1) for k, v in batch.items()}, meta, cp=cp)
    except ValueError as e:
        out["trace"] = str(e)
    return out


def _eager_suite(rank: int, world: int, tmp: str) -> dict:
    """Every eager configuration, then a run resumed from the checkpoint the second one saved
    after step 2, then the refusals: one 4-rank call (ranks and imports paid once)."""
    out = {name: _fsdp_run(rank, world, **c) for name, c in EAGER.items() if name != "2d_checkpoint"}
    out["2d_checkpoint"] = _fsdp_run(rank, world, **EAGER["2d_checkpoint"], save_dir=tmp, save_after=1)
    out["resumed"] = _fsdp_run(rank, world, **EAGER["2d_checkpoint"], steps=range(2, STEPS), resume_dir=tmp)
    out["refusals"] = _refusals(rank, world)
    return out


@pytest.fixture(scope="module")
def eager_runs(tmp_path_factory):
    return run_ranks(_eager_suite, 4, str(tmp_path_factory.mktemp("fsdp_cp") / "after_step2"))


@pytest.mark.parametrize("name", list(EAGER))
def test_fsdp_over_dp_and_cp_matches_one_process_eager(eager_runs, reference, name):
    for rank_results in eager_runs:
        _assert_matches(rank_results[name], reference)


def test_fsdp_over_dp_and_cp_matches_one_process_compiled_with_checkpointing(reference):
    for result in run_ranks(_fsdp_run, 4, **MESH_2D, compile=True, checkpoint="full"):
        _assert_matches(result, reference)


def test_resumed_run_continues_bitwise(eager_runs, reference):
    for r in eager_runs:
        full, resumed = r["2d_checkpoint"], r["resumed"]
        assert torch.equal(resumed["losses"], full["losses"][2:])
        for name, p in full["params"].items():
            assert torch.equal(resumed["params"][name], p), name


def test_reduce_grads_on_fsdp_shards_says_what_to_call(eager_runs):
    for r in eager_runs:
        msg = r["refusals"].get("reduce_grads", "no error")
        assert "already summed" in msg and "usp_graph.fsdp.prepare" in msg, msg


def test_trace_train_step_refuses_fsdp_with_a_clear_error(eager_runs):
    for r in eager_runs:
        msg = r["refusals"].get("trace", "no error")
        assert "does not compose with FSDP2" in msg and "torch.compile" in msg, msg


def test_cp_on_a_whole_mesh_or_off_the_mesh_cp_dim_says_how_to_build_it(eager_runs):
    for r in eager_runs:
        assert "pass its CP dim, e.g. mesh=mesh['cp']" in r["refusals"].get("whole_mesh", "no error"), r[
            "refusals"
        ]
        msg = r["refusals"].get("wrong_cp", "no error")
        assert "ContextParallel(strategy, mesh=mesh['cp'])" in msg, msg
