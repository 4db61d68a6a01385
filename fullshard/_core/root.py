"""What a unit asks of the root it sits under (the root's ``schedule.Schedule``),
named without importing it: the root knows the units, not the reverse.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol, TypeVar

import torch

from .param import ShardParam

_Unit = TypeVar("_Unit", contravariant=True)

# At DETAIL debug level: starts a unit's reduction of ``grads`` (of ``params``) once
# the ranks agreed on it (see [Note: Execution order]); (unit, params, grads).
ReductionGate = Callable[[Any, list[ShardParam], list[torch.Tensor]], None]


class UnitRoot(Protocol[_Unit]):
    def queue_end_of_backward(self) -> None: ...
    def after_backward(self, unit: _Unit) -> None: ...


class Unrooted:
    """A unit's root before the root's lazy init: gradients may arrive (an explicit
    ``unshard()`` then backward) but no step has started."""

    def queue_end_of_backward(self) -> None:
        pass

    def after_backward(self, unit: object) -> None:
        pass
