"""DTensor collectives go through ``fullshard._core.comm`` (see [Note: DTensor collectives]):
the spy counts them, and at DETAIL debug level ranks about to run different ones raise
instead of pairing the wrong tensors or hanging."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from fullshard import FullyShardedDataParallel as FSDP
from fullshard import StateDictType, fully_shard
from fullshard._core import comm
from fullshard.state_dict import optim_state_dict, state_dict_type
from fullshard.testing import distributed


def _adam_stepped(model: nn.Module) -> torch.optim.Optimizer:
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    optim.step()
    return optim


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper_orig_params", "wrapper_flat"])
@distributed(world_size=2)
def test_full_optim_state_dict_gathers_are_spied(front_end):
    """A FULL optimizer state dict gathers each sharded state (exp_avg, exp_avg_sq) of each
    parameter: one all-gather of its global bytes on the shard group, seen by the spy (a flat
    parameter's states: one all-gather each of the padded concatenation, FSDP1's flat layout)."""
    torch.manual_seed(0)
    model: nn.Module = nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3))
    shapes = [tuple(p.shape) for p in model.parameters()]
    if front_end == "fully_shard":
        model = fully_shard(model)
    else:
        model = FSDP(model, use_orig_params=front_end == "wrapper_orig_params", device_id=torch.device("cpu"))
    optim = _adam_stepped(model)
    with state_dict_type(model, StateDictType.FULL_STATE_DICT), comm.record_comms() as records:
        full = optim_state_dict(model, optim)
    gathers = [r for r in records if r.op == "all_gather"]
    expected = sorted(4 * torch.Size(shape).numel() for shape in shapes for _ in ("exp_avg", "exp_avg_sq"))
    if front_end == "wrapper_flat":
        total = sum(torch.Size(shape).numel() for shape in shapes)
        expected = [4 * 2 * -(-total // 2)] * 2
    assert sorted(r.nbytes for r in gathers) == expected
    assert {r.group_size for r in gathers} == {2}
    assert len(records) == len(gathers)  # nothing else (the cross-rank check is an object collective)
    assert sorted(tuple(s["exp_avg"].shape) for s in full["state"].values()) == sorted(shapes)


@distributed(world_size=2)
def test_sharded_optim_state_dict_runs_no_dtensor_collective():
    model = fully_shard(nn.Sequential(nn.Linear(8, 6), nn.ReLU(), nn.Linear(6, 3)))
    optim = _adam_stepped(model)
    with state_dict_type(model, StateDictType.SHARDED_STATE_DICT), comm.record_comms() as records:
        optim_state_dict(model, optim)
    assert [r.op for r in records] == []  # the cross-rank check is an object collective, not recorded


@distributed(world_size=4)
def test_redistribute_records_one_collective_per_changed_mesh_dim():
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    full = torch.arange(32.0).view(8, 4)
    value = distribute_tensor(full, mesh, [Shard(0), Shard(1)])
    with comm.record_comms() as records:
        gathered = comm.full_tensor(value)
    torch.testing.assert_close(gathered, full)
    # Each dim's all-gather counted as the global tensor over the other dims' shards.
    assert sorted((r.op, r.group_size, r.nbytes) for r in records) == [("all_gather", 2, 64), ("all_gather", 2, 64)]
    partial = DTensor.from_local(torch.ones(4), mesh, [Replicate(), Partial()], run_check=False)
    with comm.record_comms() as records:
        summed = comm.redistribute(partial, [Replicate(), Replicate()])
    torch.testing.assert_close(summed.to_local(), torch.full((4,), 2.0))
    assert [(r.op, r.nbytes) for r in records] == [("all_reduce", 16)]
    with comm.record_comms() as records:
        comm.redistribute(distribute_tensor(full, mesh, [Replicate(), Replicate()]), [Shard(0), Replicate()])
    assert records == []  # replicated to sharded: a local chunk, no collective


@distributed(world_size=2)
def test_mismatched_dtensor_collectives_raise_at_detail():
    dist.set_debug_level(dist.DebugLevel.DETAIL)
    mesh = init_device_mesh("cpu", (2,))
    rows = 2 + 2 * dist.get_rank()  # rank 0 gathers a [4, 3] tensor, rank 1 an [8, 3] one
    value = DTensor.from_local(torch.ones(rows, 3), mesh, [Shard(0)], run_check=False)
    with pytest.raises(
        RuntimeError,
        match=r"^DTensor collectives differ across ranks: rank 0 is about to run full_tensor of a \[4, 3\] "
        r"torch\.float32 DTensor from \(Shard\(dim=0\)\) to \(Replicate\(\)\) but rank 1 full_tensor of a \[8, 3\]",
    ):
        comm.full_tensor(value)
    same = DTensor.from_local(torch.ones(2, 3), mesh, [Shard(0)], run_check=False)
    assert comm.full_tensor(same).shape == (4, 3)  # agreeing ranks pass the check
