"""Models the tests share, shaped like the ones PyTorch's FSDP tests use."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


class TransformerWithSharedParams(nn.Module):
    """``nn.Transformer`` (2 encoder + 2 decoder layers) between a token embedding and
    an output projection that share one weight, with a float and a long buffer and
    an optional BatchNorm: shared parameters, buffers of two dtypes, and the
    encoder/decoder layer classes for ``ModuleWrapPolicy``.

    Args:
        seed: parameters are drawn from ``torch.manual_seed(seed)``.
        add_bn: include ``BatchNorm1d`` over the batch dimension.
        dropout: the transformer's dropout (0 keeps training deterministic).
    """

    vocab_size = 23
    batch_size = 2
    vocab_bias: torch.Tensor  # buffers (registered in __init__)
    long_buffer: torch.Tensor

    def __init__(self, seed: int = 0, add_bn: bool = True, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        d_model = 16
        self.embed_tokens = nn.Embedding(self.vocab_size, d_model)
        self.transformer = nn.Transformer(
            d_model=d_model,
            nhead=2,
            num_encoder_layers=2,
            num_decoder_layers=2,
            dim_feedforward=8,
            dropout=dropout,
        )
        self.output_proj = nn.Linear(d_model, self.vocab_size)
        self.output_proj.weight = self.embed_tokens.weight  # shared
        self.register_buffer("vocab_bias", torch.ones(d_model))
        self.register_buffer("long_buffer", torch.zeros(d_model, dtype=torch.long))
        self.bn = nn.BatchNorm1d(self.batch_size) if add_bn else nn.Identity()

    def get_input(self, seed: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(source, target) token ids, sequence-first: (6, B) and (4, B)."""
        generator = torch.Generator().manual_seed(seed)
        src = torch.randint(self.vocab_size, (6, self.batch_size), generator=generator)
        tgt = torch.randint(self.vocab_size, (4, self.batch_size), generator=generator)
        return src.to(device), tgt.to(device)

    def forward(self, src_ids: torch.Tensor, tgt_ids: torch.Tensor) -> torch.Tensor:
        src = self.embed_tokens(src_ids) + self.vocab_bias + self.long_buffer.type_as(self.vocab_bias)
        tgt = self.bn(self.embed_tokens(tgt_ids))
        return self.output_proj(self.transformer(src, tgt))

    @staticmethod
    def get_loss(inputs: tuple[torch.Tensor, torch.Tensor], output: torch.Tensor) -> torch.Tensor:
        _, tgt = inputs
        return F.cross_entropy(output.reshape(-1, output.size(-1)), tgt.reshape(-1), reduction="sum")

    def get_ignored_modules(self) -> list[nn.Module]:
        return [self.transformer]


class ThreeLinears(nn.Module):
    """Three 10x10 linears in a row: the small model of the hybrid-sharding tests."""

    def __init__(self) -> None:
        super().__init__()
        self.lin1, self.lin2, self.lin3 = nn.Linear(10, 10), nn.Linear(10, 10), nn.Linear(10, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin3(self.lin2(self.lin1(x)))


class UnitModule(nn.Module):
    """``l1 -> (relu, linear, relu) -> l2``: the unit ``ModuleWrapPolicy`` picks out."""

    def __init__(self, dim: int = 16, device: torch.device | None = None) -> None:
        super().__init__()
        self.l1 = nn.Linear(dim, dim, device=device)
        self.seq = nn.Sequential(nn.ReLU(), nn.Linear(dim, dim, device=device), nn.ReLU())
        self.l2 = nn.Linear(dim, dim, device=device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.l2(self.seq(self.l1(x)))


class CompositeParamModel(nn.Module):
    """A linear, two ``UnitModule``s, a bare parameter and a buffer: parameters at
    every level of the tree."""

    buffer: torch.Tensor  # registered in __init__

    def __init__(self, dim: int = 16, device: torch.device | None = None, seed: int = 0) -> None:
        super().__init__()
        torch.manual_seed(seed)
        self.l = nn.Linear(dim, dim, device=device)
        self.u1 = UnitModule(dim, device)
        self.u2 = UnitModule(dim, device)
        self.p = nn.Parameter(torch.randn((dim, dim), device=device))
        self.register_buffer("buffer", torch.randn((dim, dim), device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.mm(self.u2(self.u1(self.l(x))), self.p) + self.buffer.sum()


class NF4LoRALinear(nn.Module):
    """A frozen NF4 base weight (torchao's tensor subclass) plus a trainable low-rank update:
    a QLoRA layer, for the tensor-subclass tests and benchmark (needs torchao)."""

    def __init__(self, dim: int, rank: int = 8) -> None:
        from torchao.quantization import to_nf4

        super().__init__()
        self.base = nn.Linear(dim, dim, bias=False)
        self.base.weight = nn.Parameter(to_nf4(self.base.weight.detach().to(torch.bfloat16)), requires_grad=False)
        self.lora_a = nn.Linear(dim, rank, bias=False)
        self.lora_b = nn.Linear(rank, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_b(self.lora_a(x))
