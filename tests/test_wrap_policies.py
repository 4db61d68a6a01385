"""Auto-wrap policies: which submodules become units, for both front ends."""

import functools

import pytest
import torch
import torch.nn as nn

from fullshard import FSDP, ShardingStrategy, fully_shard
from fullshard._core.state import get_state
from fullshard.testing import distributed
from fullshard.testing.models import CompositeParamModel, UnitModule
from fullshard.wrap import (
    CustomPolicy,
    ModuleWrapPolicy,
    lambda_auto_wrap_policy,
    select_modules,
    size_based_auto_wrap_policy,
    transformer_auto_wrap_policy,
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
    assert get_state(model.u1).group.reshard_after_forward is True
    assert get_state(model.u2).group.reshard_after_forward is False
    assert {p.fqn for p in get_state(model).group.params} == {"l.weight", "l.bias", "p"}
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
