"""The cuDNN kernel's pure logic, on CPU without the cuDNN frontend (CI has neither a GPU nor the
package): graph keys, mask arguments, metadata, kernel choice, the fallbacks, and the device-side
boundary check. The kernel itself is checked on the H200 by tools/check_cudnn_gpu.py.

# T packed tokens, H query heads, G key/value heads, K head dim, N document slots
"""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import warnings
import weakref

import pytest
import torch

from usp_graph.metadata import capacity_bucket
from usp_graph.ops import boundaries, cudnn_kernel, flash_kernel, flex_kernel, kernel_choice, varlen


def _cu(*bounds: int) -> torch.Tensor:
    return torch.tensor(bounds, dtype=torch.int32)


def _qkv(t: int, h: int = 4, g: int = 4, d: int = 64, dtype=torch.bfloat16, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(t, x, d, generator=gen).to(dtype) for x in (h, g, g))


# ------------------------------------------------------------------------------------------------
# Graph keys: shapes and settings, never boundary values.


def test_plan_key_depends_on_shapes_and_settings_not_boundary_values():
    q, k, _ = _qkv(100, 4, 2, 64)
    a, b = _cu(0, 30, 100, 100), _cu(0, 1, 2, 100)  # same capacity, other boundaries
    key_a = cudnn_kernel.plan_key(q, k, a, 70, 70, True, 0.125, (-1, -1), square=True)
    key_b = cudnn_kernel.plan_key(q, k, b, 70, 70, True, 0.125, (-1, -1), square=True)
    assert key_a == key_b and hash(key_a) == hash(key_b)
    # 3 slots and S = 70 round up to their buckets: 3 and 96
    assert (key_a.slots, key_a.s_q, key_a.heads, key_a.kv_heads, key_a.head_dim) == (3, 96, 4, 2, 64)
    # each setting is part of the key
    assert cudnn_kernel.plan_key(q, k, a, 97, 70, True, 0.125, (-1, -1), square=True) != key_a
    assert cudnn_kernel.plan_key(q, k, a, 70, 70, False, 0.125, (-1, -1), square=True) != key_a
    assert cudnn_kernel.plan_key(q, k, a, 70, 70, True, 0.25, (-1, -1), square=True) != key_a
    assert cudnn_kernel.plan_key(q, k, a, 70, 70, True, 0.125, (8, -1), square=True) != key_a
    assert cudnn_kernel.plan_key(q, k, a, 70, 70, True, 0.125, (-1, -1), square=False) != key_a
    assert (
        cudnn_kernel.plan_key(q, k, _cu(0, 30, 100, 100, 100), 70, 70, True, 0.125, (-1, -1), square=True)
        != key_a
    )
    assert cudnn_kernel.plan_key(q.half(), k.half(), a, 70, 70, True, 0.125, (-1, -1), square=True) != key_a


def test_batches_with_other_document_counts_and_lengths_share_a_graph():
    """A training run's batches each hold other documents (count and longest one): their keys fall
    into a few buckets, so the graphs are built (and checked against flash) a few times, not every
    step. Deterministic backward keys stay exact (workspace ~ N x S^2)."""
    q, k, _ = _qkv(4096, 4, 2, 64)
    gen = torch.Generator().manual_seed(0)
    fwd, bwd, det = set(), set(), set()
    for _ in range(50):
        n = int(torch.randint(17, 25, (1,), generator=gen))
        cuts = torch.sort(torch.randperm(4095, generator=gen)[: n - 1] + 1).values.tolist()
        cu = _cu(0, *cuts, 4096)
        longest = int((cu[1:] - cu[:-1]).max())
        fwd.add(cudnn_kernel.plan_key(q, k, cu, longest, longest, True, 0.125, (-1, -1), square=True))
        bwd.add(
            cudnn_kernel.plan_key(
                q, k, cu, longest, longest, True, 0.125, (-1, -1), square=True, backward=True
            )
        )
        det.add(cudnn_kernel.plan_key(q, k, cu, longest, longest, True, 0.125, (-1, -1), square=True,
                                      backward=True, deterministic=True))  # fmt: skip
    assert len(fwd) <= 4 and len(bwd) == len(fwd)
    assert {key.slots for key in fwd} == {24}  # 17..24 documents: one bucket
    assert len(det) > 10  # exact: N in 17..24 and S per batch


def test_slot_metadata_pads_with_empty_slots_at_the_end():
    cu_q, cu_k = _cu(0, 3, 3, 10), _cu(2, 4, 9, 9)
    (seq_q, seq_k), (off_q, off_k, off_s) = cudnn_kernel.slot_metadata(cu_q, cu_k, 8, 2, 64, 6)
    assert seq_q.shape == seq_k.shape == (6, 1, 1, 1) and seq_q.dtype == torch.int32
    assert seq_q.flatten().tolist() == [3, 0, 7, 0, 0, 0] and seq_k.flatten().tolist() == [2, 5, 0, 0, 0, 0]
    assert off_q.shape == off_k.shape == off_s.shape == (7, 1, 1, 1)
    assert off_q.flatten().tolist() == [0, 3 * 512, 3 * 512, 10 * 512, 10 * 512, 10 * 512, 10 * 512]
    assert off_k.flatten().tolist() == [2 * 128, 4 * 128, 9 * 128, 9 * 128, 9 * 128, 9 * 128, 9 * 128]
    assert off_s.flatten().tolist() == [0, 24, 24, 80, 80, 80, 80]
    # one boundary tensor: one lengths tensor for queries and keys, padded or not
    (same_q, same_k), _ = cudnn_kernel.slot_metadata(cu_q, cu_q, 8, 8, 64, 6)
    assert same_q is same_k
    (exact, _), _ = cudnn_kernel.slot_metadata(cu_q, cu_q, 8, 8, 64, 3)
    assert exact.flatten().tolist() == [3, 0, 7]
    with pytest.raises(ValueError, match="a graph for 2 slots cannot run 3 documents"):
        cudnn_kernel.slot_metadata(cu_q, cu_q, 8, 8, 64, 2)


def test_plan_key_padded_length_is_clamped_to_the_token_count():
    q, k, _ = _qkv(100)
    key = cudnn_kernel.plan_key(q, k[:40], _cu(0, 100), 10**6, 10**6, False, 1.0, (-1, -1), square=False)
    assert (key.s_q, key.s_k) == (100, 40)
    assert cudnn_kernel.plan_key(q[:0], k, _cu(0, 0), 0, 5, False, 1.0, (-1, -1), square=False).s_q == 1
    # a bucket past the token count is the token count
    assert cudnn_kernel.plan_key(q, k, _cu(0, 100), 90, 90, False, 1.0, (-1, -1), square=True).s_q == 96
    assert (
        cudnn_kernel.plan_key(q[:95], k[:95], _cu(0, 95), 90, 90, False, 1.0, (-1, -1), square=True).s_q == 95
    )


def test_backward_key_adds_totals_rounded_to_64_and_determinism():
    q, k, _ = _qkv(100)
    cu = _cu(0, 100)
    fwd = cudnn_kernel.plan_key(q, k, cu, 100, 100, True, 1.0, (-1, -1), square=True)
    bwd = cudnn_kernel.plan_key(q, k, cu, 100, 100, True, 1.0, (-1, -1), square=True, backward=True)
    det = cudnn_kernel.plan_key(q, k, cu, 100, 100, True, 1.0, (-1, -1), square=True, backward=True,
                                deterministic=True)  # fmt: skip
    assert (fwd.total_q, fwd.total_k, fwd.deterministic) == (0, 0, False)
    assert (bwd.total_q, bwd.total_k) == (128, 128) and not bwd.deterministic
    assert det.deterministic and det != bwd and (det.total_q, det.total_k) == (128, 128)
    # token counts share a backward graph within a bucket (more tokens built for than run is fine)
    q2, k2, _ = _qkv(4000)
    wide = cudnn_kernel.plan_key(q2, k2, cu, 100, 100, True, 1.0, (-1, -1), square=True, backward=True)
    assert wide.total_q == 4096 == cudnn_kernel.plan_key(q2[:3073], k2[:3073], cu, 100, 100, True, 1.0, (-1, -1),
                                                         square=True, backward=True).total_q  # fmt: skip
    exact = cudnn_kernel.plan_key(q2, k2, cu, 100, 100, True, 1.0, (-1, -1), square=True, backward=True,
                                  deterministic=True)  # fmt: skip
    assert exact.total_q == 4032
    # determinism never splits forward keys
    assert (
        cudnn_kernel.plan_key(q, k, cu, 100, 100, True, 1.0, (-1, -1), square=True, deterministic=True) == fwd
    )


@pytest.mark.parametrize(
    "causal,window,square,expected",
    [
        (False, (-1, -1), True, (None, None, None)),
        (True, (-1, -1), True, ("top_left", None, 0)),  # square documents: top-left == bottom-right
        (True, (-1, -1), False, ("bottom_right", None, 0)),
        (True, (64, 0), True, ("top_left", 65, 0)),  # cuDNN's left bound counts the diagonal
        (True, (16, -1), False, ("bottom_right", 17, 0)),  # causal folds into the right bound
        (True, (16, 7), False, ("bottom_right", 17, 0)),
        (False, (32, 16), True, ("top_left", 33, 16)),
        (False, (-1, 5), False, ("bottom_right", None, 5)),
        (False, (3, -1), False, ("bottom_right", 4, None)),
    ],
)
def test_mask_settings_follow_the_flash_window_convention(causal, window, square, expected):
    q, k, _ = _qkv(8)
    key = cudnn_kernel.plan_key(q, k, _cu(0, 8), 8, 8, causal, 1.0, window, square=square)
    m = cudnn_kernel.mask_settings(key)
    assert (m["alignment"], m["left_bound"], m["right_bound"]) == expected


# ------------------------------------------------------------------------------------------------
# Per-call metadata.


def test_ragged_offsets_are_elements_per_row_kind():
    cu_q, cu_k = _cu(0, 3, 3, 10), _cu(2, 4, 9, 9)
    off_q, off_k, off_s = cudnn_kernel.ragged_offsets(cu_q, cu_k, 8, 2, 64)
    for off in (off_q, off_k, off_s):
        assert off.dtype == torch.int64 and off.shape == (4, 1, 1, 1) and off.is_contiguous()
    assert off_q.flatten().tolist() == [0, 3 * 512, 3 * 512, 10 * 512]
    assert off_k.flatten().tolist() == [2 * 128, 4 * 128, 9 * 128, 9 * 128]
    assert off_s.flatten().tolist() == [0, 24, 24, 80]


def test_seq_lengths_are_int32_per_slot_with_empty_slots():
    cu_q, cu_k = _cu(0, 3, 3, 10, 10), _cu(2, 4, 9, 9, 9)
    seq_q, seq_k = cudnn_kernel.seq_lengths(cu_q, cu_k)
    assert seq_q.dtype == torch.int32 and seq_q.shape == (4, 1, 1, 1)
    assert seq_q.flatten().tolist() == [3, 0, 7, 0] and seq_k.flatten().tolist() == [2, 5, 0, 0]
    same_q, same_k = cudnn_kernel.seq_lengths(cu_q, cu_q)
    assert same_q is same_k


def test_deterministic_workspace_limit_reads_the_environment(monkeypatch):
    monkeypatch.setenv("USP_CUDNN_DETERMINISTIC_WORKSPACE_MB", "12")
    assert cudnn_kernel.deterministic_workspace_limit() == 12 * 2**20


@pytest.mark.parametrize("value", ["12.5", "-1", "lots", ""])
@pytest.mark.parametrize(
    ("name", "limit"),
    [
        ("USP_CUDNN_DETERMINISTIC_WORKSPACE_MB", cudnn_kernel.deterministic_workspace_limit),
        ("USP_CUDNN_BACKWARD_WORKSPACE_MB", cudnn_kernel.backward_workspace_limit),
    ],
)
def test_a_workspace_limit_that_is_not_a_whole_number_of_mib_is_refused_by_name(
    monkeypatch, name, limit, value
):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=f"{name} must be a whole number of MiB"):
        limit()


def test_backward_workspace_limit_reads_the_environment(monkeypatch):
    monkeypatch.delenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", raising=False)
    assert cudnn_kernel.backward_workspace_limit() == 256 * 2**20
    monkeypatch.setenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", "0")
    assert cudnn_kernel.backward_workspace_limit() == 0


# ------------------------------------------------------------------------------------------------
# Without the package.


def test_missing_package_means_unavailable_and_build_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # `import cudnn` raises ImportError
    cudnn_kernel.module.cache_clear()
    try:
        assert cudnn_kernel.module() is None and not cudnn_kernel.available()
        q, k, _ = _qkv(8)
        key = cudnn_kernel.plan_key(q, k, _cu(0, 8), 8, 8, False, 1.0, (-1, -1), square=True)
        with pytest.raises(cudnn_kernel.BuildError, match="not installed"):
            cudnn_kernel._plan("fwd", key)
        assert not kernel_choice._cudnn_applies(q, k, k)
    finally:
        cudnn_kernel.module.cache_clear()


def _frame_keeping_build(kind, key, **kwargs):
    """A build that, like cuDNN frontend 1.32's, keeps an exception it caught in a local of its
    frame: a cycle (exception -> traceback -> frame -> exception) holding the frame's callers."""
    try:
        raise RuntimeError("no engine for heuristic mode A")
    except RuntimeError as exc:
        failure = exc  # noqa: F841 - the cycle
    return cudnn_kernel._Plan(graph=None, workspace=0)


def _with_build(monkeypatch, build) -> cudnn_kernel.PlanKey:
    """`build` in place of the cuDNN graph build (no package, no GPU); a key to ask `_plan` for."""
    import contextlib

    monkeypatch.setattr(cudnn_kernel, "module", lambda: object())
    monkeypatch.setattr(cudnn_kernel, "_build", build)
    monkeypatch.setattr(cudnn_kernel, "_plans", {})
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    q, k, _ = _qkv(8)
    return cudnn_kernel.plan_key(q, k, _cu(0, 8), 8, 8, False, 1.0, (-1, -1), square=True)


def test_a_graph_build_keeps_no_caller_frame_alive(monkeypatch):
    """The first backward builds its graph: whatever the build leaves in reference cycles must not
    hold that backward's frames (its gradients) until Python's next full collection."""
    import gc
    import weakref

    key = _with_build(monkeypatch, _frame_keeping_build)

    def backward_like() -> weakref.ref:
        gradient = torch.ones(1024)  # a local of a frame below the build
        cudnn_kernel._plan("bwd", key)
        return weakref.ref(gradient)

    gc.collect()
    gc.disable()  # only reference counting frees it, as between two of Python's full collections
    try:
        gradient = backward_like()
        assert gradient() is None, "the graph build kept its caller's frame (and its tensors) alive"
        assert cudnn_kernel._plans[("bwd", key)].workspace == 0
    finally:
        gc.enable()


def test_a_graph_build_error_reaches_the_caller(monkeypatch):
    def failing(kind, key, **kwargs):
        raise ValueError("bad graph")

    key = _with_build(monkeypatch, failing)
    with pytest.raises(cudnn_kernel.BuildError, match="bad graph") as info:
        cudnn_kernel._plan("fwd", key)
    assert isinstance(info.value.__cause__, ValueError) and ("fwd", key) not in cudnn_kernel._plans


# ------------------------------------------------------------------------------------------------
# The backward in groups of KV heads (its workspace: T x H x K float32, three times that with GQA).


def _workspace_by_heads(kind, key, **kwargs):
    """A build whose backward workspace is what cuDNN 9.19's was on the H200: float32 T x H x K for
    MHA, three times that with grouped K/V, for the heads of one launch."""
    h = key.heads
    per_head = key.total_q * key.head_dim * 4 * (1 if key.heads == key.kv_heads else 3)
    return cudnn_kernel._Plan(graph=("graph", kind, key), workspace=h * per_head if kind == "bwd" else 0)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "limit_mb", "groups"),
    [
        (16, 4, 256, 1),
        (16, 4, 32, 2),
        (16, 4, 1, 4),
        (16, 16, 8, 2),
        (16, 16, 1, 16),
        (8, 1, 1, 1),
        (12, 6, 13, 3),
    ],
)
def test_a_backward_over_the_workspace_limit_runs_in_the_fewest_groups_of_kv_heads(
    monkeypatch, heads, kv_heads, limit_mb, groups
):
    """T = 4096, K = 64: 1 MiB per query head of MHA, 3 MiB with GQA; one KV head cannot be split."""
    _with_build(monkeypatch, _workspace_by_heads)
    monkeypatch.setattr(cudnn_kernel, "_grouped", {})
    monkeypatch.setenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", str(limit_mb))
    q, k, _ = _qkv(4096, heads, kv_heads, 64)
    key = cudnn_kernel.plan_key(
        q, k, _cu(0, 4096), 4096, 4096, True, 0.125, (-1, -1), square=True, backward=True
    )
    assert cudnn_kernel.grouped_backward(key) == groups
    group_key = dataclasses.replace(key, heads=heads // groups, kv_heads=kv_heads // groups)
    assert groups == 1 or ("bwd", group_key) in cudnn_kernel._plans
    built = dict(cudnn_kernel._plans)
    assert cudnn_kernel.grouped_backward(key) == groups and cudnn_kernel._plans == built  # decided once
    det = dataclasses.replace(key, deterministic=True)
    assert cudnn_kernel.grouped_backward(det) == 1  # the deterministic backward stays whole


def test_a_grouped_backward_that_does_not_build_runs_whole(monkeypatch):
    def build(kind, key, **kwargs):
        if key.heads < 8:
            raise RuntimeError("no engine")
        return _workspace_by_heads(kind, key)

    _with_build(monkeypatch, build)
    monkeypatch.setattr(cudnn_kernel, "_grouped", {})
    monkeypatch.setenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", "1")
    q, k, _ = _qkv(4096, 8, 2, 64)
    key = cudnn_kernel.plan_key(
        q, k, _cu(0, 4096), 4096, 4096, True, 0.125, (-1, -1), square=True, backward=True
    )
    assert cudnn_kernel.grouped_backward(key) == 1


def test_a_grouped_backward_whose_workspace_does_not_shrink_runs_whole(monkeypatch):
    def build(kind, key, **kwargs):
        return cudnn_kernel._Plan(graph=None, workspace=2**30)

    _with_build(monkeypatch, build)
    monkeypatch.setattr(cudnn_kernel, "_grouped", {})
    q, k, _ = _qkv(4096, 8, 2, 64)
    key = cudnn_kernel.plan_key(
        q, k, _cu(0, 4096), 4096, 4096, True, 0.125, (-1, -1), square=True, backward=True
    )
    assert cudnn_kernel.grouped_backward(key) == 1


@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (6, 6), (8, 4)])
@pytest.mark.parametrize("square", [True, False])
def test_each_group_of_a_grouped_backward_gets_its_own_heads(monkeypatch, heads, kv_heads, square):
    """The launches of a grouped backward, each given its slices of q/k/v/out/dout/stats and of
    dq/dk/dv (computed here by the math kernel in fp64 in place of cuDNN), give the whole backward:
    a query head paired with another group's K/V, or a slice written twice or never, would not.
    Only one group's copies are alive at a time (two would take back the memory grouping saves)."""
    from usp_graph.ops.math_kernel import math_bwd, math_fwd

    _with_build(monkeypatch, _workspace_by_heads)
    monkeypatch.setattr(cudnn_kernel, "_grouped", {})
    monkeypatch.setenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", "0")
    gen = torch.Generator().manual_seed(heads * 10 + kv_heads)
    lengths = [5, 0, 1, 17, 9]
    t = sum(lengths)
    cu = _cu(*torch.tensor([0, *lengths]).cumsum(0).tolist())
    cu_k = cu if square else cu.clone()
    q, dout = (torch.randn(t, heads, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(t, kv_heads, 16, generator=gen, dtype=torch.float64) for _ in range(2))
    args = (cu, cu_k, 17, 17, True, 0.25)
    out, lse = math_fwd(q, k, v, *args)
    launches, copies = [], []

    def execute(plan, key, pack, ws=None):
        # one group's copies at a time: the last group's are gone when the next launches
        assert all(ref() is None for ref in copies), "a group's copies outlived its launch"
        copies.extend(weakref.ref(pack[uid]) for uid in (cudnn_kernel._Q, cudnn_kernel._O, cudnn_kernel._DQ))
        s = cudnn_kernel
        stats = pack[s._STATS][..., 0].t()
        grads = math_bwd(pack[s._DO], pack[s._Q], pack[s._K], pack[s._V], pack[s._O], stats, *args)
        for uid, g in zip((s._DQ, s._DK, s._DV), grads, strict=True):
            assert pack[uid].shape == g.shape
            pack[uid].copy_(g)
        launches.append(pack[s._Q].shape[1])

    monkeypatch.setattr(cudnn_kernel, "_execute", execute)
    got = cudnn_kernel.cudnn_bwd(dout, q, k, v, out, lse, *args, square=square)
    want = math_bwd(dout, q, k, v, out, lse, *args)
    assert launches == [heads // kv_heads] * kv_heads  # a limit of 0: one group per KV head
    for a, b in zip(got, want, strict=True):
        # cuDNN's stats are float32: 1e-7 here; another group's heads would be off by O(1)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("setting", "under_peak", "launches"), [(None, False, 4), (None, True, 1), ("0", True, 4)]
)
def test_a_backward_over_the_limit_runs_whole_where_its_workspace_fits_under_the_peak(
    monkeypatch, setting, under_peak, launches
):
    """Without the setting, a backward whose whole workspace fits under the memory peak so far runs
    in one launch (grouping would save no peak memory and costs time); a limit the user set holds."""
    _with_build(monkeypatch, _workspace_by_heads)
    monkeypatch.setattr(cudnn_kernel, "_grouped", {})
    monkeypatch.setattr(cudnn_kernel, "backward_workspace_limit", lambda: 0)
    if setting is None:
        monkeypatch.delenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", raising=False)
    else:
        monkeypatch.setenv("USP_CUDNN_BACKWARD_WORKSPACE_MB", setting)
    asked: list[int] = []
    monkeypatch.setattr(
        cudnn_kernel, "_under_peak", lambda nbytes, device: asked.append(nbytes) or under_peak
    )
    seen: list[int] = []
    monkeypatch.setattr(
        cudnn_kernel, "_execute", lambda plan, key, pack, ws=None: seen.append(pack[cudnn_kernel._Q].shape[1])
    )
    q, k, v = _qkv(64, 8, 4, 16)
    out, dout = torch.randn_like(q), torch.randn_like(q)
    lse = torch.zeros(8, 64)
    cudnn_kernel.cudnn_bwd(dout, q, k, v, out, lse, _cu(0, 64), _cu(0, 64), 64, 64, True, 0.25, square=True)
    assert len(seen) == launches and sum(seen) == 8
    if setting is None:  # asked with the whole backward's workspace: float32 T x H x K, three times with GQA
        assert asked == [64 * 8 * 16 * 4 * 3]


def test_under_peak_compares_the_allocator_high_water_mark(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 10 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 12 * 2**30)
    assert cudnn_kernel._under_peak(2**30, cuda)
    assert not cudnn_kernel._under_peak(2 * 2**30, cuda)  # the allocator's rounding: not a byte over
    assert not cudnn_kernel._under_peak(1, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    assert not cudnn_kernel._under_peak(2**30, cuda)  # a graph being captured keeps the limit


def test_importing_usp_graph_does_not_import_cudnn():
    code = "import sys, usp_graph, usp_graph.ops.varlen; print('cudnn' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# ------------------------------------------------------------------------------------------------
# Kernel choice.


def test_kernel_setting_accepts_cudnn_from_the_environment():
    code = "from usp_graph.ops import kernel_choice; print(kernel_choice._cuda_kernel)"
    env = {**__import__("os").environ, "USP_CUDA_ATTENTION": "cudnn"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.strip() == "cudnn"
    with varlen.cuda_kernel("cudnn"):
        assert kernel_choice._cuda_kernel == "cudnn"
    assert kernel_choice._cuda_kernel == "auto"


def test_auto_table_uses_shapes_only_and_cudnn_only_when_installed(monkeypatch):
    long128 = torch.zeros(16384, 4, 128, dtype=torch.bfloat16)
    long64 = torch.zeros(16384, 4, 64, dtype=torch.bfloat16)
    longer64 = torch.zeros(32768, 4, 64, dtype=torch.bfloat16)
    short = torch.zeros(4096, 4, 128, dtype=torch.bfloat16)
    monkeypatch.setattr(cudnn_kernel, "available", lambda: False)
    assert kernel_choice._auto_kernel(long128) == "flex"  # today's choice without the package
    assert kernel_choice._auto_kernel(longer64) == "flash"
    monkeypatch.setattr(cudnn_kernel, "available", lambda: True)
    assert kernel_choice._auto_kernels(long128) == ["cudnn", "flex", "flash"]
    assert kernel_choice._auto_kernel(long64) == "flash"  # measured: flash ahead at 16K with K=64
    assert kernel_choice._auto_kernel(longer64) == "cudnn"
    assert kernel_choice._auto_kernel(short) == "flash"


def _fake_cuda(monkeypatch, cudnn_result=None, cudnn_grads=None, build_error=False):
    """`_cuda_fwd`/`_cuda_bwd` on CPU: flash is the CPU kernel and cuDNN returns what the test
    gives (a function of the CPU kernel's result); calls are counted."""
    calls = {"flash_fwd": 0, "flash_bwd": 0, "cudnn_fwd": 0, "cudnn_bwd": 0}

    def counted(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)

        return run

    def fake_fwd(q, k, v, cu_q, cu_k, max_q, max_k, c, s, window=(-1, -1), **kw):
        if build_error:
            raise cudnn_kernel.BuildError("no engine")
        return (cudnn_result or tuple)(varlen._cpu_fwd(q, k, v, cu_q, cu_k, max_q, max_k, c, s, *window))

    def fake_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, c, s, window=(-1, -1), **kw):
        return (cudnn_grads or tuple)(
            varlen._cpu_bwd(do, q, k, v, o, lse, cu_q, cu_k, max_q, max_k, c, s, *window)
        )

    monkeypatch.setattr(flash_kernel, "flash_fwd", counted("flash_fwd", varlen._cpu_fwd))
    monkeypatch.setattr(flash_kernel, "flash_bwd", counted("flash_bwd", varlen._cpu_bwd))
    monkeypatch.setattr(cudnn_kernel, "available", lambda: True)
    monkeypatch.setattr(cudnn_kernel, "cudnn_fwd", counted("cudnn_fwd", fake_fwd))
    monkeypatch.setattr(cudnn_kernel, "cudnn_bwd", counted("cudnn_bwd", fake_bwd))
    monkeypatch.setattr(cudnn_kernel, "backward_groups", lambda key, device, to_allocate=0: 1)
    monkeypatch.setattr(kernel_choice, "_cudnn_checked", set())
    monkeypatch.setattr(kernel_choice, "_cudnn_broken", set())
    monkeypatch.setattr(kernel_choice, "_flex_broken", set())
    cu = _cu(0, 40, 41, 41, 128)
    q, k, v = _qkv(128, 4, 2, 64, seed=3)
    dout = _qkv(128, 4, 4, 64, seed=4)[0]
    return calls, (q, k, v, cu, cu, 87, 87, True, 0.125), dout


def _same(got, ref):
    return all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))


def test_cudnn_first_call_agrees_then_runs_unchecked(monkeypatch):
    def nudge(res):
        return tuple(x * (1 + 2e-3) for x in res)

    calls, args, dout = _fake_cuda(monkeypatch, nudge, nudge)
    with varlen.cuda_kernel("cudnn"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for _ in range(2):
            out, lse = varlen._cuda_fwd(*args)
            grads = varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
    assert _same((out, lse), nudge(varlen._cpu_fwd(*args)))  # cuDNN's own result, not flash's
    assert _same(grads, nudge(varlen._cpu_bwd(dout, *args[:3], out, lse, *args[3:])))
    assert calls == {"flash_fwd": 1, "flash_bwd": 1, "cudnn_fwd": 2, "cudnn_bwd": 2}


def test_each_launch_form_of_the_cudnn_backward_is_checked_on_its_own_first_call(monkeypatch):
    """Whole or in groups of KV heads (the memory peak decides per call): a form's first call is
    checked against flash even when the other form of the same shape was checked already."""
    calls, args, dout = _fake_cuda(monkeypatch)
    forms = iter([4, 4, 1, 1, 4])
    given = []
    monkeypatch.setattr(cudnn_kernel, "backward_groups", lambda key, device, to_allocate=0: next(forms))
    fake = cudnn_kernel.cudnn_bwd
    monkeypatch.setattr(
        cudnn_kernel, "cudnn_bwd", lambda *a, **kw: given.append(kw["groups"]) or fake(*a, **kw)
    )
    with varlen.cuda_kernel("cudnn"), warnings.catch_warnings():
        warnings.simplefilter("error")
        out, lse = varlen._cuda_fwd(*args)
        checks = []
        for _ in range(5):
            before = calls["flash_bwd"]
            varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
            checks.append(calls["flash_bwd"] - before)
    assert given == [4, 4, 1, 1, 4] and checks == [1, 0, 1, 0, 0]


@pytest.mark.parametrize("where", ["forward", "backward"])
def test_cudnn_first_call_disagrees_falls_back_to_flash_for_good(monkeypatch, where):
    def bad(res):
        return (res[0] * 1.1, *res[1:])

    calls, args, dout = _fake_cuda(
        monkeypatch, bad if where == "forward" else None, bad if where == "backward" else None
    )
    with varlen.cuda_kernel("cudnn"):
        with pytest.warns(RuntimeWarning, match=f"cudnn {where} kernel .* disagrees with flash varlen"):
            out, lse = varlen._cuda_fwd(*args)
            grads = varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
        assert _same((out, lse), varlen._cpu_fwd(*args))  # flash's result, exactly
        assert _same(grads, varlen._cpu_bwd(dout, *args[:3], out, lse, *args[3:]))
        seen = dict(calls)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            varlen._cuda_fwd(*args)
            varlen._cuda_bwd(dout, *args[:3], out, lse, *args[3:])
    # the shape runs flash from then on (a failed forward takes the backward along: one key set)
    assert calls["cudnn_fwd"] == seen["cudnn_fwd"] and calls["cudnn_bwd"] == seen["cudnn_bwd"]
    assert calls["flash_fwd"] == seen["flash_fwd"] + 1 and calls["flash_bwd"] == seen["flash_bwd"] + 1


def test_batches_of_other_documents_are_checked_against_flash_once_per_bucket(monkeypatch):
    calls, args, dout = _fake_cuda(monkeypatch)
    seen = []
    fake = cudnn_kernel.cudnn_fwd
    monkeypatch.setattr(
        cudnn_kernel, "cudnn_fwd", lambda *a, **kw: seen.append(kw["metadata"]) or fake(*a, **kw)
    )
    q, k, v = args[:3]
    batches = [(0, 40, 41, 41, 128, 128), (0, 70, 90, 100, 128, 128, 128), (0, 1, 66, 128, 128, 128)]
    with varlen.cuda_kernel("cudnn"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for bounds in batches:  # 5 or 6 slots, longest 65..87: one bucket (6 slots, S 96)
            cu = _cu(*bounds)
            longest = int((cu[1:] - cu[:-1]).max())
            out, lse = varlen._cuda_fwd(q, k, v, cu, cu, longest, longest, True, 0.125)
            varlen._cuda_bwd(dout, q, k, v, out, lse, cu, cu, longest, longest, True, 0.125)
    assert calls == {"flash_fwd": 1, "flash_bwd": 1, "cudnn_fwd": 3, "cudnn_bwd": 3}
    for (seq_q, _), (off_q, _, _) in seen:  # what cuDNN gets: padded to the key's 6 slots
        assert seq_q.shape == (6, 1, 1, 1) and off_q.shape == (7, 1, 1, 1) and int(seq_q.sum()) == 128


def test_cudnn_build_error_warns_and_runs_flash(monkeypatch):
    calls, args, dout = _fake_cuda(monkeypatch, build_error=True)
    with varlen.cuda_kernel("cudnn"):
        with pytest.warns(RuntimeWarning, match="no engine; flash varlen runs this shape"):
            out, lse = varlen._cuda_fwd(*args)
        assert _same((out, lse), varlen._cpu_fwd(*args))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            varlen._cuda_fwd(*args)
    assert calls["cudnn_fwd"] == 1 and calls["flash_fwd"] == 2


def test_cudnn_asked_for_without_the_package_warns_once_and_runs_flash(monkeypatch):
    calls, args, dout = _fake_cuda(monkeypatch)
    monkeypatch.setattr(cudnn_kernel, "available", lambda: False)
    monkeypatch.setattr(kernel_choice, "_cudnn_warned_missing", False)
    with varlen.cuda_kernel("cudnn"):
        with pytest.warns(RuntimeWarning, match="nvidia-cudnn-frontend"):
            varlen._cuda_fwd(*args)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            varlen._cuda_fwd(*args)
    assert calls["cudnn_fwd"] == 0 and calls["flash_fwd"] == 2


def test_auto_without_the_package_warns_once_where_cudnn_would_run_and_says_what_runs(monkeypatch):
    monkeypatch.setattr(cudnn_kernel, "available", lambda: False)
    monkeypatch.setattr(kernel_choice, "_cudnn_warned_missing", False)
    small = torch.empty(1024, 16, 128, dtype=torch.bfloat16, device="meta")
    large = torch.empty(32768, 16, 128, dtype=torch.bfloat16, device="meta")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # below the table's cuDNN lengths: nothing is lost, nothing said
        assert not kernel_choice._use_cudnn(small, small, small, ())
    with pytest.warns(RuntimeWarning, match=r"flex runs instead, about .*slower"):
        assert not kernel_choice._use_cudnn(large, large, large, ())
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        kernel_choice._use_cudnn(large, large, large, ())


def test_flash_or_flex_setting_never_runs_cudnn(monkeypatch):
    calls, args, dout = _fake_cuda(monkeypatch)
    monkeypatch.setattr(kernel_choice, "_use_flex", lambda *a: False)  # flex cannot build on CPU
    for kernel in ("flash", "flex"):
        with varlen.cuda_kernel(kernel):
            varlen._cuda_fwd(*args)
    assert calls["cudnn_fwd"] == 0 and calls["flash_fwd"] == 2


# ------------------------------------------------------------------------------------------------
# The device-side boundary check (issue 17): no host sync on CUDA; on CPU the same check raises.


@pytest.mark.parametrize(
    "cu_q,cu_k,t_q,t_k,max_q,max_k,ok",
    [
        ((0, 300, 512), None, 512, 512, 300, 300, True),
        ((0, 300, 512), None, 512, 512, 64, 64, False),  # max_seqlen below the longest document
        ((0, 300, 512), None, 512, 512, 300, 212, False),  # one boundary tensor: both bounds hold
        ((0, 300, 511), None, 512, 512, 300, 300, False),  # queries must end at the token count
        ((0, 300, 200, 512), None, 512, 512, 512, 512, False),  # decreasing
        ((0, 10, 20), (5, 15, 25), 20, 30, 10, 10, True),  # keys outside every document
        ((0, 10, 20), (5, 15, 31), 20, 30, 10, 16, False),  # keys past the key count
        ((0, 10, 20), (-1, 15, 25), 20, 30, 16, 16, False),
        ((0, 10, 20), (5, 15, 25), 20, 30, 10, 9, False),  # a key range longer than max_seqlen_k
        ((0, 10, 20), (5, 2, 25), 20, 30, 10, 30, False),
    ],
)
def test_boundaries_ok(cu_q, cu_k, t_q, t_k, max_q, max_k, ok):
    a = _cu(*cu_q)
    b = a if cu_k is None else _cu(*cu_k)
    got, lens_q, lens_k = boundaries.boundaries_ok(a, b, t_q, t_k, max_q, max_k)
    assert bool(got) is ok
    assert lens_q.tolist() == torch.diff(a).tolist() and lens_k.tolist() == torch.diff(b).tolist()


def test_max_seqlen_below_a_document_raises_in_the_cuda_dispatch(monkeypatch):
    """The CUDA dispatch (run here on CPU tensors, flash replaced by the CPU kernel) refuses the
    issue-17 case; on CUDA the same check is a device-side assertion."""
    monkeypatch.setattr(flash_kernel, "flash_fwd", varlen._cpu_fwd)
    q, k, v = _qkv(512, 4, 4, 64)
    cu = _cu(0, 300, 512)
    with pytest.raises(RuntimeError, match="no document longer than max_seqlen_q=64"):
        varlen._cuda_fwd(q, k, v, cu, cu, 64, 64, False, 0.125)
    out, _ = varlen._cuda_fwd(q, k, v, cu, cu, 300, 300, False, 0.125)
    assert out.shape == q.shape


def test_boundary_check_runs_once_per_tensor_and_version(monkeypatch):
    runs = []
    real = boundaries.assert_boundaries

    def counted(*args):
        runs.append(args[0])
        return real(*args)

    monkeypatch.setattr(boundaries, "assert_boundaries", counted)
    monkeypatch.setattr(boundaries, "_boundary_cache", {})
    cu = _cu(0, 3, 8)
    for _ in range(3):
        boundaries.checked_lengths(cu, cu, 8, 8, 5, 5)
    assert len(runs) == 1
    cu.add_(0)  # an in-place write: a new version, checked again
    boundaries.checked_lengths(cu, cu, 8, 8, 5, 5)
    twin = cu.clone()  # equal values, another tensor: checked again
    boundaries.checked_lengths(twin, twin, 8, 8, 5, 5)
    boundaries.checked_lengths(cu, cu, 8, 8, 6, 6)  # other settings
    assert len(runs) == 4
    cu[2] = 9  # a bad value written in place is caught
    with pytest.raises(RuntimeError):
        boundaries.checked_lengths(cu, cu, 8, 8, 5, 5)
    with torch.inference_mode():
        inf_cu = _cu(0, 3, 8)
    boundaries.checked_lengths(inf_cu, inf_cu, 8, 8, 5, 5)
    boundaries.checked_lengths(inf_cu, inf_cu, 8, 8, 5, 5)  # no version counter: never cached
    assert len(runs) == 7


# ------------------------------------------------------------------------------------------------
# Boundaries with a slot per token (documents derived from position ids on the device) are cut to
# their documents before a CUDA kernel sees them: one host read per boundary tensor.


def _one_slot_per_token(lengths: list[int]) -> torch.Tensor:
    from usp_graph import masks

    pos = torch.cat([torch.arange(n) for n in lengths])[None]
    return masks.cu_seqlens_from_positions(pos)  # T + 1 entries, unused slots repeat T


def _fit_setup(monkeypatch, lengths):
    calls, _, _ = _fake_cuda(monkeypatch)
    monkeypatch.setattr(kernel_choice, "FIT_MIN_TOKENS", 64)
    seen, reads = [], []
    fake_fwd, fake_bwd = cudnn_kernel.cudnn_fwd, cudnn_kernel.cudnn_bwd
    monkeypatch.setattr(
        cudnn_kernel, "cudnn_fwd", lambda *a, **kw: seen.append(("fwd", a[3], a[5])) or fake_fwd(*a, **kw)
    )
    monkeypatch.setattr(
        cudnn_kernel, "cudnn_bwd", lambda *a, **kw: seen.append(("bwd", a[6], a[8])) or fake_bwd(*a, **kw)
    )
    fit = kernel_choice.fit_to_documents
    monkeypatch.setattr(
        kernel_choice, "fit_to_documents", lambda cu, bound: reads.append(1) or fit(cu, bound)
    )
    t = sum(lengths)
    q, k, v = _qkv(t, 4, 2, 64, seed=5)
    dout = _qkv(t, 4, 4, 64, seed=6)[0]
    return calls, seen, reads, (q, k, v), dout


@pytest.mark.parametrize(
    "lengths", [[40, 1, 47, 40], [1] * 70 + [58], [128]], ids=["mixed", "many-short", "one"]
)
def test_a_slot_per_token_is_cut_to_the_documents_once_and_gives_the_same_result(monkeypatch, lengths):
    calls, seen, reads, (q, k, v), dout = _fit_setup(monkeypatch, lengths)
    t = sum(lengths)
    cu = _one_slot_per_token(lengths)
    want_out, want_lse = varlen._cpu_fwd(q, k, v, cu, cu, t, t, True, 0.125)
    want_grads = varlen._cpu_bwd(dout, q, k, v, want_out, want_lse, cu, cu, t, t, True, 0.125)
    with varlen.cuda_kernel("cudnn"):
        for layer in range(3):  # every layer and the backward share one boundary tensor: one read
            out, lse = varlen._cuda_fwd(q, k, v, cu, cu, t, t, True, 0.125)
            grads = varlen._cuda_bwd(dout, q, k, v, out, lse, cu, cu, t, t, True, 0.125)
            assert _same((out, lse), (want_out, want_lse)) and _same(grads, want_grads), layer
    assert len(reads) == 1
    slots = capacity_bucket(len(lengths))
    for kind, got_cu, got_max in seen:
        assert got_cu.numel() - 1 == min(slots, t), kind
        assert got_cu[: len(lengths) + 1].tolist() == torch.cumsum(torch.tensor([0, *lengths]), 0).tolist()
        assert got_max == max(lengths), kind
    assert calls["cudnn_fwd"] == 3 and calls["cudnn_bwd"] == 3


def test_empty_slots_before_the_last_document_are_kept(monkeypatch):
    _, seen, _, (q, k, v), _ = _fit_setup(monkeypatch, [128])
    # 128 tokens, 129 slots: documents of 50 and 78 tokens with empty slots between and after
    cu = _cu(0, 0, 0, 50, 50, 50, 128, *([128] * 123))
    assert cu.numel() == 130
    want = varlen._cpu_fwd(q, k, v, cu, cu, 128, 128, False, 0.125)
    with varlen.cuda_kernel("cudnn"):
        got = varlen._cuda_fwd(q, k, v, cu, cu, 128, 128, False, 0.125)
    assert _same(got, want)
    ((_, got_cu, got_max),) = seen
    assert got_cu.tolist() == [0, 0, 0, 50, 50, 50, 128] and got_max == 78


@pytest.mark.parametrize("flex_builds", [True, False], ids=["flex", "flex-fails"])
def test_flex_takes_a_slot_per_token_as_it_is_and_reads_nothing(monkeypatch, flex_builds):
    # flex reads each token's document on the device: no host read, whatever the slots. Only the
    # first call's check against flash, and flash where flex cannot build, cut the slots (one read).
    calls, seen, reads, (q, k, v), dout = _fit_setup(monkeypatch, [40, 1, 47, 40])
    flex_seen = []

    def flex_fwd(q, k, v, cu, c, s):
        if not flex_builds:
            raise flex_kernel.BuildError("no graph")
        flex_seen.append(cu)
        return varlen._cpu_fwd(q, k, v, cu, cu, q.shape[0], q.shape[0], c, s)

    def flex_bwd(do, q, k, v, o, lse, cu, c, s):
        flex_seen.append(cu)
        return varlen._cpu_bwd(do, q, k, v, o, lse, cu, cu, q.shape[0], q.shape[0], c, s)

    flash_seen = []
    flash_fwd, flash_bwd = flash_kernel.flash_fwd, flash_kernel.flash_bwd
    monkeypatch.setattr(flash_kernel, "flash_fwd", lambda *a: flash_seen.append(a[3]) or flash_fwd(*a))
    monkeypatch.setattr(flash_kernel, "flash_bwd", lambda *a: flash_seen.append(a[6]) or flash_bwd(*a))
    monkeypatch.setattr(flex_kernel, "flex_fwd", flex_fwd)
    monkeypatch.setattr(flex_kernel, "flex_bwd", flex_bwd)
    monkeypatch.setattr(kernel_choice, "_flex_applies", lambda *a: True)  # the test's fp32 tensors
    monkeypatch.setattr(kernel_choice, "_flex_checked", set())
    for step, lengths in enumerate([[40, 1, 47, 40], [1] * 70 + [58], [128]]):
        cu = _one_slot_per_token(lengths)  # each step its own boundary tensor
        want_out, want_lse = varlen._cpu_fwd(q, k, v, cu, cu, 128, 128, True, 0.125)
        want = varlen._cpu_bwd(dout, q, k, v, want_out, want_lse, cu, cu, 128, 128, True, 0.125)
        reads.clear()
        flash_seen.clear()
        with varlen.cuda_kernel("flex"), warnings.catch_warnings():
            warnings.simplefilter("ignore" if not flex_builds else "error")
            for _ in range(2):
                out, lse = varlen._cuda_fwd(q, k, v, cu, cu, 128, 128, True, 0.125)
                grads = varlen._cuda_bwd(dout, q, k, v, out, lse, cu, cu, 128, 128, True, 0.125)
                assert _same((out, lse), (want_out, want_lse)) and _same(grads, want), step
        if flex_builds:
            assert len(reads) == (1 if step == 0 else 0), step  # the first call's check only
            assert flex_seen and all(c is cu for c in flex_seen[-4:])
        else:
            assert len(reads) == 1 and not flex_seen  # flash runs, on the slots cut once
        assert len(flash_seen) == (0 if flex_builds and step else 2 if flex_builds else 4), step
        assert all(c.numel() == capacity_bucket(len(lengths)) + 1 for c in flash_seen), step


@pytest.mark.parametrize("case", ["slot-per-token", "a-slot-per-document"])
def test_auto_keeps_flash_below_16k_even_where_it_reads_the_slots(monkeypatch, case):
    # Below cuDNN's range auto runs flash, which cuts a slot per token by one host read. flex would
    # need none but builds its graphs per token count (~20 s each), and the Trainer path's count
    # changes every batch: auto keeps flash (flex only where asked for). A slot per document needs
    # no read.
    lengths = [40, 1, 47, 40]
    _, _, reads, _, dout = _fit_setup(monkeypatch, lengths)
    q, k, v = _qkv(128, 4, 2, 128, seed=5)  # head dim 128: where flex is measured fastest
    dout = _qkv(128, 4, 4, 128, seed=6)[0]
    cu = _one_slot_per_token(lengths) if case != "a-slot-per-document" else _cu(0, 40, 41, 88, 128)
    flex_seen = []

    def flex_fwd(q, k, v, cu, c, s):
        flex_seen.append(cu)
        return varlen._cpu_fwd(q, k, v, cu, cu, 128, 128, c, s)

    def flex_bwd(do, q, k, v, o, lse, cu, c, s):
        flex_seen.append(cu)
        return varlen._cpu_bwd(do, q, k, v, o, lse, cu, cu, 128, 128, c, s)

    monkeypatch.setattr(flex_kernel, "flex_fwd", flex_fwd)
    monkeypatch.setattr(flex_kernel, "flex_bwd", flex_bwd)
    monkeypatch.setattr(kernel_choice, "_flex_applies", lambda *a: True)
    monkeypatch.setattr(kernel_choice, "_flex_checked", set())
    assert kernel_choice._auto_kernel(q) == "flash"
    want_out, want_lse = varlen._cpu_fwd(q, k, v, cu, cu, 128, 128, True, 0.125)
    want = varlen._cpu_bwd(dout, q, k, v, want_out, want_lse, cu, cu, 128, 128, True, 0.125)
    with varlen.cuda_kernel("auto"), warnings.catch_warnings():
        warnings.simplefilter("error")
        for step in range(2):
            reads.clear()
            out, lse = varlen._cuda_fwd(q, k, v, cu, cu, 128, 128, True, 0.125)
            grads = varlen._cuda_bwd(dout, q, k, v, out, lse, cu, cu, 128, 128, True, 0.125)
            assert _same((out, lse), (want_out, want_lse)) and _same(grads, want), step
            # flash: one read per boundary tensor with a slot per token (the same tensor both steps)
            per_token = case == "slot-per-token"
            assert flex_seen == [] and len(reads) == (1 if per_token and step == 0 else 0)


@pytest.mark.parametrize("case", ["few-slots", "short", "cross", "capturing"])
def test_boundaries_are_left_alone_where_cutting_does_not_pay_or_cannot_run(monkeypatch, case):
    lengths = [40, 1, 47, 40]
    _, seen, reads, (q, k, v), _ = _fit_setup(monkeypatch, lengths)
    t = sum(lengths)
    cu_q = cu_k = _one_slot_per_token(lengths)
    if case == "few-slots":  # what AttentionMetadata.from_lengths gives: a slot per document
        cu_q = cu_k = _cu(0, 40, 41, 88, 128)
    elif case == "short":
        monkeypatch.setattr(kernel_choice, "FIT_MIN_TOKENS", 4096)
    elif case == "cross":
        cu_k = cu_q.clone()
    else:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with varlen.cuda_kernel("cudnn"):
        varlen._cuda_fwd(q, k, v, cu_q, cu_k, t, t, True, 0.125)
    assert reads == []
    ((_, got_cu, got_max),) = seen
    assert got_cu is cu_q and got_max == t


def test_flash_lse_conversions_equal_the_masked_fill_forms_bitwise():
    # flash's lse (+inf: a row that sees no key) to the contract's (-inf) and back, in one kernel
    # each: exactly what the two-kernel masked_fill forms give, NaN and -0.0 included.
    g = torch.Generator().manual_seed(3)
    lse = torch.randn(4, 257, generator=g) * 30
    specials = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 3.4e38, -3.4e38])
    lse.view(-1)[torch.randperm(lse.numel(), generator=g)[: 7 * 20]] = specials.repeat(20)
    out = flash_kernel.lse_out(lse)
    assert torch.equal(out.isnan(), lse.isnan())
    want = lse.masked_fill(lse == float("inf"), float("-inf"))
    assert torch.equal(out.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
    assert torch.equal(torch.signbit(out), torch.signbit(want))
    back = flash_kernel.lse_in(out)
    want = out.masked_fill(out == float("-inf"), float("inf"))
    assert torch.equal(back.nan_to_num(nan=7.0), want.nan_to_num(nan=7.0))
    assert torch.equal(torch.signbit(back), torch.signbit(want))
    assert torch.equal(back.isnan(), lse.isnan())
