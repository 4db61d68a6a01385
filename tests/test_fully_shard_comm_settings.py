"""torch 2.14's communication settings and ``dp_mesh_dims`` (issue 22, breakage 5).

What the engine honours is checked by what it does (the comm spy, parity with
one process); knobs without effect warn once; the rest raises clearly.
"""

import copy
import itertools
import warnings
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from fullshard import DataParallelMeshDims, fully_shard, share_comm_ctx
from fullshard._core import comm, compat, offload
from fullshard.comm_settings import _warned
from fullshard.models import MLP
from fullshard.wrap import ModuleWrapPolicy
from fullshard.testing import assert_params_equal, distributed, train_in_parity, train_steps


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(MLP(8, torch.device("cpu")), MLP(8, torch.device("cpu")))


def _shard(model: nn.Module, **kwargs) -> nn.Module:
    for block in model:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _batches(num_steps: int = 3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 8, generator=generator),) for _ in range(num_steps)]


def _train_like_one_process(model: nn.Module, ref: nn.Module) -> list[float]:
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(ref.parameters(), lr=0.1)
    return train_in_parity(model, ref, optim, ref_optim, _batches(), lambda m, b: m(b[0]).pow(2).mean())


@distributed(world_size=2)
def test_separate_reduce_scatter_group_reduces_on_its_own_group():
    ref = _model()
    model = _shard(copy.deepcopy(ref))
    model.set_separate_reduce_scatter_group()
    with comm.record_comms() as records:
        _train_like_one_process(model, ref)
    gather_groups = {id(r.group) for r in records if r.op == "all_gather"}
    scatter_groups = {id(r.group) for r in records if r.op == "reduce_scatter"}
    assert len(scatter_groups) == 1 and not scatter_groups & gather_groups
    model.set_separate_reduce_scatter_group(False)
    with comm.record_comms() as records:
        _train_like_one_process(model, ref)
    assert {id(r.group) for r in records if r.op == "reduce_scatter"} <= gather_groups


@distributed(world_size=2)
def test_post_optim_event_is_waited_once_then_forgotten():
    ref = _model()
    model = _shard(copy.deepcopy(ref))
    event = torch.Event()  # never recorded: on a CPU mesh nothing waits on the device
    waits = []
    original = offload.wait_for_event
    offload.wait_for_event = lambda device, stream, e: waits.append((device, stream, e))
    try:
        model.set_post_optim_event(event)
        _train_like_one_process(model, ref)
    finally:
        offload.wait_for_event = original
    assert waits == [(torch.device("cpu"), offload.ALL_GATHER, event)]  # the first step's, only
    assert fully_shard.state(model).ctx.post_optim_event is None


@distributed(world_size=2)
def test_knobs_without_effect_warn_once_and_validate_like_torch():
    model = _shard(_model())
    _warned.clear()
    for _ in range(2):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model.set_symm_mem_for_comm()
            model.set_allocate_memory_from_process_group_for_comm(True)
            model.set_reduce_scatter_max_input_buffers(2)
        expected = 3 if _ == 0 else 0
        assert len([w for w in caught if "has no effect with fullshard" in str(w.message)]) == expected
    with pytest.raises(ValueError, match="set_symm_mem_for_comm expects backend 'NCCL'"):
        model.set_symm_mem_for_comm("NVSHMEM")
    with pytest.raises(TypeError, match="set_reduce_scatter_max_input_buffers expects an int"):
        model.set_reduce_scatter_max_input_buffers(True)
    with pytest.raises(ValueError, match="expects an int >= 1 but got 0"):
        model.set_reduce_scatter_max_input_buffers(0)
    share_comm_ctx([model, model[0]])  # streams are shared already: accepted
    with pytest.raises(ValueError, match="share_comm_ctx expects modules that fully_shard was applied to"):
        share_comm_ctx([model, nn.Linear(2, 2)])


@distributed(world_size=2)
def test_dp_mesh_dims_shard_and_replicate_train_like_one_process():
    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("outer", "inner"))
    cases = [
        DataParallelMeshDims(shard="inner"),
        DataParallelMeshDims(shard=("outer", "inner")),  # flattened into one dim of 2
        DataParallelMeshDims(replicate="outer", shard="inner"),  # HSDP
        DataParallelMeshDims(replicate=("outer", "inner")),  # replicated only
    ]
    for dims, by_policy in itertools.product(cases, (False, True)):
        ref = _model()
        if by_policy:  # the blocks picked by a policy resolve the same dims as the root
            model = fully_shard(copy.deepcopy(ref), mesh=mesh, dp_mesh_dims=dims, policy=ModuleWrapPolicy({MLP}))
        else:
            model = _shard(copy.deepcopy(ref), mesh=mesh, dp_mesh_dims=dims)
        replicated_only = not dims.shard_names
        for name, param in model.named_parameters():
            expected = param.shape[0] if replicated_only else param.shape[0] // 2
            assert param.to_local().shape[0] == expected, (dims, by_policy, name)
        _train_like_one_process(model, ref)


@distributed(world_size=2)
def test_dp_mesh_dims_errors():
    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("dp",))
    with pytest.raises(ValueError, match="expects shard or replicate"):
        DataParallelMeshDims()
    with pytest.raises(ValueError, match=r"expects dp_mesh_dims among the mesh's dims \('dp',\), but got 'fsdp'"):
        fully_shard(_model(), mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="fsdp"))
    with pytest.raises(NotImplementedError, match="an int reshard_after_forward with dp_mesh_dims"):
        fully_shard(_model(), mesh=mesh, reshard_after_forward=2, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    model = _model()
    for name, param in list(model[0].in_proj.named_parameters()):
        model[0].in_proj.register_parameter(name, nn.Parameter(distribute_tensor(param.data, mesh, [Shard(0)])))
    with pytest.raises(ValueError, match=r"Replicate\(\) on the data-parallel dim 'dp', but 0.in_proj.weight has S"):
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))
    other = init_device_mesh("cpu", (2,), mesh_dim_names=("other",))
    model = _model()
    model[0].in_proj.weight = nn.Parameter(distribute_tensor(model[0].in_proj.weight.data, other, [Replicate()]))
    with pytest.raises(ValueError, match=r"on the mesh it is given \('dp',\), but 0.in_proj.weight is on"):
        fully_shard(model, mesh=mesh, dp_mesh_dims=DataParallelMeshDims(shard="dp"))


class _CountingAllGather:
    """A custom all-gather as torch 2.14 describes it: allocates, then gathers with gloo's own call."""

    def __init__(self) -> None:
        self.allocated: list[int] = []
        self.calls = 0

    def allocate(self, size, *, dtype, device):
        self.allocated.append(size[0])
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        self.calls += 1
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


class _CountingReduceScatter(_CountingAllGather):
    """A custom reduce-scatter: a SUM over the group into ``output_tensor``, averaged by the caller's op."""

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        self.calls += 1
        return dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group, async_op=async_op)


def _custom_comms_run(shard_fn) -> tuple[list[float], int, int, list[int], int]:
    """Losses and the custom objects' use with ``shard_fn``'s FSDP2 (ours or torch's)."""
    model = nn.Sequential(*_model())
    for block in model:
        shard_fn(block)
    shard_fn(model)
    gather, scatter = _CountingAllGather(), _CountingReduceScatter()
    for block in model:
        block.set_custom_all_gather(gather)
        block.set_custom_reduce_scatter(scatter)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    rank_batch = [(b[0].chunk(dist.get_world_size())[dist.get_rank()],) for b in _batches()]
    losses = train_steps(model, optim, rank_batch, lambda m, b: m(b[0]).pow(2).mean())
    return losses, gather.calls, scatter.calls, gather.allocated, len(scatter.allocated)


@distributed(world_size=2)
def test_custom_all_gather_and_reduce_scatter_replace_ours_as_torchs_do():
    with comm.record_comms() as records:
        losses, gathers, scatters, gathered, scatter_allocs = _custom_comms_run(fully_shard)
    # The blocks' gathers (forward, backward) and reduce-scatters go through the objects, 3 steps
    # of 2 blocks; the root's own parameters (none here beyond the blocks') use the engine's.
    assert (gathers, scatters) == (3 * 2 * 2, 3 * 2)
    assert scatter_allocs == 2 * scatters  # the reduce-scatter's input and output
    assert [r.op for r in records].count("all_gather") >= gathers  # still seen by the comm spy
    assert all(numel % dist.get_world_size() == 0 for numel in gathered)
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    if not hasattr(TorchFSDPModule, "set_custom_all_gather"):
        return  # torch before 2.13 has no custom collectives to compare with
    theirs = _custom_comms_run(torch_fully_shard)
    assert losses == pytest.approx(theirs[0], rel=1e-6)
    assert (gathers, scatters, scatter_allocs) == (theirs[1], theirs[2], theirs[4])


def _whole_mesh_mlp(ref: nn.Module, mesh: DeviceMesh) -> nn.Module:
    """``ref`` as DTensors on the whole ("dp", "tp") mesh: replicated on "dp",
    column- then row-parallel on "tp" (what torch 2.14 asks of dp_mesh_dims)."""
    model = copy.deepcopy(ref)
    tp = {"0.weight": Shard(0), "0.bias": Shard(0), "2.weight": Shard(1), "2.bias": Replicate()}
    for name, placement in tp.items():
        module_name, param_name = name.split(".")
        value = distribute_tensor(ref.get_parameter(name).data, mesh, _by_dim(mesh, dp=Replicate(), tp=placement))
        model.get_submodule(module_name).register_parameter(param_name, nn.Parameter(value))
    return model


def _by_dim(mesh: DeviceMesh, **placements: Placement) -> list[Placement]:
    return [placements[name] for name in mesh.mesh_dim_names]


def _whole_mesh_loss(mesh: DeviceMesh) -> Callable[[nn.Module, Sequence[torch.Tensor]], torch.Tensor]:
    """The mean square of this data-parallel rank's outputs (the whole batch's for the reference)."""

    def loss(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
        if not isinstance(model[0].weight, DTensor):
            return model(batch[0]).pow(2).mean()
        batch_layout = _by_dim(mesh, dp=Shard(0), tp=Replicate())
        out = model(DTensor.from_local(batch[0], mesh, batch_layout))
        return out.redistribute(mesh, batch_layout).to_local().pow(2).mean()

    return loss


def _train_whole_mesh(model: nn.Module, ref: nn.Module, mesh: DeviceMesh) -> list[float]:
    optim = torch.optim.AdamW(model.parameters(), lr=0.01)
    ref_optim = torch.optim.AdamW(ref.parameters(), lr=0.01)
    batches = [(torch.randn(8, 8, generator=torch.Generator().manual_seed(step)),) for step in range(4)]
    loss = _whole_mesh_loss(mesh)
    losses = train_in_parity(model, ref, optim, ref_optim, batches, loss, mesh.get_local_rank("dp"), 2, atol=1e-5)
    assert_params_equal(model, ref, atol=1e-5)
    return losses


@pytest.mark.parametrize("dim_names", [("dp", "tp"), ("tp", "dp")])
@distributed(world_size=4)
def test_dp_mesh_dims_with_whole_mesh_dtensor_parameters(dim_names):
    """Tensor parallelism on the whole SPMD mesh, FSDP over its "dp" dim: the
    shards stay on that mesh, in its dims' order, as torch 2.14 lays them out."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=dim_names)
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = _whole_mesh_mlp(ref, mesh)
    dims = DataParallelMeshDims(shard="dp")
    fully_shard(model[0], mesh=mesh, dp_mesh_dims=dims)
    fully_shard(model, mesh=mesh, dp_mesh_dims=dims)
    # 0.*: "tp" cuts dim 0 first, so the "dp" chunks of dim 0 are strided when "dp" comes first.
    dp_of_tp_rows = compat.StridedShard(0, split_factor=2) if dim_names[0] == "dp" else Shard(0)
    expected = {
        "0.weight": _by_dim(mesh, dp=dp_of_tp_rows, tp=Shard(0)),
        "0.bias": _by_dim(mesh, dp=dp_of_tp_rows, tp=Shard(0)),
        "2.weight": _by_dim(mesh, dp=Shard(0), tp=Shard(1)),
        "2.bias": _by_dim(mesh, dp=Shard(0), tp=Replicate()),
    }
    for name, param in model.named_parameters():
        assert param.device_mesh == mesh and tuple(param.placements) == tuple(expected[name]), name
        assert model.state_dict()[name].placements == param.placements
    losses = _train_whole_mesh(model, copy.deepcopy(ref), mesh)
    if not hasattr(torch.distributed.fsdp, "DataParallelMeshDims"):
        return  # this torch has no dp_mesh_dims to compare with (2.13 and 2.14 do): one process was the reference
    from torch.distributed.fsdp import DataParallelMeshDims as TorchDims
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    theirs = _whole_mesh_mlp(ref, mesh)
    torch_fully_shard(theirs[0], mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    torch_fully_shard(theirs, mesh=mesh, dp_mesh_dims=TorchDims(shard="dp"))
    for (name, ours), (_, their) in zip(model.named_parameters(), theirs.named_parameters()):
        assert their.device_mesh == ours.device_mesh and their.placements == ours.placements, name
    assert _train_whole_mesh(theirs, copy.deepcopy(ref), mesh) == pytest.approx(losses, rel=1e-5)
    for (name, ours), (_, their) in zip(model.named_parameters(), theirs.named_parameters()):
        torch.testing.assert_close(ours.to_local(), their.to_local(), atol=1e-5, rtol=1e-5, msg=name)
