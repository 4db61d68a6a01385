"""Small types shared across the engine: training states, where a parameter is registered, casts."""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map


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

    def owners(self) -> list[tuple[nn.Module, str]]:
        """Every (module, name) registering the parameter, its owner first."""
        return [(self.module, self.param_name), *zip(self.shared_modules, self.shared_param_names)]


def module_class_name(module: nn.Module) -> str:
    """The user's class name, also after fully_shard swapped the class or a front
    end's wrapper stands in front of it (a wrapper class names the child it wraps
    in ``_fullshard_wrapped_name``)."""
    wrapped_name = getattr(type(module), "_fullshard_wrapped_name", None)
    wrapped = getattr(module, "_modules", {}).get(wrapped_name) if wrapped_name else None
    if wrapped is not None:
        return module_class_name(wrapped)
    cls = type(module)
    return getattr(cls, "_fullshard_original_class", cls).__name__


def set_module_tensor(module: nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Makes ``module.<name>`` a plain attribute, not a registered parameter."""
    module._parameters.pop(name, None)
    module.__dict__[name] = tensor


def cast_floating(dtype: torch.dtype, tree: Any) -> Any:
    """Casts every floating-point tensor in a nested structure to ``dtype``."""

    def cast(t: torch.Tensor) -> torch.Tensor:
        return t.to(dtype) if t.is_floating_point() and t.dtype != dtype else t

    return map_tensors(cast, tree)


def map_tensors(fn: Callable[[torch.Tensor], Any], tree: Any) -> Any:
    """``fn`` applied to every tensor in a nested structure: pytree containers and
    dataclass instances (models pass activations between units in dataclasses;
    a tensor missed here would miss its gradient hooks)."""

    def leaf(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return fn(value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            rebuilt = copy.copy(value)
            for item in dataclasses.fields(value):
                object.__setattr__(rebuilt, item.name, map_tensors(fn, getattr(value, item.name)))
            return rebuilt
        return value

    return tree_map(leaf, tree)


def flatten_tensors(tree: Any) -> list[torch.Tensor]:
    """Every tensor ``map_tensors`` would visit, in its order."""
    found: list[torch.Tensor] = []
    map_tensors(found.append, tree)
    return found
