"""Model and optimizer state dicts: full, sharded and local, for both front ends.

[Note: State dict hooks]
``module.state_dict()`` walks the module tree; hooks make each unit answer in
the requested form without any special entry point:
  - a pre-save hook on the unit's module reshards it and, for FULL, gathers the
    unit's parameters once (one all-gather per unit, so a full state dict is
    built unit by unit: rank 0 never holds more than the full model plus one
    unit);
  - a post-save hook on every module holding managed parameters writes each
    of them under its own name (a DTensor for SHARDED, the full tensor for
    FULL), so tied parameters appear under every name, like nn.Module's;
  - the wrapper's flat parameter appears only in LOCAL state dicts, cast
    buffers in their original dtype;
  - load pre-hooks do the reverse: a parameter's value (full or DTensor, any
    layout) becomes this rank's rows, written into the unit's shard buffer.
The FSDP1 wrapper additionally removes (and on load re-inserts) its
``_fsdp_wrapped_module.`` prefix: keys look like the unsharded model's.

Optimizer state dicts are keyed by parameter FQN. Per-parameter states follow
the model's state-dict type; the wrapper's flat parameters are split into the
original parameters' states (and joined back for loading).

[Note: Model order]
Gathering or re-laying out a state is a collective, so all ranks must treat
the parameters in one order. The optimizer's order is no such order: each rank
may list its parameters differently (param groups built from sets or dicts).
Every optimizer-state call therefore walks ``model.named_parameters()`` and
picks the optimizer's parameters from it; the optimizer's order only decides
how the result's param groups list them.
"""

from __future__ import annotations

import contextlib
import functools
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor, distribute_tensor

from ._core import comm, full_params
from ._core.common import TrainingState
from ._core.group import ParamGroup
from ._core.manage import states_below
from ._core.param import ShardParam
from ._core.state import ModuleState
from ._flat_param import FlatParamView, flat_param, flat_view, param_view_of_flat
from ._names import WRAPPER_PREFIX, model_name
from .api import (
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

__all__ = [
    "full_state_dict",
    "get_state_dict_type",
    "optim_state_dict",
    "optim_state_dict_to_load",
    "set_state_dict_type",
    "state_dict_type",
]

_DEFAULT_CONFIGS: dict[StateDictType, tuple[type[StateDictConfig], type[OptimStateDictConfig]]] = {
    StateDictType.FULL_STATE_DICT: (FullStateDictConfig, FullOptimStateDictConfig),
    StateDictType.SHARDED_STATE_DICT: (ShardedStateDictConfig, ShardedOptimStateDictConfig),
    StateDictType.LOCAL_STATE_DICT: (LocalStateDictConfig, LocalOptimStateDictConfig),
}


def default_settings(state_dict_type: StateDictType) -> StateDictSettings:
    config, optim_config = _DEFAULT_CONFIGS[state_dict_type]
    return StateDictSettings(state_dict_type, config(), optim_config())


@dataclass
class _UnitStateDict:
    """What state dicts keep per unit, next to the engine's ``ModuleState``."""

    settings: StateDictSettings
    full_values: list[torch.Tensor] | None = None  # the unit's full parameters while a FULL save runs


# Keyed weakly by the engine state: the record holds no reference back to it.
_UNITS: weakref.WeakKeyDictionary[ModuleState, _UnitStateDict] = weakref.WeakKeyDictionary()


def _unit(state: ModuleState) -> _UnitStateDict:
    return _UNITS[state]


# -- settings -----------------------------------------------------------------------------------


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
            if state.group is not None and flat_param(state.group) is None:
                raise NotImplementedError(
                    "LOCAL_STATE_DICT is not yet supported with per-parameter shards (fully_shard or "
                    "use_orig_params=True): it is the flat shard of use_orig_params=False; use "
                    "SHARDED_STATE_DICT, whose DTensors carry their layout"
                )
    previous = _unit(states[0]).settings
    for state in states:
        _unit(state).settings = StateDictSettings(state_dict_type, config, optim_config)
    return previous


def get_state_dict_type(module: nn.Module) -> StateDictSettings:
    """The settings of the first unit in ``module``'s tree."""
    states = states_below(module)
    if not states:
        raise ValueError(f"get_state_dict_type expects a module containing units, but {type(module).__name__} has none")
    return _unit(states[0]).settings


@contextlib.contextmanager
def state_dict_type(
    module: nn.Module,
    state_dict_type: StateDictType,
    state_dict_config: StateDictConfig | None = None,
    optim_state_dict_config: OptimStateDictConfig | None = None,
) -> Iterator[None]:
    """``set_state_dict_type`` for the block, then the previous settings again."""
    previous = {id(s): _unit(s).settings for s in states_below(module)}
    set_state_dict_type(module, state_dict_type, state_dict_config, optim_state_dict_config)
    try:
        yield
    finally:
        for state in states_below(module):
            record = _unit(state)
            record.settings = previous.get(id(state), record.settings)


def full_state_dict(module: nn.Module, rank0_only: bool = False, offload_to_cpu: bool = False) -> dict[str, Any]:
    """The full (unsharded) state dict of a sharded model, keyed like the unsharded model.

    A collective: every rank must call it. With ``rank0_only``, the other ranks get ``{}``.
    """
    config = FullStateDictConfig(offload_to_cpu=offload_to_cpu, rank0_only=rank0_only)
    with state_dict_type(module, StateDictType.FULL_STATE_DICT, config):
        return module.state_dict()


# -- model state dict hooks ----------------------------------------------------------------------
def install_state_dict_hooks(state: ModuleState, settings: StateDictSettings) -> None:
    """Registers the hooks of [Note: State dict hooks] for one unit."""
    record = _UNITS[state] = _UnitStateDict(settings)
    group = state.group
    if group is not None:
        for unit_module in state.modules:  # several for fully_shard([a, b]): each subtree saves between its hooks
            unit_module.register_state_dict_pre_hook(functools.partial(_gather_unit, group, record))
            # Before the parameters' load hooks below: they see the sharded registration.
            unit_module.register_load_state_dict_pre_hook(functools.partial(_reshard_unit, group))
        by_module: dict[nn.Module, list[tuple[str, int]]] = {}
        for index, param in enumerate(group.spec.params):
            info = param.module_info
            for module, name in [(info.module, info.param_name), *zip(info.shared_modules, info.shared_param_names)]:
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


def install_flat_param_hooks(state: ModuleState) -> None:
    """The wrapper's flat parameter appears in LOCAL state dicts only."""
    group = state.group
    if group is None:
        raise AssertionError(f"rank {dist.get_rank()}: flat parameter hooks for a module without a unit")
    home = _flat_view(group).module
    home.register_state_dict_post_hook(functools.partial(_save_flat_param, group, _UNITS[state]))
    home.register_load_state_dict_pre_hook(functools.partial(_load_flat_param, group, _UNITS[state]))


def install_prefix_hooks(wrapper: nn.Module) -> None:
    """Keys of the wrapper's subtree without (and, loading, with) ``_fsdp_wrapped_module.``;
    the keys a load reports missing or unexpected without it too."""
    wrapper.register_state_dict_post_hook(_strip_wrapper_prefix)
    wrapper.register_load_state_dict_pre_hook(_add_wrapper_prefix)
    wrapper.register_load_state_dict_post_hook(_strip_reported_prefix)


def _flat_view(group: ParamGroup) -> FlatParamView:
    """The unit's flat parameter view (only units of the wrapper's flat form have one)."""
    view = flat_view(group)
    if view is None:
        raise AssertionError(f"rank {dist.get_rank()}: {group.spec.name} has no flat parameter")
    return view


def _reshard_unit(group: ParamGroup, *args: Any) -> None:
    """Outside forward and backward, a unit may still be unsharded (the root after a
    forward without backward, e.g. under ``torch.no_grad()``): state dicts read and
    write the shards."""
    if group.training_state is TrainingState.IDLE:
        group.reshard()


def _gather_unit(group: ParamGroup, record: _UnitStateDict, module: nn.Module, prefix: str, keep_vars: bool) -> None:
    _reshard_unit(group)
    if record.settings.state_dict_type is StateDictType.FULL_STATE_DICT:
        record.full_values = full_params.gather_full_values(group)


def _rank0_only(config: StateDictConfig | OptimStateDictConfig) -> bool:
    return isinstance(config, (FullStateDictConfig, FullOptimStateDictConfig)) and config.rank0_only


def _release_unit(record: _UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, metadata: Any) -> None:
    record.full_values = None
    settings = record.settings
    if (
        settings.state_dict_type is StateDictType.FULL_STATE_DICT
        and _rank0_only(settings.state_dict_config)
        and dist.get_rank() != 0
    ):
        for key in [k for k in state_dict if k.startswith(prefix)]:
            del state_dict[key]


def _save_params(
    group: ParamGroup,
    record: _UnitStateDict,
    entries: list[tuple[str, int]],
    module: nn.Module,
    state_dict: dict,
    prefix: str,
    metadata: Any,
) -> None:
    settings = record.settings
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
            local = param.shard_as_dtensor()._local_tensor
            value = param.dtensor_from_rows(local.cpu() if offload and local.device.type != "cpu" else local.clone())
        else:
            if record.full_values is None:  # set by _gather_unit, the unit module's pre-hook
                raise AssertionError(f"rank {dist.get_rank()}: {key} is saved before its unit was gathered")
            value = param.full_from_tp_local(record.full_values[index])
            if isinstance(value, DTensor):  # tensor parallel: the global tensor
                value = value.full_tensor()
            if offload:
                value = value.cpu()
        state_dict[key] = value


def _save_buffers_in_original_dtype(
    state: ModuleState, module: nn.Module, state_dict: dict, prefix: str, metadata: Any
) -> None:
    for name, buffer in module._buffers.items():
        key = prefix + name
        if buffer is not None and id(buffer) in state.buffer_dtypes and key in state_dict:
            state_dict[key] = buffer.detach().to(state.buffer_dtypes[id(buffer)])


def _save_flat_param(
    group: ParamGroup, record: _UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, metadata: Any
) -> None:
    view = _flat_view(group)
    key = prefix + view.name
    settings = record.settings
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        value = view.param.detach()
        state_dict[key] = value.cpu() if settings.state_dict_config.offload_to_cpu else value
    else:
        state_dict.pop(key, None)


def _load_params(
    group: ParamGroup,
    record: _UnitStateDict,
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
    if record.settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        return  # the flat parameter carries the values
    for name, index in entries:
        key = prefix + name
        param = group.spec.params[index]
        if key not in state_dict:
            if not param.register_sharded:  # not a registered parameter: nn.Module would not notice
                missing_keys.append(key)
            continue
        shard = param.shard_from_full(state_dict[key])
        if param.register_sharded:
            state_dict[key] = param.present(shard._local_tensor)  # nn.Module copies it into the registered shard
        else:
            full_params.write_shard(group, index, shard._local_tensor)
            del state_dict[key]


def _load_flat_param(
    group: ParamGroup, record: _UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, *args: Any
) -> None:
    view = _flat_view(group)
    if record.settings.state_dict_type is not StateDictType.LOCAL_STATE_DICT:
        # The original parameters' keys carry the values; keep nn.Module from
        # reporting the flat parameter missing (a copy onto itself).
        state_dict[prefix + view.name] = view.param.detach()


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


# -- optimizer state dicts ---------------------------------------------------------------------------
Entry = tuple[str, ShardParam | None, ParamGroup | None]


def _param_entries(model: nn.Module) -> dict[int, list[Entry]]:
    """id(parameter the optimizer sees) -> [(FQN, ShardParam or None, its unit or None)],
    in the model's parameter order. See [Note: Model order].

    A flat parameter maps to all the original parameters it holds; any other
    parameter to itself (with its ShardParam when it is one's sharded form).
    """
    module_paths = {id(m): n for n, m in model.named_modules()}
    by_sharded: dict[int, tuple[ShardParam, ParamGroup]] = {}
    flat_units: dict[int, ParamGroup] = {}
    for state in states_below(model):
        group = state.group
        if group is None:
            continue
        for shard_param in group.spec.params:
            by_sharded[id(shard_param.sharded_param)] = (shard_param, group)
        unit_flat_param = flat_param(group)
        if unit_flat_param is not None:
            flat_units[id(unit_flat_param)] = group
    entries: dict[int, list[Entry]] = {}
    for name, param in model.named_parameters():
        unit = flat_units.get(id(param))
        if unit is not None:
            entries[id(param)] = [
                (model_name(_join(module_paths.get(id(p.module_info.module), ""), p.module_info.param_name)), p, unit)
                for p in unit.spec.params
            ]
        else:
            found = by_sharded.get(id(param))
            entries[id(param)] = [(model_name(name), *found) if found else (model_name(name), None, None)]
    return entries


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name


def _in_model_order(
    model: nn.Module, entries: dict[int, list[Entry]], params: Iterable[torch.Tensor]
) -> list[torch.Tensor]:
    """``params`` (an optimizer's) in ``model``'s parameter order. See [Note: Model order].

    Raises:
        KeyError: a parameter that is not ``model``'s (as PyTorch's FSDP: it has no name to key it by).
    """
    wanted = {id(p): p for p in params}
    for param in wanted.values():
        if id(param) not in entries:
            raise KeyError(
                f"the optimizer holds a parameter of shape {tuple(param.shape)} that is not a parameter of "
                f"{type(model).__name__}: optimizer state dicts are keyed by the model's parameter names; "
                "give the optimizer only the model's parameters"
            )
    return [wanted[key] for key in entries if key in wanted]


def _check_same_states_across_ranks(model: nn.Module, fqns: list[str], caller: str) -> None:
    """The ranks of each shard group must hold states for the same parameters: their
    collectives pair up parameter by parameter. Only the units' own groups are asked
    (other ranks, e.g. another pipeline stage, need not call).

    Raises:
        RuntimeError: two ranks differ (as PyTorch's FSDP), naming both and the parameters.
    """
    groups: dict[int, dist.ProcessGroup] = {}
    for state in states_below(model):
        shard = state.group.spec.mesh_info.shard if state.group is not None else None
        if shard is not None and shard.size > 1 and shard.group is not None:
            groups.setdefault(id(shard.group), shard.group)
    for group in groups.values():
        every = comm.all_gather_objects(sorted(fqns), group)
        for index, theirs in enumerate(every):
            if theirs != every[0]:
                first, other = dist.get_global_rank(group, 0), dist.get_global_rank(group, index)
                raise RuntimeError(
                    f"{caller} expects every rank's optimizer to hold states for the same parameters, but rank "
                    f"{first} has {sorted(set(every[0]) - set(theirs))} that rank {other} lacks and rank {other} "
                    f"has {sorted(set(theirs) - set(every[0]))} that rank {first} lacks; give every rank's "
                    "optimizer the same parameters"
                )


def optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any] | None = None
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter FQN, full or sharded like the model's state dict.

    Per-parameter states (``exp_avg``, ``momentum_buffer``, ...) are DTensor
    shards for SHARDED, full tensors for FULL (``rank0_only``: other ranks get
    ``{}``); a flat parameter's states are split into its original parameters'.
    A collective: every rank must call it.

    Args:
        optim_state_dict: the index-keyed dict to convert (default:
            ``optim.state_dict()``); its indices count ``optim``'s parameters.

    Raises:
        KeyError: ``optim`` holds a parameter ``model`` does not have.
        RuntimeError: the ranks' optimizers hold states for different parameters.
    """
    # A model without units (plain tensors) has nothing to gather or split.
    settings = get_state_dict_type(model) if states_below(model) else default_settings(StateDictType.SHARDED_STATE_DICT)
    full = settings.state_dict_type is StateDictType.FULL_STATE_DICT
    offload = settings.optim_state_dict_config.offload_to_cpu
    entries = _param_entries(model)
    saved = optim_state_dict if optim_state_dict is not None else optim.state_dict()
    index_of = {
        id(param): index
        for saved_group, group in zip(saved["param_groups"], optim.param_groups)
        for index, param in zip(saved_group["params"], group["params"])
    }
    stepped = [
        p
        for p in _in_model_order(model, entries, (p for g in optim.param_groups for p in g["params"]))
        if index_of[id(p)] in saved["state"]
    ]
    _check_same_states_across_ranks(model, [fqn for p in stepped for fqn, _, _ in entries[id(p)]], "optim_state_dict")
    state: dict[str, dict[str, Any]] = {}
    for param in stepped:
        for fqn, shard_param, unit in entries[id(param)]:
            state[fqn] = _split_state(saved["state"][index_of[id(param)]], param, shard_param, unit, full, offload)
    param_groups = [
        {**saved_group, "params": [fqn for p in group["params"] for fqn, _, _ in entries[id(p)]]}
        for saved_group, group in zip(saved["param_groups"], optim.param_groups)
    ]
    if full and _rank0_only(settings.optim_state_dict_config) and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": param_groups}


def _split_state(
    values: dict[str, Any],
    param: torch.Tensor,
    shard_param: ShardParam | None,
    unit: ParamGroup | None,
    full: bool,
    offload: bool,
) -> dict[str, Any]:
    """One parameter's optimizer states in the requested form. Scalar tensors (Adam's
    ``step``) are copies: the optimizer increments its own in place, and the
    originals of a flat parameter would otherwise share one."""
    result = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.clone()
        elif isinstance(value, torch.Tensor):
            if unit is not None and shard_param is not None and param is flat_param(unit):
                value = param_view_of_flat(unit, unit.spec.params.index(shard_param), value, full=full)
            elif shard_param is not None:  # presented like the parameter: see [Note: Presentations]
                value = shard_param.dtensor_from_rows(shard_param.rows_from_presented(value))
                value = value.full_tensor() if full else value
            elif isinstance(value, DTensor) and full:
                value = value.full_tensor()
            if offload:
                value = value.cpu()
        result[key] = value
    return result


def optim_state_dict_to_load(
    model: nn.Module, optim: torch.optim.Optimizer, optim_state_dict: dict[str, Any]
) -> dict[str, Any]:
    """Turns an FQN-keyed optimizer state dict (full or sharded, any layout) into one
    that ``optim.load_state_dict`` accepts for ``model``'s current parameters."""
    if "param_groups" not in optim_state_dict:  # only states saved: the optimizer's own hyperparameters
        groups = [{k: v for k, v in group.items() if k != "params"} for group in optim.param_groups]
        optim_state_dict = {**optim_state_dict, "param_groups": groups}
    return optim_state_dict_for_params(model, [group["params"] for group in optim.param_groups], optim_state_dict)


def optim_state_dict_for_params(
    model: nn.Module, param_groups: list[list[torch.Tensor]] | None, optim_state_dict: dict[str, Any]
) -> dict[str, Any]:
    """``optim_state_dict_to_load`` for an optimizer given by its parameters per group
    (None: ``model``'s parameters, grouped as ``optim_state_dict``'s FQNs are), for
    the FSDP1 calls that take no optimizer."""
    entries = _param_entries(model)
    if param_groups is None:
        param_groups = _groups_by_fqn(model, entries, optim_state_dict)
    saved_state = optim_state_dict["state"]
    joined: dict[int, dict[str, Any]] = {}
    for param in _in_model_order(model, entries, (p for params in param_groups for p in params)):
        owned = entries[id(param)]
        per_param = [(shard_param, saved_state.get(fqn)) for fqn, shard_param, _ in owned]
        if any(values is not None for _, values in per_param):
            joined[id(param)] = _join_state(param, owned[0][2], per_param)
    state: dict[int, dict[str, Any]] = {}
    result_groups = []
    index = 0
    for saved_group, params in zip(optim_state_dict["param_groups"], param_groups):
        indices = []
        for param in params:
            if id(param) in joined:
                state[index] = joined[id(param)]
            indices.append(index)
            index += 1
        result_groups.append({**{k: v for k, v in saved_group.items() if k != "params"}, "params": indices})
    return {"state": state, "param_groups": result_groups}


def _groups_by_fqn(
    model: nn.Module, entries: dict[int, list], optim_state_dict: dict[str, Any]
) -> list[list[torch.Tensor]]:
    """``model``'s parameters (in model order) holding each saved group's FQNs."""
    groups: list[list[torch.Tensor]] = []
    for saved_group in optim_state_dict["param_groups"]:
        fqns = set(saved_group["params"])
        groups.append([p for p in model.parameters() if any(fqn in fqns for fqn, _, _ in entries[id(p)])])
    return groups


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any], by_name: bool, model: nn.Module, param_groups: list[list[torch.Tensor]] | None
) -> dict[str, Any]:
    """``optim_state_dict`` keyed by parameter FQN (``by_name``) or by the optimizer's
    parameter index; returned as is when already keyed so. Indices count the
    parameters of ``param_groups`` (default: ``model.parameters()``) in order.

    Raises:
        ValueError: a parameter stands for several (a flat parameter: its states
            are not any one parameter's; use ``optim_state_dict``), or a key that
            ``model`` has no parameter for.
    """
    keys = [*optim_state_dict["state"], *(k for g in optim_state_dict["param_groups"] for k in g["params"])]
    if all(isinstance(k, str if by_name else int) for k in keys):
        return optim_state_dict
    entries = _param_entries(model)
    ordered = [p for params in (param_groups or [list(model.parameters())]) for p in params]
    names = []
    for param in ordered:
        owned = entries.get(id(param))
        if owned is None:
            raise ValueError(
                f"rekey_optim_state_dict: an optimizer parameter is not a parameter of {type(model).__name__}"
            )
        if len(owned) != 1:  # RuntimeError: FSDP1's type
            raise RuntimeError(
                f"rekey_optim_state_dict expects one name per optimizer parameter but a flat parameter holds "
                f"{[fqn for fqn, _, _ in owned]}: use optim_state_dict / full_optim_state_dict for flat parameters"
            )
        names.append(owned[0][0])
    mapping: dict[Any, Any] = dict(enumerate(names)) if by_name else {name: i for i, name in enumerate(names)}

    def rekey(key: Any) -> Any:
        if key not in mapping:
            raise ValueError(f"rekey_optim_state_dict: {type(model).__name__} has no parameter for key {key!r}")
        return mapping[key]

    return {
        "state": {rekey(k): v for k, v in optim_state_dict["state"].items()},
        "param_groups": [
            {**g, "params": sorted(rekey(k) for k in g["params"])} for g in optim_state_dict["param_groups"]
        ],
    }


def _join_state(
    param: torch.Tensor, unit: ParamGroup | None, per_param: list[tuple[ShardParam | None, dict[str, Any] | None]]
) -> dict[str, Any]:
    """The states of ``param`` (a flat parameter joins its originals') from saved values."""
    first = next(values for _, values in per_param if values is not None)
    result: dict[str, Any] = {}
    for key, value in first.items():
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            # A copy, or the loaded parameters would all step one shared counter.
            result[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        if unit is not None and param is flat_param(unit):
            flat = torch.zeros_like(param)
            for shard_param, values in per_param:
                if values is not None and shard_param is not None:  # a flat parameter's originals have both
                    local = shard_param.shard_from_full(values[key])._local_tensor
                    full_params.write_shard(unit, unit.spec.params.index(shard_param), local, into=flat)
            result[key] = flat
        elif per_param[0][0] is not None:
            shard_param = per_param[0][0]
            result[key] = shard_param.present(shard_param.shard_from_full(value)._local_tensor)
        elif isinstance(param, DTensor):
            result[key] = _like(param, value)
        else:
            result[key] = value.full_tensor() if isinstance(value, DTensor) else value
    return result


def _like(param: DTensor, value: torch.Tensor) -> DTensor:
    """``value`` laid out like ``param`` (a DTensor outside any unit)."""
    full = value.full_tensor() if isinstance(value, DTensor) else value
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
