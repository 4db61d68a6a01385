"""The wrapper's flat parameter (``use_orig_params=False``) in FSDP1's layout (issue 23):
each unit's ``_flat_param`` holds ceil(total / W) elements, and its values and gradient
equal torch's FSDP1 flat shard on every rank, at 2 and 4 ranks, with sizes that divide
unevenly and a parameter smaller than W elements (see [Note: Flat layout] in _core/layout.py).
"""

import warnings

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from test_wrapper_sharded_tensor import api, local_dict  # the FSDP namespace of torch or fullshard; LOCAL dicts

from fullshard.testing import distributed


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(5, 7)  # 42 elements
        self.tiny = nn.Parameter(torch.randn(3))  # fewer elements than ranks at 4 ranks

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.lin(x)) * self.tiny.sum()


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(3, 5)  # 20 elements
        self.block = Block()
        self.out = nn.Linear(7, 1)  # a one-element bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.block(self.inp(x)))


def wrapped(lib: str) -> nn.Module:
    fsdp, ModuleWrapPolicy = api(lib)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fsdp.FullyShardedDataParallel(
            Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=False
        )


def trained(lib: str, steps: int = 2) -> nn.Module:
    """The wrapped model after ``steps`` SGD steps and one more backward (its gradients kept)."""
    model = wrapped(lib)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank() + 1)
    for step in range(steps + 1):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
        if step < steps:
            optim.step()
    return model


def flat_params(lib: str, steps: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each unit's flat parameter and its gradient after ``steps`` SGD steps and one more backward."""
    model = trained(lib, steps)
    return {
        name: (param.detach().clone(), param.grad.clone())
        for name, param in model.named_parameters()
        if name.endswith("_flat_param")
    }


def check_equal_to_torch() -> None:
    theirs = flat_params("torch", steps=2)
    ours = flat_params("ours", steps=2)
    world = dist.get_world_size()
    assert set(ours) == set(theirs)
    totals = {"_flat_param": 20 + 7 * 1 + 1, "block._flat_param": 42 + 3}
    for name, (value, grad) in theirs.items():
        total = next(t for key, t in totals.items() if name.replace("_fsdp_wrapped_module.", "") == key)
        assert value.numel() == -(-total // world)  # torch's own numbers, as the issue states them
        our_value, our_grad = ours[name]
        assert our_value.shape == value.shape, f"{name}: {our_value.shape} vs torch's {value.shape}"
        torch.testing.assert_close(our_value, value, rtol=1e-6, atol=1e-7, msg=f"{name} values")
        torch.testing.assert_close(our_grad, grad, rtol=1e-6, atol=1e-7, msg=f"{name} grad")


@pytest.mark.parametrize("world_size", [2, 4])
def test_flat_param_equals_torchs_flat_shard(world_size):
    distributed(world_size=world_size)(check_equal_to_torch)()


def check_local_state_dicts_load_across() -> None:
    """LOCAL_STATE_DICT holds FSDP1's ShardedTensors (one shard per rank, same offsets and values), so
    each framework loads the other's directly (FSDP1's loader takes exactly one local shard)."""
    models = {lib: trained(lib) for lib in ("torch", "ours")}
    saved = {lib: local_dict(lib, model) for lib, model in models.items()}
    flat_keys = [k for k in saved["torch"] if k.endswith("_flat_param")]
    assert flat_keys and set(saved["torch"]) == set(saved["ours"])
    for key in flat_keys:
        theirs, ours = saved["torch"][key], saved["ours"][key]
        assert [(m.shard_offsets, m.shard_sizes, str(m.placement)) for m in ours.metadata().shards_metadata] == [
            (m.shard_offsets, m.shard_sizes, str(m.placement)) for m in theirs.metadata().shards_metadata
        ], key
        assert len(ours.local_shards()) == len(theirs.local_shards()) <= 1, key
        for mine, their in zip(ours.local_shards(), theirs.local_shards()):
            assert mine.metadata.shard_offsets == their.metadata.shard_offsets, key
            torch.testing.assert_close(mine.tensor, their.tensor, rtol=1e-6, atol=1e-7, msg=key)
    for lib, other in (("torch", "ours"), ("ours", "torch")):
        fresh = wrapped(lib)
        fsdp, _ = api(lib)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            with fsdp.FullyShardedDataParallel.state_dict_type(fresh, fsdp.StateDictType.LOCAL_STATE_DICT):
                fresh.load_state_dict(saved[other])
        for name, param in fresh.named_parameters():
            expected = dict(models[other].named_parameters())[name]
            torch.testing.assert_close(param.detach(), expected.detach(), rtol=1e-6, atol=1e-7, msg=f"{lib} {name}")


@pytest.mark.parametrize("world_size", [2, 4])
def test_local_state_dicts_are_fsdp1s(world_size):
    distributed(world_size=world_size)(check_local_state_dicts_load_across)()
