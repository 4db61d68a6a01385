"""The FSDP1 wrapper's flat parameter (``use_orig_params=False``): a unit's shard
buffer, in FSDP1's flat layout (see [Note: Flat layout] in _core/layout.py),
registered as one ``nn.Parameter`` that the optimizer steps in place.

The engine sees it only as a ``BufferView`` (``_core/presentation.py``); state
dicts, clipping and the scaler find its unit through the engine
(``_core/unit/group.py``) and never import this module.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from ._core import compat
from ._core.presentation import DTensorShards, PresentedParam
from ._core.unit import ParamGroup, register_param_unit
from ._names import state_dict_name

FLAT_PARAM = "_flat_param"


class FlatPieces(DTensorShards):
    """The presentation of a parameter's piece of the flat shard (see [Note: Flat layout]
    in _core/layout.py): a plain 1D tensor, since a piece may start mid-row (no DTensor
    describes it). Only the flat parameter is registered; pieces stand behind it."""

    def present(self, param: PresentedParam, rows: torch.Tensor) -> torch.Tensor:
        return rows

    def rows_from_presented(self, param: PresentedParam, presented: torch.Tensor) -> torch.Tensor:
        return presented

    def rebind(self, sharded: nn.Parameter, presented: torch.Tensor) -> None:
        sharded.data = presented


FLAT_PIECES = FlatPieces()


def _names_from(module: nn.Module, unit: ParamGroup) -> tuple[str, ...]:
    """Each of ``unit``'s parameters named from ``module``, without checkpoint wrappers' prefixes."""
    paths = {m: path for path, m in module.named_modules()}
    names = []
    for param in unit.spec.params:
        path = paths[param.module_info.module]
        name = f"{path}.{param.module_info.param_name}" if path else param.module_info.param_name
        names.append(state_dict_name(name))
    return tuple(names)


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
        # The parameters it holds, named from ``module`` as its state dict names them: torch's
        # state-dict API reads this (FSDP1's attribute) to name a flat parameter's optimizer states.
        setattr(self.param, "_fqns", _names_from(module, unit))  # noqa: B010 - an attribute nn.Parameter lacks
        register_param_unit(self.param, unit)  # clip_grad_norm_ and the scaler find its replicas
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

    @torch.no_grad()
    def adopt_assigned_data(self) -> None:
        """``flat_param.data = t`` since the last forward: ``t``'s values become the shard, which the
        flat parameter views again (a plain module keeps an assigned ``.data`` too).

        Raises:
            RuntimeError: ``t`` is not of the shard's shape.
        """
        shard = self.unit.buffers.shard_buffer
        if self.param.shape == shard.shape and self.param.data_ptr() == shard.data_ptr():
            return
        if self.param.shape != shard.shape:
            raise RuntimeError(
                f"{self.unit.spec.name}'s flat parameter was given a tensor of shape {tuple(self.param.shape)}, "
                f"but it is this rank's flat shard of shape {tuple(shard.shape)}: change values in place or "
                "assign a tensor of the shard's shape"
            )
        shard.copy_(self.param.detach())
        self.param.data = shard

    def hide(self) -> None:
        del self.module._parameters[self.name]

    def show(self) -> None:
        self.module._parameters[self.name] = self.param
