"""Cross-attention: decided from data flow (never from lengths); packed query and key/value
documents given separately; eager, compiled and under context parallelism (replicated keys)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from tests.dist import run_ranks
from tests.reference import rel_err
from usp_graph import AttentionMetadata, attention_mode, documents
from usp_graph.sites import find_sites

# B batch, L video tokens, S text tokens, D width, H heads
D, H = 16, 2


class Block(nn.Module):
    """Self-attention over the video tokens, then cross-attention from them to the text tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.q2 = nn.Linear(D, D)
        self.kv2 = nn.Linear(D, 2 * D)
        self.txt = nn.Linear(D, D)  # the conditioning path has weights of its own

    def _heads(self, x):
        return x.unflatten(-1, (H, -1)).transpose(1, 2)

    def forward(self, x_BLD, c_BSD):
        q, k, v = (self._heads(t) for t in self.qkv(x_BLD).chunk(3, -1))
        x_BLD = x_BLD + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        c_BSD = torch.tanh(self.txt(c_BSD))
        k2, v2 = (self._heads(t) for t in self.kv2(c_BSD).chunk(2, -1))
        y = F.scaled_dot_product_attention(self._heads(self.q2(x_BLD)), k2, v2)
        return x_BLD + y.transpose(1, 2).flatten(2)


VIDEO, TEXT = [8, 16], [12, 12]  # equal totals: lengths cannot tell self from cross


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(1, sum(VIDEO), D, generator=gen, dtype=torch.float64)
    c = torch.randn(1, sum(TEXT), D, generator=gen, dtype=torch.float64)
    return x, c


def _alone(block, x, c):
    """Each sample (its video tokens with its own text) through the plain block."""
    outs, xs, cs = [], 0, 0
    for lv, lt in zip(VIDEO, TEXT, strict=True):
        outs.append(block(x[:, xs : xs + lv], c[:, cs : cs + lt]))
        xs, cs = xs + lv, cs + lt
    return torch.cat(outs, 1)


def _block():
    torch.manual_seed(0)
    return Block().double()


def test_cross_attention_site_is_found_by_data_flow_with_equal_lengths():
    graphs = []
    torch.compile(_block(), backend=lambda gm, ex: graphs.append(gm) or gm.forward)(*_inputs())
    self_site, cross_site = find_sites(graphs[0])
    assert not self_site.cross and cross_site.cross
    assert all(s.rewritable for s in (self_site, cross_site))


def test_packed_cross_attention_eager_and_compiled_match_each_sample_alone():
    block = _block()
    x, c = _inputs()
    ref = _alone(block, x, c)
    meta_x, meta_c = (
        AttentionMetadata.from_lengths(VIDEO, max_docs=4),
        AttentionMetadata.from_lengths(TEXT, max_docs=4),
    )
    with attention_mode(meta_x, kv=meta_c):
        eager = block(x, c)
    assert rel_err(eager, ref) <= 1e-12
    compiled = torch.compile(block, backend="usp")
    with documents(meta_x, kv=meta_c):
        out = compiled(x, c)
    assert torch.equal(out, eager)


def test_cross_attention_under_query_documents_alone_raises_in_eager_and_compiled():
    block = _block()
    x, c = _inputs()
    meta_x = AttentionMetadata.from_lengths(VIDEO, max_docs=4)
    with pytest.raises(ValueError, match="kv="):
        with attention_mode(meta_x):
            block(x, c)
    compiled = torch.compile(block, backend="usp")
    with pytest.raises(ValueError, match="kv="):
        with documents(meta_x):
            compiled(x, c)


def test_kv_documents_need_the_query_capacity():
    meta_x, meta_c = (
        AttentionMetadata.from_lengths(VIDEO, max_docs=4),
        AttentionMetadata.from_lengths(TEXT, max_docs=3),
    )
    with pytest.raises(ValueError, match="same max_docs"):
        with documents(meta_x, kv=meta_c):
            pass


def _cp_cross_all(rank, world):
    return {(s, c): _cp_cross(rank, world, s, c) for s in ("ulysses", "ring") for c in (False, True)}


def _cp_cross(rank, world, strategy, compiled):
    import torch.distributed as dist

    from usp_graph import ContextParallel

    block = _block()
    x, c = _inputs(1)
    meta_x, meta_c = (
        AttentionMetadata.from_lengths(VIDEO, max_docs=4),
        AttentionMetadata.from_lengths(TEXT, max_docs=4),
    )
    with attention_mode(meta_x, kv=meta_c):
        ref = block(x, c)
    ref.square().sum().backward()
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()
    cp = ContextParallel(strategy, group=dist.group.WORLD)
    xl = cp.shard(x, dim=1)
    if compiled:
        fn = torch.compile(block, backend="usp", options={"cp": cp})
        with documents(meta_x, kv=meta_c):
            out = fn(xl, c)
    else:
        with attention_mode(meta_x, kv=meta_c, cp=cp):
            out = block(xl, c)
    out.square().sum().backward()
    cp.reduce_grads(block.parameters())
    errs = {"out": rel_err(out, cp.shard(ref, dim=1))}
    errs.update({n: rel_err(p.grad, ref_grads[n]) for n, p in block.named_parameters()})
    return errs


def test_cross_attention_under_cp_with_replicated_text_matches_one_process():
    for per_rank in run_ranks(_cp_cross_all, 2, timeout=150):
        for case, errs in per_rank.items():  # (strategy, compiled)
            assert max(errs.values()) <= 1e-10, (case, errs)


class _QNormAttention(nn.Module):
    """Self-attention whose queries alone pass through a norm with a float attribute (like OLMo2's
    q_norm): recompiled for another instance, Dynamo makes that float a graph input."""

    def __init__(self, eps: float) -> None:
        super().__init__()
        self.qkv = nn.Linear(D, 3 * D)
        self.eps = eps

    def forward(self, x_BLD):
        q, k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in self.qkv(x_BLD).chunk(3, -1))
        q = q / (q.square().mean(-1, keepdim=True) + self.eps).sqrt()
        return F.scaled_dot_product_attention(q, k, v)


def test_module_state_turned_into_graph_inputs_is_no_stream_of_its_own():
    graphs = []

    def run(m, x):
        return m(x)

    compiled = torch.compile(run, backend=lambda gm, ex: graphs.append(gm) or gm.forward)
    x, _ = _inputs()
    for eps in (1e-5, 1e-6, 1e-7):
        compiled(_QNormAttention(eps).double(), x)
    for gm in graphs:
        (site,) = find_sites(gm)
        assert not site.cross and site.rewritable, site.describe()
