"""Full parameters on demand, outside forward and backward (the wrapper's
``summon_full_params``, full state dicts), and writing values back into a unit's shards.

Gathers in the parameters' own dtype (not the mixed-precision compute dtype)
into fresh tensors, so nothing the training step relies on is touched.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from . import comm
from .all_gather import split_views
from .group import ParamGroup


@torch.no_grad()
def gather_full_values(unit: ParamGroup) -> list[torch.Tensor]:
    """Every parameter of ``unit`` unsharded, in its own dtype, in fresh tensors.

    Gathers over the shard group only: replicas hold the same shards.
    """
    if unit.buffers.extended:  # their shards are not in the buffer (see extension.py)
        raise NotImplementedError(
            f"summon_full_params and full state dicts are not yet supported with tensor-subclass parameters "
            f"({unit.buffers.extended[0].fqn}); use sharded state dicts"
        )
    return _gather_storage_layout(unit, unit.buffers.shard_buffer)


@torch.no_grad()
def gather_full_grads(unit: ParamGroup) -> list[torch.Tensor | None]:
    """Every parameter's sharded gradient unsharded, like ``gather_full_values``;
    None for a parameter without a gradient on this rank."""
    source, present = _grads_in_storage_layout(unit)
    return [grad if keep else None for grad, keep in zip(_gather_storage_layout(unit, source), present)]


def _gather_storage_layout(unit: ParamGroup, source: torch.Tensor) -> list[torch.Tensor]:
    """All-gathers ``source`` (laid out like the shard buffer) into each parameter's full value."""
    source = source.to(unit.spec.device)
    shard = unit.spec.mesh_info.shard
    if shard.size > 1:
        output = torch.empty(source.numel() * shard.size, dtype=source.dtype, device=unit.spec.device)
        comm.all_gather(output, source, shard.process_group, async_op=False)
    else:
        output = source
    padded = [
        torch.empty(shard.size * p.shard_numel, dtype=p.orig_dtype, device=unit.spec.device) for p in unit.spec.params
    ]
    unit.buffers.storage_layout.copy_out(output, shard.size, padded, split_views(unit.spec.params, padded))
    return [p.full_from_padded(t) for p, t in zip(unit.spec.params, padded)]


def _grads_in_storage_layout(unit: ParamGroup) -> tuple[torch.Tensor, list[bool]]:
    if unit.buffers.view is not None:
        grad = unit.buffers.view.tensor.grad
        present = [grad is not None] * len(unit.spec.params)
        return (grad if grad is not None else torch.zeros_like(unit.buffers.shard_buffer)), present
    buffer = torch.zeros_like(unit.buffers.shard_buffer)
    present = []
    for index, param in enumerate(unit.spec.params):
        grad = param.sharded_param.grad
        present.append(grad is not None)
        local = param.rows_from_presented(grad) if grad is not None else None
        if local is not None and local.numel() > 0:
            unit.buffers.storage_layout.region(buffer, index, param.orig_dtype)[: local.numel()].copy_(
                local.reshape(-1)
            )
    return buffer, present


@torch.no_grad()
def write_back(unit: ParamGroup, values: list[torch.Tensor]) -> None:
    """Copies this rank's rows of full parameter values into the shards (those that differ)."""
    rank = unit.spec.mesh_info.shard.rank
    for index, (param, value) in enumerate(zip(unit.spec.params, values)):
        if param.num_valid_rows == 0:
            continue
        mine = param.rows_per_rank(value.reshape(param.unsharded_size))[rank]
        region = unit.buffers.storage_layout.region(unit.buffers.shard_buffer, index, param.orig_dtype)
        target = region[: mine.numel()].view(mine.shape)
        # Unchanged rows are not written: the shard may be a tensor autograd saved (NO_SHARD computes on it),
        # whose version an in-place copy would bump (summon_full_params from a backward hook).
        if not (target.dtype == mine.dtype and torch.equal(target, mine)):
            target.copy_(mine)


@torch.no_grad()
def write_shard(unit: ParamGroup, index: int, local: torch.Tensor, into: torch.Tensor | None = None) -> None:
    """Copies parameter ``index``'s local rows into the shard buffer (or ``into``,
    a tensor in the same layout, e.g. a flat optimizer state)."""
    target = unit.buffers.shard_buffer if into is None else into
    param = unit.spec.params[index]
    region = unit.buffers.storage_layout.region(target, index, param.orig_dtype if into is None else target.dtype)
    region[: local.numel()].copy_(local.reshape(-1))


def read_shard(unit: ParamGroup, index: int, source: torch.Tensor) -> DTensor:
    """Parameter ``index``'s shard in ``source`` (a tensor laid out like the shard
    buffer, e.g. a flat optimizer state), as a DTensor like the sharded parameter.
    The inverse of ``write_shard``."""
    region = unit.buffers.storage_layout.region(source, index, source.dtype)
    return unit.spec.params[index].dtensor_from_padded(region)
