"""The wrapper's parameter contract under ``use_orig_params=True``, with torch's FSDP1 as the oracle.

FSDP1 keeps the user's ``nn.Parameter`` objects: outside forward each is a
plain 1D view of this rank's part of the unit's shard (the full parameter with
NO_SHARD), inside forward and ``summon_full_params`` a tensor of the full
shape; ``.grad`` matches the parameter. Optimizers built before wrapping,
parameter groups and ``requires_grad_`` keep working. One spawn of 4 ranks runs
every strategy (HYBRID_SHARD on a 2x2 mesh).

Where the layouts differ (documented in docs/api.md): FSDP1 cuts the unit's
concatenated parameters into equal parts, we cut each parameter by rows, so
how many elements of a parameter a rank holds differs; only the total over
the shard group and the 1D form are compared.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel as DDP

from fullshard import FSDP, ShardingStrategy
from fullshard.testing import distributed, mean_over
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
STRATEGIES = [
    ShardingStrategy.FULL_SHARD,
    ShardingStrategy.SHARD_GRAD_OP,
    ShardingStrategy.NO_SHARD,
    ShardingStrategy.HYBRID_SHARD,
]


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin1 = nn.Linear(16, 24)  # 24x16: the shape of issue 13's item 3
        self.lin2 = nn.Linear(24, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin2(torch.relu(self.lin1(x)))


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.block = Block()
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def make_net() -> Net:
    torch.manual_seed(0)
    return Net()


def batch(step: int) -> torch.Tensor:
    return torch.randn(6, 8, generator=torch.Generator().manual_seed(100 * step + dist.get_rank()))


def hybrid_mesh_2x2():
    return init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))


def ours(model: nn.Module, strategy: ShardingStrategy, mesh, use_orig_params: bool = True) -> nn.Module:
    extra = dict(device_mesh=mesh) if strategy is ShardingStrategy.HYBRID_SHARD else {}
    return FSDP(model, sharding_strategy=strategy, auto_wrap_policy=ModuleWrapPolicy({Block}),
                use_orig_params=use_orig_params, device_id=CPU, **extra)


def theirs(model: nn.Module, strategy: ShardingStrategy, mesh, use_orig_params: bool = True) -> nn.Module:
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy as TorchPolicy

    extra = dict(device_mesh=mesh) if strategy is ShardingStrategy.HYBRID_SHARD else {}
    return TorchFSDP(model, sharding_strategy=TorchStrategy[strategy.name], auto_wrap_policy=TorchPolicy({Block}),
                     use_orig_params=use_orig_params, device_id=CPU, **extra)


def described(tensor: torch.Tensor | None) -> tuple | None:
    """What the contract fixes about a tensor: DTensor or not, its dims and dtype."""
    if tensor is None:
        return None
    return isinstance(tensor, DTensor), tensor.dim(), tensor.dtype


def shard_group_total(numel: int, wrapper: nn.Module) -> int:
    total = torch.tensor(numel)
    dist.all_reduce(total, group=wrapper.process_group)
    return int(total)


def observe(wrap, strategy: ShardingStrategy, mesh) -> dict:
    """Everything a user can see about the parameters of one wrapped ``Net``, through one step."""
    model = make_net()
    originals = list(model.parameters())
    full_shapes = [tuple(p.shape) for p in originals]
    optim = torch.optim.SGD(model.parameters(), lr=0.1)  # built before wrapping
    seen: dict = {"inside forward": []}

    def inside_forward(module, args):
        seen["inside forward"].append([(isinstance(p, DTensor), tuple(p.shape)) for p in module.parameters()])
        seen["training_state"] = wrapper.module.block.training_state.name

    model.block.lin1.register_forward_pre_hook(inside_forward)
    wrapper = wrap(model, strategy, mesh)
    params = list(wrapper.parameters())
    seen["identity after wrapping"] = len(params) == len(originals) and all(p is o for p, o in zip(params, originals))
    seen["outside forward"] = [(type(p) is nn.Parameter, *described(p)) for p in params]
    # The shape with NO_SHARD; else the elements the shard group holds together.
    seen["size outside forward"] = [
        tuple(p.shape) if strategy is ShardingStrategy.NO_SHARD else shard_group_total(p.numel(), wrapper)
        for p in params
    ]
    seen["full size"] = [
        shape if strategy is ShardingStrategy.NO_SHARD else torch.Size(shape).numel() for shape in full_shapes
    ]
    wrapper(batch(0)).sum().backward()
    seen["grad like param"] = [p.grad is None or (described(p.grad) == described(p) and p.grad.shape == p.shape)
                               for p in params]
    optim.step()
    seen["identity after a step"] = all(p is o for p, o in zip(wrapper.parameters(), originals))
    with FSDP.summon_full_params(wrapper, with_grads=True) if wrap is ours else type(wrapper).summon_full_params(
        wrapper, with_grads=True
    ):
        summoned = list(wrapper.parameters())
        seen["training_state while summoned"] = wrapper.training_state.name
        seen["summoned"] = [(type(p).__name__, tuple(p.shape), p is o) for p, o in zip(summoned, originals)]
        seen["summoned grads"] = [tuple(p.grad.shape) if p.grad is not None else None for p in summoned]
        values = [p.detach().clone() for p in summoned]
        grads = [p.grad.clone() if p.grad is not None else None for p in summoned]
    seen["attributes"] = {
        "cpu_offload": wrapper.cpu_offload.offload_params,
        "sharding_strategy": wrapper.sharding_strategy.name,
        "mixed_precision": (wrapper.mixed_precision.param_dtype, wrapper.mixed_precision.reduce_dtype,
                            wrapper.mixed_precision.buffer_dtype, wrapper.mixed_precision.keep_low_precision_grads),
        "backward_prefetch": wrapper.backward_prefetch.name,
        "forward_prefetch": wrapper.forward_prefetch,
        "limit_all_gathers": wrapper.limit_all_gathers,
        "_use_orig_params": wrapper._use_orig_params,
        "training_state": wrapper.training_state.name,
        "process_group": (wrapper.process_group.size(), wrapper.process_group.rank()),
        "world_size": (type(wrapper.world_size), wrapper.world_size),
        "rank": (type(wrapper.rank), wrapper.rank),
    }
    return {"seen": seen, "values": values, "grads": grads}


@distributed(world_size=4)
def test_parameters_types_shapes_identity_and_attributes_as_fsdp1():
    mesh = hybrid_mesh_2x2()
    for strategy in STRATEGIES:
        mine, oracle = observe(ours, strategy, mesh), observe(theirs, strategy, mesh)
        for key, value in oracle["seen"].items():
            assert mine["seen"][key] == value, f"{strategy.name}, {key}: ours {mine['seen'][key]} torch {value}"
        assert mine["seen"]["size outside forward"] == mine["seen"]["full size"]
        assert mine["seen"]["identity after a step"] and mine["seen"]["summoned grads"][2] == (24, 16)
        torch.testing.assert_close(mine["values"], oracle["values"])
        torch.testing.assert_close(mine["grads"], oracle["grads"])


def optimizers(model: Net) -> list[torch.optim.Optimizer]:
    """Two optimizers over one model, one of them with per-group hyperparameters."""
    adamw = torch.optim.AdamW([
        {"params": [model.inp.weight, model.out.weight], "lr": 1e-2, "weight_decay": 0.1},
        {"params": [model.inp.bias, model.out.bias], "lr": 3e-2, "weight_decay": 0.0},
    ])
    sgd = torch.optim.SGD([p for p in model.block.parameters() if p.requires_grad], lr=0.05, momentum=0.9)
    return [adamw, sgd]


@distributed(world_size=4)
def test_optimizers_built_before_wrapping_train_like_ddp():
    """Per-group lr and weight decay, two optimizers, a frozen bias next to
    trainable weights in one unit: equal to DDP after 3 steps."""
    mesh = hybrid_mesh_2x2()
    for strategy in STRATEGIES:
        model = make_net()
        model.block.lin1.bias.requires_grad_(False)
        frozen = model.block.lin1.bias.detach().clone()
        reference = DDP(copy.deepcopy(model))
        optims, ref_optims = optimizers(model), optimizers(reference.module)
        wrapper = ours(model, strategy, mesh)
        for step in range(3):
            losses = []
            for m, opts in ((wrapper, optims), (reference, ref_optims)):
                loss = m(batch(step)).square().mean()
                loss.backward()
                for optim in opts:
                    optim.step()
                    optim.zero_grad()
                losses.append(mean_over(loss))
            torch.testing.assert_close(losses[0], losses[1], msg=lambda m: f"{strategy.name} step {step}: {m}")
        with FSDP.summon_full_params(wrapper):
            for (name, param), ref_param in zip(wrapper.named_parameters(), reference.module.parameters()):
                torch.testing.assert_close(param, ref_param, rtol=1e-5, atol=1e-6, msg=lambda m: f"{strategy.name} {name}: {m}")
            torch.testing.assert_close(model.block.lin1.bias, frozen, rtol=0, atol=0)


def unfreeze_after_no_grad_forward(wrap) -> list[torch.Tensor]:
    model = make_net()
    model.block.lin1.weight.requires_grad_(False)
    wrapper = wrap(model, ShardingStrategy.SHARD_GRAD_OP, None)
    optim = torch.optim.SGD(wrapper.parameters(), lr=0.5)
    with torch.no_grad():
        wrapper(batch(0))
    weight = next(p for name, p in wrapper.named_parameters() if name.endswith("block._fsdp_wrapped_module.lin1.weight"))
    weight.requires_grad_(True)
    for step in range(2):
        wrapper(batch(step)).sum().backward()
        assert weight.grad is not None or weight.numel() == 0, "requires_grad_(True) was lost"
        optim.step()
        optim.zero_grad()
    with FSDP.summon_full_params(wrapper) if wrap is ours else type(wrapper).summon_full_params(wrapper):
        return [p.detach().clone() for p in wrapper.parameters()]


def edit_inside_summon(wrap, use_orig_params: bool) -> list[torch.Tensor]:
    """Issue 13, item 4: in-place edits inside summon_full_params are written back,
    also through references taken before wrapping (use_orig_params=True)."""
    model = make_net()
    before = (model.block.lin1.weight, model.out.weight, model.inp.weight)
    wrapper = wrap(model, ShardingStrategy.FULL_SHARD, None, use_orig_params)
    summon = FSDP.summon_full_params if wrap is ours else type(wrapper).summon_full_params
    with summon(wrapper), torch.no_grad():
        lin1, out, inp = before if use_orig_params else (model.block.lin1.weight, model.out.weight, model.inp.weight)
        lin1.mul_(3.0)
        out.fill_(0.25)
        inp[1].zero_()
    wrapper(batch(0)).sum().backward()  # and the edited shards are what trains
    torch.optim.SGD(wrapper.parameters(), lr=0.1).step()
    with summon(wrapper):
        return [p.detach().clone() for name, p in wrapper.named_parameters() if "flat_param" not in name]


@distributed(world_size=4)
def test_requires_grad_and_summon_writeback_as_fsdp1():
    torch.testing.assert_close(unfreeze_after_no_grad_forward(ours), unfreeze_after_no_grad_forward(theirs))
    for use_orig_params in (True, False):
        edited = edit_inside_summon(ours, use_orig_params)
        torch.testing.assert_close(edited, edit_inside_summon(theirs, use_orig_params))
        assert (edited[0][1] != 0).any()  # trained after the edit, so it can fail


@distributed(world_size=2)
def test_flat_param_data_assignment_is_kept_like_a_plain_module():
    """``flat_param.data = t`` (use_orig_params=False): ``t`` becomes the shard for every later step, as an
    assigned ``.data`` stays in a plain module (FSDP1 uses ``t`` for one forward, then steps its old shard:
    docs/api.md); a ``t`` of another shape raises at the next forward."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        wrapper = ours(make_net(), strategy, None, use_orig_params=False)
        reference = make_net()
        optim = torch.optim.SGD(wrapper.parameters(), lr=0.1)
        reference_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
        flat = dict(wrapper.named_parameters())["_fsdp_wrapped_module._flat_param"]  # the root's: inp and out
        with torch.no_grad():
            flat.data = flat.data * 0.5
            for param in (*reference.inp.parameters(), *reference.out.parameters()):
                param.mul_(0.5)
        for step in range(2):
            loss = wrapper(batch(step)).sum()
            loss.backward()
            optim.step()
            optim.zero_grad()
            reference_loss = reference(batch(step)).sum()
            reference_loss.backward()
            for param in reference.parameters():
                param.grad = mean_over(param.grad)
            reference_optim.step()
            reference_optim.zero_grad()
            torch.testing.assert_close(loss, reference_loss, msg=f"{strategy.name} step {step}")
        with FSDP.summon_full_params(wrapper):
            for (name, param), expected in zip(wrapper.named_parameters(), reference.parameters()):
                torch.testing.assert_close(param, expected, msg=f"{strategy.name} {name}")
        flat.data = torch.zeros(flat.numel() + 1)
        with pytest.raises(RuntimeError, match="flat parameter was given a tensor of shape"):
            wrapper(batch(0))


@distributed(world_size=2)
def test_data_assigned_to_gathered_parameters_between_forward_and_backward_raises():
    """Between forward and backward the root keeps its original parameters gathered (use_orig_params=True):
    an assigned ``.data`` there cannot carry its values to the shards, so the backward raises naming the
    parameter (FSDP1 raises too) instead of dropping them (FSDP2, and fully_shard with it, drop them)."""
    for strategy in (ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.NO_SHARD):
        wrapper = ours(make_net(), strategy, None)
        loss = wrapper(batch(0)).sum()
        with torch.no_grad():
            for param in wrapper.parameters():
                param.data = param.data * 0.5
        # FSDP1's types: AssertionError naming the strategy where it keeps parameters gathered, else RuntimeError.
        error = AssertionError if strategy is ShardingStrategy.SHARD_GRAD_OP else RuntimeError
        with pytest.raises(error, match=rf"\({strategy}\).*\.weight.*was assigned a new tensor while they were unsharded"):
            loss.backward()
