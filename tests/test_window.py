"""Sliding-window varlen attention against a float64 per-document reference.

# T packed tokens, H query heads, G key/value heads, K head dim, r query row, c key column
"""

from __future__ import annotations

import pytest
import torch
from functorch.compile import aot_function, make_boxed_func

from tests.reference import rel_err as _rel
from usp_graph import AttentionMetadata, sdpa_to_usp, varlen_attn
from usp_graph.graphfile import load_graph_module, save_graph_module
from usp_graph.ops import cpu_kernel
from usp_graph.ops import varlen as varlen_mod
from usp_graph.ops.window import flash_window

# (left, right) windows: causal-like, Mistral-style, symmetric, one-sided either way, diagonal only.
WINDOWS = [(-1, 0), (3, 0), (2, 2), (4, 1), (0, 0), (5, -1), (-1, 3), (0, 6), (40, 40)]
LENGTH_SETS = [[9, 0, 1, 13, 3], [1], [0, 17, 0], [6, 1, 1, 0, 11, 2]]


def _random_lengths(gen: torch.Generator, n_docs: int, max_len: int) -> list[int]:
    lens = torch.randint(0, max_len + 1, (n_docs,), generator=gen).tolist()
    lens[int(torch.randint(0, n_docs, (1,), generator=gen))] = 1
    lens[int(torch.randint(0, n_docs, (1,), generator=gen))] = 0
    return lens if sum(lens) else [3, *lens]


def _qkv(gen, t_q, t_k, h, g, k, dtype=torch.float64):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return r(t_q, h, k), r(t_k, g, k), r(t_k, g, k)


def _reference(q, k, v, cu_q, cu_k, is_causal, scale, window):
    """(out, lse) per document in float64, the window written out from its definition: query r of a
    document with lq queries and lk keys attends key c iff r + lk - lq - left <= c <= r + lk - lq
    + right (a -1 side unbounded), and c <= r + lk - lq when causal."""
    q, k, v = (x.double() for x in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    left, right = window
    outs, lses = [], []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if lq == 0:
            continue
        keep = torch.zeros(lq, lk, dtype=torch.bool)
        for r in range(lq):
            d = r + lk - lq
            for c in range(lk):
                ok = (left == -1 or c >= d - left) and (right == -1 or c <= d + right)
                keep[r, c] = ok and (not is_causal or c <= d)
        qd = q[bq[i] : bq[i + 1]].transpose(0, 1)
        kd = k[bk[i] : bk[i + 1]].transpose(0, 1).repeat_interleave(h // g, 0)
        vd = v[bk[i] : bk[i + 1]].transpose(0, 1).repeat_interleave(h // g, 0)
        s = (qd @ kd.transpose(-1, -2) * scale).masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see no key: 0
        outs.append((p @ vd).transpose(0, 1))
        lses.append(torch.logsumexp(s, -1))
    if not outs:
        return q.new_zeros(0, h, v.shape[-1]), q.new_zeros(h, 0)
    return torch.cat(outs), torch.cat(lses, 1)


def _grads(out, lse, inputs, g_out, g_lse):
    # Only finite lse entries carry a gradient (a row that sees no key has lse -inf and no inputs).
    g_lse = torch.where(lse.detach().isfinite(), g_lse, 0.0)
    return torch.autograd.grad((out, lse), inputs, (g_out.to(out.dtype), g_lse.to(lse.dtype)))


def _check(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, window, tol, scale=0.37, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, scale=scale,
                           enable_gqa=True, return_lse=True, window=window)  # fmt: skip
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref, ref_lse = _reference(q64, k64, v64, cu_q, cu_k, is_causal, scale, window)
    assert _rel(out, ref) <= tol
    assert torch.equal(lse.isfinite(), ref_lse.isfinite())  # the same rows see no key
    assert bool((lse[~lse.isfinite()] == float("-inf")).all())
    fin = ref_lse.isfinite()
    assert _rel(lse[fin], ref_lse[fin]) <= tol
    g_out = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    g_lse = torch.randn(lse.shape, generator=gen, dtype=torch.float64)
    got = _grads(out, lse, (q, k, v), g_out, g_lse)
    want = _grads(ref, ref_lse, (q64, k64, v64), g_out, g_lse)
    for name, a, b in zip("qkv", got, want, strict=True):
        assert _rel(a, b) <= tol, (name, _rel(a, b))


# ---- the op against the reference --------------------------------------------------------------


@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_matches_reference_on_random_documents_with_gqa(window, is_causal):
    gen = torch.Generator().manual_seed(hash((window, is_causal)) % 2**31)
    for lens in [*LENGTH_SETS, _random_lengths(gen, 7, 20)]:
        meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 2)
        q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, 4, 2, 8)
        cu, m = meta.cu_seqlens, meta.max_seqlen
        _check(q, k, v, cu, cu, m, m, is_causal, window, 1e-10)


@pytest.mark.parametrize("window", [(3, 0), (2, 2), (-1, 1)])
def test_window_in_float32_within_1e_5(window):
    gen = torch.Generator().manual_seed(3)
    meta = AttentionMetadata.from_lengths([12, 0, 1, 20, 5])
    q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, 4, 1, 16, torch.float32)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    _check(q, k, v, cu, cu, m, m, False, window, 1e-5)


@pytest.mark.parametrize("window", [(2, 0), (1, 3), (-1, 0), (0, -1), (4, 4), (-1, 2)])
@pytest.mark.parametrize("is_causal", [False, True])
def test_window_is_bottom_right_aligned_when_query_and_key_lengths_differ(window, is_causal):
    # shorter, longer, no queries, no keys, equal; rows above the window see no key (out 0, lse -inf)
    gen = torch.Generator().manual_seed(7)
    lq, lk = [3, 9, 0, 1, 4, 6], [8, 2, 3, 0, 4, 6]
    mq, mk = AttentionMetadata.from_lengths(lq), AttentionMetadata.from_lengths(lk)
    q, k, v = _qkv(gen, mq.total_tokens, mk.total_tokens, 4, 2, 8)
    _check(q, k, v, mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen, is_causal, window, 1e-10)


def test_rows_outside_the_window_give_zero_output_minus_inf_lse_and_zero_dq():
    gen = torch.Generator().manual_seed(4)
    cu_q = torch.tensor([0, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 2], dtype=torch.int32)  # 6 queries over 2 keys: d = r - 4
    q, k, v = _qkv(gen, 6, 2, 2, 2, 8)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 6, 2, return_lse=True, window=(-1, 1))  # rows 0-2 blind
    assert torch.equal(out[:3], torch.zeros_like(out[:3]))
    assert bool((lse[:, :3] == float("-inf")).all()) and bool(lse[:, 3:].isfinite().all())
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert torch.equal(dq[:3], torch.zeros_like(dq[:3]))
    assert all(bool(x.isfinite().all()) for x in (dq, dk, dv))


def test_long_documents_run_in_row_blocks_exactly(monkeypatch):
    # Documents longer than one block of query rows: the blocks' key ranges overlap, and their key
    # gradients are summed. Blocks of 32 rows (the kernel reads the size per call) keep it small.
    monkeypatch.setattr(cpu_kernel, "WINDOW_ROWS", 32)
    gen = torch.Generator().manual_seed(5)
    rows = cpu_kernel.WINDOW_ROWS
    lens = [rows * 2 + 7, 5, rows + 1]
    meta = AttentionMetadata.from_lengths(lens)
    q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, 2, 1, 4)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    for window, causal in (((40, 0), True), ((19, 12), False), ((-1, 5), False)):
        _check(q, k, v, cu, cu, m, m, causal, window, 1e-10)


@pytest.mark.parametrize("window", [(2, 0), (1, 2), (-1, 1)])
def test_math_path_matches_reference(window):
    # The CUDA fallback for dtypes/head dims flash does not take (run here on CPU tensors).
    gen = torch.Generator().manual_seed(6)
    cu_q = torch.tensor([0, 4, 4, 11], dtype=torch.int32)
    cu_k = torch.tensor([0, 6, 7, 12], dtype=torch.int32)
    q, k, v = (x.detach() for x in _qkv(gen, 11, 12, 4, 2, 8))
    args = (cu_q, cu_k, 7, 6, False, 0.4, *window)
    out, lse = varlen_mod._math_fwd(q, k, v, *args)
    ref, ref_lse = _reference(q, k, v, cu_q, cu_k, False, 0.4, window)
    assert _rel(out, ref) <= 1e-12
    assert torch.equal(lse.isfinite(), ref_lse.isfinite())
    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    got = varlen_mod._math_bwd(dout, q, k, v, out, lse, *args)
    want = varlen_mod._cpu_bwd(dout, q, k, v, out, lse, *args)
    for a, b in zip(got, want, strict=True):
        assert _rel(a, b) <= 1e-12


@pytest.mark.parametrize("window", [(2, 0), (1, 1)])
def test_gradcheck_float64_with_lse(window):
    gen = torch.Generator().manual_seed(8)
    cu_q = torch.tensor([0, 3, 3, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 5, 10], dtype=torch.int32)
    q, k, v = _qkv(gen, 8, 10, 4, 2, 4)

    def f(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, 5, 5, is_causal=window[1] == 0, scale=0.6,
                           enable_gqa=True, return_lse=True, window=window)  # fmt: skip

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_opcheck_passes_with_window_arguments():
    gen = torch.Generator().manual_seed(9)
    cu = AttentionMetadata.from_lengths([5, 0, 1, 6], max_docs=6).cu_seqlens
    q, k, v = (x.detach() for x in _qkv(gen, 12, 12, 4, 2, 8))
    fwd_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), cu, cu, 6, 6, False, 0.3, 2, 1)
    for result in torch.library.opcheck(torch.ops.usp.varlen_fwd.default, fwd_args).values():
        assert result == "SUCCESS"
    out, lse = torch.ops.usp.varlen_fwd(q.detach(), k.detach(), v.detach(), *fwd_args[3:])
    bwd_args = (
        torch.randn_like(out),
        q.detach(),
        k.detach(),
        v.detach(),
        out,
        lse,
        cu,
        cu,
        6,
        6,
        False,
        0.3,
        2,
        1,
    )
    for result in torch.library.opcheck(torch.ops.usp.varlen_bwd.default, bwd_args).values():
        assert result == "SUCCESS"


# ---- no window is the old code, bit for bit ----------------------------------------------------


def _run(q, k, v, cu, m, **kw):
    q, k, v = (x.detach().clone().requires_grad_() for x in (q, k, v))
    out, lse = varlen_attn(q, k, v, cu, cu, m, m, enable_gqa=True, return_lse=True, **kw)
    grads = torch.autograd.grad((out, lse), (q, k, v), (torch.ones_like(out), torch.full_like(lse, 0.5)))
    return (out, lse, *grads)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_no_window_and_windows_that_cut_nothing_are_bitwise_the_windowless_path(dtype, is_causal):
    gen = torch.Generator().manual_seed(10)
    meta = AttentionMetadata.from_lengths([9, 0, 1, 13, 3])
    q, k, v = _qkv(gen, 26, 26, 4, 2, 8, dtype)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    base = _run(q, k, v, cu, m, is_causal=is_causal)
    for window in (None, (-1, -1), (12, 12), (-1, 12), (12, -1), (40, 0 if is_causal else 40)):
        for a, b in zip(base, _run(q, k, v, cu, m, is_causal=is_causal, window=window), strict=True):
            assert torch.equal(a, b), window
    if not is_causal:  # right = 0 is causal
        causal = _run(q, k, v, cu, m, is_causal=True)
        for a, b in zip(causal, _run(q, k, v, cu, m, window=(-1, 0)), strict=True):
            assert torch.equal(a, b)


def test_windowless_calls_trace_the_old_nine_argument_op():
    from torch.fx.experimental.proxy_tensor import make_fx

    cu = torch.tensor([0, 3, 7], dtype=torch.int32)

    def attention(window):
        return lambda x: varlen_attn(x, x, x, cu, cu, 4, 4, is_causal=True, window=window)

    for window, n_args in ((None, 9), ((-1, -1), 9), ((2, 0), 11)):
        gm = make_fx(attention(window))(torch.randn(7, 2, 8))
        node = next(n for n in gm.graph.nodes if n.target == torch.ops.usp.varlen_fwd.default)
        assert len(node.args) == n_args


def test_old_style_calls_without_window_arguments_run_and_graph_files_replay(tmp_path):
    # A graph saved before the window arguments existed calls the ops with 9 / 12 arguments; the
    # schema's defaults fill them in, on load (schema check) and on replay.
    graphs = []

    def keep(gm, _inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    cu = torch.tensor([0, 3, 3, 9], dtype=torch.int32)
    x = torch.randn(9, 2, 8, dtype=torch.float64, requires_grad=True)
    w = torch.randn(8, 8, dtype=torch.float64, requires_grad=True)

    def step(window):
        return lambda x, w, cu: (
            torch.ops.usp.varlen_fwd(x @ w, x, x, cu, cu, 6, 6, True, 0.5, *window)[0].sin().sum()
        )

    for window in ((), (2, 0)):
        fn = step(window)
        graphs.clear()
        aot_function(fn, fw_compiler=keep, bw_compiler=keep)(x, w, cu).backward()
        n_args = {n.target: len(n.args) for g in graphs for n in g.graph.nodes if n.op == "call_function"}
        assert n_args[torch.ops.usp.varlen_fwd.default] == 9 + len(window)
        assert n_args[torch.ops.usp.varlen_bwd.default] == 12 + len(window)
        for i, gm in enumerate(graphs):
            save_graph_module(gm, tmp_path / f"g{i}.json")
            f = load_graph_module(tmp_path / f"g{i}.json")
            args = [
                torch.randn(s.shape, dtype=s.dtype) if s.dtype.is_floating_point else cu for s in f.inputs
            ]
            for a, b in zip(gm(*args), f(*args), strict=True):
                assert (a is None and b is None) or torch.equal(a, b)
    ref = varlen_attn(x, x, x, cu, cu, 6, 6, is_causal=True, scale=0.5)
    assert torch.equal(torch.ops.usp.varlen_fwd(x, x, x, cu, cu, 6, 6, True, 0.5)[0], ref)


# ---- public wrappers ---------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [(-2, 0), (0, -3), (1,), (1, 2, 3), "ab", (True, 0), (1.0, 2), 3, [None, 1]])
def test_a_malformed_window_is_a_value_error_naming_the_form(bad):
    cu = torch.tensor([0, 4], dtype=torch.int32)
    x = torch.randn(4, 2, 8)
    with pytest.raises(ValueError, match=r"window must be None or \(left, right\)"):
        varlen_attn(x, x, x, cu, cu, 4, 4, window=bad)
    with pytest.raises(ValueError, match=r"window must be None or \(left, right\)"):
        sdpa_to_usp(x.view(1, 2, 4, 8), x.view(1, 2, 4, 8), x.view(1, 2, 4, 8), window=bad)


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_to_usp_forwards_the_window(is_causal):
    gen = torch.Generator().manual_seed(12)
    meta = AttentionMetadata.from_lengths([7, 0, 1, 8])
    q = torch.randn(2, 4, 8, 8, generator=gen, dtype=torch.float64)
    k = torch.randn(2, 2, 8, 8, generator=gen, dtype=torch.float64)
    v = torch.randn(2, 2, 8, 8, generator=gen, dtype=torch.float64)
    pack = lambda x: x.transpose(1, 2).reshape(16, x.shape[1], 8)  # noqa: E731
    for metadata, cu in ((meta, meta.cu_seqlens), (None, torch.tensor([0, 8, 16], dtype=torch.int32))):
        out = sdpa_to_usp(q, k, v, is_causal=is_causal, enable_gqa=True, metadata=metadata, window=(2, 1))
        ref, _ = _reference(pack(q), pack(k), pack(v), cu, cu, is_causal, 8**-0.5, (2, 1))
        assert _rel(pack(out), ref) <= 1e-12


# ---- the CUDA flash arguments, checked against flash's documented rules -------------------------


def _flash_keep(lq, lk, max_k, is_causal, left, right):
    """Which keys flash-attention 2's varlen kernel keeps, following flash_api.cpp (mha_varlen_fwd,
    set_params_fprop) and the kernel's mask (row r keeps c in [d - left, d + right], d = r + lk - lq)."""
    if is_causal:
        right = 0
    if left >= max_k:
        left = -1
    if right >= max_k:
        right = -1
    if left < 0 and right >= 0:
        left = max_k
    if left >= 0 and right < 0:
        right = max_k
    keep = torch.ones(lq, lk, dtype=torch.bool)
    if left >= 0 or right >= 0:
        d = torch.arange(lq).unsqueeze(1) + lk - lq
        c = torch.arange(lk).unsqueeze(0)
        keep = (c >= d - left) & (c <= d + right)
    return keep


def test_flash_window_arguments_keep_exactly_the_window_under_flashs_rules():
    # No GPU here: model flash's handling of window_size and max_seqlen_k, and check that the
    # arguments `_flash_fwd/_flash_bwd` pass keep exactly the reference's keys for every shape,
    # including views with more queries than keys (where flash's own clamps would drop keys).
    for lq in range(1, 9):
        for lk in range(1, 9):
            for left in (-1, 0, 1, 3, 7):
                for right in (-1, 0, 2, 6):
                    if (left, right) == (-1, -1):
                        continue
                    for is_causal in (False, True):
                        max_k, kw = flash_window(lq, lk, is_causal, left, right)
                        got = _flash_keep(
                            lq, lk, max_k, is_causal, kw["window_size_left"], kw["window_size_right"]
                        )
                        d = torch.arange(lq).unsqueeze(1) + lk - lq
                        c = torch.arange(lk).unsqueeze(0)
                        r_eff = 0 if is_causal else right
                        want = ((c >= d - left) | (left == -1)) & ((c <= d + r_eff) | (r_eff == -1))
                        assert torch.equal(got, want), (lq, lk, left, right, is_causal)
    assert flash_window(5, 7, True, -1, -1) == (7, {})


@pytest.mark.parametrize("window", [(-7, 0), (3, -9)], ids=["left", "right"])
def test_the_ops_refuse_a_window_below_minus_one_as_a_graph_file_could_pass_it(window):
    q = torch.randn(8, 2, 4)
    cu = torch.tensor([0, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="two ints >= 0, or -1 for an unbounded side"):
        torch.ops.usp.varlen_fwd(q, q, q, cu, cu, 8, 8, False, 0.5, *window)
    with pytest.raises(ValueError, match="two ints >= 0, or -1 for an unbounded side"):
        torch.ops.usp.varlen_bwd(q, q, q, q, q, q[:, :, 0].T.contiguous(), cu, cu, 8, 8, False, 0.5, *window)
