"""The gather room: a unit's data at rest and on its way to the full parameters.

Each parameter's shard and its views (``param.py``), the unit's spec (``spec.py``:
what the all-gather, gradient intake and full-parameter I/O read), the shard
buffer (``buffers.py``, placed by the ground's ``layout.py``: rows, or FSDP1's
flat pieces), parameters that gather their own
way (``extension.py``), the all-gather's steps and buckets (``all_gather.py``)
and the quantized wire's codec (``codec/``). This face names what the rooms
above may use.
"""

from .all_gather import (
    AllGather,
    AllGatherInFlight,
    BucketKey,
    GatherInput,
    PostForwardShard,
    bucket_key,
    gather_bucket,
    gathered_bytes,
    split_views,
)
from .buffers import UnitBuffers
from .param import ParamModuleInfo, ShardParam, is_tensor_subclass
from .spec import UnitSpec

__all__ = [
    "AllGather",
    "AllGatherInFlight",
    "BucketKey",
    "GatherInput",
    "ParamModuleInfo",
    "PostForwardShard",
    "ShardParam",
    "UnitBuffers",
    "UnitSpec",
    "bucket_key",
    "gather_bucket",
    "gathered_bytes",
    "is_tensor_subclass",
    "split_views",
]
