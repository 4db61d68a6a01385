"""What state dicts return, per unit: the type and configs set by ``set_state_dict_type``.

Both front ends share these settings: ``fully_shard`` modules and wrappers
alike answer ``module.state_dict()`` in the form set for their unit.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn as nn

from .._core.manage import states_below
from .._core.step import ModuleState
from .._core.unit import buffer_param
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
