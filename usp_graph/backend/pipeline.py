"""The compile backend's passes: a `Pipeline`, the type `trace_train_step` runs.

    print(usp_graph.backend.backend_pipeline())

1. ``rewrite_sdpa``: Dynamo's graph -> the same with the document metadata inputs appended (when
   every attention site shares one (batch, length)) and each SDPA site replaced by the ops
   `sdpa_to_usp` runs (`usp_graph.passes.rewrite_sdpa`, the tracer's rewrite);
2. ``verify_rewrite``: the verify pass on the rewritten graph (no SDPA left unless reported,
   every usp op has a rule);
3. ``joint``: AOTAutograd's joint graph, each node tagged with its phase and forward origin
   (`usp_graph.passes.provenance`, as the tracer's joint is); required;
4. ``verify``: the verify pass on the joint graph (every forward op its backward, every forward
   collective its adjoint).

AOTAutograd makes the joint graph between passes 2 and 3, so the backend runs the pipeline in
stages on one `PipelineRun` (``Pipeline.run(only=...)``): passes 1 and 2 on Dynamo's graph, then
`JOINT_STAGE` when AOTAutograd hands over the joint (under ``torch.no_grad`` there is no joint,
and that stage does not run). Options
``disable`` and ``dump_passes`` (`UspOptions`) disable passes and dump their before/after graphs
by name, as ``Pipeline.disable`` / ``with_dump`` do for the tracer.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from ..passes.base import Pass, PassContext, PassResult, Pipeline
from ..passes.overlap import overlap_pass
from ..passes.provenance import ORIGIN_META, PHASE_META
from ..passes.rewrite import rewrite_sdpa
from ..passes.verify import verify
from .inputs import add_metadata_inputs
from .joint import tag_joint, verify_joint

__all__ = ["CompileContext", "GRAPH_STAGE", "JOINT_STAGE", "backend_pipeline"]

JOINT_STAGE = ("joint", "verify")
GRAPH_STAGE = ("overlap",)


@dataclass
class CompileContext(PassContext):
    """What the backend's passes share beyond the graph (`PassContext`'s ``cp`` included).

    shape_env / fake_mode / device: Dynamo's, for the metadata inputs the rewrite appends.
    capacity / max_seqlen / kv_max_seqlen: hints for those inputs' symbols; capacity None: the
    rewrite appends none (the sites differ in batch or length, or there are none).
    positions: the placeholder whose position ids define documents (see `rewrite_sdpa`).
    requires_grad: per input of the compiled graph (AOTAutograd's primals), for the joint's tags.
    metadata_inputs: what the rewrite appended (`add_metadata_inputs`' result), or None.
    read_repeated: K/V a model repeated are read before the repeat (`rewrite_sdpa`).
    """

    shape_env: Any = None
    fake_mode: Any = None
    device: Any = None
    capacity: int | None = None
    max_seqlen: int | None = None
    kv_max_seqlen: int | None = None
    positions: fx.Node | None = None
    requires_grad: Sequence[bool] | None = None
    metadata_inputs: Any = None
    read_repeated: bool = True


def _rewrite(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    assert isinstance(ctx, CompileContext), "the backend's passes run with a CompileContext"
    if ctx.capacity is not None:
        ctx.metadata_inputs = add_metadata_inputs(
            gm,
            shape_env=ctx.shape_env,
            fake_mode=ctx.fake_mode,
            device=ctx.device,
            capacity=ctx.capacity,
            max_seqlen=ctx.max_seqlen,
            kv_max_seqlen=ctx.kv_max_seqlen,
        )
    return rewrite_sdpa(gm, cp=ctx.cp, positions=ctx.positions, read_repeated=ctx.read_repeated)


def _verify(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return verify(gm)


def _joint(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    """matches: the backward nodes attributed to a forward node."""
    tag_joint(gm, getattr(ctx, "requires_grad", None))
    attributed = sum(
        1 for n in gm.graph.nodes if n.meta.get(PHASE_META) == "backward" and ORIGIN_META in n.meta
    )
    return PassResult("joint", gm, attributed)


def _verify_joint(gm: fx.GraphModule, ctx: PassContext) -> PassResult:
    return verify_joint(gm)


def backend_pipeline() -> Pipeline:
    """rewrite_sdpa -> verify_rewrite -> (AOTAutograd) -> joint -> verify -> (partition) -> overlap."""
    return Pipeline(
        [
            Pass(
                "rewrite_sdpa",
                _rewrite,
                "SDPA -> pack -> usp::varlen_fwd -> unpack (sdpa_to_usp); metadata inputs appended",
            ),
            Pass("verify_rewrite", _verify, "the rewritten graph: no unreported SDPA; usp ops have rules"),
            Pass(
                "joint",
                _joint,
                "AOTAutograd's joint graph: phase and forward origin of every node",
                required=True,
            ),
            Pass("verify", _verify_joint, "the joint graph: usp ops have rules; backward/adjoint present"),
            Pass(
                "overlap",
                overlap_pass,
                "each compiled graph: collectives -> issue + wait; issue early, wait late",
            ),
        ]
    )
