"""The ring op runs at most one varlen kernel call per ring step and kernel-argument group (one per
windowless step), merges each step in one pass, and stays exact and bitwise repeatable (issue 19).

# H heads, G kv heads, K head dim, T global tokens, C chunks per rank, R ring ranks (2)

Direct calls of ``usp::ring_attn_fwd`` (and, through autograd, ``usp::ring_attn_bwd``) on 2 gloo
ranks, on two chunk layouts: zigzag (C = 2) and the chunks a ring member holds under 2-D USP
(Ulysses degree 2 over 4 CP ranks, zigzag: C = 4, no two of a rank's chunks adjacent in order).
Documents are random, with an empty one, length-1 ones and one ending exactly on a chunk boundary;
GQA; windowless causal and bidirectional, and windows bounded on the left, on the right, and both
(so the 'before' and 'after' pairs of `_pair_plan` run). Every case is checked against the fp64
per-document reference (`usp_graph.testing.attention_reference`), counted, and run twice.
"""

from __future__ import annotations

import pytest
import torch

from tests.dist import run_ranks
from usp_graph.ops.window import NO_WINDOW
from usp_graph.testing import attention_reference, cu_seqlens, document_mask, lognormal_lengths, rel_err

H, G, K, CHUNK, R = 4, 2, 8, 12, 2
# Chunk ids of ring ranks 0 and 1, back to back.
LAYOUTS = {
    "zigzag": (2, [0, 3, 1, 2]),
    # 2-D USP, Ulysses degree 2 over CP ranks 0-3 with zigzag chunks [r, 7 - r]: ring member i
    # holds the chunks of CP ranks 2i and 2i + 1.
    "2d": (4, [0, 7, 1, 6, 2, 5, 3, 4]),
}
# (is_causal, window): the windows are a chunk or two wide, so they cut pairs of chunks.
MODES = {
    "causal": (True, NO_WINDOW),
    "bidirectional": (False, NO_WINDOW),
    "left_only": (True, (17, -1)),
    "right_only": (False, (-1, 14)),
    "both": (False, (9, 20)),
}
CASES = [(layout, mode) for layout in LAYOUTS for mode in MODES]
TOL = 1e-12  # fp64; the pair-by-pair op was seen at ~1e-15


def _lengths(layout: str, mode: str) -> list[int]:
    """An empty document, a length-1 one, one ending on the first chunk boundary, one crossing
    several chunks, then log-normal lengths with more of the empty and length-1 kind."""
    total = CHUNK * len(LAYOUTS[layout][1])
    head = [0, 1, CHUNK - 1, 2 * CHUNK + 5]
    rest = lognormal_lengths(total - sum(head), 7, sum(map(ord, layout + mode)), ones=2, empty=1)
    return head + rest


def _inputs(layout: str, mode: str):
    gen = torch.Generator().manual_seed(sum(map(ord, mode + layout)))
    t = CHUNK * len(LAYOUTS[layout][1])
    q_THK, go_THK = (torch.randn(t, H, K, generator=gen, dtype=torch.float64) for _ in range(2))
    k_TGK, v_TGK = (torch.randn(t, G, K, generator=gen, dtype=torch.float64) for _ in range(2))
    return q_THK, k_TGK, v_TGK, go_THK


def _groups(rank: int, layout: str, mode: str) -> tuple[list[set], list[int], list[str]]:
    """Per ring step of `rank`: the distinct kernel-argument groups (causal flag, kernel window)
    among its pairs with work, and the number of those pairs (the kernel calls of the op before
    issue 19); the kinds of pair met. Read off `_pair_plan` alone."""
    from usp_graph.ops.ring import _pair_plan

    c, ids = LAYOUTS[layout]
    causal, window = MODES[mode]
    steps = []
    for step in range(R):
        src = (rank - step) % R
        plans = [
            _pair_plan(qc, kc, CHUNK, causal, window)
            for qc in ids[rank * c : (rank + 1) * c]
            for kc in ids[src * c : (src + 1) * c]
        ]
        steps.append([p for p in plans if p is not None])
    return (
        [{(kind == "causal", tuple(win) or NO_WINDOW) for kind, _, win in plans} for plans in steps],
        [len(plans) for plans in steps],
        sorted({kind for plans in steps for kind, _, _ in plans}),
    )


def _local(x: torch.Tensor, rank: int, layout: str) -> torch.Tensor:
    c, ids = LAYOUTS[layout]
    return torch.cat([x[i * CHUNK : (i + 1) * CHUNK] for i in ids[rank * c : (rank + 1) * c]])


def _run(rank: int, layout: str, mode: str, group_name: str) -> dict:
    """One forward and backward of the ring op on this rank's chunks, with its varlen kernel calls
    counted (through the CPU kernel globals of `usp_graph.ops.varlen`, one per op call) and, per
    step, the calls and query rows the op planned (`ring._calls` runs once per step, forward then
    backward)."""
    from usp_graph.ops import ring, varlen

    c, ids = LAYOUTS[layout]
    causal, window = MODES[mode]
    lens = _lengths(layout, mode)
    q, k, v, go = (_local(x, rank, layout) for x in _inputs(layout, mode))
    ql, kl, vl = (x.clone().requires_grad_() for x in (q, k, v))
    counts = {"fwd": 0, "bwd": 0}
    steps = []  # (calls, query rows of all calls) per step
    saved = varlen._cpu_fwd, varlen._cpu_bwd, ring._calls

    def counted(name, fn):
        def run(*args):
            counts[name] += 1
            return fn(*args)

        return run

    def planned(views):
        calls = saved[2](views)
        rows = sum(sum(r.stop - r.start for r in p.rows) + p.dummy for call in calls for p in call.views)
        steps.append((len(calls), rows))
        return calls

    varlen._cpu_fwd, varlen._cpu_bwd, ring._calls = (
        counted("fwd", saved[0]),
        counted("bwd", saved[1]),
        planned,
    )
    try:
        out, lse = torch.ops.usp.ring_attn_fwd(
            ql, kl, vl, cu_seqlens(lens), max(lens), causal, K**-0.5, ids, c, group_name,
            window_left=window[0], window_right=window[1],
        )  # fmt: skip
        out.backward(go)
    finally:
        varlen._cpu_fwd, varlen._cpu_bwd, ring._calls = saved
    return {"out": out.detach(), "lse": lse, "dq": ql.grad, "dk": kl.grad, "dv": vl.grad, "calls": counts,
            "steps": steps}  # fmt: skip


def _ring_step_cases(rank: int, world: int) -> dict:
    import torch.distributed as dist

    import usp_graph.ops  # noqa: F401  (registers the ops)

    group_name = dist.group.WORLD.group_name
    results = {}
    for layout, mode in CASES:
        first = _run(rank, layout, mode, group_name)
        again = _run(rank, layout, mode, group_name)
        causal, window = MODES[mode]
        lens = _lengths(layout, mode)
        q, k, v, go = _inputs(layout, mode)
        q, k, v = (x.clone().requires_grad_() for x in (q, k, v))
        ref_out, ref_lse = attention_reference(q, k, v, cu_seqlens(lens), is_causal=causal, window=window)
        ref = dict(zip(("dq", "dk", "dv"), torch.autograd.grad(ref_out, (q, k, v), go), strict=True))
        ref["out"] = ref_out.detach()
        ref_lse = _local(ref_lse.detach().T, rank, layout).T
        finite = torch.isfinite(ref_lse)
        groups, pairs, kinds = _groups(rank, layout, mode)
        results[(layout, mode)] = {
            **{n: rel_err(first[n], _local(ref[n], rank, layout)) for n in ("out", "dq", "dk", "dv")},
            "lse": rel_err(first["lse"][finite], ref_lse[finite]),
            "same_inf": bool(torch.equal(torch.isinf(first["lse"]), ~finite)),
            "bitwise": all(torch.equal(first[n], again[n]) for n in ("out", "lse", "dq", "dk", "dv")),
            "calls": first["calls"],
            "steps": first["steps"],
            "groups": [len(g) for g in groups],
            "pairs": pairs,
            "kinds": kinds,
        }
    results["short"] = _short_boundaries(rank, group_name)
    return results


def _short_boundaries(rank: int, group_name: str) -> str:
    """The error of a call whose boundaries stop short of the stream's end (packing pairs into one
    call needs every view to reach its chunk's end)."""
    c, ids = LAYOUTS["zigzag"]
    q, k, v, _ = (_local(x, rank, "zigzag") for x in _inputs("zigzag", "causal"))
    try:
        torch.ops.usp.ring_attn_fwd(q, k, v, cu_seqlens([10, 20]), 20, True, 1.0, ids, c, group_name)
    except RuntimeError as e:
        return str(e)
    return ""


_RESULTS: list[dict] = []


def _results() -> list[dict]:
    """Both ranks' results of every case: one call for the whole module."""
    if not _RESULTS:
        _RESULTS.extend(run_ranks(_ring_step_cases, R))
    return _RESULTS


@pytest.mark.slow
def test_ring_runs_at_most_one_kernel_call_per_step_and_kernel_argument_group():
    for per_rank in _results():
        for case in CASES:
            r = per_rank[case]
            planned = [n for n, _ in r["steps"]]
            assert planned == [n for n, _ in r["steps"][:R]] * 2, (case, r)  # backward: the same calls
            assert r["calls"] == {"fwd": sum(planned[:R]), "bwd": sum(planned[R:])}, (case, r)
            assert all(n <= g for n, g in zip(planned[:R], r["groups"], strict=True)), (case, r)


@pytest.mark.slow
def test_windowless_zigzag_and_2d_steps_are_one_call_over_each_query_row_once():
    local = {layout: c * CHUNK for layout, (c, _) in LAYOUTS.items()}
    for rank, per_rank in enumerate(_results()):
        for layout in LAYOUTS:
            for mode in ("causal", "bidirectional"):
                r = per_rank[(layout, mode)]
                assert [n for n, _ in r["steps"]] == [1] * 2 * R, (rank, layout, mode, r["steps"])
                assert all(rows <= local[layout] for _, rows in r["steps"]), (rank, layout, mode, r["steps"])
        # One call per step where the pairs were 3 and 2 (zigzag causal), 4 and 4 (zigzag
        # bidirectional), 16 and 16 (2-D bidirectional).
        assert per_rank[("zigzag", "causal")]["pairs"] == [3, 2], rank
        assert per_rank[("zigzag", "bidirectional")]["pairs"] == [4, 4], rank
        assert per_rank[("2d", "bidirectional")]["pairs"] == [16, 16], rank


@pytest.mark.slow
def test_boundaries_short_of_the_stream_end_are_refused():
    for per_rank in _results():
        assert "cu_seqlens must run from 0 to the 48 tokens of the stream" in per_rank["short"]


@pytest.mark.slow
def test_cases_run_every_kind_of_pair():
    kinds = {k for per_rank in _results() for case in CASES for k in per_rank[case]["kinds"]}
    assert kinds == {"full", "causal", "before", "after"}


@pytest.mark.slow
def test_ring_steps_match_the_fp64_reference_forward_and_backward():
    for per_rank in _results():
        for case in CASES:
            r = per_rank[case]
            for name in ("out", "lse", "dq", "dk", "dv"):
                assert r[name] <= TOL, (case, name, r[name])
            assert r["same_inf"], case


@pytest.mark.slow
def test_ring_steps_are_bitwise_repeatable():
    for per_rank in _results():
        for case in CASES:
            assert per_rank[case]["bitwise"], case


def test_step_merge_copies_first_partials_and_keeps_untouched_rows_bitwise():
    from usp_graph.ops.ring import _merge_step

    gen = torch.Generator().manual_seed(19)
    t, n = 12, 4  # three query chunks of 4 rows
    out, lse = (
        torch.zeros(t, H, K, dtype=torch.float64),
        torch.full((H, t), float("-inf"), dtype=torch.float64),
    )
    seen = [False] * 3
    parts = {}  # rows -> every partial (o, lse) they got, for the reference

    def part(qi, r0, r1):
        o_p, lse_p = torch.randn(r1 - r0, H, K, generator=gen), torch.randn(H, r1 - r0, generator=gen)
        o_p, lse_p = o_p.double(), lse_p.double()
        parts.setdefault(qi, []).append((slice(r0, r1), o_p, lse_p))
        return qi, slice(r0, r1), o_p, lse_p

    first = [part(0, 0, n), part(1, n, 2 * n), part(1, n, n + 2)]  # chunk 1: a full and a 2-row partial
    _merge_step(out, lse, first, seen)
    assert torch.equal(out[:n], first[0][2]) and torch.equal(lse[:, :n], first[0][3])  # copied
    assert torch.equal(out[2 * n :], torch.zeros(n, H, K, dtype=torch.float64))  # untouched chunk 2
    assert torch.isneginf(lse[:, 2 * n :]).all() and seen == [True, True, False]
    _merge_step(out, lse, [part(2, 2 * n, 3 * n)], seen)
    chunk1 = out[n : 2 * n].clone(), lse[:, n : 2 * n].clone()
    _merge_step(out, lse, [part(0, 0, n), part(2, 2 * n, 3 * n - 1), part(0, 0, 1)], seen)
    # Chunk 1 lies inside the rows this step merged, with no partial of its own: weight exp(0) = 1.
    assert torch.equal(out[n : 2 * n], chunk1[0]) and torch.equal(lse[:, n : 2 * n], chunk1[1])
    for rows_parts in parts.values():  # each row's result is the softmax-weighted union of its partials
        ref_lse = torch.full_like(lse, float("-inf"))
        for rows, _, lse_p in rows_parts:
            ref_lse[:, rows] = torch.logaddexp(ref_lse[:, rows], lse_p)
        ref_out = torch.zeros_like(out)
        for rows, o_p, lse_p in rows_parts:
            ref_out[rows] += o_p * torch.exp(lse_p - ref_lse[:, rows]).T.unsqueeze(-1)
        rows = slice(min(r.start for r, _, _ in rows_parts), max(r.stop for r, _, _ in rows_parts))
        assert rel_err(out[rows], ref_out[rows]) <= 1e-14
        assert rel_err(lse[:, rows], ref_lse[:, rows]) <= 1e-14


# Query chunks against key chunks as ring steps meet them (zigzag and 2-D, the first step and a
# later one), and sets that overlap in part (a query chunk's own diagonal among foreign keys).
VIEW_LAYOUTS = [([0, 3], [0, 3]), ([0, 3], [1, 2]), ([1, 2], [0, 3]), ([0, 7, 1, 6], [2, 5, 3, 4]),
                ([2, 5, 3, 4], [0, 7, 1, 6]), ([0, 2, 3], [1, 2, 4]), ([4, 1], [4, 0])]  # fmt: skip
VIEW_MODES = [*MODES.values(), (True, (5, 0)), (False, (0, 0)), (False, (30, 2))]


@pytest.mark.parametrize("q_ids, k_ids", VIEW_LAYOUTS)
def test_views_cover_every_query_key_pair_of_a_step_exactly_once(q_ids, k_ids):
    # What each view's kernel call attends (its boundaries, causal flag and kernel window under the
    # varlen contract, dummy and dropped rows left out), mapped back to global positions, must add
    # up to the attention of the whole stream restricted to these queries and keys: every entry once.
    from usp_graph.ops.ring import _views

    chunk = 6
    lens = [0, 1, 5, 13, 1, 0, 9, 1, 6, 12]  # 48 tokens, chunks 0-7; 6 and 36 are chunk boundaries
    cu = cu_seqlens(lens)
    for causal, window in VIEW_MODES:
        cover = torch.zeros(48, 48, dtype=torch.int)
        for v in _views(q_ids, k_ids, chunk, cu, causal, max(lens), window):
            q_pos = torch.cat(
                [torch.arange(sl.start, sl.stop) % chunk + q_ids[sl.start // chunk] * chunk for sl in v.rows]
            )
            k_pos = torch.cat(
                [torch.arange(sl.start, sl.stop) % chunk + k_ids[sl.start // chunk] * chunk for sl in v.keys]
            )
            keep = document_mask(v.cu_q, v.cu_k, is_causal=v.causal, window=tuple(v.window) or None,
                                 total_q=len(q_pos) + v.dummy, total_k=len(k_pos))[: len(q_pos)]  # fmt: skip
            if v.valid is not None:
                keep &= v.valid.unsqueeze(1)
            cover[q_pos.unsqueeze(1), k_pos.unsqueeze(0)] += keep.int()
        ref = document_mask(cu, is_causal=causal, window=None if window == NO_WINDOW else window).int()
        rows = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in q_ids])
        cols = torch.cat([torch.arange(c * chunk, (c + 1) * chunk) for c in k_ids])
        sub = torch.zeros_like(ref)
        sub[rows.unsqueeze(1), cols.unsqueeze(0)] = ref[rows.unsqueeze(1), cols.unsqueeze(0)]
        assert torch.equal(cover, sub), (q_ids, k_ids, causal, window)
