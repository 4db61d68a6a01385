"""Gradient clipping by the true global norm of sharded, replicated and mixed parameters.

[Note: Counting each gradient element once]
After reduction every element of every gradient lives on several ranks: on
exactly one rank of each replica for sharded parameters, on every rank of a
replicate group for NO_SHARD or HSDP replicas, on every rank of a TP group for
a TP-replicated parameter. Each rank therefore adds |g|^p of the elements it
"owns" -- its local shard, but only if it is the first rank (coordinate 0) of
every mesh dimension the tensor is replicated over -- and one all-reduce over
all ranks sums the owners. Plain tensors outside any unit are counted on rank
0 only (they are expected to be equal everywhere).

A mesh may cover only part of the world: with FSDP x TP, a parameter that TP
does not split lives on the data-parallel mesh of each TP rank, and those
copies hold the same values. A rank therefore weighs what it owns on a mesh
of M ranks by M / world_size: the copies together count once. (Parameters
that differ between copies of a mesh -- pipeline stages -- need one clip per
stage.)

This works for any mix of meshes (1D FSDP, HSDP, FSDP x TP, the wrapper's flat
parameters) with a single collective, where summing per-mesh norms would
count replicas several times.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate

from ._core import comm
from ._core.unit import unit_of

__all__ = ["clip_grad_norm_"]


def _owned_local_grad(param: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor | None, float]:
    """(This rank's part of ``grad``, ``param``'s gradient, if it owns it, else None;
    its weight). See [Note: Counting each gradient element once]."""
    world = dist.get_world_size()
    if isinstance(grad, DTensor):
        mesh = grad.device_mesh
        coordinate = mesh.get_coordinate()
        if coordinate is None:  # a gradient lives on the meshes of its rank
            raise AssertionError(f"rank {dist.get_rank()} holds a gradient on a mesh it is not part of")
        for dim, placement in enumerate(grad.placements):
            if isinstance(placement, Replicate) and coordinate[dim] != 0:
                return None, 0.0
        return grad._local_tensor, mesh.size() / world
    unit = unit_of(param)  # the wrapper's flat parameter, or a plain shard view
    if unit is not None:
        owned = unit.spec.mesh_info.replicate.rank == 0
        return (grad if owned else None), unit.spec.mesh_info.mesh.size() / world
    return (grad if dist.get_rank() == 0 else None), 1.0


def _local(grad: torch.Tensor) -> torch.Tensor:
    return grad._local_tensor if isinstance(grad, DTensor) else grad


@torch.no_grad()
def clip_grad_norm_(
    parameters: Iterable[torch.Tensor] | torch.Tensor, max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """Scales gradients in place so their global norm is at most ``max_norm``.

    Every rank of the default process group must call it (one all-reduce).

    Args:
        parameters: parameters of a ``fully_shard``/``replicate``/wrapper model,
            possibly on different meshes, plus any plain parameters.
        max_norm: the largest allowed norm.
        norm_type: the p of the p-norm; ``inf`` for the largest magnitude.

    Returns:
        The total norm before clipping (the same on every rank).
    """
    if isinstance(parameters, torch.Tensor):
        parameters = [parameters]
    grads = [(p, p.grad) for p in parameters if p.grad is not None]
    norm_type = float(norm_type)
    world = comm.default_group()
    device = _local(grads[0][1]).device if grads else torch.device("cpu")
    device = comm.device_for(world, device)  # offloaded gradients on NCCL: summed on the GPU
    local = torch.zeros((), dtype=torch.float32, device=device)
    for param, grad in grads:
        owned, weight = _owned_local_grad(param, grad)
        if owned is None or owned.numel() == 0:
            continue
        owned = owned.to(device, torch.float32)
        if math.isinf(norm_type):
            local = torch.maximum(local, owned.abs().max())
        else:
            local += weight * torch.linalg.vector_norm(owned, norm_type) ** norm_type
    op = dist.ReduceOp.MAX if math.isinf(norm_type) else dist.ReduceOp.SUM
    comm.all_reduce(local, world, op, async_op=False)
    total = local if math.isinf(norm_type) else local ** (1.0 / norm_type)
    coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for _, grad in grads:
        local_grad = _local(grad)
        local_grad.mul_(coefficient.to(local_grad.device, local_grad.dtype))
    return total
