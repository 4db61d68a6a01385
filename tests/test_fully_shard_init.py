"""Initialization of ``fully_shard``: counterparts of seed 002 (test_fully_shard_init.py).

Every case runs on CPU with gloo. Where the seed needs CUDA, the device under
test is the mesh's device (CPU here; the same tests run on CUDA where present).
"""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from fullshard import FSDPModule, fully_shard, replicate
from fullshard._core.gather import ParamModuleInfo
from fullshard._core.manage import get_managed_modules, get_managed_states, get_param_module_infos
from fullshard.models import MLP, ModelArgs, Transformer, TransformerBlock
from fullshard.testing import distributed

DEVICE_TYPE = "cuda" if torch.cuda.is_available() else "cpu"
TP_PLAN = {"in_proj": ColwiseParallel(), "out_proj": RowwiseParallel()}


def _device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if DEVICE_TYPE == "cuda" else torch.device("cpu")


# -- device moves -------------------------------------------------------------------
@distributed(world_size=1)
def test_move_states_to_device_tensor():
    model = MLP(8, torch.device("cpu"), with_buffer=True)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        assert tensor.device == torch.device("cpu")
    fully_shard(model)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        assert tensor.device == _device()
    # The shards live in the unit's one flat buffer on that device.
    buffer = fully_shard.state(model).group.buffers.shard_buffer
    start, end = buffer.data_ptr(), buffer.data_ptr() + buffer.numel() * buffer.element_size()
    for param in model.parameters():
        assert start <= param.to_local().data_ptr() < end


@distributed(world_size=4)
def test_move_states_to_device_dtensor_valid():
    global_mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    model = MLP(8, torch.device("cpu"), with_buffer=True)
    parallelize_module(model, tp_mesh, TP_PLAN)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        if isinstance(tensor, DTensor):  # the DTensor constructor moved it to its mesh's device
            assert tensor.device == _device() and tensor._local_tensor.device == _device()
        else:
            assert tensor.device == torch.device("cpu")
    fully_shard(model, mesh=dp_mesh)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        assert tensor.device == _device()
        if isinstance(tensor, DTensor):
            assert tensor._local_tensor.device == _device()


@distributed(world_size=4)
def test_move_states_to_device_dtensor_invalid():
    # Seed: TP on a CPU mesh, FSDP on a CUDA mesh. Without CUDA we build the
    # FSDP mesh as a "cuda" DeviceMesh that never initializes its backend: the
    # mismatch must be reported before any collective is needed.
    global_cpu_mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    tp_mesh = global_cpu_mesh["tp"]
    dp_ranks = global_cpu_mesh["dp"].mesh
    other = "cuda" if DEVICE_TYPE == "cpu" else "cpu"
    dp_mesh = DeviceMesh(other, dp_ranks, mesh_dim_names=("dp",), _init_backend=False)
    model = MLP(8, torch.device("cpu"), with_buffer=True)
    parallelize_module(model, tp_mesh, TP_PLAN)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        assert tensor.device == torch.device("cpu")
        if isinstance(tensor, DTensor):
            assert tensor._local_tensor.device == torch.device("cpu")
    regex = (
        r"^Requires DTensor to have mesh of the same type as the FSDP mesh but got "
        rf"cpu for DTensor and {other} for FSDP$"
    )
    with pytest.raises(ValueError, match=regex):
        fully_shard(model, mesh=dp_mesh)


# -- mesh argument --------------------------------------------------------------------
@distributed(world_size=2)
def test_invalid_mesh_ndim():
    mesh = init_device_mesh(DEVICE_TYPE, (2, 1, 1))
    regex = r"^fully_shard expects a 1D or 2D DeviceMesh but got DeviceMesh\(\[\[\[0\]\], \[\[1\]\]\]\)$"
    with pytest.raises(ValueError, match=regex):
        fully_shard(MLP(8), mesh=mesh)


# -- managed modules and states ---------------------------------------------------------
def _check_same_members(got: list, expected: list) -> None:
    assert len(got) == len(expected)
    assert set(got) == set(expected)


def test_managed_modules_single():
    model = MLP(8)
    _check_same_members(get_managed_modules(model), list(model.modules()))


@distributed(world_size=1)
def test_managed_modules_nested():
    model = nn.Sequential(*[MLP(8) for _ in range(2)])
    fully_shard(model[0])
    _check_same_members(get_managed_modules(model), list(model[1].modules()) + [model])


@distributed(world_size=1)
def test_managed_modules_nested_fully_shard_and_replicate():
    model = nn.Sequential(*[MLP(8) for _ in range(3)])
    replicate(model[0])
    fully_shard(model[2])
    _check_same_members(get_managed_modules(model), list(model[1].modules()) + [model])


def test_managed_modules_duplicate():
    mlp = MLP(8)
    model = nn.Sequential(mlp, mlp)  # the same module twice: counted once
    _check_same_members(get_managed_modules(model), list(mlp.modules()) + [model])


def test_managed_states_shared_params_and_buffers():
    model = nn.Sequential(*[MLP(8, with_buffer=True) for _ in range(3)])
    model[0].in_proj.weight = model[1].in_proj.weight
    model[2].in_proj.weight = model[1].in_proj.weight
    model[1].buffer = model[2].buffer
    params, buffers = get_managed_states(get_managed_modules(model))
    _check_same_members(params, list(model.parameters()))  # deduplicated like parameters()
    _check_same_members(buffers, list(model.buffers()))


@distributed(world_size=1)
def test_managed_states_nested_fully_shard():
    model = nn.Sequential(*[MLP(8, with_buffer=True) for _ in range(2)])
    fully_shard(model[0])
    params, buffers = get_managed_states(get_managed_modules(model))
    _check_same_members(params, list(model[1].parameters()))
    _check_same_members(buffers, list(model[1].buffers()))


# -- parameter/module infos ---------------------------------------------------------------
def test_get_param_module_infos_shared_params():
    model = nn.Sequential(*[MLP(8) for _ in range(2)])
    model[0].in_proj.weight = model[1].in_proj.weight
    params, _ = get_managed_states(get_managed_modules(model))
    infos = get_param_module_infos(params, model)
    # `params` is already deduplicated: the shared weight appears once, with both owners.
    assert infos == [
        ParamModuleInfo(model[0].in_proj, "weight", [model[1].in_proj], ["weight"]),
        ParamModuleInfo(model[0].in_proj, "bias", [], []),
        ParamModuleInfo(model[0].out_proj, "weight", [], []),
        ParamModuleInfo(model[0].out_proj, "bias", [], []),
        ParamModuleInfo(model[1].in_proj, "bias", [], []),
        ParamModuleInfo(model[1].out_proj, "weight", [], []),
        ParamModuleInfo(model[1].out_proj, "bias", [], []),
    ]


def test_get_param_module_infos_duplicates():
    mlp = MLP(8)
    model = nn.Sequential(mlp, mlp)  # shared MLP
    params = list(model.parameters())
    infos = get_param_module_infos(params, model)
    assert len(infos) == len(params)
    assert infos == [
        ParamModuleInfo(mlp.in_proj, "weight", [mlp.in_proj], ["weight"]),
        ParamModuleInfo(mlp.in_proj, "bias", [mlp.in_proj], ["bias"]),
        ParamModuleInfo(mlp.out_proj, "weight", [mlp.out_proj], ["weight"]),
        ParamModuleInfo(mlp.out_proj, "bias", [mlp.out_proj], ["bias"]),
    ]

    # A shared submodule: the seed lists expectations here without asserting
    # them (and its bias entry contradicts its weight entry). Both parameters of
    # the twice-registered in_proj are registered twice, so both name it again.
    model = nn.Sequential(*[MLP(8) for _ in range(2)])
    model[0].in_proj = model[1].in_proj
    params = list(model.parameters())
    infos = get_param_module_infos(params, model)
    assert len(infos) == len(params)
    shared = model[1].in_proj
    assert infos == [
        ParamModuleInfo(shared, "weight", [shared], ["weight"]),
        ParamModuleInfo(shared, "bias", [shared], ["bias"]),
        ParamModuleInfo(model[0].out_proj, "weight", [], []),
        ParamModuleInfo(model[0].out_proj, "bias", [], []),
        ParamModuleInfo(model[1].out_proj, "weight", [], []),
        ParamModuleInfo(model[1].out_proj, "bias", [], []),
    ]


# -- sharded parameters -----------------------------------------------------------------------
def _check_1d_sharded_parameters(orig_params: list, sharded_params: list) -> None:
    world_size, rank = dist.get_world_size(), dist.get_rank()
    assert len(orig_params) == len(sharded_params)
    global_mesh = init_device_mesh(DEVICE_TYPE, (world_size,))
    for orig_param, sharded_param in zip(orig_params, sharded_params):
        assert isinstance(sharded_param, DTensor)
        assert sharded_param.device_mesh == global_mesh
        assert sharded_param.size() == orig_param.size()
        assert sharded_param.stride() == orig_param.stride()
        assert sharded_param._spec.placements == (Shard(0),)
        chunks = torch.chunk(orig_param, world_size, dim=0)
        expected = chunks[rank] if rank < len(chunks) else orig_param[:0]
        torch.testing.assert_close(sharded_param._local_tensor, expected.to(_device()))


@distributed(world_size=2)
def test_shard_tensor_parameters():
    # Odd dims: uneven shards.
    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    orig_params = [param.detach().clone() for param in model.parameters()]
    fully_shard(model)
    _check_1d_sharded_parameters(orig_params, list(model.parameters()))

    model = nn.Sequential(*[MLP(3, dim_multiplier=3) for _ in range(3)])
    model[0].in_proj = model[1].in_proj
    orig_params = [param.detach().clone() for param in model.parameters()]
    fully_shard(model)
    _check_1d_sharded_parameters(orig_params, list(model.parameters()))


@distributed(world_size=4)
def test_rank_with_zero_rows():
    # 3 rows over 4 ranks: rank 3 holds nothing, and training still works.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 3), nn.Linear(3, 2))
    ref = copy.deepcopy(model)
    fully_shard(model)
    rank = dist.get_rank()
    assert model[0].weight.to_local().shape == ((1, 5) if rank < 3 else (0, 5))
    from fullshard.testing import train_in_parity

    batches = [(torch.randn(8, 5),) for _ in range(3)]
    train_in_parity(
        model, ref, torch.optim.AdamW(model.parameters(), lr=0.1), torch.optim.AdamW(ref.parameters(), lr=0.1),
        batches, lambda m, b: m(b[0]).square().mean(),
    )


@distributed(world_size=4)
def test_shard_dtensor_parameters():
    """FSDP x TP: 2D placements, checked against torch's own fully_shard as the oracle."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor.placement_types import _StridedShard

    global_mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    torch.manual_seed(0)
    model = MLP(9, dim_multiplier=3)
    oracle = copy.deepcopy(model)
    orig_params = [param.detach().clone() for param in model.parameters()]
    orig_names = [name for name, _ in model.named_parameters()]
    for m in (model, oracle):
        parallelize_module(m, tp_mesh, TP_PLAN)
    fully_shard(model, mesh=dp_mesh)
    torch_fully_shard(oracle, mesh=dp_mesh)
    sharded_params = list(model.parameters())
    assert len(orig_params) == len(sharded_params)
    for name, orig, sharded, expected in zip(orig_names, orig_params, sharded_params, oracle.parameters()):
        assert isinstance(sharded, DTensor)
        assert sharded.device_mesh == global_mesh
        assert sharded.size() == orig.size() and sharded.stride() == orig.stride()
        # The seed predates _StridedShard: FSDP's dim-0 chunks of a parameter that
        # TP also cuts on dim 0 are chunks *within* each TP chunk.
        if "in_proj" in name:
            placements = (_StridedShard(0, split_factor=2), Shard(0))
        elif "out_proj" in name and "weight" in name:
            placements = (Shard(0), Shard(1))
        else:
            placements = (Shard(0), Replicate())
        assert sharded._spec.placements == placements, name
        assert sharded._spec.placements == expected._spec.placements, name
        torch.testing.assert_close(sharded.to_local(), expected.to_local())
        torch.testing.assert_close(sharded.full_tensor(), orig.to(_device()))


# -- lazy initialization --------------------------------------------------------------------
def _nested_mlps():
    """FSDP(model(0: MLP(FSDP(in_proj), FSDP(out_proj)), 1: MLP(in_proj, out_proj)))."""
    model = nn.Sequential(MLP(8), MLP(8))
    fully_shard(model[0].in_proj)
    fully_shard(model[0].out_proj)
    fully_shard(model)  # the root gets model[1]
    return model


@distributed(world_size=2)
def test_fully_shard_is_root():
    model = _nested_mlps()
    root_state = fully_shard.state(model)
    root_state.lazy_init()
    in_state, out_state = fully_shard.state(model[0].in_proj), fully_shard.state(model[0].out_proj)
    assert root_state.is_root is True
    assert in_state.is_root is False and out_state.is_root is False
    assert root_state.ctx.all_states == [root_state, in_state, out_state]
    assert in_state.ctx is root_state.ctx and out_state.ctx is root_state.ctx


@distributed(world_size=2)
def test_fully_shard_module_and_param_fqns():
    model = _nested_mlps()
    fully_shard.state(model).lazy_init()
    expected = {
        model: ("Sequential", {"1.in_proj.weight", "1.in_proj.bias", "1.out_proj.weight", "1.out_proj.bias"}),
        model[0].in_proj: ("0.in_proj", {"0.in_proj.weight", "0.in_proj.bias"}),
        model[0].out_proj: ("0.out_proj", {"0.out_proj.weight", "0.out_proj.bias"}),
    }
    for module, (unit_name, param_fqns) in expected.items():
        group = fully_shard.state(module).group
        assert group is not None
        assert group.spec.name == unit_name  # the root: its class
        assert {p.fqn for p in group.spec.params} == param_fqns


@distributed(world_size=2)
def test_fully_shard_double_lazy_init():
    model = _nested_mlps()
    fully_shard.state(model[0].in_proj).lazy_init()
    regex = (
        "^FSDP state has already been lazily initialized for 0.in_proj\n"
        "FSDP requires running forward through the root module first$"
    )
    with pytest.raises(RuntimeError, match=regex):
        fully_shard.state(model).lazy_init()


# -- meta device ------------------------------------------------------------------------------
def _to_empty_and_reset_parameters(model: nn.Module, mlp_dim: int) -> None:
    device = _device()
    model.to_empty(device=device)
    for param in model.parameters():
        assert param.device == device
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    const = 1337
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        tensor.detach().fill_(const)
    for module in model.modules():
        if hasattr(module, "reset_parameters"):
            module.reset_parameters()
    for param in model.parameters():
        local = param.to_local()
        if local.numel() > 0:
            assert not torch.equal(local, torch.full_like(local, const))
    for buffer in model.buffers():
        assert not torch.equal(buffer, torch.full_like(buffer, const))
    # Re-initialization went into the unit buffers: the all-gather sees it.
    model(torch.randn((4, mlp_dim), device=device)).sum().backward()
    optim.step()
    for param in model.parameters():
        assert param.grad is not None


def _sharded_on_meta(mesh: DeviceMesh | None, mlp_dim: int) -> nn.Module:
    """nn.Sequential(MLP, MLP) built and sharded under the meta device."""
    with torch.device("meta"):
        model = nn.Sequential(MLP(mlp_dim, with_buffer=True), MLP(mlp_dim))
        for param in model.parameters():
            assert param.device == torch.device("meta")
        for module in (model[0], model[1], model):
            fully_shard(module, mesh=mesh)
    for param in model.parameters():
        assert param.device == torch.device("meta")
    return model


@distributed(world_size=4)
def test_meta_device_1d_init():
    mesh = init_device_mesh(DEVICE_TYPE, (dist.get_world_size(),))
    for mlp_dim in (8, 3):  # even and uneven shards
        _to_empty_and_reset_parameters(_sharded_on_meta(mesh, mlp_dim), mlp_dim)

    # fully_shard under the meta context creating its default mesh still works.
    _to_empty_and_reset_parameters(_sharded_on_meta(None, 8), 8)


@distributed(world_size=4)
def test_meta_device_2d_init():
    global_mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("dp", "tp"))
    dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    for mlp_dim in (8, 3):
        with torch.device("meta"):
            model = MLP(mlp_dim, with_buffer=True)
            for param in model.parameters():
                assert param.device == torch.device("meta")
            parallelize_module(model, tp_mesh, TP_PLAN)
            for param in model.parameters():
                assert param.device == torch.device("meta")
            fully_shard(model.in_proj, mesh=dp_mesh)
            fully_shard(model.out_proj, mesh=dp_mesh)
            fully_shard(model, mesh=dp_mesh)
        for param in model.parameters():
            assert param.device == torch.device("meta")
        _to_empty_and_reset_parameters(model, mlp_dim)


@distributed(world_size=4)
def test_invalid_meta_device_init():
    mesh = init_device_mesh(DEVICE_TYPE, (dist.get_world_size(),))
    mlp_dim = 8
    model = _sharded_on_meta(mesh, mlp_dim)
    regex = (
        "FSDP parameters should be materialized from meta device before training, "
        "but the following were still on meta device: "
        r"\['0.in_proj.weight', '0.in_proj.bias', '0.out_proj.weight', '0.out_proj.bias'\]"
    )
    with pytest.raises(RuntimeError, match=regex):
        model(torch.randn((4, mlp_dim), device=_device()))


# -- process group init --------------------------------------------------------------------------
@distributed(world_size=4)
def test_1d_process_group_init():
    global_mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("dp", "tp"))
    ref_dp_mesh, tp_mesh = global_mesh["dp"], global_mesh["tp"]
    dp_pg = ref_dp_mesh.get_group(0)
    dp_mesh = DeviceMesh.from_group(dp_pg, DEVICE_TYPE, mesh_dim_names=("dp",))
    # Compare the mesh tensors, not the meshes: the reference one has a parent.
    assert torch.equal(dp_mesh.mesh, ref_dp_mesh.mesh)
    assert dp_mesh._coordinate_on_dim == ref_dp_mesh._coordinate_on_dim

    torch.manual_seed(42)
    mlp_dim = 8
    ref_model = MLP(mlp_dim)
    for param in ref_model.parameters():
        dist.broadcast(param.detach(), src=0)
    model = copy.deepcopy(ref_model)
    for module in (ref_model.in_proj, ref_model.out_proj, ref_model):
        fully_shard(module, mesh=ref_dp_mesh)
    for module in (model.in_proj, model.out_proj, model):
        fully_shard(module, mesh=dp_mesh)
    # Ranks of one TP group (the same DP coordinate) see the same input.
    inp = torch.randn((4, mlp_dim), device=_device())
    tp_group = tp_mesh.get_group(0)
    dist.broadcast(inp, src=dist.get_process_group_ranks(tp_group)[0], group=tp_group)
    ref_loss = ref_model(inp).sum()
    ref_loss.backward()
    loss = model(inp).sum()
    loss.backward()
    torch.testing.assert_close(loss, ref_loss)
    for param, ref_param in zip(model.parameters(), ref_model.parameters()):
        torch.testing.assert_close(param.to_local(), ref_param.to_local())
        assert torch.equal(param.device_mesh.mesh, ref_param.device_mesh.mesh)
        torch.testing.assert_close(param.grad.to_local(), ref_param.grad.to_local())
        assert torch.equal(param.grad.device_mesh.mesh, ref_param.grad.device_mesh.mesh)


# -- HSDP ----------------------------------------------------------------------------------------
@distributed(world_size=4)
def test_hsdp_broadcast_across_replicas():
    mesh = init_device_mesh(DEVICE_TYPE, (2, 2), mesh_dim_names=("replicate", "shard"))
    model_args = ModelArgs()
    model = Transformer(model_args)
    model.register_buffer("buf", torch.randn((model_args.dim,)))  # buffers follow the same flow
    for module in model.modules():
        if isinstance(module, TransformerBlock):
            fully_shard(module, mesh=mesh)
    fully_shard(model, mesh=mesh)
    if mesh.get_local_rank("replicate") > 0:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            tensor.detach().fill_(1337)

    replicate_group = mesh.get_group("replicate")

    def replica_locals(tensor: torch.Tensor) -> list[torch.Tensor]:
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        gathered = [torch.empty_like(local) for _ in range(mesh["replicate"].size())]
        dist.all_gather(gathered, local, group=replicate_group)
        return gathered

    for tensor in itertools.chain(model.parameters(), model.buffers()):
        gathered = replica_locals(tensor)
        for other in gathered[1:]:
            assert other.shape == gathered[0].shape
            if other.numel() > 0:
                assert not torch.equal(other, gathered[0])

    src = dist.get_process_group_ranks(replicate_group)[0]
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        local = tensor.to_local() if isinstance(tensor, DTensor) else tensor
        dist.broadcast(local, src=src, group=replicate_group)
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        gathered = replica_locals(tensor)
        for other in gathered[1:]:
            assert torch.equal(other, gathered[0])

    inp = torch.randint(0, model_args.vocab_size, (2, 16), device=_device())
    model(inp).sum().backward()
    # The broadcast wrote into the unit buffers: every replica now trains identically.
    for param in model.parameters():
        for other in replica_locals(param.grad)[1:]:
            assert torch.equal(other, replica_locals(param.grad)[0])


@distributed(world_size=1)
def test_fsdp_module_class_swap():
    model = nn.Sequential(MLP(4), MLP(4))
    assert not isinstance(model, FSDPModule)
    fully_shard(model[0])
    fully_shard(model)
    assert isinstance(model, FSDPModule) and isinstance(model, nn.Sequential)
    assert type(model).__name__ == "FSDPSequential"
    # Slicing a swapped container builds a plain container.
    assert type(model[:1]) is nn.Sequential
