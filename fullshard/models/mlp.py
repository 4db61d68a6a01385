"""A two-layer MLP, the smallest model with more than one parameterized child."""

from __future__ import annotations

import torch
import torch.nn as nn


class MLP(nn.Module):
    """``in_proj -> relu -> out_proj`` (+ an optional buffer added to the output).

    Args:
        dim: input and output width.
        device: where to create the parameters.
        bias: whether the projections have biases.
        with_buffer: register a ``buffer`` of shape ``(dim,)``; shows that
            buffers travel with the module.
        dim_multiplier: hidden width is ``dim_multiplier * dim`` (odd values
            give uneven shards).
    """

    def __init__(
        self,
        dim: int,
        device: torch.device | None = None,
        *,
        bias: bool = True,
        with_buffer: bool = False,
        dim_multiplier: int = 4,
    ) -> None:
        super().__init__()
        self.in_proj = nn.Linear(dim, dim_multiplier * dim, device=device, bias=bias)
        self.out_proj = nn.Linear(dim_multiplier * dim, dim, device=device, bias=bias)
        if with_buffer:
            self.register_buffer("buffer", torch.randn((dim,), device=device))
        else:
            self.buffer = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = self.out_proj(torch.relu(self.in_proj(x)))
        if self.buffer is not None:
            z = z + self.buffer
        return z

    def reset_parameters(self) -> None:
        if self.buffer is not None:
            torch.nn.init.normal_(self.buffer)
