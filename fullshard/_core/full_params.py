"""Full parameters on demand, outside forward and backward (``summon_full_params``,
full state dicts), and writing values back into a unit's shards.

Gathers in the parameters' own dtype (not the mixed-precision compute dtype)
into fresh tensors, so nothing the training step relies on is touched; on exit
changes are written back to the shards and the shards are registered again.
A front end's buffer view (the wrapper's flat parameter) is hidden meanwhile:
``named_parameters()`` then lists exactly the original model's parameters.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from . import comm
from .all_gather import split_views
from .common import TrainingState
from .group import ParamGroup
from .state import ModuleState


@contextlib.contextmanager
def full_params(
    states: list[ModuleState],
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Registers every managed parameter of ``states`` unsharded for the block.

    Raises:
        NotImplementedError: ``writeback`` with ``rank0_only`` (other ranks
            would have nothing to write back); the type PyTorch's FSDP1 raises.
        AssertionError: called during forward or backward (as PyTorch's FSDP1).
    """
    if writeback and rank0_only:
        raise NotImplementedError(
            "summon_full_params with rank0_only=True is not yet supported with writeback=True: only rank 0 "
            "holds the full parameters, so the other ranks could not write changes back; pass writeback=False"
        )
    groups = [state.group for state in states if state.group is not None]
    for group in groups:
        if group.training_state is not TrainingState.IDLE:
            raise AssertionError(
                f"summon_full_params expects no forward or backward in progress, but unit "
                f"{group.spec.name} is in {group.training_state.name}"
            )
    for group in groups:
        adopt_user_params(group)
    keep = not rank0_only or dist.get_rank() == 0
    summoned: list[ParamGroup] = []
    try:
        for group in groups:
            group.reshard()  # drop a low-precision unsharded copy kept after forward
            values = gather_full_values(group)
            grads = gather_full_grads(group) if with_grads else [None] * len(values)
            if not keep:
                continue
            if offload_to_cpu:
                values = [v.cpu() for v in values]
                grads = [g.cpu() if g is not None else None for g in grads]
            for param, value, grad in zip(group.spec.params, values, grads):
                param.show_full(value, grad, with_grads)
            if group.buffers.view is not None:  # the full parameters stand in for it
                group.buffers.view.hide()
            summoned.append(group)
        yield
    finally:
        for group in summoned:
            if writeback:
                write_back(group, [param.full_shown() for param in group.spec.params])
            for param in group.spec.params:
                param.end_show_full()
            if group.buffers.view is not None:
                group.buffers.view.show()


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
    """Copies this rank's rows of full parameter values into the shards."""
    rank = unit.spec.mesh_info.shard.rank
    for index, (param, value) in enumerate(zip(unit.spec.params, values)):
        if param.num_valid_rows == 0:
            continue
        mine = param.rows_per_rank(value.reshape(param.unsharded_size))[rank]
        region = unit.buffers.storage_layout.region(unit.buffers.shard_buffer, index, param.orig_dtype)
        region[: mine.numel()].view(mine.shape).copy_(mine)


@torch.no_grad()
def write_shard(unit: ParamGroup, index: int, local: torch.Tensor, into: torch.Tensor | None = None) -> None:
    """Copies parameter ``index``'s local rows into the shard buffer (or ``into``,
    a tensor in the same layout, e.g. a flat optimizer state)."""
    target = unit.buffers.shard_buffer if into is None else into
    param = unit.spec.params[index]
    region = unit.buffers.storage_layout.region(target, index, param.orig_dtype if into is None else target.dtype)
    region[: local.numel()].copy_(local.reshape(-1))


@torch.no_grad()
def adopt_user_params(unit: ParamGroup) -> None:
    """The wrapper's ``use_orig_params=True`` contract, checked before the unit is gathered: a Parameter
    the user registered in place of ours, or one whose ``.data`` was assigned a new tensor, becomes the
    shard (its values copied in, its object kept), as PyTorch's FSDP1 does.

    Raises:
        RuntimeError: the new value's shape is not the shard's (what FSDP1 raises).
    """
    if unit.is_unsharded:  # registered now: the unsharded parameters (forward, or kept after it)
        return
    for param in unit.spec.params:
        if not param.presentation.keeps_user_param:
            return
        registered = param.module_registration()
        shard = param.present(param.bound_rows)
        if registered is None or registered is param.unsharded_param:
            continue
        if registered is param.sharded_param and _views(registered, shard):
            continue
        if registered.shape != shard.shape:
            raise RuntimeError(
                f"Cannot writeback when the parameter shape changes\nExpects {shard.shape} but got "
                f"{registered.shape} for {param.fqn}: with use_orig_params=True a parameter outside forward is "
                "this rank's 1D shard; change values in place or assign a tensor of the shard's shape"
            )
        shard.copy_(registered.detach())
        grad = registered.grad
        registered.data = shard
        if grad is not None and grad.shape != shard.shape:
            registered.grad = None
        param.sharded_param = registered
        param.to_sharded()


def _views(tensor: torch.Tensor, region: torch.Tensor) -> bool:
    """``tensor`` is ``region`` itself (same memory, same shape)."""
    return tensor.shape == region.shape and (region.numel() == 0 or tensor.data_ptr() == region.data_ptr())
