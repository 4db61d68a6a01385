"""Small types shared across the engine: training states, module info, casts."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map_only


class TrainingState(enum.Enum):
    """Where a unit (or a module state) is in the current step."""

    IDLE = enum.auto()  # between steps, or between forward and backward
    FORWARD = enum.auto()  # inside the module's forward
    PRE_BACKWARD = enum.auto()  # backward reached the module's outputs; grads pending
    POST_BACKWARD = enum.auto()  # the module's gradients were handed to reduction


@dataclass
class ParamModuleInfo:
    """Where a parameter is registered: its owner and any module sharing it.

    Swapping sharded <-> unsharded parameters must update every registration,
    or a tied weight would silently untie.
    """

    module: nn.Module
    param_name: str
    shared_modules: list[nn.Module] = field(default_factory=list)
    shared_param_names: list[str] = field(default_factory=list)


def module_class_name(module: nn.Module) -> str:
    """The user's class name, also after fully_shard swapped the class."""
    cls = type(module)
    return getattr(cls, "_fullshard_original_class", cls).__name__


def set_module_param(module: nn.Module, name: str, param: nn.Parameter) -> None:
    """Registers ``param`` under ``name``, skipping ``nn.Module.__setattr__``'s checks
    when the module does not customise attribute setting (they cost microseconds
    per call and we swap every parameter twice per step)."""
    if type(module).__setattr__ is nn.Module.__setattr__:
        module._parameters[name] = param
    else:
        setattr(module, name, param)


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Casts every floating-point tensor in a nested structure to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return tree_map_only(torch.Tensor, cast, tree)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    return tree_map_only(torch.Tensor, fn, tree)
