"""Small types shared across the engine: training states, module info, casts."""

from __future__ import annotations

import copy
import dataclasses
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import torch
import torch.nn as nn
from torch.utils._pytree import tree_map

from ..api import BackwardPrefetch, MixedPrecisionPolicy, OffloadPolicy
from .presentation import DTensorShards


class TrainingState(enum.Enum):
    """Where a unit (or a module state) is in the current step."""

    IDLE = enum.auto()  # between steps, or between forward and backward
    FORWARD = enum.auto()  # inside the module's forward
    PRE_BACKWARD = enum.auto()  # backward reached the module's outputs; grads pending
    POST_BACKWARD = enum.auto()  # the module's gradients were handed to reduction


@dataclass(frozen=True, kw_only=True)
class UnitConfig:
    """Everything a front end decides about one unit; the engine reads only this."""

    api_name: str = "fully_shard"  # the call the user made, for messages: "<api_name> expects ..."
    ignore_argument: str = "ignored_params"  # that call's argument leaving a parameter unsharded, for messages
    # A name from a walk of the module tree as the user's model names it (a wrapper
    # drops the segments it inserts); None: the name itself.
    name_in_model: Callable[[str], str] | None = None
    reshard_after_forward: bool | int | None = None  # None: True except for the root
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    forward_prefetch: bool = True  # gather the next unit (previous step's order) while this one runs
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    cast_root_inputs: bool = False  # cast the root's inputs even without mp_policy.cast_forward_inputs
    keep_low_precision_grads: bool = False  # leave reduced gradients in the reduce dtype
    buffer_dtype: torch.dtype | None = None  # cast managed buffers for compute
    full_precision_in_eval: bool = False  # eval-mode forwards gather and compute in the parameters' dtype
    sync_module_states: bool = False  # broadcast the first rank's parameters and buffers first
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None  # param -> Shard(dim) | None (dim 0)
    presentation: DTensorShards | None = None  # how shards are shown (None: DTensors); see [Note: Presentations]
    flat_layout: bool = False  # FSDP1's flat parameter layout (see [Note: Flat layout] in layout.py)
    # A new root's lazy init takes over units below it that another root already
    # initialized (FSDP1: wrapping a trained model again); False: that raises (FSDP2).
    readopt_units: bool = False

    def model_name(self, name: str) -> str:
        """``name`` (from a module-tree walk) as the user's model names it."""
        return name if self.name_in_model is None else self.name_in_model(name)


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


_Method = TypeVar("_Method", bound=Callable[..., Any])


def outside_transforms(method: _Method) -> _Method:
    """Runs a buffer transition with functorch transforms (``torch.func.jvp``)
    switched off: buffers it allocates must stay plain tensors whose storage
    can be freed, not wrappers of the transform's level."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._are_functorch_transforms_active():
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return cast(_Method, run)
