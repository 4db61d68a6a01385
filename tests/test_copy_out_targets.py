"""The all-gather copy-out's kept targets (``all_gather.CopyOutTargets``): the views of
the unsharded storages are built once and reused every gather, and rebuilt whenever
what they view changes (a dtype change, the gathered dtype, inference mode first).
Each case checks the values against the plain model, so a stale view fails."""

import copy

import torch
import torch.nn as nn

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard._core.step.state import get_state
from fullshard.testing import distributed


def _models(**kwargs) -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 8))
    model = copy.deepcopy(ref)
    fully_shard(model[0], **kwargs)
    fully_shard(model[2], **kwargs)
    fully_shard(model, **kwargs)
    return model, ref


def _step(model: nn.Module, optim: torch.optim.Optimizer, x: torch.Tensor) -> torch.Tensor:
    loss = model(x).square().sum()
    loss.backward()
    optim.step()
    optim.zero_grad()
    return loss.detach()


@distributed(world_size=2)
def test_targets_are_kept_and_follow_a_dtype_change():
    model, ref = _models()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))  # the same on every rank
    with torch.inference_mode():  # no targets kept here: views made in inference mode stay read-only outside it
        torch.testing.assert_close(model(x), ref(x))
    optim, ref_optim = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    gather = get_state(model[0]).group.gather
    kept = None
    for step in range(3):
        torch.testing.assert_close(_step(model, optim, x), _step(ref, ref_optim, x))
        if step == 0:
            kept = gather._targets
        assert kept is not None and gather._targets is kept, "the copy-out targets were rebuilt between steps"
    model.double()
    ref.double()
    optim, ref_optim = torch.optim.SGD(model.parameters(), lr=0.1), torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(2):
        torch.testing.assert_close(_step(model, optim, x.double()), _step(ref, ref_optim, x.double()))
    assert gather._targets is not kept and gather._targets.padded[0].dtype == torch.float64
    for param, expected in zip(model.parameters(), ref.parameters()):
        torch.testing.assert_close(param.full_tensor(), expected)


@distributed(world_size=2)
def test_targets_follow_the_gathered_dtype():
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, cast_forward_inputs=False)
    model, ref = _models(mp_policy=policy)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    units = [get_state(model[0]).group, get_state(model[2]).group]
    low = copy.deepcopy(ref).to(torch.bfloat16)
    torch.testing.assert_close(model(x.bfloat16()), low(x.bfloat16()))
    for unit in units:
        unit.set_full_precision(True)
    torch.testing.assert_close(model(x), ref(x))  # gathered in fp32 now: the fp32 model exactly
    for unit in units:
        unit.set_full_precision(False)
    torch.testing.assert_close(model(x.bfloat16()), low(x.bfloat16()))
