"""Public enums and configuration dataclasses (no behaviour lives here)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["MixedPrecisionPolicy", "OffloadPolicy", "CPUOffloadPolicy"]


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
