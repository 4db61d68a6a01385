"""FSDP1's sharded values without a device mesh: torch's ``ShardedTensor``.

[Note: ShardedTensor form]
An FSDP1 wrapper built without ``device_mesh`` saves SHARDED model and
optimizer state dicts as ``ShardedTensor``s, one with a mesh as DTensors. The
ShardedTensor cuts the global tensor along dim 0 as ``torch.chunk`` does over
the unit's shard group (the whole group under NO_SHARD): chunks of
``ceil(rows / world)`` rows, one shard per rank that has a chunk, none on the
ranks past the last one. That is our row layout (DTensor ``Shard(0)``), so a
rank's shard is its DTensor's local rows: no copy, no communication. Values a
ShardedTensor cannot express (tensor-parallel placements, scalars) stay DTensors.

Loading takes either form: a ShardedTensor laid out as ours is read as the
DTensor it came from; any other layout is first assembled in full.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.placement_types import Shard as ShardPlacement

from .._core import comm
from .._core.gather import ShardParam


def as_sharded_tensor(value: DTensor) -> torch.Tensor:
    """``value`` (laid out like a unit's shard) as FSDP1's ShardedTensor; see [Note: ShardedTensor form]."""
    placements = value.placements
    split = [axis for axis, p in enumerate(placements) if not p.is_replicate()]
    if value.dim() == 0 or len(split) > 1 or (split and placements[split[0]] != ShardPlacement(0)):
        return value  # tensor parallel (or a scalar): only a DTensor says how it is laid out
    if not split and value.device_mesh.ndim != 1:
        return value
    axis = split[0] if split else 0
    mesh = value.device_mesh
    group, rank, world = mesh.get_group(axis), mesh.get_local_rank(axis), mesh.size(axis)
    local = value._local_tensor
    if not split:  # replicated (NO_SHARD): this rank's chunk of its full copy
        chunks = local.chunk(world)
        local = chunks[rank] if rank < len(chunks) else local.narrow(0, 0, 0)
    metadata = _chunk_metadata(value.shape, group, local.device)
    own = [m for m in metadata if _rank_of(m) == dist.get_rank()]
    return sharded_tensor(value.shape, value.dtype, metadata, [local] if own else [], group)


def sharded_tensor(
    size: torch.Size,
    dtype: torch.dtype,
    metadata: list[ShardMetadata],
    local: list[torch.Tensor],
    group: dist.ProcessGroup,
) -> ShardedTensor:
    """A ShardedTensor from every rank's shard metadata (the same on each rank: no communication) and
    this rank's shards, in the order ``metadata`` lists them."""
    own = [m for m in metadata if _rank_of(m) == dist.get_rank()]
    if len(own) != len(local):
        raise AssertionError(f"rank {dist.get_rank()}: {len(local)} local shards for {len(own)} shard entries")
    properties = TensorProperties(
        dtype=dtype,
        layout=torch.strided,
        requires_grad=False,
        memory_format=torch.contiguous_format,
        pin_memory=bool(local) and local[0].is_pinned(),
    )
    shards = [Shard(tensor.contiguous(), entry) for tensor, entry in zip(local, own)]
    return ShardedTensor._init_from_local_shards_and_global_metadata(
        shards, ShardedTensorMetadata(metadata, size, properties), process_group=group
    )


def shard_entry(offsets: list[int], sizes: list[int], global_rank: int, device: torch.device) -> ShardMetadata:
    """The metadata of one shard held by ``global_rank`` (``device``: this rank's)."""
    return ShardMetadata(offsets, sizes, f"rank:{global_rank}/{_device_of(global_rank, device)}")


def _rank_of(entry: ShardMetadata) -> int | None:
    return entry.placement.rank() if entry.placement is not None else None


def as_fsdp1_optim_state(value: DTensor, flat: bool) -> torch.Tensor:
    """An optimizer state in FSDP1's sharded form: a ShardedTensor, except a replicated (NO_SHARD)
    state of a unit without a flat parameter (``use_orig_params=True``), which FSDP1 hands out whole."""
    if not flat and all(p.is_replicate() for p in value.placements):
        return value._local_tensor
    return as_sharded_tensor(value)


def _chunk_metadata(size: torch.Size, group: dist.ProcessGroup, device: torch.device) -> list[ShardMetadata]:
    """One entry per ``torch.chunk`` chunk of ``size`` over ``group``'s ranks, in rank order."""
    chunks = torch.empty(size, device="meta").chunk(group.size())
    metadata, offset = [], 0
    for group_rank, chunk in enumerate(chunks):
        offsets = [offset] + [0] * (len(size) - 1)
        metadata.append(shard_entry(offsets, list(chunk.shape), dist.get_global_rank(group, group_rank), device))
        offset += chunk.shape[0]
    return metadata


def _device_of(global_rank: int, local_device: torch.device) -> torch.device:
    """Where ``global_rank``'s shard lives: this rank's own device, or (accelerators) the one
    its local rank has, as FSDP1 assumes."""
    if global_rank == dist.get_rank() or local_device.type == "cpu":
        return local_device
    count = torch.get_device_module(local_device.type).device_count()
    return torch.device(local_device.type, global_rank % max(count, 1))


def loadable(value: torch.Tensor, param: ShardParam) -> torch.Tensor:
    """A saved value ``param.shard_from_full`` takes: a ShardedTensor becomes a DTensor
    (laid out as ``param``: its shard, no communication) or the full tensor."""
    if not isinstance(value, ShardedTensor):
        return value
    if param.flat_ranges is not None:  # a piece of the flat shard: cut from the full value
        return full_tensor(value)
    like = param.shard_as_dtensor()
    sharded = any(not p.is_replicate() for p in like.placements)  # replicated: the full value is needed
    if sharded and tuple(like.placements) == tuple(param.mesh_info.dp_placements):
        mine = as_sharded_tensor(like)
        if isinstance(mine, ShardedTensor) and _same_layout(mine, value):
            shards = value.local_shards()
            mine_local = like._local_tensor
            local = shards[0].tensor if shards else mine_local.new_empty(mine_local.shape)
            # Where and as the shard is (a saved dict may be offloaded to the CPU).
            return param.dtensor_from_rows(local.to(device=mine_local.device, dtype=mine_local.dtype))
    return full_tensor(value)


def _same_layout(a: ShardedTensor, b: ShardedTensor) -> bool:
    # Metadata only: a ShardedTensor's tensor methods warn that torch deprecates the class.
    first, second = a.metadata(), b.metadata()
    return first.size == second.size and same_shards(first.shards_metadata, second.shards_metadata)


def same_shards(a: list[ShardMetadata], b: list[ShardMetadata]) -> bool:
    """Whether two layouts cut the same regions for the same ranks (devices aside)."""

    def key(metadata: list[ShardMetadata]) -> list[tuple]:
        return [(m.shard_offsets, m.shard_sizes, _rank_of(m)) for m in metadata]

    return key(a) == key(b)


def full_tensor(value: ShardedTensor) -> torch.Tensor:
    """The global tensor on every rank of ``value``'s group (a collective): each writes its shards, one sum."""
    shards = value.local_shards()
    group = value._process_group
    device = comm.device_for(group, shards[0].tensor.device) if shards else comm.backend_device(group)
    metadata = value.metadata()  # not value.size(): its tensor methods warn that torch deprecates the class
    full = torch.zeros(metadata.size, dtype=metadata.tensor_properties.dtype, device=device)
    for shard in shards:
        region = full
        for dim, (offset, length) in enumerate(zip(shard.metadata.shard_offsets, shard.metadata.shard_sizes)):
            region = region.narrow(dim, offset, length)
        region.copy_(shard.tensor)
    comm.all_reduce(full, group, dist.ReduceOp.SUM, async_op=False)
    return full
