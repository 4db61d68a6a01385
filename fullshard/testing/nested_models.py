"""Small nested models with several wrappable units, shaped like ``NestedWrappedModule``
and ``NonUniformReqGradNWM`` of PyTorch's FSDP tests (our own code).

Build the plain model once, deepcopy it for the reference, and call
``wrap_units`` on the other copy: both start from the same weights without
relying on wrapping to leave the random number generator alone.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn as nn


class NestedWrappedModule(nn.Module):
    """``self.module = Sequential(Linear(8, 4), Sequential(Linear(4, 16), Linear(16, 16)),
    Linear(16, 4), Linear(4, 8))``; ``wrap_units`` wraps ``module.1.0``, then
    ``module.1`` around it, and ``module.2``: nested units next to an unwrapped
    first and last layer, which belong to whatever wraps the whole model.

    Args:
        seed: parameters are drawn from ``torch.manual_seed(seed)``.
    """

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        first = nn.Linear(8, 4)
        middle = nn.Sequential(nn.Linear(4, 16), nn.Linear(16, 16))
        tail: list[nn.Module] = [nn.Linear(16, 4), nn.Linear(4, 8)]
        self.module = nn.Sequential(first, middle, *self._arrange_tail(tail))

    @staticmethod
    def _arrange_tail(tail: list[nn.Module]) -> list[nn.Module]:
        return tail

    def wrap_units(self, wrap: Callable[[nn.Module], nn.Module]) -> NestedWrappedModule:
        """Replaces ``module.1.0``, ``module.1`` and ``module.2`` by ``wrap(...)`` of
        themselves (innermost first); returns ``self``."""
        middle = self.module[1]
        assert isinstance(middle, nn.Sequential)  # built so above; a subclass may wrap it later
        middle[0] = wrap(middle[0])
        self.module[1] = wrap(middle)
        self.module[2] = wrap(self.module[2])
        return self

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)

    @staticmethod
    def get_input(rank: int, device: torch.device | None = None) -> tuple[torch.Tensor]:
        """A (4, 8) batch that differs per rank and is the same on every call."""
        generator = torch.Generator().manual_seed(1 + rank)
        return (torch.rand(4, 8, generator=generator).to(device),)

    @staticmethod
    def get_loss(inputs: tuple[torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        return output.sum()


class NonUniformReqGradNWM(NestedWrappedModule):
    """``NestedWrappedModule`` with its last two layers in one ``Sequential``
    (``module.2``, one unit) and every parameter frozen except those of the last
    layer (``module.2.1``): units that are wholly frozen, one that mixes frozen
    and trainable parameters (``use_orig_params=True`` only), and ranks whose
    optimizer sees few gradients. The same seed gives the same weights as
    ``NestedWrappedModule``.

    PyTorch's flat parameters put all of ``module.2.1`` on the last rank; our
    per-parameter row sharding gives each rank rows of it. A rank with no
    gradient at all needs a parameter with fewer rows than ranks (see the grad
    scaler tests).
    """

    TRAINABLE_PREFIX = "module.2.1."

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        for name, param in self.named_parameters():
            if not name.startswith(self.TRAINABLE_PREFIX):
                param.requires_grad_(False)

    @staticmethod
    def _arrange_tail(tail: list[nn.Module]) -> list[nn.Module]:
        return [nn.Sequential(*tail)]
