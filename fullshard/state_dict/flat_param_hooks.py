"""The wrapper's flat parameter (``use_orig_params=False``) in model state dicts:
saved and loaded as itself in LOCAL state dicts only; in FULL and SHARDED ones
the original parameters' keys carry its values.

[Note: Local flat parameters]
FSDP1 saves a unit's flat parameter as a 1-D ShardedTensor over the
concatenation of the unit's parameters (flattened, in order, without
padding), each rank holding its equal-sized contiguous part. Our flat shard
holds each parameter's rows, padded per parameter, so a rank's elements of that
same concatenation are one contiguous range per parameter: the ShardedTensor
has one local shard per parameter with rows here (views of the flat shard, no
copy). Its global tensor is FSDP1's (same size, same values), so
``torch.distributed.checkpoint`` reads it back at any world size and a dict of
another layout (FSDP1's own) loads by assembling it; a plain tensor (this
rank's padded flat shard) loads as before.

The wrapper hands the parameter and where it is registered: this module does
not know the flat parameter's class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed._shard.sharding_spec import ShardMetadata

from .._core import full_params
from .._core.group import ParamGroup
from .._core.state import ModuleState
from ..api import StateDictType
from .settings import UnitStateDict, unit_record
from .sharded_tensor import full_tensor, same_shards, shard_entry, sharded_tensor


def install_flat_param_hooks(state: ModuleState, home: nn.Module, name: str, param: nn.Parameter) -> None:
    """Hooks on ``home``, the module ``param`` (``state``'s unit's flat parameter) is registered on as ``name``."""
    record = unit_record(state)
    if state.group is None:
        raise AssertionError(f"rank {dist.get_rank()}: a flat parameter without a unit")
    unit = state.group
    home.register_state_dict_post_hook(functools.partial(_save_flat_param, unit, name, param, record))
    home.register_load_state_dict_pre_hook(functools.partial(_load_flat_param, unit, name, param, record))


def _save_flat_param(
    unit: ParamGroup,
    name: str,
    param: nn.Parameter,
    record: UnitStateDict,
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    _: Any,
) -> None:
    key = prefix + name
    settings = record.model_settings()
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        value = param.detach()
        state_dict[key] = flat_sharded_tensor(unit, value.cpu() if settings.state_dict_config.offload_to_cpu else value)
    else:
        state_dict.pop(key, None)


def _load_flat_param(
    unit: ParamGroup,
    name: str,
    param: nn.Parameter,
    record: UnitStateDict,
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    *_: Any,
) -> None:
    key = prefix + name
    if record.model_settings().state_dict_type is not StateDictType.LOCAL_STATE_DICT:
        # The original parameters' keys carry the values; keep nn.Module from
        # reporting the flat parameter missing (a copy onto itself).
        state_dict[key] = param.detach()
    elif isinstance(state_dict.get(key), ShardedTensor):
        state_dict[key] = flat_shard_from(unit, state_dict[key], param.detach())


def _layout(unit: ParamGroup, device: torch.device) -> tuple[list[ShardMetadata], list[int]]:
    """Every rank's shards of the unit's concatenated parameters (see [Note: Local flat parameters]),
    and the index of the parameter behind each of this rank's, in order."""
    shard = unit.spec.mesh_info.shard
    group = _shard_group(unit)
    metadata: list[ShardMetadata] = []
    mine: list[int] = []
    for group_rank in range(shard.size):
        global_rank = dist.get_global_rank(group, group_rank)
        offset = 0
        for index, p in enumerate(unit.spec.params):
            first_row = min(group_rank * p.shard_rows, p.num_rows)
            rows = min(p.shard_rows, p.num_rows - first_row)
            if rows > 0:
                start = offset + first_row * p.row_numel
                metadata.append(shard_entry([start], [rows * p.row_numel], global_rank, device))
                if group_rank == shard.rank:
                    mine.append(index)
            offset += p.num_rows * p.row_numel
    return metadata, mine


def _shard_group(unit: ParamGroup) -> dist.ProcessGroup:
    group = unit.spec.mesh_info.shard.group
    if group is None:  # only a one-rank shard group has none, and its units save full state dicts
        raise AssertionError(f"rank {dist.get_rank()}: {unit.spec.name} is sharded over no process group")
    return group


def _total_numel(unit: ParamGroup) -> int:
    return sum(p.num_rows * p.row_numel for p in unit.spec.params)


def flat_sharded_tensor(unit: ParamGroup, flat: torch.Tensor) -> ShardedTensor:
    """``flat`` (this rank's flat shard, or a tensor laid out like it) as the ShardedTensor of
    [Note: Local flat parameters]: views, no copy."""
    metadata, mine = _layout(unit, flat.device)
    local = [full_params.read_shard(unit, index, flat)._local_tensor.reshape(-1) for index in mine]
    return sharded_tensor(torch.Size([_total_numel(unit)]), flat.dtype, metadata, local, _shard_group(unit))


def flat_shard_from(unit: ParamGroup, value: ShardedTensor, like: torch.Tensor) -> torch.Tensor:
    """This rank's flat shard (laid out like ``like``) from a saved flat ShardedTensor: its own
    shards when laid out as ours, else cut from the assembled global tensor (a collective).

    Raises:
        ValueError: its size is not the unit's total number of elements.
    """
    total = _total_numel(unit)
    size = tuple(value.metadata().size)  # metadata: its tensor methods warn that torch deprecates the class
    if size != (total,):
        raise ValueError(
            f"loading the flat parameter of {unit.spec.name} expects a ShardedTensor of {total} elements (its "
            f"parameters' total) but got {size}; save and load with the same wrapping"
        )
    flat = torch.zeros_like(like)
    metadata, mine = _layout(unit, like.device)
    if same_shards(metadata, value.metadata().shards_metadata):
        by_offset = {shard.metadata.shard_offsets[0]: shard.tensor for shard in value.local_shards()}
        own = [m for m in metadata if m.placement is not None and m.placement.rank() == dist.get_rank()]
        for index, entry in zip(mine, own):
            full_params.write_shard(unit, index, by_offset[entry.shard_offsets[0]], into=flat)
        return flat
    whole = full_tensor(value)
    offset = 0
    for index, p in enumerate(unit.spec.params):
        region = whole.narrow(0, offset, p.num_rows * p.row_numel).view(p.unsharded_size)
        full_params.write_shard(unit, index, p.rows_per_rank(region)[unit.spec.mesh_info.shard.rank], into=flat)
        offset += p.num_rows * p.row_numel
    return flat
