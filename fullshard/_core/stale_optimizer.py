"""An optimizer built before sharding: it holds the parameters ``fully_shard`` replaced.

[Note: Optimizer built before sharding]
Sharding registers new parameter objects (the shards, as DTensors or flat
pieces); the originals leave the model. An optimizer built from
``model.parameters()`` before that holds the originals: their ``.grad`` stays
None, so its ``step()`` changes nothing, silently (torch's FSDP behaves the
same). The originals that sharding replaced are remembered weakly, by identity;
the first ``step()`` of every optimizer, through one global step pre-hook
registered at the first replacement, checks its parameters against them once
and warns. Later steps cost one weak-set lookup.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn as nn
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

_replaced: WeakIdKeyDictionary = WeakIdKeyDictionary()  # original parameter -> its name in the model
_checked: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
_hook: RemovableHandle | None = None


def remember_replaced(pairs: Iterable[tuple[nn.Parameter, str]]) -> None:
    """Records parameters that sharding took out of the model (with their FQNs)."""
    global _hook
    for param, name in pairs:
        _replaced[param] = name
    if _hook is None and len(_replaced):
        _hook = register_optimizer_step_pre_hook(_check_once)


def _check_once(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
    if optimizer in _checked:
        return
    _checked.add(optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    stale = [_replaced[p] for p in params if p in _replaced]
    if not stale:
        return
    held = "none of the sharded model's" if len(stale) == len(params) else f"{len(params) - len(stale)} others"
    warnings.warn(
        f"{type(optimizer).__name__} holds {len(stale)} parameter(s) that fully_shard replaced "
        f"(e.g. {stale[0]}) and {held}: it steps nothing for them. Build the optimizer after sharding, "
        "from the sharded model's parameters()",
        UserWarning,
        stacklevel=3,
    )
