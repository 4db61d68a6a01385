"""The wrapper's flat parameter (``use_orig_params=False``) in model state dicts:
saved and loaded as itself in LOCAL state dicts only; in FULL and SHARDED ones
the original parameters' keys carry its values.

[Note: Local flat parameters]
FSDP1 saves a unit's flat parameter as a 1-D ShardedTensor over the
concatenation of the unit's parameters (flattened, in order, without
padding), each rank holding its equal-sized contiguous part. Ours is laid out
so (see [Note: Flat layout] in _core/layout.py): the ShardedTensor is the flat
shard without its end padding (a view, no copy), so
``torch.distributed.checkpoint`` reads it back at any world size, a dict of
another layout loads by assembling it, and a plain tensor (this rank's padded
flat shard) loads as it is.

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

from .._core.step import ModuleState
from .._core.unit import ParamGroup
from ..api import StateDictType
from .model import UnitStateDict, unit_record
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
    settings = record.model_settings
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
    if record.model_settings.state_dict_type is not StateDictType.LOCAL_STATE_DICT:
        # The original parameters' keys carry the values; keep nn.Module from
        # reporting the flat parameter missing (a copy onto itself).
        state_dict[key] = param.detach()
    elif isinstance(state_dict.get(key), ShardedTensor):
        state_dict[key] = flat_shard_from(unit, state_dict[key], param.detach())


def _flat_layout(unit: ParamGroup, chunk: int, device: torch.device) -> tuple[list[ShardMetadata], int]:
    """Under FSDP1's flat layout (see [Note: Flat layout] in _core/layout.py): every rank's one
    contiguous shard of the concatenation, and how many of this rank's elements are not padding."""
    shard, total = unit.spec.mesh_info.shard, _total_numel(unit)
    group = _shard_group(unit)
    metadata = [
        shard_entry([r * chunk], [min(chunk, total - r * chunk)], dist.get_global_rank(group, r), device)
        for r in range(shard.size)
        if r * chunk < total
    ]
    return metadata, max(0, min(chunk, total - shard.rank * chunk))


def _chunk(unit: ParamGroup) -> int:
    layout = unit.spec.shard_layout
    if not layout.flat:  # the wrapper lays every use_orig_params=False unit out flat
        raise AssertionError(f"rank {dist.get_rank()}: {unit.spec.name}'s flat parameter is not laid out flat")
    return layout.flat_chunk


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
    entries, valid = _flat_layout(unit, _chunk(unit), flat.device)
    return sharded_tensor(
        torch.Size([_total_numel(unit)]), flat.dtype, entries, [flat[:valid]] if valid else [], _shard_group(unit)
    )


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
    chunk = _chunk(unit)
    entries, valid = _flat_layout(unit, chunk, like.device)
    if same_shards(entries, value.metadata().shards_metadata):
        local = value.local_shards()
        if local:
            flat[:valid].copy_(local[0].tensor)
    else:
        start = unit.spec.mesh_info.shard.rank * chunk
        flat[:valid].copy_(full_tensor(value)[start : start + valid])
    return flat
