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

import fullshard
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


def flat_params(lib: str, steps: int) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """Each unit's flat parameter and its gradient after ``steps`` SGD steps and one more backward."""
    if lib == "torch":
        from torch.distributed import fsdp
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    else:
        fsdp, ModuleWrapPolicy = fullshard, fullshard.wrap.ModuleWrapPolicy
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = fsdp.FullyShardedDataParallel(
            Net(), auto_wrap_policy=ModuleWrapPolicy({Block}), device_id=torch.device("cpu"), use_orig_params=False
        )
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(dist.get_rank() + 1)
    for step in range(steps + 1):
        optim.zero_grad()
        model(torch.randn(4, 3, generator=gen)).pow(2).mean().backward()
        if step < steps:
            optim.step()
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
