"""Hybrid sharding with the wrapper: counterparts of seed 000 (test_fsdp_hybrid_shard.py).

4 ranks on one machine form 2 "nodes" of 2 (LOCAL_WORLD_SIZE=2, as torchrun
would set on two 2-GPU nodes): shard within a node, replicate across nodes.
"""

import enum
import os
from collections import Counter

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer

from fullshard import FSDP, ShardingStrategy, hybrid_mesh
from fullshard._core import comm
from fullshard.testing import distributed
from fullshard.testing.models import ThreeLinears, TransformerWithSharedParams
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
HYBRID = [ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2]
LAYERS = ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer})


class Mode(enum.Enum):
    ALL_HYBRID_SHARD = enum.auto()  # every unit hybrid
    MIXED_HYBRID_FULL_SHARD = enum.auto()  # hybrid transformer under a FULL_SHARD root


def two_nodes_of_two() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard group, replicate group) of this rank: nodes {0, 1} and {2, 3}."""
    rank = dist.get_rank()
    shard_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicate_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    return shard_groups[rank // 2], replicate_groups[rank % 2]


@distributed(world_size=2)
def test_raises_manual_wrap_hybrid_shard_when_none_policy():
    for strategy in HYBRID:
        with pytest.raises(ValueError, match="requires explicit specification of process group or device_mesh."):
            FSDP(ThreeLinears(), sharding_strategy=strategy, device_id=CPU)


@distributed(world_size=2)
def test_invalid_pg_specification_raises():
    with pytest.raises(ValueError, match="^Expected process_group to be passed in"):
        FSDP(
            ThreeLinears(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU,
            process_group=dist.distributed_c10d._get_default_group(),
            sharding_strategy=ShardingStrategy.HYBRID_SHARD,
        )


@distributed(world_size=4)
def test_hsdp_sync_module_state():
    model = ThreeLinears()
    for linear in (model.lin1, model.lin2, model.lin3):
        nn.init.constant_(linear.weight, dist.get_rank())
    model = FSDP(
        model, sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=True,
        sync_module_states=True, process_group=two_nodes_of_two(), device_id=CPU,
    )
    # Every rank and replica now holds rank 0's values: its shards, and the full weights.
    for linear in (model.lin1, model.lin2, model.lin3):
        assert (linear.weight == 0).all()  # this rank's shard: a plain 1D view
    with FSDP.summon_full_params(model):
        for linear in (model.lin1, model.lin2, model.lin3):
            assert linear.weight.shape == (10, 10) and (linear.weight == 0).all()


def _build(strategy: ShardingStrategy, mode: Mode, use_orig_params: bool, use_device_mesh: bool) -> nn.Module:
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard")) if use_device_mesh else None
    hybrid = dict(
        sharding_strategy=strategy, auto_wrap_policy=LAYERS, use_orig_params=use_orig_params,
        device_id=CPU, device_mesh=mesh,
    )
    model = TransformerWithSharedParams(add_bn=False)
    if mode is Mode.ALL_HYBRID_SHARD:
        return FSDP(model, **hybrid)
    model.transformer = FSDP(model.transformer, **hybrid)
    return FSDP(model, sharding_strategy=ShardingStrategy.FULL_SHARD, use_orig_params=use_orig_params, device_id=CPU)


@pytest.mark.parametrize("use_device_mesh", [False, True])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("strategy", HYBRID)
@distributed(world_size=4)
def test_fsdp_hybrid_shard_basic_setup(strategy, mode, use_orig_params, use_device_mesh):
    """Intra/inter-node groups are right and shared by every hybrid unit; each unit
    reduce-scatters within its node and all-reduces across nodes once per step."""
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = _build(strategy, mode, use_orig_params, use_device_mesh)
    rank = dist.get_rank()
    hybrid_units = [m for m in FSDP.fsdp_modules(model) if m.sharding_strategy in HYBRID]
    assert len(hybrid_units) == 5  # 4 layers + the root, or + the wrapped transformer
    intra, inter = hybrid_units[0].process_group, hybrid_units[0]._inter_node_pg
    assert dist.get_process_group_ranks(intra) == [2 * (rank // 2), 2 * (rank // 2) + 1]
    assert dist.get_process_group_ranks(inter) == [rank % 2, rank % 2 + 2]
    for unit in hybrid_units:  # one pair of groups, shared
        assert unit.process_group is intra and unit._inter_node_pg is inter
    if mode is Mode.MIXED_HYBRID_FULL_SHARD:
        assert model.sharding_strategy is ShardingStrategy.FULL_SHARD
        assert model.process_group.size() == 4 and model._inter_node_pg is None

    inp = model.module.get_input(seed=rank)
    with comm.record_comms() as records:
        model.module.get_loss(inp, model(*inp)).backward()
    counts = Counter(r.op for r in records)
    num_units = len(FSDP.fsdp_modules(model))
    assert counts["reduce_scatter"] == num_units
    assert counts["all_reduce"] == len(hybrid_units)
    for record in records:
        if record.op == "all_reduce":
            assert record.group is inter


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", HYBRID)
@distributed(world_size=4)
def test_fsdp_hybrid_shard_parity(strategy, use_orig_params):
    """HSDP trains exactly like torch's DDP over all ranks (5 Adam steps, each rank its own batch): the
    reference is torch's, not our own FULL_SHARD, so a fault shared by both strategies shows."""
    from torch.nn.parallel import DistributedDataParallel

    os.environ["LOCAL_WORLD_SIZE"] = "2"
    ddp_model = DistributedDataParallel(TransformerWithSharedParams(add_bn=False))
    hsdp_model = FSDP(TransformerWithSharedParams(add_bn=False), auto_wrap_policy=LAYERS,
                      use_orig_params=use_orig_params, device_id=CPU, sharding_strategy=strategy,
                      process_group=hybrid_process_groups())
    assert hsdp_model._inter_node_pg.size() > 1, "HSDP model initialized without replication"
    ddp_optim = torch.optim.Adam(ddp_model.parameters(), lr=1e-2)
    hsdp_optim = torch.optim.Adam(hsdp_model.parameters(), lr=1e-2)
    for step in range(5):
        inp = ddp_model.module.get_input(seed=100 * step + dist.get_rank())
        losses = []
        for model, optim in ((ddp_model, ddp_optim), (hsdp_model, hsdp_optim)):
            optim.zero_grad()
            loss = model.module.get_loss(inp, model(*inp))
            losses.append(loss)
            loss.backward()
            optim.step()
        torch.testing.assert_close(losses[0], losses[1])
    with FSDP.summon_full_params(hsdp_model):
        named = list(zip(ddp_model.module.named_parameters(), hsdp_model.named_parameters()))
        assert [n for (n, _), _ in named] == [n.replace("_fsdp_wrapped_module.", "") for _, (n, _) in named]
        for (name, p), (_, q) in named:
            if name.endswith("in_proj_bias"):
                # The key bias has an exactly-zero gradient (softmax ignores a
                # shift); Adam turns float noise there into arbitrary updates.
                third = p.numel() // 3
                p, q = torch.cat([p[:third], p[2 * third :]]), torch.cat([q[:third], q[2 * third :]])
            torch.testing.assert_close(q, p, rtol=1e-5, atol=1e-6, msg=lambda m: f"{name}: {m}")


def hybrid_process_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """FSDP1's _init_intra_and_inter_node_groups(world, 2), via a (nodes, 2) mesh."""
    mesh = hybrid_mesh("cpu", num_devices_per_node=2)
    return mesh.get_group("shard"), mesh.get_group("replicate")


@distributed(world_size=4)
def test_hybrid_groups_from_local_world_size():
    os.environ["LOCAL_WORLD_SIZE"] = "2"
    model = FSDP(ThreeLinears(), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                 auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), device_id=CPU)
    units = FSDP.fsdp_modules(model)
    assert len(units) == 4  # three linears and the root
    assert all(u.process_group is units[0].process_group for u in units)
    assert units[0].process_group.size() == 2 and units[0]._inter_node_pg.size() == 2
