"""Lightning (Fabric and Trainer) with ``ModelParallelStrategy`` over fullshard (issue 22, breakage 3).

Lightning finds FSDP2 units by torch's ``FSDPModule``; after
``fullshard.use_in_place_of_torch()`` it finds ours. Gradient accumulation
(``fabric.no_backward_sync``) must then reach our units: no reduce-scatter on
the no-sync micro-batches (counted with the comm spy), and the same losses as
torch's FSDP2 under the same Lightning code.
"""

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard._core import comm
from fullshard.testing import distributed

# Out of the inner loop, and not even collected there (the Makefile's INNER_LOOP_SKIPS): importing Lightning
# costs about 2 s before the first test; make test runs the file.
pytestmark = pytest.mark.slow

lightning = pytest.importorskip(
    "lightning", reason="lightning is an optional test dependency (pip install -e '.[libraries]')"
)
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


class _Module(lightning.LightningModule):
    def __init__(self, fully_shard) -> None:
        super().__init__()
        self.fully_shard = fully_shard
        self.model = _model()
        self.losses: list[float] = []

    def configure_model(self) -> None:
        _parallelize_with(self.fully_shard)(self.model, self.device_mesh)

    def training_step(self, batch: list[torch.Tensor], index: int) -> torch.Tensor:
        loss = self.model(batch[0]).pow(2).mean()
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.AdamW(self.parameters(), lr=0.01)

    def train_dataloader(self) -> torch.utils.data.DataLoader:
        data = torch.randn(64, 8, generator=torch.Generator().manual_seed(3))
        return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(data), batch_size=4)


def trainer_fit(fully_shard, max_steps: int, ckpt_path: str | None = None, save_to: str | None = None) -> list[float]:
    from lightning.pytorch.strategies import ModelParallelStrategy as TrainerModelParallel

    as_torchelastic_rank()
    trainer = lightning.Trainer(
        accelerator="cpu", devices=2, max_steps=max_steps, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False,
        strategy=TrainerModelParallel(data_parallel_size=2, tensor_parallel_size=1),
    )  # fmt: skip
    module = _Module(fully_shard)
    trainer.fit(module, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)  # a sharded (DCP) checkpoint directory
    return module.losses


@distributed(world_size=2)
def test_trainer_fit_and_resume_like_torch():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    path = comm.broadcast_object(os.path.join(tempfile.mkdtemp(), "ckpt") if dist.get_rank() == 0 else None)
    with fullshard.use_in_place_of_torch():
        ours = trainer_fit(fullshard.fully_shard, 4, save_to=path)
        ours += trainer_fit(fullshard.fully_shard, 8, ckpt_path=path)
    # Lightning restarts the interrupted epoch's data on resume: compare with torch's
    # FSDP2 through the same save and resume, whose losses differ if either restores wrongly.
    theirs = trainer_fit(torch_fully_shard, 4, save_to=path + "-torch")
    theirs += trainer_fit(torch_fully_shard, 8, ckpt_path=path + "-torch")
    assert len(ours) == 8
    assert ours[4] < ours[0], "the resumed run starts from the initial weights: nothing was restored"
    assert ours == pytest.approx(theirs, rel=1e-5), (ours, theirs)
