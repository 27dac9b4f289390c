"""Every usp op propagates shapes on the meta device, forward and backward (issue 30).

# T packed tokens, H query heads, G key/value heads, K head dim, Kv value head dim

Meta tensors are how models are initialised without memory and how shapes are checked: every torch
op accepts them, so every usp op must too. Attention ops are compared with a CPU run on real data
(shapes, dtypes, strides of every output and gradient); collectives, which need no process group
on meta (their meta kernel never reaches one), with the shapes their schema promises for a group
of 2. A usp op that this file does not cover fails `test_every_usp_op_is_covered`.
"""

from __future__ import annotations

import pytest
import torch

import usp_graph  # noqa: F401  (registers the usp ops)
from usp_graph import registry
from usp_graph.ops import varlen

META = torch.device("meta")
NO_GROUP = "no_such_group"  # on meta no group is looked up


def _layout(t: torch.Tensor) -> tuple:
    return tuple(t.shape), t.dtype, t.stride()


# (name, H, G, K, Kv, lengths_q, lengths_k, is_causal, window, dtype)
VARLEN_FORMS = [
    ("mha causal", 4, 4, 8, 8, [5, 0, 1, 6], None, True, None, torch.float64),
    ("gqa bidirectional", 4, 2, 8, 8, [3, 9], None, False, None, torch.float32),
    ("value head dim differs", 2, 1, 8, 6, [4, 4, 4], None, True, None, torch.float32),
    ("sliding window", 4, 2, 8, 8, [7, 5], None, True, (2, 0), torch.float64),
    ("two-sided window", 2, 2, 4, 4, [6, 3], None, False, (1, 2), torch.float32),
    ("short queries over keys", 2, 2, 8, 8, [2, 3], [5, 6], True, None, torch.float64),
    ("bfloat16", 2, 2, 8, 8, [4, 4], None, True, None, torch.bfloat16),
]


def _cu(lengths: list[int], slots: int) -> torch.Tensor:
    ends = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)
    return torch.cat([ends, ends[-1:].expand(slots + 1 - len(ends))])


def _varlen_inputs(h, g, k, kv, lq, lk, dtype, device):
    lk = lk or lq
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(sum(lq), h, k, generator=gen, dtype=torch.float64).to(dtype)
    kk = torch.randn(sum(lk), g, k, generator=gen, dtype=torch.float64).to(dtype)
    v = torch.randn(sum(lk), g, kv, generator=gen, dtype=torch.float64).to(dtype)
    slots = max(len(lq), len(lk)) + 2  # unused tail slots, as AttentionMetadata has
    cu_q, cu_k = _cu(lq, slots), _cu(lk, slots)
    return [x.to(device).requires_grad_(x.is_floating_point()) for x in (q, kk, v)] + [
        cu_q.to(device),
        cu_k.to(device),
        max(lq),
        max(lk),
    ]


@pytest.mark.parametrize("form", VARLEN_FORMS, ids=[f[0] for f in VARLEN_FORMS])
def test_varlen_attn_on_meta_matches_cpu_forward_and_backward(form):
    _, h, g, k, kv, lq, lk, is_causal, window, dtype = form
    results = {}
    for device in ("cpu", META):
        q, kk, v, cu_q, cu_k, mq, mk = _varlen_inputs(h, g, k, kv, lq, lk, dtype, device)
        out, lse = varlen.varlen_attn(
            q, kk, v, cu_q, cu_k, mq, mk, is_causal=is_causal, enable_gqa=True, return_lse=True, window=window
        )
        # Both outputs feed the loss, so the backward also runs the lse-gradient terms.
        (out.sum() + lse.masked_fill(lse.isinf(), 0).sum()).backward()
        results[str(device)] = [out, lse, q.grad, kk.grad, v.grad]
    for got, want in zip(results["meta"], results["cpu"], strict=True):
        assert got.device == META
        assert _layout(got) == _layout(want)


@pytest.mark.parametrize("window", [(), (3, 0)], ids=["no window", "window"])
def test_varlen_ops_called_directly_on_meta(window):
    q, k, v, cu_q, cu_k, mq, mk = _varlen_inputs(4, 2, 8, 6, [3, 5], None, torch.float32, META)
    out, lse = torch.ops.usp.varlen_fwd(q, k, v, cu_q, cu_k, mq, mk, True, 0.25, *window)
    assert _layout(out) == ((8, 4, 6), torch.float32, (24, 6, 1)) and _layout(lse) == (
        (4, 8),
        torch.float32,
        (8, 1),
    )
    dq, dk, dv = torch.ops.usp.varlen_bwd(out, q, k, v, out, lse, cu_q, cu_k, mq, mk, True, 0.25, *window)
    assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)
    assert all(t.device == META for t in (out, lse, dq, dk, dv))


def test_ring_attention_on_meta_forward_and_backward():
    """``usp::ring_attn_fwd`` / ``ring_attn_bwd`` (2 ranks' chunk ids) need no group on meta."""
    q, k, v, cu, _, mq, _ = _varlen_inputs(4, 2, 8, 8, [3, 5], None, torch.float32, META)
    for win in ({}, {"window_left": 2, "window_right": 0}):
        out, lse = torch.ops.usp.ring_attn_fwd(q, k, v, cu, mq, True, 0.3, [0, 1], 1, NO_GROUP, **win)
        assert (out.shape, lse.shape, lse.dtype) == ((8, 4, 8), (4, 8), torch.float32)
        out.sum().backward()
        assert (q.grad.shape, k.grad.shape, v.grad.shape) == (q.shape, k.shape, v.shape)
        q.grad = k.grad = v.grad = None
        dq, dk, dv = torch.ops.usp.ring_attn_bwd(
            out, q, k, v, out, lse, cu, mq, True, 0.3, [0, 1], 1, NO_GROUP, **win
        )
        assert (dq.shape, dk.shape, dv.shape) == (q.shape, k.shape, v.shape)


# Collectives over a group of 2: (op, args after x, x shape, output shape). Each forward op is also
# differentiated on meta: its backward (the adjoint collective) must give x's shape back.
COLLECTIVES = [
    ("all_gather", (1, 2, NO_GROUP), (3, 4, 5), (3, 8, 5)),
    ("all_gather", (0, 2, NO_GROUP), (3, 4, 5), (6, 4, 5)),
    ("reduce_scatter", (1, 2, NO_GROUP), (3, 4, 5), (3, 2, 5)),
    ("reduce_scatter", (2, 2, NO_GROUP), (3, 4, 6), (3, 4, 3)),
    ("all_to_all", (1, 2, [2, 2], [5, 5], NO_GROUP), (3, 4, 5), (3, 2, 10)),  # Ulysses: heads <-> sequence
    ("all_to_all", (2, 1, [5, 5], [2, 2], NO_GROUP), (3, 2, 10), (3, 4, 5)),  # and back
    ("halo_exchange", (1, 2, 1, 3, NO_GROUP), (3, 6, 5), (3, 9, 5)),
    ("halo_exchange", (1, 3, 0, 0, NO_GROUP), (2, 6, 4), (2, 9, 4)),
    ("halo_reduce", (1, 2, 1, NO_GROUP), (3, 9, 5), (3, 6, 5)),
]


@pytest.mark.parametrize("case", COLLECTIVES, ids=[f"{c[0]}{c[2]}" for c in COLLECTIVES])
def test_collective_on_meta_forward_and_backward(case):
    name, args, x_shape, out_shape = case
    x = torch.empty(x_shape, device=META, dtype=torch.float64, requires_grad=True)
    y = getattr(torch.ops.usp, name)(x, *args)
    assert (y.shape, y.device, y.dtype) == (out_shape, META, torch.float64)
    y.sum().backward()
    assert (x.grad.shape, x.grad.device) == (x.shape, META)


def test_uneven_all_to_all_on_meta_needs_its_group():
    """An uneven split's output depends on this rank's share, so its meta kernel asks the group for
    the rank: without one, a ValueError that says to initialise torch.distributed (never a guess)."""
    x = torch.empty(3, 5, 5, device=META)
    with pytest.raises(ValueError, match="init_process_group"):
        torch.ops.usp.all_to_all(x, 1, 2, [3, 2], [5, 5], NO_GROUP)


def test_issued_collectives_and_wait_on_meta():
    """The lowered (overlap) forms: issue -> wait gives what the collective gives."""
    x = torch.empty(3, 4, 5, device=META)
    for name, args, out_shape in [
        ("all_gather", (1, 2, NO_GROUP), (3, 8, 5)),
        ("reduce_scatter", (1, 2, NO_GROUP), (3, 2, 5)),
        ("all_to_all", (1, 2, [2, 2], [5, 5], NO_GROUP), (3, 2, 10)),
    ]:
        started = getattr(torch.ops.usp, f"{name}_start")(x, *args)
        assert started.device == META
        dim = args[0] if name != "all_to_all" else args[1]
        done = torch.ops.usp.wait(started, dim, name == "reduce_scatter")
        assert done.shape == getattr(torch.ops.usp, name)(x, *args).shape == out_shape, name


def _usp_ops() -> set[str]:
    names = set()
    for rule in registry.TABLE:
        names |= {rule.op, *rule.backward_ops}
        if rule.adjoint:
            names.add(rule.adjoint)
        if rule.issue:
            names.add(rule.issue)
    return names | {registry.WAIT}


COVERED = (
    {"varlen_fwd", "varlen_bwd", "ring_attn_fwd", "ring_attn_bwd", "wait"}
    | {c[0] for c in COLLECTIVES}
    | {f"{c[0]}_start" for c in COLLECTIVES if c[0] in ("all_gather", "reduce_scatter", "all_to_all")}
)


def test_every_usp_op_is_covered():
    names = {n.split("::")[1] for n in _usp_ops()}
    registered = {
        n for n in dir(torch.ops.usp) if isinstance(getattr(torch.ops.usp, n), torch._ops.OpOverloadPacket)
    }
    assert names <= registered
    assert registered <= COVERED, f"usp ops with no meta test: {sorted(registered - COVERED)}"


@pytest.mark.parametrize("metadata_device", ["cpu", "meta"])
def test_meta_initialised_model_runs_under_attention_mode(metadata_device):
    """A model built on the meta device (no memory) checks its shapes through usp's attention,
    forward and backward, as it would through SDPA."""
    from usp_graph import AttentionMetadata, attention_mode
    from usp_graph.models import Llama, LlamaConfig

    config = LlamaConfig(n_layers=1)
    meta = AttentionMetadata.from_lengths([5, 0, 1, 10], max_docs=8)
    position_ids = torch.tensor([[0, 1, 2, 3, 4, 0, *range(10)]])
    shapes = {}
    for device in ("cpu", META):
        with torch.device(device):
            torch.manual_seed(0)
            model = Llama(config)
        ids = torch.zeros(1, 16, dtype=torch.long, device=device)
        with attention_mode(meta.to(metadata_device if device == META else "cpu")) as mode:
            logits = model(ids, position_ids.to(device))
        logits.sum().backward()
        assert mode.calls == config.n_layers
        shapes[str(device)] = [_layout(logits)] + [_layout(p.grad) for p in model.parameters()]
    assert shapes["meta"] == shapes["cpu"]
