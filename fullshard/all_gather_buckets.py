"""``set_all_gather_bucket_size``: small units' prefetched all-gathers as one collective.

fullshard's addition (torch's FSDP issues one all-gather per unit): see
[Note: Gather buckets] in ``_core/gather/all_gather.py``.
"""

from __future__ import annotations

import torch.nn as nn

from ._core.manage import states_below
from ._core.settings import DEFAULT_ALL_GATHER_BUCKET_BYTES

__all__ = ["DEFAULT_ALL_GATHER_BUCKET_BYTES", "set_all_gather_bucket_size"]


def set_all_gather_bucket_size(module: nn.Module, nbytes: int) -> None:
    """Lets every unit in ``module`` (``fully_shard`` units or ``FullyShardedDataParallel``
    instances, ``module`` included) share a prefetched all-gather with the units that follow
    it, up to ``nbytes`` gathered in one collective; 0 gathers every unit alone, as torch's
    FSDP does.

    A bucket counts the bytes of the gathered (padded) parameters in the gather dtype, so a
    unit larger than ``nbytes`` always gathers alone. The default,
    ``DEFAULT_ALL_GATHER_BUCKET_BYTES`` (1 MiB), buckets small units (a ``Linear(64, 64)``)
    and leaves transformer blocks of a few MiB alone. Takes effect from the next prefetch.

    Raises:
        ValueError: ``module`` holds no unit, or ``nbytes`` is negative.
    """
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ValueError(f"set_all_gather_bucket_size expects a byte count >= 0 (0: off) but got {nbytes!r}")
    states = states_below(module)
    if not states:
        raise ValueError(
            "set_all_gather_bucket_size expects a module sharded by fully_shard or FullyShardedDataParallel "
            f"but got {type(module).__name__}, which holds no unit; shard it first"
        )
    for state in states:
        if state.group is not None:
            state.group.settings.all_gather_bucket_bytes = nbytes
