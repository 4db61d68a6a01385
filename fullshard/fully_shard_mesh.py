"""``fully_shard``'s mesh arguments (``mesh``, ``dp_mesh_dims``, FSDP1's ``strategy``)
resolved once, in the front end, into the one ``MeshInfo`` the engine receives.

[Note: SPMD meshes]
``DataParallelMeshDims`` names the mesh dims that shard and replicate; several
names flatten into one dim. The engine then runs on that data-parallel mesh: 1D
(shard, or replicate only) or 2D (replicate, shard), as if it had been passed
as ``mesh``. Parameters may be DTensors on the whole mesh, replicated on its
data-parallel dims and placed on the others (tensor parallelism): their shards
stay on that mesh, the data-parallel shard dim becoming Shard(0) (see
``ShardParam._init_whole_mesh``).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate

from ._core import compat
from ._core.common import module_class_name
from ._core.manage import get_managed_modules, get_managed_states, validate_dtensor_meshes
from ._core.mesh import MeshInfo, default_device_type, default_mesh, describe_mesh, hybrid_mesh
from .api import HYBRID_STRATEGIES, DataParallelMeshDims, ShardingStrategy


def resolve_mesh(
    roots: tuple[nn.Module, ...],
    mesh: DeviceMesh | None,
    dp_mesh_dims: DataParallelMeshDims | None,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[MeshInfo, bool | int | None]:
    """The ``MeshInfo`` a ``fully_shard`` call's unit runs on, and its resolved
    ``reshard_after_forward`` (a strategy decides it); every mesh check is made here."""
    if dp_mesh_dims is not None:
        mesh, replicate_only = resolve_dp_mesh_dims(roots, mesh, dp_mesh_dims, strategy, reshard_after_forward)
    else:
        mesh, replicate_only, reshard_after_forward = _resolve_strategy(roots[0], mesh, strategy, reshard_after_forward)
    for root in roots:
        validate_dtensor_meshes(root, mesh.device_type)
    mesh_info = MeshInfo.for_replicate(mesh) if replicate_only else MeshInfo.for_fully_shard(mesh)
    return mesh_info, reshard_after_forward


def _resolve_strategy(
    module: nn.Module,
    mesh: DeviceMesh | None,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[DeviceMesh, bool, bool | int | None]:
    """Maps an FSDP1 strategy onto (mesh, replicate only?, resharding choice)."""
    if strategy is None:
        mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
        validate_mesh(mesh)
        return mesh, False, reshard_after_forward
    keeps = strategy in (ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy._HYBRID_SHARD_ZERO2)
    if reshard_after_forward is not None and strategy is ShardingStrategy.NO_SHARD:
        raise ValueError(
            f"fully_shard expects no reshard_after_forward with NO_SHARD (parameters are never sharded) but got "
            f"reshard_after_forward={reshard_after_forward} for {module_class_name(module)}"
        )
    if reshard_after_forward is not None and keeps == bool(reshard_after_forward):
        raise ValueError(
            f"fully_shard expects either strategy or reshard_after_forward, but got {strategy.name} with "
            f"reshard_after_forward={reshard_after_forward} for {module_class_name(module)}"
        )
    reshard = False if keeps else reshard_after_forward
    if strategy in HYBRID_STRATEGIES:
        mesh = mesh if mesh is not None else hybrid_mesh(default_device_type())
        if mesh.ndim != 2:
            raise ValueError(f"fully_shard expects a 2D DeviceMesh for {strategy.name} but got {describe_mesh(mesh)}")
        return mesh, False, reshard
    mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
    if mesh.ndim != 1:
        raise ValueError(f"fully_shard expects a 1D DeviceMesh for {strategy.name} but got {describe_mesh(mesh)}")
    if strategy is ShardingStrategy.NO_SHARD:
        return mesh, True, False
    return mesh, False, reshard


def resolve_dp_mesh_dims(
    roots: tuple[nn.Module, ...],
    mesh: DeviceMesh | None,
    dims: DataParallelMeshDims,
    strategy: ShardingStrategy | None,
    reshard_after_forward: bool | int | None,
) -> tuple[DeviceMesh, bool]:
    """``fully_shard``'s (data-parallel mesh, replicate only?) for ``dp_mesh_dims``."""
    owner = module_class_name(roots[0])
    if strategy is not None:
        raise ValueError(f"fully_shard expects either strategy or dp_mesh_dims, but got both for {owner}")
    if isinstance(reshard_after_forward, int) and not isinstance(reshard_after_forward, bool):
        raise NotImplementedError(
            f"fully_shard does not support an int reshard_after_forward with dp_mesh_dims yet ({owner}); pass a bool"
        )
    mesh = mesh if mesh is not None else default_mesh(None, "fully_shard")
    names = {id(p): name for root in roots for name, p in root.named_parameters()}
    params, _ = get_managed_states(get_managed_modules(roots))  # not those of units below
    return data_parallel_mesh(mesh, dims, [(names[id(p)], p) for p in params])


def data_parallel_mesh(
    mesh: DeviceMesh, dims: DataParallelMeshDims, params: Iterable[tuple[str, nn.Parameter]]
) -> tuple[DeviceMesh, bool]:
    """(the data-parallel mesh, replicate only?) for ``mesh`` and ``dims``.

    Raises:
        ValueError: the mesh has no dim names, a name is not among them, a
            parameter is a plain tensor while a non-data-parallel dim has more
            than one rank (it would need to be a DTensor on the whole mesh), or
            a DTensor parameter is on another mesh or not Replicate() on the
            data-parallel dims.
        NotImplementedError: DTensor parameters with several shard (or
            replicate) dims, which would flatten into one.
    """
    names = mesh.mesh_dim_names
    if names is None:
        raise ValueError("fully_shard expects a mesh with mesh_dim_names when dp_mesh_dims is given, but got none")
    for name in (*dims.shard_names, *dims.replicate_names):
        if name not in names:
            raise ValueError(f"fully_shard expects dp_mesh_dims among the mesh's dims {names}, but got {name!r}")
    data_parallel = {*dims.shard_names, *dims.replicate_names}
    others = [name for name in names if name not in data_parallel and mesh[name].size() > 1]
    for name, param in params:
        if isinstance(param, DTensor):
            _check_whole_mesh_param(name, param, mesh, dims)
        elif others:
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) expects parameters that are DTensors on the whole mesh when its "
                f"non-data-parallel dims {others} have more than one rank, but {name} is a plain tensor"
            )
    shard = _flattened(mesh, dims.shard_names)
    replicate = _flattened(mesh, dims.replicate_names)
    if shard is None and replicate is not None:
        return replicate, True
    if shard is None:
        raise AssertionError("DataParallelMeshDims names neither shard nor replicate dims")
    if replicate is None:
        return shard, False
    return compat.concatenate_meshes([replicate, shard]), False


def _check_whole_mesh_param(name: str, param: DTensor, mesh: DeviceMesh, dims: DataParallelMeshDims) -> None:
    if param.device_mesh != mesh:
        raise ValueError(
            f"fully_shard(dp_mesh_dims=...) expects DTensor parameters on the mesh it is given "
            f"{mesh.mesh_dim_names}, but {name} is on {param.device_mesh}; distribute it on the whole mesh"
        )
    if len(dims.shard_names) > 1 or len(dims.replicate_names) > 1:
        raise NotImplementedError(
            f"fully_shard(dp_mesh_dims=...) does not support DTensor parameters ({name}) with several shard or "
            f"replicate dims yet (got {dims}); name one dim each"
        )
    names = mesh.mesh_dim_names or ()
    for dim in (*dims.shard_names, *dims.replicate_names):
        placement = param.placements[names.index(dim)]
        if not isinstance(placement, Replicate):
            raise ValueError(
                f"fully_shard(dp_mesh_dims=...) expects parameters Replicate() on the data-parallel dim {dim!r}, "
                f"but {name} has {placement}; distribute it with Replicate() there"
            )


def _flattened(mesh: DeviceMesh, names: tuple[str, ...]) -> DeviceMesh | None:
    if not names:
        return None
    if len(names) == 1:
        return mesh[names[0]]
    return mesh[names]._flatten("_".join(names))


def validate_mesh(mesh: DeviceMesh) -> None:
    if not isinstance(mesh, DeviceMesh):
        raise TypeError(f"fully_shard expects a DeviceMesh for mesh but got {type(mesh).__name__}")
    if mesh.ndim not in (1, 2):
        raise ValueError(f"fully_shard expects a 1D or 2D DeviceMesh but got {describe_mesh(mesh)}")
