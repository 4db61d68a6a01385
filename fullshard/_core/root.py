"""What a unit asks of the root it sits under (``context.RootContext``), named
without importing the context: the context knows the units, not the reverse.
"""

from __future__ import annotations

from typing import Protocol, TypeVar

import torch

from .param import ShardParam

_Unit = TypeVar("_Unit", contravariant=True)


class UnitRoot(Protocol[_Unit]):
    def queue_end_of_backward(self) -> None: ...
    def record_post_forward(self, group: _Unit) -> int: ...
    def prefetch(self, group: _Unit) -> None: ...
    def reduce(self, group: _Unit, params: list[ShardParam], grads: list[torch.Tensor]) -> None: ...


class Unrooted:
    """A unit's root before the root's lazy init: gradients may arrive (an explicit
    ``unshard()`` then backward) but no step has started."""

    def queue_end_of_backward(self) -> None:
        pass

    def record_post_forward(self, group: object) -> int:
        raise AssertionError(f"{group} ran forward before its root's lazy init")

    def prefetch(self, group: object) -> None:
        raise AssertionError(f"{group} prefetched before its root's lazy init")

    def reduce(self, group: object, params: list[ShardParam], grads: list[torch.Tensor]) -> None:
        raise AssertionError(f"{group} reduced before its root's lazy init")
