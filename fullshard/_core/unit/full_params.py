"""Full parameters on demand, outside forward and backward (the wrapper's
``summon_full_params``, full state dicts), and writing values back into a unit's shards.

Gathers in the parameters' own dtype (not the mixed-precision compute dtype)
into fresh tensors, so nothing the training step relies on is touched.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from .. import comm
from ..gather import ShardParam, split_views
from .group import ParamGroup


@torch.no_grad()
def gather_full_values(unit: ParamGroup) -> list[torch.Tensor]:
    """Every parameter of ``unit`` unsharded, in its own dtype, in fresh tensors.

    Gathers over the shard group only: replicas hold the same shards. A tensor-subclass
    parameter (see [Note: Gather extensions]) is not in the buffer: its shard's DTensor is
    gathered as its own type (the subclass defines that all-gather: NF4 sends its packed
    parts), so the full value is the one the model was sharded from, bit for bit.
    """
    values = gather_like_shards(unit, unit.buffers.shard_buffer)
    for param in unit.buffers.extended:
        values[unit.spec.params.index(param)] = comm.full_tensor(param.shard_as_dtensor())
    return values


@torch.no_grad()
def gather_full_grads(unit: ParamGroup) -> list[torch.Tensor | None]:
    """Every parameter's sharded gradient unsharded, like ``gather_full_values``;
    None for a parameter without a gradient on this rank."""
    source, present = _grads_in_storage_layout(unit)
    return [grad if keep else None for grad, keep in zip(gather_like_shards(unit, source), present)]


@torch.no_grad()
def gather_like_shards(unit: ParamGroup, source: torch.Tensor) -> list[torch.Tensor]:
    """All-gathers ``source`` (laid out like the shard buffer: the shards, a gradient, a flat
    optimizer state) into each parameter's full value, in fresh tensors (a collective)."""
    source = source.to(unit.spec.device)
    shard = unit.spec.mesh_info.shard
    if shard.size > 1:
        output = torch.empty(source.numel() * shard.size, dtype=source.dtype, device=unit.spec.device)
        comm.all_gather(output, source, shard.process_group, async_op=False)
    else:
        output = source
    # A tensor-subclass parameter has an empty region (its value: gather_full_values).
    padded = [
        torch.empty(p.unsharded_numel if p.extension is None else 0, dtype=p.orig_dtype, device=unit.spec.device)
        for p in unit.spec.params
    ]
    unit.buffers.storage_layout.copy_out(output, shard.size, padded, split_views(unit.spec.params, padded))
    return [p.full_from_padded(t) if p.extension is None else t for p, t in zip(unit.spec.params, padded)]


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


def local_part(param: ShardParam, value: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``value`` (the full parameter, or a DTensor of any layout) as the
    shard buffer holds it: its rows, or its piece of the flat shard (see [Note: Flat layout])."""
    if param.flat_ranges is None:
        return param.shard_from_full(value)._local_tensor
    full = comm.full_tensor(value) if isinstance(value, DTensor) else value
    if tuple(full.shape) != tuple(param.global_size):
        raise ValueError(f"loading {param.fqn} expects shape {tuple(param.global_size)} but got {tuple(full.shape)}")
    return param.rows_per_rank(full)[param.mesh_info.shard.rank]


def row_shard(param: ShardParam, full: torch.Tensor) -> DTensor:
    """This rank's dim-0 rows of ``full`` (``param``'s full value or a state of its shape) as
    a DTensor like a row-sharded parameter's: the sharded form of state dicts, also for a
    parameter held as a piece of the flat shard (FSDP1 cuts those from the full value too).
    The rows are a copy: a view would keep (and ``torch.save`` write) the whole gathered value,
    whose storage may be freed or reused once the state dict is built."""
    shard = param.mesh_info.shard
    num_rows = full.size(0)
    chunk = -(-num_rows // shard.size)
    start = min(shard.rank * chunk, num_rows)
    return param.dtensor_from_rows(full.narrow(0, start, min(chunk, num_rows - start)).clone())
