"""Ranks that built or sharded different models (issue 36): every rank raises at the root's
lazy init, before the first all-gather, naming the unit and the two ranks, instead of gloo
aborting the process on mismatched sizes or NCCL hanging. See [Note: Ranks agree on the model]."""

import time

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from fullshard import FullyShardedDataParallel, fully_shard
from fullshard.testing import case, distributed
from fullshard.wrap import ModuleWrapPolicy

CASES = {
    # what rank 1 does differently -> what the message says
    "a wider layer": r"unit '0' holds 0\.weight \[16, 16\] torch\.float32 on rank 0 and 0\.weight \[24, 24\] "
    r"torch\.float32 on rank 1",
    "one more layer": r"unit '3' \(and any after it\) is sharded on rank 1 only",
    "no unit per block": r"the units' order reaches '0' on rank 0 where it reaches 'Sequential' on rank 1",
    "another resharding": r"unit '1' has reshard_after_forward=True on rank 0 and "
    r"reshard_after_forward=False on rank 1",
    "another dtype": r"unit '0' holds 0\.weight \[16, 16\] torch\.float32 on rank 0 and 0\.weight \[16, 16\] "
    r"torch\.float64 on rank 1",
}


def _model(differs: str) -> nn.Sequential:
    other = dist.get_rank() == 1
    dim = 24 if other and differs == "a wider layer" else 16
    depth = 4 if other and differs == "one more layer" else 3
    model = nn.Sequential(*(nn.Linear(dim, dim) for _ in range(depth)))
    if other and differs == "another dtype":
        model[0].double()
    return model


@distributed(world_size=2)
def test_ranks_that_shard_different_models_raise_before_the_first_all_gather():
    for differs, message in CASES.items():
        with case(differs):
            model = _model(differs)
            if not (differs == "no unit per block" and dist.get_rank() == 1):
                for layer in model:
                    fully_shard(layer)
            fully_shard(model)
            if differs == "another resharding" and dist.get_rank() == 1:
                model[1].set_reshard_after_forward(False)
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=r"^the ranks sharded different models under Sequential: ranks 0 "
                               r"and 1 differ \(" + message + r"\)\. Every rank must build the same model"):
                model(torch.randn(2, model[0].in_features, dtype=model[0].weight.dtype))
            assert time.monotonic() - start < 10


@distributed(world_size=2)
def test_wrapper_ranks_that_wrap_differently_raise():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Sequential(nn.Linear(8, 8)), nn.Linear(8, 8))
    policy = ModuleWrapPolicy({nn.Sequential} if dist.get_rank() == 0 else {nn.Linear})
    wrapped = FullyShardedDataParallel(model, auto_wrap_policy=policy, use_orig_params=True)
    with pytest.raises(RuntimeError, match=r"^the ranks sharded different models under .*ranks 0 and 1 differ"):
        wrapped(torch.randn(2, 8))
    dist.barrier()  # both ranks raised at the same point: the group still works


@distributed(world_size=2)
def test_ranks_that_agree_pass_the_check_with_one_small_collective():
    from fullshard._core import comm

    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    for layer in model:
        fully_shard(layer)
    fully_shard(model)
    object_gathers = []
    real = dist.all_gather_object
    dist.all_gather_object = lambda *a, **k: object_gathers.append(a) or real(*a, **k)  # a pooled rank: undone below
    gathers_per_step = []
    try:
        for _ in range(2):
            with comm.record_comms() as records:
                model(torch.randn(2, 8)).sum().backward()
            gathers_per_step.append([r.nbytes for r in records if r.op == "all_gather"])
    finally:
        dist.all_gather_object = real
    assert len(object_gathers) == 1  # the digest, once: the first step's lazy init
    assert gathers_per_step[0] == gathers_per_step[1]  # and no all-gather of the engine's
