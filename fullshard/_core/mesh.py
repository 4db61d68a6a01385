"""Which ranks a unit shards over and which it replicates over.

[Note: Mesh roles]
A data-parallel mesh plays up to two roles:
  - shard: parameters are split on dim 0 across these ranks (all-gather before
    use, reduce-scatter of gradients);
  - replicate: every rank holds the same shard (all-reduce of gradients).
1-D mesh -> shard only (FSDP). 2-D mesh (replicate, shard) -> both (HSDP).
``replicate()`` -> a 1-D mesh in the replicate role only (DDP). A role whose
size is 1 costs nothing: no collective is issued for it. The degenerate HSDP
mesh (n, 1) therefore still all-reduces across its n replicas.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import Placement, Replicate, Shard

from . import comm
from .comm import GroupInfo


def axis_group(mesh: DeviceMesh, axis: int | None) -> GroupInfo:
    """The group of ``mesh``'s dim ``axis`` and this rank's place in it; no axis: this rank alone."""
    if axis is None:
        return GroupInfo(None, 1, 0)
    return GroupInfo(mesh.get_group(axis), mesh.size(axis), mesh.get_local_rank(axis))


class MeshInfo:
    """A data-parallel mesh and its roles. See [Note: Mesh roles]."""

    def __init__(self, mesh: DeviceMesh, shard_axis: int | None, replicate_axis: int | None):
        self.mesh = mesh
        self.shard_axis = shard_axis
        self.replicate_axis = replicate_axis
        self.shard = axis_group(mesh, shard_axis)
        self.replicate = axis_group(mesh, replicate_axis)
        # Facts every unit and parameter over this mesh reads, fixed once: the device its tensors live
        # on, and a plain (non-TP) parameter shard's placements.
        self.device = device_of_mesh(mesh)
        self.dp_placements: tuple[Placement, ...] = (Replicate(),)
        if shard_axis is not None:
            self.dp_placements = (Replicate(), Shard(0)) if replicate_axis is not None else (Shard(0),)

    @staticmethod
    def for_fully_shard(mesh: DeviceMesh) -> MeshInfo:
        return MeshInfo(mesh, shard_axis=mesh.ndim - 1, replicate_axis=0 if mesh.ndim == 2 else None)

    @staticmethod
    def for_replicate(mesh: DeviceMesh) -> MeshInfo:
        return MeshInfo(mesh, shard_axis=None, replicate_axis=0)

    def __repr__(self) -> str:
        return f"MeshInfo(shard={self.shard.size}, replicate={self.replicate.size})"


def device_of_mesh(mesh: DeviceMesh) -> torch.device:
    """The device a mesh's tensors live on (the current device for accelerators)."""
    if mesh.device_type == "cpu":
        return torch.device("cpu")
    module = getattr(torch, mesh.device_type, None)
    if module is not None and hasattr(module, "current_device") and module.is_available():
        return torch.device(mesh.device_type, module.current_device())
    return torch.device(mesh.device_type)


def default_device_type() -> str:
    """Where a front end computes when the user names no device or mesh: CUDA when
    this process sees a GPU, else CPU (as torch's FSDP). The one place that decides."""
    return "cuda" if torch.cuda.is_available() else "cpu"


def default_mesh(device_type: str | None, api: str) -> DeviceMesh:
    """A 1-D mesh over all ranks, on ``device_type`` (default: the accelerator, else CPU)."""
    if not dist.is_initialized():
        raise RuntimeError(
            f"{api} expects torch.distributed to be initialized (call "
            "torch.distributed.init_process_group) or an explicit mesh"
        )
    device_type = device_type or default_device_type()
    # The mesh's rank tensor must be a real CPU tensor even under a
    # `with torch.device("meta")` model-construction context.
    with torch.device("cpu"):
        return init_device_mesh(device_type, (dist.get_world_size(),))


def describe_mesh(mesh: DeviceMesh) -> str:
    return f"DeviceMesh({mesh.mesh.tolist()})"


def validate_mesh_backend(mesh_info: MeshInfo, owner: str, api: str) -> None:
    """Each of the mesh's groups must communicate natively on the mesh's device.

    Raises:
        ValueError: a CPU mesh over NCCL (no CPU collectives: it would fail in the
            first all-gather), or an accelerator mesh over gloo (host-staged, and
            the engine's collectives would all run through it).
    """
    kind = mesh_info.mesh.device_type
    for info in (mesh_info.shard, mesh_info.replicate):
        if info.group is None or _communicates_natively(info.group, kind):
            continue
        backend = dist.get_backend(info.group)
        fix = (
            "pass mesh=init_device_mesh('cuda', ...) to train on the GPU, or init_process_group('gloo') for CPU"
            if kind == "cpu"
            else "init_process_group('nccl') to train on the GPU, or pass mesh=init_device_mesh('cpu', ...) for CPU"
        )
        raise ValueError(
            f"{api} expects a mesh whose process group communicates on its device, but {owner} got a "
            f"{kind} mesh over the {backend} backend; {fix}"
        )


def _communicates_natively(group: dist.ProcessGroup, device_type: str) -> bool:
    """Whether ``group`` communicates on ``device_type`` natively: through the backend
    a mixed string names for it, else through a backend whose own device it is (NCCL
    for CUDA; gloo takes CUDA tensors only by staging them in host memory)."""
    backend = str(dist.get_backend(group)).lower()
    if ":" in backend:
        named = dict(part.split(":") for part in backend.split(","))
        backend = named.get(device_type, "")
    types = dist.Backend.backend_capability.get(backend, [])
    return device_type in types if device_type == "cpu" else types[:1] == [device_type]


def post_forward_group(mesh_info: MeshInfo, reshard_after_forward: int) -> GroupInfo:
    """The smaller group that a unit reshards to after forward (int reshard).

    Ranks are cut into consecutive blocks of ``reshard_after_forward`` along the
    shard axis (consecutive ranks usually share a node). The groups are built
    once per (mesh, size) and kept on the mesh object: every unit that asks for
    the same size shares them, and they die with the mesh.
    """
    cache = mesh_info.mesh.__dict__.setdefault("_fullshard_post_forward_meshes", {})
    sub_mesh = cache.get(reshard_after_forward)
    if sub_mesh is None:
        with torch.device("cpu"):
            ranks = mesh_info.mesh.mesh.reshape(-1, reshard_after_forward)
            sub_mesh = DeviceMesh(mesh_info.mesh.device_type, ranks)
        cache[reshard_after_forward] = sub_mesh
    return axis_group(sub_mesh, 1)


def devices_per_node() -> int:
    """Ranks per node: torchrun's LOCAL_WORLD_SIZE, else the local accelerator count.

    Without either (plain CPU processes), every rank counts as one node.
    """
    if "LOCAL_WORLD_SIZE" in os.environ:
        return int(os.environ["LOCAL_WORLD_SIZE"])
    if torch.cuda.is_available():
        return torch.cuda.device_count()
    return dist.get_world_size()


def hybrid_mesh(device_type: str, num_devices_per_node: int | None = None) -> DeviceMesh:
    """A (nodes, ranks per node) mesh over all ranks: shard within a node, replicate across."""
    world = dist.get_world_size()
    per_node = num_devices_per_node or devices_per_node()
    if per_node < 1 or world % per_node != 0:
        raise ValueError(
            f"hybrid sharding expects the world size {world} to be a multiple of the ranks per node "
            f"{per_node} (set LOCAL_WORLD_SIZE or pass num_devices_per_node)"
        )
    with torch.device("cpu"):
        return init_device_mesh(device_type, (world // per_node, per_node), mesh_dim_names=("replicate", "shard"))


def mesh_from_groups(
    shard_group: dist.ProcessGroup, replicate_group: dist.ProcessGroup | None, device_type: str
) -> DeviceMesh:
    """A DeviceMesh over existing groups: 1D from one group, 2D (replicate, shard) from a pair.

    For a pair, every rank contributes its shard group's ranks (one all-gather
    of objects over the default group) so each rank knows the whole 2D layout.

    Raises:
        ValueError: the pair does not tile the world (sizes whose product is not
            the world size, or groups that do not cross exactly at this rank).
    """
    with torch.device("cpu"):
        if replicate_group is None:
            return DeviceMesh.from_group(shard_group, device_type)
        rank, world = dist.get_rank(), dist.get_world_size()
        shard_ranks = dist.get_process_group_ranks(shard_group)
        replicate_ranks = dist.get_process_group_ranks(replicate_group)
        if len(shard_ranks) * len(replicate_ranks) != world:
            raise ValueError(
                f"process_group expects a (shard, replicate) pair whose sizes multiply to the world size "
                f"{world}, but got sizes {len(shard_ranks)} and {len(replicate_ranks)}"
            )
        if set(shard_ranks) & set(replicate_ranks) != {rank}:
            raise ValueError(
                f"process_group expects the shard group {shard_ranks} and the replicate group "
                f"{replicate_ranks} to share exactly this rank ({rank})"
            )
        rows = comm.all_gather_objects((replicate_ranks.index(rank), shard_ranks))
        layout: list[list[int] | None] = [None] * len(replicate_ranks)
        for replica, ranks in rows:
            if layout[replica] not in (None, ranks):
                raise ValueError(
                    f"process_group pairs disagree across ranks: replica {replica} has shard groups "
                    f"{layout[replica]} and {ranks}"
                )
            layout[replica] = ranks
        return DeviceMesh.from_group(
            [replicate_group, shard_group],
            device_type,
            mesh=torch.tensor(layout),
            mesh_dim_names=("replicate", "shard"),
        )
