"""Document masks read by what the graph computes (`usp_graph.masks`), and documents from position ids."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.fx.experimental.proxy_tensor import make_fx

from usp_graph import AttentionMetadata, attention_mode, documents
from usp_graph.masks import (
    band_of,
    check_positions_match,
    cu_seqlens_from_positions,
    documents_of_mask,
    segments_of_positions,
)
from usp_graph.models import Llama, LlamaConfig, make_llama_batch
from usp_graph.sites import find_sites

B, L, H, K = 2, 12, 2, 4


def _packed_mask(pos_BL, window=None, causal=True):
    """The mask transformers' training path builds: documents where positions count up by one,
    causal (and a sliding window) on the remapped positions."""
    first = pos_BL[:, :1] - 1
    seg = (torch.diff(pos_BL, prepend=first, dim=-1) != 1).cumsum(-1)
    q, k = pos_BL[:, :, None], pos_BL[:, None, :]
    keep = seg[:, :, None] == seg[:, None, :]
    if causal:
        keep = keep & (k <= q)
    if window is not None:
        keep = keep & (k > q - window)
    return keep[:, None]


def band_mask(doc_BL, window):
    """Reference: the (B, L, L) keep-mask of the band `window` inside the documents `doc_BL`."""
    idx = torch.arange(doc_BL.shape[-1])
    diff_LL = idx.view(-1, 1) - idx.view(1, -1)  # q - k
    keep = doc_BL.unsqueeze(-1) == doc_BL.unsqueeze(-2)
    if window[0] != -1:
        keep = keep & (diff_LL <= window[0])
    if window[1] != -1:
        keep = keep & (-diff_LL <= window[1])
    return keep


def _zero_start_mask(pos_BL):
    """Causal within documents that start only where a position is 0: not transformers' rule (a
    position that does not count up starts one too), so probes tell them apart."""
    seg = (pos_BL == 0).cumsum(-1)
    keep = (seg[:, :, None] == seg[:, None, :]) & torch.ones(L, L, dtype=torch.bool).tril()
    return keep[:, None]


def _site(fn, pos):
    q = torch.randn(B, H, L, K)
    gm = make_fx(fn, tracing_mode="symbolic", pre_dispatch=True)(q, pos)
    (site,) = find_sites(gm)
    return site


def _positions(lengths_per_row):
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in lengths_per_row])


POS = _positions([[5, 1, 6], [3, 3, 3, 3]])


@pytest.mark.parametrize(
    ("mask_fn", "causal", "window"),
    [
        (lambda p: _packed_mask(p), True, None),
        (lambda p: _packed_mask(p, window=3), True, (2, -1)),
        (lambda p: _packed_mask(p, causal=False), False, None),
        (lambda p: _packed_mask(p).to(torch.float32).log(), True, None),  # 0 / -inf additive form
    ],
    ids=["causal", "sliding_window", "bidirectional", "additive"],
)
def test_a_mask_built_from_position_ids_is_read_as_a_band_inside_their_documents(mask_fn, causal, window):
    site = _site(lambda q, p: F.scaled_dot_product_attention(q, q, q, attn_mask=mask_fn(p)), POS)
    assert site.rewritable, site.reason
    assert site.mask_form.kind == "positions" and site.mask_form.positions.op == "placeholder"
    assert (site.is_causal, site.window) == (causal, window)


def test_a_mask_that_ignores_position_values_is_a_band_per_row():
    def fn(q, p):
        keep = torch.ones(p.shape[1], p.shape[1], dtype=torch.bool).tril()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep & (p[0, 0] >= 0))

    site = _site(fn, POS)
    assert site.rewritable and site.mask_form.kind == "rows" and site.is_causal and site.window is None


@pytest.mark.parametrize(
    ("fn", "reason"),
    [
        (
            lambda q, p: F.scaled_dot_product_attention(
                q, q, q, attn_mask=(p[:, None, :, None] > p[:, None, None, :])
            ),
            "not causal",
        ),
        (
            lambda q, p: F.scaled_dot_product_attention(
                q, q, q, attn_mask=_packed_mask(p) & (q[:, :, :, :1] > 0)
            ),
            "depends on the values of input",
        ),
        (
            lambda q, p: F.scaled_dot_product_attention(q, q, q, attn_mask=_zero_start_mask(p)),
            "neither",
        ),
    ],
    ids=["not_a_band", "float_input", "other_document_rule"],
)
def test_other_masks_are_refused_with_the_reason(fn, reason):
    site = _site(fn, POS)
    assert not site.rewritable and reason in site.reason


def test_cu_seqlens_from_positions_equals_from_position_ids_and_fills_capacity():
    gen = torch.Generator().manual_seed(0)
    for _ in range(20):
        rows = []
        for _ in range(3):
            lengths, left = [], 10
            while left:
                n = int(torch.randint(1, left + 1, (1,), generator=gen))
                lengths.append(n)
                left -= n
            rows.append(lengths)
        pos = _positions(rows)
        ref = AttentionMetadata.from_position_ids(pos)
        n = ref.cu_seqlens.numel()
        cu = cu_seqlens_from_positions(pos)
        assert cu.dtype == torch.int32 and cu.numel() == pos.numel() + 1
        assert torch.equal(cu[:n], ref.cu_seqlens) and bool((cu[n:] == pos.numel()).all())
        assert torch.equal(cu_seqlens_from_positions(pos, n), ref.cu_seqlens)
        check_positions_match(ref.cu_seqlens, pos)


def test_check_positions_match_fails_for_other_documents():
    pos = _positions([[4, 4, 4]])
    with pytest.raises(RuntimeError, match="does not describe the documents"):
        check_positions_match(AttentionMetadata.from_lengths([4, 8]).cu_seqlens, pos)
    with pytest.raises(RuntimeError, match="does not describe the documents"):  # over capacity
        check_positions_match(cu_seqlens_from_positions(pos, 3), pos)


def test_documents_and_band_are_recovered_from_a_concrete_mask():
    pos = _positions([[5, 1, 6], [2, 10]])
    doc = segments_of_positions(pos)
    for window in ((-1, 0), (2, 0), (-1, -1), (1, 3)):
        keep = band_mask(doc, window)
        assert torch.equal(documents_of_mask(keep), doc)
        assert band_of(keep, doc) == window
    assert band_of(band_mask(doc, (-1, 0)) & (torch.rand(2, 12, 12) > 0.5)) is None


def test_eager_attention_mode_reads_documents_off_a_packed_mask_without_metadata():
    torch.manual_seed(0)
    q, k, v = (torch.randn(B, H, L, K, dtype=torch.float64) for _ in range(3))
    mask = _packed_mask(POS, window=4)
    with attention_mode():
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    ref = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    assert (out - ref).abs().max() <= 1e-12


def _llama():
    torch.manual_seed(0)
    return Llama(LlamaConfig(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=48)).double()


def test_option_documents_derives_the_documents_from_position_ids_without_a_documents_block():
    model = _llama()
    reports: list = []
    compiled = torch.compile(
        model, backend="usp", options={"documents": "position_ids_BL", "on_compile": reports.append}
    )
    for lengths in ([5, 1, 0, 7, 3], [2, 9, 3, 2]):
        batch = make_llama_batch(model.config, lengths, generator=torch.Generator().manual_seed(1))
        with attention_mode(AttentionMetadata.from_position_ids(batch["position_ids"])):
            ref = model(batch["input_ids"], batch["position_ids"])
        out = compiled(batch["input_ids"], batch["position_ids"])
        assert torch.equal(out, ref)
    assert len(reports) == 1  # new boundaries, no recompile


def test_option_documents_with_max_docs_fails_a_step_with_more_documents():
    model = _llama()
    compiled = torch.compile(model, backend="usp", options={"documents": "position_ids_BL", "max_docs": 3})
    batch = make_llama_batch(model.config, [4, 4, 4, 4], generator=torch.Generator().manual_seed(2))
    with pytest.raises(RuntimeError, match="does not describe the documents"):
        compiled(batch["input_ids"], batch["position_ids"])
    batch = make_llama_batch(model.config, [8, 4, 4], generator=torch.Generator().manual_seed(2))
    compiled(batch["input_ids"], batch["position_ids"])


def test_option_documents_names_a_missing_argument():
    model = _llama()
    compiled = torch.compile(model, backend="usp", options={"documents": "position_ids"})
    batch = make_llama_batch(model.config, [4, 4], generator=torch.Generator().manual_seed(2))
    with pytest.raises(Exception, match="no argument 'position_ids'"):
        compiled(batch["input_ids"], batch["position_ids"])


def test_a_packed_mask_under_documents_is_checked_against_the_metadata():
    def attend(q, pos):
        return F.scaled_dot_product_attention(q, q, q, attn_mask=_packed_mask(pos))

    compiled = torch.compile(attend, backend="usp")
    q = torch.randn(1, H, L, K, dtype=torch.float64)
    pos = _positions([[5, 1, 6]])
    with documents(AttentionMetadata.from_position_ids(pos, max_docs=4)):
        out = compiled(q, pos)
    assert (out - attend(q, pos)).abs().max() <= 1e-12
    with pytest.raises(RuntimeError, match="does not describe the documents"):
        with documents(AttentionMetadata.from_lengths([6, 6], max_docs=4)):
            compiled(q, pos)
    out = compiled(q, pos)  # outside documents(): from the position ids
    assert (out - attend(q, pos)).abs().max() <= 1e-12


def _cp_documents_from_positions(rank, world):
    import torch.distributed as dist

    from tests.reference import rel_err
    from usp_graph import ContextParallel

    model = _llama()
    batch = make_llama_batch(model.config, [5, 1, 6, 3, 1], generator=torch.Generator().manual_seed(4))
    with attention_mode(AttentionMetadata.from_position_ids(batch["position_ids"])):
        ref = model(batch["input_ids"], batch["position_ids"])
    (ref.square().sum() / ref.shape[-1] / ref.shape[1]).backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    errs = {}
    for strategy in ("ulysses",):  # what is gathered does not depend on the strategy
        model.zero_grad()
        cp = ContextParallel(strategy, group=dist.group.WORLD)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="usp", options={"cp": cp, "documents": "position_ids_BL"})
        out = compiled(cp.shard(batch["input_ids"], 1), cp.shard(batch["position_ids"], 1))
        cp.token_mean(out.square().sum() / out.shape[-1], out.shape[1]).backward()
        cp.reduce_grads(model.parameters())
        errs[strategy] = max(
            [rel_err(out, cp.shard(ref, 1))]
            + [rel_err(p.grad, ref_grads[n]) for n, p in model.named_parameters()]
        )
    return errs


def test_option_documents_under_cp_gathers_the_position_ids_of_every_rank():
    from tests.dist import run_ranks

    for errs in run_ranks(_cp_documents_from_positions, 2, timeout=150):
        assert max(errs.values()) <= 1e-10, errs


def test_verify_never_runs_a_mask_subgraph(monkeypatch):
    """verify (and so `usp-graph verify` on a file) reads structure only: no op of the graph runs."""
    import usp_graph.masks as masks_mod
    from usp_graph.passes import VerifyError
    from usp_graph.passes.verify import verify

    site = _site(lambda q, p: F.scaled_dot_product_attention(q, q, q, attn_mask=_packed_mask(p)), POS)
    gm = site.node.graph.owning_module
    for node in gm.graph.nodes:
        node.meta.pop("usp_mask_form", None)
    monkeypatch.setattr(masks_mod, "_mask_form", lambda *a: pytest.fail("verify evaluated a mask"))
    with pytest.raises(VerifyError, match="is still in the graph"):
        verify(gm)


@pytest.mark.slow
def test_reading_a_mask_subgraph_at_compile_time_takes_no_memory_quadratic_in_tokens():
    """mask_form on a graph that builds a packed (1, 1, T, T) mask from position ids at T = 8192
    (transformers' form): the subgraph runs at a probe length, so peak memory grows far less than
    the T^2 bytes the mask itself would take (the old reading took an int64 copy: 8 T^2)."""
    import subprocess
    import sys

    code = """
import resource, torch
from torch.fx.experimental.proxy_tensor import make_fx
from usp_graph.masks import mask_form
T = 8192
def build(pos):
    seg = (torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    q, k = pos[:, :, None], pos[:, None, :]
    keep = (seg[:, :, None] == seg[:, None, :]) & (k <= q) & (k > q - 100)
    return keep[:, None]
pos = torch.cat([torch.arange(3000), torch.arange(T - 3000)])[None]
gm = make_fx(build, tracing_mode="fake")(pos)
out = [n for n in gm.graph.nodes if n.op == "output"][0].args[0]
out = out[0] if isinstance(out, (tuple, list)) else out
torch.zeros(1 << 20).sum()
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
form = mask_form(out, batch=1, length=T)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
assert not isinstance(form, str), form
assert form.kind == "positions" and form.window == (99, 0), form
print((after - before) * 1024)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    grown = int(out.stdout.split()[-1])
    assert grown < 8192 * 8192 // 8, (
        f"peak memory grew {grown} bytes reading a {8192 * 8192}-byte mask's subgraph"
    )


def test_a_mask_from_a_padding_attention_mask_is_refused_naming_the_padding():
    """A padded batch: transformers ANDs the caller's attention_mask into its mask. The reason
    names the padding mask (not "not causal ...", not a missing argument)."""

    def fn(q, pos, attention_mask):
        keep = _packed_mask(pos) & attention_mask[:, None, None, :].bool()
        return F.scaled_dot_product_attention(q, q, q, attn_mask=keep)

    q = torch.randn(B, H, L, K)
    padding = torch.ones(B, L, dtype=torch.long)
    padding[1, :3] = 0
    gm = make_fx(fn, tracing_mode="symbolic", pre_dispatch=True)(q, POS, padding)
    (site,) = find_sites(gm)
    assert not site.rewritable and "padding attention_mask" in site.reason, site.reason
