"""The wrapper's flat parameter (``use_orig_params=False``) in model state dicts:
saved and loaded as itself in LOCAL state dicts only; in FULL and SHARDED ones
the original parameters' keys carry its values.

The wrapper hands the parameter and where it is registered: this module does
not know the flat parameter's class.
"""

from __future__ import annotations

import functools
from typing import Any

import torch.nn as nn

from .._core.state import ModuleState
from ..api import StateDictType
from .settings import UnitStateDict, unit_record


def install_flat_param_hooks(state: ModuleState, home: nn.Module, name: str, param: nn.Parameter) -> None:
    """Hooks on ``home``, the module ``param`` (``state``'s unit's flat parameter) is registered on as ``name``."""
    record = unit_record(state)
    home.register_state_dict_post_hook(functools.partial(_save_flat_param, name, param, record))
    home.register_load_state_dict_pre_hook(functools.partial(_load_flat_param, name, param, record))


def _save_flat_param(
    name: str, param: nn.Parameter, record: UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, _: Any
) -> None:
    key = prefix + name
    settings = record.model_settings()
    if settings.state_dict_type is StateDictType.LOCAL_STATE_DICT:
        value = param.detach()
        state_dict[key] = value.cpu() if settings.state_dict_config.offload_to_cpu else value
    else:
        state_dict.pop(key, None)


def _load_flat_param(
    name: str, param: nn.Parameter, record: UnitStateDict, module: nn.Module, state_dict: dict, prefix: str, *_: Any
) -> None:
    if record.model_settings().state_dict_type is not StateDictType.LOCAL_STATE_DICT:
        # The original parameters' keys carry the values; keep nn.Module from
        # reporting the flat parameter missing (a copy onto itself).
        state_dict[prefix + name] = param.detach()
