"""usp::all_to_all / all_gather / reduce_scatter on 2 and 4 gloo ranks, against references built
from every rank's inputs, plus their backward rules, traced graphs, argument errors and faults.

# B batch, H heads, h = H/P heads per rank, L sequence, l = L/P per rank, K head dim, P ranks

Each spawn of ranks costs seconds, so one spawn per world size runs every check and returns the
raw results (module-scoped fixtures); the tests below only compare. Inputs are fresh random fp64
tensors drawn from a seed chosen per run (printed in failure messages); every rank and the parent
regenerate all ranks' inputs from it, so the references need no communication.
"""

from __future__ import annotations

import datetime
import os
import time
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
from torch.autograd.gradcheck import GradcheckError

from tests.dist import RankError, run_ranks
from usp_graph import registry
from usp_graph.distributed import (
    all_reduce_sum_ordered,
    group_name,
    group_timeout,
    resolve_group,
)
from usp_graph.ops.collectives import all_gather, all_to_all, reduce_scatter

A2A = torch.ops.usp.all_to_all.default
AG = torch.ops.usp.all_gather.default
RS = torch.ops.usp.reduce_scatter.default


# ------------------------------------------------------------------------------------------------
# Cases and their single-process references.


@dataclass(frozen=True)
class Case:
    name: str
    op: str  # "all_to_all", "all_gather" or "reduce_scatter"
    shapes: tuple[tuple[int, ...], ...]  # x's shape on each rank
    dim: int = 0  # all_gather / reduce_scatter
    scatter_dim: int = 0
    gather_dim: int = 0
    scatter_sizes: tuple[tuple[int, ...], ...] | None = None  # per rank; None: the wrapper's default
    gather_sizes: tuple[tuple[int, ...], ...] | None = None


def _a2a_cases(P: int, B: int, h: int, seq: int, K: int) -> list[Case]:
    H, L = h * P, seq * P
    heads = (2,) + (1,) * (P - 1)  # uneven: H not divisible by P
    lens = (3, 5, 2, 4, 1, 6, 2, 3)[:P]
    # same-dim all_to_all: rank r sends S[r][j] rows to rank j (zeros included)
    S = [[(r + 2 * j) % 3 for j in range(P)] for r in range(P)]
    return [
        Case("ulysses_seq_to_heads", "all_to_all", ((B, H, seq, K),) * P, scatter_dim=1, gather_dim=2),
        Case("ulysses_heads_to_seq", "all_to_all", ((B, h, L, K),) * P, scatter_dim=2, gather_dim=1),
        Case(
            "uneven_seq_to_heads",
            "all_to_all",
            tuple((B, sum(heads), n, K) for n in lens),
            scatter_dim=1,
            gather_dim=2,
            scatter_sizes=(heads,) * P,
            gather_sizes=(lens,) * P,
        ),
        Case(
            "uneven_heads_to_seq",
            "all_to_all",
            tuple((B, n, sum(lens), K) for n in heads),
            scatter_dim=2,
            gather_dim=1,
            scatter_sizes=(lens,) * P,
            gather_sizes=(heads,) * P,
        ),
        Case("negative_dims", "all_to_all", ((2 * P, 3, 4),) * P, scatter_dim=-3, gather_dim=-1),
        Case(
            "same_dim_uneven",
            "all_to_all",
            tuple((3, sum(S[r]), 2) for r in range(P)),
            scatter_dim=1,
            gather_dim=1,
            scatter_sizes=tuple(tuple(S[r]) for r in range(P)),
            gather_sizes=tuple(tuple(S[j][r] for j in range(P)) for r in range(P)),
        ),
    ]


def _cases(P: int) -> list[Case]:
    return _a2a_cases(P, B=3, h=2, seq=4, K=5) + [
        Case("all_gather_dim1", "all_gather", ((3, 4, 2),) * P, dim=1),
        Case("all_gather_dim0", "all_gather", ((3, 4),) * P, dim=0),
        Case("all_gather_last", "all_gather", ((2, 3, 5),) * P, dim=-1),
        Case("reduce_scatter_dim1", "reduce_scatter", ((3, 2 * P, 5),) * P, dim=1),
        Case("reduce_scatter_dim0", "reduce_scatter", ((3 * P, 2),) * P, dim=0),
        Case("reduce_scatter_last", "reduce_scatter", ((2, 3, 2 * P),) * P, dim=-1),
    ]


def _gradcheck_cases(P: int) -> list[Case]:
    small = _a2a_cases(P, B=1, h=1, seq=2, K=2)
    return [
        c for c in small if c.name in ("ulysses_seq_to_heads", "uneven_heads_to_seq", "same_dim_uneven")
    ] + [
        Case("all_gather", "all_gather", ((2, 3),) * P, dim=1),
        Case("reduce_scatter", "reduce_scatter", ((2, 2 * P),) * P, dim=1),
    ]


def _ordered_sum(parts: list[torch.Tensor]) -> torch.Tensor:
    acc = parts[0].clone()
    for p in parts[1:]:
        acc = acc + p
    return acc


def _ref_all_to_all(xs, sd, gd, scatter_sizes, gather_sizes):
    P = len(xs)
    ndim = xs[0].dim()
    sd, gd = sd % ndim, gd % ndim
    if scatter_sizes is None:
        scatter_sizes = [[x.shape[sd] // P] * P for x in xs]
    pieces = [x.split(list(ss), dim=sd) for x, ss in zip(xs, scatter_sizes, strict=True)]
    outs = [torch.cat([pieces[j][r] for j in range(P)], dim=gd) for r in range(P)]
    if gather_sizes is not None:
        assert [[o.shape[gd] for o in [pieces[j][r] for j in range(P)]] for r in range(P)] == [
            list(g) for g in gather_sizes
        ], "inconsistent test case"
    return outs


def _ref_forward(case: Case, xs: list[torch.Tensor]) -> list[torch.Tensor]:
    P = len(xs)
    if case.op == "all_to_all":
        return _ref_all_to_all(xs, case.scatter_dim, case.gather_dim, case.scatter_sizes, case.gather_sizes)
    if case.op == "all_gather":
        return [torch.cat(xs, dim=case.dim)] * P
    return [_ordered_sum([x.chunk(P, dim=case.dim)[r] for x in xs]) for r in range(P)]


def _ref_adjoint(case: Case, gs: list[torch.Tensor]) -> list[torch.Tensor]:
    """The gradient of every rank's input given every rank's output gradient, written out."""
    P = len(gs)
    if case.op == "all_to_all":
        ss = case.scatter_sizes or [[s[case.scatter_dim] // P] * P for s in case.shapes]
        gsz = case.gather_sizes or [[s[case.gather_dim]] * P for s in case.shapes]
        return _ref_all_to_all(gs, case.gather_dim, case.scatter_dim, gsz, ss)
    if case.op == "all_gather":  # d x_q = sum over r (in rank order) of chunk q of d y_r
        return [_ordered_sum([g.chunk(P, dim=case.dim)[q] for g in gs]) for q in range(P)]
    return [torch.cat(gs, dim=case.dim)] * P  # reduce_scatter: d x_q = concatenation of all d y_r


def _tensors(case: Case, seed: int, index: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Every rank's input and output gradient for `case`, the same in every process."""
    gen = torch.Generator().manual_seed(seed * 1000 + index)
    xs = [torch.randn(s, generator=gen, dtype=torch.float64) for s in case.shapes]
    outs = _ref_forward(case, xs)
    gs = [torch.randn(o.shape, generator=gen, dtype=torch.float64) for o in outs]
    return xs, gs


def _apply(case: Case, x: torch.Tensor, rank: int, group=None) -> torch.Tensor:
    if case.op == "all_gather":
        return all_gather(x, case.dim, group=group)
    if case.op == "reduce_scatter":
        return reduce_scatter(x, case.dim, group=group)
    return all_to_all(
        x,
        case.scatter_dim,
        case.gather_dim,
        scatter_sizes=None if case.scatter_sizes is None else case.scatter_sizes[rank],
        gather_sizes=None if case.gather_sizes is None else case.gather_sizes[rank],
        group=group,
    )


# ------------------------------------------------------------------------------------------------
# What each rank runs (module level: pickled by reference).


class _Replicated(torch.autograd.Function):
    """Identity on a tensor every rank holds a copy of; backward sums the gradient over ranks."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return all_reduce_sum_ordered([g])[0]


class _SumOverRanks(torch.autograd.Function):
    """Sum over ranks (the result is replicated); backward passes the gradient through."""

    @staticmethod
    def forward(ctx, x):
        return all_reduce_sum_ordered([x])[0]

    @staticmethod
    def backward(ctx, g):
        return g


def _global_function(case: Case, rank: int, world: int):
    """X (every rank's input, flat, the same on all ranks) -> Y (every rank's output, flat, the same
    on all ranks).

    gradcheck runs in lockstep on all ranks, so it perturbs all ranks' inputs at once and feeds the
    same output gradient to all; applied to one rank's op alone, the numerical and analytical
    Jacobians then differ by construction. On the replicated global map they are both the true
    Jacobian of the collective (the two autograd Functions above are exact: every summand but one
    is zero), so gradcheck checks the op's backward rule, adjoint collective included."""
    xs, _ = _tensors(case, 0, 0)
    in_sizes = [x.numel() for x in xs]
    out_sizes = [y.numel() for y in _ref_forward(case, xs)]
    in_off, out_off = sum(in_sizes[:rank]), sum(out_sizes[:rank])

    def f(X_flat):
        x = _Replicated.apply(X_flat)[in_off : in_off + in_sizes[rank]].view(case.shapes[rank])
        y = _apply(case, x, rank).reshape(-1)
        Y = torch.cat([y.new_zeros(out_off), y, y.new_zeros(sum(out_sizes) - out_off - y.numel())])
        return _SumOverRanks.apply(Y)

    return f, sum(in_sizes)


def _usp_nodes(gm: torch.fx.GraphModule) -> list[tuple[str, list[str], bool]]:
    """(target, args after the tensor, whether any size argument is computed in the graph)."""
    return [
        (
            str(n.target),
            [str(a) for a in n.args[1:]],
            any(isinstance(v, torch.fx.Node) for a in n.args[1:] if isinstance(a, list) for v in a),
        )
        for n in gm.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("usp.")
    ]


def _fwd_bwd(op):
    def fwd_bwd(x, g):
        y = op(x)
        (dx,) = torch.autograd.grad(y, x, g)
        return y, dx

    return fwd_bwd


def _traced_checks(rank: int, world: int, seed: int) -> dict:
    """make_fx (symbolic) of forward + autograd.grad: the op and its adjoint are nodes, and the graph
    replays on both ranks, with a different sequence length, equal to eager."""
    from torch.fx.experimental.proxy_tensor import make_fx

    gen = torch.Generator().manual_seed(seed + 7 + rank)
    fns = {
        "all_to_all": lambda x: all_to_all(x, 1, 2),  # Ulysses x_BHlK -> x_BhLK
        "all_gather": lambda x: all_gather(x, 2),
        "reduce_scatter": lambda x: reduce_scatter(x, 1),
    }
    out = {}
    for name, op in fns.items():
        fwd_bwd = _fwd_bwd(op)

        def inputs(seq, op=op):  # B=3, H=4, l=seq, K=7: distinct sizes (no duck-sized symbols)
            x = torch.randn(3, 4, seq, 7, generator=gen, dtype=torch.float64)
            y = op(x)  # the output shape (one collective, all ranks in step)
            return x.requires_grad_(), torch.randn(y.shape, generator=gen, dtype=torch.float64)

        gm = make_fx(fwd_bwd, tracing_mode="symbolic")(*inputs(5))
        x, g = inputs(6)
        y_graph, dx_graph = gm(x.detach(), g)
        y_eager, dx_eager = fwd_bwd(x, g)
        out[name] = {
            "nodes": _usp_nodes(gm),
            "replay_equal": torch.equal(y_graph, y_eager) and torch.equal(dx_graph, dx_eager),
            "out_shape": tuple(y_graph.shape),
        }
    return out


def _chain(x):
    """Every op and every adjoint: Ulysses there, all_gather, reduce_scatter, Ulysses back."""
    y_BhLK = all_to_all(x, 1, 2)
    y_BhLK = reduce_scatter(all_gather(y_BhLK, 0), 0)
    return all_to_all(y_BhLK, 2, 1)


def _compiled_checks(rank: int, world: int, seed: int) -> dict[str, bool]:
    """torch.compile(fullgraph=True, backend="aot_eager") of the ops equals eager, bitwise."""
    gen = torch.Generator().manual_seed(seed + 5 + rank)
    x = torch.randn(3, 2 * world, 5, 7, generator=gen, dtype=torch.float64, requires_grad=True)
    g = torch.randn(x.shape, generator=gen, dtype=torch.float64)
    y_eager = _chain(x)
    (dx_eager,) = torch.autograd.grad(y_eager, x, g)
    y_comp = torch.compile(_chain, backend="aot_eager", fullgraph=True)(x)
    (dx_comp,) = torch.autograd.grad(y_comp, x, g)
    return {"forward": torch.equal(y_comp, y_eager), "backward": torch.equal(dx_comp, dx_eager)}


def _opchecks(rank: int, world: int) -> list[str]:
    name = group_name()
    x = torch.randn(2, 4, 3 + rank, dtype=torch.float64, requires_grad=True)
    lens = [3 + r for r in range(world)]
    a = torch.randn(2, 5, 3, dtype=torch.float64, requires_grad=True)
    split = [1, 4] if rank == 0 else [4, 1]
    arg_sets = [
        (A2A, (x, 1, 2, [2] * world, lens, name)),
        (A2A, (a, 1, 1, split, split, name)),  # same dim: rank 0 sends 1 row to itself, 4 to rank 1
        (AG, (a, 1, world, name)),
        (RS, (x.detach()[:, :, :3].clone().requires_grad_(), 1, world, name)),
    ]
    done = []
    for op, args in arg_sets:
        try:
            torch.library.opcheck(op, args)
            done.append(str(op))
        except Exception as e:  # reported by the test (all ranks run the same sub-tests)
            done.append(f"{op}: {e}")
    return done


def _bad_argument_errors(rank: int, world: int) -> dict[str, tuple[str, str]]:
    x = torch.randn(2, 4, 3, dtype=torch.float64)
    name = group_name()
    sub = dist.new_group(list(range(world)))
    dead = sub.group_name
    dist.destroy_process_group(sub)
    attempts = {
        "scatter_dim_range": lambda: all_to_all(x, 3, 1),
        "gather_dim_range": lambda: all_to_all(x, 1, -4),
        "scatter_sizes_sum": lambda: all_to_all(x, 1, 2, scatter_sizes=[1, 2]),
        "scatter_sizes_len": lambda: all_to_all(x, 1, 2, scatter_sizes=[4]),
        "gather_sizes_len": lambda: all_to_all(x, 1, 2, gather_sizes=[3, 3, 3]),
        "gather_sizes_own": lambda: all_to_all(x, 1, 2, gather_sizes=[2, 2]),
        "negative_size": lambda: all_to_all(x, 1, 2, scatter_sizes=[5, -1]),
        "sizes_type": lambda: all_to_all(x, 1, 2, scatter_sizes=torch.tensor([2, 2])),
        "not_divisible": lambda: all_to_all(x, 2, 1),
        "reduce_scatter_divisible": lambda: reduce_scatter(x, 2),
        "all_gather_dim_range": lambda: all_gather(x, 5),
        "unknown_group": lambda: all_gather(x, 0, group="no-such-group"),
        "destroyed_group": lambda: all_gather(x, 0, group=dead),
        "group_type": lambda: all_gather(x, 0, group=3),
        "x_type": lambda: all_gather([1.0, 2.0], 0),
        "op_group_size": lambda: AG(x, 0, world + 1, name),
        "op_sizes_sum": lambda: A2A(x, 1, 2, [1, 1], [3, 3], name),
        "op_unknown_group": lambda: RS(x, 1, world, "no-such-group"),
    }
    errors = {}
    for key, call in attempts.items():
        try:
            call()
            errors[key] = ("no error", "")
        except Exception as e:  # the test compares type and message
            errors[key] = (type(e).__name__, str(e))
    # Nothing was sent, so the group still works.
    errors["still_works"] = ("ok", str(torch.equal(all_gather(x, 0)[2 * rank : 2 * rank + 2], x)))
    return errors


def _case_checks(rank: int, world: int, seed: int) -> dict:
    out = {}
    for i, case in enumerate(_cases(world)):
        xs, gs = _tensors(case, seed, i)
        x = xs[rank].clone().requires_grad_()
        y = _apply(case, x, rank)
        (dx,) = torch.autograd.grad(y, x, gs[rank])
        out[case.name] = (y.detach(), dx)
    return out


def _round_trips(rank: int, world: int, seed: int) -> dict[str, bool]:
    """Ulysses there and back is the identity, bitwise (even and uneven)."""
    by_name = {c.name: (i, c) for i, c in enumerate(_cases(world))}
    out = {}
    for fwd, back in (
        ("ulysses_seq_to_heads", "ulysses_heads_to_seq"),
        ("uneven_seq_to_heads", "uneven_heads_to_seq"),
    ):
        i, c_f = by_name[fwd]
        _, c_b = by_name[back]
        x = _tensors(c_f, seed, i)[0][rank]
        out[fwd] = torch.equal(_apply(c_b, _apply(c_f, x, rank), rank), x)
    return out


def _layout_checks(rank: int, world: int, seed: int) -> dict[str, bool]:
    """A non-contiguous input (same values, other strides) gives the same bits, contiguous output."""
    out = {}
    for i, case in enumerate(_cases(world)):
        x = _tensors(case, seed, i)[0][rank]
        strided = x.movedim(0, -1).contiguous().movedim(-1, 0)
        y = _apply(case, strided, rank)
        out[case.name] = torch.equal(y, _apply(case, x, rank)) and y.is_contiguous()
    return out


def _ordered_sum_checks(rank: int, world: int, seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed + 99)
    grads = [torch.randn(world, 5, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    grads += [torch.randn(world, 4, generator=gen, dtype=torch.float32)]
    mine = [g[rank] for g in grads]
    summed = all_reduce_sum_ordered(mine)
    return {
        "sums": summed,
        "inputs_kept": all(torch.equal(m, g[rank]) for m, g in zip(mine, grads, strict=True)),
    }


def _gradchecks(rank: int, world: int, seed: int) -> dict:
    out = {}
    for case in _gradcheck_cases(world):
        f, n = _global_function(case, rank, world)
        X = torch.randn(n, generator=torch.Generator().manual_seed(seed + n), dtype=torch.float64)
        try:  # every rank sees the same replicated Jacobian, so a failure is the same on all ranks
            out[case.name] = torch.autograd.gradcheck(f, (X.requires_grad_(),), fast_mode=True)
        except GradcheckError as e:
            out[case.name] = str(e)
    return out


def _timeout_checks(rank: int, world: int, seed: int) -> dict:
    return {
        "world": group_timeout(),
        "subgroup_default": group_timeout(dist.new_group(list(range(world)))),
        "subgroup_explicit": group_timeout(
            dist.new_group(list(range(world)), timeout=datetime.timedelta(seconds=7))
        ),
    }


def _rank_checks(rank: int, world: int, seed: int, full: bool) -> dict:
    """Every check of one spawn, in the same order on all ranks; returns raw results and timings."""
    sections = [
        ("cases", _case_checks),
        ("round_trips", _round_trips),
        ("layout", _layout_checks),
        ("ordered_sum", _ordered_sum_checks),
    ]
    if full:
        sections += [
            ("gradcheck", _gradchecks),
            ("traced", _traced_checks),
            ("opcheck", lambda r, w, s: _opchecks(r, w)),
            ("compiled", _compiled_checks),
            ("errors", lambda r, w, s: _bad_argument_errors(r, w)),
            ("timeouts", _timeout_checks),
        ]
    out: dict = {"seconds": {}}
    for key, check in sections:
        t0 = time.monotonic()
        out[key] = check(rank, world, seed)
        out["seconds"][key] = round(time.monotonic() - t0, 2)
    return out


# ------------------------------------------------------------------------------------------------
# Fault scenarios (rank 0 enters collectives; rank 1 misbehaves).

FAULT_PG_TIMEOUT_S = 5.0


def _try_collectives(rank: int, world: int, groups: list) -> list[tuple[str, str, float]]:
    """Rank 0 calls each op on its own group; returns (error type, message, seconds) per op."""
    x = torch.randn(4, 6, dtype=torch.float64)
    calls = [
        lambda g: all_to_all(x, 0, 1, group=g),
        lambda g: all_gather(x, 0, group=g),
        lambda g: reduce_scatter(x, 1, group=g),
    ]
    seen = []
    for call, g in zip(calls, groups, strict=True):
        t0 = time.monotonic()
        try:
            call(g)
            seen.append(("no error", "", time.monotonic() - t0))
        except Exception as e:
            seen.append((type(e).__name__, str(e), time.monotonic() - t0))
    return seen


def _fault_groups(world: int, n: int = 3) -> list:
    timeout = datetime.timedelta(seconds=FAULT_PG_TIMEOUT_S)
    return [dist.new_group(list(range(world)), timeout=timeout) for _ in range(n)]


def _peer_raises(rank: int, world: int) -> list:
    groups = _fault_groups(world)
    if rank == 1:
        raise ValueError("deliberate failure on rank 1 before the collective")
    return _try_collectives(rank, world, groups)


def _peer_dies(rank: int, world: int) -> list:
    groups = _fault_groups(world)
    if rank == 1:
        os._exit(3)  # a crash: no traceback, no result
    return _try_collectives(rank, world, groups)


def _peer_absent(rank: int, world: int) -> tuple[str, str, float] | None:
    """Rank 1 stays alive but never enters the collective: rank 0 must give up after the timeout."""
    (group,) = _fault_groups(world, 1)
    store = dist.distributed_c10d._get_default_store()
    if rank == 1:  # wait (outside any collective) until rank 0 has seen its error
        store.wait(["rank0_done"], datetime.timedelta(seconds=60))
        return None
    t0 = time.monotonic()
    try:
        reduce_scatter(torch.randn(2, 4, dtype=torch.float64), 1, group=group)
        seen = ("no error", "", time.monotonic() - t0)
    except Exception as e:
        seen = (type(e).__name__, str(e), time.monotonic() - t0)
    store.set("rank0_done", "1")
    return seen


def _hangs(rank: int, world: int) -> int:
    if rank == 1:
        time.sleep(600)
    return rank


# ------------------------------------------------------------------------------------------------
# Fixtures: one spawn per world size.


@pytest.fixture(scope="module")
def spawned():
    """world size -> (world, seed, every rank's results); each world size is spawned once."""
    cache: dict[int, tuple] = {}

    def get(world: int) -> tuple:
        if world not in cache:
            seed = int.from_bytes(os.urandom(3), "little")
            t0 = time.monotonic()
            results = run_ranks(_rank_checks, world, seed, world == 2, pg_timeout=50)
            print(f"\n{world} ranks: {time.monotonic() - t0:.1f} s; rank 0 checks: {results[0]['seconds']}")
            cache[world] = (world, seed, results)
        return cache[world]

    return get


@pytest.fixture(params=[2, 4], ids=["P2", "P4"])
def ranks(spawned, request):
    return spawned(request.param)


@pytest.fixture
def ranks2(spawned):
    """The 2-rank run, which also holds gradcheck, traced graphs, opcheck and argument errors."""
    return spawned(2)


# ------------------------------------------------------------------------------------------------
# Forward and backward against the references.


@pytest.mark.slow
def test_forward_matches_reference_bitwise(ranks):
    world, seed, results = ranks
    for i, case in enumerate(_cases(world)):
        xs, _ = _tensors(case, seed, i)
        ref = _ref_forward(case, xs)
        for r in range(world):
            y = results[r]["cases"][case.name][0]
            assert y.shape == ref[r].shape, (case.name, r, seed)
            assert torch.equal(y, ref[r]), f"{case.name} rank {r} (seed={seed})"


@pytest.mark.slow
def test_backward_matches_reference_adjoint_bitwise(ranks):
    world, seed, results = ranks
    for i, case in enumerate(_cases(world)):
        _, gs = _tensors(case, seed, i)
        ref = _ref_adjoint(case, gs)
        for r in range(world):
            dx = results[r]["cases"][case.name][1]
            assert torch.equal(dx, ref[r]), f"{case.name} rank {r} (seed={seed})"


@pytest.mark.slow
def test_reference_adjoint_is_the_autograd_gradient_of_the_reference(ranks):
    world, seed, _ = ranks
    for i, case in enumerate(_cases(world)):
        xs, gs = _tensors(case, seed, i)
        leaves = [x.clone().requires_grad_() for x in xs]
        outs = _ref_forward(case, leaves)
        grads = torch.autograd.grad(outs, leaves, gs)
        for r, (g, ref) in enumerate(zip(grads, _ref_adjoint(case, gs), strict=True)):
            torch.testing.assert_close(g, ref, rtol=1e-14, atol=1e-14, msg=f"{case.name} rank {r}")


@pytest.mark.slow
def test_noncontiguous_input_gives_the_same_bits(ranks):
    world, _, results = ranks
    for r in range(world):
        assert all(results[r]["layout"].values()), results[r]["layout"]


@pytest.mark.slow
def test_ulysses_round_trip_is_bitwise_identity(ranks):
    world, seed, results = ranks
    for r in range(world):
        assert results[r]["round_trips"] == {"ulysses_seq_to_heads": True, "uneven_seq_to_heads": True}


@pytest.mark.slow
def test_all_reduce_sum_ordered_sums_in_rank_order_on_every_rank(ranks):
    world, seed, results = ranks
    gen = torch.Generator().manual_seed(seed + 99)
    grads = [torch.randn(world, 5, 3, generator=gen, dtype=torch.float64) for _ in range(2)]
    grads += [torch.randn(world, 4, generator=gen, dtype=torch.float32)]
    for r in range(world):
        assert results[r]["ordered_sum"]["inputs_kept"]
        for got, g in zip(results[r]["ordered_sum"]["sums"], grads, strict=True):
            assert got.dtype == g.dtype and got.shape == g.shape[1:]
            assert torch.equal(got, _ordered_sum(list(g.unbind(0)))), f"rank {r} (seed={seed})"


# ------------------------------------------------------------------------------------------------
# Autograd structure (2 ranks).


@pytest.mark.slow
def test_gradcheck_each_op_fp64(ranks2):
    world, seed, results = ranks2
    names = [c.name for c in _gradcheck_cases(world)]
    for r in range(world):
        assert results[r]["gradcheck"] == dict.fromkeys(names, True), f"seed={seed}"


@pytest.mark.slow
def test_traced_joint_graph_has_op_and_adjoint(ranks2):
    world, _, results = ranks2
    traced = results[0]["traced"]
    a2a = traced["all_to_all"]["nodes"]
    assert [t for t, *_ in a2a] == ["usp.all_to_all.default"] * 2
    (fwd_args, bwd_args) = (a2a[0][1], a2a[1][1])
    assert fwd_args[:2] == ["1", "2"] and bwd_args[:2] == ["2", "1"]  # dims swapped
    assert bwd_args[2:4] == [fwd_args[3], fwd_args[2]]  # sizes swapped
    assert [t for t, *_ in traced["all_gather"]["nodes"]] == [
        "usp.all_gather.default",
        "usp.reduce_scatter.default",
    ]
    assert [t for t, *_ in traced["reduce_scatter"]["nodes"]] == [
        "usp.reduce_scatter.default",
        "usp.all_gather.default",
    ]


@pytest.mark.slow
def test_traced_graph_is_symbolic_and_replays_bitwise(ranks2):
    world, _, results = ranks2
    for r in range(world):
        traced = results[r]["traced"]
        assert all(t["replay_equal"] for t in traced.values()), r
        # traced with l=5, replayed with l=6: sizes came from the inputs, not constants
        assert traced["all_to_all"]["out_shape"] == (3, 4 // world, 6 * world, 7)
        assert traced["all_gather"]["out_shape"] == (3, 4, 6 * world, 7)
        assert traced["reduce_scatter"]["out_shape"] == (3, 4 // world, 6, 7)
        assert all(sym for *_, sym in traced["all_to_all"]["nodes"])  # split sizes computed in-graph


@pytest.mark.slow
def test_torch_compile_fullgraph_matches_eager_bitwise(ranks2):
    world, _, results = ranks2
    for r in range(world):
        assert results[r]["compiled"] == {"forward": True, "backward": True}


@pytest.mark.slow
def test_opcheck_passes_for_each_op(ranks2):
    world, _, results = ranks2
    for r in range(world):
        assert results[r]["opcheck"] == [str(A2A), str(A2A), str(AG), str(RS)]


def test_registry_rules_name_the_adjoints():
    for op, adjoint in ((A2A, A2A), (AG, RS), (RS, AG)):
        rule = registry.rule_for(op)
        assert rule.kind == "collective"
        assert rule.adjoint is adjoint
        assert rule.backward_ops == (adjoint,)


# ------------------------------------------------------------------------------------------------
# Argument errors.


@pytest.mark.slow
def test_bad_arguments_raise_errors_naming_the_argument(ranks2):
    world, _, results = ranks2
    errors = results[1]["errors"]
    expected = {
        "scatter_dim_range": ("ValueError", "scatter_dim=3 is out of range"),
        "gather_dim_range": ("ValueError", "gather_dim=-4 is out of range"),
        "scatter_sizes_sum": ("ValueError", "scatter_sizes [1, 2] sum to 3 but x has 4 along scatter_dim=1"),
        "scatter_sizes_len": ("ValueError", "scatter_sizes has 1 entries but the group has 2 ranks"),
        "gather_sizes_len": ("ValueError", "gather_sizes has 3 entries but the group has 2 ranks"),
        "gather_sizes_own": ("ValueError", "gather_sizes[1] (this rank's own piece) is 2 but x has 3"),
        "negative_size": ("ValueError", "scatter_sizes[1] must be >= 0"),
        "sizes_type": ("TypeError", "scatter_sizes must be a list of ints"),
        "not_divisible": ("ValueError", "pass scatter_sizes"),
        "reduce_scatter_divisible": ("ValueError", "not divisible by the group's 2 ranks"),
        "all_gather_dim_range": ("ValueError", "dim=5 is out of range"),
        "unknown_group": ("ValueError", "unknown process group name 'no-such-group'"),
        "destroyed_group": ("ValueError", "unknown process group name"),
        "group_type": ("TypeError", "group must be a ProcessGroup"),
        "x_type": ("TypeError", "x must be a Tensor"),
        "op_group_size": ("ValueError", "group_size=3 but process group"),
        "op_sizes_sum": ("ValueError", "scatter_sizes [1, 1] sum to 2"),
        "op_unknown_group": ("ValueError", "unknown process group name 'no-such-group'"),
        "still_works": ("ok", "True"),
    }
    for key, (typ, text) in expected.items():
        got_type, got_msg = errors[key]
        assert got_type == typ and text in got_msg, (key, errors[key])


def test_uninitialized_torch_distributed_is_a_clear_error():
    assert not dist.is_initialized()
    for call in (
        lambda: group_name(),
        lambda: resolve_group("0"),
        lambda: all_gather(torch.ones(2), 0),
        lambda: all_reduce_sum_ordered([torch.ones(2)]),
    ):
        with pytest.raises(ValueError, match=r"init_process_group"):
            call()


# ------------------------------------------------------------------------------------------------
# Faults: no hang, a clear error within the process group's timeout.


@pytest.mark.slow
def test_group_timeout_is_the_one_the_group_was_created_with(ranks2):
    world, _, results = ranks2
    t = results[0]["timeouts"]
    assert t["world"] == datetime.timedelta(seconds=50)  # the spawned fixture's pg_timeout=50
    assert t["subgroup_explicit"] == datetime.timedelta(seconds=7)
    assert t["subgroup_default"] != t["world"]  # new_group does not inherit it: pass timeout= there


def _assert_collective_errors(seen, *, within_s):
    assert len(seen) == 3
    for typ, msg, seconds in seen:
        assert typ == "CollectiveError", (typ, msg)
        assert "failed on rank 0 of 2" in msg and "init_process_group(timeout=...)" in msg
        assert seconds < within_s, (seconds, msg)


@pytest.mark.slow
def test_peer_raising_before_collective_fails_the_others_within_timeout():
    t0 = time.monotonic()
    with pytest.raises(RankError) as info:
        run_ranks(_peer_raises, 2, timeout=60)
    assert list(info.value.failures) == [1]
    assert "deliberate failure on rank 1" in str(info.value)
    _assert_collective_errors(info.value.results[0], within_s=FAULT_PG_TIMEOUT_S)
    assert time.monotonic() - t0 < 30


@pytest.mark.slow
def test_dead_peer_is_reported_and_the_others_fail_within_timeout():
    with pytest.raises(RankError) as info:
        run_ranks(_peer_dies, 2, timeout=60)
    assert info.value.failures == {1: "rank 1 exited with code 3 without reporting a result"}
    _assert_collective_errors(info.value.results[0], within_s=FAULT_PG_TIMEOUT_S)


@pytest.mark.slow
def test_absent_peer_makes_the_collective_time_out_after_the_group_timeout():
    typ, msg, seconds = run_ranks(_peer_absent, 2, timeout=60)[0]
    assert typ == "CollectiveError", msg
    assert "Timed out" in msg and f"({datetime.timedelta(seconds=FAULT_PG_TIMEOUT_S)})" in msg
    assert FAULT_PG_TIMEOUT_S - 0.5 <= seconds < FAULT_PG_TIMEOUT_S + 3, seconds


@pytest.mark.slow
def test_hung_rank_is_killed_and_reported_as_timeout():
    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"ranks \[(0, )?1\] of 2 were still running after 8") as info:
        run_ranks(_hangs, 2, timeout=8)
    assert time.monotonic() - t0 < 8 + 5
    message = str(info.value)
    assert "rank 1 stacks:" in message
    if "Ranks that finished: [0]" in message:  # not still starting up on a loaded machine
        assert "in _hangs" in message  # the stuck rank's Python stack


# ------------------------------------------------------------------------------------------------
# The size agreement's verdict (issue 31; tests/test_collective_faults.py runs it on real ranks).


def _header(key: int, send: list[int], recv: list[int]) -> list[int]:
    from usp_graph.distributed import _MAGIC

    return [_MAGIC, key, *send, *recv]


def test_size_verdict_accepts_ranks_whose_sends_are_what_their_peers_expect():
    from usp_graph.distributed import _verdict

    rows = [_header(7, [8, 16], [8, 24]), _header(7, [24, 0], [16, 0])]
    assert _verdict(rows, 2) is None


def test_size_verdict_names_the_pair_that_disagrees_and_is_the_same_for_every_rank():
    from usp_graph.distributed import _verdict

    more = [_header(7, [8, 16], [8, 16]), _header(7, [24, 16], [16, 16])]
    assert _verdict(more, 2) == "rank 1 sends 24 bytes to rank 0, which expects 16"
    fewer = [_header(7, [8, 16], [8, 16]), _header(7, [8, 16], [16, 16])]
    assert _verdict(fewer, 2) == "rank 1 sends 8 bytes to rank 0, which expects 16"
    other_op = [_header(7, [8, 8], [8, 8]), _header(9, [8, 8], [8, 8])]
    assert "rank(s) [1] called this collective with a different op" in _verdict(other_op, 2)
    not_ours = [_header(7, [8, 8], [8, 8]), [0, 7, 8, 8, 8, 8]]
    assert "rank 1 entered a different collective" in _verdict(not_ours, 2)


@pytest.mark.slow
def test_size_digest_is_the_same_in_every_process():
    import subprocess
    import sys

    from usp_graph.distributed import _digest

    key = ("usp::all_to_all", "torch.float64", 4, 1, 2, (1, 8))
    code = f"from usp_graph.distributed import _digest; print(_digest({key!r}))"
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                           env={"PYTHONHASHSEED": "123", "PATH": ""})  # fmt: skip
    assert int(other.stdout) == _digest(key)
