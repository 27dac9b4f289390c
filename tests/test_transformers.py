"""Real transformers models under backend "usp" and `attention_mode`: tiny random configs, fp64, no downloads.

Llama, Qwen2 (sliding window on one layer), Mistral (sliding window), Gemma3 (sliding and full
layers), GPT2 and BERT (bidirectional). With ``use_cache=False`` (the training path) and no
attention mask, transformers builds a packed-sequence mask from the position ids; the backend reads
it as a band inside the documents of the position ids. With ``use_cache=True`` there is no packed
mask (is_causal, or a sliding-window mask), and ``documents(meta)`` supplies the documents.

Every model is compiled once per use_cache setting (`_compiled`), at one shape (2 rows x 16 tokens),
and the tests share that compiled model: it keeps the compile count, and the time, small, and lets
`test_new_boundaries_reuse_the_compiled_graph` count every compile the shared model ever made.

# B batch (rows), L tokens per row, N documents
"""

from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass, field

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

pytest.importorskip("transformers")

import usp_graph  # noqa: E402
from tests.dist import run_ranks  # noqa: E402
from tests.realmodels import (  # noqa: E402
    LM_SPECS,
    checkpoint_layers,
    compile_usp,
    grads,
    lm_batch,
    lm_forward,
    make_lm,
    max_err,
    packed_positions,
    per_document,
    weighted_loss,
)
from usp_graph import AttentionMetadata  # noqa: E402

ROWS, LENGTH = 2, 16
# Two packings of the same 2 x 16 tokens, each with a length-1 document and documents longer than
# the sliding window (4 tokens). No document crosses a row: transformers' mask is per row.
PACKINGS = ((5, 1, 6, 4, 9, 7), (3, 8, 1, 4, 2, 7, 7))
MAX_DOCS = 8

NAMES = list(LM_SPECS)
CAUSAL = [n for n, s in LM_SPECS.items() if s.causal]
NAME_USE_CACHE = [(n, uc) for n in NAMES for uc in ((False, True) if LM_SPECS[n].causal else (False,))]


@pytest.fixture(autouse=True, scope="module")
def _one_thread_fresh_dynamo():
    # - One thread: the models are tiny, and on a busy 2-core machine OpenMP threads waiting on each
    #   other make eager steps far slower.
    # - Dynamo starts and ends empty: the compiled models are shared by this module's tests on
    #   purpose, and nobody else's.
    # - Every model class is built once before anything compiles: a class registers itself in a
    #   transformers global when first built, and compiled forwards guard on that registry's size,
    #   so a new class would recompile every model compiled before it.
    # - Every transformers forward is wrapped by one decorator function (utils/deprecation.py), so
    #   all models share one Dynamo code object and its recompile limit (8). Past it Dynamo runs the
    #   forward eagerly, where an SDPA call under documents(...) raises (see the test below): raise the limit,
    #   and fail loudly if it is hit anyway.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    torch._dynamo.reset()
    for name in LM_SPECS:
        make_lm(name)
    with torch._dynamo.config.patch(recompile_limit=64, fail_on_recompile_limit_hit=True):
        yield
    _compiled.cache_clear()
    torch._dynamo.reset()
    torch.set_num_threads(threads)


def _packed_batch(lengths: tuple[int, ...], *, seed: int) -> tuple[Tensor, Tensor, AttentionMetadata]:
    """(ids_BL, pos_BL, meta): 2 x 16 tokens holding `lengths` in order, positions restarting at 0."""
    pos = packed_positions(lengths).view(ROWS, LENGTH)
    ids = torch.randint(0, 64, (ROWS, LENGTH), generator=torch.Generator().manual_seed(seed))
    return ids, pos, AttentionMetadata.from_position_ids(pos, max_docs=MAX_DOCS)


def _alone(model: nn.Module, ids: Tensor, pos: Tensor, lengths, *, use_cache: bool):
    """Output and grads of the plain model with each document run alone (its own batch of one)."""
    flat_ids, flat_pos = ids.reshape(1, -1), pos.reshape(1, -1)
    out = per_document(
        lambda s: lm_forward(model, flat_ids[:, s], flat_pos[:, s], use_cache=use_cache), lengths
    ).view(ROWS, LENGTH, -1)
    weighted_loss(out).backward()
    return out.detach(), grads(model)


@dataclass
class Compiled:
    """One model compiled with backend "usp" (aot_eager), the reports of every compile it made."""

    model: nn.Module
    use_cache: bool
    reports: list = field(default_factory=list)
    fn: nn.Module | None = None

    def __post_init__(self):
        self.fn = compile_usp(self.model, on_compile=self.reports.append)

    def run(self, ids: Tensor, pos: Tensor, meta: AttentionMetadata | None = None):
        """Output and grads of the weighted loss, under ``documents(meta)`` when meta is given."""
        block = usp_graph.documents(meta) if meta is not None else contextlib.nullcontext()
        with block:
            out = lm_forward(self.fn, ids, pos, use_cache=self.use_cache)
        weighted_loss(out).backward()
        return out.detach(), grads(self.model)


@functools.cache
def _compiled(name: str, use_cache: bool) -> Compiled:
    return Compiled(make_lm(name), use_cache)


def _eager(model: nn.Module, ids: Tensor, pos: Tensor, *, use_cache: bool, mode=None):
    """Output and grads of the weighted loss in eager, inside `mode` (a context manager) if given."""
    with mode if mode is not None else contextlib.nullcontext():
        out = lm_forward(model, ids, pos, use_cache=use_cache)
    weighted_loss(out).backward()
    return out.detach(), grads(model)


# ---- one document per row ------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_one_document_per_row_compiled_is_bitwise_equal_to_eager(name):
    # use_cache=False: under compile transformers always builds the packed-sequence mask (it cannot
    # test the position ids while tracing); eager sees one document per row and builds none (or
    # only the sliding window). The backend reads the documents off that mask: one per row.
    c = _compiled(name, False)
    ids, pos = lm_batch(ROWS, LENGTH, seed=1)
    out, got = c.run(ids, pos)
    with torch.no_grad():
        plain = lm_forward(c.model, ids, pos, use_cache=False)
    assert torch.equal(out, plain), max_err(out, plain)
    _, ref = _eager(c.model, ids, pos, use_cache=False, mode=usp_graph.attention_mode())
    assert got.keys() == ref.keys()
    assert all(torch.equal(got[n], ref[n]) for n in ref), max_err(got, ref)
    assert [r.kept for r in c.reports] == [()], c.reports


# ---- packed documents ----------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "use_cache"), NAME_USE_CACHE)
def test_packed_documents_match_each_document_run_alone(name, use_cache):
    c = _compiled(name, use_cache)
    ids, pos, meta = _packed_batch(PACKINGS[0], seed=2)
    out, got = c.run(ids, pos, meta)
    ref_out, ref = _alone(c.model, ids, pos, PACKINGS[0], use_cache=use_cache)
    tol = LM_SPECS[name].tol
    assert max_err(out, ref_out) <= tol
    assert max_err(got, ref) <= tol


@pytest.mark.parametrize(("name", "use_cache"), NAME_USE_CACHE)
def test_new_boundaries_reuse_the_compiled_graph(name, use_cache):
    # Two packings of the same shapes and capacity: the second call runs the first call's graph with
    # new cu_seqlens (and a new max_seqlen). The shared model may have run other boundaries in other
    # tests of this module, always at this shape: one compile in all.
    c = _compiled(name, use_cache)
    for seed, lengths in enumerate(PACKINGS):
        ids, pos, meta = _packed_batch(lengths, seed=seed)
        out, _ = c.run(ids, pos, meta)
        with torch.no_grad():
            ref = per_document(
                lambda s, ids=ids, pos=pos: lm_forward(
                    c.model, ids.view(1, -1)[:, s], pos.view(1, -1)[:, s], use_cache=use_cache
                ),
                lengths,
            )
        assert max_err(out.view(ref.shape), ref) <= LM_SPECS[name].tol, lengths
    assert len(c.reports) == 1, [r.graph for r in c.reports]
    assert len(c.reports[0].rewritten) == 2 and c.reports[0].kept == (), c.reports[0]


@pytest.mark.parametrize(("name", "use_cache"), NAME_USE_CACHE)
def test_eager_attention_mode_is_bitwise_equal_to_compiled_on_packed_documents(name, use_cache):
    c = _compiled(name, use_cache)
    ids, pos, meta = _packed_batch(PACKINGS[1], seed=3)
    out, got = c.run(ids, pos, meta)
    ref_out, ref = _eager(c.model, ids, pos, use_cache=use_cache, mode=usp_graph.attention_mode(meta))
    assert torch.equal(out, ref_out), max_err(out, ref_out)
    assert all(torch.equal(got[n], ref[n]) for n in ref), max_err(got, ref)


@pytest.mark.parametrize("name", CAUSAL)
def test_compiled_without_documents_block_reads_documents_off_the_position_ids(name):
    # use_cache=False and no documents(...): the graph derives the documents from the packed mask
    # transformers built from the position ids.
    c = _compiled(name, False)
    ids, pos, _ = _packed_batch(PACKINGS[0], seed=4)
    out, got = c.run(ids, pos)
    ref_out, ref = _alone(c.model, ids, pos, PACKINGS[0], use_cache=False)
    assert max_err(out, ref_out) <= LM_SPECS[name].tol
    assert max_err(got, ref) <= LM_SPECS[name].tol


@pytest.mark.parametrize("name", CAUSAL)
def test_eager_attention_mode_without_metadata_reads_documents_off_the_packed_mask(name):
    model = _compiled(name, False).model
    ids, pos, meta = _packed_batch(PACKINGS[0], seed=5)
    out, got = _eager(model, ids, pos, use_cache=False, mode=usp_graph.attention_mode())
    ref_out, ref = _eager(model, ids, pos, use_cache=False, mode=usp_graph.attention_mode(meta))
    assert torch.equal(out, ref_out), max_err(out, ref_out)
    assert all(torch.equal(got[n], ref[n]) for n in ref), max_err(got, ref)


@pytest.mark.parametrize("name", CAUSAL)
def test_metadata_that_disagrees_with_the_position_ids_raises(name):
    c = _compiled(name, False)
    ids, pos, _ = _packed_batch(PACKINGS[0], seed=6)
    wrong = AttentionMetadata.from_lengths(PACKINGS[1], max_docs=MAX_DOCS)
    with pytest.raises(
        RuntimeError, match="usp_graph: the document metadata does not describe the documents"
    ):
        c.run(ids, pos, wrong)
    c.model.zero_grad(set_to_none=True)
    with pytest.raises(
        ValueError, match="not a causal, bidirectional or sliding-window mask within the documents"
    ):
        _eager(c.model, ids, pos, use_cache=False, mode=usp_graph.attention_mode(wrong))


@pytest.mark.parametrize(("name", "use_cache"), [("bert", False), ("llama", True)])
def test_documents_option_derives_documents_from_position_ids(name, use_cache):
    # Neither builds a packed mask (BERT never does; a decoder with a cache does not): without the
    # option they would attend across documents. With it, no documents(...) block is needed.
    model = make_lm(name)
    reports: list = []
    fn = compile_usp(model, documents="position_ids", on_compile=reports.append)
    for seed, lengths in enumerate(PACKINGS):
        ids, pos, _ = _packed_batch(lengths, seed=seed)
        out = lm_forward(fn, ids, pos, use_cache=use_cache)
        weighted_loss(out).backward()
        got = grads(model)
        ref_out, ref = _alone(model, ids, pos, lengths, use_cache=use_cache)
        assert max_err(out, ref_out) <= 1e-10 and max_err(got, ref) <= 1e-10, lengths
    assert len(reports) == 1


def test_documents_are_not_silently_ignored_when_dynamo_runs_the_model_eagerly():
    c = _compiled("llama", False)
    model = c.model
    ids, pos, meta = _packed_batch(PACKINGS[0], seed=11)
    try:
        with usp_graph.documents(meta):
            lm_forward(c.fn, ids, pos, use_cache=False)  # compiled (once per module: shared)
            with torch._dynamo.config.patch(recompile_limit=1, fail_on_recompile_limit_hit=False):
                try:
                    # use_cache=True fails a guard; at the limit Dynamo runs the forward eagerly
                    out = lm_forward(c.fn, ids, pos, use_cache=True)
                except usp_graph.EagerAttentionError:
                    return  # refusing is fine; a wrong result is not
    finally:
        # At the limit Dynamo stops compiling the shared forward code for good: start over, and
        # let the shared compiled models of later tests be rebuilt (their compile counts too).
        torch._dynamo.reset()
        _compiled.cache_clear()
    ref, _ = _alone(model, ids, pos, PACKINGS[0], use_cache=True)
    assert max_err(out.detach(), ref) <= 1e-10


# ---- gradient checkpointing ----------------------------------------------------------------------


def _enable_checkpointing(model: nn.Module) -> None:
    checkpoint_layers(model)
    model.train()  # transformers checkpoints only in training mode


# transformers >= 5.25 (its `kernels` attention wrapper) breaks Dynamo's graph at each checkpointed
# layer unless this is set; usp warns with this fix (usp_graph.checkpointing, tests/test_path_matrix.py)
@torch._dynamo.config.patch(skip_fwd_side_effects_in_bwd_under_checkpoint=True)
def test_gradient_checkpointing_llama_compiled_matches_eager():
    model = make_lm("llama")
    ids, pos = lm_batch(ROWS, LENGTH, seed=7)
    _, ref = _eager(model, ids, pos, use_cache=False)  # no checkpointing
    packed_ids, packed_pos, meta = _packed_batch(PACKINGS[0], seed=8)
    ref_packed_out, ref_packed = _alone(model, packed_ids, packed_pos, PACKINGS[0], use_cache=False)

    _enable_checkpointing(model)
    c = Compiled(model, use_cache=False)
    _, got = c.run(ids, pos)
    assert max_err(got, ref) <= 1e-10
    out, got = c.run(packed_ids, packed_pos, meta)
    assert max_err(out, ref_packed_out) <= 1e-10 and max_err(got, ref_packed) <= 1e-10
    assert len(c.reports) == 1 and len(c.reports[0].rewritten) == 2, c.reports


# ---- context parallelism -------------------------------------------------------------------------

CP_OP = {"ulysses": "usp.all_to_all", "ring": "usp.ring_attn_fwd"}  # the strategy ran: its forward op
CP_LENGTHS = (5, 1, 11, 8, 7)  # 32 tokens, 16 per rank; a document crosses the shard boundary


def _llama_cp(rank: int, world: int, strategies: list[str]) -> list[dict]:
    """Loss and every param grad of a compiled CP step per strategy vs the single process."""
    from usp_graph import ContextParallel

    model = make_lm("llama")
    pos = packed_positions(CP_LENGTHS)
    ids = torch.randint(0, 64, pos.shape, generator=torch.Generator().manual_seed(9))
    meta = AttentionMetadata.from_position_ids(pos, max_docs=MAX_DOCS)  # GLOBAL, the same on every rank

    def loss_sum(logits: Tensor, labels: Tensor) -> Tensor:
        return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum")

    ref_loss = loss_sum(lm_forward(model, ids, pos), ids) / ids.numel()  # plain model, one process
    ref_loss.backward()
    ref = grads(model)
    out = []
    for strategy in strategies:
        cp = ContextParallel(strategy)
        reports: list = []
        fn = compile_usp(model, cp=cp, on_compile=reports.append)
        local_ids, local_pos = cp.shard(ids, 1), cp.shard(pos, 1)
        with usp_graph.documents(meta):
            logits = lm_forward(fn, local_ids, local_pos)
        loss = cp.token_mean(loss_sum(logits, local_ids), local_ids.numel())
        loss.backward()
        cp.reduce_grads(model.parameters())
        got = grads(model)
        out.append(
            {
                "strategy": strategy,
                "loss": max_err(cp.global_sum(loss), ref_loss.detach()),
                "grads": max_err(got, ref),
                "usp_ops": reports[0].usp_ops["forward"],
            }
        )
    # Without position ids transformers counts rotary positions with arange over the rank's shard,
    # restarting at 0 on every rank (silently wrong on rank 1 before): eager and compiled refuse.
    refused = {}
    for how in ("eager", "compiled"):
        try:
            with torch.no_grad():
                if how == "eager":
                    with usp_graph.attention_mode(cp=cp):
                        model(input_ids=local_ids, use_cache=False)
                else:
                    compile_usp(model, cp=cp)(input_ids=local_ids, use_cache=False)
            refused[how] = "no error"
        except ValueError as e:
            refused[how] = str(e)
    return out, refused


def test_llama_context_parallel_ulysses_and_ring_match_one_process():
    for rank_results, refused in run_ranks(_llama_cp, 2, ["ulysses", "ring"]):
        for r in rank_results:
            assert r["loss"] <= 1e-10 and r["grads"] <= 1e-10, r
            assert any(op.startswith(CP_OP[r["strategy"]]) for op in r["usp_ops"]), r
        for how, msg in refused.items():
            assert "context parallelism, but" in msg and "reach the queries or keys" in msg, (how, msg)
            assert "pass position_ids sharded with cp.shard" in msg, (how, msg)
