"""Kernel workspaces on the CPU: what an operator allocates inside itself, measured once per shape.

[Note: Kernel workspaces]
A traced operator shows its outputs, not the scratch its kernel takes while it
runs. On the CPU, oneDNN's convolutions reorder their inputs and weights into
blocked layouts (up to a few times the input), and its bf16/fp16 matmuls pack
their operands (some KiB each): enough to move a small model's peak by 15%.
No formula covers the kernels' choices, so for those operators (and only on a
CPU device) the probe runs the operator once for real at the traced shapes,
outside the fake mode, with random values, and keeps the bytes its allocation
events rose above its outputs; the trace holds that much for the length of
the call. Shapes repeat across blocks, so each is measured once. This
allocates one operator's inputs and outputs, not the model's. On CUDA the
workspaces (cuBLAS's, cuDNN's) are not probed: this machine runs no CUDA
kernel, and ``fullshard plan`` says so (see [Note: Plan model]).
"""

from __future__ import annotations

from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.utils._pytree import tree_flatten, tree_map_only

from ..training.tensor_peak import TensorPeak

__all__ = ["WorkspaceProbe"]

_aten = torch.ops.aten
_CONVOLUTIONS = {_aten.convolution.default, _aten.convolution_backward.default}
_MATMULS = {_aten.mm.default, _aten.addmm.default, _aten.bmm.default, _aten.baddbmm.default}


def _real(value: torch.Tensor) -> torch.Tensor:
    if value.is_floating_point():
        return torch.randn(value.shape, dtype=value.dtype).as_strided(value.shape, value.stride())
    return torch.zeros(value.shape, dtype=value.dtype)


class WorkspaceProbe:
    """Bytes of scratch an operator takes on this CPU (see [Note: Kernel workspaces])."""

    def __init__(self) -> None:
        self.cache: dict[tuple, int] = {}

    def wants(self, func: Any, args: Any) -> bool:
        if func in _CONVOLUTIONS:
            return True
        if func in _MATMULS:
            return any(isinstance(a, torch.Tensor) and a.dtype in (torch.bfloat16, torch.float16) for a in args)
        return False

    def bytes(self, func: Any, args: Any, kwargs: dict) -> int:
        tensors = [t for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)]
        key = (
            func,
            tuple((tuple(t.shape), tuple(t.stride()), t.dtype) for t in tensors),
            repr(tree_map_only(torch.Tensor, lambda t: None, (args, kwargs))),
        )
        if key not in self.cache:
            self.cache[key] = self._measure(func, args, kwargs)
        return self.cache[key]

    def _measure(self, func: Any, args: Any, kwargs: dict) -> int:
        with unset_fake_temporarily():
            real_args, real_kwargs = tree_map_only(torch.Tensor, _real, (args, kwargs))
            func(*real_args, **real_kwargs)  # first calls may set up (oneDNN's primitive cache)
            with TensorPeak() as peak:
                out = func(*real_args, **real_kwargs)
            outputs = {
                t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                for t in tree_flatten(out)[0]
                if isinstance(t, torch.Tensor)
            }
            return max(0, peak.rise - sum(outputs.values()))
