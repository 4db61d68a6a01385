"""The FSDP1 wrapper's flat parameter (``use_orig_params=False``): a unit's shard
buffer registered as one ``nn.Parameter`` that the optimizer steps in place.

The engine sees it only as a ``BufferView`` (``_core/buffer_view.py``); what
it means to state dicts, clipping and the scaler is answered here.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._core import compat
from ._core.group import ParamGroup

FLAT_PARAM = "_flat_param"
# On a flat parameter or a plain shard view: its unit, for clip_grad_norm_ and the scaler.
UNIT_ATTR = "_fullshard_unit"


class FlatParamView:
    """A ``BufferView``: the unit's shard buffer as ``module.<name>``.

    Raises:
        ValueError: the unit mixes dtypes or frozen and trainable parameters
            (one flat tensor has one dtype and one ``requires_grad``).
    """

    def __init__(self, unit: ParamGroup, module: nn.Module, name: str = FLAT_PARAM) -> None:
        dtypes = {p.orig_dtype for p in unit.spec.params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{p.fqn}: {p.orig_dtype}" for p in unit.spec.params)
            raise ValueError(
                f"use_orig_params=False expects one dtype per unit, but {unit.spec.name} mixes {listing}; "
                "use use_orig_params=True or wrap the differently-typed modules separately"
            )
        requires_grad = {p.sharded_param.requires_grad for p in unit.spec.params}
        if len(requires_grad) > 1:
            frozen = [p.fqn for p in unit.spec.params if not p.sharded_param.requires_grad]
            raise ValueError(
                f"use_orig_params=False expects all parameters of a unit to share requires_grad, but "
                f"{unit.spec.name} has frozen {frozen} next to trainable ones (a flat parameter would "
                "let the optimizer change the frozen ones); use use_orig_params=True or wrap the frozen "
                "modules in their own unit"
            )
        self.unit = unit
        self.module = module  # where the flat parameter is registered, as ``name``
        self.name = name
        self.param = nn.Parameter(unit.buffers.shard_buffer, requires_grad=requires_grad.pop())
        # Lets clip_grad_norm_ and the scaler find its replicas (an attribute Parameter's type does not declare).
        setattr(self.param, UNIT_ATTR, unit)
        if unit.spec.keep_low_precision_grads:
            compat.set_grad_dtype(self.param, unit.buffers.reduce_dtype, unit.spec.name)
        module.register_parameter(name, self.param)
        unit.buffers.install_view(self, unit.spec.name)

    @property
    def tensor(self) -> torch.Tensor:
        return self.param

    def sync_requires_grad(self) -> None:
        """``requires_grad_`` on the flat parameter (``module.requires_grad_(False)``
        on a wrapped unit) freezes or unfreezes every parameter in it."""
        for param in self.unit.spec.params:
            if param.sharded_param.requires_grad != self.param.requires_grad:
                param.sharded_param.requires_grad_(self.param.requires_grad)

    def hide(self) -> None:
        del self.module._parameters[self.name]

    def show(self) -> None:
        self.module._parameters[self.name] = self.param


def flat_view(unit: ParamGroup | None) -> FlatParamView | None:
    """The unit's flat parameter view, if the wrapper gave it one."""
    view = unit.buffers.view if unit is not None else None
    return view if isinstance(view, FlatParamView) else None


def flat_param(unit: ParamGroup | None) -> nn.Parameter | None:
    """The unit's flat parameter (None for per-parameter shards)."""
    view = flat_view(unit)
    return view.param if view is not None else None


def param_view_of_flat(unit: ParamGroup, index: int, flat: torch.Tensor, full: bool) -> torch.Tensor:
    """Parameter ``index``'s part of a tensor laid out like the shard buffer
    (a flat optimizer state): its DTensor shard, or the full tensor."""
    region = unit.buffers.storage_layout.region(flat, index, flat.dtype)
    shard = unit.spec.params[index].dtensor_from_padded(region)
    return shard.full_tensor() if full else shard
