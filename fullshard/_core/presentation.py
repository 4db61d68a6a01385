"""How a unit shows a sharded parameter to the user (module attribute, ``.grad``,
optimizer), and the hook a front end installs when one object stands for a
unit's whole shard buffer (``BufferView``): the engine's two plug-in points for
front ends.

[Note: Presentations]
The engine keeps this rank's rows of every parameter in the unit's shard
buffer (see [Note: Unit buffers]); a presentation decides what object stands
for those rows outside forward and backward:
  - ``DTensorShards`` (``fully_shard``): a new ``nn.Parameter`` wrapping a
    DTensor (``Shard(0)``, ...) whose local tensor is the rows.
  - ``LocalViews`` (the FSDP1 wrapper's ``use_orig_params=True``): the user's
    own ``nn.Parameter`` object, its ``.data`` a plain view of the rows:
    flattened to 1D, as FSDP1 shows a parameter's part of the unit's flat
    shard, or in the parameter's shape when nothing is sharded (NO_SHARD).
    The object never changes, so optimizers built before wrapping, parameter
    groups and ``requires_grad_`` keep working; its ``.grad`` has its shape.
Both present gradients and optimizer states the same way as the parameter,
and both convert to and from DTensors, the layout-carrying form that state
dicts and resharding use.

[Note: Buffer views]
The FSDP1 wrapper's ``use_orig_params=False`` registers the buffer itself as
one flat ``nn.Parameter`` (``fullshard/_flat_param.py``). The engine knows it
only through the ``BufferView`` protocol: what it must keep in step with that object.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
from torch.distributed.tensor import DTensor


class PresentedParam(Protocol):
    """What a presentation reads of the parameter it presents (``param.ShardParam``)."""

    @property
    def num_valid_rows(self) -> int: ...

    def chunk_size(self, num_rows: int) -> torch.Size: ...

    def dtensor_from_rows(self, local: torch.Tensor) -> DTensor: ...


class DTensorShards:
    """See [Note: Presentations]."""

    keeps_user_param = False  # a new Parameter stands for the shard
    # Whether a unit kept unsharded after a no-grad forward shows its shards
    # again (FSDP1 does; FSDP2 keeps the full parameters registered).
    sharded_after_no_grad_forward = False
    # Whether resharding raises when the user gave a gathered parameter's ``.data`` a tensor of its own,
    # whose values cannot reach the shards (FSDP1 raises; FSDP2 drops the assignment, and so do we).
    refuses_unsharded_data_assignment = False
    refusal: type[Exception] = RuntimeError  # what that refusal raises, and the setting its message names
    refusal_setting = ""

    def present(self, param: PresentedParam, rows: torch.Tensor) -> torch.Tensor:
        """``rows`` (this rank's unpadded rows of ``param``) in the presented form."""
        return param.dtensor_from_rows(rows)

    def rows_from_presented(self, param: PresentedParam, presented: torch.Tensor) -> torch.Tensor:
        """The inverse of ``present``: the rows behind a presented tensor."""
        return presented._local_tensor if isinstance(presented, DTensor) else presented

    def rebind(self, sharded: nn.Parameter, presented: torch.Tensor) -> None:
        """Points the existing sharded parameter at new rows."""
        if not isinstance(sharded, DTensor) or not isinstance(presented, DTensor):
            raise AssertionError(f"DTensor shards rebind DTensors, not {type(sharded)} to {type(presented)}")
        sharded._local_tensor = presented._local_tensor


class LocalViews(DTensorShards):
    """See [Note: Presentations].

    Args:
        flatten: show 1D views (sharded strategies) rather than the parameter's
            shape (NO_SHARD, where the rows are the whole parameter).
        refusal, refusal_setting: the exception type of an unsharded ``.data`` assignment
            and the setting its message names (the front end's, as its users know them).
    """

    keeps_user_param = True
    sharded_after_no_grad_forward = True
    refuses_unsharded_data_assignment = True

    def __init__(self, flatten: bool, refusal: type[Exception] = RuntimeError, refusal_setting: str = "") -> None:
        self.flatten = flatten
        self.refusal, self.refusal_setting = refusal, refusal_setting

    def present(self, param: PresentedParam, rows: torch.Tensor) -> torch.Tensor:
        return rows.reshape(-1) if self.flatten else rows

    def rows_from_presented(self, param: PresentedParam, presented: torch.Tensor) -> torch.Tensor:
        if isinstance(presented, DTensor):
            return presented._local_tensor
        return presented.view(param.chunk_size(param.num_valid_rows))

    def rebind(self, sharded: nn.Parameter, presented: torch.Tensor) -> None:
        sharded.data = presented


DTENSOR_SHARDS = DTensorShards()


class BufferView(Protocol):
    @property
    def tensor(self) -> torch.Tensor:
        """The registered object: it shares the shard buffer's storage (``nn.Module._apply``
        may give it new storage, which the unit then adopts), and its ``.grad``
        receives the unit's reduced gradients in the buffer's layout."""
        ...

    def sync_requires_grad(self) -> None:
        """Called before the unsharded parameters are registered: ``requires_grad_`` on
        the object (un)freezes the parameters it stands for."""
        ...

    def hide(self) -> None:
        """Unregisters the object while the full parameters stand in for it."""
        ...

    def show(self) -> None:
        """Registers it again."""
        ...
