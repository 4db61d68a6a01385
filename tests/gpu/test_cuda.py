"""fullshard on a GPU with NCCL: training parity, CPU offload, ``fullshard train``, the scaler with its
scale on CUDA, state dicts and checkpoints. Parity and checkpoints run at world 1 and at world 2 (one
process per GPU, gpu_ranks.py; skipped with fewer GPUs), where every all-gather and reduce-scatter crosses
devices. Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
from gpu_ranks import device_of, on_ranks

from fullshard import (
    FSDP, CPUOffload, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardedGradScaler, checkpoint,
    fully_shard,
)
from fullshard._core import comm
from fullshard.testing.models import ThreeLinears
from fullshard.training import TrainConfig, loop

CUDA = torch.device("cuda", 0)
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(ThreeLinears(), nn.ReLU(), ThreeLinears())


def _batches(rank: int = 0) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1 + rank)
    return [torch.randn(8, 10, generator=generator) for _ in range(STEPS)]


def _train(model: nn.Module, optim: torch.optim.Optimizer, rank: int = 0, device: torch.device = CUDA) -> list[float]:
    losses = []
    for batch in _batches(rank):
        loss = model(batch.to(device)).pow(2).mean()
        loss.backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _full(param: torch.Tensor) -> torch.Tensor:
    return (param.full_tensor() if hasattr(param, "full_tensor") else param).detach().cpu()


def _fully_shard(model: nn.Module, mesh, **kwargs) -> nn.Module:
    for block in (model[0], model[2]):
        fully_shard(block, mesh=mesh, **kwargs)
    return fully_shard(model, mesh=mesh, **kwargs)


def _no_model_state_on_gpu(model: nn.Module, optim: torch.optim.Optimizer) -> None:
    for name, param in model.named_parameters():
        local = getattr(param, "_local_tensor", param)
        assert local.device.type == "cpu" and local.is_pinned(), name
        assert param.grad is None, name
    for state in optim.state.values():
        for value in state.values():
            if isinstance(value, torch.Tensor):
                assert getattr(value, "_local_tensor", value).device.type == "cpu"


def _plain_losses_on_every_batch(model: nn.Module, rank: int, world: int, device: torch.device) -> list[float]:
    """One process training on every rank's batch (the mean of their losses): what sharded training
    over ``world`` ranks, each on its own batch, must equal. Returns rank ``rank``'s losses."""
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    every = [_batches(r) for r in range(world)]
    losses = []
    for step in range(STEPS):
        per_rank = [model(batches[step].to(device)).pow(2).mean() for batches in every]
        torch.stack(per_rank).mean().backward()
        optim.step()
        optim.zero_grad(set_to_none=True)
        losses.append(per_rank[rank].item())
    return losses


def check_matches_a_plain_model(mesh) -> None:
    """Each rank trains on its own batch; losses and full parameters equal the one-process model's.
    At world 2 the gradients must be averaged across the GPUs (a rank training on its own batch
    only, or a reduce-scatter that sums, fails), and the collectives must have been issued."""
    device, rank, world = device_of(mesh), mesh.get_local_rank(), mesh.size()
    plain = _model().to(device)
    expected = _plain_losses_on_every_batch(plain, rank, world, device)
    sharded = _fully_shard(_model().to(device), mesh)
    with comm.record_comms() as records:
        losses = _train(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2), rank, device)
    assert losses == pytest.approx(expected, rel=1e-5 if world > 1 else 1e-6)
    for (name, a), b in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full(a), _full(b), msg=name)
    if world > 1:
        ops = [record.op for record in records]
        assert ops.count("all_gather") >= STEPS and ops.count("reduce_scatter") >= STEPS, ops


@pytest.mark.parametrize("world", [1, 2])
def test_fully_shard_matches_a_plain_model_on_nccl(world):
    on_ranks(world, check_matches_a_plain_model)


def check_cpu_offload_equals_no_offload(mesh, front_end: str) -> None:
    """fp32: the same losses and parameters as without offload; between steps no
    parameter, gradient or optimizer state of the model on the GPU."""
    device, rank = device_of(mesh), mesh.get_local_rank()

    def build(offload: bool) -> nn.Module:
        model = _model()  # built on the CPU, as a user with a large model would
        if front_end == "fully_shard":
            return _fully_shard(model, mesh, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        return FSDP(model, device_id=device, cpu_offload=CPUOffload(offload_params=offload), use_orig_params=True)

    reference = build(False)
    expected = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2), rank, device)
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offloaded = build(True)
    optim = torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
    losses = _train(offloaded, optim, rank, device)
    torch.cuda.synchronize()
    torch.empty(1, device=device)  # lets the allocator release blocks freed behind the copy stream
    assert losses == pytest.approx(expected, rel=1e-6)
    for (name, a), b in zip(offloaded.named_parameters(), reference.parameters()):
        torch.testing.assert_close(_full(a), _full(b), rtol=1e-6, atol=1e-7, msg=name)
    _no_model_state_on_gpu(offloaded, optim)
    # Nothing of the offloaded model stays allocated on the GPU between steps.
    assert torch.cuda.memory_allocated() == before


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_cpu_offload_equals_no_offload_and_keeps_the_gpu_free(front_end, world):
    on_ranks(world, check_cpu_offload_equals_no_offload, front_end)


def test_offloaded_module_moved_to_the_gpu_is_an_error(nccl_world):
    with torch.device("meta"):
        model = _model()
    _fully_shard(model, nccl_world, offload_policy=CPUOffloadPolicy())
    with pytest.raises(RuntimeError, match=r"CPU offload expects the parameters of .* on the CPU.*to_empty\(device='cpu'\)"):
        model.to_empty(device=CUDA)


def test_fully_shard_train_on_nccl(nccl_world, capsys):
    """The loop of ``fullshard train`` (as torchrun runs it) with bf16 and with CPU offload;
    the summary reports CUDA's max_memory_allocated next to the plan."""
    for cpu_offload in (False, True):
        config = TrainConfig(layers=2, dim=64, heads=4, seq=32, batch=4, steps=3, warmup=1,
                             mixed_precision="bf16", cpu_offload=cpu_offload)
        result = loop.train(config)
        assert result.device == "cuda" and result.steps_done == 3 and all(p > 0 for p in result.peaks)
        assert all(loss == loss for loss in result.losses)  # no NaN
    assert "max_memory_allocated" in capsys.readouterr().out


def test_grad_scaler_with_its_scale_on_cuda(nccl_world):
    model = _fully_shard(_model().to(CUDA), nccl_world, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float16))
    optim = torch.optim.SGD(model.parameters(), lr=1e-2)
    scaler = ShardedGradScaler(device="cuda", init_scale=2.0**10)
    batch = _batches()[0].to(CUDA)
    scaler.scale(model(batch).float().pow(2).mean()).backward()
    assert scaler._scale.device.type == "cuda"
    before = [_full(p) for p in model.parameters()]
    next(iter(model.parameters())).grad._local_tensor.fill_(float("inf"))
    scaler.step(optim)
    scaler.update()
    assert scaler.get_scale() == 2.0**9  # the step was skipped and the scale halved
    for a, b in zip(model.parameters(), before):
        torch.testing.assert_close(_full(a), b)


def check_state_dict_and_checkpoint_round_trip(mesh, path, offload: bool) -> None:
    """A checkpoint of a trained model (each rank its own batches) restores every shard, and
    training on from it equals training on from the original."""
    device, rank = device_of(mesh), mesh.get_local_rank()
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    model = _fully_shard(_model() if offload else _model().to(device), mesh, **policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim, rank, device)
    state = model.state_dict()
    assert all(v.device_mesh.device_type == mesh.device_type for v in state.values())
    checkpoint.save(path, model, optim)
    restored = _fully_shard(_model() if offload else _model().to(device), mesh, **policy)
    restored_optim = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    checkpoint.load(path, restored, restored_optim)
    for (name, a), b in zip(restored.named_parameters(), model.parameters()):
        torch.testing.assert_close(_full(a), _full(b), msg=name)
        assert getattr(a, "_local_tensor", a).device.type == ("cpu" if offload else device.type)
    resumed = _train(restored, restored_optim, rank, device)
    assert resumed == pytest.approx(_train(model, optim, rank, device), rel=1e-6)


@pytest.mark.parametrize("world", [1, 2])
@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_and_checkpoint_round_trip(tmp_path, offload, world):
    on_ranks(world, check_state_dict_and_checkpoint_round_trip, str(tmp_path), offload)
