"""One communication unit: the parameters that one ``fully_shard`` call manages.

A unit costs one all-gather before it runs (again in backward when it was
resharded after forward) and one reduce-scatter of its gradients, no matter how
many parameters it has. See [Note: Unit buffers] for the memory layout and
[Note: Reduction pipeline] for what happens to gradients.

[Note: When a unit's backward is done]
Backward gives no "module finished" event, so two signals are combined:
  1. each unsharded parameter's post-accumulate-grad hook: once every parameter
     that requires grad has its gradient, the unit reduces immediately;
  2. a hook on the gradient of the unit's forward inputs: it fires after the
     unit's backward; it reshards units that expect no gradient (frozen).
A unit may run several times in one forward, and a use's backward may need
the parameters' values after every gradient is in (a frozen parameter behind a
trainable one, a frozen unit called twice). So neither signal reshards while
a use whose backward has started still waits for its input hook
(``_uses_in_backward``), and a use whose backward starts after its unit was
resharded gathers again. (Uses counted from their backward's start, not from
forward: a forward whose graph is never backpropagated must not hold a unit.)
Whatever neither signal finished (parameters unused this step, units whose
inputs need no grad) is finished by the end-of-backward callback.
"""

from __future__ import annotations

import contextlib
import enum
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from ..api import CPUOffloadPolicy
from . import comm, compat, offload
from .common import TrainingState, UnitConfig
from .layout import Layout
from .mesh import GroupInfo, MeshInfo
from .param import ShardParam
from .presentation import DTENSOR_SHARDS
from .reduction import GradReduction, ReduceSettings

if TYPE_CHECKING:
    from .state import IterationContext

_Method = TypeVar("_Method", bound=Callable[..., Any])


def _outside_transforms(method: _Method) -> _Method:
    """Runs a buffer transition with functorch transforms (``torch.func.jvp``)
    switched off: buffers it allocates must stay plain tensors whose storage
    can be freed, not wrappers of the transform's level."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return run  # type: ignore[return-value]


class ShardedState(enum.Enum):
    SHARDED = enum.auto()  # only this rank's shards exist
    SHARDED_POST_FORWARD = enum.auto()  # a larger shard for the smaller post-forward group
    UNSHARDED = enum.auto()  # full parameters registered on the modules


@dataclass
class _AllGatherInFlight:
    work: dist.Work | None
    input: torch.Tensor  # kept alive until the collective is done
    output: torch.Tensor
    layout: Layout
    num_chunks: int


class UnitUse:
    """One forward call of a unit whose inputs need gradients (see [Note: When a
    unit's backward is done])."""

    __slots__ = ("in_backward",)

    def __init__(self) -> None:
        self.in_backward = False


class ParamGroup:
    """A unit's parameters, buffers and step transitions."""

    def __init__(
        self,
        params: list[ShardParam],
        mesh_info: MeshInfo,
        post_forward: GroupInfo | None,
        device: torch.device,
        config: UnitConfig,
        reshard_after_forward: bool,
        unit_name: str,
    ) -> None:
        self.params = params
        self.unit_name = unit_name  # the managed module's class, for messages before lazy init
        self.mesh_info = mesh_info
        self.post_forward_group = post_forward  # None unless resharding to a smaller group
        self.device = device  # where compute and communication happen
        self.offload = isinstance(config.offload_policy, CPUOffloadPolicy)
        # Pinned host memory makes copies to and from an accelerator asynchronous.
        self._pin_memory = self.offload and config.offload_policy.pin_memory and device.type != "cpu"
        self.mp_policy = config.mp_policy
        self.presentation = config.presentation or DTENSOR_SHARDS
        self.keep_low_precision_grads = config.keep_low_precision_grads
        self.flat_param: torch.nn.Parameter | None = None  # see expose_flat_param
        self.flat_param_home: tuple[torch.nn.Module, str] | None = None  # where it is registered
        self.reshard_after_forward = reshard_after_forward
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.reduce_settings = ReduceSettings()
        self.unshard_in_backward = True  # False: backward needs no parameter values (embeddings)
        self._partial_grads: dict[ShardParam, torch.Tensor] = {}  # see [Note: Reduction pipeline]
        self.module_fqn = ""  # set at lazy init
        self.ctx: IterationContext | None = None  # set at lazy init
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: _AllGatherInFlight | None = None
        self._shows_shards_unsharded = False  # see show_shards
        self._post_forward_shard: tuple[torch.Tensor, Layout] | None = None
        self._awaiting_grads: set[ShardParam] = set()
        self._uses_in_backward = 0  # uses whose backward started and whose input hook has not fired
        self._post_forward_indices: list[int] = []
        self.prefetch_after_backward: list[ParamGroup] = []  # BackwardPrefetch.BACKWARD_POST
        for param in params:
            param.on_grad_ready = self._on_grad_ready
        self._build_shard_buffer([p.initial_shard for p in params])
        for param in params:
            param.initial_shard = None
            if self.keep_low_precision_grads:
                compat.set_grad_dtype(param.sharded_param, self.reduce_dtype, unit_name)

    # -- buffers -----------------------------------------------------------------
    @property
    def storage_device(self) -> torch.device:
        return torch.device("cpu") if self.offload else self.device

    @torch.no_grad()
    def _build_shard_buffer(self, shards: list[torch.Tensor]) -> None:
        """(Re)packs this rank's shards into one flat buffer. See [Note: Unit buffers]."""
        on_meta = any(s.is_meta for s in shards)
        device = torch.device("meta") if on_meta else self.storage_device
        self.storage_layout = Layout.build([p.shard_numel for p in self.params], [s.dtype for s in shards])
        buffer = torch.zeros(self.storage_layout.total, dtype=self.storage_layout.dtype, device=device)
        if self._pin_memory and not on_meta:
            buffer = buffer.pin_memory()
        for index, shard in enumerate(shards):
            if not on_meta and shard.numel() > 0:
                region = self.storage_layout.region(buffer, index, shard.dtype)
                region[: shard.numel()].view_as(shard).copy_(shard)
        self._bind_buffer(buffer)

    def _bind_buffer(self, buffer: torch.Tensor, dtypes: list[torch.dtype] | None = None) -> None:
        """Makes ``buffer`` (storage layout) the home of every parameter's shard,
        each viewed as ``dtypes[i]`` (default: its current dtype)."""
        dtypes = dtypes or [p.local_dtype for p in self.params]
        for index, (param, dtype) in enumerate(zip(self.params, dtypes)):
            param.bind_shard(self.storage_layout.region(buffer, index, dtype))
        self.shard_buffer = buffer  # 1D
        self._set_gather_layout()
        self.reduce_dtype = self._pick_reduce_dtype()

    def _set_gather_layout(self) -> None:
        needs_cast = any(p.param_dtype != p.orig_dtype for p in self.params)
        self.gather_layout = (
            Layout.build([p.shard_numel for p in self.params], [p.param_dtype for p in self.params])
            if needs_cast
            else self.storage_layout
        )
        self._needs_cast = needs_cast

    def set_full_precision(self, full_precision: bool) -> None:
        """Gathers and computes in the parameters' own dtype (True) instead of the
        mixed-precision ``param_dtype``; the unsharded forms change dtype, so a
        change reshards first."""
        if all(p.full_precision == full_precision for p in self.params):
            return
        self.reshard()
        for param in self.params:
            param.full_precision = full_precision
        self._set_gather_layout()

    def _pick_reduce_dtype(self) -> torch.dtype:
        policy = self.mp_policy
        if policy.reduce_dtype is not None:
            return policy.reduce_dtype
        if policy.param_dtype is not None:
            return policy.param_dtype
        dtypes = {p.orig_dtype for p in self.params} or {torch.float32}
        result = dtypes.pop()
        for dtype in dtypes:
            result = torch.promote_types(result, dtype)
        return result

    def rebind_shards(self) -> None:
        """Re-packs after ``nn.Module._apply`` gave the shards new tensors (``to_empty``, ``.to``).

        With a flat parameter, ``_apply`` moved that parameter itself (the
        shards are plain attributes it does not visit): adopt its new storage.
        """
        for param in self.params:
            registered = param.module_registration()
            if isinstance(registered, DTensor) and registered is not param.sharded_param:
                param.sharded_param = registered  # _apply replaced rather than swapped
            param.forget_unsharded()
        if self.offload:
            self._check_on_host()
        if self.flat_param is not None:
            buffer = self.flat_param.detach()
            dtypes = [buffer.dtype] * len(self.params)  # model.half(): the shards change dtype with it
            self.storage_layout = Layout.build([p.shard_numel for p in self.params], dtypes)
            self._bind_buffer(buffer, dtypes)
            for param in self.params:
                param.to_sharded()
        else:
            self._build_shard_buffer([p.local_shard for p in self.params])

    def adopt_registered_shards(self) -> None:
        """Takes the parameters now registered on the modules as the shards, when
        the user replaced ours (``load_state_dict(..., assign=True)``, e.g. a meta
        model's parameters assigned piece by piece): their values move into the
        unit's buffer, which they then view."""
        if self.flat_param is None and any(
            isinstance(p.module_registration(), DTensor) and p.module_registration() is not p.sharded_param
            for p in self.params
        ):
            self.rebind_shards()

    def _check_on_host(self) -> None:
        """Offloaded shards live in host memory: a module moved (or materialized) onto
        an accelerator would put the whole sharded model there at once."""
        moved = [self.flat_param] if self.flat_param is not None else [p.local_shard for p in self.params]
        devices = {t.device for t in moved if t.device.type not in ("cpu", "meta")}
        if devices:
            raise RuntimeError(
                f"CPU offload expects the parameters of {self.owner_name} on the CPU, but they were moved to "
                f"{devices.pop()}; materialize a meta-device model with module.to_empty(device='cpu') (or load a "
                "CPU state dict) and do not move it: offloaded shards reach the GPU only while gathered"
            )

    # -- the FSDP1 flat parameter --------------------------------------------------
    def expose_flat_param(self, module: torch.nn.Module, name: str) -> torch.nn.Parameter:
        """Registers the shard buffer as ``module.<name>``, one ``nn.Parameter`` the
        optimizer steps in place.

        Raises:
            ValueError: the unit mixes dtypes or frozen and trainable parameters
                (one flat tensor has one dtype and one ``requires_grad``).
        """
        dtypes = {p.orig_dtype for p in self.params}
        if len(dtypes) > 1:
            listing = ", ".join(f"{p.fqn}: {p.orig_dtype}" for p in self.params)
            raise ValueError(
                f"use_orig_params=False expects one dtype per unit, but {self.owner_name} mixes {listing}; "
                "use use_orig_params=True or wrap the differently-typed modules separately"
            )
        requires_grad = {p.sharded_param.requires_grad for p in self.params}
        if len(requires_grad) > 1:
            frozen = [p.fqn for p in self.params if not p.sharded_param.requires_grad]
            raise ValueError(
                f"use_orig_params=False expects all parameters of a unit to share requires_grad, but "
                f"{self.owner_name} has frozen {frozen} next to trainable ones (a flat parameter would "
                "let the optimizer change the frozen ones); use use_orig_params=True or wrap the frozen "
                "modules in their own unit"
            )
        self.flat_param = torch.nn.Parameter(self.shard_buffer, requires_grad=requires_grad.pop())
        self.flat_param._fullshard_unit = self  # lets clip_grad_norm_ find its replicas
        if self.keep_low_precision_grads:
            compat.set_grad_dtype(self.flat_param, self.reduce_dtype, self.owner_name)
        module.register_parameter(name, self.flat_param)
        self.flat_param_home = (module, name)
        for param in self.params:
            param.register_sharded = False
            param.to_sharded()
        return self.flat_param

    # -- full parameters on demand (summon_full_params) --------------------------------
    def gather_full(self, grads: bool = False) -> list[torch.Tensor | None]:
        """Every parameter (or its gradient) unsharded, in its own dtype, in fresh tensors.

        Gathers over the shard group only: replicas hold the same shards. A
        parameter without a gradient on this rank gets None for ``grads=True``.
        """
        with torch.no_grad():
            if grads:
                source, present = self._grads_in_storage_layout()
            else:
                source, present = self.shard_buffer, [True] * len(self.params)
            source = source.to(self.device)
            shard = self.mesh_info.shard
            if shard.size > 1:
                output = torch.empty(source.numel() * shard.size, dtype=source.dtype, device=self.device)
                comm.all_gather(output, source, shard.group, async_op=False)
            else:
                output = source
            padded = [
                torch.empty(shard.size * p.shard_numel, dtype=p.orig_dtype, device=self.device) for p in self.params
            ]
            self.storage_layout.copy_out(output, shard.size, padded, self._split_views(padded))
        return [p.unsharded_view(t) if keep else None for p, t, keep in zip(self.params, padded, present)]

    def _grads_in_storage_layout(self) -> tuple[torch.Tensor, list[bool]]:
        if self.flat_param is not None:
            grad = self.flat_param.grad
            present = [grad is not None] * len(self.params)
            return (grad if grad is not None else torch.zeros_like(self.shard_buffer)), present
        buffer = torch.zeros_like(self.shard_buffer)
        present = []
        for index, param in enumerate(self.params):
            grad = param.sharded_param.grad
            present.append(grad is not None)
            local = param.rows_of(grad) if grad is not None else None
            if local is not None and local.numel() > 0:
                self.storage_layout.region(buffer, index, param.orig_dtype)[: local.numel()].copy_(local.reshape(-1))
        return buffer, present

    @torch.no_grad()
    def write_shard(self, index: int, local: torch.Tensor, into: torch.Tensor | None = None) -> None:
        """Copies parameter ``index``'s local rows into the shard buffer (or ``into``,
        a tensor in the same layout, e.g. a flat optimizer state)."""
        target = self.shard_buffer if into is None else into
        param = self.params[index]
        region = self.storage_layout.region(target, index, param.orig_dtype if into is None else target.dtype)
        region[: local.numel()].copy_(local.reshape(-1))

    def param_view_of_flat(self, index: int, flat: torch.Tensor, full: bool) -> torch.Tensor:
        """Parameter ``index``'s part of a tensor laid out like the shard buffer
        (a flat optimizer state): its DTensor shard, or the full tensor."""
        region = self.storage_layout.region(flat, index, flat.dtype)
        shard = self.params[index].sharded_dtensor(region)
        return shard.full_tensor() if full else shard

    def _split_views(self, padded: list[torch.Tensor]) -> list[list[torch.Tensor] | None] | None:
        """Per-rank views for parameters sharded on a dim other than 0 (see layout.py)."""
        if all(p.shard_dim == 0 for p in self.params):
            return None
        return [p.split_views(t) for p, t in zip(self.params, padded)]

    @torch.no_grad()
    def write_back(self, values: list[torch.Tensor]) -> None:
        """Copies this rank's rows of full parameter values into the shards."""
        rank = self.mesh_info.shard.rank
        for index, (param, value) in enumerate(zip(self.params, values)):
            if param.num_valid_rows == 0:
                continue
            mine = param.rank_chunks(value.reshape(param.unsharded_size))[rank]
            region = self.storage_layout.region(self.shard_buffer, index, param.orig_dtype)
            region[: mine.numel()].view(mine.shape).copy_(mine)

    @property
    def owner_name(self) -> str:
        return self.module_fqn or self.unit_name

    # -- unshard / reshard -------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    def _check_materialized(self) -> None:
        if self.shard_buffer.is_meta:
            names = [p.fqn for p in self.params]
            raise RuntimeError(
                "FSDP parameters should be materialized from meta device before training, "
                f"but the following were still on meta device: {names}\n"
                "For example, call module.to_empty(device=...) and then reset_parameters() "
                "on each module."
            )

    def _copy_stream(self) -> contextlib.AbstractContextManager:
        """Where the offloaded shards travel to the device and their all-gather is
        issued (see [Note: CPU offload] in offload.py)."""
        return offload.on_copy_stream(self.device) if self.offload else contextlib.nullcontext()

    def _all_gather_input(self) -> torch.Tensor:
        """This rank's shards on the compute device, in the gather dtype."""
        if not self._needs_cast and self.shard_buffer.device == self.device:
            return self.shard_buffer
        staged = torch.empty(self.gather_layout.total, dtype=self.gather_layout.dtype, device=self.device)
        with self._copy_stream():
            if not self._needs_cast:
                staged.copy_(self.shard_buffer, non_blocking=True)
            else:
                torch._foreach_copy_(
                    [self.gather_layout.region(staged, i, p.param_dtype) for i, p in enumerate(self.params)],
                    [self.storage_layout.region(self.shard_buffer, i, p.orig_dtype) for i, p in enumerate(self.params)],
                    non_blocking=True,
                )
        return staged

    @_outside_transforms
    def unshard(self, async_op: bool = False) -> None:
        """Starts gathering the full parameters (no-op if unsharded or in flight)."""
        if self.is_unsharded or self._all_gather is not None or not self.params:
            return
        self._check_materialized()
        if self._post_forward_shard is not None:
            source, layout = self._post_forward_shard
            group = self.post_forward_group
        else:
            if self.mesh_info.shard.size == 1 and not self._needs_cast and not self.offload:
                self._alias_unsharded()
                return
            source, layout = self._all_gather_input(), self.gather_layout
            group = self.mesh_info.shard
        if group.size == 1:
            output, work = source, None
        else:
            output = torch.empty(source.numel() * group.size, dtype=source.dtype, device=self.device)
            with self._copy_stream():  # after the copy-in, not after the compute enqueued before it
                work = comm.all_gather(output, source, group.group, async_op=async_op)
        self._all_gather = _AllGatherInFlight(work, source, output, layout, group.size)

    def unshard_needs_collective(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        if self.is_unsharded or self._all_gather is not None or not self.params:
            return False
        if self._post_forward_shard is not None:
            return self.post_forward_group.size > 1
        return self.mesh_info.shard.size > 1

    def join_all_gather(self) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        if self._post_forward_shard is not None:
            source, group = self._post_forward_shard[0], self.post_forward_group
        else:
            source, group = self._all_gather_input(), self.mesh_info.shard
        if group.size > 1:
            scratch = torch.empty(source.numel() * group.size, dtype=source.dtype, device=self.device)
            with self._copy_stream():
                comm.all_gather(scratch, source, group.group, async_op=False)
            if self.offload:
                offload.join_copy_stream(self.device)

    def _follow_flat_requires_grad(self) -> None:
        """``requires_grad_`` on the flat parameter (``module.requires_grad_(False)``
        on a wrapped unit) freezes or unfreezes every parameter in it."""
        if self.flat_param is None:
            return
        for param in self.params:
            if param.sharded_param.requires_grad != self.flat_param.requires_grad:
                param.sharded_param.requires_grad_(self.flat_param.requires_grad)

    def _alias_unsharded(self) -> None:
        self._follow_flat_requires_grad()
        for index, param in enumerate(self.params):
            param.alias_unsharded(self.storage_layout.region(self.shard_buffer, index, param.orig_dtype))
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @_outside_transforms
    def wait_for_unshard(self) -> None:
        """Finishes an in-flight unshard: copy-out and registration of full parameters."""
        in_flight, self._all_gather = self._all_gather, None
        if in_flight is None:
            if self._shows_shards_unsharded:  # kept unsharded but showing the shards
                self._register_unsharded()
            return
        if in_flight.work is not None:
            in_flight.work.wait()
        if self.offload:
            offload.join_copy_stream(self.device)
        padded = [p.padded_unsharded(self.device) for p in self.params]
        # Saved activations of an earlier forward alias this storage: the refill
        # must not look like an in-place change to autograd.
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for tensor in padded:
                stack.enter_context(torch.autograd._unsafe_preserve_version_counter(tensor))
            in_flight.layout.copy_out(in_flight.output, in_flight.num_chunks, padded, self._split_views(padded))
        self._post_forward_shard = None
        self._register_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def _register_unsharded(self) -> None:
        self._follow_flat_requires_grad()
        for param in self.params:
            param.to_unsharded()
        self._shows_shards_unsharded = False

    def show_shards(self) -> None:
        """Registers the shards but keeps the full parameters for the next use
        (a no-grad forward under a presentation that asks for it)."""
        for param in self.params:
            param.to_sharded()
        self._shows_shards_unsharded = True

    @_outside_transforms
    def reshard(self) -> None:
        """Frees the full parameters and registers the shards."""
        if self._all_gather is not None:
            self.wait_for_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        for param in self.params:
            if param.aliases_shard:
                continue
            param.free_unsharded()
        for param in self.params:
            param.to_sharded()
        self._shows_shards_unsharded = False
        self._post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

    def _reshard_to_post_forward(self) -> None:
        """Keeps 1/k of the full parameters for a re-gather within the k-group."""
        group = self.post_forward_group
        layout = self.gather_layout.scaled(self.mesh_info.shard.size // group.size)
        kept = torch.empty(layout.total, dtype=layout.dtype, device=self.device)
        for index, param in enumerate(self.params):
            full = param.padded_unsharded(self.device)
            full = full if full.dtype == layout.dtype else full.view(layout.dtype)
            layout.region(kept, index, layout.dtype).copy_(full.view(group.size, -1)[group.rank])
        self.reshard()
        self._post_forward_shard = (kept, layout)
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # -- forward -------------------------------------------------------------------
    @_outside_transforms
    def post_forward(self, record_order: bool) -> None:
        if self.reshard_after_forward:
            if self.post_forward_group is not None and self.is_unsharded:
                self._reshard_to_post_forward()
            else:
                self.reshard()
        elif self.is_unsharded and not torch.is_grad_enabled() and self.presentation.sharded_after_no_grad_forward:
            self.show_shards()
        if record_order:
            self._post_forward_indices.append(self.ctx.record_post_forward(self))
        self.training_state = TrainingState.IDLE

    # -- backward (see [Note: When a unit's backward is done]) ---------------------
    def begin_backward(self) -> bool:
        """Starts gathering for backward; False if this backward already did."""
        if self.training_state is TrainingState.PRE_BACKWARD:
            return False
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
        return True

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """A bool reshards fully or not at all, dropping a smaller post-forward group."""
        if self._post_forward_shard is not None:  # 1/k kept since forward: the shards are registered
            self._post_forward_shard = None
            self.sharded_state = ShardedState.SHARDED
        self.reshard_after_forward = reshard_after_forward
        self.post_forward_group = None

    def start_use_backward(self, use: UnitUse | None) -> None:
        """Backward reached the outputs of ``use`` (None: a use whose inputs need no grad)."""
        if use is not None and not use.in_backward:
            use.in_backward = True
            self._uses_in_backward += 1

    def gather_for_another_use(self) -> None:
        """A use whose backward starts after this unit's backward resharded it."""
        if self.unshard_in_backward and self.training_state is TrainingState.POST_BACKWARD:
            self.unshard()
            self.wait_for_unshard()

    def expect_grads(self) -> None:
        self._awaiting_grads = {p for p in self.params if p.unsharded_param.requires_grad}

    def take_backward_prefetch_index(self) -> int | None:
        """Index, in the post-forward order, of the use whose backward starts now."""
        return self._post_forward_indices.pop() if self._post_forward_indices else None

    def _on_grad_ready(self, param: ShardParam) -> None:
        if self.ctx is not None:
            self.ctx.queue_end_of_backward()
        self._awaiting_grads.discard(param)
        self._maybe_finish_backward()

    def on_input_grads(self, use: UnitUse) -> None:
        if use.in_backward:
            use.in_backward = False
            self._uses_in_backward -= 1
        if self.training_state is TrainingState.POST_BACKWARD and not self._uses_in_backward:
            if self.reshard_after_backward:
                self.reshard()  # gathered again for a later use (gather_for_another_use)
            return
        self._maybe_finish_backward()

    def _maybe_finish_backward(self) -> None:
        if (
            not self._awaiting_grads
            and not self._uses_in_backward
            and self.training_state is TrainingState.PRE_BACKWARD
        ):
            self.post_backward()

    def post_backward(self) -> None:
        """Reshards and hands this unit's gradients to reduction (idempotent)."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self._awaiting_grads = set()
        for target in self.prefetch_after_backward:
            self.ctx.prefetch(target)
        self.prefetch_after_backward = []
        if not self.requires_gradient_sync:
            self._accumulate_unsynced_grads()
            if self.reshard_after_backward:
                self.reshard()
            return
        params, grads = self._take_grads()
        if self.reshard_after_backward:
            self.reshard()
        if not params:
            return
        validator = self.ctx.validator
        agreed = validator.gate("reduce", self, params=params) if validator is not None else None
        if agreed is None:
            self._submit_reduction(params, grads)
            return
        for group, names in agreed:  # the same order on every rank: see [Note: Execution order]
            if group is self and names == [p.fqn for p in params]:
                self._submit_reduction(params, grads)
            else:
                group.join_reduction(names)

    def join_reduction(self, names: list[str]) -> None:
        """Takes part in another rank's reduction of this unit's parameters ``names``
        with zero gradients (execution-order validation); the averaged result is
        this rank's gradient too, as DDP does for unused parameters."""
        params = [p for p in self.params if p.fqn in names]
        grads = [self._zero_grad(p) for p in params]
        if self.training_state is TrainingState.IDLE:
            self.training_state = TrainingState.POST_BACKWARD  # it will not run here this time
        self._submit_reduction(params, grads)

    def _submit_reduction(self, params: list[ShardParam], grads: list[torch.Tensor]) -> None:
        self.ctx.reductions.make_room()
        partial_only = self.reduce_settings.partial_only(self.mesh_info.replicate)
        partial = None
        if self._partial_grads and not partial_only:
            params, grads, partial = self._take_partial_grads(params, grads)
        reduction = GradReduction(
            grads,
            [p.shard_numel for p in params],
            [p.shard_dim for p in params],
            self.mesh_info.shard,
            self.mesh_info.replicate,
            self.reduce_dtype,
            on_done=lambda output: (self._keep_partial_grads if partial_only else self._accept_grads)(params, output),
            settings=self.reduce_settings,
            partial=partial,
        )
        del grads  # the copy-in holds them now; free the unsharded gradients
        self.ctx.reductions.submit(reduction)

    def _take_partial_grads(
        self, params: list[ShardParam], grads: list[torch.Tensor]
    ) -> tuple[list[ShardParam], list[torch.Tensor], torch.Tensor]:
        """Adds the parameters that only have a partial result (zero gradients now)
        and returns the partial results laid out like the reduction's output."""
        given = dict(zip(params, grads))
        params = [p for p in self.params if p in given or p in self._partial_grads]
        grads = [given[p] if p in given else self._zero_grad(p) for p in params]
        partial = torch.cat(
            [
                self._partial_grads.pop(p)
                if p in self._partial_grads
                else torch.zeros(p.shard_numel, dtype=self.reduce_dtype, device=self.device)
                for p in params
            ]
        )
        return params, grads, partial

    def _zero_grad(self, param: ShardParam) -> torch.Tensor:
        """A zero unsharded gradient: joining a reduction this rank has nothing for."""
        return torch.zeros(param.unsharded_size, dtype=param.param_dtype, device=self.device)

    def _keep_partial_grads(self, params: list[ShardParam], output: torch.Tensor) -> None:
        offset = 0
        for param in params:
            chunk = output[offset : offset + param.shard_numel]
            offset += param.shard_numel
            kept = self._partial_grads.get(param)
            self._partial_grads[param] = chunk if kept is None else kept.add_(chunk)

    def _grad_dtype(self, param: ShardParam) -> torch.dtype:
        return self.reduce_dtype if self.keep_low_precision_grads else param.orig_dtype

    def _accept_grads(self, params: list[ShardParam], output: torch.Tensor) -> None:
        """Adds the reduced shards (``output``: ``params``' shards back to back) to ``.grad``."""
        if self.flat_param is not None:
            self._accept_flat_grad(params, output)
            return
        offset = 0
        for param in params:
            padded = output[offset : offset + param.shard_numel]
            offset += param.shard_numel
            padded = self._to_storage(padded, self._grad_dtype(param))
            sharded = param.sharded_param
            if sharded.grad is None:
                sharded.grad = param.present_padded(padded)
            else:
                offload.wait_for_host_copies()  # the CPU adds now
                local = param.rows_of(sharded.grad)
                local.add_(padded[: local.numel()].view_as(local))
        _step_in_backward_optimizers([p.sharded_param for p in params])

    def _accept_flat_grad(self, params: list[ShardParam], output: torch.Tensor) -> None:
        dtype = self._grad_dtype(params[0])
        if len(params) == len(self.params):  # every shard present: output has the buffer's layout
            full = self._to_storage(output, dtype)
        else:
            full = torch.zeros(self.storage_layout.total, dtype=dtype, device=self.storage_device)
            offset = 0
            for param in params:
                index = self.params.index(param)
                start = self.storage_layout.offsets[index]
                full[start : start + param.shard_numel].copy_(output[offset : offset + param.shard_numel])
                offset += param.shard_numel
        if self.flat_param.grad is None:
            self.flat_param.grad = full
        else:
            offload.wait_for_host_copies()
            self.flat_param.grad.add_(full)
        _step_in_backward_optimizers([self.flat_param])

    def _to_storage(self, reduced: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """A reduced gradient shard where the shards live: offloaded, copied to host
        memory off the compute stream (see [Note: CPU offload])."""
        if self.offload:
            return offload.to_host(reduced, dtype)
        return reduced.to(self.storage_device, dtype)

    def _take_grads(self) -> tuple[list[ShardParam], list[torch.Tensor]]:
        params, grads = [], []
        for param in self.params:
            grad = _pop_unsharded_grad(param)
            if param.unsynced_grad is not None:
                grad = param.unsynced_grad if grad is None else param.unsynced_grad.add_(grad)
                param.unsynced_grad = None
            if grad is not None:
                params.append(param)
                grads.append(grad.contiguous())
        return params, grads

    def _accumulate_unsynced_grads(self) -> None:
        """No sync: gradients stay unsharded, summed in the reduce dtype."""
        for param in self.params:
            unsharded = param.unsharded_param
            if unsharded is None or unsharded.grad is None:
                continue
            if unsharded.grad.dtype == self.reduce_dtype and param.unsynced_grad is None:
                continue  # autograd keeps summing into .grad
            grad = _pop_unsharded_grad(param).to(self.reduce_dtype)
            param.unsynced_grad = grad if param.unsynced_grad is None else param.unsynced_grad.add_(grad)

    def finish_backward(self) -> None:
        """End of backward: reduce what is left, drop stray prefetches, go idle."""
        if self.training_state is not TrainingState.POST_BACKWARD and self._has_pending_grads():
            self.post_backward()
        if self._all_gather is not None:  # a prefetch whose unit never ran
            self.wait_for_unshard()
        if self.reshard_after_backward and self.is_unsharded:
            self.reshard()
        self.training_state = TrainingState.IDLE
        self._awaiting_grads = set()
        self._uses_in_backward = 0
        self._post_forward_indices.clear()

    def _has_pending_grads(self) -> bool:
        return any(
            p.unsynced_grad is not None or (p.unsharded_param is not None and p.unsharded_param.grad is not None)
            for p in self.params
        )

    def __repr__(self) -> str:
        return f"ParamGroup({self.module_fqn or '<root>'}, {len(self.params)} params)"


def _step_in_backward_optimizers(params: list[torch.Tensor]) -> None:
    """``torch.distributed.optim._apply_optimizer_in_backward`` attaches optimizers to
    a parameter and steps them from its AccumulateGrad hook, which never fires for
    a sharded parameter (its gradient is written, not accumulated): they step here,
    once the reduced gradient landed, and drop it, as that hook would."""
    for param in params:
        optimizers = getattr(param, "_in_backward_optimizers", ())
        for optimizer in optimizers:
            optimizer.step()
        if optimizers:
            param.grad = None


def _pop_unsharded_grad(param: ShardParam) -> torch.Tensor | None:
    unsharded = param.unsharded_param
    if unsharded is None or unsharded.grad is None:
        return None
    grad = unsharded.grad
    unsharded.grad = None
    if isinstance(grad, DTensor):
        if tuple(grad.placements) != param.tp_placements:
            grad = grad.redistribute(placements=param.tp_placements)
        grad = grad._local_tensor
    return grad
