"""The wrapper's SHARDED state dicts without a device mesh: torch's ShardedTensors, as FSDP1's (issue 23).

Each rank's shards (offsets, sizes, placements, values) are compared with torch's FSDP1 on the same
model at 4 ranks, where rows do not divide evenly and some ranks hold no chunk; the dicts load back
(either form), through torch.distributed.checkpoint too, at another world size and into fully_shard.
"""

import warnings

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor, ShardedTensorMetadata, TensorProperties
from torch.distributed._shard.sharding_spec import ShardMetadata
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor

import fullshard
from fullshard.testing import clone_tree, distributed, full_value, run_distributed

CPU = torch.device("cpu")


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)  # 7 rows: 2, 2, 2, 1 at 4 ranks
        self.head = nn.Linear(7, 2)  # 2 rows: ranks 2 and 3 hold no chunk

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.lin(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 5)
        self.block = Block()
        self.out = nn.Linear(2, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def api(lib: str):
    if lib == "torch":
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        fsdp, ModuleWrapPolicy = fullshard, fullshard.wrap.ModuleWrapPolicy
    return fsdp, ModuleWrapPolicy


def wrapped(lib: str, use_orig_params: bool, strategy: str = "FULL_SHARD", mesh=None, groups=None) -> nn.Module:
    fsdp, policy = api(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp.FullyShardedDataParallel(
            Net(),
            auto_wrap_policy=policy({Block}),
            device_id=CPU,
            use_orig_params=use_orig_params,
            sharding_strategy=getattr(fsdp.ShardingStrategy, strategy),
            device_mesh=mesh,
            process_group=groups,
        )


def hybrid_groups() -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(shard, replicate) groups of a 2 x 2 layout, made in the same order on every rank."""
    rank, made = dist.get_rank(), {}
    for ranks in ([0, 1], [2, 3], [0, 2], [1, 3]):
        made[tuple(ranks)] = dist.new_group(ranks)
    return made[(0, 1) if rank < 2 else (2, 3)], made[(0, 2) if rank % 2 == 0 else (1, 3)]


def trained(lib: str, use_orig_params: bool, strategy: str = "FULL_SHARD", mesh=None, groups=None):
    model = wrapped(lib, use_orig_params, strategy, mesh, groups)
    optim = torch.optim.Adam(model.parameters(), lr=0.01)
    gen = torch.Generator().manual_seed(dist.get_rank() + 1)
    model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
    optim.step()
    return model, optim


def sharded_dicts(lib: str, model: nn.Module, optim: torch.optim.Optimizer) -> tuple[dict, dict]:
    fsdp, _ = api(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.SHARDED_STATE_DICT):
            return model.state_dict(), fsdp.FullyShardedDataParallel.optim_state_dict(model, optim)


def layout(value: torch.Tensor) -> object:
    """Everything a ShardedTensor says about itself on this rank (a DTensor: its type and placements)."""
    if isinstance(value, DTensor):
        return ("DTensor", tuple(value.placements), value.to_local())
    if not isinstance(value, ShardedTensor):
        return (type(value).__name__, value)
    # A local shard's placement is left out: FSDP1 names the rank in the unit's group there (its global
    # metadata names global ranks, as both of ours do); they differ under a hybrid group pair.
    shards = [(s.metadata.shard_offsets, s.metadata.shard_sizes) for s in value.local_shards()]
    everyone = [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in value.metadata().shards_metadata]
    values = [s.tensor for s in value.local_shards()]
    return ("ShardedTensor", tuple(value.size()), value.metadata().tensor_properties.dtype, everyone, shards, values)


def assert_same(theirs: object, ours: object, where: str) -> None:
    if isinstance(theirs, torch.Tensor):
        torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6, msg=lambda m: f"{where}: {m}")
    elif isinstance(theirs, (tuple, list)):
        assert type(theirs) is type(ours) and len(theirs) == len(ours), f"{where}: torch {theirs} / ours {ours}"
        for index, (a, b) in enumerate(zip(theirs, ours)):
            assert_same(a, b, f"{where}[{index}]")
    else:
        assert theirs == ours, f"{where}: torch {theirs!r} / ours {ours!r}"


@distributed(world_size=4)
def test_sharded_tensors_equal_torchs_shard_by_shard():
    groups = hybrid_groups()
    for use_orig_params in (False, True):
        for strategy in ("FULL_SHARD", "NO_SHARD", "HYBRID_SHARD"):  # hybrid: a group pair, no mesh
            hybrid = groups if strategy == "HYBRID_SHARD" else None
            results = {
                lib: sharded_dicts(lib, *trained(lib, use_orig_params, strategy, groups=hybrid))
                for lib in ("torch", "ours")
            }
            (their_sd, their_osd), (our_sd, our_osd) = results["torch"], results["ours"]
            case = f"use_orig_params={use_orig_params} {strategy}"
            assert set(their_sd) == set(our_sd), case
            for key in their_sd:
                assert_same(layout(their_sd[key]), layout(our_sd[key]), f"{case} {key}")
            assert set(their_osd["state"]) == set(our_osd["state"]), case
            for fqn, states in their_osd["state"].items():
                for name, value in states.items():
                    assert_same(layout(value), layout(our_osd["state"][fqn][name]), f"{case} osd {fqn} {name}")
            if strategy == "FULL_SHARD":
                assert isinstance(our_sd["block.head.weight"], ShardedTensor)
                holds = len(our_sd["block.head.weight"].local_shards()) == 1  # 2 rows, 4 ranks: 1, 1, 0, 0
                assert holds == (dist.get_rank() < 2)


@distributed(world_size=4)
def test_with_a_device_mesh_values_stay_dtensors():
    mesh = init_device_mesh("cpu", (4,))
    for lib in ("torch", "ours"):
        sd, osd = sharded_dicts(lib, *trained(lib, False, mesh=mesh))
        assert all(isinstance(v, DTensor) for v in sd.values()), lib
        assert all(isinstance(s["exp_avg"], DTensor) for s in osd["state"].values()), lib


def full_parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    with fullshard.FSDP.summon_full_params(model):
        return {name: p.detach().clone() for name, p in model.named_parameters()}


@distributed(world_size=2)
def test_both_forms_load_model_and_optimizer():
    """A ShardedTensor dict and a DTensor dict (a wrapper given a mesh) load into either wrapper."""
    mesh = init_device_mesh("cpu", (2,))
    for source_mesh in (None, mesh):
        model, optim = trained("ours", False, mesh=source_mesh)
        sd, osd = (clone_tree(d) for d in sharded_dicts("ours", model, optim))
        expected = full_parameters(model)
        for target_mesh in (None, mesh):
            target = wrapped("ours", False, mesh=target_mesh)
            target_optim = torch.optim.Adam(target.parameters(), lr=0.01)
            with fullshard.FSDP.state_dict_type(target, fullshard.StateDictType.SHARDED_STATE_DICT):
                target.load_state_dict(sd)
                target_optim.load_state_dict(fullshard.FSDP.optim_state_dict_to_load(target, target_optim, osd))
            loaded = full_parameters(target)
            for name, value in expected.items():
                torch.testing.assert_close(loaded[name], value, msg=lambda m: f"{name}: {m}")
            _, target_osd = sharded_dicts("ours", target, target_optim)
            for fqn, states in osd["state"].items():
                torch.testing.assert_close(full_value(target_osd["state"][fqn]["exp_avg"]), full_value(states["exp_avg"]))


@distributed(world_size=2)
def test_a_sharded_tensor_of_another_layout_is_assembled():
    """Columns split instead of rows: the value is gathered, then cut as this unit's."""
    model, _ = trained("ours", False)
    full = torch.arange(35.0).view(7, 5)
    rank = dist.get_rank()
    columns = [(0, 3), (3, 2)]
    metadata = [ShardMetadata([0, start], [7, width], f"rank:{r}/cpu") for r, (start, width) in enumerate(columns)]
    start, width = columns[rank]
    local = [Shard(full[:, start : start + width].contiguous(), metadata[rank])]
    properties = TensorProperties(dtype=torch.float32, requires_grad=False)
    value = ShardedTensor._init_from_local_shards_and_global_metadata(
        local, ShardedTensorMetadata(metadata, torch.Size([7, 5]), properties)
    )
    with fullshard.FSDP.state_dict_type(model, fullshard.StateDictType.SHARDED_STATE_DICT):
        sd = model.state_dict()
        sd["block.lin.weight"] = value
        model.load_state_dict(sd)
    torch.testing.assert_close(full_parameters(model)["block.lin.weight"], full)


def _save(path: str) -> tuple[dict, dict]:
    model, optim = trained("ours", False)
    sd, osd = sharded_dicts("ours", model, optim)
    dcp.save({"model": sd, "optim": osd}, checkpoint_id=path)
    return full_parameters(model), {fqn: full_value(s["exp_avg"]) for fqn, s in osd["state"].items()}


def _load(path: str, params: dict, exp_avgs: dict) -> None:
    model, optim = trained("ours", False)  # its dicts are the templates DCP reads into: ShardedTensors
    state = dict(zip(("model", "optim"), sharded_dicts("ours", model, optim)))
    dcp.load(state, checkpoint_id=path)
    with fullshard.FSDP.state_dict_type(model, fullshard.StateDictType.SHARDED_STATE_DICT):
        model.load_state_dict(state["model"])
        optim.load_state_dict(fullshard.FSDP.optim_state_dict_to_load(model, optim, state["optim"]))
    loaded = full_parameters(model)
    for name, value in params.items():
        torch.testing.assert_close(loaded[name], value, msg=lambda m: f"{name}: {m}")
    _, osd = sharded_dicts("ours", model, optim)
    for fqn, value in exp_avgs.items():
        torch.testing.assert_close(full_value(osd["state"][fqn]["exp_avg"]), value, msg=lambda m: f"{fqn}: {m}")
    # fully_shard over the same checkpoint: DTensors read what ShardedTensors wrote.
    net = Net()
    for module in (net.block, net):
        fullshard.fully_shard(module)
    composable = {"model": net.state_dict()}
    dcp.load(composable, checkpoint_id=path)
    net.load_state_dict(composable["model"])
    for name, param in net.named_parameters():
        torch.testing.assert_close(param.full_tensor(), params[name], msg=lambda m: f"fully_shard {name}: {m}")


def test_dcp_round_trip_at_another_world_size_and_into_fully_shard(tmp_path):
    """torch.distributed.checkpoint saves the ShardedTensors at 4 ranks; 2 ranks load them back."""
    path = str(tmp_path / "checkpoint")
    params, exp_avgs = run_distributed(_save, 4, path)[0]
    run_distributed(_load, 2, path, params, exp_avgs)


# -- LOCAL_STATE_DICT: flat parameters ---------------------------------------------------------------
def local_dict(lib: str, model: nn.Module) -> dict:
    fsdp, _ = api(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with fsdp.FullyShardedDataParallel.state_dict_type(model, fsdp.StateDictType.LOCAL_STATE_DICT):
            return model.state_dict()


class WithBuffer(Net):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("scale", torch.full((3,), 0.5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) * self.scale


@distributed(world_size=4)
def test_local_flat_parameters_hold_torchs_global_tensor():
    """Each flat parameter's ShardedTensor assembles to FSDP1's (the unit's parameters concatenated),
    and FSDP1's local state dict loads into ours (another layout: assembled, then cut)."""
    theirs, _ = trained("torch", False)
    ours, _ = trained("ours", False)
    their_sd, our_sd = local_dict("torch", theirs), local_dict("ours", ours)
    assert set(their_sd) == set(our_sd) and "block._flat_param" in our_sd
    for key in their_sd:
        assert type(our_sd[key]) is type(their_sd[key]), key
        torch.testing.assert_close(full_value(our_sd[key]), full_value(their_sd[key]), msg=lambda m: f"{key}: {m}")
    fresh = wrapped("ours", False)
    with fullshard.FSDP.state_dict_type(fresh, fullshard.StateDictType.LOCAL_STATE_DICT):
        fresh.load_state_dict(their_sd)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

        with TorchFSDP.summon_full_params(theirs):
            expected = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for n, p in theirs.named_parameters()}
    for name, value in full_parameters(fresh).items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")


@distributed(world_size=2)
def test_local_buffers_stay_in_the_compute_dtype():
    for lib in ("torch", "ours"):
        fsdp, policy = api(lib)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = fsdp.FullyShardedDataParallel(
                WithBuffer(),
                auto_wrap_policy=policy({Block}),
                device_id=CPU,
                mixed_precision=fsdp.MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16),
            )
        assert local_dict(lib, model)["scale"].dtype == torch.bfloat16, lib


def _save_local(path: str) -> dict:
    model, _ = trained("ours", False)
    dcp.save(local_dict("ours", model), checkpoint_id=path)
    return full_parameters(model)


def _load_local(path: str, expected: dict) -> None:
    model = wrapped("ours", False)
    sd = local_dict("ours", model)
    dcp.load(sd, checkpoint_id=path)
    with fullshard.FSDP.state_dict_type(model, fullshard.StateDictType.LOCAL_STATE_DICT):
        model.load_state_dict(sd)
    for name, value in full_parameters(model).items():
        torch.testing.assert_close(value, expected[name], msg=lambda m: f"{name}: {m}")
    # torch's FSDP1 reads the same checkpoint: the global tensors are its own.
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    theirs = wrapped("torch", False)
    sd = local_dict("torch", theirs)
    with torch.no_grad():  # its local shards are views of its flat parameter made under no_grad
        dcp.load(sd, checkpoint_id=path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with TorchFSDP.state_dict_type(theirs, _torch_local()):
            theirs.load_state_dict(sd)
        with TorchFSDP.summon_full_params(theirs):
            for name, param in theirs.named_parameters():
                clean = name.replace("_fsdp_wrapped_module.", "")
                torch.testing.assert_close(param, expected[clean], msg=lambda m: f"torch {clean}: {m}")


def _torch_local():
    from torch.distributed.fsdp import StateDictType

    return StateDictType.LOCAL_STATE_DICT


def test_local_state_dict_reshards_through_dcp(tmp_path):
    """Saved at 4 ranks, loaded at 2 (by fullshard and by torch's FSDP1): the flat parameters' global
    tensors do not depend on the world size or the framework."""
    path = str(tmp_path / "local")
    expected = run_distributed(_save_local, 4, path)[0]
    run_distributed(_load_local, 2, path, expected)


@distributed(world_size=4)
def test_sharded_state_dict_after_destroyed_groups_over_the_same_ranks():
    """DeviceMesh equality ignores the process groups, so torch's sharding-propagation cache hands the
    optimizer step's in-place outputs the mesh of earlier, destroyed groups over the same ranks; the
    state dicts still cut the values over the unit's own groups."""
    first = hybrid_groups()
    trained("ours", False, "HYBRID_SHARD", groups=first)  # primes the cache with a mesh over `first`
    for group in first:
        dist.destroy_process_group(group)
    model, optim = trained("ours", False, "HYBRID_SHARD", groups=hybrid_groups())
    model_sd, optim_sd = sharded_dicts("ours", model, optim)
    with fullshard.FullyShardedDataParallel.summon_full_params(model):
        full = {name.replace("_fsdp_wrapped_module.", ""): p.detach().clone() for name, p in model.named_parameters()}
    assert set(model_sd) == set(full)
    for name, value in model_sd.items():
        assert isinstance(value, ShardedTensor), name
        torch.testing.assert_close(full_value(value), full[name], msg=name)
    assert all(isinstance(v, ShardedTensor) for s in optim_sd["state"].values() for k, v in s.items() if k != "step")
