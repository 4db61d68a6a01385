"""A unit's shard buffer: this rank's shards of all its parameters in one flat
tensor, the layouts that place them, and the dtypes they gather and reduce in.
See [Note: Unit buffers] in layout.py.
"""

from __future__ import annotations

import torch
from torch.distributed.tensor import DTensor

from ..presentation import BufferView
from .extension import has_gather_hooks
from .param import ShardParam
from .spec import UnitSpec


class UnitBuffers:
    """Packs and re-packs a unit's shards; ``shard_buffer`` is their home (1D)."""

    def __init__(self, spec: UnitSpec, shards: list[torch.Tensor]) -> None:
        self.params = spec.params
        # The parameters whose all-gather an extension makes (see extension.py).
        self.extended = tuple(p for p in self.params if p.extension is not None)
        self.mp_policy = spec.mp_policy
        self.storage_device = spec.storage_device  # the host under CPU offload
        self.offload = spec.offload
        self.pin_memory = spec.pin_memory  # pinned host memory: copies to an accelerator are asynchronous
        self.shard_layout = spec.shard_layout  # rows, or FSDP1's flat pieces (see [Note: Flat layout])
        # A front end's tensor registered in place of the shards (see ``presentation.BufferView``).
        self.view: BufferView | None = None
        self.build(shards)

    @torch.no_grad()
    def build(self, shards: list[torch.Tensor]) -> None:
        """(Re)packs this rank's shards into one flat buffer."""
        on_meta = any(s.is_meta for s in shards)
        device = torch.device("meta") if on_meta else self.storage_device
        numels = [p.buffer_numel for p in self.params]
        self.storage_layout = self.shard_layout.buffer_layout(numels, [s.dtype for s in shards])
        buffer = torch.zeros(
            self.storage_layout.total,
            dtype=self.storage_layout.dtype,
            device=device,
            pin_memory=self.pin_memory and not on_meta,  # allocated pinned: no second host copy
        )
        for index, (param, shard) in enumerate(zip(self.params, shards)):
            if not on_meta and param.buffer_numel > 0 and shard.numel() > 0:
                region = self.storage_layout.region(buffer, index, shard.dtype)
                region[: shard.numel()].view_as(shard).copy_(shard)
        self._bind(buffer)

    def adopt(self, buffer: torch.Tensor) -> None:
        """Makes ``buffer`` (the storage a buffer view was given by ``nn.Module._apply``)
        the home of the shards; they take its dtype (``model.half()``)."""
        dtypes = [buffer.dtype] * len(self.params)
        self.storage_layout = self.shard_layout.buffer_layout([p.buffer_numel for p in self.params], dtypes)
        self._bind(buffer, dtypes)

    def install_view(self, view: BufferView, owner: str) -> None:
        """A front end registers ``view`` in place of the shards (see ``presentation.BufferView``);
        ``owner`` names the unit in errors."""
        if self.extended:
            raise NotImplementedError(
                f"tensor-subclass parameters ({self.extended[0].fqn} in {owner}) are not yet supported with "
                "use_orig_params=False (one flat parameter cannot hold them); use fully_shard"
            )
        self.view = view
        for param in self.params:
            param.register_sharded = False
            param.to_sharded()

    def unmaterialized(self) -> RuntimeError:
        """What a gather raises while ``shard_buffer`` is on the meta device (a unit asks the
        buffer's ``is_meta`` itself before every gather: no call on the way)."""
        names = [p.fqn for p in self.params]
        return RuntimeError(
            "FSDP parameters should be materialized from meta device before training, "
            f"but the following were still on meta device: {names}\n"
            "For example, call module.to_empty(device=...) and then reset_parameters() "
            "on each module."
        )

    def rebind(self, owner: str) -> None:
        """Re-packs after ``nn.Module._apply`` gave the shards new tensors (``to_empty``, ``.to``);
        ``owner`` names the unit in errors.

        With a buffer view (the wrapper's flat parameter), ``_apply`` moved that
        view itself (the shards are plain attributes it does not visit): adopt
        its new storage.
        """
        for param in self.params:
            registered = param.module_registration()
            if isinstance(registered, DTensor) and registered is not param.sharded_param:  # a Parameter
                param.sharded_param = registered  # _apply replaced rather than swapped
            param.forget_unsharded()
        view = self.view
        if self.offload:
            _check_on_host(view, self.params, owner)
        if view is not None:
            self.adopt(view.tensor.detach())
            for param in self.params:
                param.to_sharded()
        else:
            self.build([p.local_shard for p in self.params])

    def adopt_registered(self, owner: str, whole_only: bool = False) -> None:
        """Takes the parameters now registered on the modules as the shards, when
        the user replaced ours (``load_state_dict(..., assign=True)``, e.g. a meta
        model's parameters assigned piece by piece): their values move into the
        unit's buffer, which they then view. ``whole_only``: not while some are still
        on the meta device (a load of some of them; the rest come later)."""
        registered = [p.module_registration() for p in self.params]
        if whole_only and any(r is not None and r.is_meta for r in registered):
            return
        if self.view is None and any(
            isinstance(r, DTensor) and r is not p.sharded_param for p, r in zip(self.params, registered)
        ):
            self.rebind(owner)

    def adopt_gather_hooks(self, owner: str, reshards_to_smaller_group: bool) -> None:
        """Plain parameters whose local shard was given ``fsdp_pre_all_gather`` /
        ``fsdp_post_all_gather`` after sharding (patched on the tensor, or on its class, after
        ``to_empty``) gather through them from the root's lazy init on, as torch's FSDP2
        looks for them there too; the buffer is re-packed without them (see
        [Note: Gather extensions]). ``owner`` names the unit in errors."""
        if self.view is not None or self.params[0].presentation.keeps_user_param:
            return  # the FSDP1 wrapper's parameters have no gather hooks (nor has torch's FSDP1)
        # The rows the buffer holds (``bound_rows``): the registered shard's local tensor, the object
        # the hooks are patched on (parameters the user replaced were adopted just before).
        found = [p for p in self.params if p.extension is None and p.tp_mesh is None and has_gather_hooks(p.bound_rows)]
        if not found:
            return
        unsupported = (
            "CPU offload"
            if self.offload
            else "an int reshard_after_forward"
            if reshards_to_smaller_group
            else "Shard(dim != 0)"
            if any(p.shard_dim != 0 for p in found)
            else None
        )
        if unsupported:
            raise NotImplementedError(
                f"{unsupported} is not yet supported with parameters that gather through fsdp_pre_all_gather "
                f"({found[0].fqn} in {owner})"
            )
        for param in found:
            param.adopt_gather_hooks()
        self.extended = tuple(p for p in self.params if p.extension is not None)
        self.build([p.local_shard for p in self.params])

    def _bind(self, buffer: torch.Tensor, dtypes: list[torch.dtype] | None = None) -> None:
        """Makes ``buffer`` (storage layout) the home of every parameter's shard,
        each viewed as ``dtypes[i]`` (default: its current dtype)."""
        dtypes = dtypes or [p.local_dtype for p in self.params]
        for index, (param, dtype) in enumerate(zip(self.params, dtypes)):
            if param.extension is None:  # an extension's shard is a tensor of its own
                param.bind_shard(self.storage_layout.region(buffer, index, dtype))
        self.shard_buffer = buffer  # 1D
        self.set_dtypes()

    def set_dtypes(self) -> None:
        """The all-gather layout and the reduce dtype, after the parameters' dtypes changed."""
        self.set_gather_layout()
        self.reduce_dtype = self._pick_reduce_dtype()

    def set_gather_layout(self) -> None:
        """The all-gather input's layout: the storage layout unless parameters cast."""
        needs_cast = any(p.param_dtype != p.orig_dtype for p in self.params if p.extension is None)
        self.gather_layout = (
            self.shard_layout.buffer_layout([p.buffer_numel for p in self.params], [p.param_dtype for p in self.params])
            if needs_cast
            else self.storage_layout
        )
        self.needs_cast = needs_cast

    def _pick_reduce_dtype(self) -> torch.dtype:
        policy = self.mp_policy
        # An eval-mode step in full precision (FSDP_USE_FULL_PREC_IN_EVAL) reduces in it too, as FSDP1.
        full_precision = bool(self.params) and all(p.full_precision for p in self.params)
        if policy.reduce_dtype is not None and not full_precision:
            return policy.reduce_dtype
        if policy.param_dtype is not None and not full_precision:
            return policy.param_dtype
        # The parameters that get gradients decide: a frozen float8 weight beside them gets none
        # (and float8 types do not promote). With every parameter frozen, any but float8.
        dtypes = (
            {p.orig_dtype for p in self.params if p.sharded_param.requires_grad}
            or {p.orig_dtype for p in self.params if p.orig_dtype.itemsize > 1}
            or {torch.float32}
        )
        result = dtypes.pop()
        for dtype in dtypes:
            result = torch.promote_types(result, dtype)
        return result


def _check_on_host(view: BufferView | None, params: list[ShardParam], owner: str) -> None:
    """Offloaded shards live in host memory: a module moved (or materialized) onto
    an accelerator would put the whole sharded model there at once."""
    moved = [view.tensor] if view is not None else [p.local_shard for p in params]
    devices = {t.device for t in moved if t.device.type not in ("cpu", "meta")}
    if devices:
        raise RuntimeError(
            f"CPU offload expects the parameters of {owner} on the CPU, but they were moved to "
            f"{devices.pop()}; materialize a meta-device model with module.to_empty(device='cpu') (or load a "
            "CPU state dict) and do not move it: offloaded shards reach the GPU only while gathered"
        )
