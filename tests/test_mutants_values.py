"""Values the engine computes, against a one-process reference: cases the mutation run over the value
paths (tools/mutants.py, issue 38) found that no test checked. Each rank trains with SGD on its own
batch and the reference on every rank's batch (``DataParallelReference``), so a gradient off by any
factor, or one rank's gradient alone, moves the parameters away from the reference's."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed._shard.sharded_tensor import ShardedTensor
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import Shard

from fullshard import (
    FSDP,
    FSDPModule,
    MixedPrecisionPolicy,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictType,
    fully_shard,
)
from fullshard.testing import DataParallelReference, case, distributed, full_value
from fullshard.wrap import ModuleWrapPolicy

STEPS = 2
LR = 0.5  # large: a gradient off by a few percent moves a parameter by far more than the tolerance


ODD = (6, 5, 7, 3)  # no weight's rows split evenly over 2 or 4 ranks: every unit pads
EVEN = (6, 4, 8, 2)  # every weight splits evenly on both dims: the one-kernel copy-in path where it can


def build(widths: tuple[int, ...] = ODD) -> nn.Module:
    torch.manual_seed(0)
    first, hidden, wide, last = widths
    return nn.Sequential(nn.Linear(first, hidden), nn.Tanh(), nn.Linear(hidden, wide), nn.Tanh(), nn.Linear(wide, last))


def shard_units(model: nn.Module, **kwargs) -> nn.Module:
    for layer in (model[0], model[2], model[4]):
        fully_shard(layer, **kwargs)
    return fully_shard(model, **kwargs)


def every_unit(model: nn.Module, setter: Callable[[FSDPModule], None]) -> None:
    for module in model.modules():
        if isinstance(module, FSDPModule):
            setter(module)


def loss_of(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return model(batch[0]).pow(2).mean()


def bf16_loss_of(model: nn.Module, batch: Sequence[torch.Tensor]) -> torch.Tensor:
    return model(batch[0].bfloat16()).float().pow(2).mean()


def rank_batches(step: int, world: int) -> list[tuple[torch.Tensor]]:
    return [(torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + r + 1)),) for r in range(world)]


class MixedDtypes(nn.Module):
    """One unit holding fp32 and fp64 parameters: its shards are packed as bytes, the fp64 one
    aligned after an fp32 region of odd length (a gap the copy-out must skip)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(6, 5)
        self.scale = nn.Parameter(torch.rand(3, dtype=torch.float64) + 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x) * self.scale.float().mean()


class PartlyUsed(nn.Module):
    """A unit with a parameter its forward never uses: its gradient stays None, as without FSDP."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.used, self.unused = nn.Linear(6, 3), nn.Linear(6, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


def assert_trains_like_reference(
    model: nn.Module,
    ref: nn.Module,
    grad_scale: float = 1.0,
    rtol: float = 1e-5,
    atol: float = 1e-6,
    flat: bool = False,
) -> None:
    """SGD steps of ``model`` (this rank's batch) and of ``ref``, the same model in one process (every
    rank's batch), whose averaged gradient is multiplied by ``grad_scale`` (the reduction's factor
    against an average); full parameters (and which have a gradient) compared after every step.
    ``flat``: the FSDP1 wrapper's flat parameter, compared through its full state dict."""
    world, rank = dist.get_world_size(), dist.get_rank()
    reference = DataParallelReference(ref, loss_of)
    optim, ref_optim = torch.optim.SGD(model.parameters(), lr=LR), torch.optim.SGD(ref.parameters(), lr=LR)
    for step in range(STEPS):
        every = rank_batches(step, world)
        loss_of(model, every[rank]).backward()
        reference.backward(every)
        if not flat:
            for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
                assert (param.grad is None) == (ref_param.grad is None), f"step {step} {name}: {param.grad}"
        optim.step()
        optim.zero_grad()
        for param in ref.parameters():
            if param.grad is not None:
                param.grad.mul_(grad_scale)
        ref_optim.step()
        ref_optim.zero_grad()
        values = model.state_dict() if flat else {name: full_value(p) for name, p in model.named_parameters()}
        for name, ref_param in ref.named_parameters():
            torch.testing.assert_close(
                values[name], ref_param.detach(), rtol=rtol, atol=atol, msg=f"step {step} {name}"
            )


@distributed(world_size=2)
def test_reductions_train_like_one_process():
    """Reduction paths the parity tests leave out: a dim-1 shard (chunked per rank on dim 1), a
    float16 reduction with a divide factor (divided before and after the sum), SUM-only reductions
    (divided after the collective, once), and a replicate dimension's all-reduce (a shard group of
    one, whose unsharded parameter is the shard itself)."""
    world = dist.get_world_size()
    fp16_reduce = MixedPrecisionPolicy(reduce_dtype=torch.float16)
    for widths in (ODD, EVEN):
        with case(f"weights sharded on dim 1, widths {widths}"):
            model = shard_units(build(widths), shard_placement_fn=lambda p: Shard(p.ndim - 1))
            assert_trains_like_reference(model, build(widths))
    with case("float16 reduction, divide factor 8"):
        model = shard_units(build(), mp_policy=fp16_reduce)
        every_unit(model, lambda unit: unit.set_gradient_divide_factor(8.0))
        assert_trains_like_reference(model, build(), grad_scale=world / 8.0, rtol=1e-2, atol=1e-3)
    with case("SUM only"):
        model = shard_units(build())
        every_unit(model, lambda unit: unit.set_force_sum_reduction_for_comms(True))
        assert_trains_like_reference(model, build())
    with case("replicate only, SUM only"):
        mesh = init_device_mesh("cpu", (world, 1), mesh_dim_names=("replicate", "shard"))
        model = shard_units(build(), mesh=mesh)
        every_unit(model, lambda unit: unit.set_force_sum_reduction_for_comms(True))
        assert_trains_like_reference(model, build())
        # A shard group of one gathers nothing: the unsharded parameter is the shard itself.
        shard = model[0].weight.to_local()
        model[0].unshard()
        assert model[0].weight.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr()
        model[0].reshard()


@distributed(world_size=2)
def test_units_of_two_dtypes_or_an_unused_parameter_train_like_one_process():
    """fp32 and fp64 parameters in one unit (a byte layout with an alignment gap); a parameter
    the forward never uses (no gradient, not a zero one)."""
    with case("two dtypes"):
        assert_trains_like_reference(fully_shard(MixedDtypes()), MixedDtypes(), atol=1e-5)
    with case("an unused parameter"):
        assert_trains_like_reference(fully_shard(PartlyUsed()), PartlyUsed())
    with case("an unused parameter, the wrapper's flat parameter"):
        assert_trains_like_reference(FSDP(PartlyUsed(), use_orig_params=False), PartlyUsed(), flat=True)


@distributed(world_size=4)
def test_post_forward_shard_of_two_ranks_trains_like_one_process():
    """``reshard_after_forward=2`` over 4 ranks: backward re-gathers from the kept half."""
    assert_trains_like_reference(shard_units(build(), reshard_after_forward=2), build())


@distributed(world_size=2)
def test_bf16_gradient_accumulation_sums_in_the_reduce_dtype():
    """Two micro-batches, the first without gradient sync: bf16 gradients are summed in fp32 (the
    reduce dtype), as the one-process reference sums them; a sum kept in bf16 is off by its rounding."""
    world, rank = dist.get_world_size(), dist.get_rank()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model, ref = shard_units(build(), mp_policy=policy), build()
    every = rank_batches(0, world)
    for index, micro in enumerate(every[rank][0].chunk(2)):
        model.set_requires_gradient_sync(index == 1)
        (bf16_loss_of(model, (micro,)) / 2).backward()
    DataParallelReference(ref, bf16_loss_of, param_dtype=torch.bfloat16).backward(every, num_microbatches=2)
    for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(full_value(param.grad), ref_param.grad, rtol=1e-4, atol=1e-6, msg=name)


@distributed(world_size=2)
def test_summon_full_params_hands_out_full_values_and_grads_and_writes_back():
    """The wrapper's summon_full_params: full parameters and (``with_grads``) the averaged
    gradients of the one-process reference; a change made inside is in the shards afterwards."""
    world, rank = dist.get_world_size(), dist.get_rank()
    model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    ref = build()
    every = rank_batches(0, world)
    loss_of(model, every[rank]).backward()
    DataParallelReference(ref, loss_of).backward(every)
    with FSDP.summon_full_params(model, with_grads=True):
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.detach(), ref_param.detach(), msg=name)
            torch.testing.assert_close(param.grad, ref_param.grad, msg=name)
    with FSDP.summon_full_params(model, writeback=True), torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    with FSDP.summon_full_params(model):
        for (name, param), ref_param in zip(model.named_parameters(), ref.parameters()):
            torch.testing.assert_close(param.detach(), ref_param.detach() + 1.0, msg=name)


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.local_tensor() if hasattr(value, "local_tensor") else value.to_local()


@distributed(world_size=2)
def test_sharded_state_dict_offloaded_to_the_cpu_is_a_snapshot():
    """With ``offload_to_cpu`` on a CPU model the saved shards are copies, as without it: a later
    change of the parameters does not reach a state dict taken before. The values are FSDP1's
    ShardedTensors, as torch's wrapper saves them."""
    model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=True)
    config = ShardedStateDictConfig(offload_to_cpu=True)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT, config):
        saved = model.state_dict()
    assert all(isinstance(value, ShardedTensor) for value in saved.values()), saved
    kept = {key: _local(value).clone() for key, value in saved.items()}
    with torch.no_grad():
        for param in model.parameters():
            param.add_(1.0)
    for key, value in saved.items():
        torch.testing.assert_close(_local(value), kept[key], msg=key)


@distributed(world_size=2)
def test_a_key_missing_from_a_loaded_state_dict_is_reported_once():
    """``load_state_dict(strict=False)`` names a missing key once, as nn.Module does, whether the
    wrapper registers the original parameters or only its flat one."""
    for use_orig_params in (True, False):
        with case(f"use_orig_params={use_orig_params}"):
            model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params)
            state = model.state_dict()
            del state["2.weight"]
            assert model.load_state_dict(state, strict=False).missing_keys == ["2.weight"]


def _forms_and_locals(osd: dict) -> dict[str, dict[str, tuple[str, torch.Tensor | object]]]:
    """Each state's type and local value (a ShardedTensor's local shard)."""
    out = {}
    for fqn, states in osd["state"].items():
        out[fqn] = {}
        for key, value in states.items():
            if isinstance(value, ShardedTensor):
                local = value.local_shards()[0].tensor if value.local_shards() else torch.empty(0)
            else:
                local = value
            out[fqn][key] = (type(value).__name__, local)
    return out


@distributed(world_size=2)
def test_no_shard_sharded_optim_state_dict_has_torchs_forms_and_values():
    """NO_SHARD under SHARDED_STATE_DICT, torch's FSDP1 as the oracle: a ShardedTensor per state with
    a flat parameter, the whole tensor with ``use_orig_params=True``; the same Adam states."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    from torch.distributed.fsdp import StateDictType as TorchStateDictType

    world, rank = dist.get_world_size(), dist.get_rank()
    libs = (
        (TorchFSDP, TorchStrategy.NO_SHARD, TorchStateDictType.SHARDED_STATE_DICT),
        (FSDP, ShardingStrategy.NO_SHARD, StateDictType.SHARDED_STATE_DICT),
    )
    for use_orig_params in (True, False):
        with case(f"use_orig_params={use_orig_params}"):
            found = []
            for wrapper, strategy, kind in libs:
                model = wrapper(
                    build(), sharding_strategy=strategy, use_orig_params=use_orig_params, device_id=torch.device("cpu")
                )
                optim = torch.optim.Adam(model.parameters(), lr=0.1)
                loss_of(model, rank_batches(0, world)[rank]).backward()
                optim.step()
                with wrapper.state_dict_type(model, kind):
                    found.append(_forms_and_locals(wrapper.optim_state_dict(model, optim)))
            theirs, ours = found
            assert ours.keys() == theirs.keys()
            for fqn, states in theirs.items():
                assert {k: form for k, (form, _) in ours[fqn].items()} == {k: form for k, (form, _) in states.items()}
                for key, (_, value) in states.items():
                    torch.testing.assert_close(ours[fqn][key][1], value, msg=f"{fqn} {key}")


@distributed(world_size=2)
def test_wrapper_optimizer_state_round_trip_resumes_training_exactly():
    """An optimizer state dict of the wrapper (FQN-keyed, or full and sharded again) loaded into a
    fresh model and optimizer (flat and original parameters): the next Adam step equals the
    uninterrupted run's. A group
    passed to sharded_optim_state_dict is ignored with a warning."""
    world, rank = dist.get_world_size(), dist.get_rank()
    loaders = {
        "optim_state_dict_to_load": lambda model, optim, source, source_optim: FSDP.optim_state_dict_to_load(
            model, optim, FSDP.optim_state_dict(source, source_optim)
        ),
        "shard_full_optim_state_dict": lambda model, optim, source, source_optim: FSDP.shard_full_optim_state_dict(
            FSDP.full_optim_state_dict(source, source_optim, rank0_only=False), model
        ),
    }
    for use_orig_params, loader in itertools.product((False, True), loaders):
        with case(f"use_orig_params={use_orig_params}, {loader}"):
            models, optims = [], []
            for _ in range(2):
                model = FSDP(build(), auto_wrap_policy=ModuleWrapPolicy({nn.Linear}), use_orig_params=use_orig_params)
                models.append(model)
                optims.append(torch.optim.Adam(model.parameters(), lr=0.1))
            first, resumed = models
            loss_of(first, rank_batches(0, world)[rank]).backward()
            optims[0].step()
            optims[0].zero_grad()
            resumed.load_state_dict(first.state_dict())
            loadable = loaders[loader](resumed, optims[1], first, optims[0])
            assert not optims[1].state  # converted, not loaded (load_directly=False is the default)
            optims[1].load_state_dict(loadable)
            for model, optim in zip(models, optims):
                loss_of(model, rank_batches(1, world)[rank]).backward()
                optim.step()
            for key, value in first.state_dict().items():
                torch.testing.assert_close(resumed.state_dict()[key], value, msg=key)
            other_group = dist.new_group(list(range(world)))  # the model's own group is not warned of
            with pytest.warns(UserWarning, match=r"FSDP\.sharded_optim_state_dict ignores group"):
                FSDP.sharded_optim_state_dict(first, optims[0], group=other_group)
