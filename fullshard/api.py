"""Public enums and configuration dataclasses (no behaviour lives here)."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn

__all__ = [
    "AllGatherQuantization",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "keeps_exact_by_default",
]


class ShardingStrategy(enum.Enum):
    """How the FSDP1-style wrapper (and ``fully_shard(strategy=...)``) shards a unit."""

    FULL_SHARD = enum.auto()  # shard; free after forward (ZeRO-3)
    SHARD_GRAD_OP = enum.auto()  # shard; keep after forward (ZeRO-2)
    NO_SHARD = enum.auto()  # replicate; all-reduce gradients (DDP)
    HYBRID_SHARD = enum.auto()  # FULL_SHARD within a node, replicate across nodes
    _HYBRID_SHARD_ZERO2 = enum.auto()  # SHARD_GRAD_OP within a node, replicate across nodes


HYBRID_STRATEGIES = (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2)


class BackwardPrefetch(enum.Enum):
    """When the wrapper gathers the next unit in backward."""

    BACKWARD_PRE = enum.auto()  # when the current unit's backward starts (more overlap, more memory)
    BACKWARD_POST = enum.auto()  # once the current unit's gradients are reduced


@dataclass(frozen=True)
class MixedPrecision:
    """FSDP1-style mixed precision for ``FullyShardedDataParallel``.

    Attributes:
        param_dtype: dtype of the gathered parameters (forward/backward compute).
        reduce_dtype: dtype of the gradient reduction (default: ``param_dtype``).
        buffer_dtype: dtype buffers are cast to for compute (state dicts keep
            the original dtype).
        keep_low_precision_grads: leave the reduced gradients in the reduce
            dtype instead of casting them back to the parameters' dtype.
        cast_forward_inputs: cast every wrapped module's floating-point inputs
            to ``param_dtype``.
        cast_root_forward_inputs: cast the root's floating-point inputs to
            ``param_dtype`` (whatever ``cast_forward_inputs`` says).
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    buffer_dtype: torch.dtype | None = None
    keep_low_precision_grads: bool = False
    cast_forward_inputs: bool = False
    cast_root_forward_inputs: bool = True


@dataclass(frozen=True)
class CPUOffload:
    """FSDP1-style offload: ``offload_params=True`` keeps shards and gradients on the CPU."""

    offload_params: bool = False


@dataclass(frozen=True)
class MixedPrecisionPolicy:
    """Module-level mixed precision for ``fully_shard``.

    The sharded parameters keep their original dtype (the optimizer steps in
    it); only the unsharded copy that forward/backward compute with is cast.

    Attributes:
        param_dtype: dtype of the unsharded parameters, hence of the all-gather
            and of forward/backward compute. ``None`` keeps the original dtype.
        reduce_dtype: dtype of the gradient reduction. ``None`` means
            ``param_dtype`` (or the original dtype when that is ``None`` too).
            While gradient sync is off, gradients accumulate in this dtype.
        output_dtype: if set, floating-point forward outputs are cast to it.
        cast_forward_inputs: cast floating-point forward inputs to
            ``param_dtype`` before the module runs.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    output_dtype: torch.dtype | None = None
    cast_forward_inputs: bool = True


@dataclass
class DataParallelMeshDims:
    """Names the data-parallel dims of a whole SPMD mesh given to
    ``fully_shard(mesh, dp_mesh_dims=...)``; the mesh's other dims are left alone.

    Attributes:
        shard: the dim (or dims, flattened into one) the parameters are sharded over.
        replicate: the dim (or dims, flattened into one) they are replicated over
            (HSDP with ``shard``; data parallel without sharding alone).
    """

    shard: str | tuple[str, ...] | None = None
    replicate: str | tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.shard is None and self.replicate is None:
            raise ValueError("DataParallelMeshDims expects shard or replicate (or both) but got neither")

    @property
    def shard_names(self) -> tuple[str, ...]:
        return _names(self.shard)

    @property
    def replicate_names(self) -> tuple[str, ...]:
        return _names(self.replicate)


def _names(dims: str | tuple[str, ...] | None) -> tuple[str, ...]:
    if dims is None:
        return ()
    return (dims,) if isinstance(dims, str) else tuple(dims)


@dataclass
class OffloadPolicy:
    """No offloading: sharded parameters and gradients live on the mesh's device."""


@dataclass
class CPUOffloadPolicy(OffloadPolicy):
    """Sharded parameters, gradients and so optimizer states live on the CPU.

    Each unit's shards are copied to the device for the all-gather, and its
    reduced gradient shard is copied back to the CPU, where the optimizer steps.

    Attributes:
        pin_memory: pin the CPU shards (faster, asynchronous host-device copies).
            Ignored when no accelerator is present.
    """

    pin_memory: bool = True


class StateDictType(enum.Enum):
    """What ``state_dict()`` returns for a sharded model (and its optimizer)."""

    FULL_STATE_DICT = enum.auto()  # full tensors, keyed like the unsharded model
    LOCAL_STATE_DICT = enum.auto()  # the wrapper's flat local shards, as they are
    SHARDED_STATE_DICT = enum.auto()  # one DTensor per parameter, keyed like the unsharded model


class OptimStateKeyType(enum.Enum):
    """How an optimizer state dict's ``state`` is keyed (see ``FSDP.rekey_optim_state_dict``)."""

    PARAM_NAME = enum.auto()  # parameter FQNs, portable across wrappings
    PARAM_ID = enum.auto()  # ints, as ``optim.state_dict()`` keys them


@dataclass
class StateDictConfig:
    """``offload_to_cpu``: hand out CPU tensors."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only rank 0 keeps the full tensors (others get an empty dict)."""

    rank0_only: bool = False


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    pass


@dataclass
class LocalStateDictConfig(StateDictConfig):
    pass


@dataclass
class OptimStateDictConfig:
    """``offload_to_cpu``: hand out CPU tensors (the default for optimizer states, as in torch)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    rank0_only: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    pass


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    offload_to_cpu: bool = False


@dataclass
class StateDictSettings:
    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


def keeps_exact_by_default(module: nn.Module, name: str, param: nn.Parameter) -> bool:
    """Norm weights, biases (anything under 2 dims) and embeddings are gathered exact:
    they are small, and their errors do not average out over a matrix product."""
    return param.dim() < 2 or isinstance(module, nn.Embedding)


@dataclass(frozen=True)
class AllGatherQuantization:
    """fullshard's addition (torch has no counterpart): gather weights as 1-byte
    block-wise codes, about half the bytes of bf16 (ZeRO++'s quantized weights).
    Set with ``fullshard.set_all_gather_quantization``; master weights, optimizer
    states and gradients are untouched, and the reduce-scatter keeps ``reduce_dtype``.

    Attributes:
        dtype: the code, ``torch.int8`` or ``torch.float8_e4m3fn``.
        block_size: values per fp32 scale (a multiple of 4); smaller blocks are
            more exact and send more scales (``4 / block_size`` bytes a value).
        keep_exact: ``(module, name, param) -> bool``, True for a parameter to
            gather exact; ``module`` is the one that registers it as ``name``
            (any of them for a shared parameter); ``param`` has the parameter's
            own shape (under the FSDP1 wrapper, whose shards are 1D, a meta-device
            stand-in of that shape).
    """

    dtype: torch.dtype = torch.int8
    block_size: int = 128
    keep_exact: Callable[[nn.Module, str, nn.Parameter], bool] = keeps_exact_by_default
