"""A unit's kept unsharded (or post-forward) form never outlives a change of its
shards (see [Note: Kept forms go stale]): an optimizer step or a state-dict load
after a no-grad forward is seen by the next forward, as in one process.
Torch's FSDP (2.13) reuses the kept form there and computes with the old
values (the test below names the settings where it does)."""

import copy

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import FullyShardedDataParallel, ShardingStrategy, fully_shard
from fullshard._core import comm
from fullshard.testing import distributed, full_value, run_distributed


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8), nn.Linear(8, 4))


def _shard(model: nn.Module, front_end: str, setting: object, world_size: int) -> nn.Module:
    if front_end == "fully_shard":
        mesh = init_device_mesh("cpu", (world_size,))
        fully_shard(model[0], mesh=mesh, reshard_after_forward=setting)
        fully_shard(model[2], mesh=mesh, reshard_after_forward=setting)
        return fully_shard(model, mesh=mesh, reshard_after_forward=setting)
    strategy, use_orig_params = setting
    wrap = dict(sharding_strategy=getattr(ShardingStrategy, strategy), use_orig_params=use_orig_params)
    model[0] = FullyShardedDataParallel(model[0], **wrap)
    model[2] = FullyShardedDataParallel(model[2], **wrap)
    return FullyShardedDataParallel(model, **wrap)


def _train_with_evaluation_before_step(front_end: str, setting: object, world_size: int, load: bool) -> None:
    ref = _model()
    model = _shard(copy.deepcopy(ref), front_end, setting, world_size)
    pairs = [(net, torch.optim.SGD(net.parameters(), lr=0.05)) for net in (ref, model)]
    generator = torch.Generator().manual_seed(1)
    batches = [torch.randn(3, 8, generator=generator) for _ in range(3)]
    losses: list[list[float]] = [[], []]
    for index, (net, optim) in enumerate(pairs):
        for x in batches:
            if load:  # a checkpoint taken now (``state_dict()`` reshards: never between a step and a forward)
                halved = {key: value.detach().clone() * 0.5 for key, value in net.state_dict().items()}
            loss = net(x).square().sum()
            loss.backward()
            losses[index].append(loss.item())
            with torch.no_grad():
                net(x)  # evaluation forward: keeps whatever the setting keeps
            optim.step()  # after the evaluation: the kept forms are now stale
            optim.zero_grad()
            if load:  # an evaluation forward on the stepped values, then the (halved) checkpoint loaded
                with torch.no_grad():
                    losses[index].append(net(x).square().sum().item())
                net.load_state_dict(halved)
    assert losses[1] == pytest.approx(losses[0], rel=1e-5)
    if front_end == "fully_shard":  # the shards (a kept form stays registered until the next use)
        for shard, want in zip(pairs[1][1].param_groups[0]["params"], ref.parameters()):
            torch.testing.assert_close(full_value(shard), want.detach())
    else:
        with FullyShardedDataParallel.summon_full_params(model):
            for (name, got), want in zip(model.named_parameters(), ref.parameters()):
                torch.testing.assert_close(got, want, msg=name)


@pytest.mark.parametrize("load", [False, True], ids=["step", "step_and_load"])
@pytest.mark.parametrize("reshard_after_forward", [False, 2, True])
@distributed(world_size=4)
def test_fully_shard_evaluation_forward_before_step(reshard_after_forward, load):
    # torch's fully_shard: the next forward runs on the old values for False and 2
    _train_with_evaluation_before_step("fully_shard", reshard_after_forward, 4, load)


@pytest.mark.parametrize("use_orig_params", [False, True])
@pytest.mark.parametrize("strategy", ["SHARD_GRAD_OP", "FULL_SHARD", "NO_SHARD"])
def test_wrapper_evaluation_forward_before_step(strategy, use_orig_params):
    # torch's FSDP1: the next forward runs on the old values under SHARD_GRAD_OP and FULL_SHARD
    run_distributed(_train_with_evaluation_before_step, 2, "wrapper", (strategy, use_orig_params), 2, False)


@distributed(world_size=2)
def test_kept_unsharded_form_serves_forwards_until_the_shards_change():
    """Inference with ``reshard_after_forward=False`` gathers once (the reason to
    keep the form), and once more after the shards changed."""
    model = _shard(_model(), "fully_shard", False, 2)
    shards = list(model[2].parameters())  # while sharded: what an optimizer holds
    x = torch.randn(3, 8)
    with torch.no_grad(), comm.record_comms() as records:
        for _ in range(3):
            model(x)
    assert [r.op for r in records].count("all_gather") == 3  # each unit once
    with torch.no_grad():
        for shard in shards:
            shard.mul_(2.0)
    with torch.no_grad(), comm.record_comms() as records:
        model(x)
        model(x)
    assert [r.op for r in records].count("all_gather") == 1  # only the changed unit, once


@distributed(world_size=2)
def test_model_built_in_inference_mode_keeps_its_forms():
    """Shards made under ``torch.inference_mode`` keep no version counters: their
    kept forms are reused without a check (nothing outside that mode can change them)."""
    with torch.inference_mode():
        ref = _model()
        model = _shard(copy.deepcopy(ref), "fully_shard", False, 2)
        x = torch.randn(3, 8)
        with comm.record_comms() as records:
            outputs = [model(x) for _ in range(2)]
        want = ref(x)
    assert [r.op for r in records].count("all_gather") == 3
    for output in outputs:
        torch.testing.assert_close(output, want)
