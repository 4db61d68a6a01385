"""What a unit is, fixed when it is made: its parameters, mesh, devices, dtypes
and names (see [Note: Unit spec]).

[Note: Unit spec]
``manage_module`` builds one frozen ``UnitSpec`` per unit. Everything that
works on a unit's data (the all-gather, gradient intake, the shard buffer,
full-parameter I/O, logging) reads the spec and the buffers, not the unit:
the unit (``unit/group.py``) keeps only its lifecycle state (sharded or
not, where it is in the step, run-time settings). The one thing learnt later
is the name: the root's lazy init knows the module's path in the model and
replaces the spec with a named copy (``ParamGroup.set_names``; readers holding
the old one are told).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...api import MixedPrecisionPolicy
from ..layout import ShardLayout
from ..mesh import MeshInfo
from ..presentation import DTensorShards
from .param import ShardParam


@dataclass(frozen=True, slots=True)
class UnitSpec:
    """One unit's fixed description (see [Note: Unit spec])."""

    params: list[ShardParam]  # in the shard buffer's order
    mesh_info: MeshInfo
    device: torch.device  # where compute and communication happen
    offload: bool  # shards and sharded gradients live in host memory (CPUOffloadPolicy)
    storage_device: torch.device  # where the shards and sharded gradients live: the host when offloaded
    pin_memory: bool  # offloaded to pinned memory: copies to an accelerator are asynchronous
    mp_policy: MixedPrecisionPolicy
    presentation: DTensorShards  # how the shards are shown (see [Note: Presentations])
    keep_low_precision_grads: bool  # reduced gradients stay in the reduce dtype
    # How the parameters are cut into shards: rows, or FSDP1's flat pieces (see [Note: Flat layout]).
    shard_layout: ShardLayout
    # The unit's name in messages: its module's path in the model once the root's lazy init
    # ran, else (and for the root, whose path is "") the module's class name.
    name: str
    label: str  # its name in profiler labels: the module's path, or trace.ROOT (see [Note: Profiler labels])
