"""Optimizer state dicts keyed by parameter FQN, full or sharded like the model's.

Per-parameter states follow the model's state-dict type; a flat parameter's
(the wrapper's ``use_orig_params=False``) are split into the original
parameters' states, and joined back for loading.

[Note: Model order]
Gathering or re-laying out a state is a collective, so all ranks must treat
the parameters in one order. The optimizer's order is no such order: each rank
may list its parameters differently (param groups built from sets or dicts).
Every optimizer-state call therefore walks ``model.named_parameters()`` and
picks the optimizer's parameters from it; the optimizer's order only decides
how the result's param groups list them.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.tensor import DTensor, distribute_tensor

from .._core import comm
from .._core.gather import ShardParam
from .._core.manage import states_below
from .._core.unit import ParamGroup, buffer_param, full_params
from .._names import state_dict_name
from ..api import StateDictType
from .model import default_settings, get_state_dict_type, rank0_only, unit_record
from .sharded_tensor import as_fsdp1_optim_state, loadable

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
        unit_flat_param = buffer_param(group)
        if unit_flat_param is not None:
            flat_units[id(unit_flat_param)] = group
    entries: dict[int, list[Entry]] = {}
    for name, param in model.named_parameters():
        unit = flat_units.get(id(param))
        if unit is not None:
            entries[id(param)] = [
                (
                    state_dict_name(_join(module_paths.get(id(p.module_info.module), ""), p.module_info.param_name)),
                    p,
                    unit,
                )
                for p in unit.spec.params
            ]
        else:
            found = by_sharded.get(id(param))
            entries[id(param)] = [(state_dict_name(name), *found) if found else (state_dict_name(name), None, None)]
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


def _check_same_states_across_ranks(model: nn.Module, stepped: list[Entry], caller: str) -> None:
    """The ranks of each shard group must hold states for the same parameters of that group's
    units (and of no unit): their collectives pair up parameter by parameter. Only the units'
    own groups are asked (other ranks, e.g. another pipeline stage, need not call), each about
    its own units (experts on a group of their own differ between the ranks of the others).

    Raises:
        RuntimeError: two ranks differ (as PyTorch's FSDP), naming both and the parameters.
    """
    groups: dict[int, dist.ProcessGroup] = {}
    for state in states_below(model):
        shard = state.group.spec.mesh_info.shard if state.group is not None else None
        if shard is not None and shard.size > 1 and shard.group is not None:
            groups.setdefault(id(shard.group), shard.group)
    for key, group in groups.items():
        fqns = [fqn for fqn, _, unit in stepped if unit is None or id(unit.spec.mesh_info.shard.group) == key]
        differ = comm.first_disagreement(sorted(fqns), group)
        if differ is not None:
            first, ours, other, theirs = differ
            raise RuntimeError(
                f"{caller} expects every rank's optimizer to hold states for the same parameters, but rank "
                f"{first} has {sorted(set(ours) - set(theirs))} that rank {other} lacks and rank {other} "
                f"has {sorted(set(theirs) - set(ours))} that rank {first} lacks; give every rank's "
                "optimizer the same parameters"
            )


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any] | None = None,
    *,
    whole_units: bool = False,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter FQN, full or sharded like the model's state dict.

    Per-parameter states (``exp_avg``, ``momentum_buffer``, ...) are DTensor
    shards for SHARDED (ShardedTensors for FSDP1 wrappers without a device mesh,
    see [Note: ShardedTensor form]), full tensors for FULL (``rank0_only``: other ranks get
    ``{}``); a flat parameter's states are split into its original parameters'.
    A collective: every rank must call it.

    Args:
        optim_state_dict: the index-keyed dict to convert (default:
            ``optim.state_dict()``); its indices count ``optim``'s parameters.
        whole_units: refuse an optimizer with states for part of a ``use_orig_params=True``
            wrapper unit's trainable parameters, as FSDP1's calls do (they pass True).

    Raises:
        KeyError: ``optim`` holds a parameter ``model`` does not have.
        RuntimeError: the ranks' optimizers hold states for different parameters, or (``whole_units``)
            for part of a unit's trainable parameters.
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
    _check_same_states_across_ranks(model, [entry for p in stepped for entry in entries[id(p)]], "optim_state_dict")
    # After the check above: every rank of a unit holds the same states, so all raise or none.
    if whole_units:
        _check_whole_units(model, {id(p) for p in stepped if _has_tensor_state(saved["state"][index_of[id(p)]])})
    as_sharded_tensors = set() if full else _units_saving_sharded_tensors(model)
    state: dict[str, dict[str, Any]] = {}
    for param in stepped:
        values = saved["state"][index_of[id(param)]]
        gathered = _gather_flat_states(param, entries[id(param)][0][2], values)
        for fqn, shard_param, unit in entries[id(param)]:
            state[fqn] = _split_state(values, param, shard_param, unit, full, offload, gathered)
            if unit is not None and id(unit) in as_sharded_tensors:
                flat = buffer_param(unit) is not None
                state[fqn] = {
                    k: as_fsdp1_optim_state(v, flat) if isinstance(v, DTensor) else v for k, v in state[fqn].items()
                }
    param_groups = [
        {**saved_group, "params": [fqn for p in group["params"] for fqn, _, _ in entries[id(p)]]}
        for saved_group, group in zip(saved["param_groups"], optim.param_groups)
    ]
    if full and rank0_only(settings.optim_state_dict_config) and dist.get_rank() != 0:
        return {}
    return {"state": state, "param_groups": param_groups}


def _has_tensor_state(values: dict[str, Any]) -> bool:
    return any(isinstance(value, torch.Tensor) for value in values.values())


def _check_whole_units(model: nn.Module, stated: set[int]) -> None:
    """A unit showing the user's own parameters (the wrapper's ``use_orig_params=True``) has its states
    saved together, as FSDP1's: an optimizer with tensor states for some of its trainable parameters and
    not the others is refused, as FSDP1 refuses it (``stated``: id() of the parameters with states).

    Raises:
        RuntimeError: naming the unit, the parameters without states and the fix.
    """
    for state in states_below(model):
        unit = state.group
        if unit is None or not unit.spec.presentation.keeps_user_param:
            continue
        trainable = [p for p in unit.spec.params if p.sharded_param.requires_grad]
        missing = [p.fqn for p in trainable if id(p.sharded_param) not in stated]
        if missing and len(missing) < len(trainable):
            held = [p.fqn for p in trainable if id(p.sharded_param) in stated]
            raise RuntimeError(
                f"optim_state_dict expects the optimizer to hold states for all trainable parameters of a unit "
                f"or for none, but of {unit.spec.name}'s it holds {held} and not {missing} (FSDP1 saves a "
                "unit's states together); give this optimizer all of the unit's parameters, or wrap the "
                "modules of the others in a FullyShardedDataParallel unit of their own"
            )


def _units_saving_sharded_tensors(model: nn.Module) -> set[int]:
    """id() of the units whose sharded states are ShardedTensors (see [Note: ShardedTensor form])."""
    return {id(s.group) for s in states_below(model) if s.group is not None and unit_record(s).sharded_tensors}


def _gather_flat_states(
    param: torch.Tensor, unit: ParamGroup | None, values: dict[str, Any]
) -> dict[str, list[torch.Tensor]]:
    """A flat parameter's states in FSDP1's flat layout, each gathered once into its original
    parameters' full values (see [Note: Flat layout] in _core/layout.py); {} for any other."""
    if unit is None or not unit.spec.shard_layout.flat or param is not buffer_param(unit):
        return {}
    return {
        key: full_params.gather_like_shards(unit, value)
        for key, value in values.items()
        if isinstance(value, torch.Tensor) and value.dim() > 0
    }


def _split_state(
    values: dict[str, Any],
    param: torch.Tensor,
    shard_param: ShardParam | None,
    unit: ParamGroup | None,
    full: bool,
    offload: bool,
    gathered: dict[str, list[torch.Tensor]],
) -> dict[str, Any]:
    """One parameter's optimizer states in the requested form (``gathered``: a flat parameter's
    states gathered, see ``_gather_flat_states``). Scalar tensors (Adam's ``step``) are copies:
    the optimizer increments its own in place, and the originals of a flat parameter would
    otherwise share one."""
    result = {}
    for key, value in values.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0:
            value = value.clone()
        elif isinstance(value, torch.Tensor):
            if key in gathered and unit is not None and shard_param is not None:
                whole = gathered[key][unit.spec.params.index(shard_param)]
                value = whole if full else full_params.row_shard(shard_param, whole)
            elif shard_param is not None:  # presented like the parameter: see [Note: Presentations]
                value = shard_param.dtensor_from_rows(shard_param.rows_from_presented(value))
                value = comm.full_tensor(value) if full else value
            elif isinstance(value, DTensor) and full:
                value = comm.full_tensor(value)
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
    _check_group_fqns(model, entries, optim_state_dict)
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


def _check_group_fqns(model: nn.Module, entries: dict[int, list[Entry]], optim_state_dict: dict[str, Any]) -> None:
    """Raises ``KeyError`` (as torch's FSDP does) when the saved param groups name a
    parameter ``model`` lacks: its states would otherwise be dropped without a word
    (torch's state-dict API renames keys of compiled models so, e.g. ``2.0.weight`` to
    ``2._orig_mod.0.weight``, when another parameter's FQN ends in ``0.weight``)."""
    known = {fqn for owned in entries.values() for fqn, _, _ in owned}
    unknown = [
        fqn
        for group in optim_state_dict.get("param_groups", ())
        for fqn in group.get("params", ())
        if isinstance(fqn, str) and fqn not in known
    ]
    if unknown:
        raise KeyError(
            f"optim_state_dict_to_load: the optimizer state dict's param_groups name {unknown}, which are not "
            f"parameters of {type(model).__name__} (it has {sorted(known)}); load a dict saved from a model of "
            "the same structure, keyed by its parameter names"
        )


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
        if not isinstance(value, torch.Tensor) or (not isinstance(value, ShardedTensor) and value.dim() == 0):
            # A copy, or the loaded parameters would all step one shared counter.
            result[key] = value.clone() if isinstance(value, torch.Tensor) else value
            continue
        if unit is not None and param is buffer_param(unit):
            flat = torch.zeros_like(param)
            for shard_param, values in per_param:
                if values is not None and shard_param is not None:  # a flat parameter's originals have both
                    local = full_params.local_part(shard_param, loadable(values[key], shard_param))
                    full_params.write_shard(unit, unit.spec.params.index(shard_param), local, into=flat)
            result[key] = flat
        elif per_param[0][0] is not None:
            shard_param = per_param[0][0]
            result[key] = shard_param.present(shard_param.shard_from_full(loadable(value, shard_param))._local_tensor)
        elif isinstance(param, DTensor):
            result[key] = _like(param, value)
        else:
            result[key] = comm.full_tensor(value) if isinstance(value, DTensor) else value
    return result


def _like(param: DTensor, value: torch.Tensor) -> DTensor:
    """``value`` laid out like ``param`` (a DTensor outside any unit)."""
    full = comm.full_tensor(value) if isinstance(value, DTensor) else value
    return distribute_tensor(full.to(param.device), param.device_mesh, param.placements, src_data_rank=None)
