"""A unit's run-time settings: what ``FSDPModule``'s setters (and the wrapper's
``no_sync`` and ``register_comm_hook``) change between steps. The unit owns one
``UnitSettings``; its gradient intake reads ``reduce``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .bucket import DEFAULT_ALL_GATHER_BUCKET_BYTES
from .mesh import GroupInfo
from .reduction import ReduceSettings


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

    def choose_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """The user's bool: reshard fully or not at all, no smaller post-forward group."""
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_forward_chosen = True
        self.post_forward_group = None

    def keep_unsharded_as_root(self) -> None:
        """Unless the user chose: the root keeps its parameters (backward needs them first)."""
        if not self.reshard_after_forward_chosen:
            self.reshard_after_forward = False
