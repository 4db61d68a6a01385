"""Behaviours torch's own FSDP tests assert that fullshard missed (issue 35, item 2),
each checked against torch's FSDP on gloo (the oracle) or a one-process reference."""

import contextlib
import copy
import types
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from upstream_oracle import sgd_train

from fullshard import FSDP
from fullshard._core import comm
from fullshard.models import MLP
from fullshard.testing import distributed, full_value

# Out of the inner loop (4-rank pools, about 35 s): the inner loop keeps their paths' parity tests.
pytestmark = pytest.mark.slow

CPU = torch.device("cpu")


def adam_steps(model: nn.Module, x: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``steps`` Adam steps (lr 1e-2) on the loss ``model(x).sum()``; the losses."""
    return sgd_train(model, [x] * steps, optim=torch.optim.Adam(model.parameters(), lr=1e-2))


class NormedMLP(nn.Module):
    """A plain LayerNorm before a tensor-parallel MLP: DTensor and plain parameters in one unit."""

    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.mlp = MLP(8)
        with torch.no_grad():
            self.norm.weight.normal_()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.norm(x))


TP_PLAN = {"mlp.in_proj": ColwiseParallel(), "mlp.out_proj": RowwiseParallel()}


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("sync_module_states", [False, True])
@distributed(world_size=4)
def test_wrapper_flat_parameter_with_tensor_parallel_trains_like_torch(sync_module_states, use_orig_params):
    """The wrapper over tensor-parallel DTensors (use_orig_params=False, FSDP1's default, and True;
    FULL_SHARD and SHARD_GRAD_OP) trains as torch's FSDP1 does; sync_module_states takes
    data-parallel rank 0's values (torch cannot sync on CPU, so its twin starts from them).
    Torch's CPUOffload variants need a GPU (on CPU there is nothing to offload to)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy

    from fullshard import ShardingStrategy

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_rank = mesh["dp"].get_local_rank()
    for strategy in ("FULL_SHARD", "SHARD_GRAD_OP"):
        torch.manual_seed(dp_rank if sync_module_states else 0)
        ours = NormedMLP()
        torch.manual_seed(0)
        theirs = NormedMLP()
        for model in (ours, theirs):
            parallelize_module(model, mesh["tp"], copy.deepcopy(TP_PLAN))
        ours = FSDP(
            ours,
            device_mesh=mesh["dp"],
            sync_module_states=sync_module_states,
            use_orig_params=use_orig_params,
            sharding_strategy=ShardingStrategy[strategy],
        )
        theirs = TorchFSDP(
            theirs,
            device_mesh=mesh["dp"],
            device_id=CPU,
            use_orig_params=use_orig_params,
            sharding_strategy=TorchStrategy[strategy],
        )
        optims = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (ours, theirs)]
        torch.manual_seed(100 + dp_rank)
        for step in range(3):
            x = torch.randn(4, 8)
            losses = []
            for model, optim in zip((ours, theirs), optims):
                loss = model(x).pow(2).sum()
                loss.backward()
                optim.step()
                optim.zero_grad()
                losses.append(loss.detach())
            torch.testing.assert_close(losses[0], losses[1], msg=lambda m: f"{strategy} step {step}: {m}")
        with FSDP.summon_full_params(ours), TorchFSDP.summon_full_params(theirs):
            for (name, param), (_, other) in zip(ours.named_parameters(), theirs.named_parameters()):
                torch.testing.assert_close(full_value(param), full_value(other), msg=lambda m: f"{name}: {m}")
        x = torch.randn(4, 8)  # and training goes on after summon_full_params
        torch.testing.assert_close(ours(x).pow(2).sum(), theirs(x).pow(2).sum())


class ReplicatedOnTP(nn.Module):
    """A parameter and a buffer replicated over the tensor-parallel mesh, with values of each rank's own."""

    def __init__(self, tp_mesh) -> None:
        super().__init__()
        from torch.distributed.tensor import DTensor, Replicate

        self.param = nn.Parameter(DTensor.from_local(torch.randn(8, 8), tp_mesh, [Replicate()], run_check=False))
        self.register_buffer("buf", DTensor.from_local(torch.randn(8, 8), tp_mesh, [Replicate()], run_check=False))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.param.to_local() + self.buf.to_local() + x


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=4)
def test_sync_module_states_syncs_replicated_dtensor_parameters_and_buffers(use_orig_params):
    """sync_module_states=True over the data-parallel dim (torch's test_fsdp_tp_sync_module_state):
    every rank ends with the values of data-parallel rank 0 of its tensor-parallel column, for the
    parameter (seen inside summon_full_params) and the buffer; before, all four ranks differ."""
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
    dp_group = mesh["dp"].get_group()
    torch.manual_seed(dist.get_rank())
    model = ReplicatedOnTP(mesh["tp"])

    def across_dp(tensor: torch.Tensor) -> list[torch.Tensor]:
        gathered = [torch.empty_like(tensor) for _ in range(dp_group.size())]
        dist.all_gather(gathered, tensor.contiguous(), group=dp_group)
        return gathered

    before = {"param": across_dp(model.param.to_local()), "buf": across_dp(model.buf.to_local())}
    for values in before.values():
        assert not torch.equal(values[0], values[1])
    model = FSDP(model, device_mesh=mesh["dp"], sync_module_states=True, use_orig_params=use_orig_params)
    with FSDP.summon_full_params(model):
        after = {"param": across_dp(model.param.to_local()), "buf": across_dp(model.buf.to_local())}
    for name, values in after.items():
        for value in values:
            torch.testing.assert_close(value, before[name][0], rtol=0, atol=0, msg=lambda m: f"{name}: {m}")


class GroupDouble:
    """What torch's own tests pass as a process group: ``rank()`` and ``size()``, no ``dist.ProcessGroup``."""

    def __init__(self, rank: int, size: int) -> None:
        self._rank, self._size = rank, size

    def rank(self) -> int:
        return self._rank

    def size(self) -> int:
        return self._size


@distributed(world_size=2)
def test_wrapper_takes_a_process_group_double():
    """A one-rank double shards nothing (each rank keeps and trains its own copy, as torch's FSDP1
    does); a double of the world's size shards over the world; any other size is refused."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(rank)  # a different model per rank: nothing is synced over one rank
    model = nn.Sequential(nn.Linear(5, 6), nn.ReLU(), nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    alone = FSDP(model, process_group=GroupDouble(rank, 1))
    with comm.record_comms() as records:
        alone(torch.ones(2, 5)).sum().backward()
        reference(torch.ones(2, 5)).sum().backward()
    assert not records  # nothing to gather or reduce over one rank
    (flat,) = alone.parameters()  # the whole model, unsharded
    torch.testing.assert_close(flat.grad, torch.cat([p.grad.view(-1) for p in reference.parameters()]))
    torch.manual_seed(0)
    whole = nn.Linear(4, 4)
    theirs = TorchFSDP(copy.deepcopy(whole), process_group=dist.group.WORLD, device_id=CPU)
    ours = FSDP(whole, process_group=GroupDouble(rank, world))
    assert [p.numel() for p in ours.parameters()] == [p.numel() for p in theirs.parameters()]  # sharded over both
    x = torch.randn(3, 4)
    torch.testing.assert_close(ours(x), theirs(x))
    with pytest.raises(ValueError, match=r"^FullyShardedDataParallel expects process_group .* of size 3 in a world of 2$"):
        FSDP(nn.Linear(4, 4), process_group=GroupDouble(rank, 3))


@distributed(world_size=2)
def test_auto_wrapping_a_model_that_holds_units_raises_like_torch():
    """A unit directly under the root or one level deeper: torch's FSDP1 and ours both raise
    ValueError naming its path ("but found <path> in"), with a class policy and the size policy."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchModuleWrapPolicy
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

    from fullshard import fully_shard
    from fullshard.wrap import ModuleWrapPolicy, size_based_auto_wrap_policy

    def torch_inner(module):
        return TorchFSDP(module, device_id=CPU)

    for wrapper, policies, wrap_inner in (
        (TorchFSDP, (TorchModuleWrapPolicy({nn.Linear}), torch_size_policy), torch_inner),
        (FSDP, (ModuleWrapPolicy({nn.Linear}), size_based_auto_wrap_policy), FSDP),
        (FSDP, (ModuleWrapPolicy({nn.Linear}), size_based_auto_wrap_policy), fully_shard),
    ):
        kwargs = {"device_id": CPU} if wrapper is TorchFSDP else {}
        for nested, path in ((False, "lin1"), (True, "lin1.1")):
            for policy in policies:
                model = nn.Module()
                inner = wrap_inner(nn.Linear(4, 4))
                model.lin1 = nn.Sequential(nn.Linear(4, 4), inner) if nested else inner
                model.lin2 = wrap_inner(nn.Linear(4, 4))
                policy = functools.partial(policy, min_num_params=1) if isinstance(policy, types.FunctionType) else policy
                with pytest.raises(ValueError, match=rf"^FSDP auto wrapping requires modules to not already have FSDP applied but found {path} in"):
                    wrapper(model, auto_wrap_policy=policy, **kwargs)
    model = nn.Sequential(nn.Linear(4, 4), FSDP(nn.Sequential(nn.Linear(4, 4))))
    FSDP(model)  # nesting by hand stays allowed


class _CustomGather:
    def allocate(self, size, *, dtype, device):
        return torch.empty(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, async_op=False):
        return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)


@pytest.mark.parametrize("custom", ["all_gather", "reduce_scatter"])
@distributed(world_size=2)
def test_process_group_allocation_refuses_a_custom_collective_like_torch(custom):
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import fully_shard

    for shard in (torch_fully_shard, fully_shard):
        model = shard(nn.Linear(4, 4))
        model.set_allocate_memory_from_process_group_for_comm(False)  # before a custom one: fine
        getattr(model, f"set_custom_{custom}")(_CustomGather())
        for enable in (True, False):
            with pytest.raises(AssertionError, match=r"^cannot call set_allocate_memory_from_process_group"):
                model.set_allocate_memory_from_process_group_for_comm(enable)


def _unshard_nested_first(shard) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Nested units gathered (async) before the root's first forward, then two training steps:
    the losses and the full parameters after them."""
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
    for layer in model:
        shard(layer)
    shard(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(2):
        handles = [layer.unshard(async_op=True) for layer in model[:2]]
        for handle in handles:
            handle.wait()
        assert all(not isinstance(p, torch.distributed.tensor.DTensor) for p in model[0].parameters())
        torch.manual_seed(10 + dist.get_rank() + step)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optim.step()
        optim.zero_grad()
        losses.append(loss.detach())
    return losses, [full_value(p) for p in model.parameters()]


@distributed(world_size=2)
def test_unshard_of_nested_units_before_the_first_forward_keeps_the_real_root():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import fully_shard

    ours, theirs = _unshard_nested_first(fully_shard), _unshard_nested_first(torch_fully_shard)
    torch.testing.assert_close(ours, theirs)


def _wrapped_names(model: nn.Module) -> list[str]:
    """The wrapped units' paths, torch's and our wrapper's inner-module names taken out."""
    return [
        name.replace("_fsdp_wrapped_module.", "").replace("_fsdp_wrapped_module", "")
        for name, module in model.named_modules()
        if type(module).__name__ == "FullyShardedDataParallel"
    ]


# The size policy's presets (torch's TestAutoWrap preset tests): a model and the leaves added to
# FORCE_LEAF_MODULES. Linears of 10x10 (110 parameters) pass min_num_params=40, of 5x5 (30) do not.
SIZE_POLICY_MODELS = {
    "excluded container, small children": (lambda: nn.ModuleList([nn.Linear(5, 5), nn.Linear(5, 5)]), set()),
    "excluded container, a large child": (lambda: nn.ModuleList([nn.Linear(10, 10)]), set()),
    "forced leaf attention": (lambda: nn.Sequential(nn.Linear(10, 10), nn.MultiheadAttention(100, 1)), set()),
    "Linear added to the forced leaves": (
        lambda: nn.Sequential(nn.Linear(10, 10), nn.ModuleList([nn.Linear(10, 10)])),
        {nn.Linear},
    ),
    "nested": (
        lambda: nn.Sequential(
            nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8)),
            nn.MultiheadAttention(8, 2),
            nn.Sequential(nn.Sequential(nn.Linear(8, 8))),
        ),
        set(),
    ),
}


@distributed(world_size=2)
def test_size_policy_presets_wrap_like_torchs():
    """Containers in EXCLUDE_WRAP_MODULES are never units themselves (their large children are);
    FORCE_LEAF_MODULES (attention, or the defaults extended) are never units and never looked
    into: the same units as torch's FSDP1 under its own policy, for each model."""
    import functools

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy as torch_size_policy

    from fullshard.wrap import size_based_auto_wrap_policy

    assert size_based_auto_wrap_policy.FORCE_LEAF_MODULES == torch_size_policy.FORCE_LEAF_MODULES
    assert size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES == torch_size_policy.EXCLUDE_WRAP_MODULES
    for label, (build, extra_leaves) in SIZE_POLICY_MODELS.items():
        names = []
        for wrapper, policy in ((TorchFSDP, torch_size_policy), (FSDP, size_based_auto_wrap_policy)):
            torch.manual_seed(0)
            chosen = functools.partial(
                policy, min_num_params=40, force_leaf_modules=policy.FORCE_LEAF_MODULES | extra_leaves
            )
            kwargs = {"device_id": CPU} if wrapper is TorchFSDP else {}
            names.append(_wrapped_names(wrapper(build(), auto_wrap_policy=chosen, **kwargs)))
        assert names[0] == names[1], label
        assert names[1][0] == "", label  # the root is always a unit
        if label == "excluded container, a large child":
            assert names[1] == ["", "0"]
        if label == "forced leaf attention":
            assert names[1] == ["", "0"]  # attention and its out_proj stay inside the root
        if label == "Linear added to the forced leaves":
            assert names[1] == [""]


class _InnerWithUnit(nn.Module):
    def __init__(self, wrapper, **kwargs) -> None:
        super().__init__()
        self.layers = nn.Sequential(wrapper(nn.Linear(5, 5), **kwargs), nn.ReLU(), nn.Linear(5, 3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


@distributed(world_size=2)
def test_wrapping_a_trained_model_again_for_inference_like_torch():
    """FSDP1 lets a new root adopt units another root used (FSDP2 refuses: fully_shard's own test)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    outputs = []
    for wrapper, kwargs in ((TorchFSDP, {"device_id": CPU}), (FSDP, {})):
        torch.manual_seed(0)
        inner = _InnerWithUnit(wrapper, **kwargs)
        model = wrapper(inner, **kwargs)
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        for _ in range(3):
            model(torch.randn(4, 5)).sum().backward()
            optim.step()
            optim.zero_grad()
        x = torch.randn(4, 5)
        trained = model(x)
        again = wrapper(inner, **kwargs)
        torch.testing.assert_close(again(x), trained)
        outputs.append(trained)
    torch.testing.assert_close(outputs[0], outputs[1])


@pytest.mark.parametrize("broadcast", [True, False])
@distributed(world_size=2)
def test_meta_model_loaded_by_set_model_state_dict_saves_and_runs_like_torch(broadcast):
    """torch's set_model_state_dict loads into a meta-device model by assigning new parameters:
    state_dict() and forward see them at once, before any forward (torch's FSDP2 adopts them in a
    load post-hook too)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import fully_shard

    torch.manual_seed(0)
    reference = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    full = reference.state_dict()
    x = torch.randn(2, 4)
    for shard in (torch_fully_shard, fully_shard):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
        for index in (0, 2):
            shard(model[index])
        shard(model)
        if broadcast:  # only rank 0 holds the dict
            loaded = {k: v.clone() for k, v in full.items()} if dist.get_rank() == 0 else {}  # torch's call rewrites it
        else:
            loaded = {k: v.clone() for k, v in full.items()}
        options = StateDictOptions(full_state_dict=True, broadcast_from_rank0=broadcast, strict=False)
        set_model_state_dict(model, loaded, options=options)
        saved = model.state_dict()
        assert not any(v.is_meta for v in saved.values()), shard.__module__
        for key, value in saved.items():
            torch.testing.assert_close(full_value(value), full[key], msg=lambda m: f"{shard.__module__} {key}: {m}")
        torch.testing.assert_close(model(x), reference(x))


class EvenNet(nn.Module):
    """torch's even model: every layer's rows split evenly over 2 and 4 ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.net1 = nn.Sequential(nn.Linear(8, 16), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
        self.net3 = nn.Linear(32, 64)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(64, 8))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net4(self.net3(self.net2(self.net1(x))))


class UnevenNet(EvenNet):
    """Uneven rows (5, 15, 5): padded shards, and a rank with none of a bias."""

    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.net1 = nn.Sequential(nn.Linear(5, 10), nn.ReLU())
        self.net2 = nn.Sequential(nn.Linear(10, 15), nn.ReLU())
        self.net3 = nn.Linear(15, 30)
        self.net4 = nn.Sequential(nn.ReLU(), nn.Linear(30, 5))


def _local(value):
    return value.to_local() if hasattr(value, "to_local") else value


def _assert_same_values(saved, loaded, where: str) -> None:
    assert type(saved) is type(loaded), where
    torch.testing.assert_close(_local(loaded), _local(saved), rtol=0, atol=0, msg=lambda m: f"{where}: {m}")
    assert _local(loaded).device == _local(saved).device, where


def _sharded_dicts_survive_torch_save(mesh, strategy) -> None:
    """torch's test_dtensor_sharded_{model,optim}_load_state_dict: a mesh wrapper's sharded model and
    optimizer dicts go through torch.save on every rank; after one more step, loading them back
    restores exactly the saved values (DTensors, same devices), so the load is not a no-op."""
    import io

    from fullshard import ShardedOptimStateDictConfig, ShardedStateDictConfig, StateDictType

    for net, offload_to_cpu, use_orig_params in (
        (EvenNet, False, False),
        (UnevenNet, True, False),
        (UnevenNet, False, True),
        (EvenNet, True, True),
    ):
        where = f"{net.__name__} offload_to_cpu={offload_to_cpu} use_orig_params={use_orig_params}"
        torch.manual_seed(0)
        model = FSDP(net(), device_mesh=mesh, sharding_strategy=strategy, use_orig_params=use_orig_params)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        torch.manual_seed(1 + dist.get_rank())
        batch = torch.rand(4, model.net1[0].in_features)

        def step() -> None:
            model(batch).sum().backward()
            optim.step()
            optim.zero_grad()

        step()
        FSDP.set_state_dict_type(
            model,
            StateDictType.SHARDED_STATE_DICT,
            ShardedStateDictConfig(offload_to_cpu=offload_to_cpu),
            ShardedOptimStateDictConfig(offload_to_cpu=offload_to_cpu),
        )
        files = {"model": io.BytesIO(), "optim": io.BytesIO()}
        saved = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        for key, value in saved.items():
            torch.save(value, files[key])
            files[key].seek(0)
        saved = {key: copy.deepcopy(value) for key, value in saved.items()}
        step()
        stepped = model.state_dict()
        changed = [k for k, v in saved["model"].items() if not torch.equal(_local(stepped[k]), _local(v))]
        assert changed, f"{where}: the extra step changed nothing: {stepped}"
        model.load_state_dict(torch.load(files["model"], weights_only=False))
        loaded = torch.load(files["optim"], weights_only=False)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, loaded))
        now = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        assert list(now["model"]) == list(saved["model"]), where
        for key, value in saved["model"].items():
            _assert_same_values(value, now["model"][key], f"{where} {key}")
        assert list(now["optim"]["state"]) == list(saved["optim"]["state"]), where
        for fqn, states in saved["optim"]["state"].items():
            for name, value in states.items():
                _assert_same_values(value, now["optim"]["state"][fqn][name], f"{where} {fqn}.{name}")
                local = _local(value)
                if name != "step":  # each shard owns memory of its own size (no view of a full value)
                    assert local.untyped_storage().nbytes() == local.numel() * local.element_size(), (where, fqn)


@distributed(world_size=2)
def test_sharded_dicts_of_a_mesh_wrapper_survive_torch_save():
    from fullshard import ShardingStrategy

    _sharded_dicts_survive_torch_save(init_device_mesh("cpu", (2,)), ShardingStrategy.FULL_SHARD)


@distributed(world_size=4)
def test_sharded_dicts_of_a_hybrid_mesh_wrapper_survive_torch_save():
    from fullshard import ShardingStrategy

    _sharded_dicts_survive_torch_save(init_device_mesh("cpu", (2, 2)), ShardingStrategy.HYBRID_SHARD)


# Factor 8 takes the same path (a sum and a division) as 4: only make test-exhaustive runs it.
@pytest.mark.parametrize("factor", [4.0, pytest.param(8.0, marks=pytest.mark.exhaustive)])
@distributed(world_size=4)
def test_root_gradient_divide_factor_on_a_2d_mesh_matches_torch_and_one_process(factor):
    """The root's divide factor on a (replicate, shard) mesh, every unit kept unsharded after
    forward, 10 AdamW steps: the root's gradients are the sum over ranks / factor, the blocks'
    the average (torch's own test of set_gradient_divide_factor, issue 35 item 1). torch's FSDP2
    reduces with PREMUL_SUM there, which gloo lacks: it sums and divides instead."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    from fullshard import fully_shard
    from fullshard.models import ModelArgs, Transformer, TransformerBlock

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("outer", "inner"))
    torch.manual_seed(42)
    reference = Transformer(ModelArgs(dropout_p=0.0, weight_tying=False))
    for module in reference.modules():  # torch's default init: nonzero biases, as in torch's test
        if isinstance(module, (nn.Linear, nn.Embedding, nn.LayerNorm)):
            module.reset_parameters()
    models = []
    for shard in (fully_shard, torch_fully_shard):
        model = copy.deepcopy(reference)
        for block in model.layers:
            shard(block, mesh=mesh, reshard_after_forward=False)
        shard(model, mesh=mesh, reshard_after_forward=False)
        model.set_gradient_divide_factor(factor)
        if shard is torch_fully_shard:
            for module in model.modules():
                if hasattr(module, "set_force_sum_reduction_for_comms"):
                    module.set_force_sum_reduction_for_comms(True)
        models.append(model)
    block_params = {p for m in reference.modules() if isinstance(m, TransformerBlock) for p in m.parameters()}
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in [*models, reference]]
    torch.manual_seed(42 + dist.get_rank())
    tokens = torch.randint(0, reference.args.vocab_size, (2, 16))
    for step in range(10):
        losses = [model(tokens).sum() for model in [*models, reference]]
        for loss in losses:
            loss.backward()
        for param in reference.parameters():  # what the ranks' reductions compute, in one process
            param.grad.mul_(1.0 / (world if param in block_params else factor))
            dist.all_reduce(param.grad)
        for optim in optims:
            optim.step()
            optim.zero_grad()
        for model in models:
            for (name, param), ref_param in zip(model.named_parameters(), reference.parameters()):
                torch.testing.assert_close(full_value(param), ref_param, msg=lambda m: f"step {step}, {name}: {m}")


class ReduceThenMLPs(nn.Module):
    """Three layers whose outputs are all-reduced (async, not differentiable) while the next
    unit's parameters are gathered: each MLP unit's ``unshard(async_op=True)`` is issued inside
    the root's forward, before the MLPs run (torch's TestFullyShardUnshardMultiProcess)."""

    def __init__(self, dim: int = 8) -> None:
        super().__init__()
        self.reduce = nn.ModuleList([nn.Linear(dim, dim, bias=False) for _ in range(3)])
        self.mlps = nn.ModuleList([MLP(dim) for _ in range(3)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ys, works = [], []
        for layer, mlp in zip(self.reduce, self.mlps):
            y = torch.relu(layer(x))
            works.append(dist.all_reduce(y.detach(), async_op=True))
            ys.append(y)
            if hasattr(mlp, "unshard"):
                mlp.unshard(async_op=True)
        out = 0
        for y, work, mlp in zip(ys, works, self.mlps):
            work.wait()
            out = out + mlp(y)
        return out


@distributed(world_size=2)
def test_async_unshard_inside_the_roots_forward_trains_like_torch():
    """MLP units kept unsharded after forward, gathered early by the root's forward; replicate
    (torch's FSDP-based one for torch) as the root: 10 Adam steps give torch's losses and
    parameters."""
    from torch.distributed._composable.replicate_with_fsdp import replicate as torch_replicate
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    runs = []
    for shard, replicate in ((torch_fully_shard, torch_replicate), (fullshard.fully_shard, fullshard.replicate)):
        torch.manual_seed(42)
        model = ReduceThenMLPs()
        for mlp in model.mlps:
            shard(mlp, reshard_after_forward=False)
        replicate(model)
        torch.manual_seed(43 + dist.get_rank())
        losses = adam_steps(model, torch.randn(2, 8), 10)
        runs.append((losses, [full_value(p) for p in model.parameters()]))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


def _patch_bf16_gather(local: torch.Tensor, calls: list) -> None:
    """Gives one tensor object (not its class) a bf16 all-gather: the pre-hook sends the shard
    in bf16, the post-hook upcasts the gathered rows to the parameter dtype."""
    from torch.autograd.grad_mode import _unsafe_preserve_version_counter

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        calls.append(tuple(outer_size))
        return (self.to(torch.bfloat16),), None

    def fsdp_post_all_gather(self, outputs, metadata, param_dtype, *, out=None):
        (gathered,) = outputs
        if out is not None:  # a refresh in place: autograd saved ``out`` in forward
            with torch.no_grad(), _unsafe_preserve_version_counter(out):
                out.copy_(gathered)
            return None
        full = gathered.to(param_dtype)
        return full, (gathered, full)

    local.fsdp_pre_all_gather = types.MethodType(fsdp_pre_all_gather, local)
    local.fsdp_post_all_gather = types.MethodType(fsdp_post_all_gather, local)


@distributed(world_size=2)
def test_gather_hooks_patched_onto_local_shards_after_to_empty_are_used_like_torch():
    """torch's test_all_gather_extensions_monkey_patch: a meta model sharded, materialized with
    to_empty, then each weight's local shard (a plain tensor) given gather hooks before the first
    forward: the hooks run (bf16 on the wire), and 3 Adam steps give torch's losses and weights."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    runs = []
    for shard in (torch_fully_shard, fullshard.fully_shard):
        with torch.device("meta"):
            model = nn.Sequential(*(MLP(8) for _ in range(3)))
        for mlp in model:
            shard(mlp)
        shard(model)
        model.to_empty(device="cpu")
        torch.manual_seed(0)
        for param in model.parameters():
            nn.init.trunc_normal_(param)
        calls: list = []
        for name, param in model.named_parameters():
            if name.endswith("weight"):
                _patch_bf16_gather(param._local_tensor, calls)
        torch.manual_seed(42 + dist.get_rank())
        losses = adam_steps(model, torch.randn(2, 8), 3)
        assert calls, shard.__module__
        runs.append((losses, [full_value(p) for p in model.parameters()], len(calls)))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@distributed(world_size=2)
def test_meta_model_under_cpu_offload_loaded_piece_by_piece_like_torch():
    """torch's test_dp_state_dict_cpu_offload: a meta model under CPU offload takes DTensor
    state-dict pieces one at a time (assign=True, strict=False), some parameters still on meta
    between them; forward then runs (lazy init without error), the state dict is on the CPU and
    holds the loaded values, and training gives torch's FSDP2's losses and parameters. (torch's
    error for a non-CPU dict, and its pinned memory, need an accelerator.)"""
    from torch.distributed.fsdp import CPUOffloadPolicy as TorchCPUOffloadPolicy
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import distribute_tensor

    import fullshard

    torch.manual_seed(42)
    full = [torch.randn(4, 4), torch.randn(4, 4)]
    x = torch.rand(4, 4, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    runs = []
    for shard, policy in (
        (torch_fully_shard, TorchCPUOffloadPolicy(pin_memory=False)),
        (fullshard.fully_shard, fullshard.CPUOffloadPolicy(pin_memory=False)),
    ):
        with torch.device("meta"):
            model = nn.Sequential(nn.Linear(4, 4, bias=False), nn.Linear(4, 4, bias=False))
        for layer in model:
            shard(layer, offload_policy=policy)
        shard(model, offload_policy=policy)
        pieces = [
            {name: distribute_tensor(value, param.device_mesh, param.placements)}
            for (name, param), value in zip(model.named_parameters(), full)
        ]
        for piece in pieces:
            model.load_state_dict(piece, assign=True, strict=False)
        saved = model.state_dict()
        assert all(v.device.type == "cpu" for v in saved.values()), shard.__module__
        for value, expected in zip(saved.values(), full):
            torch.testing.assert_close(value.full_tensor(), expected, rtol=0, atol=0)
        losses = adam_steps(model, x, 3)
        assert all(v.device.type == "cpu" for v in model.state_dict().values()), shard.__module__
        runs.append((losses, [full_value(p) for p in model.parameters()]))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_optimizer_state_keys_with_checkpoint_wrappers_and_ignored_modules_are_torchs(use_orig_params):
    """torch's test_full_optim_state_dict_keys: optimizer state dicts (full and sharded) of a model
    whose Linears are checkpoint-wrapped, one module ignored, are keyed as its model state dict is:
    no _checkpoint_wrapped_module segment (ours had it, so a torch checkpoint's keys did not match)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import apply_activation_checkpointing
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    from fullshard import StateDictType

    keys = {}
    for wrapper, types_, kwargs in (
        (TorchFSDP, TorchStateDictType, {"device_id": CPU}),
        (FSDP, StateDictType, {}),
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Sequential(nn.Linear(6, 6)), nn.Linear(6, 3))
        apply_activation_checkpointing(model, check_fn=lambda m: isinstance(m, nn.Linear))
        model[2][0] = FSDP(model[2][0], use_orig_params=use_orig_params, **kwargs) if wrapper is FSDP else wrapper(
            model[2][0], use_orig_params=use_orig_params, **kwargs
        )
        model = wrapper(model, use_orig_params=use_orig_params, ignored_modules=[model[3]], **kwargs)
        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            with wrapper.state_dict_type(model, types_[kind]):
                model_keys = set(model.state_dict())
                optim_keys = set(wrapper.optim_state_dict(model, optim)["state"])
            keys[(wrapper.__module__, kind)] = (model_keys, optim_keys)
    for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
        ours, theirs = keys[("fullshard", kind)], keys[(TorchFSDP.__module__, kind)]
        assert ours == theirs, kind
        assert ours[1] <= ours[0] and not any("_checkpoint_wrapped_module" in k for k in ours[1]), kind


class NormedPair(nn.Module):
    """Two layers and a root parameter that a user recomputes from them after materializing
    (torch's test_reset_sharded_param_in_lazy_init)."""

    def __init__(self) -> None:
        super().__init__()
        self.layer1 = nn.Linear(3, 3, bias=False)
        self.layer2 = nn.Linear(3, 3, bias=False)
        self.weight_norm = nn.Parameter(torch.empty(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer2(self.layer1(x)).sum() + self.weight_norm.sum()


class NoInputs(nn.Module):
    """A root whose forward takes no inputs (torch's test_root_no_forward_inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.randn(4, 4))
        self.lin = nn.Linear(4, 4)

    def forward(self) -> torch.Tensor:
        return self.lin(self.start).sum()


def _fully_shard_edge_cases(shard) -> dict[str, Any]:
    """Values of several small fully_shard flows, to compare across libraries."""
    out: dict[str, Any] = {}
    with torch.device("meta"):
        model = NormedPair()
    shard(model.layer1)
    shard(model.layer2)
    shard(model)
    model.layer1.to_empty(device="cpu")
    model.layer2.to_empty(device="cpu")
    with torch.no_grad():
        for index, param in enumerate((model.layer1.weight, model.layer2.weight)):
            full = torch.arange(9.0).view(3, 3) * (index + 1) / 10
            param.to_local().copy_(full.chunk(dist.get_world_size())[dist.get_rank()])
        norm = torch.linalg.norm(model.layer1.weight, dim=1) + torch.linalg.norm(model.layer2.weight, dim=1)
    model.weight_norm = nn.Parameter(norm)  # a DTensor: the root's new sharded parameter
    loss = model(torch.ones(3, 3))
    loss.backward()
    out["replaced root parameter"] = (loss.detach(), [full_value(p.grad) for p in model.parameters()])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    for layer in model:
        shard(layer)
    shard(model)  # the root manages no parameter
    states = [shard.state(m) for m in (model[0], model[1], model)]
    assert len({id(s) for s in states}) == 3 and shard.state(model[0]) is states[0]
    handle = model.unshard(async_op=True)
    if handle is not None:
        handle.wait()
    out["unit without parameters"] = model(torch.ones(2, 4)).detach()
    torch.manual_seed(0)
    model = NoInputs()
    shard(model.lin)
    shard(model)
    loss = model()
    loss.backward()
    out["no forward inputs"] = (loss.detach(), [full_value(p.grad) for p in model.parameters()])
    return out


@distributed(world_size=2)
def test_fully_shard_edge_cases_like_torch():
    """A root parameter replaced (by a DTensor) after sharding and before the first forward; a root
    that manages no parameter gathered by unshard(async_op=True); a forward without inputs; one
    state per unit: the values of torch's FSDP2."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    theirs = _fully_shard_edge_cases(torch_fully_shard)
    ours = _fully_shard_edge_cases(fullshard.fully_shard)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")


@distributed(world_size=2)
def test_fully_shard_trains_what_torch_refuses_like_one_process():
    """Deliberate differences (docs/api.md): a unit over several modules with no parent unit (a
    root of several modules; torch raises RuntimeError at lazy init) and a non-contiguous
    (channels_last) parameter (torch raises NotImplementedError) train as one process does."""
    import fullshard

    def steps(model: nn.Module, forward, shape, average: bool) -> list[torch.Tensor]:
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(2):
            ranks = range(dist.get_world_size()) if average else [dist.get_rank()]
            xs = [torch.randn(*shape, generator=torch.Generator().manual_seed(10 * step + r)) for r in ranks]
            (sum(forward(model, x).sum() for x in xs) / len(xs)).backward()
            optim.step()
            optim.zero_grad()
        return [full_value(p) for p in model.parameters()]

    torch.manual_seed(0)
    pair = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    reference = steps(copy.deepcopy(pair), lambda m, x: m[1](m[0](x)), (2, 4), average=True)
    fullshard.fully_shard([pair[0], pair[1]])
    torch.testing.assert_close(steps(pair, lambda m, x: m[1](m[0](x)), (2, 4), average=False), reference)
    torch.manual_seed(0)
    conv = nn.Conv2d(3, 4, 3).to(memory_format=torch.channels_last)
    assert not conv.weight.is_contiguous()
    reference = steps(copy.deepcopy(conv), lambda m, x: m(x), (2, 3, 6, 6), average=True)
    fullshard.fully_shard(conv)
    torch.testing.assert_close(steps(conv, lambda m, x: m(x), (2, 3, 6, 6), average=False), reference)


# torch's FSDP1 argument checks whose messages its own tests match (test_ignored_states_check,
# test_bad_arg_meta): (case, the anchored regex both libraries' ValueError must match, the arguments).
def _two_layer_block() -> nn.Sequential:
    return nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))


def _ignored_children(model: nn.Sequential) -> list[nn.Module]:
    return list(model[0].children())[1:]


WRAPPER_ARGUMENT_ERRORS = (
    (
        "parameters as ignored_modules",
        r"^ignored_modules expects nn.Module list elements but got types \[<class 'torch.nn.parameter.Parameter'>\]",
        lambda m: {"ignored_modules": [p for c in _ignored_children(m) for p in c.parameters()]},
    ),
    (
        "both ignored_modules and ignored_states",
        r"^Cannot pass both ignored_modules and ignored_states at the same time",
        lambda m: {"ignored_modules": _ignored_children(m), "ignored_states": list(_ignored_children(m)[0].parameters())},
    ),
    (
        "modules and parameters in ignored_states",
        r"^ignored_states expects all nn.Parameter or all nn.Module list elements but got types "
        r"\[<class 'torch.nn.modules.linear.Linear'>, <class 'torch.nn.parameter.Parameter'>\]",
        lambda m: {"ignored_states": [_ignored_children(m)[0], next(_ignored_children(m)[0].parameters())]},
    ),
    ("a param_init_fn that is not callable", r"to be callable", lambda m: {"param_init_fn": 42}),
)


@distributed(world_size=2)
def test_wrapper_argument_errors_match_torchs_messages():
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    for label, pattern, arguments in WRAPPER_ARGUMENT_ERRORS:
        for wrapper, extra in ((TorchFSDP, {"device_id": CPU}), (FSDP, {})):
            with torch.device("meta") if "param_init_fn" in label else contextlib.nullcontext():
                model = _two_layer_block()
            with pytest.raises(ValueError, match=pattern):
                wrapper(model, **arguments(model), **extra)
    # Ignoring the wrapped module itself: torch's FSDP1 warns and ignores every parameter; ours
    # refuses (docs/api.md, the wrapper's differences from torch).
    model = _two_layer_block()
    with pytest.warns(UserWarning, match="Trying to ignore the top-level module passed into the FSDP constructor"):
        TorchFSDP(model, ignored_modules=[model], device_id=CPU)
    with pytest.raises(ValueError, match=r"^FullyShardedDataParallel expects the wrapped module itself not to be ignored"):
        FSDP(model, ignored_modules=[model])


@distributed(world_size=2)
def test_shard_placement_fn_dims_like_torch():
    """Shard(-1) counts from the end: the placements, local shapes and a training step of torch's
    FSDP2 (test_init_1d_transformer_shard_dim_neg1). Shard(1) for a 1-D bias: torch fails its internal
    AssertionError, ours raises ValueError naming the parameter (docs/api.md, test_invalid_shard_dim)."""
    from torch.distributed.fsdp import fully_shard as torch_fully_shard
    from torch.distributed.tensor import Shard

    import fullshard

    runs = []
    for shard in (torch_fully_shard, fullshard.fully_shard):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 8))
        shard(model, shard_placement_fn=lambda param: Shard(-1))
        layout = [(tuple(p.placements), tuple(p.to_local().shape)) for p in model.parameters()]
        optim = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(4, 16, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
        optim.step()
        runs.append((layout, [full_value(p) for p in model.parameters()]))
    assert runs[0][0] == runs[1][0]
    torch.testing.assert_close(runs[1][1], runs[0][1], rtol=0, atol=0)
    with pytest.raises(AssertionError, match="Shard dim 1 is invalid for 1D tensor"):
        torch_fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)), shard_placement_fn=lambda p: Shard(1))
    with pytest.raises(ValueError, match=r"^fully_shard expects shard_placement_fn to return a dim of 0.bias's 1D shape"):
        fullshard.fully_shard(nn.Sequential(nn.Linear(16, 16), nn.Linear(16, 8)), shard_placement_fn=lambda p: Shard(1))


class ListWithForward(nn.ModuleList):
    """A ModuleList subclass with a forward of its own (torch's test_modulelist_subclass_with_forward)."""

    def __init__(self) -> None:
        super().__init__([nn.Linear(8, 8), nn.Linear(8, 8)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self:
            x = layer(x)
        return x


def _hsdp_step(shard, mesh) -> tuple[torch.Tensor, list[torch.Tensor]]:
    torch.manual_seed(42)
    model = ListWithForward()
    for layer in model:
        shard(layer, mesh=mesh)
    shard(model, mesh=mesh)
    loss = model(torch.randn(2, 8, generator=torch.Generator().manual_seed(dist.get_rank()))).sum()
    loss.backward()
    return loss.detach(), [full_value(p.grad) for p in model.parameters()]


@distributed(world_size=4)
def test_hybrid_meshes_built_other_ways_like_torch():
    """A (replicate, shard) mesh built by DeviceMesh.from_group from two groups (torch's
    test_2d_process_group_init), over a ModuleList subclass with a forward: torch's loss and
    gradients. A 2-D mesh without mesh_dim_names: torch refuses it (AssertionError), ours takes its
    dims as (replicate, shard) by position (docs/api.md) and gives the same values."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    named = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    groups = [named.get_group("replicate"), named.get_group("shard")]
    from_groups = DeviceMesh.from_group(groups, "cpu", mesh_dim_names=("replicate", "shard"), mesh=torch.arange(4).view(2, 2))
    expected = _hsdp_step(torch_fully_shard, named)
    torch.testing.assert_close(_hsdp_step(torch_fully_shard, from_groups), expected, rtol=0, atol=0)
    torch.testing.assert_close(_hsdp_step(fullshard.fully_shard, from_groups), expected, rtol=0, atol=0)
    unnamed = init_device_mesh("cpu", (2, 2))
    with pytest.raises(AssertionError, match="Please init the 2D mesh for HSDP with mesh_dim_names specified"):
        torch_fully_shard(nn.Linear(8, 8), mesh=unnamed)
    torch.testing.assert_close(_hsdp_step(fullshard.fully_shard, unnamed), expected, rtol=0, atol=0)


@pytest.mark.parametrize("use_orig_params", [False, True])
@distributed(world_size=2)
def test_optimizer_states_that_are_not_tensors_survive_like_torch(use_orig_params):
    """torch's test_state_dict_with_none_tensor_state: a float and a None added to each parameter's
    optimizer state come back from optim_state_dict and optim_state_dict_to_load unchanged; with
    load_directly=True the optimizer holds them (test_interface_arguments)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    for wrapper, kwargs in ((TorchFSDP, {"device_id": CPU}), (FSDP, {})):
        for optim_class in (torch.optim.Adam, torch.optim.SGD):
            torch.manual_seed(0)
            model = wrapper(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3)), use_orig_params=use_orig_params, **kwargs)
            optim = optim_class(model.parameters(), lr=1e-2)
            model(torch.randn(2, 4)).sum().backward()
            optim.step()
            original = copy.deepcopy(optim.state_dict())
            for state in original["state"].values():
                state["value1"], state["value2"] = 2.74, None
            osd = wrapper.optim_state_dict(model, optim, optim_state_dict=original)
            loadable = wrapper.optim_state_dict_to_load(model, optim, osd)
            where = f"{wrapper.__module__} {optim_class.__name__}"
            assert bool(loadable["state"]) == (optim_class is torch.optim.Adam), where
            for state in loadable["state"].values():
                assert state["value1"] == 2.74 and state["value2"] is None, where
            wrapper.optim_state_dict_to_load(model, optim, osd, load_directly=True)
            for state in optim.state_dict()["state"].values():
                assert state["value1"] == 2.74 and state["value2"] is None, where


def _registration_and_dicts(shard) -> dict[str, Any]:
    """What torch's test_param_registration_after_backward, test_dp_state_dict_save_load,
    test_layer_by_layer_shard_no_false_positive and test_shard_placement_fn_contiguous_params_grads
    look at, for one library."""
    import gc

    from torch.distributed.tensor import DTensor, Shard

    out: dict[str, Any] = {}
    for reshard in (True, False, 2):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 5))
        shard(model[0], reshard_after_forward=reshard)
        shard(model, reshard_after_forward=reshard)
        model(torch.randn(2, 8)).sum().backward()
        out[f"registered after backward, reshard {reshard}"] = [isinstance(p, DTensor) for p in model.parameters()]
        # torch's values are the parameters' own storage; ours are copies (see UPSTREAM.md, test_dp_state_dict_save_load).
        saved = model.state_dict()
        pointers = [p.to_local().data_ptr() for p in model.parameters()]
        new = {k: v.detach().clone().fill_(42.0 + dist.get_rank()) for k, v in saved.items()}
        model.load_state_dict(new)
        out[f"loaded in place, reshard {reshard}"] = (
            [p.to_local().data_ptr() == ptr for p, ptr in zip(model.parameters(), pointers) if p.size(0) % 2 == 0],
            [full_value(p) for p in model.parameters()],
        )
        before = {k: full_value(v) for k, v in model.state_dict().items()}
        model(torch.randn(2, 8))  # the root keeps its parameters unsharded after this forward
        out[f"dict after a forward, reshard {reshard}"] = (before, {k: full_value(v) for k, v in model.state_dict().items()})
    for _ in range(4):  # object ids reused after garbage collection are not taken for shared parameters
        blocks = nn.Sequential(*(nn.Linear(4, 4) for _ in range(3)))
        for block in blocks:
            shard(block)
        shard(blocks)
        del blocks
        gc.collect()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 6), nn.Linear(6, 4))
    shard(model, shard_placement_fn=lambda p: Shard(1) if p.ndim == 2 else None)
    model(torch.randn(2, 8)).sum().backward()
    out["Shard(1) contiguity"] = [
        (p.is_contiguous(), p.to_local().is_contiguous(), p.grad.is_contiguous(), p.grad.to_local().is_contiguous())
        for p in model.parameters()
    ]
    return out


@distributed(world_size=2)
def test_registration_in_place_loads_and_contiguity_like_torch():
    from torch.distributed.fsdp import fully_shard as torch_fully_shard

    import fullshard

    theirs, ours = _registration_and_dicts(torch_fully_shard), _registration_and_dicts(fullshard.fully_shard)
    assert list(ours) == list(theirs)
    for key, value in theirs.items():
        torch.testing.assert_close(ours[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
    assert all(all(flags) for flags in ours["Shard(1) contiguity"])
    for key, value in ours.items():
        if key.startswith("registered"):
            assert all(value), key


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(4, 4)
        self.lin2 = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


def _blocks(wrapper, kwargs, checkpointed: bool) -> nn.Module:
    """Two blocks, each wrapped by hand, around a checkpoint wrapper or not (torch's
    test_state_dict_with_manual_ac_wrapper)."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    torch.manual_seed(0)
    model = nn.Sequential(Block(), Block())
    for index, block in enumerate(model):
        model[index] = wrapper(checkpoint_wrapper(block) if checkpointed else block, **kwargs)
    return wrapper(model, **kwargs)


@distributed(world_size=2)
def test_wrapper_state_dicts_names_and_legacy_warnings_like_torch():
    """Several FSDP1 behaviours, each against torch's FSDP1: a model with FSDP(checkpoint_wrapper(block))
    units saves the keys of the same model without checkpointing and loads its dict (full and sharded);
    named_parameters() inside forward gives clean names and full shapes (use_orig_params=True); a local
    state dict survives torch.save / torch.load into a new wrapper; every legacy optimizer call given
    optim_input warns FutureWarning (full, shard and scatter)."""
    import io

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    from fullshard import StateDictType

    for wrapper, kinds, kwargs in (
        (TorchFSDP, TorchStateDictType, {"device_id": CPU}),
        (FSDP, StateDictType, {}),
    ):
        where = wrapper.__module__
        for kind in ("FULL_STATE_DICT", "SHARDED_STATE_DICT"):
            plain, checkpointed = _blocks(wrapper, kwargs, False), _blocks(wrapper, kwargs, True)
            with torch.no_grad():
                for param in plain.parameters():
                    param.add_(1.0)
            with wrapper.state_dict_type(plain, kinds[kind]), wrapper.state_dict_type(checkpointed, kinds[kind]):
                saved = plain.state_dict()
                assert list(checkpointed.state_dict()) == list(saved), (where, kind)
                checkpointed.load_state_dict(saved, strict=True)
            with wrapper.summon_full_params(plain), wrapper.summon_full_params(checkpointed):
                for ours, theirs in zip(checkpointed.parameters(), plain.parameters()):
                    torch.testing.assert_close(ours, theirs, msg=lambda m: f"{where} {kind}: {m}")

        seen = []

        class Named(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lin = nn.Linear(5, 5)

            def forward(self, x: torch.Tensor) -> torch.Tensor:
                seen.append([(n.replace("_fsdp_wrapped_module.", ""), tuple(p.shape)) for n, p in self.named_parameters()])
                return self.lin(x)

        wrapper(Named(), use_orig_params=True, **kwargs)(torch.randn(2, 5))
        assert seen == [[("lin.weight", (5, 5)), ("lin.bias", (5,))]], (where, seen)

        model = _blocks(wrapper, kwargs, False)
        with wrapper.state_dict_type(model, kinds["LOCAL_STATE_DICT"]):
            buffer = io.BytesIO()
            torch.save(model.state_dict(), buffer)
            buffer.seek(0)
            other = _blocks(wrapper, kwargs, False)
            with torch.no_grad():
                for param in other.parameters():
                    param.zero_()
            with wrapper.state_dict_type(other, kinds["LOCAL_STATE_DICT"]):
                other.load_state_dict(torch.load(buffer, weights_only=False))
        with wrapper.summon_full_params(model), wrapper.summon_full_params(other):
            for ours, theirs in zip(other.parameters(), model.parameters()):
                torch.testing.assert_close(ours, theirs, rtol=0, atol=0, msg=lambda m: f"{where} local: {m}")

        optim = torch.optim.Adam(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optim.step()
        params = list(model.parameters())
        with pytest.warns(FutureWarning, match="optim_input"):
            full = wrapper.full_optim_state_dict(model, optim, optim_input=params, rank0_only=False)
        with pytest.warns(FutureWarning, match="optim_input"):
            wrapper.shard_full_optim_state_dict(full, model, optim_input=params)
        with pytest.warns(FutureWarning, match="optim_input"):
            wrapper.scatter_full_optim_state_dict(full if dist.get_rank() == 0 else None, model, optim_input=params)


@distributed(world_size=2)
def test_optimizer_in_backward_on_flat_parameters_trains_like_one_process():
    """Deliberate difference (docs/api.md): torch's FSDP1 refuses an optimizer applied in backward
    with use_orig_params=False (RuntimeError at forward); ours steps the flat parameter once its
    reduced gradient lands, which for an elementwise optimizer is the step of each parameter."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp.wrap import always_wrap_policy as torch_always_wrap
    from torch.distributed.optim import _apply_optimizer_in_backward

    from fullshard.wrap import always_wrap_policy

    def build() -> nn.Module:
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))

    theirs = TorchFSDP(build(), auto_wrap_policy=torch_always_wrap, use_orig_params=False, device_id=CPU)
    _apply_optimizer_in_backward(torch.optim.SGD, theirs.parameters(), {"lr": 0.1}, register_hook=False)
    with pytest.raises(RuntimeError, match="only supported with use_orig_params=True"):
        theirs(torch.randn(2, 4))
    reference = build()
    reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    ours = FSDP(build(), auto_wrap_policy=always_wrap_policy, use_orig_params=False)
    _apply_optimizer_in_backward(torch.optim.SGD, ours.parameters(), {"lr": 0.1})
    for step in range(3):
        xs = [torch.randn(2, 4, generator=torch.Generator().manual_seed(10 * step + r)) for r in range(2)]
        ours(xs[dist.get_rank()]).sum().backward()
        assert all(p.grad is None for p in ours.parameters())  # stepped and dropped in backward
        (sum(reference(x).sum() for x in xs) / 2).backward()
        reference_optim.step()
        reference_optim.zero_grad()
    with FSDP.summon_full_params(ours):
        for param, expected in zip(ours.parameters(), reference.parameters()):
            torch.testing.assert_close(param, expected)


@distributed(world_size=2)
def test_units_may_differ_in_settings_torch_requires_equal():
    """torch's test_homogeneous_attributes: FSDP1 refuses, at lazy init, units that differ in
    limit_all_gathers or in FSDP_USE_FULL_PREC_IN_EVAL. Ours accepts both (docs/api.md): the limit has
    no effect here, and each unit follows its own eval precision; the outputs are the plain model's."""
    import os

    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    def build(wrapper, kwargs, how: str) -> nn.Module:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        if how == "limit_all_gathers":
            model[0] = wrapper(model[0], limit_all_gathers=False, **kwargs)
            return wrapper(model, limit_all_gathers=True, **kwargs)
        os.environ["FSDP_USE_FULL_PREC_IN_EVAL"] = "1"
        try:
            model[0] = wrapper(model[0], **kwargs)
        finally:
            del os.environ["FSDP_USE_FULL_PREC_IN_EVAL"]
        return wrapper(model, **kwargs)

    x = torch.randn(2, 4)
    for how, name in (("limit_all_gathers", "limit_all_gathers"), ("full precision in eval", "_use_full_prec_in_eval")):
        with pytest.raises(ValueError, match=f"Expects one homogeneous value for {name}"):
            build(TorchFSDP, {"device_id": CPU}, how)(x)
        torch.manual_seed(0)
        plain = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
        torch.testing.assert_close(build(FSDP, {}, how)(x), plain(x))


class IgnoredBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(5, 5) * 0.1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight


class RankDependentIgnored(nn.Module):
    """layer1 holds rank + 1 ignored blocks, so the units after it see different module
    enumerations on each rank (torch's ModelWithIgnoredModules)."""

    def __init__(self, num_ignored: int) -> None:
        super().__init__()
        self.layer0 = nn.Linear(5, 5)
        self.layer1 = nn.Sequential(nn.Linear(5, 5), *(IgnoredBlock() for _ in range(num_ignored)))
        self.layer2 = nn.Linear(5, 5)
        self.layer3 = nn.Sequential(nn.Linear(5, 5), nn.ReLU(), nn.Linear(5, 5))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layer3(self.layer2(self.layer1(self.layer0(x))))


@pytest.mark.parametrize("ignore_at_root", [False, True])
@distributed(world_size=2)
def test_rank_dependent_ignored_modules_train_like_torch(ignore_at_root):
    """torch's test_diff_ignored_modules_across_ranks: a different number of ignored modules on each
    rank (passed to the root too, or not), 3 Adam steps: torch's losses and parameters."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP

    runs = []
    for wrapper, kwargs in ((TorchFSDP, {"device_id": CPU}), (FSDP, {})):
        torch.manual_seed(0)
        model = RankDependentIgnored(num_ignored=dist.get_rank() + 1)
        ignored = [m for m in model.layer1.modules() if isinstance(m, IgnoredBlock)]
        model.layer1 = wrapper(model.layer1, ignored_modules=ignored, **kwargs)
        model.layer3 = wrapper(model.layer3, **kwargs)
        model = wrapper(model, ignored_modules=ignored if ignore_at_root else None, **kwargs)
        optim = torch.optim.Adam(model.parameters(), lr=1e-2)
        losses = []
        for step in range(3):
            x = torch.randn(2, 5, generator=torch.Generator().manual_seed(10 * step + dist.get_rank()))
            loss = model(x).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses.append(loss.detach())
        runs.append((losses, model.state_dict()))  # both default to full state dicts
    torch.testing.assert_close(runs[1], runs[0])


@distributed(world_size=2)
def test_rank0_saved_state_dict_reaches_every_rank_through_sync_module_states():
    """torch's test_state_dict_rank0_offload_save_load_flow: a trained wrapper's full state dict,
    saved on rank 0 only (offloaded to the CPU), loaded into a plain model on rank 0; every rank then
    wraps its own model with sync_module_states=True and holds rank 0's values. (torch's FSDP1 cannot
    sync CPU modules: the saved values are the reference.)"""
    from fullshard import FullStateDictConfig, StateDictType

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(4, 6), nn.ReLU(), FSDP(nn.Linear(6, 3))))
    optim = torch.optim.Adam(model.parameters(), lr=0.1)
    model(torch.randn(2, 4, generator=torch.Generator().manual_seed(dist.get_rank()))).sum().backward()
    optim.step()
    config = FullStateDictConfig(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, config):
        saved = model.state_dict()
    assert (saved == {}) == (dist.get_rank() != 0)
    assert all(v.device.type == "cpu" and type(v) is torch.Tensor for v in saved.values())
    torch.manual_seed(1 + dist.get_rank())  # each rank's fresh model differs
    fresh = nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 3))
    if dist.get_rank() == 0:
        fresh.load_state_dict(saved)
    fresh[2] = FSDP(fresh[2], sync_module_states=True)
    fresh = FSDP(fresh, sync_module_states=True)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        expected = model.state_dict()
    with FSDP.state_dict_type(fresh, StateDictType.FULL_STATE_DICT):
        loaded = fresh.state_dict()
    assert list(loaded) == list(expected)
    for key, value in expected.items():
        torch.testing.assert_close(loaded[key], value, rtol=0, atol=0, msg=lambda m: f"{key}: {m}")
