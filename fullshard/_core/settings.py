"""What a front end decides about a unit: ``UnitConfig`` once, when the unit is
made, and ``UnitSettings`` between steps (what ``FSDPModule``'s setters and the
wrapper's ``no_sync`` and ``register_comm_hook`` change). The unit owns one
``UnitSettings``; its gradient intake reads ``reduce`` (``ReduceSettings``).

Data only: the rules that read these fields live where they apply (the unit,
the root's lazy init, the reduction), so a step reads settings as plain
attributes and never calls in here.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn as nn

from ..api import BackwardPrefetch, MixedPrecisionPolicy, OffloadPolicy
from .comm import PLAIN_GATHER_WIRE, PLAIN_SCATTER_WIRE, GatherWire, GroupInfo, ScatterWire
from .presentation import DTensorShards

# Units of at most this many gathered bytes are bucketed by default (see [Note: Gather buckets]); the bench GPT's
# 3.4 MiB blocks are not, 128 units of Linear(64, 64) are (benchmarks/RESULTS.md, issue 24).
DEFAULT_ALL_GATHER_BUCKET_BYTES = 1024 * 1024


@dataclass(frozen=True, kw_only=True)
class UnitConfig:
    """Everything a front end decides about one unit; the engine reads only this."""

    api_name: str = "fully_shard"  # the call the user made, for messages: "<api_name> expects ..."
    ignore_argument: str = "ignored_params"  # that call's argument leaving a parameter unsharded, for messages
    # A name from a walk of the module tree as the user's model names it (a wrapper
    # drops the segments it inserts); ``str``: the name as it is.
    name_in_model: Callable[[str], str] = str
    reshard_after_forward: bool | int | None = None  # None: True except for the root
    mp_policy: MixedPrecisionPolicy = field(default_factory=MixedPrecisionPolicy)
    offload_policy: OffloadPolicy = field(default_factory=OffloadPolicy)
    forward_prefetch: bool = True  # gather the next unit (previous step's order) while this one runs
    backward_prefetch: BackwardPrefetch | None = BackwardPrefetch.BACKWARD_PRE
    cast_root_inputs: bool = False  # cast the root's inputs even without mp_policy.cast_forward_inputs
    keep_low_precision_grads: bool = False  # leave reduced gradients in the reduce dtype
    buffer_dtype: torch.dtype | None = None  # cast managed buffers for compute
    full_precision_in_eval: bool = False  # eval-mode forwards gather and compute in the parameters' dtype
    sync_module_states: bool = False  # broadcast the first rank's parameters and buffers first
    shard_placement_fn: Callable[[nn.Parameter], Any] | None = None  # param -> Shard(dim) | None (dim 0)
    presentation: DTensorShards | None = None  # how shards are shown (None: DTensors); see [Note: Presentations]
    flat_layout: bool = False  # FSDP1's flat parameter layout (see [Note: Flat layout] in layout.py)
    # As a root, adopt units another root adopted before (FSDP1: wrapping a trained model's inner
    # module again, for inference); FSDP2 refuses any unit lazily initialized before.
    adopts_used_units: bool = False


@dataclass
class ReduceSettings:
    """How a unit reduces its gradients; changed at run time through ``FSDPModule``
    (and the wrapper's ``register_comm_hook``)."""

    divide_factor: float | None = None  # None: average over the ranks
    all_reduce: bool = True  # HSDP: False stops after the reduce-scatter (a partial result)
    comm_hook: tuple[Callable[..., None], Any] | None = None  # (hook, state): communicates instead
    post_reduce_hook: Callable[[torch.Tensor], None] | None = None  # sees each final reduced shard
    sum_only: bool = False  # average with SUM and divisions, never ReduceOp.AVG
    # Zero gradients for trainable parameters this rank's backward did not reach, so that
    # every rank reduces the same parameters (conditional use: mixture of experts).
    include_unused: bool = False
    # The shard ranks' own group for reduce-scatters (set_separate_reduce_scatter_group),
    # so they need not queue behind all-gathers on one communicator; None: the mesh's.
    scatter_group: GroupInfo | None = None
    # What allocates the reduce-scatter's input and output and runs it: the engine's own, or the
    # user's object (FSDPModule.set_custom_reduce_scatter); see [Note: Wires] in comm.py.
    reduce_scatter: ScatterWire = PLAIN_SCATTER_WIRE


@dataclass(slots=True)
class UnitSettings:
    """One unit's settings; the unit reads them when it reaches the step they govern."""

    reshard_after_forward: bool
    post_forward_group: GroupInfo | None = None  # reshard to this smaller group (an int reshard_after_forward)
    reshard_after_forward_chosen: bool = False  # the user set it: the root keeps it too
    reshard_after_backward: bool = True
    requires_gradient_sync: bool = True
    unshard_in_backward: bool = True  # False: backward needs no parameter values (embeddings)
    reduce: ReduceSettings = field(default_factory=ReduceSettings)
    # Prefetched with the following units in one all-gather up to this many gathered bytes (0: alone);
    # see [Note: Gather buckets].
    all_gather_bucket_bytes: int = DEFAULT_ALL_GATHER_BUCKET_BYTES
    # How the all-gather travels: the engine's own, the user's object (set_custom_all_gather), block-wise
    # codes on either (set_all_gather_quantization); see [Note: Wires] in comm.py.
    gather_wire: GatherWire = PLAIN_GATHER_WIRE
