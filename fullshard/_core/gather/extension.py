"""Parameters whose all-gather is not their shard's elements.

[Note: Gather extensions]
A plain parameter's shard lives in the unit's shard buffer and is gathered
as is (see [Note: Unit buffers]). A parameter with a ``GatherExtension``
decides itself what it sends and how the full parameter is rebuilt:
  1. ``inputs(shard, mp_policy)``: the 1D tensors this rank contributes (any dtypes);
     the unit packs them, as bytes, behind its plain shards, so a unit still
     costs ONE all-gather;
  2. ``outputs(num_chunks, device)``: where the copy-out puts each gathered
     input (``num_chunks`` blocks, rank-major), allocated once and refilled;
  3. ``rebuild(param_dtype, out)``: the unsharded tensor from those outputs,
     or None after refreshing ``out`` (the previous step's tensor) in place;
  4. ``free()``: drops the outputs' storage when the unit reshards.
The gather is in bytes (``uint8``) whenever an extension takes part: the bytes
are the same, and backends that lack a dtype (gloo has no float8) carry them.

``TensorHooks`` is the extension of a tensor subclass that defines
``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` (torchao's NF4 and
float8 weights, ...). Such a parameter keeps its own sharded subclass tensor,
split on dim 0 with the operations the subclass supports (``chunk``,
``new_zeros``, ``copy_``), never in the flat buffer: its elements may not
be plain numbers at all (packed 4-bit data and scales). Its gradient, a plain
tensor, is reduced like any other. A subclass without the hooks has no way to
say what its shard's bytes are, so its first all-gather refuses it with the
parameter's name; the hooks are looked up at each gather, so a class patched
with them after sharding (torch's tests do this) gathers with them. A plain
parameter whose local shard gets the hooks after sharding (patched on that
tensor object after ``to_empty``, as torch's tests also do) is found at the
root's lazy init, where torch's FSDP2 looks too: it leaves the unit's buffer
for storage of its own and gathers through them from then on
(``UnitBuffers.adopt_gather_hooks``).
"""

from __future__ import annotations

import inspect
from typing import Any, Protocol

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh

from ...api import MixedPrecisionPolicy
from ..mesh import MeshInfo


class GatherExtension(Protocol):
    """See [Note: Gather extensions]."""

    def inputs(self, shard: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> list[torch.Tensor]: ...

    def outputs(self, num_chunks: int, device: torch.device) -> list[torch.Tensor]: ...

    def rebuild(self, param_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None: ...

    def free(self) -> None: ...


def has_gather_hooks(tensor: torch.Tensor) -> bool:
    return callable(getattr(tensor, "fsdp_pre_all_gather", None)) and callable(
        getattr(tensor, "fsdp_post_all_gather", None)
    )


def _no_hooks_error(kind: str, fqn: str, api: str) -> NotImplementedError:
    return NotImplementedError(
        f"{api} does not support the tensor subclass {kind} of parameter {fqn} yet: it defines no "
        "fsdp_pre_all_gather / fsdp_post_all_gather, so its shard has no defined wire format; define both "
        "methods on the subclass (before the first forward) or pass a plain tensor"
    )


def shard_subclass(full: torch.Tensor, world: int, rank: int, fqn: str, api: str) -> torch.Tensor:
    """This rank's dim-0 chunk of a tensor subclass, copied into storage of its
    own so that the full tensor can be freed. The copy has the first (padded)
    chunk's size; a shorter last chunk is returned as its leading rows."""
    kind = type(full).__name__
    try:
        chunks = list(torch.chunk(full, world, dim=0))
        padded = chunks[0].new_zeros(chunks[0].size())
        if rank < len(chunks) and chunks[rank].numel() > 0:
            mine = chunks[rank]
            target = padded if mine.size(0) == padded.size(0) else padded.narrow(0, 0, mine.size(0))
            target.copy_(mine)
            return padded if target is padded else target
        return padded.narrow(0, 0, 0)
    except (NotImplementedError, RuntimeError, AssertionError) as exc:
        if not has_gather_hooks(full):  # what the user can fix first
            raise _no_hooks_error(kind, fqn, api) from exc
        raise NotImplementedError(
            f"{api} cannot shard parameter {fqn}: its tensor subclass {kind} does not support splitting "
            f"dim 0 into {world} chunks of equal size ({type(exc).__name__}: {exc}); choose a dim-0 size that "
            f"the subclass splits evenly {world} ways (NF4: a multiple of {world} x its block sizes)"
        ) from exc


def shard_mesh(mesh_info: MeshInfo) -> DeviceMesh:
    """The 1D mesh of the shard axis, which the hooks receive."""
    mesh, axis = mesh_info.mesh, mesh_info.shard_axis
    if mesh.ndim == 1 or axis is None:
        return mesh
    names = mesh.mesh_dim_names
    if names is None:
        raise NotImplementedError("tensor-subclass parameters on a 2D mesh need mesh_dim_names (init_device_mesh)")
    return mesh[names[axis]]


class TensorHooks:
    """The ``fsdp_pre_all_gather`` / ``fsdp_post_all_gather`` methods of a
    parameter's tensor subclass (both signatures of the pre-hook: ``(mesh)``
    and ``(mesh, outer_size, outer_stride, module, mp_policy)``).

    Args:
        fqn: the parameter's name, for messages.
        module: the module that owns the parameter (passed to the pre-hook).
        mesh_info: the unit's data-parallel mesh.
        unsharded_size: the full parameter's size.
        padded_rows: rows of a full (padded) shard; every rank must send that many.
        api: the front end the user called, which messages name.
    """

    def __init__(
        self,
        fqn: str,
        module: nn.Module,
        mesh_info: MeshInfo,
        unsharded_size: torch.Size,
        padded_rows: int,
        api: str,
    ) -> None:
        self.fqn = fqn
        self.api = api
        self.module = module
        self.mesh = shard_mesh(mesh_info)
        self.unsharded_size = unsharded_size
        self.padded_rows = padded_rows
        self._metadata: Any = None  # the pre-hook's, for the matching post-hook
        self._input_sizes: list[torch.Size] = []
        self._outputs: list[torch.Tensor] = []  # 1D, num_chunks * input numel each
        self._inner: list[torch.Tensor] = []  # tensors the post-hook built on, freed with the outputs
        self._input_dtypes: list[torch.dtype] = []
        self._post_hook: Any = None  # the sharded tensor's fsdp_post_all_gather
        self._new_outputs = True  # outputs (re)allocated since the last rebuild: no tensor to refresh

    def inputs(self, shard: torch.Tensor, mp_policy: MixedPrecisionPolicy) -> list[torch.Tensor]:
        """The pre-hook's tensors, flattened. The hooks are looked up now, at every gather, so a class
        given them after ``fully_shard`` (patched on) gathers with them (as torch's FSDP2 does)."""
        if not has_gather_hooks(shard):
            raise _no_hooks_error(type(shard).__name__, self.fqn, self.api)
        pre_hook = shard.fsdp_pre_all_gather  # type: ignore[attr-defined]
        num_args = len(inspect.signature(pre_hook).parameters)
        if num_args == 1:
            inputs, self._metadata = pre_hook(self.mesh)
        elif num_args == 5:
            stride = torch.empty(self.unsharded_size, device="meta").stride()
            inputs, self._metadata = pre_hook(self.mesh, self.unsharded_size, stride, self.module, mp_policy)
        else:
            raise TypeError(
                f"{self.api} expects {type(shard).__name__}.fsdp_pre_all_gather (parameter {self.fqn}) to take "
                "(mesh) or (mesh, outer_size, outer_stride, module, mp_policy) but got "
                f"{inspect.signature(pre_hook)}"
            )
        if shard.size(0) != self.padded_rows and any(t.size(0) != self.padded_rows for t in inputs):
            raise ValueError(
                f"fsdp_pre_all_gather of {self.fqn} must return inputs padded to {self.padded_rows} rows (every "
                f"rank sends the same sizes) but got {[tuple(t.size()) for t in inputs]}"
            )
        self._input_sizes, self._input_dtypes = [t.size() for t in inputs], [t.dtype for t in inputs]
        self._post_hook = shard.fsdp_post_all_gather  # type: ignore[attr-defined]
        return [t.reshape(-1) for t in inputs]

    def outputs(self, num_chunks: int, device: torch.device) -> list[torch.Tensor]:
        wanted = [(size.numel() * num_chunks, dtype) for size, dtype in zip(self._input_sizes, self._input_dtypes)]
        if [(t.numel(), t.dtype) for t in self._outputs] != wanted or any(t.device != device for t in self._outputs):
            self._outputs = [torch.empty(numel, dtype=dtype, device=device) for numel, dtype in wanted]
            self._inner = []
            self._new_outputs = True
        for tensor in self._outputs:
            _allocate(tensor)
        return self._outputs

    def rebuild(self, param_dtype: torch.dtype, out: torch.Tensor | None) -> torch.Tensor | None:
        """The post-hook: a new unsharded tensor, or None after refreshing ``out``."""
        gathered = tuple(t.view(-1, *size[1:]) for t, size in zip(self._outputs, self._input_sizes))
        post_hook, metadata, self._metadata = self._post_hook, self._metadata, None
        if out is not None and not self._new_outputs:
            for tensor in self._inner:
                _allocate(tensor)
            post_hook(gathered, metadata, param_dtype, out=out)
            return None
        unsharded, inner = post_hook(gathered, metadata, param_dtype)
        self._inner, self._new_outputs = list(inner), False
        return unsharded

    def free(self) -> None:
        for tensor in [*self._outputs, *self._inner]:
            storage = tensor.untyped_storage()
            if storage.size() != 0:
                storage.resize_(0)


def _allocate(tensor: torch.Tensor) -> None:
    """Gives a freed tensor its storage back (same storage object: views stay valid)."""
    storage = tensor.untyped_storage()
    needed = int((tensor.storage_offset() + tensor.numel()) * tensor.element_size())
    if storage.size() < needed:
        storage.resize_(needed)
