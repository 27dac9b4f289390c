"""Graph passes: rewrite SDPA into varlen attention, differentiate, verify.

The default pipeline (``print(default_pipeline())``):

1. ``rewrite_sdpa``: each SDPA site -> `sdpa_to_usp` re-traced in place (`rewrite.py`);
2. ``joint``: the train-step graph, backward from the ops' registered rules (`joint.py`);
3. ``verify``: no unreported SDPA, every usp op has a rule, every forward op its backward, every
   trainable parameter a gradient (`verify.py`; the pairing of forward ops with their backward is
   `pairing.py`, which inspect reads too);
4. ``overlap``: each collective -> issue + wait, scheduled so independent compute runs while the
   data travels (`overlap.py`).

Provenance tags of joint graphs (phase, forward origin) are written by `provenance.py`, for the
traced joint and for AOTAutograd's in the compile backend alike.
"""

from __future__ import annotations

from .base import PASS_META, Pass, PassContext, PassResult, Pipeline, PipelineRun, graph_text, tag_nodes
from .joint import build_joint, joint_pass
from .overlap import ASYNC_META, overlap, overlap_pass
from .pairing import Pairing, pair_backward
from .provenance import ORIGIN_META, PHASE_META
from .rewrite import metadata_inputs, rewrite_pass, rewrite_sdpa
from .verify import VerifyError, verify, verify_pass

__all__ = [
    "ASYNC_META",
    "ORIGIN_META",
    "PASS_META",
    "PHASE_META",
    "Pass",
    "PassContext",
    "PassResult",
    "Pairing",
    "Pipeline",
    "PipelineRun",
    "VerifyError",
    "build_joint",
    "default_pipeline",
    "graph_text",
    "metadata_inputs",
    "overlap",
    "pair_backward",
    "rewrite_sdpa",
    "tag_nodes",
    "verify",
]


def default_pipeline() -> Pipeline:
    """rewrite_sdpa -> joint -> verify -> overlap."""
    return Pipeline(
        [
            Pass(
                "rewrite_sdpa",
                rewrite_pass,
                "SDPA -> pack -> usp::varlen_fwd -> unpack (sdpa_to_usp); metadata as graph inputs",
            ),
            Pass(
                "joint",
                joint_pass,
                "forward -> forward + backward from the ops' registered autograd rules",
                required=True,
            ),
            Pass(
                "verify",
                verify_pass,
                "no unreported SDPA; usp ops have rules; backward/adjoint present; all grads",
            ),
            Pass(
                "overlap",
                overlap_pass,
                "collectives -> issue + wait; issue early, wait late (compute overlaps the transfer)",
            ),
        ]
    )
