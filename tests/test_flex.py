"""document_block_mask: flex_attention's BlockMask for packed documents, built from cu_seqlens."""

from __future__ import annotations

import warnings

import pytest
import torch

from usp_graph import AttentionMetadata, varlen_attn
from usp_graph.flex import document_block_mask, document_ids

flex = pytest.importorskip("torch.nn.attention.flex_attention")


def _lengths(gen: torch.Generator, total: int) -> list[int]:
    cuts = sorted(torch.randint(0, total + 1, (5,), generator=gen).tolist())
    lens = [b - a for a, b in zip([0, *cuts], [*cuts, total], strict=True)]
    big = lens.index(max(lens))
    lens[big] -= 1
    return [*lens[:big], 1, 0, *lens[big:]]  # an empty and a length-1 document, wherever they land


def _reference_mask(meta: AttentionMetadata, causal: bool, block: int):
    doc = document_ids(meta.cu_seqlens, meta.total_tokens)

    def mask_mod(b, h, q, kv):
        same = doc[q] == doc[kv]
        return same & (q >= kv) if causal else same

    t = meta.total_tokens
    return flex.create_block_mask(mask_mod, None, None, t, t, device="cpu", BLOCK_SIZE=block)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("total, block", [(200, 16), (256, 32), (97, 8)])
def test_blocks_equal_create_block_mask_and_flex_equals_varlen(causal, total, block):
    gen = torch.Generator().manual_seed(total + block + causal)
    meta = AttentionMetadata.from_lengths(_lengths(gen, total), max_docs=10)
    got = document_block_mask(meta, is_causal=causal, block_size=block)
    ref = _reference_mask(meta, causal, block)
    assert torch.equal(got.to_dense(), ref.to_dense())
    assert torch.equal(got.kv_num_blocks, ref.kv_num_blocks)
    assert torch.equal(got.full_kv_num_blocks, ref.full_kv_num_blocks)

    q = torch.randn(1, 4, total, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(1, 2, total, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # flex_attention warns that it is not compiled (a CPU reference here)
        out = flex.flex_attention(q, k, v, block_mask=got, enable_gqa=True)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    ref_out = varlen_attn(
        *(x[0].transpose(0, 1) for x in (q, k, v)), cu, cu, m, m, is_causal=causal, enable_gqa=True
    )
    assert (out[0].transpose(0, 1) - ref_out).abs().max() <= 1e-12


def test_document_ids_skip_empty_documents():
    meta = AttentionMetadata.from_lengths([2, 0, 3, 1], max_docs=6)
    assert document_ids(meta.cu_seqlens, 6).tolist() == [0, 0, 2, 2, 2, 3]


def test_bad_arguments_name_the_fix():
    cu = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="pass total_tokens with a cu_seqlens tensor"):
        document_block_mask(cu, is_causal=True)
    with pytest.raises(ValueError, match="block_size must be a positive int"):
        document_block_mask(cu, 4, is_causal=True, block_size=0)
    with pytest.raises(ValueError, match="total_tokens must be a positive int"):
        document_block_mask(cu, 0, is_causal=True)


# ------------------------------------------------------------------------------------------------
# The flex kernel path of usp::varlen_fwd/bwd (usp_graph.ops.flex_kernel). Its compiled form needs
# CUDA; here the same traced graphs run uncompiled (flex's reference implementation) against the
# fp64 math path, which checks the block mask, the layouts, the base-2 lse and the backward wiring.


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("total", [256, 300])
def test_q_blocks_equal_block_masks_transpose(causal, total):
    from usp_graph.flex import blocks_of_documents

    gen = torch.Generator().manual_seed(total + causal)
    meta = AttentionMetadata.from_lengths(_lengths(gen, total), max_docs=10)
    doc = document_ids(meta.cu_seqlens, total)
    blocks = blocks_of_documents(doc, is_causal=causal, block_size=32, with_q_blocks=True)
    ref = flex.BlockMask.from_kv_blocks(*blocks[:4], BLOCK_SIZE=32, seq_lengths=(total, total))
    q_side = (ref.q_num_blocks, ref.q_indices, ref.full_q_num_blocks, ref.full_q_indices)
    for got, want in zip(blocks[4:], q_side, strict=True):
        assert torch.equal(got, want)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("total, heads, groups", [(256, 4, 2), (300, 2, 2)])
def test_flex_kernel_graphs_equal_math_path(causal, total, heads, groups):
    from usp_graph.ops import flex_kernel
    from usp_graph.ops.varlen import _math_bwd, _math_fwd

    gen = torch.Generator().manual_seed(7 * total + heads + causal)
    meta = AttentionMetadata.from_lengths(_lengths(gen, total), max_docs=10)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    q = torch.randn(total, heads, 16, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(total, groups, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    scale = 0.3
    doc = flex_kernel._doc_ids(cu, total)
    fwd = flex_kernel.trace(flex_kernel._forward_graph(causal, scale, q.dtype), [q, k, v, doc])
    out, lse = fwd(q, k, v, doc)
    ref_out, ref_lse = _math_fwd(q, k, v, cu, cu, m, m, causal, scale)
    assert out.shape == ref_out.shape and out.is_contiguous()
    assert (out - ref_out).abs().max() <= 1e-12
    assert (lse - ref_lse).abs().max() <= 1e-12  # natural log, as the op's contract says

    dout = torch.randn(out.shape, generator=gen, dtype=torch.float64)
    inputs = [dout, q, k, v, out, lse, doc]
    bwd = flex_kernel.trace(flex_kernel._backward_graph(causal, scale, q.dtype), inputs)
    grads = bwd(*inputs)
    for got, want in zip(
        grads, _math_bwd(dout, q, k, v, ref_out, ref_lse, cu, cu, m, m, causal, scale), strict=True
    ):
        assert got.shape == want.shape
        assert (got - want).abs().max() <= 1e-12


def test_flex_kernel_build_failure_is_a_build_error(monkeypatch):
    """A failed trace or compile arrives as BuildError with its cause (the varlen op then runs
    flash varlen for that shape and warns once), and nothing is cached for the shape."""
    from usp_graph.ops import flex_kernel

    def broken(fn, inputs):
        raise RuntimeError("an internal API moved")

    monkeypatch.setattr(flex_kernel, "trace", broken)
    q = torch.randn(128, 2, 16)
    cu = torch.tensor([0, 100, 128], dtype=torch.int32)
    with pytest.raises(flex_kernel.BuildError, match="cannot build the flex fwd kernel") as info:
        flex_kernel.flex_fwd(q, q, q, cu, True, 0.25)
    assert "an internal API moved" in str(info.value.__cause__)
    assert not any(key[1:] == flex_kernel.plan_key(q, q, q, True, 0.25) for key in flex_kernel._plans)


def test_kernel_choice_rules():
    from usp_graph.ops import boundaries, flex_kernel, kernel_choice

    cu = torch.tensor([0, 100, 256], dtype=torch.int32)
    twin = cu.clone()  # equal values, other memory: not known to be equal without a sync
    bf = torch.zeros(256, 4, 128, dtype=torch.bfloat16)
    assert kernel_choice._flex_applies(bf, bf, bf, cu, cu)
    assert not kernel_choice._flex_applies(bf, bf, bf, cu, twin)
    assert not kernel_choice._flex_applies(bf[:200], bf[:200], bf[:200], cu, cu)  # not a whole block count
    assert not kernel_choice._flex_applies(bf.float(), bf.float(), bf.float(), cu, cu)
    assert not kernel_choice._flex_applies(
        bf[..., :96], bf[..., :96], bf[..., :96], cu, cu
    )  # K not a power of 2
    assert boundaries.same_boundaries(bf, bf, cu, cu) and not boundaries.same_boundaries(bf, bf, cu, twin)

    with kernel_choice.cuda_kernel("flex"):
        assert kernel_choice._use_flex(bf, bf, bf, cu, cu, True, 0.1)
        assert not kernel_choice._use_flex(bf, bf, bf, cu, twin, True, 0.1)
    with kernel_choice.cuda_kernel("flash"):
        assert not kernel_choice._use_flex(bf, bf, bf, cu, cu, True, 0.1)
    assert kernel_choice._cuda_kernel == "auto"
    # auto: shapes only, never boundary values
    long = torch.zeros(kernel_choice.FLEX_MIN_TOKENS, 4, 128, dtype=torch.bfloat16)
    assert kernel_choice._auto_kernel(long) == "flex"
    assert kernel_choice._auto_kernel(long[..., :64]) == "flash"  # head dim outside the measured range
    assert kernel_choice._auto_kernel(bf) == "flash"

    # a shape whose flex build failed runs flash from then on, with one warning
    key = flex_kernel.plan_key(bf, bf, bf, True, 0.1)
    try:
        with pytest.warns(RuntimeWarning, match="flash varlen runs this shape"):
            kernel_choice._flex_failed(bf, bf, bf, True, 0.1, flex_kernel.BuildError("cannot build"))
        with kernel_choice.cuda_kernel("flex"):
            assert not kernel_choice._use_flex(bf, bf, bf, cu, cu, True, 0.1)
            assert kernel_choice._use_flex(bf, bf, bf, cu, cu, False, 0.1)
    finally:
        kernel_choice._flex_broken.discard(key)


def test_kernel_setting_is_checked():
    import subprocess
    import sys

    from usp_graph.ops import kernel_choice

    with pytest.raises(ValueError, match="cuda_kernel must be one of auto, flash, flex"):
        with kernel_choice.cuda_kernel("triton"):
            pass
    assert kernel_choice._cuda_kernel == "auto"
    env_bad = subprocess.run(
        [sys.executable, "-c", "import usp_graph"],
        env={**__import__("os").environ, "USP_CUDA_ATTENTION": "fast"},
        capture_output=True,
        text=True,
    )
    assert env_bad.returncode != 0
    assert "USP_CUDA_ATTENTION must be one of auto, flash, flex, cudnn, got 'fast'" in env_bad.stderr


def test_flex_entry_points_end_to_end(monkeypatch):
    """flex_fwd/flex_bwd end to end (document ids, the build thread, the plan cache, layouts),
    with compile_fx replaced by the traced graph itself (CPU inductor cannot compile flex with an
    lse). The backward is called from inside an autograd backward, as the varlen op's rule does;
    the second round reuses the cached plans."""
    import torch._inductor.compile_fx as compile_fx_module

    from usp_graph.ops import flex_kernel
    from usp_graph.ops.varlen import _math_bwd, _math_fwd

    monkeypatch.setattr(compile_fx_module, "compile_fx", lambda gm, inputs: gm)
    monkeypatch.setattr(flex_kernel, "_plans", {})
    gen = torch.Generator().manual_seed(3)
    total, causal, scale = 256, True, 0.25
    meta = AttentionMetadata.from_lengths(_lengths(gen, total), max_docs=10)
    cu, m = meta.cu_seqlens, meta.max_seqlen
    q, k, v, dout = (torch.randn(total, 2, 16, generator=gen, dtype=torch.float64) for _ in range(4))
    ref_out, ref_lse = _math_fwd(q, k, v, cu, cu, m, m, causal, scale)
    ref_grads = _math_bwd(dout, q, k, v, ref_out, ref_lse, cu, cu, m, m, causal, scale)

    class Probe(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            Probe.grads = flex_kernel.flex_bwd(dout, q, k, v, out, lse, cu, causal, scale)
            return grad

    for _ in range(2):
        out, lse = flex_kernel.flex_fwd(q, k.requires_grad_(), v, cu, causal, scale)
        assert (out - ref_out).abs().max() <= 1e-12 and (lse - ref_lse).abs().max() <= 1e-12
        Probe.apply(torch.zeros(3, requires_grad=True)).sum().backward()
        for got, want in zip(Probe.grads, ref_grads, strict=True):
            assert (got - want).abs().max() <= 1e-12
        k.requires_grad_(False)
    assert sorted(key[0] for key in flex_kernel._plans) == ["bwd", "fwd"]


def _first_call_setup(monkeypatch, flex_fwd_result, flex_bwd_result):
    """`_cuda_fwd`/`_cuda_bwd` run on CPU: flash is the CPU kernel, flex returns what the test
    gives (a function of flash's own result); calls are counted."""
    from usp_graph.ops import flash_kernel, flex_kernel, kernel_choice, varlen

    calls = {"flash_fwd": 0, "flash_bwd": 0, "flex_fwd": 0, "flex_bwd": 0}

    def counted(name, fn):
        def run(*args):
            calls[name] += 1
            return fn(*args)

        return run

    monkeypatch.setattr(flash_kernel, "flash_fwd", counted("flash_fwd", varlen._cpu_fwd))
    monkeypatch.setattr(flash_kernel, "flash_bwd", counted("flash_bwd", varlen._cpu_bwd))
    monkeypatch.setattr(
        flex_kernel,
        "flex_fwd",
        counted(
            "flex_fwd",
            lambda q, k, v, cu, c, s: flex_fwd_result(varlen._cpu_fwd(q, k, v, cu, cu, 256, 256, c, s)),
        ),
    )
    monkeypatch.setattr(
        flex_kernel,
        "flex_bwd",
        counted(
            "flex_bwd",
            lambda do, q, k, v, o, lse, cu, c, s: flex_bwd_result(
                varlen._cpu_bwd(do, q, k, v, o, lse, cu, cu, 256, 256, c, s)
            ),
        ),
    )
    monkeypatch.setattr(kernel_choice, "_flex_checked", set())
    monkeypatch.setattr(kernel_choice, "_flex_broken", set())
    gen = torch.Generator().manual_seed(7)
    lens = _lengths(gen, 256)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v, dout = (torch.randn(256, 4, 64, generator=gen).bfloat16() for _ in range(4))
    fwd_args = (q, k, v, cu, cu, max(lens), max(lens), True, 0.125)
    return varlen, calls, fwd_args, dout


def _same(got, ref):
    return all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_flex_first_call_agrees_then_runs_unchecked(monkeypatch):
    # flex's result a little off (bf16 rounding scale): accepted, then no flash call again
    def nudge(res):
        return tuple(x * (1 + 2e-3) for x in res)

    varlen, calls, args, dout = _first_call_setup(monkeypatch, nudge, nudge)
    with varlen.cuda_kernel("flex"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            out, lse = varlen._cuda_fwd(*args)
            grads = varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
    flash = varlen._cpu_fwd(*args)
    assert _same((out, lse), nudge(flash))  # flex's own result, not flash's
    assert _same(grads, nudge(varlen._cpu_bwd(dout, *args[:3], out, lse, *args[3:])))
    assert calls == {"flash_fwd": 1, "flash_bwd": 1, "flex_fwd": 2, "flex_bwd": 2}


@pytest.mark.parametrize(
    "corrupt",
    [
        pytest.param(lambda x: x * 1.1, id="scaled"),
        pytest.param(lambda x: x.index_fill(0, torch.tensor([0]), float("nan")), id="nan-row"),
        pytest.param(lambda x: x.index_fill(-1, torch.tensor([3]), float("-inf")), id="spurious-inf"),
    ],
)
@pytest.mark.parametrize("where", ["forward", "backward"])
def test_flex_first_call_disagrees_falls_back_to_flash(monkeypatch, corrupt, where):
    def bad(res):
        return (corrupt(res[0]), *res[1:])

    fine = tuple
    varlen, calls, args, dout = _first_call_setup(
        monkeypatch, bad if where == "forward" else fine, bad if where == "backward" else fine
    )
    with varlen.cuda_kernel("flex"):
        with pytest.warns(RuntimeWarning, match=f"flex {where} kernel .* disagrees with flash varlen"):
            out, lse = varlen._cuda_fwd(*args)
            grads = varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
        # what came back is flash's, exactly; the shape runs flash from then on, flex never again
        assert _same((out, lse), varlen._cpu_fwd(*args))
        assert _same(grads, varlen._cpu_bwd(dout, *args[:3], out, lse, *args[3:]))
        seen = dict(calls)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            varlen._cuda_fwd(*args)
            varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
    assert calls["flex_fwd"] == seen["flex_fwd"] and calls["flex_bwd"] == seen["flex_bwd"]
    assert calls["flash_fwd"] == seen["flash_fwd"] + 1 and calls["flash_bwd"] == seen["flash_bwd"] + 1


def test_disagreement_compares_infinities_and_scale():
    from usp_graph.ops.kernel_choice import FLEX_CHECK_TOL, _disagreement

    ref = torch.tensor([1.0, -2.0, float("-inf"), 3.0])
    assert _disagreement(("x",), (ref.clone(),), (ref,)) is None
    assert _disagreement(("x",), (ref * (1 + FLEX_CHECK_TOL / 2),), (ref,)) is None
    assert "x rel err" in _disagreement(("x",), (ref * (1 + 2 * FLEX_CHECK_TOL),), (ref,))
    assert "inf" in _disagreement(("x",), (torch.tensor([1.0, -2.0, 0.0, 3.0]),), (ref,))
    assert "inf" in _disagreement(("x",), (torch.tensor([1.0, -2.0, float("inf"), 3.0]),), (ref,))
    assert _disagreement(("a", "b"), (ref, ref.nan_to_num()), (ref, ref)).startswith("b ")


def test_a_first_call_on_nan_inputs_neither_condemns_nor_clears_the_kernel():
    # A first batch holding a NaN (a diverged step, a bad input) made every kernel "disagree" with
    # flash (NaN != NaN), which moved the shape to flash varlen for the rest of the run.
    from usp_graph.ops import kernel_choice as kc

    ref = torch.tensor([1.0, float("nan"), float("-inf"), 3.0])
    assert kc._compare(("x",), (ref.clone(),), (ref,)) == (None, True)
    other = ref.clone()
    other[1] = float("-inf")  # cuDNN's lse of a NaN query row is NaN, flash's -inf
    assert kc._compare(("x",), (other,), (ref,)) == (None, True)
    assert kc._compare(("x",), (ref * 2,), (ref,))[0] is not None  # the entries without NaN still count
    clean = ref.nan_to_num(0.0)
    assert kc._compare(("x",), (ref,), (clean,))[0] is not None  # a NaN the kernel made: a disagreement
    checked, broken = set(), set()
    got = kc._checked_or_flash(
        "cudnn", "forward", ("x",), (ref.clone(),), lambda: (ref,), "k", checked, broken, "k"
    )
    assert got[0] is not ref and not checked and not broken  # its own result; checked again next time
    kc._checked_or_flash(
        "cudnn", "forward", ("x",), (ref[[0, 3]],), lambda: (ref[[0, 3]],), "k", checked, broken, "k"
    )
    assert checked == {("forward", "k")} and not broken
