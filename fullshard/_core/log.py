"""The ``fullshard`` logger: what lazy initialisation built, at DEBUG.

[Note: Logging]
All of fullshard logs under ``logging.getLogger("fullshard")`` (this module
uses its child ``fullshard.init``) and only at DEBUG: at the default level
nothing is printed. At DEBUG, lazy initialisation (the root's first forward)
logs the mesh, then one line per unit (parameters, numel, bytes, dtypes,
offload, resharding) and one with the unit's bytes per step, counted as
``comm.record_comms()`` counts them (the full buffer for an all-gather and a
reduce-scatter, the shard for an all-reduce).
"""

from __future__ import annotations

import logging

from .group import ParamGroup
from .mesh import MeshInfo

logger = logging.getLogger("fullshard.init")


def log_lazy_init(root_name: str, groups: list[ParamGroup]) -> None:
    """The DEBUG lines of one root's lazy initialisation."""
    if not logger.isEnabledFor(logging.DEBUG):
        return
    logger.debug("lazy init of root %s: %d units", root_name, len(groups))
    meshes: list[MeshInfo] = []
    for group in groups:
        if all(group.spec.mesh_info is not seen for seen in meshes):
            meshes.append(group.spec.mesh_info)
            _log_mesh(group.spec.mesh_info)
        _log_unit(group)


def _log_mesh(mesh_info: MeshInfo) -> None:
    mesh = mesh_info.mesh
    logger.debug(
        "mesh %s (dims %s) on %s: shard group %d ranks, replicate group %d ranks",
        tuple(mesh.shape),
        mesh.mesh_dim_names,
        mesh_info.device,
        mesh_info.shard.size,
        mesh_info.replicate.size,
    )


def _log_unit(group: ParamGroup) -> None:
    params = group.spec.params
    numel = sum(p.global_size.numel() for p in params)
    full_bytes = sum(p.global_size.numel() * p.orig_dtype.itemsize for p in params)
    shard_bytes = group.buffers.shard_buffer.numel() * group.buffers.shard_buffer.element_size()
    logger.debug(
        "unit %s: %d parameters, %d elements, %d bytes (%d per rank sharded), dtypes %s, compute dtype %s, "
        "reduce dtype %s, offload %s, reshard after forward %s",
        group.spec.name,
        len(params),
        numel,
        full_bytes,
        shard_bytes,
        sorted({str(p.orig_dtype) for p in params}),
        sorted({str(p.param_dtype) for p in params}),
        group.buffers.reduce_dtype,
        group.spec.offload,
        group.settings.reshard_after_forward,
    )
    shard, replicate = group.spec.mesh_info.shard, group.spec.mesh_info.replicate
    gather_layout = group.buffers.gather_layout
    gather_bytes = gather_layout.total * gather_layout.dtype.itemsize * shard.size
    grad_numel = sum(p.shard_numel for p in params if p.sharded_param.requires_grad)
    reduce_bytes = grad_numel * group.buffers.reduce_dtype.itemsize
    num_gathers = (1 + int(group.settings.reshard_after_forward)) if shard.size > 1 else 0
    logger.debug(
        "unit %s bytes per step: all-gather %d (%d calls), reduce-scatter %d, all-reduce %d",
        group.spec.name,
        gather_bytes * num_gathers,
        num_gathers,
        reduce_bytes * shard.size if shard.size > 1 and grad_numel else 0,
        reduce_bytes if replicate.size > 1 and grad_numel else 0,
    )
