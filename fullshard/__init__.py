"""fullshard: Fully Sharded Data Parallel (ZeRO-3) training for PyTorch.

The public names mirror ``torch.distributed.fsdp``: switching is a change of
imports.
"""

from .api import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy
from .fully_shard import FSDPModule, UnshardHandle, fully_shard, register_fsdp_forward_method
from .replicate import ReplicateModule, replicate

__all__ = [
    "CPUOffloadPolicy",
    "FSDPModule",
    "MixedPrecisionPolicy",
    "OffloadPolicy",
    "ReplicateModule",
    "UnshardHandle",
    "fully_shard",
    "register_fsdp_forward_method",
    "replicate",
]

for _name in __all__:
    globals()[_name].__module__ = "fullshard"
del _name
