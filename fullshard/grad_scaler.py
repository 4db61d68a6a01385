"""``ShardedGradScaler``: loss scaling for fp16 training where every rank holds only shards.

Used exactly like ``torch.amp.GradScaler``::

    scaler = ShardedGradScaler()
    scaler.scale(loss).backward()
    scaler.step(optimizer)  # unscales, skips the step on every rank if any rank saw inf/NaN
    scaler.update()

[Note: One skip decision for all ranks]
A rank sees only its shard of each gradient, so an inf in one shard is visible
to one rank. If that rank skipped the step while the others took it, the shards
of one parameter would stop belonging to the same model. ``unscale_`` therefore
folds this rank's per-device inf flags into one flag on the scale's device and
takes its MAX over ``process_group`` (one all-reduce per optimizer step, through
``_core.comm``), so every rank steps or skips together and ``update`` backs the
scale off identically everywhere. A rank with no gradients at all (no rows of
any trainable parameter) still joins the all-reduce with a zero flag.

DTensor gradients (``fully_shard``) are unscaled as
their local tensors: DTensor's own rule for the unscale kernel all-reduces the
flag over the parameter's mesh, a second, hidden collective per (device, dtype).

[Note: Which group a parameter belongs to]
A parameter belongs to a group when the group contains every rank that holds a
piece of it: all ranks of its ``DeviceMesh`` (shard, replicate and TP axes
alike) for a DTensor, all ranks of its unit's mesh for the wrapper's flat
parameter or plain shard views (``use_orig_params=True``). Skipping together
only works over such a group, so ``unscale_`` checks it and raises otherwise (a
larger group is fine). Plain tensors carry no mesh; any group is accepted for them.

[Note: Where the scale lives]
The scale is created on the device of the first tensor passed to ``scale`` (as
in ``GradScaler``), whatever ``device`` says: a CPU run with the default
``device="cuda"`` scales on the CPU instead of switching itself off. Gradients
may live elsewhere (CPU offload); their flags are moved to the scale's device.
"""

from __future__ import annotations

from collections import abc, defaultdict
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, overload

import torch
import torch.distributed as dist
from torch.amp.grad_scaler import GradScaler, OptState
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from ._core import comm
from ._core.unit import buffer_param, unit_of

__all__ = ["ShardedGradScaler"]


class ShardedGradScaler(GradScaler):
    """``torch.amp.GradScaler`` for sharded models: every rank skips the same steps.

    See [Note: One skip decision for all ranks].

    Args:
        device: accepted for compatibility; the scale lives on the device of the
            first tensor passed to ``scale`` (see [Note: Where the scale lives]).
        init_scale: the initial scale factor.
        backoff_factor: multiplies the scale after a step with inf/NaN gradients.
        growth_factor: multiplies the scale after ``growth_interval`` clean steps.
        growth_interval: the number of consecutive clean steps before growing.
        enabled: False makes ``scale``/``unscale_``/``update`` no-ops and ``step``
            a plain ``optimizer.step()``.
        process_group: the group the inf/NaN flag is reduced over; it must
            contain every rank holding a piece of the optimizer's parameters
            (see [Note: Which group a parameter belongs to]). Default: the
            default group when torch.distributed is initialized, else none. A
            single-rank group (or any object whose ``size()`` is 1) means no
            communication.

    Raises:
        ValueError: ``process_group`` does not contain this rank.
    """

    def __init__(
        self,
        device: str = "cuda",
        init_scale: float = 2.0**16,
        backoff_factor: float = 0.5,
        growth_factor: float = 2.0,
        growth_interval: int = 2000,
        enabled: bool = True,
        process_group: dist.ProcessGroup | None = None,
    ) -> None:
        # GradScaler switches itself off for device="cuda" on a machine without
        # CUDA; our scale follows the tensors, so it is told "cpu" (which only
        # skips that check) and keeps the requested device for reference.
        super().__init__(
            "cpu",
            init_scale=init_scale,
            growth_factor=growth_factor,
            backoff_factor=backoff_factor,
            growth_interval=growth_interval,
            enabled=enabled,
        )
        self._device = device
        if process_group is not None and process_group == dist.GroupMember.NON_GROUP_MEMBER:
            raise ValueError(
                f"ShardedGradScaler expects a process_group that contains this rank, but rank "
                f"{dist.get_rank()} is not a member; pass the group every rank holding the model is in"
            )
        self.process_group = process_group
        self._checked: dict[tuple[int, int], tuple[Any, DeviceMesh]] = {}  # (group, mesh) pairs that passed

    @overload
    def scale(self, outputs: torch.Tensor) -> torch.Tensor: ...
    @overload
    def scale(self, outputs: list[torch.Tensor]) -> list[torch.Tensor]: ...
    @overload
    def scale(self, outputs: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]: ...
    @overload
    def scale(self, outputs: Iterable[torch.Tensor]) -> Iterable[torch.Tensor]: ...
    def scale(self, outputs: torch.Tensor | Iterable[torch.Tensor]) -> torch.Tensor | Iterable[torch.Tensor]:
        """Multiplies a tensor, or every tensor in nested lists/tuples (or an
        iterable), by the scale. Each result keeps its input's dtype: FSDP mixed
        precision returns a low-precision loss, and a 0-dim fp16 loss times the
        fp32 scale would otherwise come back fp32.

        Raises:
            ValueError: ``outputs`` holds something that is not a tensor.
        """
        if not self._enabled:
            return outputs
        per_device: dict[torch.device, torch.Tensor] = {}

        def scale_one(value: Any) -> Any:
            if isinstance(value, torch.Tensor):
                if value.device not in per_device:
                    per_device[value.device] = self._scale_on(value.device)
                return (value * per_device[value.device]).to(value.dtype)
            if isinstance(value, (list, tuple)):
                return type(value)(scale_one(v) for v in value)
            if isinstance(value, abc.Iterable):
                return map(scale_one, value)
            raise ValueError(
                f"ShardedGradScaler.scale expects a tensor or an iterable of tensors but got {type(value).__name__}"
            )

        return scale_one(outputs)

    def _scale_on(self, device: torch.device) -> torch.Tensor:
        """The scale copied to ``device`` (created there on first use)."""
        if self._scale is None:
            self._lazy_init_scale_growth_tracker(device)
        scale, _ = self._check_scale_growth_tracker("scale")
        return scale.to(device, non_blocking=True)

    def _lazy_init_scale_growth_tracker(self, dev: torch.device) -> None:
        super()._lazy_init_scale_growth_tracker(dev)
        self._device = dev.type  # GradScaler.update checks a new_scale tensor against it

    def unscale_(self, optimizer: torch.optim.Optimizer) -> None:
        """Divides this rank's gradient shards by the scale and agrees with the
        other ranks of ``process_group`` on whether any of them saw inf/NaN.

        Raises:
            RuntimeError: called twice for ``optimizer`` in one step, or after ``step``.
            ValueError: ``process_group`` lacks ranks holding the parameters.
        """
        if not self._enabled:
            return
        scale, _ = self._check_scale_growth_tracker("unscale_")
        state = self._per_optimizer_states[id(optimizer)]
        if state["stage"] is not OptState.READY:
            done = "unscale_() has already been called" if state["stage"] is OptState.UNSCALED else "step() was called"
            raise RuntimeError(
                f"ShardedGradScaler.unscale_ expects one call per optimizer between update() calls, before "
                f"step(), but {done} on this optimizer since the last update()"
            )
        group = self._reduction_group(optimizer)
        # The reciprocal in float64 gives the same inv_scale as GradScaler for any scale value.
        inv_scale = scale.double().reciprocal().float()
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        flags = self._unscale_grads_(optimizer, inv_scale, found_inf)
        state["found_inf_per_device"] = self._agree_on_found_inf(flags, group)
        state["stage"] = OptState.UNSCALED

    # The keys are devices (torch annotates them str), as in the dict GradScaler builds.
    def _check_inf_per_device(self, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        # The path ``step`` takes for optimizers that unscale inside their own
        # step (fused Adam): the flag they skip on must agree across ranks too.
        group = self._reduction_group(optimizer)
        flags = super()._check_inf_per_device(optimizer)
        state = self._per_optimizer_states[id(optimizer)]
        state["found_inf_per_device"] = self._agree_on_found_inf(flags, group)
        return state["found_inf_per_device"]

    def _unscale_grads_(
        self,
        optimizer: torch.optim.Optimizer,
        inv_scale: torch.Tensor,
        found_inf: torch.Tensor,
        allow_fp16: bool = True,
    ) -> dict[torch.device, torch.Tensor]:
        """Unscales this rank's local gradients in place; returns an inf/NaN flag
        per device they live on (copies of ``found_inf``). No communication."""
        buckets: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        with torch.no_grad():
            for param in _params(optimizer):
                grad = param.grad
                if grad is None:
                    continue
                if not allow_fp16 and grad.dtype == torch.float16:
                    raise ValueError("ShardedGradScaler expects no fp16 gradients here but got one")
                if grad.is_sparse:
                    if not grad.is_coalesced():
                        # Duplicate indices add up in the optimizer: check their sums,
                        # which can overflow fp16 where every addend is finite.
                        param.grad = grad = grad.coalesce()
                    local = grad._values()
                else:
                    local = grad._local_tensor if isinstance(grad, DTensor) else grad  # see the first Note
                buckets[(local.device, local.dtype)].append(local)
            flags: dict[torch.device, torch.Tensor] = {}
            for (device, _), grads in buckets.items():
                if device not in flags:
                    flags[device] = found_inf.to(device, copy=True)
                torch._amp_foreach_non_finite_check_and_unscale_(grads, flags[device], inv_scale.to(device))
        return flags

    def update(self, new_scale: float | torch.Tensor | None = None) -> None:
        """Backs the scale off if any step since the last update saw inf/NaN (on
        any rank), grows it after ``growth_interval`` clean steps, or sets it to
        ``new_scale`` (a float, or a one-element tensor on any device)."""
        if self._enabled and isinstance(new_scale, torch.Tensor) and self._scale is not None:
            new_scale = new_scale.to(self._scale.device)  # see [Note: Where the scale lives]
        super().update(new_scale)

    # -- helpers ---------------------------------------------------------------------
    def _reduction_group(self, optimizer: torch.optim.Optimizer) -> Any:
        """The group to reduce the flag over (None: this rank is alone), after
        checking it covers the parameters. See [Note: Which group a parameter belongs to]."""
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        if group is None:  # torch.distributed is not initialized: this rank is alone
            return None
        ranks: set[int] | None = None
        for param in _params(optimizer):
            mesh = _mesh_of(param)
            if mesh is None or (id(group), id(mesh)) in self._checked:
                continue
            ranks = _ranks_of(group) if ranks is None else ranks
            needed = set(mesh.mesh.flatten().tolist())
            if not needed <= ranks:
                raise ValueError(
                    f"ShardedGradScaler expects process_group to contain every rank holding a piece of the "
                    f"optimizer's parameters, but {_describe(param)} lives on ranks {sorted(needed)} and process_group "
                    f"has ranks {sorted(ranks)}; pass the group the model is sharded over (None: the default group)"
                )
            self._checked[(id(group), id(mesh))] = (group, mesh)  # holding them keeps the ids unique
        return group if group.size() > 1 else None

    def _agree_on_found_inf(self, flags: Mapping[Any, torch.Tensor], group: Any) -> dict[torch.device, torch.Tensor]:
        """This rank's flags (one per device) summed into one on the scale's device, then MAXed over ``group``."""
        scale, _ = self._check_scale_growth_tracker("unscale_")
        found_inf = torch.zeros((), dtype=torch.float32, device=scale.device)
        for flag in flags.values():
            found_inf += flag.to(found_inf.device).reshape(())
        if group is not None:
            on_wire = found_inf.to(comm.device_for(group, found_inf.device))
            comm.all_reduce(on_wire, group, dist.ReduceOp.MAX, async_op=False)
            found_inf = on_wire.to(found_inf.device)
        return {found_inf.device: found_inf}


def _params(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for param_group in optimizer.param_groups:
        yield from param_group["params"]


def _mesh_of(param: torch.Tensor) -> DeviceMesh | None:
    """The mesh of ranks holding pieces of ``param`` (None for a plain tensor)."""
    if isinstance(param, DTensor):
        return param.device_mesh
    unit = unit_of(param)  # the wrapper's flat parameter, or a plain shard view
    return unit.spec.mesh_info.mesh if unit is not None else None


def _describe(param: torch.Tensor) -> str:
    """``param`` named for messages (it has a mesh: see ``_mesh_of``)."""
    unit = unit_of(param)
    if unit is not None and param is buffer_param(unit):
        return f"the flat parameter of {unit.spec.name}"
    if unit is not None:
        shape = next(tuple(p.global_size) for p in unit.spec.params if p.sharded_param is param)
        return f"a parameter of shape {shape}"
    return f"a parameter of shape {tuple(param.shape)}"


def _ranks_of(group: Any) -> set[int]:
    if group.size() == 1:
        # Possibly a stand-in torch.distributed does not know; it holds this process only.
        return {dist.get_rank() if dist.is_initialized() else 0}
    return set(dist.get_process_group_ranks(group))
