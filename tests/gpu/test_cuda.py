"""fullshard on a GPU with NCCL (world 1): training parity, CPU offload, ``fullshard train``, the
scaler with its scale on CUDA, state dicts and checkpoints. Skipped without CUDA (conftest.py)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from fullshard import (
    FSDP, CPUOffload, CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, ShardedGradScaler, checkpoint,
    fully_shard,
)
from fullshard.testing.models import ThreeLinears
from fullshard.training import TrainConfig, loop

CUDA = torch.device("cuda", 0)
STEPS = 3


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(ThreeLinears(), nn.ReLU(), ThreeLinears())


def _batches() -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randn(8, 10, generator=generator) for _ in range(STEPS)]


def _train(model: nn.Module, optim: torch.optim.Optimizer) -> list[float]:
    losses = []
    for batch in _batches():
        loss = model(batch.to(CUDA)).pow(2).mean()
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


def test_fully_shard_matches_a_plain_model_on_nccl(nccl_world):
    plain = _model().to(CUDA)
    expected = _train(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2))
    sharded = _fully_shard(_model().to(CUDA), nccl_world)
    assert _train(sharded, torch.optim.AdamW(sharded.parameters(), lr=1e-2)) == pytest.approx(expected, rel=1e-6)
    for (name, a), b in zip(sharded.named_parameters(), plain.parameters()):
        torch.testing.assert_close(_full(a), _full(b), msg=name)


@pytest.mark.parametrize("front_end", ["fully_shard", "wrapper"])
def test_cpu_offload_equals_no_offload_and_keeps_the_gpu_free(nccl_world, front_end):
    """fp32: the same losses and parameters as without offload; between steps no
    parameter, gradient or optimizer state of the model on the GPU."""
    def build(offload: bool) -> nn.Module:
        model = _model()  # built on the CPU, as a user with a large model would
        if front_end == "fully_shard":
            return _fully_shard(model, nccl_world, offload_policy=CPUOffloadPolicy() if offload else OffloadPolicy())
        return FSDP(model, device_id=CUDA, cpu_offload=CPUOffload(offload_params=offload), use_orig_params=True)

    reference = build(False)
    expected = _train(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2))
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    offloaded = build(True)
    optim = torch.optim.AdamW(offloaded.parameters(), lr=1e-2)
    losses = _train(offloaded, optim)
    torch.cuda.synchronize()
    torch.empty(1, device=CUDA)  # lets the allocator release blocks freed behind the copy stream
    assert losses == pytest.approx(expected, rel=1e-6)
    for (name, a), b in zip(offloaded.named_parameters(), reference.parameters()):
        torch.testing.assert_close(_full(a), _full(b), rtol=1e-6, atol=1e-7, msg=name)
    _no_model_state_on_gpu(offloaded, optim)
    # Nothing of the offloaded model stays allocated on the GPU between steps.
    assert torch.cuda.memory_allocated() == before


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


@pytest.mark.parametrize("offload", [False, True])
def test_state_dict_and_checkpoint_round_trip(nccl_world, tmp_path, offload):
    policy = {"offload_policy": CPUOffloadPolicy()} if offload else {}
    model = _fully_shard(_model() if offload else _model().to(CUDA), nccl_world, **policy)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _train(model, optim)
    state = model.state_dict()
    assert all(v.device_mesh.device_type == "cuda" for v in state.values())
    checkpoint.save(tmp_path, model, optim)
    restored = _fully_shard(_model() if offload else _model().to(CUDA), nccl_world, **policy)
    restored_optim = torch.optim.AdamW(restored.parameters(), lr=1e-2)
    checkpoint.load(tmp_path, restored, restored_optim)
    for (name, a), b in zip(restored.named_parameters(), model.parameters()):
        torch.testing.assert_close(_full(a), _full(b), msg=name)
        assert getattr(a, "_local_tensor", a).device.type == ("cpu" if offload else "cuda")
    assert _train(restored, restored_optim) == pytest.approx(_train(model, optim), rel=1e-6)
