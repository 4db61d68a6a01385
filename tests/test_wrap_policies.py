"""Auto-wrap policies: which submodules become units, for both front ends; and
manual wrapping with ``enable_wrap`` / ``wrap``."""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fullshard import FSDP, ShardingStrategy, fully_shard
from fullshard._core.step.state import get_state
from fullshard.testing import DataParallelReference, assert_params_equal, distributed, mean_over
from fullshard.testing.models import CompositeParamModel, UnitModule
from fullshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    always_wrap_policy,
    enable_wrap,
    lambda_auto_wrap_policy,
    select_modules,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
    wrap,
)

CPU = torch.device("cpu")


def names(root: nn.Module, selected) -> list[str]:
    by_module = {m: n for n, m in root.named_modules()}
    return [by_module[module] for module, _ in selected]


def test_module_wrap_policy_selects_classes_children_first():
    model = nn.Sequential(UnitModule(), nn.Sequential(UnitModule(), nn.Linear(16, 16)))
    assert names(model, select_modules(model, ModuleWrapPolicy({UnitModule}))) == ["0", "1.0"]
    selected = select_modules(model, ModuleWrapPolicy({UnitModule, nn.Sequential}))
    # post-order: a Sequential inside a unit comes before the unit, the outer Sequential last
    assert names(model, selected) == ["0.seq", "0", "1.0.seq", "1.0", "1"]


def test_function_policies():
    model = CompositeParamModel(dim=16)
    transformer = functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={UnitModule})
    assert names(model, select_modules(model, transformer)) == ["u1", "u2"]
    by_name = functools.partial(lambda_auto_wrap_policy, lambda_fn=lambda m: isinstance(m, nn.Linear) and m.in_features == 16)
    assert len(select_modules(model, by_name)) == 7  # l and 3 linears per unit
    # Each unit holds 3 * (16 * 16 + 16) = 816 parameters; everything holds 3424.
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=800)
    assert names(model, select_modules(model, size)) == ["u1", "u2"]
    assert select_modules(model, functools.partial(size_based_auto_wrap_policy, min_num_params=10_000)) == []
    assert ModuleWrapPolicy({UnitModule})(model.u1, recurse=False, nonwrapped_numel=0)


def test_custom_policy_overrides_and_ignored_modules():
    model = CompositeParamModel(dim=16)
    policy = CustomPolicy(lambda m: {"reshard_after_forward": False} if m is model.u2 else isinstance(m, UnitModule))
    selected = select_modules(model, policy, ignored_modules=set(model.u1.modules()))
    assert names(model, selected) == ["u2"] and selected[0][1] == {"reshard_after_forward": False}
    with pytest.raises(ValueError, match="CustomPolicy expects its function to return a bool or a dict"):
        select_modules(model, CustomPolicy(lambda m: 1))


@distributed(world_size=2)
def test_fully_shard_with_policy():
    model = CompositeParamModel(dim=16)
    policy = CustomPolicy(lambda m: {"reshard_after_forward": False} if m is model.u2 else isinstance(m, UnitModule))
    fully_shard(model, policy=policy)
    assert get_state(model.u1).group.settings.reshard_after_forward is True
    assert get_state(model.u2).group.settings.reshard_after_forward is False
    assert {p.fqn for p in get_state(model).group.spec.params} == {"l.weight", "l.bias", "p"}
    model(torch.randn(4, 16)).sum().backward()
    assert all(p.grad is not None for p in model.parameters())


@distributed(world_size=2)
def test_wrapper_with_size_policy_and_strategy_override():
    model = CompositeParamModel(dim=16)
    policy = CustomPolicy(
        lambda m: {"sharding_strategy": ShardingStrategy.NO_SHARD} if m is model.u2 else isinstance(m, UnitModule)
    )
    wrapper = FSDP(model, auto_wrap_policy=policy, device_id=CPU)
    assert isinstance(model.u1, FSDP) and isinstance(model.u2, FSDP)
    assert model.u1.sharding_strategy is ShardingStrategy.FULL_SHARD
    assert model.u2.sharding_strategy is ShardingStrategy.NO_SHARD
    wrapper(torch.randn(4, 16)).sum().backward()
    size = functools.partial(size_based_auto_wrap_policy, min_num_params=800)
    model = CompositeParamModel(dim=16)
    FSDP(model, auto_wrap_policy=size, device_id=CPU)
    assert isinstance(model.u1, FSDP) and isinstance(model.u2, FSDP) and not isinstance(model.l, FSDP)


def test_always_wrap_policy_selects_every_submodule_like_torch():
    from torch.distributed.fsdp.wrap import always_wrap_policy as torch_always_wrap_policy

    model = CompositeParamModel(dim=16)
    selected = names(model, select_modules(model, always_wrap_policy))
    # Every submodule but the root (parameterless ReLUs too, as torch wraps them), children first.
    assert sorted(selected) == sorted(name for name, _ in model.named_modules() if name)
    assert selected.index("u1.seq.1") < selected.index("u1.seq") < selected.index("u1")
    assert names(model, select_modules(model, torch_always_wrap_policy)) == selected
    calls = []

    def recording(**kwargs):
        calls.append(kwargs)
        return always_wrap_policy(**kwargs)

    select_modules(model, recording)
    assert calls and all(always_wrap_policy(**c) is torch_always_wrap_policy(**c) is True for c in calls)


# -- manual wrapping: enable_wrap / wrap -------------------------------------------------------
class Recorded(nn.Module):
    """A stand-in wrapper class that remembers its arguments."""

    def __init__(self, module: nn.Module, **kwargs) -> None:
        super().__init__()
        self.module, self.kwargs = module, kwargs


def test_wrap_outside_enable_wrap_returns_the_module():
    layer = nn.Linear(2, 2)
    assert wrap(layer) is layer
    assert wrap(layer, sharding_strategy=ShardingStrategy.NO_SHARD) is layer


def test_enable_wrap_merges_arguments_like_torch():
    from torch.distributed.fsdp.wrap import enable_wrap as torch_enable_wrap
    from torch.distributed.fsdp.wrap import wrap as torch_wrap

    results = []
    for enable, wrap_fn in ((enable_wrap, wrap), (torch_enable_wrap, torch_wrap)):
        with enable(wrapper_cls=Recorded, a=1, b=2):
            plain, overridden = wrap_fn(nn.Linear(2, 2)), wrap_fn(nn.Linear(2, 2), b=3, c=4)
        assert isinstance(plain, Recorded) and isinstance(plain.module, nn.Linear)
        results.append((plain.kwargs, overridden.kwargs))
        layer = nn.Linear(2, 2)
        assert wrap_fn(layer) is layer  # the block is over
    assert results[0] == results[1] == ({"a": 1, "b": 2}, {"a": 1, "b": 3, "c": 4})


@pytest.mark.parametrize(
    "kwargs, match",
    [
        pytest.param({"a": 1}, "wrapper_cls", id="no_wrapper_cls"),
        pytest.param({"wrapper_cls": None}, "enable_wrap expects wrapper_cls to be the wrapper class", id="wrapper_cls_none"),
    ],
)
def test_enable_wrap_bad_arguments(kwargs, match):
    with pytest.raises(TypeError, match=match):
        with enable_wrap(**kwargs):
            pass


def test_enable_wrap_cannot_be_nested():
    with enable_wrap(wrapper_cls=Recorded, a=1):
        with pytest.raises(ValueError, match=r"enable_wrap cannot be nested.*wrapper_cls=Recorded"):
            with enable_wrap(wrapper_cls=Recorded, a=2):
                pass
        assert wrap(nn.Linear(2, 2)).kwargs == {"a": 1}  # the outer block is still in force
    layer = nn.Linear(2, 2)
    assert wrap(layer) is layer


def test_enable_wrap_restores_state_after_an_error():
    layer = nn.Linear(2, 2)
    with pytest.raises(RuntimeError, match="boom"):
        with enable_wrap(wrapper_cls=Recorded):
            raise RuntimeError("boom")
    assert wrap(layer) is layer
    with enable_wrap(wrapper_cls=Recorded):  # not mistaken for a nested block
        assert isinstance(wrap(layer), Recorded)


def manually_wrapped_model() -> nn.Sequential:
    """FSDP1-style model code: marks its units with ``wrap``, one with its own strategy."""
    torch.manual_seed(0)
    return nn.Sequential(
        wrap(nn.Sequential(nn.Linear(8, 16), nn.ReLU())),
        wrap(nn.Sequential(nn.Linear(16, 16), nn.ReLU()), sharding_strategy=ShardingStrategy.SHARD_GRAD_OP),
        wrap(nn.Sequential(nn.Linear(16, 16), nn.ReLU())),
        nn.Linear(16, 1),
    )


def batch_for(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, 8, generator=generator), torch.randn(4, 1, generator=generator)


def mse(model: nn.Module, batch) -> torch.Tensor:
    inputs, targets = batch
    return F.mse_loss(model(inputs), targets)


@distributed(world_size=2)
def test_enable_wrap_trains_like_one_process():
    ref = manually_wrapped_model()  # outside the block: a plain model
    assert not any(isinstance(m, FSDP) for m in ref.modules())
    with enable_wrap(wrapper_cls=FSDP, device_id=CPU, sharding_strategy=ShardingStrategy.FULL_SHARD):
        model = FSDP(manually_wrapped_model(), device_id=CPU)
    units = [model.module[i] for i in range(3)]
    assert all(isinstance(u, FSDP) for u in units) and not isinstance(model.module[3], FSDP)
    assert [u.sharding_strategy for u in units] == [
        ShardingStrategy.FULL_SHARD, ShardingStrategy.SHARD_GRAD_OP, ShardingStrategy.FULL_SHARD
    ]
    # The override reaches the engine: SHARD_GRAD_OP keeps its parameters after forward.
    assert [get_state(u).group.settings.reshard_after_forward for u in units] == [True, False, True]
    assert len(FSDP.fsdp_modules(model)) == 4
    with FSDP.summon_full_params(model):
        assert_params_equal(model, ref, match_names=False)  # wrapping left the initialization alone

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = DataParallelReference(ref, mse)
    optims = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, ref)]
    for step in range(3):
        loss = mse(model, batch_for(rank, step))
        loss.backward()
        ref_loss = reference.backward([batch_for(r, step) for r in range(world)])
        for optim in optims:
            optim.step()
            optim.zero_grad()
        torch.testing.assert_close(mean_over(loss), ref_loss)
    with FSDP.summon_full_params(model):
        assert_params_equal(model, ref, match_names=False)
