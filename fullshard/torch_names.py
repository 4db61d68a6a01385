"""Point ``torch.distributed.fsdp``'s public names at fullshard's, for libraries
that look them up (Lightning, accelerate, torchtitan, peft's helpers).

Usage, before the library is imported (it binds the names it imports then)::

    import fullshard
    fullshard.use_in_place_of_torch()      # or: with fullshard.use_in_place_of_torch(): ...
    import lightning                      # its FSDPModule checks now find fullshard's units
    ...
    fullshard.restore_torch_names()        # torch's own names again

Each module in ``TORCH_MODULES`` that this torch has gets, for every public
name fullshard also defines (``fullshard`` and ``fullshard.wrap``), fullshard's
object in place of torch's; the private paths libraries import from
(``torch.distributed.fsdp._fully_shard``, ``torch.distributed._composable.fsdp``)
are among them. Names fullshard lacks (``FlatParameter``) stay torch's.
Nothing of torch's FSDP is called: its modules are imported to rebind names
in them, and the originals are kept to be put back.

torch's own state-dict API (``torch.distributed.checkpoint.state_dict``:
``get_state_dict``, ``set_state_dict`` and friends) is such a library: it finds
FSDP1 wrappers by torch's class, which it imported as ``FSDP``, and asks torch's
private helpers about them. Its names are rebound too (``STATE_DICT_API``), so that
it treats fullshard's wrapper as FSDP1: optimizer states keyed by the parameters'
own names, shards saved as shards. Without the rebinding the wrapper refuses that
API (``FullyShardedDataParallel._fqn_modifiers``) rather than be taken for a plain
module.
"""

# clean-room: rebinds torch's names only

from __future__ import annotations

import importlib
from types import ModuleType, TracebackType
from typing import Any

from . import wrap

__all__ = [
    "STATE_DICT_API",
    "TORCH_MODULES",
    "TorchNamesRebound",
    "restore_torch_names",
    "state_dict_api_rebound",
    "use_in_place_of_torch",
]

# The paths libraries import torch's FSDP names from. torch's implementation
# modules (``_fully_shard._fully_shard``) are left alone: their own code reads
# those names, and torch's FSDP must keep working beside fullshard's.
TORCH_MODULES = (
    "torch.distributed.fsdp",
    "torch.distributed.fsdp.api",
    "torch.distributed.fsdp.wrap",
    "torch.distributed.fsdp.fully_sharded_data_parallel",
    "torch.distributed.fsdp.sharded_grad_scaler",
    "torch.distributed.fsdp._fully_shard",
    "torch.distributed._composable.fsdp",
    "torch.distributed._composable.fsdp.fully_shard",
    "torch.distributed.checkpoint.state_dict",
)
STATE_DICT_API = "torch.distributed.checkpoint.state_dict"

# (module, name, torch's object), in the order rebound; undone in reverse.
_replaced: list[tuple[ModuleType, str, Any]] = []


def _ours() -> dict[str, Any]:
    """fullshard's public objects by the names torch gives them."""
    import fullshard  # the package imports this module: bind late

    objects = {name: getattr(fullshard, name) for name in fullshard.__all__ if name not in _NOT_TORCHS}
    objects.update((name, getattr(wrap, name)) for name in wrap.__all__)
    return objects


# fullshard's names that are not torch's FSDP names (or not the same object there).
_NOT_TORCHS = {"FSDP", "use_in_place_of_torch", "restore_torch_names", "hybrid_mesh", "full_state_dict"}


def _extra(module: ModuleType) -> dict[str, Any]:
    """Names a module bound to torch's FSDP under names of its own: the state-dict API's alias
    of the wrapper class, and the private helpers and constants it asks about wrappers."""
    if module.__name__ != STATE_DICT_API:
        return {}
    from .api import HYBRID_STRATEGIES
    from .wrapper import FullyShardedDataParallel

    return {
        "FSDP": FullyShardedDataParallel,
        "_get_module_fsdp_state_if_fully_sharded_module": _wrapper_or_none,
        "HYBRID_SHARDING_STRATEGIES": set(HYBRID_STRATEGIES),
    }


def _wrapper_or_none(module: Any) -> Any:
    """The state of ``module`` if it is a wrapper (which is its own state, as in FSDP1), else None."""
    from .wrapper import FullyShardedDataParallel

    return module if isinstance(module, FullyShardedDataParallel) else None


def state_dict_api_rebound() -> bool:
    """Whether torch's state-dict API now finds fullshard's wrapper as FSDP1."""
    return any(module.__name__ == STATE_DICT_API and name == "FSDP" for module, name, _ in _replaced)


class TorchNamesRebound:
    """What ``use_in_place_of_torch`` did; ``undo()`` (or leaving a ``with`` block) puts torch's names back."""

    def __init__(self, start: int) -> None:
        self._start = start

    def undo(self) -> None:
        while len(_replaced) > self._start:
            module, name, original = _replaced.pop()
            setattr(module, name, original)

    def __enter__(self) -> TorchNamesRebound:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self.undo()


def use_in_place_of_torch() -> TorchNamesRebound:
    """Makes ``torch.distributed.fsdp``'s public names (and those of the private
    paths in ``TORCH_MODULES``) resolve to fullshard's, until undone.

    Call it before importing a library that imports torch's names, or at least
    before it looks them up. Returns a handle whose ``undo()`` restores torch's
    names; it is also a context manager.
    """
    start = len(_replaced)
    ours = _ours()
    for module in _torch_modules():
        for name, obj in {**ours, **_extra(module)}.items():
            current = getattr(module, name, None)
            # A submodule of that name (``torch.distributed.fsdp.wrap``) is not a name to rebind.
            if current is not None and current is not obj and not isinstance(current, ModuleType):
                _replaced.append((module, name, current))
                setattr(module, name, obj)
    return TorchNamesRebound(start)


def _torch_modules() -> list[ModuleType]:
    """All of ``TORCH_MODULES`` this torch has, imported before any name is rebound:
    one imported later would copy fullshard's names, taking them for torch's."""
    modules = []
    for path in TORCH_MODULES:
        try:
            modules.append(importlib.import_module(path))
        except ImportError:  # a path this torch does not have
            continue
    return modules


def restore_torch_names() -> None:
    """Undoes every ``use_in_place_of_torch`` call not undone yet."""
    TorchNamesRebound(0).undo()
