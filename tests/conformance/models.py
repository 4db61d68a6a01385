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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block2(self.block1(self.inp(x)))
        if self.kind == "buffers":
            h = h * self.scale
        # Each input in its layer's dtype: under mixed precision an ignored layer (ignored_modules, ignored
        # states) keeps fp32 parameters between bf16 ones (a no-op cast everywhere else).
        h = self.mid(h.to(self.mid.weight.dtype))
        if self.kind == "tied":
            h = self.out2(torch.relu(h).to(self.out2.weight.dtype))
        return self.out(h.to(self.out.weight.dtype))


MODEL_KINDS = ("nested", "tied", "frozen", "buffers", "norm")


def build(kind: str) -> Net:
    torch.manual_seed(0)
    return Net(kind)


def batch(step: int, rank: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank + 1)
    return torch.randn(4, IN_DIM, generator=gen)
