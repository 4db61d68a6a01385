"""accelerate's FSDP2 plugin over fullshard (issue 22, breakage 3).

accelerate imports torch's ``fully_shard`` / ``FSDPModule`` when it prepares a
model; after ``fullshard.use_in_place_of_torch()`` it shards with ours, and a
model the user already sharded with fullshard is recognised and left as it is
(it used to be sharded again by torch's ``fully_shard``: ``TypeError:
Invariant encountered``). Losses equal torch's FSDP2 through the same calls.
"""

import os

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard
from fullshard.testing import distributed

# Out of the inner loop, and not even collected there (the Makefile's INNER_LOOP_SKIPS): importing accelerate
# costs a tenth of a second before the first test; make test runs the file.
pytestmark = pytest.mark.slow

accelerate = pytest.importorskip("accelerate", reason="accelerate is an optional test dependency")
from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin  # noqa: E402


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))


def _accelerator() -> accelerate.Accelerator:
    rank, world = dist.get_rank(), dist.get_world_size()
    os.environ.update(
        RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1", MASTER_PORT="29500",
    )  # fmt: skip
    accelerate.state.AcceleratorState._reset_state(reset_partial_state=True)
    plugin = FullyShardedDataParallelPlugin(fsdp_version=2, reshard_after_forward=True)
    accelerator = accelerate.Accelerator(cpu=True, fsdp_plugin=plugin)
    # accelerate enables FSDP on accelerators only; on CPU ranks (gloo) say it is on.
    accelerator.state.distributed_type = DistributedType.FSDP
    accelerator.state.fsdp_plugin = plugin
    return accelerator


def train(model: nn.Module) -> list[float]:
    accelerator = _accelerator()
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.01)
    model, optimizer = accelerator.prepare(model, optimizer)
    generator = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        loss = model(torch.randn(4, 8, generator=generator)).pow(2).mean()
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def _user_sharded(fully_shard) -> nn.Module:
    model = _model()
    fully_shard(model[0])
    fully_shard(model[2])
    return fully_shard(model)


@distributed(world_size=2)
def test_fsdp2_plugin_shards_with_fullshard_like_torch():
    with fullshard.use_in_place_of_torch():
        model = _model()
        ours = train(model)
        assert isinstance(model, fullshard.FSDPModule)
    assert ours == pytest.approx(train(_model()), rel=1e-5)


@distributed(world_size=2)
def test_a_model_the_user_sharded_is_left_as_it_is():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    with fullshard.use_in_place_of_torch():
        model = _user_sharded(fullshard.fully_shard)
        units = [m for m in model.modules() if isinstance(m, fullshard.FSDPModule)]
        ours = train(model)
        assert [m for m in model.modules() if isinstance(m, fullshard.FSDPModule)] == units
    assert ours == pytest.approx(train(_user_sharded(torch_fully_shard)), rel=1e-5)


@distributed(world_size=2)
def test_without_the_opt_in_accelerate_shards_our_units_again():
    """What issue 22 reported: torch's fully_shard over fullshard's parameters."""
    with pytest.raises(TypeError, match="Invariant encountered"):
        train(_user_sharded(fullshard.fully_shard))
