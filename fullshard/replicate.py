"""Data parallelism without sharding, on the same engine as ``fully_shard``.

Each rank keeps full parameters (``Replicate()`` DTensors); gradients are
averaged with one all-reduce per unit. Useful for small submodules inside a
sharded model, and as DDP with the ``fully_shard`` controls.
"""

from __future__ import annotations

from typing import cast

import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ._core.manage import manage_module, validate_dtensor_meshes, validate_module
from ._core.mesh import MeshInfo, default_mesh, describe_mesh
from ._core.settings import UnitConfig
from .api import MixedPrecisionPolicy, OffloadPolicy, StateDictType
from .fully_shard import FSDPModule, swap_class
from .state_dict.model import default_settings, install_state_dict_hooks

__all__ = ["replicate", "ReplicateModule"]


class ReplicateModule(FSDPModule):
    """Mixed into the class of every module that ``replicate`` was applied to."""


def replicate(
    module: nn.Module,
    *,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy = MixedPrecisionPolicy(),
    offload_policy: OffloadPolicy = OffloadPolicy(),
    ignored_params: set[nn.Parameter] | None = None,
) -> ReplicateModule:
    """Replicates ``module`` across ``mesh`` and all-reduces its gradients.

    Args:
        module: the module (changed in place and returned).
        mesh: a 1D mesh; default: all ranks.
        mp_policy, offload_policy, ignored_params: as for ``fully_shard``.
    """
    validate_module(module, "replicate")
    mesh = mesh if mesh is not None else default_mesh(None, "replicate")
    if mesh.ndim != 1:
        raise ValueError(f"replicate expects a 1D DeviceMesh but got {describe_mesh(mesh)}")
    validate_dtensor_meshes(module, mesh.device_type)
    config = UnitConfig(
        api_name="replicate", reshard_after_forward=False, mp_policy=mp_policy, offload_policy=offload_policy
    )
    state = manage_module(module, MeshInfo.for_replicate(mesh), config, ignored_params)
    install_state_dict_hooks(state, default_settings(StateDictType.SHARDED_STATE_DICT))
    swap_class(module, ReplicateModule, "Replicate")
    return cast(ReplicateModule, module)  # swap_class made it one
