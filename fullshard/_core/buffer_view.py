"""The hook a front end installs when one object stands for a unit's whole shard buffer.

The FSDP1 wrapper's ``use_orig_params=False`` registers the buffer itself as
one flat ``nn.Parameter`` (``fullshard/_flat_param.py``). The engine knows it
only through this protocol: what it must keep in step with that object.
"""

from __future__ import annotations

from typing import Protocol

import torch


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
