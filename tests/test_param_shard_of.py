"""``ShardParam.shard_from_full``: a full value (a state dict's) as this rank's shard.

The oracle is torch's ``distribute_tensor`` with the sharded parameter's mesh
and placements, and the shard the engine took at construction.
"""

from __future__ import annotations

from unittest import mock

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.utils._python_dispatch import TorchDispatchMode

from fullshard import CPUOffloadPolicy, fully_shard
from fullshard.testing import distributed
from fullshard.testing.fake_group import fake_world


def _model() -> nn.Sequential:
    torch.manual_seed(0)  # the same values on every rank: the full values below are global
    return nn.Sequential(nn.Linear(6, 7), nn.Linear(7, 5))  # rows split unevenly over 2 and 4


def _assert_shard(param, value: torch.Tensor) -> None:
    shard = param.shard_from_full(value)
    expected = distribute_tensor(value, param.spmd_mesh, param.placements, src_data_rank=None)
    assert shard.device_mesh == param.spmd_mesh and tuple(shard.placements) == tuple(param.placements)
    assert shard.shape == value.shape, param.fqn
    torch.testing.assert_close(shard._local_tensor, expected._local_tensor, rtol=0, atol=0, msg=param.fqn)
    torch.testing.assert_close(shard._local_tensor, param.local_shard, rtol=0, atol=0, msg=param.fqn)


@distributed(world_size=4)
def test_every_rank_gets_its_rows_1d_and_2d():
    """FSDP over 4 ranks (dim 0, and dim 1 through ``shard_placement_fn``), and
    FSDP x TP on a (2, 2) mesh with Colwise (Shard(0): FSDP's rows nest inside
    TP's, ``_StridedShard``), Rowwise (Shard(1)) and replicated parameters."""
    full = {n: p.detach().clone() for n, p in _model().named_parameters()}
    for shard_placement_fn in (None, lambda p: Shard(1) if p.ndim == 2 else None):
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)), shard_placement_fn=shard_placement_fn)
        for param in fully_shard.state(model).group.spec.params:
            _assert_shard(param, full[param.fqn])

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    model = _model()
    tp = {"0.weight": Shard(0), "0.bias": Shard(0), "1.weight": Shard(1), "1.bias": Replicate()}
    for name, placement in tp.items():
        module, attr = model[int(name[0])], name[2:]
        setattr(module, attr, nn.Parameter(distribute_tensor(full[name], mesh["tp"], [placement], src_data_rank=None)))
    fully_shard(model, mesh=mesh["dp"])
    for param in fully_shard.state(model).group.spec.params:
        assert isinstance(param.sharded_param, DTensor) and param.tp_mesh is not None
        _assert_shard(param, full[param.fqn])


class _Allocations(TorchDispatchMode):
    """Records the size of every tensor an op returns."""

    def __init__(self) -> None:
        super().__init__()
        self.numels: list[int] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.numels += [t.numel() for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        return out


def test_offloaded_shard_is_taken_on_the_host_without_a_full_copy():
    """Under CPU offload with an accelerator mesh (here a CPU mesh that says
    ``cuda``: a CPU build cannot allocate there, so any move of the value to the
    mesh's device fails), the shard is made in host memory from this rank's rows
    only: no tensor of the full size is created anywhere."""
    with fake_world(4, 1):
        full = {n: p.detach().clone() for n, p in _model().named_parameters()}
        model = _model()
        fully_shard(model, mesh=init_device_mesh("cpu", (4,)), offload_policy=CPUOffloadPolicy(pin_memory=False))
        cuda_type = property(lambda self: "cuda")  # as in test_fake_pg: a class property wins on every torch
        for param in fully_shard.state(model).group.spec.params:
            value = full[param.fqn]
            with mock.patch.object(DeviceMesh, "device_type", new=cuda_type, create=True), _Allocations() as spy:
                shard = param.shard_from_full(value)
                assert shard.device_mesh.device_type == "cuda"
            assert shard._local_tensor.device.type == "cpu"
            torch.testing.assert_close(shard._local_tensor, param.local_shard, rtol=0, atol=0)
            assert spy.numels and max(spy.numels) == param.local_shard.numel() < value.numel(), (param.fqn, spy.numels)
