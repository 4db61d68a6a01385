"""Small types shared across the engine: training states, module attributes, casts of nested tensors."""

from __future__ import annotations

import copy
import dataclasses
import enum
from collections.abc import Callable
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
