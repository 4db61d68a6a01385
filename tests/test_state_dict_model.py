"""Model state dicts: counterparts of seed 003 (test_fully_shard_model_checkpoint.py) and
the full / sharded / local forms of both front ends."""

import copy
import itertools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.tensor import DTensor
from torch.nn import TransformerDecoderLayer, TransformerEncoderLayer

from fullshard import (
    FSDP,
    FullStateDictConfig,
    MixedPrecision,
    ShardingStrategy,
    StateDictType,
    full_state_dict,
    fully_shard,
)
from fullshard._core.unit import full_params
from fullshard.state_dict.model import unit_record
from fullshard.testing import distributed, full_value
from fullshard.testing.models import CompositeParamModel, TransformerWithSharedParams, UnitModule
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
LAYERS = ModuleWrapPolicy({TransformerEncoderLayer, TransformerDecoderLayer})


def gathered(state_dict: dict) -> dict:
    """Every value as a full tensor (DTensors gathered)."""
    return {k: full_value(v) for k, v in state_dict.items()}


def check_state_dict_parity(local_sd: dict, sd: dict) -> None:
    assert set(sd) == set(local_sd)
    for key in sd:
        assert sd[key].shape == local_sd[key].shape, f"shape mismatch for {key}"
        torch.testing.assert_close(full_value(sd[key]), local_sd[key], msg=lambda m: f"{key}: {m}")


def check_model_parity(m1: nn.Module, m2: nn.Module) -> None:
    named1, named2 = list(m1.named_parameters()), list(m2.named_parameters())
    assert [n for n, _ in named1] == [n for n, _ in named2]
    for (name, p1), (_, p2) in zip(named1, named2):
        torch.testing.assert_close(full_value(p1), full_value(p2), msg=lambda m: f"{name}: {m}")


@torch.no_grad()
def zero_model(model: nn.Module, zero_buffers: bool = False) -> None:
    for param in model.parameters():
        param.zero_()
    if zero_buffers:
        for buffer in model.buffers():
            buffer.zero_()


def _save_load_round_trip(local_model: nn.Module, shard, sharded_state_dict: bool = True) -> None:
    save_model = shard(copy.deepcopy(local_model))
    if not sharded_state_dict:
        FSDP.set_state_dict_type(save_model, StateDictType.FULL_STATE_DICT)
    local_sd, sd = local_model.state_dict(), save_model.state_dict()
    if sharded_state_dict:
        assert any(isinstance(v, DTensor) for v in sd.values())
    else:
        assert not any(isinstance(v, DTensor) for v in sd.values())
    check_state_dict_parity(local_sd, sd)
    load_model = shard(copy.deepcopy(local_model))
    zero_model(load_model)
    for param in load_model.parameters():
        assert full_value(param).sum() == 0
    if not sharded_state_dict:
        FSDP.set_state_dict_type(load_model, StateDictType.FULL_STATE_DICT)
    load_model.load_state_dict({k: v.clone() for k, v in sd.items()})
    check_model_parity(load_model, save_model)


@pytest.mark.parametrize("sharded", [True, False])
@distributed(world_size=2)
def test_state_dict_save_load_root_fully_shard(sharded):
    def shard(module):
        return fully_shard(module, policy=ModuleWrapPolicy({UnitModule}))

    _save_load_round_trip(CompositeParamModel(), shard, sharded)


@distributed(world_size=2)
def test_state_dict_save_load_submodule_fully_shard():
    def shard(module):
        fully_shard(module.u1)
        fully_shard(module.u2)
        return module

    _save_load_round_trip(CompositeParamModel(), shard)


@pytest.mark.parametrize("ignore_modules,sharded_state_dict", list(itertools.product([False, True], [False, True])))
@distributed(world_size=2)
def test_state_dict_save_load_flow(ignore_modules, sharded_state_dict):
    """Shared parameters, buffers of two dtypes, ignored modules, full or sharded."""
    local_model = TransformerWithSharedParams()
    with torch.no_grad():
        for tensor in itertools.chain(local_model.parameters(), local_model.buffers()):
            if torch.count_nonzero(tensor) == 0:
                tensor.add_(torch.ones_like(tensor))
    save_model = copy.deepcopy(local_model)
    fully_shard(save_model, policy=LAYERS, ignored_modules=save_model.get_ignored_modules() if ignore_modules else [])
    kind = StateDictType.SHARDED_STATE_DICT if sharded_state_dict else StateDictType.FULL_STATE_DICT
    FSDP.set_state_dict_type(save_model, kind)
    state_dict = save_model.state_dict()
    check_state_dict_parity(local_model.state_dict(), gathered(state_dict))
    assert "output_proj.weight" in state_dict and "embed_tokens.weight" in state_dict  # tied, under both names
    if ignore_modules:
        assert not isinstance(state_dict["transformer.encoder.layers.0.linear1.weight"], DTensor)

    load_model = TransformerWithSharedParams(seed=1)
    zero_model(load_model, zero_buffers=True)
    fully_shard(load_model, policy=LAYERS, ignored_modules=load_model.get_ignored_modules() if ignore_modules else [])
    FSDP.set_state_dict_type(load_model, kind)
    load_model.load_state_dict(state_dict)
    check_model_parity(load_model, save_model)
    for (name, b1), (_, b2) in zip(load_model.named_buffers(), save_model.named_buffers()):
        torch.testing.assert_close(b1, b2, msg=lambda m: f"{name}: {m}")


@distributed(world_size=2)
def test_full_state_dict_save_load_mixed_sharding():
    def shard(module):
        fully_shard(module.u1)
        fully_shard(module, strategy=ShardingStrategy.NO_SHARD)
        return module

    _save_load_round_trip(CompositeParamModel(), shard, sharded_state_dict=False)
    _save_load_round_trip(CompositeParamModel(), shard, sharded_state_dict=True)


# -- the wrapper ------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kind,use_orig_params",
    [
        (StateDictType.FULL_STATE_DICT, False), (StateDictType.FULL_STATE_DICT, True),
        (StateDictType.SHARDED_STATE_DICT, False), (StateDictType.SHARDED_STATE_DICT, True),
        (StateDictType.LOCAL_STATE_DICT, False),
    ],
)
@distributed(world_size=2)
def test_wrapper_state_dict_types(kind, use_orig_params):
    local_model = TransformerWithSharedParams()
    precision = MixedPrecision(param_dtype=torch.bfloat16, buffer_dtype=torch.bfloat16)

    def wrap(seed_model):
        return FSDP(seed_model, auto_wrap_policy=LAYERS, use_orig_params=use_orig_params, device_id=CPU,
                    mixed_precision=precision)

    save_model = wrap(copy.deepcopy(local_model))
    assert save_model.module.vocab_bias.dtype == torch.bfloat16  # cast for compute
    with FSDP.state_dict_type(save_model, kind):
        state_dict = save_model.state_dict()
    if kind is StateDictType.LOCAL_STATE_DICT:
        flat_keys = [k for k in state_dict if k.endswith("_flat_param")]
        assert len(flat_keys) == 5 and "embed_tokens.weight" not in state_dict
    else:
        check_state_dict_parity(local_model.state_dict(), gathered(state_dict))
        assert state_dict["vocab_bias"].dtype == torch.float32  # the original dtype
    load_model = wrap(TransformerWithSharedParams(seed=1))
    with FSDP.state_dict_type(load_model, kind):
        load_model.load_state_dict(state_dict)
    with FSDP.summon_full_params(load_model), FSDP.summon_full_params(save_model):
        check_model_parity(load_model, save_model)


@distributed(world_size=2)
def test_full_state_dict_rank0_only_offload_and_unit_by_unit():
    local_model = TransformerWithSharedParams()
    model = FSDP(copy.deepcopy(local_model), auto_wrap_policy=LAYERS, device_id=CPU)
    alive: list[int] = []
    gather = full_params.gather_full_values

    def counting_gather(group, *args, **kwargs):
        alive.append(sum(1 for m in FSDP.fsdp_modules(model) if unit_record(m._state).full_values is not None))
        return gather(group, *args, **kwargs)

    full_params.gather_full_values = counting_gather
    try:
        with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                                  FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
            state_dict = model.state_dict()
    finally:
        full_params.gather_full_values = gather
    # The root's gathered values stay in the dict; each layer is gathered while no
    # other layer's are held: the root plus one unit at a time.
    assert alive == [0] + [1] * 4
    if dist.get_rank() == 0:
        check_state_dict_parity(local_model.state_dict(), state_dict)
        assert all(v.device.type == "cpu" for v in state_dict.values())
    else:
        assert state_dict == {}
    assert set(full_state_dict(model)) == set(local_model.state_dict())


@distributed(world_size=2)
def test_sharded_state_dict_loads_across_layouts():
    """A sharded state dict of a FULL_SHARD model loads into NO_SHARD and HYBRID-like layouts."""
    from torch.distributed.device_mesh import init_device_mesh

    local_model = CompositeParamModel()
    source = fully_shard(copy.deepcopy(local_model), policy=ModuleWrapPolicy({UnitModule}))
    state_dict = source.state_dict()
    for target in (
        fully_shard(CompositeParamModel(seed=3), strategy=ShardingStrategy.NO_SHARD),
        fully_shard(CompositeParamModel(seed=3), mesh=init_device_mesh("cpu", (2, 1))),
    ):
        target.load_state_dict(state_dict)
        check_model_parity(target, local_model)
