"""FSDP1's optimizer-state calls (``FSDP.optim_state_dict``, ``FSDP.full_optim_state_dict``,
``FSDP.rekey_optim_state_dict``, ...), as compositions of ``fullshard.state_dict``'s two.

The wrapper class exposes each as a static method of the same name; the
arguments FSDP1 took and we cannot honour (``group``, ``optim_input``) warn.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

from . import state_dict as state_dicts
from ._core import comm
from ._core.common import map_tensors
from .api import FullOptimStateDictConfig, OptimStateKeyType, StateDictType
from .state_dict import optim as fqn_optim_state

OptimInput = list[dict[str, Any]] | Iterable[nn.Parameter] | None


def optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim``'s state keyed by parameter FQN, full or sharded like the model's
    state dict (see ``fullshard.state_dict.optim_state_dict``). ``optim_state_dict``:
    the index-keyed dict to convert instead of ``optim.state_dict()``."""
    _warn_if_group_given(group, "FSDP.optim_state_dict", model)
    return state_dicts.optim_state_dict(model, optim, optim_state_dict, whole_units=True)


def optim_state_dict_to_load(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_state_dict: dict[str, Any],
    is_named_optimizer: bool = False,
    load_directly: bool = False,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """The FQN-keyed ``optim_state_dict`` in the form ``optim.load_state_dict`` takes
    (loaded right away with ``load_directly``).

    Raises:
        NotImplementedError: ``is_named_optimizer=True`` (torchrec's NamedOptimizer).
    """
    if is_named_optimizer:
        raise NotImplementedError(
            "FSDP.optim_state_dict_to_load supports torch.optim optimizers, not NamedOptimizer: "
            "pass is_named_optimizer=False"
        )
    _warn_if_group_given(group, "FSDP.optim_state_dict_to_load", model)
    result = state_dicts.optim_state_dict_to_load(model, optim, optim_state_dict)
    if load_directly:
        optim.load_state_dict(result)
    return result


def full_optim_state_dict(
    model: nn.Module,
    optim: torch.optim.Optimizer,
    optim_input: OptimInput = None,
    rank0_only: bool = True,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``optim_state_dict`` under FULL_STATE_DICT (CPU tensors; ``{}`` off rank 0
    with ``rank0_only``), whatever the model's state-dict type. A collective.

    ``optim_input`` is deprecated (a FutureWarning, as in PyTorch): ``optim`` lists its parameters.
    """
    _param_groups(optim, optim_input, "FSDP.full_optim_state_dict")
    _warn_if_group_given(group, "FSDP.full_optim_state_dict", model)
    config = FullOptimStateDictConfig(offload_to_cpu=True, rank0_only=rank0_only)
    with state_dicts.state_dict_type(model, StateDictType.FULL_STATE_DICT, optim_state_dict_config=config):
        return state_dicts.optim_state_dict(model, optim, whole_units=True)


def sharded_optim_state_dict(
    model: nn.Module, optim: torch.optim.Optimizer, group: dist.ProcessGroup | None = None
) -> dict[str, Any]:
    """``optim_state_dict`` under SHARDED_STATE_DICT: states as ShardedTensors (DTensors
    for wrappers given a device mesh), whatever the model's state-dict type (load with ``optim_state_dict_to_load``)."""
    _warn_if_group_given(group, "FSDP.sharded_optim_state_dict", model)
    with state_dicts.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        return state_dicts.optim_state_dict(model, optim, whole_units=True)


def shard_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any],
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """This rank's part of an FQN-keyed optimizer state dict, keyed by index for
    ``optim.load_state_dict``. Without ``optim``, the optimizer's parameters are
    ``optim_input`` (its parameters or param groups), else ``model.parameters()``.
    Accepts sharded dicts too (any layout); no communication.

    Raises:
        ValueError: ``full_optim_state_dict`` is keyed by index (rekey it to PARAM_NAME first).
    """
    keys = [
        *full_optim_state_dict["state"],
        *(k for g in full_optim_state_dict["param_groups"] for k in g["params"]),
    ]
    if not all(isinstance(key, str) for key in keys):
        raise ValueError(
            "shard_full_optim_state_dict expects an optimizer state dict keyed by parameter name: convert it "
            "with FSDP.rekey_optim_state_dict(osd, OptimStateKeyType.PARAM_NAME, model) first"
        )
    groups = _param_groups(optim, optim_input, "FSDP.shard_full_optim_state_dict")
    return fqn_optim_state.optim_state_dict_for_params(model, groups, full_optim_state_dict)


def scatter_full_optim_state_dict(
    full_optim_state_dict: dict[str, Any] | None,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
    group: dist.ProcessGroup | None = None,
) -> dict[str, Any]:
    """``shard_full_optim_state_dict`` of the dict given on ``group``'s first rank
    (the other ranks may pass None): it is broadcast over ``group`` (default: all
    ranks), so only one rank needs to load the checkpoint. A collective."""
    source = dist.get_global_rank(group, 0) if group is not None else 0
    mine: dict[str, Any] = {}  # a placeholder off the source rank
    if dist.get_rank() == source:
        if full_optim_state_dict is None:
            raise ValueError(f"scatter_full_optim_state_dict expects the state dict on rank {source} but got None")
        # On the CPU: unpickled tensors would otherwise land on the source's device.
        mine = map_tensors(torch.Tensor.cpu, full_optim_state_dict)
    received = comm.broadcast_object(mine, src_rank=source, group=group)
    return shard_full_optim_state_dict(received, model, optim_input, optim)


def flatten_sharded_optim_state_dict(
    sharded_optim_state_dict: dict[str, Any], model: nn.Module, optim: torch.optim.Optimizer
) -> dict[str, Any]:
    """``sharded_optim_state_dict``'s output in the form ``optim.load_state_dict``
    takes: ``optim_state_dict_to_load`` (which reads any layout)."""
    return optim_state_dict_to_load(model, optim, sharded_optim_state_dict)


def rekey_optim_state_dict(
    optim_state_dict: dict[str, Any],
    optim_state_key_type: OptimStateKeyType,
    model: nn.Module,
    optim_input: OptimInput = None,
    optim: torch.optim.Optimizer | None = None,
) -> dict[str, Any]:
    """``optim_state_dict`` keyed by parameter name or by index (``optim_state_dict``
    itself when already so): to load a wrapped model's full dict into an
    unwrapped model's optimizer, or the reverse. Indices follow ``optim``'s
    parameters, else ``optim_input``'s, else ``model.parameters()``; param
    groups list their keys sorted.

    Raises:
        RuntimeError: a flat parameter in the optimizer (``use_orig_params=False``:
            its state is no single parameter's), as FSDP1.
        ValueError: a key ``model`` lacks, or an unknown ``optim_state_key_type``.
    """
    # By name: torch's own OptimStateKeyType members work too.
    name = getattr(optim_state_key_type, "name", None)
    if name not in OptimStateKeyType.__members__:
        raise ValueError(f"rekey_optim_state_dict expects an OptimStateKeyType but got {optim_state_key_type!r}")
    groups = _param_groups(optim, optim_input, "FSDP.rekey_optim_state_dict")
    by_name = name == OptimStateKeyType.PARAM_NAME.name
    return fqn_optim_state.rekey_optim_state_dict(optim_state_dict, by_name, model, groups)


def _param_groups(
    optim: torch.optim.Optimizer | None, optim_input: OptimInput, caller: str
) -> list[list[torch.Tensor]] | None:
    """The optimizer's parameters per group: ``optim``'s, else ``optim_input``'s (its
    constructor argument: parameters or param-group dicts), else None."""
    if optim_input is not None:
        warnings.warn(
            f"{caller}: the optim_input argument is deprecated (as in PyTorch's FSDP); pass optim instead, "
            "or neither to use the model's parameters",
            FutureWarning,
            stacklevel=3,
        )
    if optim is not None:
        return [list(group["params"]) for group in optim.param_groups]
    if optim_input is None:
        return None
    items: list[Any] = list(optim_input)
    if items and isinstance(items[0], dict):
        return [list(group["params"]) for group in items]
    return [items]


def _warn_if_group_given(group: dist.ProcessGroup | None, caller: str, model: nn.Module) -> None:
    """A group other than the model's own is ignored, with a warning (torch's state-dict API
    passes the root wrapper's own group: nothing to say then)."""
    if group is not None and group is not getattr(model, "process_group", None):
        warnings.warn(
            f"{caller} ignores group: every unit communicates over its own process group", UserWarning, stacklevel=3
        )
