"""usp::varlen_fwd/bwd against a per-document reference in float64.

# T packed tokens, H query heads, G key/value heads, K head dim
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.reference import rel_err as _rel
from usp_graph import AttentionMetadata, registry, varlen_attn

# Lengths with empty and length-1 documents in every position that matters.
LENGTH_SETS = [[5, 0, 1, 7, 3], [1], [0, 4, 0], [9, 1, 1, 0, 6, 2]]


def _random_lengths(gen: torch.Generator, n_docs: int, max_len: int) -> list[int]:
    lens = torch.randint(0, max_len + 1, (n_docs,), generator=gen).tolist()
    lens[int(torch.randint(0, n_docs, (1,), generator=gen))] = 1
    lens[int(torch.randint(0, n_docs, (1,), generator=gen))] = 0
    if sum(lens) == 0:
        lens[0] = 3
    return lens


def _qkv(gen, t_q, t_k, h, g, k, dtype):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return r(t_q, h, k), r(t_k, g, k), r(t_k, g, k)


def _reference(q, k, v, cu_q, cu_k, is_causal, scale):
    """Per-document math SDPA in float64 with an explicit bottom-right causal mask."""
    q, k, v = (x.double() for x in (q, k, v))
    h, g = q.shape[1], k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs = []
    bq, bk = cu_q.tolist(), cu_k.tolist()
    for i in range(len(bq) - 1):
        lq, lk = bq[i + 1] - bq[i], bk[i + 1] - bk[i]
        if lq == 0:
            continue
        qd = q[bq[i] : bq[i + 1]].transpose(0, 1)
        kd = k[bk[i] : bk[i + 1]].transpose(0, 1).repeat_interleave(h // g, 0)
        vd = v[bk[i] : bk[i + 1]].transpose(0, 1).repeat_interleave(h // g, 0)
        s = qd @ kd.transpose(-1, -2) * scale
        if is_causal:
            keep = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
            s = s.masked_fill(~keep, float("-inf"))
        p = torch.softmax(s, -1).nan_to_num(0.0)  # rows that see no key: 0
        outs.append((p @ vd).transpose(0, 1))
    return torch.cat(outs) if outs else q.new_zeros(0, h, v.shape[-1])


def _check_against_reference(q, k, v, cu_q, cu_k, max_q, max_k, is_causal, scale, tol):
    gen = torch.Generator().manual_seed(1234)
    out = varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, is_causal=is_causal, scale=scale, enable_gqa=True)
    q64, k64, v64 = (x.detach().double().requires_grad_() for x in (q, k, v))
    ref = _reference(q64, k64, v64, cu_q, cu_k, is_causal, scale)
    assert _rel(out, ref) <= tol
    g = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), g.to(out.dtype))
    rq, rk, rv = torch.autograd.grad(ref, (q64, k64, v64), g)
    for got, want in ((dq, rq), (dk, rk), (dv, rv)):
        assert _rel(got, want) <= tol


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("heads", [(4, 4), (4, 2), (6, 1)])
def test_varlen_matches_per_document_reference(dtype, tol, is_causal, heads):
    gen = torch.Generator().manual_seed(hash((str(dtype), is_causal, heads)) % 2**31)
    h, g = heads
    for lens in [*LENGTH_SETS, _random_lengths(gen, 8, 24)]:
        meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 2)
        q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, h, g, 16, dtype)
        cu = meta.cu_seqlens
        _check_against_reference(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, is_causal, 0.37, tol)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
def test_causal_is_bottom_right_when_query_and_key_lengths_differ(dtype, tol):
    gen = torch.Generator().manual_seed(7)
    lq, lk = [3, 6, 0, 1, 4], [5, 2, 3, 0, 4]  # shorter, longer, no queries, no keys, equal
    mq, mk = AttentionMetadata.from_lengths(lq), AttentionMetadata.from_lengths(lk)
    q, k, v = _qkv(gen, mq.total_tokens, mk.total_tokens, 4, 2, 8, dtype)
    _check_against_reference(
        q, k, v, mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen, True, 8**-0.5, tol
    )


def test_rows_that_see_no_key_give_zero_output_and_minus_inf_lse():
    gen = torch.Generator().manual_seed(3)
    cu_q = torch.tensor([0, 4, 6], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 2], dtype=torch.int32)  # doc 0: 4 queries over 2 keys; doc 1: no keys
    q, k, v = _qkv(gen, 6, 2, 2, 2, 8, torch.float64)
    out, lse = varlen_attn(q, k, v, cu_q, cu_k, 4, 2, is_causal=True, return_lse=True)
    assert torch.equal(out[:2], torch.zeros_like(out[:2])) and torch.equal(out[4:], torch.zeros_like(out[4:]))
    assert bool((lse[:, [0, 1, 4, 5]] == float("-inf")).all())
    assert bool(lse[:, 2:4].isfinite().all())
    dq, dk, dv = torch.autograd.grad(out.sum(), (q, k, v))
    assert bool(dq.isfinite().all() and dk.isfinite().all() and dv.isfinite().all())
    assert torch.equal(dq[:2], torch.zeros_like(dq[:2]))


@pytest.mark.parametrize("window", [(-1, -1), (1, 0)], ids=["plain", "window"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_a_nan_query_gives_a_nan_row_not_a_finite_one(is_causal, window):
    # The CPU flash kernel gives a query row holding a NaN out 0 and lse 0: a finite loss over a NaN
    # input. usp makes it NaN, as the math attention does; every other row is unchanged bit for bit.
    gen = torch.Generator().manual_seed(5)
    cu_q = torch.tensor([0, 4, 6, 9], dtype=torch.int32)
    cu_k = torch.tensor([0, 2, 2, 5], dtype=torch.int32)  # doc 0: rows 0-1 see no key (causal); doc 1: none
    q, k, v = _qkv(gen, 9, 5, 2, 2, 8, torch.float64)
    clean = varlen_attn(q, k, v, cu_q, cu_k, 4, 3, is_causal=is_causal, return_lse=True, window=window)
    bad = q.detach().clone()
    bad[[0, 3, 5, 7], 1, 2] = float("nan")  # head 1 of: a blind row (if causal), a row, a keyless doc, a row
    out, lse = varlen_attn(bad, k, v, cu_q, cu_k, 4, 3, is_causal=is_causal, return_lse=True, window=window)
    blind = is_causal or window != (-1, -1)  # row 0 sees no key when causal or windowed (bottom-right)
    for row in (3, 7) + (() if blind else (0,)):  # rows that see keys
        assert bool(out[row, 1].isnan().all()) and bool(lse[1, row].isnan()), row
    for row in (5,) + ((0,) if blind else ()):  # sees no key: out 0, lse -inf, NaN or not
        assert torch.equal(out[row], torch.zeros_like(out[row])) and lse[1, row] == float("-inf")
    keep = torch.ones(9, 2, dtype=torch.bool)
    keep[[0, 3, 5, 7], 1] = False
    assert torch.equal(out[keep], clean[0][keep]) and torch.equal(lse.t()[keep], clean[1].t()[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("is_causal", [False, True])
def test_half_precision_close_to_float64_reference(dtype, is_causal):
    gen = torch.Generator().manual_seed(11)
    meta = AttentionMetadata.from_lengths([17, 0, 1, 30, 12])
    q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, 4, 2, 32, dtype)
    cu = meta.cu_seqlens
    _check_against_reference(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, is_causal, None, 2e-2)


@pytest.mark.parametrize("is_causal", [False, True])
def test_gradcheck_float64(is_causal):
    gen = torch.Generator().manual_seed(5)
    meta = AttentionMetadata.from_lengths([3, 0, 1, 4], max_docs=6)
    q, k, v = _qkv(gen, 8, 8, 4, 2, 4, torch.float64)
    cu, m = meta.cu_seqlens, meta.max_seqlen

    def f(q, k, v):
        return varlen_attn(
            q, k, v, cu, cu, m, m, is_causal=is_causal, scale=0.6, enable_gqa=True, return_lse=True
        )

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_gradcheck_lse_with_unequal_lengths():
    gen = torch.Generator().manual_seed(6)
    cu_q = torch.tensor([0, 2, 5], dtype=torch.int32)
    cu_k = torch.tensor([0, 4, 7], dtype=torch.int32)
    q, k, v = _qkv(gen, 5, 7, 2, 1, 4, torch.float64)

    def f(q, k, v):
        return varlen_attn(q, k, v, cu_q, cu_k, 3, 4, is_causal=True, enable_gqa=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


def test_opcheck_passes_for_both_ops():
    gen = torch.Generator().manual_seed(8)
    meta = AttentionMetadata.from_lengths([3, 0, 1, 4], max_docs=6)
    q, k, v = _qkv(gen, 8, 8, 4, 2, 8, torch.float64)
    cu = meta.cu_seqlens
    fwd_args = (q, k, v, cu, cu, 4, 4, True, 0.3)
    for result in torch.library.opcheck(torch.ops.usp.varlen_fwd.default, fwd_args).values():
        assert result == "SUCCESS"
    out, lse = torch.ops.usp.varlen_fwd(*(x.detach() if isinstance(x, torch.Tensor) else x for x in fwd_args))
    bwd_args = (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, cu, cu, 4, 4, True, 0.3)
    for result in torch.library.opcheck(torch.ops.usp.varlen_bwd.default, bwd_args).values():
        assert result == "SUCCESS"


@pytest.mark.parametrize("causal", [True, False])
def test_keys_outside_every_document_are_unused_and_get_zero_gradient(causal):
    # A key window padded on both sides (what the halo strategy hands the op): cu_k starts after 0
    # and ends before the key count. Same result as the unpadded keys; zero grads on the padding.
    gen = torch.Generator().manual_seed(11)
    lens = [3, 0, 1, 5]
    cu = AttentionMetadata.from_lengths(lens, max_docs=6).cu_seqlens
    q, k, v = _qkv(gen, 9, 9, 4, 2, 8, torch.float64)
    pad = lambda x, a, b: torch.cat([torch.randn(a, *x.shape[1:], generator=gen, dtype=x.dtype), x,
                                     torch.randn(b, *x.shape[1:], generator=gen, dtype=x.dtype)])  # noqa: E731  # fmt: skip
    kp, vp = pad(k.detach(), 4, 3).requires_grad_(), pad(v.detach(), 4, 3).requires_grad_()
    go = torch.randn(9, 4, 8, generator=gen, dtype=torch.float64)
    ref = varlen_attn(q, k, v, cu, cu, 5, 5, is_causal=causal, enable_gqa=True)
    ref.backward(go)
    qp = q.detach().clone().requires_grad_()
    out = varlen_attn(qp, kp, vp, cu, cu + 4, 5, 5, is_causal=causal, enable_gqa=True)
    out.backward(go)
    assert torch.equal(out, ref)
    assert torch.equal(qp.grad, q.grad)
    for padded, plain in ((kp.grad, k.grad), (vp.grad, v.grad)):
        assert torch.equal(padded[4:13], plain)
        assert torch.equal(padded[:4], torch.zeros_like(padded[:4]))
        assert torch.equal(padded[13:], torch.zeros_like(padded[13:]))


def test_outputs_are_contiguous_for_strided_inputs_as_the_fake_impls_promise():
    # Ulysses hands the op (H, T, K)-major views; a compiler checks the real outputs' strides
    # against the fake impl's, so both ops return contiguous tensors for any input layout.
    gen = torch.Generator().manual_seed(10)
    meta = AttentionMetadata.from_lengths([3, 0, 1, 4], max_docs=6)
    q, k, v = (torch.randn(h, 8, 8, generator=gen, dtype=torch.float64).transpose(0, 1) for h in (4, 2, 2))
    assert not q.is_contiguous()
    cu = meta.cu_seqlens
    fwd_args = (q, k, v, cu, cu, 4, 4, True, 0.3)
    out, lse = torch.ops.usp.varlen_fwd(*fwd_args)
    grads = torch.ops.usp.varlen_bwd(
        out.transpose(0, 1).contiguous().transpose(0, 1), q, k, v, out, lse, cu, cu, 4, 4, True, 0.3
    )
    for t in (out, lse, *grads):
        assert t.is_contiguous()
    for result in torch.library.opcheck(torch.ops.usp.varlen_fwd.default, fwd_args).values():
        assert result == "SUCCESS"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_runs_are_bitwise_equal(dtype):
    gen = torch.Generator().manual_seed(9)
    meta = AttentionMetadata.from_lengths([40, 0, 1, 23, 64])
    cu, m = meta.cu_seqlens, meta.max_seqlen
    q, k, v = _qkv(gen, meta.total_tokens, meta.total_tokens, 4, 2, 16, dtype)
    g = torch.randn(meta.total_tokens, 4, 16, generator=gen).to(dtype)
    runs = []
    for _ in range(2):
        out = varlen_attn(q, k, v, cu, cu, m, m, is_causal=True, enable_gqa=True)
        runs.append((out, *torch.autograd.grad(out, (q, k, v), g)))
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
@pytest.mark.parametrize("window", [None, (5, 0), (3, 2)])
@pytest.mark.parametrize("rep", [2, 4])
def test_enable_gqa_is_bitwise_the_model_repeating_kv_itself(dtype, window, rep):
    # transformers passes enable_gqa=True when it builds no mask and repeats K/V itself when it
    # does (compiled graphs always build one), and Ulysses repeats K/V heads when they do not split
    # over the ranks as the query heads do: both forms must give the same bits in every output and
    # gradient, whatever order the CPU kernel's own GQA would sum a group in.
    gen = torch.Generator().manual_seed(rep)
    lengths = _random_lengths(gen, 7, 40) + [1, 0]
    meta = AttentionMetadata.from_lengths(lengths)
    cu, m, t, g = meta.cu_seqlens, meta.max_seqlen, meta.total_tokens, 2
    q, k, v = _qkv(gen, t, t, g * rep, g, 16, dtype)
    d_out = torch.randn(t, g * rep, 16, generator=gen).to(dtype)
    d_lse = torch.randn(g * rep, t, generator=gen).to(dtype)
    kw = dict(is_causal=window is None, scale=0.3, return_lse=True, window=window or (-1, -1))
    repeats = {
        "repeat_interleave": lambda x: x.repeat_interleave(rep, 1),
        "expand": lambda x: x[:, :, None].expand(t, g, rep, 16).reshape(t, g * rep, 16),
    }
    out, lse = varlen_attn(q, k, v, cu, cu, m, m, enable_gqa=True, **kw)
    d_lse = d_lse.masked_fill(lse.isinf(), 0).to(lse.dtype)
    ref = (out, lse, *torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse)))
    for name, repeat in repeats.items():
        out, lse = varlen_attn(q, repeat(k), repeat(v), cu, cu, m, m, **kw)
        got = (out, lse, *torch.autograd.grad((out, lse), (q, k, v), (d_out, d_lse)))
        for what, a, b in zip(("out", "lse", "dq", "dk", "dv"), got, ref, strict=True):
            assert torch.equal(a, b), (name, what, (a.double() - b.double()).abs().max())


def test_unused_lse_adds_no_backward_work():
    # With lse unused, backward is exactly one varlen_bwd: the lse terms must not run.
    gen = torch.Generator().manual_seed(10)
    meta = AttentionMetadata.from_lengths([4, 3])
    q, k, v = _qkv(gen, 7, 7, 2, 2, 8, torch.float64)
    cu = meta.cu_seqlens
    seen = []

    class Count(torch.utils._python_dispatch.TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    out = varlen_attn(q, k, v, cu, cu, 4, 4)
    with Count():
        out.sum().backward()
    usp_ops = [f for f in seen if f.namespace == "usp"]
    assert usp_ops == [torch.ops.usp.varlen_bwd.default]


def test_registry_has_varlen_rule_and_refuses_unknown_ops():
    rule = registry.rule_for(torch.ops.usp.varlen_fwd.default)
    assert rule.kind == "attention"
    assert rule.backward_ops == (torch.ops.usp.varlen_bwd.default,)
    assert registry.is_backward_op(torch.ops.usp.varlen_bwd.default)
    with pytest.raises(NotImplementedError, match="aten.mm.default"):
        registry.rule_for(torch.ops.aten.mm.default)


def test_registry_check_complete_names_an_op_without_a_rule():
    lib = torch.library.Library("usp_test_orphan", "DEF")
    lib.define("orphan(Tensor x) -> Tensor")
    with pytest.raises(NotImplementedError, match="usp_test_orphan::orphan"):
        registry.check_complete("usp_test_orphan")
    registry.check_complete()  # the package's own namespace is complete


def test_matches_sdpa_per_sample_in_float32():
    # One document per row is exactly SDPA's semantics.
    gen = torch.Generator().manual_seed(12)
    q = torch.randn(3, 4, 10, 16, generator=gen)
    k = torch.randn(3, 2, 10, 16, generator=gen)
    v = torch.randn(3, 2, 10, 16, generator=gen)
    meta = AttentionMetadata.per_sample(3, 10)
    pack = lambda x: x.transpose(1, 2).reshape(30, x.shape[1], 16)
    cu = meta.cu_seqlens
    out = varlen_attn(pack(q), pack(k), pack(v), cu, cu, 10, 10, is_causal=True, enable_gqa=True)
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert _rel(out, pack(ref)) <= 1e-6


def _qkv_kv(gen, t_q, t_k, h, g, d, dv, dtype):
    def r(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64).to(dtype).requires_grad_()

    return r(t_q, h, d), r(t_k, g, d), r(t_k, g, dv)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 1e-5)])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("dims", [(16, 8), (8, 24)], ids=["Kv<K", "Kv>K"])
def test_value_head_dim_may_differ_from_query_head_dim(dtype, tol, is_causal, dims):
    """v_TGKv with Kv != K (issue 17): random boundaries with empty and length-1 documents, GQA,
    forward and backward against the float64 per-document reference."""
    d, dv = dims
    gen = torch.Generator().manual_seed(hash((str(dtype), is_causal, dims)) % 2**31)
    for lens in [*LENGTH_SETS, _random_lengths(gen, 8, 24), _random_lengths(gen, 5, 40)]:
        meta = AttentionMetadata.from_lengths(lens, max_docs=len(lens) + 2)
        q, k, v = _qkv_kv(gen, meta.total_tokens, meta.total_tokens, 4, 2, d, dv, dtype)
        cu = meta.cu_seqlens
        out = varlen_attn(
            q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, is_causal=is_causal, enable_gqa=True
        )
        assert out.shape == (meta.total_tokens, 4, dv)
        _check_against_reference(q, k, v, cu, cu, meta.max_seqlen, meta.max_seqlen, is_causal, 0.37, tol)


def test_value_head_dim_differs_with_unequal_lengths_and_a_window():
    gen = torch.Generator().manual_seed(21)
    lq, lk = [3, 6, 0, 1, 4], [5, 2, 3, 0, 4]
    mq, mk = AttentionMetadata.from_lengths(lq), AttentionMetadata.from_lengths(lk)
    q, k, v = _qkv_kv(gen, mq.total_tokens, mk.total_tokens, 4, 2, 8, 12, torch.float64)
    args = (mq.cu_seqlens, mk.cu_seqlens, mq.max_seqlen, mk.max_seqlen)
    _check_against_reference(q, k, v, *args, True, 8**-0.5, 1e-10)
    # a window: the padded call equals the math path (which takes Kv != K as it is)
    from usp_graph.ops.varlen import _math_fwd

    out, lse = varlen_attn(q, k, v, *args, is_causal=True, enable_gqa=True, return_lse=True, window=(1, 0))
    ref_out, ref_lse = _math_fwd(q.detach(), k.detach(), v.detach(), *args, True, 8**-0.5, 1, 0)
    assert _rel(out, ref_out) <= 1e-12
    assert torch.equal(lse == float("-inf"), ref_lse == float("-inf"))


def test_gradcheck_value_head_dim_differs():
    gen = torch.Generator().manual_seed(22)
    meta = AttentionMetadata.from_lengths([3, 0, 1, 4], max_docs=6)
    q, k, v = _qkv_kv(gen, 8, 8, 4, 2, 4, 6, torch.float64)
    cu, m = meta.cu_seqlens, meta.max_seqlen

    def f(q, k, v):
        return varlen_attn(q, k, v, cu, cu, m, m, is_causal=True, scale=0.6, enable_gqa=True, return_lse=True)

    assert torch.autograd.gradcheck(f, (q, k, v), fast_mode=True)


@pytest.mark.parametrize("kernel", ["cpu", "math"])
def test_a_boundary_tensor_is_walked_once_per_step_and_again_after_a_write(monkeypatch, kernel):
    """Boundaries with a slot per token (documents from position ids in a compiled graph) made the
    CPU and math kernels walk every slot in Python at each call; every layer and the backward share
    the tensor, so they walk it once. The result is bitwise that of the slot-per-document form, and
    a tensor refilled in place, even where no version counter sees it (``.data``, numpy), is walked
    again (never a stale answer)."""
    from usp_graph import masks
    from usp_graph.ops import boundaries, math_kernel, varlen

    if kernel == "math":  # the math kernel as the CPU varlen op's kernel
        monkeypatch.setattr(varlen, "_cpu_fwd", math_kernel.math_fwd)
        monkeypatch.setattr(varlen, "_cpu_bwd", math_kernel.math_bwd)
    walks = []
    real = boundaries.doc_bounds
    monkeypatch.setattr(boundaries, "doc_bounds", lambda *a: walks.append(a[0].numel()) or real(*a))
    gen = torch.Generator().manual_seed(7)
    lengths = _random_lengths(gen, 9, 12)
    t = sum(lengths)
    pos = torch.cat([torch.arange(n) for n in lengths if n])[None]
    per_token = masks.cu_seqlens_from_positions(pos)  # T + 1 slots
    per_doc = AttentionMetadata.from_lengths(lengths).cu_seqlens
    q, k, v = _qkv(gen, t, t, 4, 2, 8, torch.float64)

    def step(cu):
        x = q
        for _ in range(3):  # three layers
            x = varlen_attn(x, k, v, cu, cu, t, t, is_causal=True, enable_gqa=True)
        return (x, *torch.autograd.grad(x.square().sum(), (q, k, v)))

    got = step(per_token)
    assert walks == [t + 1]  # forward and backward of every layer: one walk
    want = step(per_doc)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    walks.clear()
    per_token.data[1:] = t  # one document of all the tokens, refilled behind the version counter
    whole = step(per_token)
    assert walks == [t + 1]
    one = torch.tensor([0, t], dtype=torch.int32)
    assert all(torch.equal(a, b) for a, b in zip(whole, step(one), strict=True))
