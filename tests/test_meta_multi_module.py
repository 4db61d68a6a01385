"""Meta-device init of a unit over several modules (issue 22, breakage 4).

``fully_shard([norm, head])`` under the meta device, then ``model.to_empty()``,
as torchtitan builds its models: ``to_empty`` visits ``norm`` and ``head`` one
after the other, so the unit sees half of its parameters moved at a time. Every
parameter must end up materialized, and training must match torch's FSDP2 run
the same way.
"""

import pytest
import torch
import torch.nn as nn
from torch.distributed.fsdp import fully_shard as torch_fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from fullshard import fully_shard
from fullshard.testing import distributed, train_steps

TORCH_VERSION = tuple(int(part) for part in torch.__version__.split(".")[:2])


class _Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.body = nn.Linear(8, 8)
        self.norm = nn.LayerNorm(8)
        self.head = nn.Linear(8, 16)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.norm(torch.relu(self.body(self.embed(tokens)))))


def _build_on_meta_and_materialize(shard) -> nn.Module:
    with torch.device("meta"):
        model = _Head()
    shard(model.body)
    shard([model.norm, model.head])
    shard(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        for index, param in enumerate(model.parameters()):  # the same values whatever the layout
            full = torch.randn(param.shape, generator=torch.Generator().manual_seed(index))
            if isinstance(param, DTensor):
                full = distribute_tensor(full, param.device_mesh, param.placements)
            param.copy_(full)
    return model


def _train(model: nn.Module) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    batches = [torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(step)) for step in range(3)]
    return train_steps(model, optim, batches, lambda m, tokens: m(tokens).logsumexp(-1).mean())


@distributed(world_size=2)
def test_to_empty_materializes_every_module_of_a_unit():
    ours = _build_on_meta_and_materialize(fully_shard)
    for name, param in ours.named_parameters():
        assert not param.is_meta, f"{name} is still on the meta device after to_empty"
        assert not param.to_local().is_meta, f"{name}'s shard is still on the meta device after to_empty"
    theirs = _build_on_meta_and_materialize(torch_fully_shard)
    for name, param in theirs.named_parameters():
        assert not param.is_meta, f"torch's FSDP2 left {name} on meta"
    reference = _build_on_meta_and_materialize(lambda module: module)  # one process's model, same values
    ours_losses, their_losses, reference_losses = _train(ours), _train(theirs), _train(reference)
    assert ours_losses == pytest.approx(reference_losses, rel=1e-6), (ours_losses, reference_losses)
    if TORCH_VERSION >= (2, 13):  # torch 2.8's FSDP2 trains a list unit unlike one process (from step 2 on)
        assert ours_losses == pytest.approx(their_losses, rel=1e-6), (ours_losses, their_losses)
