"""Optimizer state dicts keyed by parameter FQN, and seed 000's HSDP save/load."""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from fullshard import FSDP, ShardingStrategy, StateDictType, fully_shard
from fullshard.models import ModelArgs, Transformer, TransformerBlock
from fullshard.testing import DataParallelReference, clone_tree, distributed, full_value
from fullshard.testing.models import ThreeLinears
from fullshard.wrap import ModuleWrapPolicy

CPU = torch.device("cpu")
ARGS = ModelArgs(n_layers=2, vocab_size=32, max_seq_len=8, dim=16)
OPTIMIZERS = {
    "adam": lambda params: torch.optim.Adam(params, lr=1e-2),
    "adamw": lambda params: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1),
    "sgd": lambda params: torch.optim.SGD(params, lr=1e-2, momentum=0.9),
}


def make_model() -> Transformer:
    torch.manual_seed(0)
    return Transformer(ARGS)


def batch_for(rank: int, step: int):
    tokens = torch.randint(ARGS.vocab_size, (4, 8), generator=torch.Generator().manual_seed(100 * step + rank))
    return tokens, tokens.roll(-1, dims=1)


def lm_loss(model: nn.Module, batch) -> torch.Tensor:
    tokens, targets = batch
    return F.cross_entropy(model(tokens).flatten(0, 1), targets.flatten())


def train(model: nn.Module, optim: torch.optim.Optimizer, steps: range) -> None:
    for step in steps:
        lm_loss(model, batch_for(dist.get_rank(), step)).backward()
        optim.step()
        optim.zero_grad()


@pytest.mark.parametrize("kind", [StateDictType.FULL_STATE_DICT, StateDictType.SHARDED_STATE_DICT])
@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
@distributed(world_size=2)
def test_wrapper_optim_state_dict_round_trip(optimizer, use_orig_params, kind):
    ref = make_model()
    reference = DataParallelReference(ref, lm_loss)
    ref_optim = OPTIMIZERS[optimizer](ref.parameters())

    def wrapped() -> nn.Module:
        return FSDP(make_model(), auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}), device_id=CPU,
                    use_orig_params=use_orig_params)

    model = wrapped()
    optim = OPTIMIZERS[optimizer](model.parameters())
    train(model, optim, range(2))
    for step in range(2):
        reference.backward([batch_for(r, step) for r in range(2)])
        ref_optim.step()
        ref_optim.zero_grad()

    with FSDP.state_dict_type(model, kind):
        model_sd = model.state_dict()
        osd = FSDP.optim_state_dict(model, optim)
    # Keyed by FQN, with the same states as the unsharded reference optimizer's.
    names = [n for n, _ in ref.named_parameters()]
    assert set(osd["state"]) == set(names)
    fqns = [fqn for group in osd["param_groups"] for fqn in group["params"]]
    # A flat parameter lists its unit's parameters together; otherwise model order.
    assert (sorted(fqns) == sorted(names)) if not use_orig_params else (fqns == names)
    ref_state = ref_optim.state_dict()["state"]
    for index, name in enumerate(names):
        for key, value in ref_state[index].items():
            torch.testing.assert_close(full_value(osd["state"][name][key]), value, rtol=1e-5, atol=1e-6)

    other = wrapped()
    other_optim = OPTIMIZERS[optimizer](other.parameters())
    # Like optimizer.state_dict(), the dicts reference live tensors: copy them, as
    # saving to disk would, before a second optimizer in this process takes them.
    model_sd, osd = clone_tree(model_sd), clone_tree(osd)
    with FSDP.state_dict_type(other, kind):
        other.load_state_dict(model_sd)
        other_optim.load_state_dict(FSDP.optim_state_dict_to_load(other, other_optim, osd))
    train(model, optim, range(2, 4))
    train(other, other_optim, range(2, 4))
    with FSDP.summon_full_params(model), FSDP.summon_full_params(other):
        for (name, p), (_, q) in zip(model.named_parameters(), other.named_parameters()):
            torch.testing.assert_close(p, q, msg=lambda m: f"{name}: {m}")


@distributed(world_size=2)
def test_fully_shard_optimizer_state_dict_holds_dtensors():
    def sharded() -> nn.Module:
        model = make_model()
        for layer in model.layers:
            fully_shard(layer)
        return fully_shard(model)

    model, other = sharded(), sharded()
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    train(model, optim, range(2))
    state = clone_tree(optim.state_dict())  # live tensors: copy before a second optimizer takes them
    assert all(isinstance(v["exp_avg"], torch.distributed.tensor.DTensor) for v in state["state"].values())
    other.load_state_dict(model.state_dict())
    other_optim = torch.optim.AdamW(other.parameters(), lr=1e-2)
    other_optim.load_state_dict(state)  # the optimizer's own state dict round-trips
    osd = FSDP.optim_state_dict(model, optim)  # FQN-keyed, for fully_shard models too
    assert "layers.0.attention.wq.weight" in osd["state"]
    train(model, optim, range(2, 4))
    train(other, other_optim, range(2, 4))
    for p, q in zip(model.parameters(), other.parameters()):
        torch.testing.assert_close(full_value(p), full_value(q))


@distributed(world_size=2)
def test_optim_state_dict_refuses_ranks_with_different_states():
    """Rank 1's optimizer lacks one parameter: every rank raises naming the ranks and the parameter,
    instead of pairing collectives of different parameters."""
    model = make_model()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    params = list(model.parameters())
    optim = torch.optim.SGD(params if dist.get_rank() == 0 else params[:-1], lr=1e-2, momentum=0.9)
    train(model, optim, range(1))
    with pytest.raises(RuntimeError, match=r"rank 0 has \['norm\.bias'\] that rank 1 lacks"):
        FSDP.optim_state_dict(model, optim)


@distributed(world_size=4)
def test_hsdp_save_load_state_dict():
    """Seed 000: sharded model and optimizer state dicts of an HSDP model
    (``(shard, replicate)`` groups, use_orig_params=True) load into a new one."""
    rank = dist.get_rank()
    nodes = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replicas = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    groups = (nodes[rank // 2], replicas[rank % 2])

    def make() -> nn.Module:
        return FSDP(ThreeLinears(), sharding_strategy=ShardingStrategy.HYBRID_SHARD, use_orig_params=True,
                    process_group=groups, device_id=CPU)

    torch.manual_seed(0)
    model = make()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 10)).sum().backward()
    optim.step()
    assert model.process_group is groups[0] and model._inter_node_pg is groups[1]
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        msd = model.state_dict()
        osd = clone_tree(FSDP.optim_state_dict(model, optim))  # as if saved: no live tensors shared

    torch.manual_seed(1)
    load_model = make()
    load_optim = torch.optim.AdamW(load_model.parameters())
    with FSDP.state_dict_type(load_model, StateDictType.SHARDED_STATE_DICT):
        load_model.load_state_dict(msd)
        FSDP.optim_state_dict_to_load(load_model, load_optim, osd)
    load_optim.load_state_dict(osd)  # as in the seed: the FQN-keyed dict loads directly
    # Its sharded states are DTensors, the parameters plain shard views (FSDP1's
    # use_orig_params=True): optim_state_dict_to_load gives states to train with.
    load_optim.load_state_dict(FSDP.optim_state_dict_to_load(load_model, load_optim, osd))

    for p, q in zip(model.parameters(), load_model.parameters()):
        torch.testing.assert_close(full_value(p), full_value(q))
    for state, loaded in zip(optim.state.values(), load_optim.state.values()):
        torch.testing.assert_close(full_value(state["exp_avg"]), full_value(loaded["exp_avg"]))
    optim.zero_grad()
    for m, o in ((model, optim), (load_model, load_optim)):  # and they keep training alike
        m(torch.ones(2, 10)).sum().backward()
        o.step()
    for p, q in zip(model.parameters(), load_model.parameters()):
        torch.testing.assert_close(full_value(p), full_value(q))
