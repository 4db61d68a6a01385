"""Lightning (Fabric and Trainer) with ``ModelParallelStrategy`` over fullshard (issue 22, breakage 3).

Lightning finds FSDP2 units by torch's ``FSDPModule``; after
``fullshard.use_in_place_of_torch()`` it finds ours. Gradient accumulation
(``fabric.no_backward_sync``) must then reach our units: no reduce-scatter on
the no-sync micro-batches (counted with the comm spy), and the same losses as
torch's FSDP2 under the same Lightning code.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard._core import comm
from fullshard.testing import distributed

lightning = pytest.importorskip("lightning", reason="lightning is an optional test dependency (pip install -e '.[libraries]')")
from lightning.fabric import Fabric  # noqa: E402
from lightning.fabric.strategies import ModelParallelStrategy  # noqa: E402

NUM_MICROBATCHES = 3


def as_torchelastic_rank() -> None:
    """Tells Lightning the ranks already exist (it would spawn its own otherwise)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        TORCHELASTIC_RUN_ID="fullshard-tests", RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0",
        WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _parallelize_with(fully_shard):
    def parallelize(model: nn.Module, mesh) -> nn.Module:
        dp_mesh = mesh["data_parallel"]
        for index in (0, 2):
            fully_shard(model[index], mesh=dp_mesh)
        return fully_shard(model, mesh=dp_mesh)

    return parallelize


def fabric_with_accumulation(fully_shard) -> tuple[list[float], list[int]]:
    """Losses of 3 steps of 3 micro-batches, and the reduce-scatters each micro-batch issued."""
    as_torchelastic_rank()
    strategy = ModelParallelStrategy(_parallelize_with(fully_shard), data_parallel_size=2, tensor_parallel_size=1)
    fabric = Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    model = fabric.setup(_model())
    optimizer = fabric.setup_optimizers(torch.optim.SGD(model.parameters(), lr=0.1))
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses, reductions = [], []
    for _ in range(3):
        for index in range(NUM_MICROBATCHES):
            inputs = torch.randn(4, 8, generator=generator)
            is_last = index == NUM_MICROBATCHES - 1
            with comm.record_comms() as records, fabric.no_backward_sync(model, enabled=not is_last):
                loss = model(inputs).pow(2).mean()
                fabric.backward(loss / NUM_MICROBATCHES)
            reductions.append(sum(r.op == "reduce_scatter" for r in records))
            losses.append(loss.item())
        optimizer.step()
        optimizer.zero_grad()
    return losses, reductions


@distributed(world_size=2)
def test_fabric_accumulation_skips_reductions_like_torch():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    with fullshard.use_in_place_of_torch():
        losses, reductions = fabric_with_accumulation(fullshard.fully_shard)
    num_units = 3
    assert reductions == [0, 0, num_units] * 3, reductions
    torch_losses, _ = fabric_with_accumulation(torch_fully_shard)
    assert losses == pytest.approx(torch_losses, rel=1e-6)


@distributed(world_size=2)
def test_without_the_opt_in_lightning_misses_our_units():
    """What issue 22 reported: every micro-batch reduced (the right values, all the traffic)."""
    _, reductions = fabric_with_accumulation(fullshard.fully_shard)
    assert reductions == [3, 3, 3] * 3, reductions
