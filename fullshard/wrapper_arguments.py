"""The FSDP1 wrapper's constructor arguments resolved into what the engine takes.

FSDP1's rules, each in one function: which groups a unit shards and replicates
over (``process_group``, ``device_mesh``, the hybrid strategies), which modules
and parameters are ignored, how a strategy and the precision / offload / prefetch
arguments become a ``UnitConfig``, and how meta-device modules are materialized.
"""

from __future__ import annotations

import dataclasses
import os
import warnings
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ._core.manage import get_managed_modules
from ._core.mesh import MeshInfo, default_device_type, default_mesh, describe_mesh, hybrid_mesh, mesh_from_groups
from ._core.presentation import LocalViews
from ._core.settings import UnitConfig
from ._core.step import module_class_name
from ._flat_param import FLAT_PIECES
from ._names import model_name
from .api import (
    HYBRID_STRATEGIES,
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)


def no_shard_on_one_rank(strategy: ShardingStrategy, mesh_info: MeshInfo) -> tuple[ShardingStrategy, MeshInfo]:
    """FULL_SHARD and SHARD_GRAD_OP over one rank are NO_SHARD (FSDP1 switches, and warns:
    ``warn_no_shard_on_one_rank``)."""
    if strategy in HYBRID_STRATEGIES or strategy is ShardingStrategy.NO_SHARD or mesh_info.shard.size != 1:
        return strategy, mesh_info
    return ShardingStrategy.NO_SHARD, MeshInfo.for_replicate(mesh_info.mesh)


def warn_no_shard_on_one_rank(requested: ShardingStrategy) -> None:
    warnings.warn(
        f"FullyShardedDataParallel switches from {requested} to ShardingStrategy.NO_SHARD: the "
        "process group has one rank, so there is nothing to shard",
        UserWarning,
        stacklevel=3,
    )


def warn_if_mixed_requires_grad(params: list, owner: str) -> None:
    """Frozen and trainable parameters in one unit: the unit reduces a gradient buffer covering the
    frozen ones too (FSDP1 warns the same)."""
    if len({p.sharded_param.requires_grad for p in params}) > 1:
        warnings.warn(
            f"{owner} has both parameters with requires_grad=True and False: the unit's gradient memory and "
            "communication cover the frozen parameters too; wrap the frozen modules in their own unit to avoid it",
            UserWarning,
            stacklevel=4,
        )


def resolve_ignored(
    module: nn.Module,
    ignored_modules: Iterable[nn.Module] | None,
    ignored_states: Iterable[nn.Parameter | nn.Module] | None,
    wrapper_type: type[nn.Module],
) -> tuple[set[nn.Module], set[nn.Parameter]]:
    """The ignored modules (with their subtrees) and parameters below ``module``.

    Entries elsewhere are skipped: one list may be given to several wrappers,
    each taking what lies below it (as FSDP1 does). A ``wrapper_type`` (the
    wrapper class) among them is an error: its unit is made already.
    """
    if ignored_modules is not None and ignored_states is not None:
        raise ValueError(
            "Cannot pass both ignored_modules and ignored_states at the same time (FullyShardedDataParallel); "
            "pass all of them as ignored_states"
        )
    items = list(ignored_modules or ignored_states or ())
    types = sorted({type(item) for item in items}, key=lambda kind: kind.__name__)
    if ignored_modules is not None and any(not isinstance(item, nn.Module) for item in items):
        # FSDP1's wording (its own tests match it), then the fix.
        raise ValueError(
            f"ignored_modules expects nn.Module list elements but got types {types}; pass parameters as ignored_states"
        )
    kinds = {nn.Module if isinstance(item, nn.Module) else nn.Parameter for item in items}
    if len(kinds) > 1:
        raise ValueError(
            f"ignored_states expects all nn.Parameter or all nn.Module list elements but got types {types}; "
            "ignore the modules' parameters instead"
        )
    for item in items:
        if not isinstance(item, (nn.Module, nn.Parameter)):
            raise ValueError(
                f"FullyShardedDataParallel expects ignored states to be modules or parameters but got "
                f"{type(item).__name__}"
            )
        if isinstance(item, wrapper_type):
            raise ValueError(
                f"FullyShardedDataParallel expects ignored_modules / ignored_states without wrapped modules, "
                f"but "
                f"{module_class_name(item)} is a FullyShardedDataParallel; ignore the module it wraps "
                "before wrapping it instead"
            )
    if any(item is module for item in items):
        raise ValueError(
            f"FullyShardedDataParallel expects the wrapped module itself not to be ignored "
            f"({module_class_name(module)}); ignore its submodules instead"
        )
    own = set(module.modules())
    expanded = {m for ignored in items if isinstance(ignored, nn.Module) and ignored in own for m in ignored.modules()}
    own_params = set(module.parameters())
    params = {p for p in items if isinstance(p, nn.Parameter) and p in own_params}
    params |= {p for m in expanded for p in m.parameters()}
    return expanded, params


def _device_type(device_id: int | torch.device | None) -> str:
    if device_id is None:
        return default_device_type()
    if isinstance(device_id, int):
        torch.cuda.set_device(device_id)
        return "cuda"
    device = torch.device(device_id)
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)
    return device.type


def resolve_mesh(
    process_group: Any,
    device_mesh: DeviceMesh | None,
    strategy: ShardingStrategy,
    policy: Any,
    device_id: int | torch.device | None,
) -> MeshInfo:
    """FSDP1's rules for which groups a unit shards and replicates over."""
    if process_group is not None and device_mesh is not None:
        raise ValueError(
            "Cannot pass both process_group and device_mesh at the same time. Please just pass only one of them."
        )
    device_type = _device_type(device_id)
    if strategy in HYBRID_STRATEGIES:
        if device_mesh is not None:
            if device_mesh.ndim != 2:
                raise ValueError(f"Expected device_mesh to have ndim=2 but got {device_mesh.ndim}")
            return MeshInfo.for_fully_shard(device_mesh)
        if process_group is None:
            if policy is None:
                raise ValueError(
                    f"Manual wrapping with {strategy} requires explicit specification of process group or device_mesh."
                )
            return MeshInfo.for_fully_shard(hybrid_mesh(device_type))
        if not (
            isinstance(process_group, tuple)
            and len(process_group) == 2
            and all(isinstance(g, dist.ProcessGroup) for g in process_group)
        ):
            raise ValueError(
                "Expected process_group to be passed in as either None or "
                f"Tuple[dist.ProcessGroup, dist.ProcessGroup] but got {type(process_group)}"
            )
        shard_group, replicate_group = process_group
        return MeshInfo.for_fully_shard(mesh_from_groups(shard_group, replicate_group, device_type))
    if device_mesh is not None:
        if device_mesh.ndim != 1:
            raise ValueError(
                f"{strategy.name} expects a 1D device_mesh but got {describe_mesh(device_mesh)}; "
                "2D meshes are for the hybrid strategies"
            )
        mesh = device_mesh
    elif process_group is not None:
        if isinstance(process_group, tuple):
            raise ValueError(
                f"{strategy.name} expects one process group; a (shard, replicate) pair is for the hybrid strategies"
            )
        mesh = mesh_from_groups(_real_group(process_group), None, device_type)
    else:
        mesh = default_mesh(device_type, "FullyShardedDataParallel")
    return MeshInfo.for_replicate(mesh) if strategy is ShardingStrategy.NO_SHARD else MeshInfo.for_fully_shard(mesh)


def _real_group(group: Any) -> dist.ProcessGroup:
    """``group``, or for a stand-in that only answers ``rank()`` and ``size()`` (the
    doubles torch's own tests pass, not a ``dist.ProcessGroup``) the real group it
    stands for: this rank alone for size 1, the world for the world's size.

    Raises:
        ValueError: a stand-in of another size, or without ``rank()`` and ``size()``.
    """
    if isinstance(group, dist.ProcessGroup):
        return group
    size = group.size() if callable(getattr(group, "size", None)) and callable(getattr(group, "rank", None)) else None
    if size == 1:
        return dist.new_group([dist.get_rank()], use_local_synchronization=True)
    if size == dist.get_world_size():
        return dist.group.WORLD  # type: ignore[return-value]
    raise ValueError(
        "FullyShardedDataParallel expects process_group to be a torch.distributed ProcessGroup (or an object "
        f"with rank() and size() standing for this rank alone or the whole world) but got {type(group).__name__}"
        + (f" of size {size} in a world of {dist.get_world_size()}" if size is not None else "")
    )


@dataclass(frozen=True, kw_only=True)
class WrapperSettings:
    """A wrapper's constructor arguments that the wrappers its policy creates inherit
    (as FSDP1's do); the groups only where an override asks for its own."""

    process_group: dist.ProcessGroup | tuple[dist.ProcessGroup, dist.ProcessGroup] | None
    device_mesh: DeviceMesh | None
    cpu_offload: CPUOffload | None
    backward_prefetch: BackwardPrefetch | None
    mixed_precision: MixedPrecision | None
    param_init_fn: Callable[[nn.Module], None] | None
    device_id: int | torch.device | None
    sync_module_states: bool
    forward_prefetch: bool
    limit_all_gathers: bool
    use_orig_params: bool

    def inherited(self) -> dict[str, Any]:
        """The constructor keywords a policy's wrapper gets (it shares the groups through its mesh)."""
        skipped = ("process_group", "device_mesh")
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in skipped}


_KEEPING_STRATEGIES = (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)


def unit_config(strategy: ShardingStrategy, settings: WrapperSettings) -> UnitConfig:
    precision = settings.mixed_precision or MixedPrecision()
    offload = settings.cpu_offload
    reshard = {
        ShardingStrategy.FULL_SHARD: None,  # resharded after forward, except the root
        ShardingStrategy.HYBRID_SHARD: None,
        ShardingStrategy.SHARD_GRAD_OP: False,
        ShardingStrategy._HYBRID_SHARD_ZERO2: False,
        ShardingStrategy.NO_SHARD: False,
    }[strategy]
    return UnitConfig(
        api_name="FullyShardedDataParallel",
        ignore_argument="ignored_states",
        adopts_used_units=True,
        name_in_model=model_name,
        reshard_after_forward=reshard,
        mp_policy=MixedPrecisionPolicy(
            param_dtype=precision.param_dtype,
            reduce_dtype=precision.reduce_dtype,
            cast_forward_inputs=precision.cast_forward_inputs,
        ),
        offload_policy=CPUOffloadPolicy() if offload is not None and offload.offload_params else OffloadPolicy(),
        forward_prefetch=settings.forward_prefetch,
        backward_prefetch=settings.backward_prefetch,
        cast_root_inputs=precision.cast_root_forward_inputs and precision.param_dtype is not None,
        keep_low_precision_grads=precision.keep_low_precision_grads,
        # Read when wrapping, as PyTorch's FSDP1 does.
        full_precision_in_eval=os.environ.get("FSDP_USE_FULL_PREC_IN_EVAL", "") == "1",
        buffer_dtype=precision.buffer_dtype,
        presentation=LocalViews(
            flatten=strategy is not ShardingStrategy.NO_SHARD,
            # FSDP1's types: its own check under the strategies that keep parameters gathered after
            # forward, autograd's error (a RuntimeError) under the others.
            refusal=AssertionError if strategy in _KEEPING_STRATEGIES else RuntimeError,
            refusal_setting=f" ({strategy})",
        )
        if settings.use_orig_params
        else FLAT_PIECES,
        # One flat parameter per unit, in FSDP1's layout (see [Note: Flat layout] in _core/layout.py).
        flat_layout=not settings.use_orig_params,
        sync_module_states=settings.sync_module_states,
    )


def materialize_meta(
    module: nn.Module, param_init_fn: Callable[[nn.Module], None] | None, device: torch.device, ignored: set[nn.Module]
) -> None:
    """FSDP1: meta-device modules are initialized when wrapped.

    ``param_init_fn`` (or ``to_empty`` + ``reset_parameters``) is applied to each
    module the wrapper manages, parents before children (breadth first, as FSDP1
    does, so seeded random initialisation gives FSDP1's values); nested
    wrappers were initialized by their own constructor.
    """
    managed = _breadth_first(get_managed_modules(module, ignored), module)
    tensors = [t for m in managed for t in (*m.parameters(recurse=False), *m.buffers(recurse=False))]
    if not any(t.is_meta for t in tensors):
        return
    if param_init_fn is not None and not callable(param_init_fn):
        raise ValueError(
            f"FullyShardedDataParallel expects param_init_fn {param_init_fn!r} to be callable but got "
            f"{type(param_init_fn)}"
        )
    with torch.no_grad():
        for submodule in managed:
            if param_init_fn is not None:
                param_init_fn(submodule)
                continue
            if not any(True for _ in (*submodule.parameters(recurse=False), *submodule.buffers(recurse=False))):
                continue
            reset = getattr(submodule, "reset_parameters", None)
            if not callable(reset):
                raise ValueError(
                    f"FullyShardedDataParallel expects meta-device modules to define reset_parameters(), but "
                    f"{module_class_name(submodule)} does not; give it one or pass param_init_fn"
                )
            submodule.to_empty(device=device, recurse=False)
            reset()


def _breadth_first(modules: list[nn.Module], root: nn.Module) -> list[nn.Module]:
    """``modules`` (a subtree of ``root``) in breadth-first order."""
    wanted, frontier = set(modules), [root]
    order: list[nn.Module] = []
    seen = {root}
    while frontier:
        order.extend(m for m in frontier if m in wanted)
        children = [c for m in frontier for c in m.children() if c in wanted and c not in seen]
        seen.update(children)
        frontier = list(dict.fromkeys(children))
    return order
