"""The wrapper's full parameters on demand (``FSDP.summon_full_params``) and its
``use_orig_params=True`` contract (parameters the user replaced become the shards).

Outside forward the user sees shards; inside ``summon_full_params`` the full
parameters are registered instead (the engine's ``_core/unit/full_params.py``
gathers them and writes changes back). A flat parameter (``use_orig_params=False``)
is hidden meanwhile: ``named_parameters()`` then lists exactly the original
model's parameters.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from ._core.common import TrainingState
from ._core.manage import states_below
from ._core.step import ModuleState, get_state
from ._core.unit import ParamGroup, full_params, register_param_unit
from ._flat_param import FlatParamView

_summoned: weakref.WeakSet[ModuleState] = weakref.WeakSet()  # units inside summon_full_params


def is_summoned(state: ModuleState) -> bool:
    """Whether ``state``'s unit is inside ``summon_full_params``."""
    return state in _summoned


@contextlib.contextmanager
def summon_full_params(
    module: nn.Module,
    recurse: bool = True,
    writeback: bool = True,
    rank0_only: bool = False,
    offload_to_cpu: bool = False,
    with_grads: bool = False,
) -> Iterator[None]:
    """Makes the full parameters of ``module``'s units visible for the block.

    Args:
        module: a wrapper (or any module containing wrappers / fully_shard modules).
        recurse: also every unit below ``module`` (else ``module``'s own only).
        writeback: copy changes back into the shards on exit.
        rank0_only: only rank 0 of each unit's process group (the shard group under the hybrid
            strategies, as FSDP1) keeps the full parameters (needs writeback=False).
        offload_to_cpu: hand out CPU copies.
        with_grads: also gather gradients into ``.grad``.
    """
    states = states_below(module) if recurse else [s for s in [get_state(module)] if s is not None]
    _summoned.update(states)
    try:
        with _show_full_params(states, writeback, rank0_only, offload_to_cpu, with_grads):
            yield
    finally:
        _summoned.difference_update(states)


@contextlib.contextmanager
def _show_full_params(
    states: list[ModuleState], writeback: bool, rank0_only: bool, offload_to_cpu: bool, with_grads: bool
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
    summoned: list[ParamGroup] = []
    # A unit kept gathered in its own dtype (the root between forward and backward) stays gathered
    # after the block, as in FSDP1; a low-precision gathered copy is dropped: the block's values
    # (and any writeback) are full precision. A kept form the writeback made stale is gathered
    # again at its next use (see [Note: Kept forms go stale]).
    kept = [group for group in groups if group.is_unsharded and _gathered_in_own_dtype(group)]
    try:
        for group in groups:
            if group in kept:
                group.show_shards()  # the block shows full values where the shards are registered
            else:
                group.reshard()
            values = full_params.gather_full_values(group)
            grads = full_params.gather_full_grads(group) if with_grads else [None] * len(values)
            if rank0_only and _group_rank(group) != 0:
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
                full_params.write_back(group, [param.full_shown() for param in group.spec.params])
            for param in group.spec.params:
                param.end_show_full()
            if group.buffers.view is not None:
                group.buffers.view.show()
            if group in kept:
                group.show_shards()  # registered sharded, still gathered for the next use


def adopt_user_params_before_forward(wrapper: nn.Module, _args: Any) -> None:
    """Parameters (or flat parameters) the user replaced or re-pointed since the last step become the
    shards, for every unit this forward may gather (the root's forward prefetches its children). See
    ``adopt_user_params`` and ``FlatParamView.adopt_assigned_data``."""
    state = get_state(wrapper)
    if state is None or state.is_root is False:
        return
    for below in states_below(wrapper):
        if below.group is not None:
            adopt_assignments(below.group)


def adopt_assignments(unit: ParamGroup) -> None:
    """What the user assigned to the unit's flat parameter or original parameters becomes its shards."""
    view = unit.buffers.view
    if isinstance(view, FlatParamView):
        view.adopt_assigned_data()
    else:
        adopt_user_params(unit)


def _gathered_in_own_dtype(group: ParamGroup) -> bool:
    return all(param.param_dtype == param.orig_dtype for param in group.spec.params)


@torch.no_grad()
def _group_rank(group: ParamGroup) -> int:
    """This rank in the unit's process group (FSDP1's ``rank``: the shard group's under the hybrid
    strategies, every rank's under NO_SHARD), the one ``rank0_only`` reads."""
    info = group.spec.mesh_info
    return (info.replicate if info.shard_axis is None else info.shard).rank


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
        register_param_unit(registered, unit)  # clip_grad_norm_ and the scaler find its shards' unit
        param.to_sharded()


def _views(tensor: torch.Tensor, region: torch.Tensor) -> bool:
    """``tensor`` is ``region`` itself (same memory, same shape)."""
    return tensor.shape == region.shape and (region.numel() == 0 or tensor.data_ptr() == region.data_ptr())
