"""The model of a ``fullshard train`` run: built on the meta device, sharded, then initialised shard by shard.

No rank ever holds the whole model. Each parameter is initialised from its
own generator, seeded by (seed, parameter name): the rank draws the full
tensor of that one parameter and keeps its rows. The values therefore do not
depend on the world size, the strategy or the front end, and
``initialize(plain_model)`` gives a single process the very same model (the
parity reference). The FSDP1 wrapper shards a unit as it wraps it, so there
each unit is materialised and given those values first (``param_init_fn``),
one unit at a time.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, distribute_tensor

from .._core.mesh import default_mesh, hybrid_mesh
from ..all_gather_quantization import set_all_gather_quantization
from ..api import (
    AllGatherQuantization,
    CPUOffload,
    CPUOffloadPolicy,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    ShardingStrategy,
)
from ..fully_shard import fully_shard
from ..models import Transformer, TransformerBlock
from ..wrap import ModuleWrapPolicy
from ..wrapper import FullyShardedDataParallel
from .config import TrainConfig

__all__ = ["build_sharded_model", "initialize"]

_INIT_STD = 0.02  # GPT-2's
_DTYPES = {"none": None, "bf16": torch.bfloat16, "fp16": torch.float16}
_STRATEGIES = {
    "full": ShardingStrategy.FULL_SHARD,
    "grad-op": ShardingStrategy.SHARD_GRAD_OP,
    "no-shard": ShardingStrategy.NO_SHARD,
    "hybrid": ShardingStrategy.HYBRID_SHARD,
}


def _full_value(name: str, shape: torch.Size, seed: int) -> torch.Tensor:
    """GPT-2 initialisation of one parameter: N(0, 0.02) matrices, unit norm scales, zero biases."""
    if len(shape) >= 2:
        generator = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
        return torch.randn(shape, generator=generator) * _INIT_STD
    return torch.ones(shape) if name.endswith("norm.weight") else torch.zeros(shape)


@torch.no_grad()
def initialize(model: nn.Module, seed: int) -> None:
    """Gives every parameter of ``model`` (sharded or not) its deterministic initial value."""
    for name, param in model.named_parameters():
        full = _full_value(name, param.shape, seed)
        if isinstance(param, DTensor):
            mine = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(mine.to_local())
        else:
            param.copy_(full)


def mixed_precision_policy(config: TrainConfig) -> MixedPrecisionPolicy:
    """Compute in the chosen dtype, reduce gradients in fp32."""
    dtype = _DTYPES[config.mixed_precision]
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32 if dtype else None)


def build_sharded_model(config: TrainConfig, device: torch.device) -> nn.Module:
    """The configured Transformer, one unit per block plus the root, initialised on ``device``:
    a ``Transformer`` (``--front-end fully_shard``) or the wrapper around one."""
    with torch.device("meta"):
        model = Transformer(config.model_args())
    hybrid = config.strategy == "hybrid"
    # The loop's device (its backend's), not whatever this process can see.
    mesh = hybrid_mesh(device.type, config.shard_size) if hybrid else default_mesh(device.type, "fully_shard")
    if config.front_end == "wrapper":
        wrapped = _wrap(model, config, device, mesh)
        if config.all_gather_code is not None:
            set_all_gather_quantization(wrapped, AllGatherQuantization(dtype=config.all_gather_code))
        return wrapped
    fully_shard(
        model,
        mesh=mesh,
        strategy=None if hybrid else _STRATEGIES[config.strategy],
        policy=ModuleWrapPolicy({TransformerBlock}),
        mp_policy=mixed_precision_policy(config),
        offload_policy=CPUOffloadPolicy() if config.cpu_offload else OffloadPolicy(),
    )
    if config.all_gather_code is not None:
        set_all_gather_quantization(model, AllGatherQuantization(dtype=config.all_gather_code))
    model.to_empty(device="cpu" if config.cpu_offload else device)
    initialize(model, config.seed)
    return model


def _wrap(model: Transformer, config: TrainConfig, device: torch.device, mesh: DeviceMesh) -> nn.Module:
    """FSDP1's API on ``model``: flat parameters, each unit initialised as the wrapper materialises it."""
    # A tied parameter is one meta tensor under two names: it gets its first name's value
    # (as ``named_parameters`` and ``initialize`` see it) and stays one tensor.
    names = {param: name for name, param in model.named_parameters()}
    made: dict[nn.Parameter, nn.Parameter] = {}

    def materialize(module: nn.Module) -> None:  # the wrapper calls it on each module it manages
        for key, param in module.named_parameters(recurse=False):
            if param not in made:
                value = _full_value(names[param], param.shape, config.seed).to(device)
                made[param] = nn.Parameter(value, requires_grad=param.requires_grad)
            setattr(module, key, made[param])

    compute = _DTYPES[config.mixed_precision]
    return FullyShardedDataParallel(
        model,
        sharding_strategy=_STRATEGIES[config.strategy],
        cpu_offload=CPUOffload(offload_params=config.cpu_offload),
        auto_wrap_policy=ModuleWrapPolicy({TransformerBlock}),
        mixed_precision=MixedPrecision(param_dtype=compute, reduce_dtype=torch.float32 if compute else None),
        param_init_fn=materialize,
        device_id=device,
        device_mesh=mesh,
        use_orig_params=False,
    )
