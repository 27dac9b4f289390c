"""`ContextParallel`: which strategy, over which ranks, and how tokens are laid out."""

from __future__ import annotations

import weakref
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch import Tensor

from ..distributed import all_gather_into, all_reduce_sum_ordered, gather_ints, group_timeout, run_collective
from ..metadata import AttentionMetadata
from ..ops.window import NO_WINDOW, check_window
from .common import reorder_chunks
from .layout import ChunkLayout
from .table import STRATEGIES, STRATEGY_TABLE

__all__ = ["ContextParallel", "STRATEGIES"]

LOAD_BALANCE = (None, "zigzag")


def token_mean(loss_sum: Tensor, num_tokens: Tensor | int, group) -> Tensor:
    """`loss_sum / (num_tokens summed over the ranks of group)`, differentiable in `loss_sum`."""
    from torch.distributed import _functional_collectives as funcol

    if isinstance(num_tokens, torch.Tensor):
        n = num_tokens.detach().to(torch.float64)
    else:  # an int or a traced SymInt (e.g. x.numel()): full() keeps it symbolic, as_tensor would not
        n = torch.full((), num_tokens, dtype=torch.float64, device=loss_sum.device)
    # A functional all-reduce, so a traced train step records it as a graph node. Token counts
    # are integers: their float64 sum is exact in any reduction order.
    total = funcol.wait_tensor(funcol.all_reduce(n, "sum", group))
    return loss_sum / total.to(loss_sum.dtype)


def _ordered_sum(x: Tensor, group) -> Tensor:
    """Sum over ranks in rank order 0..P-1: bitwise reproducible, unlike a backend's all-reduce."""
    return all_reduce_sum_ordered([x], group)[0]


class ContextParallel:
    """A context-parallel attention plan over a process group.

    strategy: ``"allgather_kv"`` (Q sharded, K/V all-gathered), ``"ulysses"`` (sequence <-> heads
    all-to-all), ``"ring"`` (K/V rotate, LSE merge) or ``"usp"`` (Ulysses inside groups of
    `ulysses_degree` consecutive ranks, ring across them; ``across="halo"`` exchanges halos across
    them instead, with `max_document_len`) or ``"halo"`` (Q and K/V stay sharded;
    each rank takes from its neighbours only the K/V that documents crossing its shard boundary
    need: at most ``max_document_len - 1`` tokens each way).
    group / mesh: the CP ranks (default: the whole world). `mesh` is a 1-D `DeviceMesh`, e.g. the
    CP dim of a torchtitan-style mesh: ``ContextParallel("ulysses", mesh=world_mesh["cp"])`` (FSDP2
    over the other dims: `usp_graph.fsdp.prepare`). For ``"usp"`` a 2-D `mesh` gives the ring
    dimension first and the Ulysses dimension second.
    load_balance: None (rank p holds the p-th 1/P of each row) or ``"zigzag"`` (rank p holds
    chunks p and 2P-1-p of 2P, which balances causal work).
    max_document_len: for ``"halo"`` only, and required there: the longest document a step may
    hold (`AttentionMetadata.max_seqlen` must not exceed it: the step fails with a ValueError
    on every rank otherwise). Bytes sent scale with it, not with the shard length; it may be at
    most the local row length + 1.
    check_metadata: debug mode; every attention call first checks that all ranks hold the same
    metadata (a host sync per call).
    head_groups: for ``"ulysses"`` only: split the heads into this many groups and run the
    all-to-alls and attention group by group (default 1). With the overlap pass
    (`usp_graph.passes.overlap`) group j+1's q/k/v travel while group j attends and group j's output
    travels while group j+1 attends; each head's attention is the same computation, so the result
    is the same as with one group. The query heads (and K/V heads, else K/V are repeated to the
    query heads) must divide into head_groups x P.

    ``"auto"`` picks the strategy and its options for the run (`usp_graph.cp.auto`): give
    `documents` (the packer's document lengths of one step, or of a few sampled steps), `heads`,
    `kv_heads` (default `heads`), `head_dim`, `dtype` (default bfloat16) and `is_causal`; the link
    and kernel rates are measured on the group at once (a collective: every rank constructs it), or
    taken from `rates`. `decision` holds the estimates and reasons (None for a named strategy); its
    `line()` is logged on rank 0 (logger ``usp_graph.cp``).

    Sequence lengths must be divisible by P (2P with zigzag): `shard` raises otherwise.
    """

    def __init__(
        self,
        strategy: str,
        *,
        group: dist.ProcessGroup | None = None,
        mesh=None,
        ulysses_degree: int | None = None,
        load_balance: str | None = None,
        max_document_len: int | None = None,
        across: str | None = None,
        check_metadata: bool = False,
        head_groups: int = 1,
        documents=None,
        heads: int | None = None,
        kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        is_causal: bool = True,
        rates=None,
    ) -> None:
        # 1. "auto" decides the strategy and its options; 2. the options are checked against the
        # strategy; 3. the process groups are set up; 4. the strategy's degrees (and usp's subgroups).
        self.decision = None
        auto_inputs = {"documents": documents, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
                       "dtype": dtype, "rates": rates}  # fmt: skip
        if strategy == "auto":
            named = {"ulysses_degree": ulysses_degree, "load_balance": load_balance,
                     "max_document_len": max_document_len, "across": across}  # fmt: skip
            self.decision = _decide(group, mesh, named, auto_inputs, is_causal)
            strategy, opts = self.decision.strategy, self.decision.options
            ulysses_degree = opts.get("ulysses_degree")
            load_balance = opts.get("load_balance")
            max_document_len = opts.get("max_document_len")
        else:
            given = [k for k, v in auto_inputs.items() if v is not None]
            if given:
                raise ValueError(f"{', '.join(given)}: only for strategy 'auto', not {strategy!r}")
        self.across = _check_options(strategy, load_balance, max_document_len, across, head_groups)
        self.max_document_len = max_document_len
        self.head_groups = head_groups
        _require_distributed()
        if mesh is not None and group is not None:
            raise ValueError("pass either group or mesh, not both")
        self.strategy = strategy
        self.load_balance = load_balance
        self.check_metadata = check_metadata
        ring_group = ulysses_group = None
        if mesh is not None:
            group, ring_group, ulysses_group, ulysses_degree = _mesh_groups(strategy, mesh, ulysses_degree)
        group = group if group is not None else dist.group.WORLD
        self.world = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given CP group")
        self.group_name = group.group_name
        self._group_ref = weakref.ref(group)  # weakly: see `_live_group`
        self.layout = ChunkLayout(self.world, zigzag=load_balance == "zigzag")
        self._set_degrees(ulysses_degree, ring_group, ulysses_group)

    group = property(lambda self: _live_group(self))

    def _set_degrees(self, ulysses_degree: int | None, ring_group, ulysses_group) -> None:
        """Ranks per Ulysses group and per ring (usp: `ulysses_degree`, its subgroups made here
        unless a 2-D mesh gave them; ulysses: all of them; ring, allgather_kv, halo: one)."""
        if self.strategy == "usp":
            if ulysses_degree is None:
                raise ValueError("strategy 'usp' needs ulysses_degree (ranks per Ulysses group)")
            if isinstance(ulysses_degree, bool) or not isinstance(ulysses_degree, int) or ulysses_degree < 1:
                raise ValueError(f"ulysses_degree must be a positive int, got {ulysses_degree!r}")
            if self.world % ulysses_degree:
                raise ValueError(
                    f"ulysses_degree={ulysses_degree} must divide the CP group size {self.world}"
                )
            if ring_group is None:
                # Each rank creates its subgroups by its own degree: ranks that disagree would call
                # new_group a different number of times and meet only at the group's timeout.
                degrees = [
                    row[0] for row in gather_ints("ContextParallel('usp')", self.group, [ulysses_degree])
                ]
                if len(set(degrees)) > 1:
                    raise ValueError(
                        "CP ranks disagree on ContextParallel('usp', ulysses_degree=...): "
                        + ", ".join(f"{d} on rank {r}" for r, d in enumerate(degrees))
                        + "; every rank must pass the same"
                    )
                ring_group, ulysses_group = _usp_subgroups(self.group, self.world, self.rank, ulysses_degree)
            self.ulysses_degree = ulysses_degree
            self.ring_size = self.world // ulysses_degree
        elif ulysses_degree is not None:
            raise ValueError(f"ulysses_degree is only for strategy 'usp', not {self.strategy!r}")
        else:
            self.ulysses_degree, self.ring_size = (
                (self.world, 1) if self.strategy == "ulysses" else (1, self.world)
            )
        self.ring_group_name = ring_group.group_name if ring_group is not None else self.group_name
        self.ulysses_group_name = ulysses_group.group_name if ulysses_group is not None else self.group_name

    def __repr__(self) -> str:
        extra = f", ulysses_degree={self.ulysses_degree}" if self.strategy == "usp" else ""
        if self.strategy == "usp" and self.across == "halo":
            extra += f", across='halo', max_document_len={self.max_document_len}"
        if self.strategy == "halo":
            extra = f", max_document_len={self.max_document_len}"
        if self.head_groups != 1:
            extra += f", head_groups={self.head_groups}"
        return (
            f"ContextParallel({self.strategy!r}, world={self.world}, rank={self.rank}{extra}, "
            f"load_balance={self.load_balance!r})"
        )

    # ---- token layout ----------------------------------------------------------------------------

    def _chunks(self, n: int, what: str) -> int:
        total = self.layout.row_chunks_total
        if n % total:
            how = f"2 x {self.world} (zigzag)" if self.layout.zigzag else str(self.world)
            raise ValueError(
                f"{what} length {n} is not divisible by {how}; pad the sequence to a multiple of {total}"
            )
        return total

    def shard(self, x: Tensor, dim: int) -> Tensor:
        """This rank's part of the global tensor `x` along its sequence dim `dim`."""
        n = self._chunks(x.shape[dim], f"dim {dim}")
        chunks = x.chunk(n, dim)
        mine = [chunks[c] for c in self.layout.row_chunks(self.rank)]
        return mine[0] if len(mine) == 1 else torch.cat(mine, dim)

    def unshard(self, x: Tensor, dim: int) -> Tensor:
        """The global tensor from every rank's shard along `dim` (differentiable: ``usp::all_gather``)."""
        dim = dim % x.dim()
        gathered = torch.ops.usp.all_gather(x, dim, self.world, self.group_name)
        return reorder_chunks(gathered, dim, self.layout.gather_order())

    # ---- attention -------------------------------------------------------------------------------

    def attention(
        self,
        q_BHLK: Tensor,
        k_BGLK: Tensor,
        v_BGLK: Tensor,
        *,
        cu_seqlens: Tensor,
        max_seqlen: int,
        is_causal: bool,
        scale: float,
        window: tuple[int, int] | None = None,
    ) -> Tensor:
        """Attention of this rank's query shard over the whole (global) documents.

        `window=(left, right)`: a sliding window over global positions within each document
        (flash-attention's convention, -1 unbounded; `usp_graph.varlen_attn`), every strategy."""
        ll = q_BHLK.shape[2]
        if k_BGLK.shape[2] != ll:
            raise ValueError(
                f"context parallelism needs equal query and key lengths, got {ll} and {k_BGLK.shape[2]}"
            )
        if isinstance(ll, int) and ll % self.layout.per_rank:
            raise ValueError(f"local sequence length {ll} must be even with zigzag load balancing")
        if self.check_metadata:
            self.assert_same_metadata(cu_seqlens)
        window = check_window(window)
        if window[0] == -1 and (is_causal or window[1] == 0):
            # (-1, 0) is causal, and causal with no left bound is no window: the strategies'
            # causal code (ring's skipped pairs, halo's one-sided halo) and no windowed kernels.
            window, is_causal = NO_WINDOW, True
        elif is_causal:
            window = (window[0], 0)
        return STRATEGY_TABLE[self.strategy].attention(
            self,
            q_BHLK,
            k_BGLK,
            v_BGLK,
            cu_seqlens=cu_seqlens,
            max_seqlen=max_seqlen,
            is_causal=is_causal,
            scale=scale,
            window=window,
        )

    def assert_same_metadata(self, cu_seqlens: Tensor | AttentionMetadata) -> None:
        """Debug check: every rank holds the same document boundaries (host sync). Ranks that
        disagree, in capacity too, get the same `ValueError` on every rank; one that never arrives
        is a `CollectiveError` (the group's timeout)."""
        _check_same_metadata(cu_seqlens, self.group, self.world)

    # ---- training helpers ------------------------------------------------------------------------

    def token_mean(self, loss_sum: Tensor, num_tokens: Tensor | int) -> Tensor:
        """This rank's share of the global token-mean loss: `loss_sum / (tokens over all ranks)`.

        Summed over the CP ranks (`global_sum`) it equals the single-process mean; its gradient,
        after `reduce_grads`, equals the single-process gradient. With FSDP2 over a mesh that
        holds these CP ranks, use `usp_graph.fsdp.prepare(...).token_mean` instead.
        """
        return token_mean(loss_sum, num_tokens, self.group)

    def global_sum(self, x: Tensor) -> Tensor:
        """Sum of a (detached) tensor over the CP ranks, in rank order."""
        return _ordered_sum(x.detach(), self.group)

    def reduce_grads(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Sum every parameter's grad over the CP ranks, in place, in rank order (deterministic).

        A parameter with no grad on this rank contributes zeros; it gets a grad when any rank has one.
        FSDP2's sharded (DTensor) grads are refused: see `usp_graph.fsdp` for that layout.
        """
        _reduce_grads(list(params), self.group)


def _live_group(cp: ContextParallel) -> dist.ProcessGroup:
    """`ContextParallel.group`: the CP process group, held weakly. A plan kept for the whole run (a
    global, Dynamo's cache of a compiled step) must not keep its group alive past
    destroy_process_group: its gloo threads would run into the interpreter's teardown (issue 37,
    `usp_graph.distributed._exit_cleanly`)."""
    group = cp._group_ref()
    if group is None:
        raise ValueError(
            f"the process group {cp.group_name!r} of this ContextParallel was destroyed; build a "
            "ContextParallel on a live group"
        )
    return group


def _check_same_metadata(cu_seqlens: Tensor | AttentionMetadata, group, world: int) -> None:
    """`ContextParallel.assert_same_metadata` over `group` of `world` ranks."""
    cu = cu_seqlens.cu_seqlens if isinstance(cu_seqlens, AttentionMetadata) else cu_seqlens
    what = "assert_same_metadata (check_metadata)"
    sizes = [row[0] for row in gather_ints(f"{what}: capacity", group, [cu.numel()])]
    if len(set(sizes)) > 1:  # gathering the boundaries themselves would need equal sizes
        raise ValueError(
            "CP ranks disagree on the document boundaries' capacity: cu_seqlens holds "
            + ", ".join(f"{n} entries on rank {r}" for r, n in enumerate(sizes))
            + "; every rank must pass the same global metadata (the same max_docs too)"
        )
    mine = cu.reshape(-1).to(torch.int64)
    gathered = mine.new_empty(world * mine.numel())
    run_collective(what, group, lambda: all_gather_into(gathered, mine, group))
    rows = gathered.view(world, -1)
    bad = [r for r in range(world) if not torch.equal(rows[r], rows[0])]
    if bad:
        raise ValueError(
            f"CP ranks disagree on the document boundaries: ranks {bad} differ from rank 0 "
            f"({rows[bad[0]].tolist()} vs {rows[0].tolist()}); every rank must pass the same global metadata"
        )


def _reduce_grads(params: list[torch.nn.Parameter], group) -> None:
    """`ContextParallel.reduce_grads` over `group`: one ordered sum per dtype and device."""
    _refuse_fsdp_grads(params, group)
    buckets: dict[tuple[torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
    for p in params:
        if p.requires_grad:
            buckets.setdefault((p.dtype, p.device), []).append(p)
    for bucket in buckets.values():  # one collective per dtype/device, in a fixed order
        flat = torch.cat(
            [(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1) for p in bucket]
        )
        total = _ordered_sum(flat, group)
        offset = 0
        for p in bucket:
            n = p.numel()
            p.grad = total[offset : offset + n].view_as(p).clone()
            offset += n


def _refuse_fsdp_grads(params: list[torch.nn.Parameter], group) -> None:
    """A clear error for FSDP2's DTensor grads, which `reduce_grads` must not sum (again)."""
    from torch.distributed.tensor import DTensor

    sharded = next((p for p in params if isinstance(p.grad, DTensor) or isinstance(p, DTensor)), None)
    if sharded is None:
        return
    mesh_ranks = set(sharded.device_mesh.mesh.flatten().tolist())
    cp_ranks = set(dist.get_process_group_ranks(group))
    if cp_ranks <= mesh_ranks and len(cp_ranks) > 1:
        why = (
            "FSDP's reduce-scatter already summed them over these CP ranks (its mesh holds them); "
            "summing again would count every CP rank's part P times"
        )
    else:
        why = "they are FSDP2 shards (DTensors), not whole gradients"
    raise ValueError(
        f"reduce_grads got FSDP2-sharded parameters: {why}. Shard with usp_graph.fsdp.prepare(model, mesh, cp) "
        "and build the loss with its token_mean (FSDP's divide factor set to 1); its reduce_grads does "
        "what the layout needs"
    )


# ---- construction: "auto", the option checks, the process groups --------------------------------


def _require_distributed() -> None:
    if not dist.is_available() or not dist.is_initialized():
        raise ValueError("ContextParallel needs torch.distributed initialized: call init_process_group first")


def _decide(group, mesh, named: dict[str, object], auto_inputs: dict[str, object], is_causal: bool):
    """Strategy ``"auto"``: the `usp_graph.cp.auto` decision for these documents and heads on the
    CP group (a collective: it measures the group's rates unless given)."""
    fixed = [k for k, v in named.items() if v is not None]
    if fixed:
        raise ValueError(f"strategy 'auto' chooses {', '.join(fixed)} itself; leave them out")
    missing = [k for k in ("documents", "heads", "head_dim") if auto_inputs[k] is None]
    if missing:
        raise ValueError(
            f"strategy 'auto' needs {', '.join(missing)}: the document lengths of a step (or a "
            "few sampled steps), the query heads and the head dim of the attention it will run"
        )
    from .auto import resolve

    _require_distributed()
    if mesh is not None and group is not None:
        raise ValueError("pass either group or mesh, not both")
    if mesh is not None and mesh.ndim != 1:
        raise ValueError(f"strategy 'auto' takes a 1-D mesh (the CP dim), got {mesh.ndim}-D")
    on = mesh.get_group() if mesh is not None else (group if group is not None else dist.group.WORLD)
    a = auto_inputs
    return resolve(on, a["documents"], heads=a["heads"], kv_heads=a["kv_heads"], head_dim=a["head_dim"],
                   dtype=a["dtype"] or torch.bfloat16, is_causal=is_causal, rates=a["rates"],
                   device=None)  # fmt: skip


def _check_options(
    strategy: str,
    load_balance: str | None,
    max_document_len: int | None,
    across: str | None,
    head_groups: int,
) -> str | None:
    """Each option against the strategy it belongs to; returns `across` (usp's default: ``"ring"``)."""
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {', '.join(STRATEGIES)} or 'auto'; got {strategy!r}")
    if load_balance not in LOAD_BALANCE:
        raise ValueError(f"load_balance must be None or 'zigzag', got {load_balance!r}")
    if strategy == "usp":
        if across not in (None, "ring", "halo"):
            raise ValueError(
                f"across must be 'ring' or 'halo' (how usp's Ulysses groups share K/V), got {across!r}"
            )
        across = across or "ring"
    elif across is not None:
        raise ValueError(f"across is only for strategy 'usp', not {strategy!r}")
    if strategy == "halo" or across == "halo":
        what = "strategy 'halo'" if strategy == "halo" else "usp with across='halo'"
        if (
            isinstance(max_document_len, bool)
            or not isinstance(max_document_len, int)
            or max_document_len < 1
        ):
            raise ValueError(
                f"{what} needs max_document_len, a positive int: the longest document a step may "
                f"hold; got {max_document_len!r}"
            )
        if load_balance is not None:
            raise ValueError(
                f"{what} needs contiguous shards (load_balance=None): its halo is the neighbouring "
                "chunks; packed documents balance causal work without zigzag"
            )
    elif max_document_len is not None:
        raise ValueError(
            f"max_document_len is only for strategy 'halo' and usp with across='halo', not {strategy!r}"
        )
    if isinstance(head_groups, bool) or not isinstance(head_groups, int) or head_groups < 1:
        raise ValueError(f"head_groups must be a positive int, got {head_groups!r}")
    if head_groups != 1 and strategy != "ulysses":
        raise ValueError(f"head_groups is only for strategy 'ulysses', not {strategy!r}")
    return across


def _mesh_groups(strategy: str, mesh, ulysses_degree: int | None):
    """(CP group, ring group, Ulysses group, ulysses_degree) of a `DeviceMesh`: usp's 2-D mesh gives
    its ring and Ulysses dims (and a new group of every rank in it); other strategies take a 1-D mesh."""
    if strategy != "usp":
        if mesh.ndim != 1:
            names = getattr(mesh, "mesh_dim_names", None) or ()
            hint = f"; pass its CP dim, e.g. mesh=mesh[{names[-1]!r}]" if names else ""
            raise ValueError(f"strategy {strategy!r} needs a 1-D mesh (the CP dim), got {mesh.ndim}-D{hint}")
        return mesh.get_group(), None, None, ulysses_degree
    if mesh.ndim != 2:
        raise ValueError(f"strategy 'usp' needs a 2-D mesh (ring, ulysses), got {mesh.ndim}-D")
    ring_group, ulysses_group = mesh.get_group(0), mesh.get_group(1)
    if ulysses_degree not in (None, mesh.size(1)):
        raise ValueError(f"ulysses_degree={ulysses_degree} disagrees with the mesh's {mesh.size(1)}")
    # The whole CP group: every rank of the mesh.
    group = dist.new_group([int(r) for r in mesh.mesh.flatten().tolist()])
    return group, ring_group, ulysses_group, mesh.size(1)


def _usp_subgroups(group, world: int, rank: int, u: int):
    """(this rank's ring group, its Ulysses group) for usp with `u` consecutive ranks per Ulysses group."""
    # new_group is collective: every rank creates every subgroup, in the same order.
    ranks = [dist.get_global_rank(group, i) for i in range(world)]
    # Subgroups do not inherit the parent's timeout (they would get 30 min): pass it on, so a
    # failed peer still surfaces within the configured time.
    timeout = group_timeout(group)
    mine_u = mine_r = None
    for i in range(world // u):
        g = dist.new_group([ranks[i * u + j] for j in range(u)], timeout=timeout)
        if rank // u == i:
            mine_u = g
    for j in range(u):
        g = dist.new_group([ranks[i * u + j] for i in range(world // u)], timeout=timeout)
        if rank % u == j:
            mine_r = g
    return mine_r, mine_u
