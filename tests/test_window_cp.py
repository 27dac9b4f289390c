"""Sliding windows under every CP strategy on gloo ranks vs the single-process call, float64.

# B batch, H heads, G kv heads, L global length, K head dim, P ranks
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from tests.test_cp import _halo_lengths, _lengths, _seed

# Windows shorter and longer than a chunk (8 tokens, 4 with zigzag), one-sided either way, the
# diagonal alone, and one that cuts nothing on documents of these lengths.
WINDOWS = [(3, 0), (2, 2), (5, -1), (-1, 3), (0, 0), (11, 6), (1, 13), (40, 40)]


def _rel(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / max(||ref||, 1): relative, but absolute where the reference is rounding noise
    (window (0, 0): each query sees itself only, so dq is 0 up to rounding)."""
    x, ref = x.double(), ref.double()
    return (x - ref).norm().item() / max(ref.norm().item(), 1.0)


def _make_cp(kind: str, world: int, zigzag: bool, longest: int):
    from usp_graph import ContextParallel

    lb = "zigzag" if zigzag else None
    if kind == "usp":  # ring across Ulysses groups of 2 (pure Ulysses on 2 ranks)
        return ContextParallel("usp", ulysses_degree=2, load_balance=lb)
    if kind == "usp_ring":  # Ulysses degree 1: the ring op over the whole group
        return ContextParallel("usp", ulysses_degree=1, load_balance=lb)
    if kind == "halo":
        return ContextParallel("halo", max_document_len=longest)
    if kind == "usp_halo":
        return ContextParallel("usp", ulysses_degree=min(2, world // 2) or 1, across="halo",
                               max_document_len=longest)  # fmt: skip
    return ContextParallel(kind, load_balance=lb)


def _window_cases(rank: int, world: int, configs: list[tuple]) -> list[dict]:
    """Each config: (kind, zigzag, causal, window, heads, kv_heads, batch, longest document or 0,
    dtype name). Out and q/k/v grads of the CP call vs the single-process call."""
    import torch.nn.functional as F  # noqa: F401  (the CP call goes through sdpa_to_usp)

    from usp_graph import AttentionMetadata, sdpa_to_usp

    results = []
    for kind, zigzag, causal, window, h, g, b, longest, dtype_name in configs:
        dtype = getattr(torch, dtype_name)
        gen = torch.Generator().manual_seed(_seed("window", kind, zigzag, causal, window, h, g, b, longest))
        length = 8 * world
        lens = _halo_lengths(gen, b * length, longest) if longest else _lengths(gen, b * length)
        meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 2)
        cp = _make_cp(kind, world, zigzag, longest or 9)
        q = torch.randn(b, h, length, 8, generator=gen, dtype=torch.float64).to(dtype)
        k = torch.randn(b, g, length, 8, generator=gen, dtype=torch.float64).to(dtype)
        v = torch.randn(b, g, length, 8, generator=gen, dtype=torch.float64).to(dtype)
        go = torch.randn(b, h, length, 8, generator=gen, dtype=torch.float64).to(dtype)
        qr, kr, vr = (x.clone().requires_grad_() for x in (q, k, v))
        ref = sdpa_to_usp(qr, kr, vr, is_causal=causal, enable_gqa=True, metadata=meta, window=window)
        ref.backward(go)
        ql, kl, vl = (cp.shard(x, 2).clone().requires_grad_() for x in (q, k, v))
        out = sdpa_to_usp(ql, kl, vl, is_causal=causal, enable_gqa=True, metadata=meta, cp=cp, window=window)
        out.backward(cp.shard(go, 2))
        results.append(
            {
                "config": (kind, zigzag, causal, window, h, g, b, longest, dtype_name),
                "out": _rel(out, cp.shard(ref, 2)),
                "dq": _rel(ql.grad, cp.shard(qr.grad, 2)),
                "dk": _rel(kl.grad, cp.shard(kr.grad, 2)),
                "dv": _rel(vl.grad, cp.shard(vr.grad, 2)),
            }
        )
    return results


TOL = {"float64": 1e-10, "float32": 1e-5}


def _check(results_per_rank):
    for results in results_per_rank:
        for r in results:
            for key in ("out", "dq", "dk", "dv"):
                assert r[key] <= TOL[r["config"][-1]], (r["config"], key, r[key])


def _configs(world: int) -> list[tuple]:
    shardings = [
        (kind, zz) for kind in ("allgather_kv", "ulysses", "ring", "usp", "usp_ring") for zz in (False, True)
    ]
    configs = [
        (kind, zz, causal, window, 4, 2, 2, 0, "float64")
        for kind, zz in shardings
        for causal in (False, True)
        for window in WINDOWS
    ]
    # halo: documents no longer than max_document_len (every window), and documents longer than it
    # where the window bounds both sides within the halo (the exchange sends only the window).
    for kind in ("halo", "usp_halo"):
        for causal in (False, True):
            configs += [(kind, False, causal, window, 4, 2, 2, 9, "float64") for window in WINDOWS]
            configs += [
                (kind, False, causal, window, 4, 2, 2, 20, "float64") for window in [(3, 0), (2, 4), (0, 0)]
            ]
    configs += [
        (kind, True, True, (3, 0), 4, 1, 1, 0, "float32") for kind in ("allgather_kv", "ring", "ulysses")
    ]
    configs += [("halo", False, False, (2, 3), 4, 1, 1, 9, "float32")]
    return configs


@pytest.mark.slow
def test_every_strategy_with_a_window_matches_one_process_on_2_ranks():
    _check(run_ranks(_window_cases, 2, _configs(2)))


@pytest.mark.slow
def test_ring_and_2d_usp_with_a_window_match_one_process_on_4_ranks():
    configs = [
        (kind, zz, causal, window, 4, 2, 1, 0, "float64")
        for kind, zz in (("ring", True), ("usp", False), ("usp", True))
        for causal in (False, True)
        for window in [(3, 0), (2, 9), (5, -1), (-1, 5)]
    ] + [("usp_halo", False, causal, (3, 2), 4, 2, 1, 20, "float64") for causal in (False, True)]
    _check(run_ranks(_window_cases, 4, configs))


def test_ring_pair_plan_skips_pairs_outside_the_window_and_runs_covered_pairs_in_full():
    from usp_graph.ops.ring import _pair_plan

    c = 4  # chunk tokens; key chunk 0 against query chunk 2 is 4 tokens apart at the nearest
    assert _pair_plan(2, 0, c, True, (4, 0)) is None  # nearest pair 5 apart
    assert _pair_plan(2, 0, c, True, (5, 0)) == ("before", 1, (0, -1))  # query row 0 sees key 3
    assert _pair_plan(2, 0, c, True, (10, 0)) == ("before", 4, (2, -1))
    assert _pair_plan(2, 0, c, True, (11, 0)) == ("full", c, ())  # farthest pair 11 apart
    assert _pair_plan(0, 2, c, True, (11, 5)) is None  # causal: later keys never
    assert _pair_plan(0, 2, c, False, (-1, 6)) == ("after", 2, (-1, 2))
    assert _pair_plan(1, 1, c, True, (2, 0)) == ("causal", c, (2, 0))
    assert _pair_plan(1, 2, c, True, (-1, -1)) is None and _pair_plan(2, 1, c, True, (-1, -1)) == (
        "full",
        c,
        (),
    )


def _halo_bytes(rank: int, world: int) -> list[tuple]:
    from usp_graph import AttentionMetadata, ContextParallel, sdpa_to_usp
    from usp_graph.cp.cost import bytes_sent
    from usp_graph.distributed import count_bytes_sent

    rows = []
    for causal, window, b in ((True, (3, 0), 1), (False, (2, 5), 2), (False, (7, -1), 1)):
        cp = ContextParallel("halo", max_document_len=9)
        meta = AttentionMetadata.from_lengths([9, 7] * (b * world // 2), max_docs=b * world)
        q = torch.randn(b, 4, 8, 8, requires_grad=True)
        k = torch.randn(b, 2, 8, 8, requires_grad=True)
        with count_bytes_sent() as fwd:
            out = sdpa_to_usp(q, k, k, is_causal=causal, enable_gqa=True, metadata=meta, cp=cp, window=window)
        with count_bytes_sent() as bwd:
            out.sum().backward()
        kw = dict(tokens=b * 8 * world, heads=4, kv_heads=2, head_dim=8, world=world, element_size=4,
                  max_document_len=9, is_causal=causal, rank=rank, batch=b, window=window)  # fmt: skip
        got = (sum(fwd.values()), sum(fwd.values()) + sum(bwd.values()))
        rows.append((window, got, (bytes_sent("halo", backward=False, **kw), bytes_sent("halo", **kw))))
    return rows


@pytest.mark.slow
def test_halo_with_a_window_sends_what_the_cost_model_says():
    for rows in run_ranks(_halo_bytes, 2):
        for window, got, model in rows:
            assert got == model, window


def test_halo_sends_only_the_window():
    from usp_graph.cp.common import halo_widths as _halo_widths

    assert _halo_widths(9, True, (-1, -1)) == (8, 0, True)  # windowless: as before
    assert _halo_widths(9, False, (-1, -1)) == (8, 8, True)
    assert _halo_widths(9, True, (3, 0)) == (3, 0, False)  # any document length
    assert _halo_widths(9, False, (3, 20)) == (3, 8, True)
    assert _halo_widths(9, False, (2, -1)) == (2, 8, True)


def _windowed_step(cp, causal, window):
    def step(q, k, v, go, cu):
        out = cp.attention(q, k, v, cu_seqlens=cu, max_seqlen=9, is_causal=causal, scale=0.3, window=window)
        return (out, *torch.autograd.grad(out, (q, k, v), go))

    return step


def _traced_vs_eager(rank: int, world: int) -> list[tuple]:
    """Each strategy's windowed forward + backward traced with symbolic token counts (make_fx), run
    on other boundaries and token counts than it was traced with, vs eager: bitwise."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from usp_graph import AttentionMetadata

    rows = []
    for kind, zigzag, causal, window in (
        ("allgather_kv", True, False, (2, 3)),  # dummy query rows
        ("allgather_kv", False, False, (4, -1)),  # the reversed stream
        ("ring", True, False, (5, 6)),
        ("ulysses", False, True, (3, 0)),
        ("halo", False, False, (2, 3)),
        ("usp_halo", False, True, (3, 0)),
    ):
        step = _windowed_step(_make_cp(kind, world, zigzag, 9), causal, window)

        def inputs(b, ll, lens, seed):
            gen = torch.Generator().manual_seed(seed)
            q, k, v, go = (torch.randn(b, 4, ll, 8, generator=gen, dtype=torch.float64) for _ in range(4))
            cu = AttentionMetadata.from_lengths(lens, max_docs=12).cu_seqlens
            return q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), go, cu

        # 2 ranks, 2 rows (the strategies loop over rows: a static dim) of 10 local tokens traced
        # (a size no other dim has: no duck sizing), then other boundaries, then 12 tokens.
        gm = make_fx(step, tracing_mode="symbolic")(*inputs(2, 10, [9, 1, 0, 6, 8, 8, 8], 1))
        for b, ll, lens in ((2, 10, [1, 9, 3, 3, 0, 8, 8, 8]), (2, 12, [5, 9, 1, 9, 8, 8, 8])):
            args = inputs(b, ll, lens, 2)
            eager, traced = step(*args), gm(*args)
            rows.append((kind, all(torch.equal(a, t) for a, t in zip(eager, traced, strict=True))))
    return rows


@pytest.mark.slow
def test_windowed_strategies_trace_symbolically_and_replay_other_shapes_bitwise():
    for rows in run_ranks(_traced_vs_eager, 2):
        for kind, same in rows:
            assert same, kind
