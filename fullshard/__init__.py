"""fullshard: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch.

The public names mirror PyTorch's own FSDP package: switching is a change of
imports.
"""

# First, before torch: a Ctrl-C while the fullshard command starts exits without a traceback
# (fullshard/cli/startup.py; a program that imports fullshard is left alone).
from .cli import startup as _startup  # noqa: F401 (imported for its effect)

# isort: split
from ._core.mesh import hybrid_mesh
from .all_gather_buckets import set_all_gather_bucket_size
from .all_gather_quantization import set_all_gather_quantization
from .api import (
    AllGatherQuantization,
    BackwardPrefetch,
    CPUOffload,
    CPUOffloadPolicy,
    DataParallelMeshDims,
    FullOptimStateDictConfig,
    FullStateDictConfig,
    LocalOptimStateDictConfig,
    LocalStateDictConfig,
    MixedPrecision,
    MixedPrecisionPolicy,
    OffloadPolicy,
    OptimStateDictConfig,
    OptimStateKeyType,
    ShardedOptimStateDictConfig,
    ShardedStateDictConfig,
    ShardingStrategy,
    StateDictConfig,
    StateDictSettings,
    StateDictType,
)
from .clip import clip_grad_norm_
from .fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method, share_comm_ctx
from .grad_scaler import ShardedGradScaler
from .replicate import ReplicateModule, replicate
from .state_dict import full_state_dict
from .torch_names import restore_torch_names, use_in_place_of_torch
from .wrapper import FSDP, FullyShardedDataParallel

__all__ = [
    "AllGatherQuantization",
    "BackwardPrefetch",
    "CPUOffload",
    "CPUOffloadPolicy",
    "DataParallelMeshDims",
    "FSDP",
    "FSDPModule",
    "FullOptimStateDictConfig",
    "FullStateDictConfig",
    "FullyShardedDataParallel",
    "LocalOptimStateDictConfig",
    "LocalStateDictConfig",
    "MixedPrecision",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "OptimStateDictConfig",
    "OptimStateKeyType",
    "ReplicateModule",
    "ShardedGradScaler",
    "ShardedOptimStateDictConfig",
    "ShardedStateDictConfig",
    "ShardingStrategy",
    "StateDictConfig",
    "StateDictSettings",
    "StateDictType",
    "UnshardHandle",
    "clip_grad_norm_",
    "full_state_dict",
    "fully_shard",
    "hybrid_mesh",
    "register_fsdp_forward_method",
    "replicate",
    "restore_torch_names",
    "set_all_gather_bucket_size",
    "set_all_gather_quantization",
    "share_comm_ctx",
    "use_in_place_of_torch",
]

for _name in __all__:
    if _name != "FSDP":  # an alias
        globals()[_name].__module__ = "fullshard"
del _name
