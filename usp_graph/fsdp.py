"""FSDP2 x context parallelism on one `DeviceMesh`, with gradients reduced exactly once.

    mesh = init_device_mesh("cuda", (dp, cp), mesh_dim_names=("dp_shard", "cp"))
    cp = ContextParallel("ulysses", mesh=mesh["cp"])
    plan = usp_graph.fsdp.prepare(model, mesh, cp)       # fully_shard on every block and the root
    with attention_mode(meta, cp=cp):                    # or torch.compile(backend="usp", options={"cp": cp})
        loss_sum = F.cross_entropy(logits, labels, ignore_index=-100, reduction="sum")
    plan.token_mean(loss_sum, (labels != -100).sum()).backward()
    plan.reduce_grads(model.parameters())                # a no-op when FSDP's mesh holds the CP ranks
    optimizer.step()

The layout is torchtitan's: mesh dims ``dp_replicate`` (optional), ``dp_shard`` (optional) and
``cp``. FSDP shards parameters over ``dp_shard x cp`` flattened (``fold_cp=True``, named
``dp_shard_cp``): CP ranks hold different tokens of the same rows, so their gradients are partial
sums just like those of data-parallel ranks, and one reduce-scatter over all of them completes
the gradient. With a ``dp_replicate`` dim the mesh handed to `fully_shard` is 2-D
``(dp_replicate, dp_shard_cp)``: HSDP (all-reduce over replicas after the reduce-scatter).

Why a helper: FSDP divides the reduced gradient by its group size by default, and CP's loss is
already normalized by the global token count (`ContextParallel.token_mean`); the two together
are off by the FSDP world size. `prepare` sets every FSDP module's divide factor to 1 (and sum-only
collectives: gloo has no PREMUL_SUM), and `FSDPPlan.token_mean` divides by the tokens of every rank
of the mesh, so backward of the summed per-rank losses is the single-process gradient of the
global token mean. `ContextParallel.reduce_grads` on FSDP's sharded gradients raises and says so.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .cp.context import ContextParallel, _ordered_sum, token_mean

__all__ = ["FSDPPlan", "blocks_of", "fsdp_mesh", "prepare"]

DP_REPLICATE, DP_SHARD, CP = "dp_replicate", "dp_shard", "cp"


def _names(mesh) -> tuple[str, ...]:
    names = getattr(mesh, "mesh_dim_names", None)
    if not names:
        raise ValueError(
            "the mesh needs named dims, e.g. init_device_mesh(device, (dp, cp), mesh_dim_names=('dp_shard', 'cp'))"
        )
    return tuple(names)


def fsdp_mesh(mesh, *, cp_dim: str = CP, fold_cp: bool = True):
    """The mesh `fully_shard` takes for `mesh`: 1-D ``dp_shard[_cp]``, or 2-D
    ``(dp_replicate, dp_shard[_cp])`` (HSDP) when `mesh` has a ``dp_replicate`` dim.

    `fold_cp=True` shards over the data and CP ranks together (torchtitan's ``dp_shard_cp``);
    False shards over ``dp_shard`` only, and `FSDPPlan.reduce_grads` then sums over the CP ranks."""
    names = _names(mesh)
    allowed = (DP_REPLICATE, DP_SHARD, cp_dim)
    unknown = [n for n in names if n not in allowed]
    if unknown or cp_dim not in names:
        raise ValueError(
            f"mesh dims must be {cp_dim!r} with optional {DP_SHARD!r} and {DP_REPLICATE!r} (tensor or pipeline "
            f"parallel dims are not handled here); got {names}"
        )
    shard = [n for n in (DP_SHARD, cp_dim) if n in names and (n != cp_dim or fold_cp)]
    if not shard:
        raise ValueError(f"fold_cp=False needs a {DP_SHARD!r} dim to shard over; mesh dims are {names}")
    if len(shard) == 1:
        flat_name, flat = shard[0], mesh[shard[0]]
    else:
        flat_name = "_".join(shard)
        flat = mesh[tuple(shard)]._flatten(flat_name)
    if DP_REPLICATE in names:
        return mesh[(DP_REPLICATE, flat_name)]
    return flat


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The items of every `nn.ModuleList` in `model` (decoder blocks), outermost lists only."""
    found: list[nn.Module] = []
    inside: set[int] = set()
    for module in model.modules():
        if id(module) in inside:
            continue
        if isinstance(module, nn.ModuleList):
            for block in module:
                found.append(block)
                inside.update(id(m) for m in block.modules())
    return found


class FSDPPlan:
    """What `prepare` set up: the loss scaling and gradient reduction of FSDP2 x CP.

    mesh: the whole mesh; fsdp_mesh: the one `fully_shard` got; cp: the `ContextParallel`;
    group: every rank of `mesh` (token counts and logged losses are summed over it)."""

    def __init__(self, mesh, fsdp_mesh, cp: ContextParallel, fold_cp: bool) -> None:
        self.mesh, self.fsdp_mesh, self.cp, self.fold_cp = mesh, fsdp_mesh, cp, fold_cp
        names = _names(mesh)
        self.group = mesh._flatten("_".join(names)).get_group() if len(names) > 1 else mesh.get_group()
        self.world = dist.get_world_size(self.group)

    def __repr__(self) -> str:
        return (
            f"FSDPPlan(mesh={_names(self.mesh)}{tuple(self.mesh.shape)}, fsdp over "
            f"{_names(self.fsdp_mesh)}, cp={self.cp!r})"
        )

    def token_mean(self, loss_sum: Tensor, num_tokens: Tensor | int) -> Tensor:
        """This rank's share of the global token-mean loss: `loss_sum / (tokens of every rank of the mesh)`.

        Backward of it on every rank gives gradients whose sum over all ranks (what the FSDP
        reduction with divide factor 1 and `reduce_grads` compute) is the single-process gradient
        of the token mean over the whole global batch (every data-parallel replica's rows)."""
        return token_mean(loss_sum, num_tokens, self.group)

    def global_sum(self, x: Tensor) -> Tensor:
        """Sum of a (detached) tensor over every rank of the mesh, in rank order: the global loss
        from `token_mean`'s per-rank shares."""
        return _ordered_sum(x.detach(), self.group)

    def reduce_grads(self, params: Iterable[nn.Parameter]) -> None:
        """Complete the gradients after backward: nothing to do when FSDP shards over the CP ranks
        too (its reduce-scatter already summed them); with ``fold_cp=False`` sum each local grad
        shard over the CP ranks, in rank order."""
        if self.fold_cp:
            return
        grads = [p.grad for p in params if p.grad is not None]
        shards = [g._local_tensor if hasattr(g, "_local_tensor") else g for g in grads]
        with torch.no_grad():
            for shard, total in zip(shards, _ordered_sums(shards, self.cp.group), strict=True):
                shard.copy_(total)


def _ordered_sums(tensors: Sequence[Tensor], group) -> list[Tensor]:
    from .distributed import all_reduce_sum_ordered

    return all_reduce_sum_ordered(list(tensors), group) if tensors else []


def prepare(
    model: nn.Module,
    mesh,
    cp: ContextParallel,
    *,
    blocks: Sequence[nn.Module] | None = None,
    cp_dim: str = CP,
    fold_cp: bool = True,
    **fully_shard_kwargs: Any,
) -> FSDPPlan:
    """`fully_shard` every block of `model` (default: `blocks_of(model)`) and `model` itself over
    `fsdp_mesh(mesh)`, with gradients summed (divide factor 1); returns the `FSDPPlan` whose
    `token_mean` makes the loss and whose `reduce_grads` completes the gradients.

    `cp` must run over ``mesh[cp_dim]`` (build it with ``ContextParallel(strategy, mesh=mesh["cp"])``).
    Extra keywords go to `fully_shard` (``mp_policy``, ``reshard_after_forward``, ...)."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not isinstance(cp, ContextParallel):
        raise TypeError(f"cp must be a usp_graph.ContextParallel, got {type(cp).__name__}")
    if "mesh" in fully_shard_kwargs:
        raise ValueError("prepare picks the mesh fully_shard gets (fsdp_mesh(mesh)); do not pass mesh=")
    target = fsdp_mesh(mesh, cp_dim=cp_dim, fold_cp=fold_cp)
    cp_ranks = sorted(int(r) for r in mesh[cp_dim].mesh.flatten().tolist())
    if sorted(dist.get_process_group_ranks(cp.group)) != cp_ranks:
        raise ValueError(
            f"cp runs over ranks {sorted(dist.get_process_group_ranks(cp.group))} but mesh[{cp_dim!r}] of this "
            f"rank holds {cp_ranks}; build it with ContextParallel(strategy, mesh=mesh[{cp_dim!r}])"
        )
    if any(isinstance(m, FSDPModule) for m in model.modules()):
        raise ValueError("the model is already sharded (fully_shard was applied); prepare applies it itself")
    for block in blocks_of(model) if blocks is None else blocks:
        fully_shard(block, mesh=target, **fully_shard_kwargs)
    fully_shard(model, mesh=target, **fully_shard_kwargs)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # Sum, never average: token_mean already divides by the global token count.
            m.set_gradient_divide_factor(1.0)
            # Sum-only collectives: a factor of 1 would otherwise be NCCL's PREMUL_SUM, which gloo lacks.
            m.set_force_sum_reduction_for_comms(True)
    return FSDPPlan(mesh, target, cp, fold_cp)
