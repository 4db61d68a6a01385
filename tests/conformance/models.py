"""The matrix's models: small, uneven sizes (11, 7, 5 rows do not divide by 2 or 4), built from a seed.

Each is a root with ``Block`` children: the wrapper wraps every ``Block`` (and the root), ``fully_shard``
shards every ``Block`` then the root.
"""

from __future__ import annotations

import torch
import torch.nn as nn

IN_DIM = 3


class Block(nn.Module):
    def __init__(self, norm: bool = False) -> None:
        super().__init__()
        self.lin1 = nn.Linear(5, 7)
        self.lin2 = nn.Linear(7, 5)
        self.norm = nn.LayerNorm(5) if norm else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.lin2(torch.tanh(self.lin1(x)))
        return self.norm(y) if self.norm is not None else y


class Net(nn.Module):
    """``inp -> block1 -> block2 -> out``; ``kind`` picks the variation on it."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.inp = nn.Linear(IN_DIM, 5)
        self.block1 = Block(norm=kind == "norm")
        self.block2 = Block(norm=kind == "norm")
        self.mid = nn.Linear(5, 5)
        self.out = nn.Linear(5, 2)
        if kind == "tied":  # one Parameter under two names, both in the root's unit
            self.out2 = nn.Linear(5, 5)
            self.out2.weight = self.mid.weight
        if kind == "frozen":
            self.block1.lin1.requires_grad_(False)
            self.mid.requires_grad_(False)
        if kind == "buffers":
            self.register_buffer("scale", torch.full((5,), 0.5))
        self.kind = kind
        # Each input in its layer's dtype, read inside the layer's forward (a unit's weight is gathered by
        # then): under mixed precision an ignored layer (ignored_modules, ignored_states) keeps fp32 weights
        # between bf16 ones, so both sides would raise a dtype mismatch instead of training. A no-op cast
        # everywhere else.
        for layer in (self.mid, self.out, getattr(self, "out2", None)):
            if layer is not None:
                layer.register_forward_pre_hook(_input_in_weight_dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.block1(self.inp(x)))
        if self.kind == "buffers":
            h = h * self.scale
        h = self.mid(h)
        if self.kind == "tied":
            h = self.out2(torch.relu(h))
        return self.out(h)


def _input_in_weight_dtype(layer: nn.Module, args: tuple) -> tuple:
    return (args[0].to(layer.weight.dtype),)


MODEL_KINDS = ("nested", "tied", "frozen", "buffers", "norm")


def build(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(kind)


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank + 1)
    return torch.randn(4, IN_DIM, generator=gen)
