"""Model state dicts: what form each unit answers in (``set_state_dict_type``,
``state_dict_type``, ``full_state_dict``; the same settings for ``fully_shard``
modules and wrappers) and the hooks that make each unit's modules save and load
full, sharded or local values in it under the unsharded model's keys.

[Note: State dict hooks]
``module.state_dict()`` walks the module tree; hooks make each unit answer in
the requested form without any special entry point:
  - a pre-save hook on the unit's module reshards it and, for FULL, gathers the
    unit's parameters once (one all-gather per unit, so a full state dict is
    built unit by unit: rank 0 never holds more than the full model plus one
    unit);
  - a post-save hook on every module holding managed parameters writes each
    of them under its own name (a DTensor for SHARDED, or FSDP1's ShardedTensor
    for a wrapper without a device mesh; the full tensor for FULL), so tied
    parameters appear under every name, like nn.Module's;
  - the wrapper's flat parameter appears only in LOCAL state dicts, cast
    buffers in their original dtype (in LOCAL ones, as FSDP1's, in the dtype
    the unit computes with);
  - load pre-hooks do the reverse: a parameter's value (full, DTensor or
    ShardedTensor, any layout) becomes this rank's rows, written into the
    unit's shard buffer.
The FSDP1 wrapper additionally removes (and on load re-inserts) its
``_fsdp_wrapped_module.`` prefix: keys look like the unsharded model's.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor

from .._core import comm
from .._core.common import TrainingState
from .._core.manage import states_below
from .._core.step import ModuleState
from .._core.unit import ParamGroup, buffer_param, full_params
from .._names import WRAPPER_PREFIX, model_name
from ..api import (
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    OptimStateDictConfig,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .sharded_tensor import as_sharded_tensor, loadable

_DEFAULT_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_settings(state_dict_type: StateDictType) -> StateDictSettings:
    config, optim_config = _DEFAULT_CONFIGS[state_dict_type]
    return StateDictSettings(state_dict_type, config(), optim_config())


_ALWAYS_FULL = default_settings(StateDictType.FULL_STATE_DICT)


class UnitStateDict:
    """What state dicts keep per unit, next to the engine's ``ModuleState``.

    Args:
        settings: what ``set_state_dict_type`` set (``settings``; setting it fixes ``model_settings``).
        always_full: FSDP1's NO_SHARD units: their model state dicts are full whatever type is
            set (FSDP1 warns so too).
        sharded_tensors: FSDP1 wrappers built without a device mesh: SHARDED values are
            ShardedTensors (see [Note: ShardedTensor form] in sharded_tensor.py), else DTensors.
    """

    def __init__(self, settings: StateDictSettings, always_full: bool = False, sharded_tensors: bool = False) -> None:
        self.full_values: list[torch.Tensor] | None = None  # the unit's full parameters while a FULL save runs
        self.always_full = always_full
        self.sharded_tensors = sharded_tensors
        self.settings = settings

    @property
    def settings(self) -> StateDictSettings:
        return self._settings

    @settings.setter
    def settings(self, settings: StateDictSettings) -> None:
        self._settings = settings
        # The form this unit's model state dict takes (a FULL type's own configs are kept): fixed when
        # the type is set, read as a plain attribute by every state-dict hook.
        full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
        self.model_settings = _ALWAYS_FULL if self.always_full and not full else settings


# Keyed weakly by the engine state: the record holds no reference back to it.
_UNITS: weakref.WeakKeyDictionary[ModuleState, UnitStateDict] = weakref.WeakKeyDictionary()


def register_unit(
    state: ModuleState, settings: StateDictSettings, always_full: bool = False, sharded_tensors: bool = False
) -> UnitStateDict:
    """Starts ``state``'s record with ``settings`` (when its unit is made)."""
    record = _UNITS[state] = UnitStateDict(settings, always_full=always_full, sharded_tensors=sharded_tensors)
    return record


def unit_record(state: ModuleState) -> UnitStateDict:
    return _UNITS[state]


def rank0_only(config: StateDictConfig | OptimStateDictConfig) -> bool:
    return isinstance(config, (FullStateDictConfig, FullOptimStateDictConfig)) and config.rank0_only


def set_state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> StateDictSettings:
    """Sets what ``state_dict()`` (and ``optim_state_dict``) return for every unit in
    ``module``'s tree, for ``fully_shard`` modules and wrappers alike.

    Returns:
        The previous settings (of the first unit found).

    Raises:
        ValueError: ``module`` contains no unit.
        RuntimeError: a config does not match the type (as PyTorch's FSDP).
    """
    states = states_below(module)
    if not states:
        raise ValueError(
            f"set_state_dict_type expects a module containing fully_shard or FullyShardedDataParallel "
            f"units, but {type(module).__name__} has none"
        )
    expected_config, expected_optim = _DEFAULT_CONFIGS[state_dict_type]
    config = state_dict_config or expected_config()
    optim_config = optim_state_dict_config or expected_optim()
    if not isinstance(config, expected_config):
        raise RuntimeError(
            f"set_state_dict_type expects state_dict_config of type {expected_config.__name__} for "
            f"{state_dict_type.name} but got {type(config).__name__}"
        )
    if not isinstance(optim_config, expected_optim):
        raise RuntimeError(
            f"set_state_dict_type expects optim_state_dict_config of type {expected_optim.__name__} for "
            f"{state_dict_type.name} but got {type(optim_config).__name__}"
        )
    if state_dict_type is StateDictType.LOCAL_STATE_DICT:
        for state in states:
            if state.group is not None and buffer_param(state.group) is None:
                raise NotImplementedError(
                    "LOCAL_STATE_DICT is not yet supported with per-parameter shards (fully_shard or "
                    "use_orig_params=True): it is the flat shard of use_orig_params=False; use "
                    "SHARDED_STATE_DICT, whose DTensors carry their layout"
                )
    previous = unit_record(states[0]).settings
    for state in states:
        unit_record(state).settings = StateDictSettings(state_dict_type, config, optim_config)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings of the first unit in ``module``'s tree."""
    states = states_below(module)
    if not states:
        raise ValueError(f"get_state_dict_type expects a module containing units, but {type(module).__name__} has none")
    return unit_record(states[0]).settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """``set_state_dict_type`` for the block, then the previous settings again."""
    previous = {id(s): unit_record(s).settings for s in states_below(module)}
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for state in states_below(module):
            record = unit_record(state)
            record.settings = previous.get(id(state), record.settings)


def full_state_dict(module: nn.Module, rank0_only: bool = False, offload_to_cpu: bool = False) -> dict[str, Any]:
    """The full (unsharded) state dict of a sharded model, keyed like the unsharded model.

    A collective: every rank must call it. With ``rank0_only``, the other ranks get ``{}``.
    """
    config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
    with state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
        return module.state_dict()


def install_state_dict_hooks(
    state: ModuleState, settings: StateDictSettings, always_full: bool = False, sharded_tensors: bool = False
) -> None:
    """Registers the hooks of [Note: State dict hooks] for one unit; ``always_full``: its model state dicts
    are full whatever type is set, with a warning (FSDP1's NO_SHARD units); ``sharded_tensors``: its
    sharded values are ShardedTensors (FSDP1 without a device mesh, see [Note: ShardedTensor form])."""
    record = register_unit(state, settings, always_full, sharded_tensors)
    group = state.group
    if group is not None:
        for unit_module in state.modules:  # several for fully_shard([a, b]): each subtree saves between its hooks
            unit_module.register_state_dict_pre_hook(functools.partial(_gather_unit, group, record))
            # Before the parameters' load hooks below: they see the sharded registration.
            unit_module.register_load_state_dict_pre_hook(functools.partial(_prepare_load, group, record))
            # An assigning load (torch's set_model_state_dict into a meta model) registers new
            # parameters: they become the shards now, not only at the root's lazy init.
            unit_module.register_load_state_dict_post_hook(functools.partial(_adopt_loaded, group))
        by_module: dict[nn.Module, list[tuple[str, int]]] = {}
        for index, param in enumerate(group.spec.params):
            for module, name in param.module_info.owners():
                by_module.setdefault(module, []).append((name, index))
        for module, entries in by_module.items():
            module.register_state_dict_post_hook(functools.partial(_save_params, group, record, entries))
            module.register_load_state_dict_pre_hook(functools.partial(_load_params, group, record, entries))
        # After the hooks above: the unit module's own parameters are written
        # before its gathered values are dropped.
        for unit_module in state.modules:
            unit_module.register_state_dict_post_hook(functools.partial(_release_unit, record))
    if state.buffer_dtypes:
        for module in state.module.modules():
            if any(id(b) in state.buffer_dtypes for b in module._buffers.values() if b is not None):
                module.register_state_dict_post_hook(functools.partial(_save_buffers_in_original_dtype, state))


def install_prefix_hooks(wrapper: nn.Module) -> None:
    """Keys of the wrapper's subtree without (and, loading, with) ``_fsdp_wrapped_module.``;
    the keys a load reports missing or unexpected without it too."""
    wrapper.register_state_dict_post_hook(_strip_wrapper_prefix)
    wrapper.register_load_state_dict_pre_hook(_add_wrapper_prefix)
    wrapper.register_load_state_dict_post_hook(_strip_reported_prefix)


def _reshard_unit(group: ParamGroup, *args: Any) -> None:
    """Outside forward and backward, a unit may still be unsharded (the root after a
    forward without backward, e.g. under ``torch.no_grad()``): state dicts read and
    write the shards."""
    if group.training_state is TrainingState.IDLE:
        group.reshard()


def _prepare_load(group: ParamGroup, record: UnitStateDict, *args: Any) -> None:
    _warn_if_always_full(record)
    _reshard_unit(group)


def _adopt_loaded(group: ParamGroup, module: nn.Module, incompatible_keys: Any) -> None:
    group.adopt_registered(whole_only=True)  # a load of some parameters waits for the rest


def _warn_if_always_full(record: UnitStateDict) -> None:
    if record.always_full:
        warnings.warn(
            "a FullyShardedDataParallel unit with ShardingStrategy.NO_SHARD saves and loads full state dicts, "
            f"whatever type is set (now {record.settings.state_dict_type.name}), as FSDP1's do",
            UserWarning,
            stacklevel=4,
        )


def _gather_unit(group: ParamGroup, record: UnitStateDict, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _warn_if_always_full(record)
    _reshard_unit(group)
    kind = record.model_settings.state_dict_type
    # A flat piece's sharded value is cut from the full one (see [Note: Flat layout] in _core/layout.py).
    flat_sharded = kind is StateDictType.SHARDED_STATE_DICT and group.spec.shard_layout.flat
    if kind is StateDictType.FULL_STATE_DICT or flat_sharded:
        record.full_values = full_params.gather_full_values(group)


def _release_unit(record: UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    record.full_values = None
    settings = record.model_settings
    if (
        settings.state_dict_type is StateDictType.FULL_STATE_DICT
        and rank0_only(settings.state_dict_config)
        and dist.get_rank() != 0
    ):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]


def _save_params(
    group: ParamGroup,
    record: UnitStateDict,
    entries: list[tuple[str, int]],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    metadata: Any,
) -> None:
    settings = record.model_settings
    kind, offload = settings.state_dict_type, settings.state_dict_config.offload_to_cpu
    for name, index in entries:
        key = prefix + name
        param = group.spec.params[index]
        if kind is StateDictType.LOCAL_STATE_DICT:
            state_dict.pop(key, None)
            continue
        value: torch.Tensor
        if kind is StateDictType.SHARDED_STATE_DICT:
            # Each value owns its memory, as FSDP1's do: views of one shard buffer would make the dict
            # fail ``copy.deepcopy`` (DTensors sharing a storage cannot be deep-copied).
            if param.flat_ranges is None:
                local = param.bound_rows  # what the unit's buffer holds, as FULL values are gathered from it
            else:
                local = full_params.row_shard(param, _gathered(record, key)[index])._local_tensor
            value = param.dtensor_from_rows(local.cpu() if offload and local.device.type != "cpu" else local.clone())
            if record.sharded_tensors:
                value = as_sharded_tensor(value)
        else:
            value = param.full_from_tp_local(_gathered(record, key)[index])
            if isinstance(value, DTensor):  # tensor parallel: the global tensor
                value = comm.full_tensor(value)
            if offload:
                value = value.cpu()
        state_dict[key] = value


def _gathered(record: UnitStateDict, key: str) -> list[torch.Tensor]:
    if record.full_values is None:  # set by _gather_unit, the unit module's pre-hook
        raise AssertionError(f"rank {dist.get_rank()}: {key} is saved before its unit was gathered")
    return record.full_values


def _save_buffers_in_original_dtype(
    state: ModuleState, module: nn.Module, state_dict: dict, prefix: str, metadata: Any
) -> None:
    if unit_record(state).model_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        return  # as FSDP1: a local state dict holds the buffers as the unit computes with them
    for name, buffer in module._buffers.items():
        key = prefix + name
        if buffer is not None and id(buffer) in state.buffer_dtypes and key in state_dict:
            state_dict[key] = buffer.detach().to(state.buffer_dtypes[id(buffer)])


def _load_params(
    group: ParamGroup,
    record: UnitStateDict,
    entries: list[tuple[str, int]],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    metadata: Any,
    strict: bool,
    missing_keys: list[str],
    unexpected_keys: list[str],
    error_msgs: list[str],
) -> None:
    if record.model_settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        return  # the flat parameter carries the values
    for name, index in entries:
        key = prefix + name
        param = group.spec.params[index]
        if key not in state_dict:
            if not param.register_sharded:  # not a registered parameter: nn.Module would not notice
                missing_keys.append(key)
            continue
        value = loadable(state_dict[key], param)
        if param.extension is not None:
            _copy_subclass_parts(param.local_shard, param.shard_from_full(value)._local_tensor)
            state_dict[key] = param.sharded_param  # nn.Module's copy is then of the shard onto itself
        elif param.register_sharded:
            # nn.Module copies it into the registered shard
            state_dict[key] = param.present(param.shard_from_full(value)._local_tensor)
        else:
            full_params.write_shard(group, index, full_params.local_part(param, value))
            del state_dict[key]


def _copy_subclass_parts(target: torch.Tensor, source: torch.Tensor) -> None:
    """Writes a tensor-subclass shard part by part when ``source`` has the same parts: a subclass's
    own ``copy_`` may judge two shards of one layout different (torchao's NF4 compares a block count
    that its split leaves stale) and then re-quantize, which changes the values (or fails)."""
    names, _ = target.__tensor_flatten__()  # type: ignore[attr-defined]
    parts = [(getattr(target, name), getattr(source, name, None)) for name in names]
    if type(source) is type(target) and all(
        isinstance(part, torch.Tensor) and part.shape == mine.shape and part.dtype == mine.dtype for mine, part in parts
    ):
        with torch.no_grad():
            for mine, part in parts:
                mine.copy_(part)
        return
    with torch.no_grad():
        target.copy_(source)


def _strip_wrapper_prefix(module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    inner = prefix + WRAPPER_PREFIX
    for key in [k for k in state_dict if k.startswith(inner)]:
        state_dict[prefix + key[len(inner) :]] = state_dict.pop(key)


def _add_wrapper_prefix(module: nn.Module, state_dict: dict, prefix: str, *args: Any) -> None:
    inner = prefix + WRAPPER_PREFIX
    for key in [k for k in state_dict if k.startswith(prefix) and not k.startswith(inner)]:
        state_dict[inner + key[len(prefix) :]] = state_dict.pop(key)


def _strip_reported_prefix(module: nn.Module, incompatible_keys: Any) -> None:
    for keys in (incompatible_keys.missing_keys, incompatible_keys.unexpected_keys):
        keys[:] = [model_name(key) for key in keys]
