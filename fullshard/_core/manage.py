"""The engine's entry point: put one module's parameters under one unit.

Both front ends (``fully_shard``, ``replicate``, and the FSDP1-style wrapper)
end here with a mesh role assignment and a resharding choice; nothing below
knows which front end called.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn as nn

from ..api import CPUOffloadPolicy
from .common import UnitConfig, module_class_name
from .group import ParamGroup
from .init import (
    broadcast_from_first_rank,
    claim_params,
    get_managed_modules,
    get_managed_states,
    get_param_module_infos,
    move_buffers,
    root_modules,
    shard_dims,
    validate_devices,
    validate_params,
)
from .layout import flat_pieces
from .mesh import GroupInfo, MeshInfo, post_forward_group, validate_mesh_backend
from .param import ShardParam
from .presentation import DTENSOR_SHARDS
from .spec import UnitSpec
from .stale_optimizer import remember_replaced
from .state import ModuleState, get_state
from .trace import unit_labels
from .unit_settings import UnitSettings


def resolve_reshard_after_forward(
    config: UnitConfig, mesh_info: MeshInfo, module: nn.Module
) -> tuple[bool, GroupInfo | None]:
    """(reshard after forward?, smaller post-forward group for an int)."""
    value, api = config.reshard_after_forward, config.api_name
    if value is None:
        return True, None
    if isinstance(value, bool):
        return value, None
    shard_size = mesh_info.shard.size
    if not isinstance(value, int):
        raise ValueError(
            f"{api} expects reshard_after_forward to be None, a bool or an int but got "
            f"{value!r} ({type(value).__name__}) for {module_class_name(module)}"
        )
    if value < 1 or shard_size % value != 0:
        raise ValueError(
            f"{api} expects reshard_after_forward to be a bool or an int that divides the "
            f"shard size {shard_size}, but got {value} for {module_class_name(module)}"
        )
    if value == 1:
        return False, None  # keeping 1/1 of the parameters is not resharding
    if value == shard_size:
        return True, None
    return True, post_forward_group(mesh_info, value)


def manage_module(
    module: nn.Module | tuple[nn.Module, ...],
    mesh_info: MeshInfo,
    config: UnitConfig,
    ignored_params: Iterable[nn.Parameter] | None = None,
    ignored_modules: Iterable[nn.Module] = (),
) -> ModuleState:
    """Shards the parameters of ``module`` (or of several modules, one unit over
    all of them) minus those of already-managed submodules."""
    roots = (module,) if isinstance(module, nn.Module) else root_modules(module)
    device = mesh_info.device
    validate_mesh_backend(mesh_info, module_class_name(roots[0]), config.api_name)
    # Entries outside the module are not an error: one ignore list may serve
    # several units, each taking what lies below it.
    ignored = set(ignored_params or ())
    reshard, post_forward = resolve_reshard_after_forward(config, mesh_info, roots[0])
    modules = get_managed_modules(roots, ignored_modules)
    params, buffers = get_managed_states(modules, ignored)
    infos = get_param_module_infos(params, roots)
    names = {id(p): config.model_name(name) for root in roots for name, p in root.named_parameters()}
    owner = (
        "[" + ", ".join(module_class_name(m) for m in roots) + "]" if len(roots) > 1 else module_class_name(roots[0])
    )
    validate_params(params, infos, names, owner, config)
    validate_devices(roots, params, config.api_name)
    if config.sync_module_states:
        broadcast_from_first_rank(params, buffers, mesh_info)
    buffer_dtypes = move_buffers(modules, device, config.buffer_dtype)
    mp_policy = config.mp_policy
    dims = shard_dims(params, config.shard_placement_fn, names)
    if post_forward is not None and any(dims):
        raise NotImplementedError(
            f"{config.api_name} does not support an int reshard_after_forward with shard_placement_fn's "
            f"non-zero shard dims yet ({module_class_name(roots[0])}); pass a bool"
        )
    shard_params = [
        ShardParam(
            p, info, mesh_info, mp_policy.param_dtype, config.presentation or DTENSOR_SHARDS, dim, names.get(id(p))
        )
        for p, info, dim in zip(params, infos, dims)
    ]
    for shard_param, param in zip(shard_params, params):
        shard_param.fqn = names.get(id(param), shard_param.fqn)  # root-relative after lazy init
    # See [Note: Optimizer built before sharding].
    remember_replaced((p, sp.fqn) for sp, p in zip(shard_params, params) if sp.sharded_param is not p)
    claim_params(params, infos, owner, config.api_name)
    if not shard_params:
        return ModuleState(roots, None, config, device, buffer_dtypes)
    flat_chunk = _use_flat_layout(shard_params, params, mesh_info) if config.flat_layout else None
    spec = unit_spec(shard_params, mesh_info, config, owner, flat_chunk)
    extended = [p.fqn for p in shard_params if p.extension is not None]
    if extended and (post_forward is not None or spec.offload):
        raise NotImplementedError(
            f"{'CPU offload' if spec.offload else 'an int reshard_after_forward'} is not yet supported with "
            f"tensor-subclass parameters ({extended[0]} in {owner})"
        )
    chosen = config.reshard_after_forward is not None
    group = ParamGroup(spec, UnitSettings(reshard, post_forward, reshard_after_forward_chosen=chosen))
    return ModuleState(roots, group, config, device, buffer_dtypes)


def _use_flat_layout(shard_params: list[ShardParam], params: list[nn.Parameter], mesh_info: MeshInfo) -> int | None:
    """Shards ``shard_params`` as pieces of FSDP1's flat parameter (see [Note: Flat layout]);
    returns the chunk each rank holds. Parameters that one flat tensor cannot hold (several
    dtypes, frozen next to trainable, tensor subclasses) keep their rows: the front end's flat
    parameter refuses them. Tensor-parallel DTensors and other shard dims keep their rows too
    (a piece of a DTensor's local tensor is no DTensor); the flat parameter is then the rows
    buffer, and trains as before the flat layout (issue 35).
    On one shard rank the row layout is the flat one (each parameter whole, back to back): the
    parameters keep their rows there."""
    if (
        len({p.dtype for p in params}) > 1
        or len({p.requires_grad for p in params}) > 1
        or any(p.extension is not None or p.tp_mesh is not None or p.shard_dim != 0 for p in shard_params)
    ):
        return None
    if mesh_info.shard.size == 1:
        return sum(p.numel() for p in params)
    chunk, pieces = flat_pieces([p.numel() for p in params], mesh_info.shard.size)
    for shard_param, param, ranges in zip(shard_params, params, pieces):
        shard_param.use_flat_pieces(ranges, param.detach())
    return chunk


def unit_spec(
    params: list[ShardParam], mesh_info: MeshInfo, config: UnitConfig, name: str, flat_chunk: int | None = None
) -> UnitSpec:
    """The spec of the unit over ``params`` (see [Note: Unit spec])."""
    device, policy = mesh_info.device, config.offload_policy
    offload = isinstance(policy, CPUOffloadPolicy)
    return UnitSpec(
        params=params,
        mesh_info=mesh_info,
        device=device,
        offload=offload,
        storage_device=torch.device("cpu") if offload else device,
        pin_memory=isinstance(policy, CPUOffloadPolicy) and policy.pin_memory and device.type != "cpu",
        mp_policy=config.mp_policy,
        presentation=config.presentation or DTENSOR_SHARDS,
        keep_low_precision_grads=config.keep_low_precision_grads,
        flat_chunk=flat_chunk,
        name=name,
        labels=unit_labels(""),
    )


def states_below(module: nn.Module) -> list[ModuleState]:
    """The engine states of ``module`` and every module below it, in module order
    (a unit over several modules appears once)."""
    found = [s for s in (get_state(m) for m in module.modules()) if s is not None]
    return list(dict.fromkeys(found))
