"""``fully_shard`` with the FSDP1-style arguments of seed 003: policy, strategy, ignored_modules."""

import copy
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer

from fullshard import ShardingStrategy, fully_shard, set_all_gather_bucket_size
from fullshard._core import comm
from fullshard._core.step.state import get_state
from fullshard.testing import DataParallelReference, assert_params_equal, case, distributed, mean_over
from fullshard.testing.models import CompositeParamModel, TransformerWithSharedParams, UnitModule
from fullshard.wrap import ModuleWrapPolicy

LAYERS = ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer})


def transformer_loss(model: nn.Module, batch) -> torch.Tensor:
    return TransformerWithSharedParams.get_loss(batch, model(*batch))


def composite_loss(model: nn.Module, batch) -> torch.Tensor:
    return model(batch[0]).square().mean()


def train_and_compare(model: nn.Module, ref: nn.Module, loss_fn, make_batch, steps: int = 5) -> Counter:
    """Steps ``model`` on each rank's batch and ``ref`` on all of them; returns collective counts."""
    rank, world = dist.get_rank(), dist.get_world_size()
    reference = DataParallelReference(ref, loss_fn)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    with comm.record_comms() as records:
        for step in range(steps):
            loss = loss_fn(model, make_batch(rank, step))
            loss.backward()
            ref_loss = reference.backward([make_batch(r, step) for r in range(world)])
            for optim in optims:
                optim.step()
                optim.zero_grad()
            torch.testing.assert_close(mean_over(loss), ref_loss, rtol=1e-5, atol=1e-5)
    return Counter(r.op for r in records)


def transformer_batch(rank: int, step: int):
    return TransformerWithSharedParams.get_input(TransformerWithSharedParams, seed=100 * step + rank)


def composite_batch(rank: int, step: int):
    return (torch.randn(4, 16, generator=torch.Generator().manual_seed(100 * step + rank)),)


@distributed(world_size=2)
def test_policy_makes_a_unit_per_layer():
    ref = TransformerWithSharedParams(add_bn=False)
    model = fully_shard(copy.deepcopy(ref), policy=LAYERS)
    layers = [m for m in model.modules() if isinstance(m, (TransformerEncoderLayer, TransformerDecoderLayer))]
    assert len(layers) == 4 and all(get_state(m) is not None for m in layers)
    counts = train_and_compare(model, ref, transformer_loss, transformer_batch)
    assert counts["reduce_scatter"] == 5 * 5  # four layers and the root, five steps
    assert_params_equal(model, ref, rtol=1e-4, atol=1e-4)


@distributed(world_size=2)
def test_no_shard_root_over_sharded_submodule():
    """Seed 003's mixed sharding: fully_shard(u1), then NO_SHARD on the root."""
    ref = CompositeParamModel()
    model = copy.deepcopy(ref)
    fully_shard(model.u1)
    fully_shard(model, strategy=ShardingStrategy.NO_SHARD)
    assert model.l.weight.to_local().shape == (16, 16)  # replicated
    assert model.u1.l1.weight.to_local().shape == (8, 16)  # sharded
    counts = train_and_compare(model, ref, composite_loss, composite_batch)
    assert counts["all_reduce"] == 5 and counts["reduce_scatter"] == 5
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_no_shard_with_a_policy_replicates_every_unit():
    """The policy's units get the strategy as the user gave it (a regression: they got the root's
    resolved reshard_after_forward=False, which NO_SHARD then rejected)."""
    ref = CompositeParamModel()
    model = fully_shard(copy.deepcopy(ref), policy=ModuleWrapPolicy({UnitModule}), strategy=ShardingStrategy.NO_SHARD)
    assert all(get_state(unit) is not None for unit in (model.u1, model.u2))
    assert model.u1.l1.weight.to_local().shape == (16, 16)  # replicated
    counts = train_and_compare(model, ref, composite_loss, composite_batch)
    assert counts["all_reduce"] == 3 * 5 and counts["reduce_scatter"] == 0
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_shard_grad_op_keeps_parameters_after_forward():
    ref = CompositeParamModel()
    model = fully_shard(copy.deepcopy(ref), policy=ModuleWrapPolicy({UnitModule}), strategy=ShardingStrategy.SHARD_GRAD_OP)
    set_all_gather_bucket_size(model, 0)  # the count below is one gather per unit
    counts = train_and_compare(model, ref, composite_loss, composite_batch)
    assert counts["all_gather"] == 3 * 5  # once per unit and step: nothing is re-gathered in backward
    assert_params_equal(model, ref)


@pytest.mark.parametrize("strategy", [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2])
@distributed(world_size=4)
def test_hybrid_strategy_builds_node_groups(strategy):
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ref = CompositeParamModel()
    model = fully_shard(copy.deepcopy(ref), policy=ModuleWrapPolicy({UnitModule}), strategy=strategy)
    info = get_state(model.u1).group.spec.mesh_info
    assert info.shard.size == 2 and info.replicate.size == 2
    assert get_state(model).group.spec.mesh_info.mesh is info.mesh  # one mesh for every unit
    counts = train_and_compare(model, ref, composite_loss, composite_batch)
    assert counts["all_reduce"] == 3 * 5 and counts["reduce_scatter"] == 3 * 5
    assert_params_equal(model, ref)


@distributed(world_size=2)
def test_ignored_modules():
    ref = TransformerWithSharedParams(add_bn=False)
    model = copy.deepcopy(ref)
    fully_shard(model, policy=LAYERS, ignored_modules=model.get_ignored_modules())
    for param in model.transformer.parameters():
        assert not hasattr(param, "placements")  # left alone, not sharded
    assert hasattr(model.embed_tokens.weight, "placements")
    model.get_loss(transformer_batch(dist.get_rank(), 0), model(*transformer_batch(dist.get_rank(), 0))).backward()
    grads = [torch.empty_like(model.transformer.encoder.norm.weight.grad) for _ in range(2)]
    dist.all_gather(grads, model.transformer.encoder.norm.weight.grad)
    assert not torch.equal(grads[0], grads[1])  # not reduced


def _one_dim_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (2,))


def _ignoring_itself() -> None:
    model = CompositeParamModel()
    fully_shard(model, ignored_modules=[model])


def _no_shard_row(reshard: bool) -> tuple:
    return (
        ValueError,
        rf"no reshard_after_forward with NO_SHARD \(parameters are never sharded\) but got reshard_after_forward={reshard} for CompositeParamModel",
        lambda: fully_shard(CompositeParamModel(), strategy=ShardingStrategy.NO_SHARD, reshard_after_forward=reshard),
    )


# One behaviour per row: (exception type, message pattern, the call that must raise it), all in one
# distributed body so the table costs one task.
STRATEGY_ERRORS = {
    "grad_op_with_reshard": (
        ValueError, r"either strategy or reshard_after_forward, but got SHARD_GRAD_OP with reshard_after_forward=True for CompositeParamModel",
        lambda: fully_shard(CompositeParamModel(), strategy=ShardingStrategy.SHARD_GRAD_OP, reshard_after_forward=True)),
    "full_shard_without_reshard": (
        ValueError, r"either strategy or reshard_after_forward, but got FULL_SHARD with reshard_after_forward=False",
        lambda: fully_shard(CompositeParamModel(), strategy=ShardingStrategy.FULL_SHARD, reshard_after_forward=False)),
    "no_shard_with_reshard": _no_shard_row(True),
    "no_shard_without_reshard": _no_shard_row(False),
    "hybrid_on_1d_mesh": (
        ValueError, r"2D DeviceMesh for HYBRID_SHARD but got DeviceMesh\(\[0, 1\]\)",
        lambda: fully_shard(CompositeParamModel(), strategy=ShardingStrategy.HYBRID_SHARD, mesh=_one_dim_mesh())),
    "ignored_module_is_the_module": (
        ValueError, r"ignored_modules to be proper submodules of CompositeParamModel, but got CompositeParamModel itself",
        _ignoring_itself),
}


@distributed(world_size=2)
def test_strategy_errors():
    for name, (error, match, call) in STRATEGY_ERRORS.items():
        with case(name), pytest.raises(error, match=match):
            call()
    # A module outside is skipped, as torch skips ignored parameters outside (one list, several units).
    fully_shard(CompositeParamModel(), ignored_modules=[nn.Linear(2, 2)])
