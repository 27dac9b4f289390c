"""Every CP strategy on gloo ranks vs the independent fp64 per-document reference (`usp_graph.testing`).

# B batch (1), H heads, G kv heads, L global length, K head dim, T packed tokens, P ranks

Realistic sizes: 512 tokens, head dim 32, GQA (4 query heads over 2 KV heads). The document
layouts put boundaries where the strategies split the stream: on 4 ranks each shard is 128 tokens
and each zigzag chunk 64, and `EDGES` has a document crossing 3 shards (4 ranks under zigzag), ends
exactly on shard and zigzag boundaries, length-1 documents on both sides of them, an empty
document and a length-1 document at each end of the stream. `HALO_EDGES` does the same within
halo's limit (no document longer than a shard + 1). Out, dq, dk, dv, the ring op's `lse`, and
forward-only calls under `torch.no_grad()` are checked; all cases of one world size run in one
call on the session's pooled ranks, and each test reads its cases from that call.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from usp_graph.testing import attention_reference, cu_seqlens, lognormal_lengths, rel_err

L, H, G, K = 512, 4, 2, 32
# On 4 ranks: shard ends 128, 256, 384; zigzag chunk ends every 64. Documents (start..end):
# 0..1, 1..127, 127..128 (ends on a shard and chunk boundary), 128..448 (shards 1-3; under zigzag
# chunks 2-6 on 4 ranks; ends on a chunk boundary), 448..449 (length 1 after it), an empty one,
# 449..511, 511..512.
EDGES = [1, 126, 1, 320, 1, 0, 62, 1]
# Halo's documents fit one shard + 1: 102..231 is 129 long and crosses 128; 231..256 ends on a
# shard boundary, 256..257 starts one; 377..477 crosses 384.
HALO_EDGES = [1, 100, 1, 129, 25, 1, 0, 120, 100, 34, 1]
HALO_LONGEST = 129
LAYOUTS = {
    "edges": EDGES,
    "halo_edges": HALO_EDGES,
    "lognormal": lognormal_lengths(L, 48, 18, ones=3, empty=1),
}
WINDOWS = {"none": None, "causal_band": (48, 0), "two_sided": (16, 24)}
TOL = {"float64": 1e-12, "float32": 5e-6}  # seen: 1.2e-15 and 4.3e-7


def _make_cp(kind: str, world: int, zigzag: bool):
    from usp_graph import ContextParallel

    lb = "zigzag" if zigzag else None
    if kind == "usp":  # Ulysses groups of 2, ring across them (pure Ulysses on 2 ranks)
        return ContextParallel("usp", ulysses_degree=2, load_balance=lb)
    if kind == "halo":
        return ContextParallel("halo", max_document_len=HALO_LONGEST)
    if kind == "usp_halo":
        return ContextParallel("usp", ulysses_degree=2, across="halo", max_document_len=HALO_LONGEST)
    return ContextParallel(kind, load_balance=lb)


def _inputs(layout: str, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(sum(map(ord, layout)))
    q, go = (torch.randn(1, H, L, K, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, G, L, K, generator=gen, dtype=torch.float64) for _ in range(2))
    return q.to(dtype), k.to(dtype), v.to(dtype), go.to(dtype)


def _thk(x_BHLK: torch.Tensor) -> torch.Tensor:
    return x_BHLK[0].transpose(0, 1).contiguous()


def _bhlk(x_THK: torch.Tensor) -> torch.Tensor:
    return x_THK.transpose(0, 1).unsqueeze(0)


def _reference(layout: str, causal: bool, window):
    """fp64 out and dq, dk, dv (BHLK, global) and lse (H, T) of the layout's inputs."""
    q, k, v, go = (x.double().requires_grad_(i < 3) for i, x in enumerate(_inputs(layout, torch.float64)))
    out, lse = attention_reference(
        _thk(q), _thk(k), _thk(v), cu_seqlens(LAYOUTS[layout]), is_causal=causal, window=window
    )
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), _thk(go))
    return {"out": _bhlk(out.detach()), "dq": dq, "dk": dk, "dv": dv, "lse": lse.detach()}


def _cases(world: int) -> list[tuple]:
    """(kind, zigzag, causal, layout, window name, dtype name, grad) of every case on `world` ranks."""
    sharded = [(kind, zz) for kind in ("allgather_kv", "ulysses", "ring", "usp") for zz in (False, True)]
    cases = [
        (kind, zz, causal, layout, "none", "float64", True)
        for kind, zz in sharded
        for causal in (False, True)
        for layout in ("edges", "lognormal")
    ]
    cases += [
        (kind, False, causal, "halo_edges", "none", "float64", True)
        for kind in ("halo", "usp_halo")
        for causal in (False, True)
    ]
    cases += [
        (kind, zz, causal, "edges", window, "float64", True)
        for kind, zz in sharded
        for causal, window in ((True, "causal_band"), (False, "two_sided"))
    ]
    cases += [(kind, zz, True, "edges", "none", "float32", True) for kind, zz in sharded]
    cases += [("halo", False, True, "halo_edges", "none", "float32", True)]
    # Forward only, under torch.no_grad().
    cases += [(kind, zz, True, "edges", "none", "float64", False) for kind, zz in sharded]
    cases += [("halo", False, False, "halo_edges", "none", "float64", False)]
    return cases


def _strategy_cases(rank: int, world: int) -> dict:
    """Rel errors of every case of `_cases(world)` on this rank's shards, and of the ring op's lse."""
    from usp_graph import AttentionMetadata, sdpa_to_usp

    refs: dict[tuple, dict] = {}
    errors: dict[tuple, dict] = {}
    for case in _cases(world):
        kind, zigzag, causal, layout, window_name, dtype_name, grad = case
        window = WINDOWS[window_name]
        key = (layout, causal, window_name)
        if key not in refs:
            refs[key] = _reference(layout, causal, window)
        ref = refs[key]
        meta = AttentionMetadata.from_lengths(LAYOUTS[layout], max_docs=len(LAYOUTS[layout]) + 2)
        cp = _make_cp(kind, world, zigzag)
        q, k, v, go = _inputs(layout, getattr(torch, dtype_name))
        ql, kl, vl = (cp.shard(x, 2).clone().requires_grad_() for x in (q, k, v))
        if grad:
            out = sdpa_to_usp(
                ql, kl, vl, is_causal=causal, enable_gqa=True, metadata=meta, cp=cp, window=window
            )
            out.backward(cp.shard(go, 2))
            errors[case] = {
                "out": rel_err(out, cp.shard(ref["out"], 2)),
                **{
                    f"d{n}": rel_err(x.grad, cp.shard(ref[f"d{n}"], 2))
                    for n, x in zip("qkv", (ql, kl, vl), strict=True)
                },
            }
        else:
            with torch.no_grad():
                out = sdpa_to_usp(
                    ql, kl, vl, is_causal=causal, enable_gqa=True, metadata=meta, cp=cp, window=window
                )
            errors[case] = {
                "out": rel_err(out, cp.shard(ref["out"], 2)),
                "requires_grad": out.requires_grad,
                "grad_fn": out.grad_fn is not None,
            }
    errors.update(_ring_lse_cases(world, refs))
    return errors


def _ring_lse_cases(world: int, refs: dict) -> dict:
    """The lse of ``usp::ring_attn_fwd`` (the ring strategy's op) on this rank's rows vs the reference."""
    import usp_graph.ops  # noqa: F401  (registers the ops)

    errors = {}
    for zigzag in (False, True):
        for causal in (False, True):
            for layout in ("edges", "lognormal"):
                ref = refs.get((layout, causal, "none")) or _reference(layout, causal, None)
                cp = _make_cp("ring", world, zigzag)
                q, k, v, _ = _inputs(layout, torch.float64)
                ids = [c for r in range(world) for c in cp.layout.global_chunks(r, 1)]
                cu = cu_seqlens(LAYOUTS[layout])
                max_seqlen = max(LAYOUTS[layout])
                _, lse_HT = torch.ops.usp.ring_attn_fwd(
                    *(_thk(cp.shard(x, 2)) for x in (q, k, v)), cu, max_seqlen, causal, K**-0.5,
                    ids, cp.layout.per_rank, cp.group_name,
                )  # fmt: skip
                ref_HT = cp.shard(ref["lse"].unsqueeze(0), 2)[0]
                finite = torch.isfinite(ref_HT)
                errors[("ring_lse", zigzag, causal, layout)] = {
                    "lse": rel_err(lse_HT[finite], ref_HT[finite]),
                    "same_inf": bool(torch.equal(torch.isinf(lse_HT), ~finite)),
                }
    return errors


_RESULTS: dict[int, list[dict]] = {}


def _results(world: int) -> list[dict]:
    """Every rank's errors on `world` ranks: one call per world size for the whole module."""
    if world not in _RESULTS:
        _RESULTS[world] = run_ranks(_strategy_cases, world)
    return _RESULTS[world]


def _ids(cases):
    return ["-".join(str(p) for p in c[:6]) + ("" if c[6] else "-no_grad") for c in cases]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_every_strategy_matches_the_fp64_reference_out_and_grads(world):
    for per_rank in _results(world):
        for case in _cases(world):
            if not case[6]:
                continue
            tol = TOL[case[5]]
            for name in ("out", "dq", "dk", "dv"):
                assert per_rank[case][name] <= tol, (case, name, per_rank[case][name])


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_forward_only_cp_under_no_grad_matches_the_reference_and_records_no_graph(world):
    for per_rank in _results(world):
        for case in _cases(world):
            if case[6]:
                continue
            r = per_rank[case]
            assert r["out"] <= TOL[case[5]], (case, r)
            assert not r["requires_grad"] and not r["grad_fn"], (case, r)


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_ring_lse_under_cp_matches_the_reference_with_minus_inf_rows_kept(world):
    for per_rank in _results(world):
        lse_cases = [c for c in per_rank if c[0] == "ring_lse"]
        assert len(lse_cases) == 8
        for case in lse_cases:
            assert per_rank[case]["lse"] <= 1e-12, (case, per_rank[case])
            assert per_rank[case]["same_inf"], case


def test_layouts_put_documents_on_the_shard_and_zigzag_boundaries():
    # The layouts are what makes these tests hard: check they still say what the docstring says.
    ends = cu_seqlens(EDGES).tolist()
    assert sum(EDGES) == L and {128, 448, 512} <= set(ends) and 0 in EDGES
    assert 128 in ends and ends[ends.index(128) + 1] == 448  # a document over shards 1, 2 and 3 of 4
    starts_ends_of_ones = [(a, b) for a, b in zip(ends, ends[1:], strict=False) if b - a == 1]
    assert {(0, 1), (127, 128), (448, 449), (511, 512)} <= set(starts_ends_of_ones)
    halo_ends = cu_seqlens(HALO_EDGES).tolist()
    assert sum(HALO_EDGES) == L and max(HALO_EDGES) == HALO_LONGEST and {256, 512} <= set(halo_ends)
    assert (256, 257) in zip(halo_ends, halo_ends[1:], strict=False)
    assert sum(LAYOUTS["lognormal"]) == L and LAYOUTS["lognormal"].count(1) >= 3
