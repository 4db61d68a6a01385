"""Which unit a tensor the optimizer holds belongs to, for code that gets parameters, not units.

Gradient clipping, the grad scaler and optimizer state dicts are handed what
the optimizer steps. A DTensor carries its mesh; the wrapper's plain tensors do
not: its flat parameter (one tensor over the unit's whole shard buffer) and,
with ``use_orig_params=True``, the 1D views of each parameter's shard. The
front end registers those here; the shared services look them up here, and
never import the front end's classes.
"""

from __future__ import annotations

import torch

from .group import ParamGroup

# On the registered tensor itself: it lives exactly as long as the tensor.
_UNIT_ATTR = "_fullshard_unit"


def register_param_unit(tensor: torch.Tensor, unit: ParamGroup) -> None:
    """Records that ``tensor`` (a plain tensor the optimizer sees) holds shards of ``unit``."""
    setattr(tensor, _UNIT_ATTR, unit)


def unit_of(tensor: torch.Tensor) -> ParamGroup | None:
    """The unit ``tensor`` was registered with (None for DTensors and tensors outside units)."""
    return getattr(tensor, _UNIT_ATTR, None)


def buffer_param(unit: ParamGroup) -> torch.Tensor | None:
    """The one tensor a front end registered over ``unit``'s whole shard buffer (the
    wrapper's flat parameter; see ``buffer_view.py``), if any."""
    return unit.buffers.view.tensor if unit.buffers.view is not None else None
