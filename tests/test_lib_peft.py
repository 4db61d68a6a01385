"""peft LoRA under fully_shard: frozen base weights and trainable adapters in
one unit, trained like torch's FSDP2, the adapter saved and loaded back."""

import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import full_state_dict, fully_shard
from fullshard._core import comm
from fullshard.testing import distributed, train_steps

# Out of the inner loop, and not even collected there (the Makefile's INNER_LOOP_SKIPS): importing peft
# costs about 2 s before the first test; make test runs the file.
pytestmark = pytest.mark.slow

peft = pytest.importorskip("peft", reason="peft is an optional test dependency")

TARGETS = ["in_proj", "out_proj"]


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.in_proj, self.out_proj = nn.Linear(8, 16), nn.Linear(16, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.out_proj(torch.relu(self.in_proj(x)))


class _Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(_Block() for _ in range(2))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _lora_model() -> nn.Module:
    torch.manual_seed(0)
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(_Model(), config)


def _shard(model: nn.Module, shard) -> nn.Module:
    for block in model.base_model.model.blocks:
        shard(block)
    shard(model)
    return model


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    return [torch.randn(4, 8, generator=generator) for _ in range(3)]


def _train(model: nn.Module) -> list[float]:
    optim = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.01)
    return train_steps(model, optim, _batches(), lambda m, batch: m(batch).pow(2).mean())


@distributed(world_size=2)
def test_lora_trains_like_torch_and_its_adapter_reloads():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    ours = _shard(_lora_model(), fully_shard)
    trainable = {n for n, p in ours.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    losses = _train(ours)
    assert losses == pytest.approx(_train(_shard(_lora_model(), torch_fully_shard)), rel=1e-5)

    full = full_state_dict(ours)  # every rank: a collective
    probe = torch.randn(4, 8, generator=torch.Generator().manual_seed(9))
    expected = ours(probe).detach()
    directory = comm.broadcast_object(tempfile.mkdtemp() if dist.get_rank() == 0 else None)
    if dist.get_rank() == 0:
        ours.save_pretrained(directory, state_dict=full)
    dist.barrier()
    torch.manual_seed(0)
    reloaded = peft.PeftModel.from_pretrained(_Model(), directory)
    adapter = {n: p for n, p in reloaded.named_parameters() if "lora_" in n}
    assert adapter.keys() == trainable
    for name, param in adapter.items():
        torch.testing.assert_close(param, full[name], rtol=0, atol=0)
    torch.testing.assert_close(reloaded(probe), expected)
