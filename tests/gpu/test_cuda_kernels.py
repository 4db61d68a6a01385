"""GPU: one kernel per unit, side streams and event-ordered frees (NCCL at world 1; bf16 training
against FSDP2 at world 2 too, one process per GPU, gpu_ranks.py).

The copy/cast op counts of tests/test_copy_count.py on CUDA (where the
reduce-scatter copy-in is ``_chunk_cat``'s one kernel and the all-gather
runs on its own stream), bf16 training equal to FSDP2's through those
streams, and offload copies that give their device memory back once done.
"""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch
import torch.nn as nn
from gpu_ranks import device_of, on_ranks
from torch.distributed.fsdp import MixedPrecisionPolicy as TorchMixedPrecisionPolicy
from torch.distributed.fsdp import fully_shard as torch_fully_shard

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard._core import offload
from fullshard.models import ModelArgs, Transformer

ARGS = ModelArgs(n_layers=2, vocab_size=64, max_seq_len=16, dim=64, n_heads=4)
CUDA = torch.device("cuda", 0)


def _sharded(shard, policy, mesh) -> nn.Module:
    torch.manual_seed(0)
    model = Transformer(ARGS).to(device_of(mesh))
    for layer in model.layers:
        shard(layer, mesh=mesh, mp_policy=policy)
    return shard(model, mesh=mesh, mp_policy=policy)


def _step_ops(model: nn.Module, tokens: torch.Tensor) -> dict[str, int]:
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from test_copy_count import CopyCounter

    model.loss(tokens, tokens).backward()
    model.zero_grad()
    with CopyCounter() as counter:
        model.loss(tokens, tokens).backward()
    return dict(counter.counts)


@pytest.mark.parametrize("mixed", [False, True])
def test_copy_ops_per_step_at_most_fsdp2_on_cuda(nccl_world, mixed):
    bf16 = torch.bfloat16
    ours_policy = (
        MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32) if mixed else MixedPrecisionPolicy()
    )
    theirs_policy = (
        TorchMixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32)
        if mixed
        else TorchMixedPrecisionPolicy()
    )
    tokens = torch.randint(ARGS.vocab_size, (2, 16), device=CUDA)
    ours = _step_ops(_sharded(fully_shard, ours_policy, nccl_world), tokens)
    theirs = _step_ops(_sharded(torch_fully_shard, theirs_policy, nccl_world), tokens)
    assert sum(ours.values()) <= sum(theirs.values()), (ours, theirs)
    assert ours.get("_foreach_copy_", 0) == 0, ours  # the CUDA copy-in is _chunk_cat, not the CPU path


def check_bf16_training_equals_fsdp2(mesh) -> None:
    """Each rank its own tokens: at world 2 the bf16 all-gathers and fp32 reduce-scatters cross GPUs."""
    bf16, device = torch.bfloat16, device_of(mesh)
    ours = _sharded(fully_shard, MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32), mesh)
    theirs = _sharded(torch_fully_shard, TorchMixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=torch.float32), mesh)
    losses = {}
    for name, model in (("ours", ours), ("theirs", theirs)):
        optim = torch.optim.AdamW(model.parameters(), lr=1e-3)
        generator = torch.Generator().manual_seed(1 + mesh.get_local_rank())
        losses[name] = []
        for _ in range(3):
            tokens = torch.randint(ARGS.vocab_size, (2, 16), generator=generator).to(device)
            loss = model.loss(tokens, tokens)
            loss.backward()
            optim.step()
            optim.zero_grad()
            losses[name].append(loss.item())
    assert losses["ours"] == pytest.approx(losses["theirs"], rel=1e-2)


@pytest.mark.parametrize("world", [1, 2])
def test_bf16_training_equals_fsdp2_through_the_all_gather_stream(world):
    on_ranks(world, check_bf16_training_equals_fsdp2)


def test_offload_copy_frees_its_device_tensor_once_done(nccl_world):
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    device_tensor = torch.randn(1 << 20, device=CUDA)
    expected = device_tensor.cpu()
    host = offload.to_host(device_tensor, torch.float32)
    del device_tensor  # still referenced by the copy in flight, not by record_stream
    assert torch.cuda.memory_allocated() > before
    offload.wait_for_host_copies()
    assert torch.cuda.memory_allocated() == before  # the event completed: the block is back
    assert torch.equal(host, expected) and host.is_pinned()
    assert copy.copy(offload._in_flight) == []
