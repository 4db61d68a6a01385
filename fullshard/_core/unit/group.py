"""One communication unit: the parameters that one ``fully_shard`` call manages.

A unit costs one all-gather before it runs (again in backward when it was
resharded after forward) and one reduce-scatter of its gradients, no matter how
many parameters it has. ``ParamGroup`` is the unit's lifecycle in a step
(forward and backward transitions, when its backward is done) and the forms of
its parameters with the moves between them: sharded (only this rank's shards
exist), sharded post-forward (a larger shard kept for a re-gather within a
smaller group) and unsharded (the full parameters registered on the modules);
``unshard`` all-gathers, ``reshard`` frees. The all-gather's steps are in the
gather room (see [Note: Unit buffers]), what happens to the unit's gradients in
the reduce room (see [Note: Reduction pipeline]). What a unit asks of the root
it sits under (``UnitRoot``, the root's schedule) is named here without
importing it: the root knows the units, not the reverse.

[Note: When a unit's backward is done]
Autograd has no "module finished" event. A unit reduces once every parameter
that requires grad has its gradient (post-accumulate-grad hooks), and a hook on
its forward inputs' gradient fires after its backward (frozen units reshard
there). A unit run several times may need its values after all its gradients
are in, so neither signal reshards while a use whose backward started still
waits for its input hook; a use starting backward after the reshard gathers
again. Uses count from their backward's start: a forward that is never
backpropagated holds nothing. The end-of-backward callback finishes the rest
(parameters unused this step, units whose inputs need no grad).

[Note: Kept forms go stale]
A unit can keep its unsharded (or post-forward) form past the step that
gathered it: a no-grad forward has no backward to reshard it, and
``reshard_after_forward=False`` or a kept 1/k shard exist for reuse. If the
shards then change in place (an optimizer step after an evaluation forward, a
state-dict load), reusing the kept form would compute with the old values.
The shards' version counters are recorded when a form is gathered: the
buffer's (shared by its views: plain shards, the flat parameter) and each
sharded parameter's (a DTensor counts its in-place ops on itself, not on its
local tensor); ``unshard`` drops a form whose shards moved on and gathers again. Torch's FSDP
reuses such forms as they are.

[Note: Which unit a tensor belongs to]
Gradient clipping, the grad scaler and optimizer state dicts are handed what
the optimizer steps. A DTensor carries its mesh; the wrapper's plain tensors do
not: its flat parameter (one tensor over the unit's whole shard buffer) and,
with ``use_orig_params=True``, the 1D views of each parameter's shard. The
front end registers those (``register_param_unit``); the shared services look
them up (``unit_of``, ``buffer_param``), and never import the front end's classes.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, cast

import torch
import torch.nn as nn

from .. import compat, trace
from ..comm import GroupInfo
from ..common import TrainingState
from ..gather import (
    AllGather,
    AllGatherInFlight,
    BucketKey,
    GatherInput,
    PostForwardShard,
    ShardParam,
    UnitBuffers,
    UnitSpec,
    bucket_key,
    gather_bucket,
    gathered_bytes,
)
from ..reduce import GradIntake, ReductionQueue
from ..settings import UnitSettings

_Method = TypeVar("_Method", bound=Callable[..., Any])


def outside_transforms(method: _Method) -> _Method:
    """Runs a buffer transition with functorch transforms (``torch.func.jvp``)
    switched off: buffers it allocates must stay plain tensors whose storage
    can be freed, not wrappers of the transform's level."""

    @functools.wraps(method)
    def run(*args: Any, **kwargs: Any) -> Any:
        if not torch._C._are_functorch_transforms_active():
            return method(*args, **kwargs)
        with torch._C._DisableFuncTorch():
            return method(*args, **kwargs)

    return cast(_Method, run)


class ShardedState(enum.Enum):
    SHARDED = enum.auto()  # only this rank's shards exist
    SHARDED_POST_FORWARD = enum.auto()  # a larger shard for the smaller post-forward group
    UNSHARDED = enum.auto()  # full parameters registered on the modules


_Unit = TypeVar("_Unit", contravariant=True)

# At DETAIL debug level: starts a unit's reduction of ``grads`` (of ``params``) once
# the ranks agreed on it (see [Note: Execution order]); (unit, params, grads).
ReductionGate = Callable[[Any, list[ShardParam], list[torch.Tensor]], None]


class UnitRoot(Protocol[_Unit]):
    def queue_end_of_backward(self) -> None: ...
    def after_backward(self, unit: _Unit) -> None: ...


class Unrooted:
    """A unit's root before the root's lazy init: gradients may arrive (an explicit
    ``unshard()`` then backward) but no step has started."""

    def queue_end_of_backward(self) -> None:
        pass

    def after_backward(self, unit: object) -> None:
        pass


class UnitUse:
    """One forward call of a unit whose inputs need gradients (see [Note: When a
    unit's backward is done])."""

    __slots__ = ("in_backward",)

    def __init__(self) -> None:
        self.in_backward = False


class ParamGroup:
    """One unit: its lifecycle in a step and its parameters' forms (see the module
    docstring). What it is (parameters, mesh, devices, name) is its ``spec`` (see
    [Note: Unit spec]), the user's run-time choices its ``settings``."""

    def __init__(self, spec: UnitSpec, settings: UnitSettings) -> None:
        self.spec = spec
        self.buffers = UnitBuffers(spec, [p.bound_rows for p in spec.params])
        self.gather = AllGather(spec, self.buffers, settings)
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        self._shows_shards_unsharded = False  # see show_shards
        self._post_forward_shard: PostForwardShard | None = None
        self._gathered_version: int | None = None  # the shards' version behind a kept form, see the Note

        self.settings = settings
        self.grads = GradIntake(spec, self.buffers, settings.reduce)
        self.root: UnitRoot[ParamGroup] = Unrooted()  # the root's schedule from its lazy init on
        self.reduction_gate: ReductionGate | None = None  # the order check's, at DETAIL debug level
        self.training_state = TrainingState.IDLE
        self._uses_in_backward = 0  # uses whose backward started and whose input hook has not fired
        for param in spec.params:
            param.on_grad_ready = self._on_grad_ready
            param.to_sharded()
            if spec.keep_low_precision_grads:
                compat.set_grad_dtype(param.sharded_param, self.buffers.reduce_dtype, spec.name)

    def join_root(self, root: UnitRoot[ParamGroup], queue: ReductionQueue, gate: ReductionGate | None) -> None:
        """The root's lazy init: ``queue`` takes this unit's reductions (through
        ``gate`` first at DETAIL debug level, see [Note: Execution order]); the
        parameters the user registered meanwhile become the shards."""
        self.root = root
        self.grads.queue = queue
        self.reduction_gate = gate
        self.adopt_registered()
        self.buffers.adopt_gather_hooks(self.spec.name, self.settings.post_forward_group is not None)

    def adopt_registered(self, whole_only: bool = False) -> None:
        """Parameters the user registered in place of the shards (``load_state_dict(...,
        assign=True)`` into a meta-device model) become the shards; ``whole_only``: once
        none is left on the meta device."""
        self.buffers.adopt_registered(self.spec.name, whole_only)

    def set_names(self, path: str, fqns: dict[nn.Parameter, str]) -> None:
        """The root's lazy init knows the managed module's ``path`` in the model and
        the parameters' names there (``fqns``, by registered shard)."""
        for param in self.spec.params:
            param.fqn = fqns.get(param.sharded_param, param.fqn)
        named = dataclasses.replace(self.spec, name=path or self.spec.name, label=path or trace.ROOT)
        self.spec = self.grads.spec = named

    def describe(self) -> tuple:
        """What every rank of this unit's groups must agree on (see [Note: Ranks agree on the
        model] in step/state.py): its name, its parameters and the settings that shape its collectives."""
        spec, policy = self.spec, self.spec.mp_policy
        # requires_grad is left out: a rank-dependent freeze changes which units run, which
        # the execution-order check reports at DETAIL level (and which may change at run time).
        params = tuple((p.fqn, tuple(p.global_size), str(p.sharded_param.dtype)) for p in spec.params)
        settings = (
            f"reshard_after_forward={self.settings.reshard_after_forward}",
            f"param_dtype={policy.param_dtype}, reduce_dtype={policy.reduce_dtype}",
            f"shard size {spec.mesh_info.shard.size}, replicas {spec.mesh_info.replicate.size}",
        )
        return spec.name, params, settings

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """A bool reshards fully or not at all, dropping a smaller post-forward group."""
        self.drop_post_forward_shard()  # 1/k kept since forward: the shards are registered
        settings = self.settings
        settings.reshard_after_forward, settings.post_forward_group = reshard_after_forward, None
        settings.reshard_after_forward_chosen = True  # the root keeps it too

    # -- forward (the schedule gathers: see [Note: Prefetch]) ----------------------
    def prefetch(self, in_backward: bool = False) -> bool:
        """Starts gathering ahead of use unless unsharded, its backward is done, or
        (``in_backward``) it does not unshard in backward. Returns whether it gathers."""
        if self.sharded_state is ShardedState.UNSHARDED or self.training_state is TrainingState.POST_BACKWARD:
            return False
        if in_backward and not self.settings.unshard_in_backward:
            return False
        self.unshard(async_op=True)
        return True

    def gathers_on_prefetch(self, in_backward: bool = False) -> bool:
        """Whether ``prefetch(in_backward)`` would issue an all-gather now."""
        return self.training_state is not TrainingState.POST_BACKWARD and self.unshard_needs_collective(in_backward)

    def bucket_entry(self) -> tuple[BucketKey, int, int] | None:
        """(key, gathered bytes, bucket limit) when this unit, about to gather, may share its
        all-gather with others (see [Note: Gather buckets]); None: it gathers alone."""
        limit = self.settings.all_gather_bucket_bytes
        if limit <= 0 or self._post_forward_shard is not None or self._gathered_version is not None:
            return None
        group = self.spec.mesh_info.shard
        key = bucket_key(self.gather, group, self.spec.offload)
        nbytes = gathered_bytes(self.gather, group)
        return None if key is None or nbytes > limit else (key, nbytes, limit)

    def finish_unused_prefetch(self) -> None:
        """A forward prefetch whose use did not come (the order changed): the unit
        ends as if it had run."""
        self.wait_for_unshard()
        if self.settings.reshard_after_forward:
            self.reshard()

    @outside_transforms
    def post_forward(self) -> None:
        settings = self.settings
        if settings.reshard_after_forward:
            if settings.post_forward_group is not None and self.is_unsharded:
                self.reshard_to_post_forward(settings.post_forward_group)
            else:
                self.reshard()
        elif self.is_unsharded and not torch.is_grad_enabled() and self.spec.presentation.sharded_after_no_grad_forward:
            self.show_shards()
        self.training_state = TrainingState.IDLE

    # -- backward (see [Note: When a unit's backward is done]) ---------------------
    def unshard_needs_collective(self, in_backward: bool = False) -> bool:
        """Whether gathering now (``in_backward``: ``pre_backward``) issues an all-gather."""
        return (not in_backward or self.settings.unshard_in_backward) and self._gather_needed()

    def start_use_backward(self, use: UnitUse | None, again: bool) -> bool:
        """Backward reached the outputs of ``use`` (None: a use whose inputs need no
        grad); ``again``: another use of the unit started backward before. Returns
        whether the unit is to gather for backward now (its first use)."""
        if use is not None and not use.in_backward:
            use.in_backward = True
            self._uses_in_backward += 1
        if not again:
            return self.training_state is not TrainingState.PRE_BACKWARD
        if self.settings.unshard_in_backward and self.training_state is TrainingState.POST_BACKWARD:
            self.unshard()  # this use's backward started after the unit's backward resharded it
        return False

    def pre_backward(self) -> None:
        """Gathers for backward (once per backward: see the schedule) and expects
        the gradients of the parameters that require them."""
        self.training_state = TrainingState.PRE_BACKWARD
        if self.settings.unshard_in_backward:
            self.unshard()
        else:
            self.wait_for_unshard()
        self.grads.expect()

    def _on_grad_ready(self, param: ShardParam) -> None:
        self.root.queue_end_of_backward()
        self.grads.awaiting.discard(param)
        self._maybe_finish_backward()

    def on_input_grads(self, use: UnitUse) -> None:
        if use.in_backward:
            use.in_backward = False
            self._uses_in_backward -= 1
        if self.training_state is TrainingState.POST_BACKWARD and not self._uses_in_backward:
            if self.settings.reshard_after_backward:
                self.reshard()  # gathered again for a later use (start_use_backward)
            return
        self._maybe_finish_backward()

    def _maybe_finish_backward(self) -> None:
        if not self.grads.awaiting and not self._uses_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            self.post_backward()

    def post_backward(self) -> None:
        """Reshards and hands this unit's gradients to reduction (idempotent)."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self.grads.awaiting = set()
        self.root.after_backward(self)
        settings = self.settings
        if not settings.requires_gradient_sync:
            self.grads.accumulate_unsynced()
            if settings.reshard_after_backward:
                self.reshard()
            return
        params, grads = self.grads.take()
        if settings.reshard_after_backward:
            self.reshard()
        if not params:
            return
        if self.reduction_gate is None:
            self.grads.submit(params, grads)
        else:
            self.reduction_gate(self, params, grads)

    def finalize_backward(self) -> None:
        """End of backward: reduce what is left, drop stray prefetches, go idle."""
        if self.training_state is not TrainingState.POST_BACKWARD and self.grads.owes_reduction():
            self.post_backward()
        if self._all_gather is not None:  # a prefetch whose unit never ran
            self.wait_for_unshard()
        if self.settings.reshard_after_backward and self.is_unsharded:
            self.reshard()
        self._go_idle()

    def _go_idle(self) -> None:
        self.training_state = TrainingState.IDLE
        self.grads.awaiting = set()
        self._uses_in_backward = 0

    def abandon_step(self) -> None:
        """After an exception cut a step short: no gather in flight, sharded, no
        gradient of that step kept (see ``RootContext.abandon_step``)."""
        self.reshard()  # waits for a gather in flight first
        self.grads.discard()
        self._go_idle()

    # -- forms (see [Note: Kept forms go stale]) ------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @outside_transforms
    def unshard(self, async_op: bool = False) -> None:
        """Gathers the full parameters and registers them (no-op if unsharded);
        ``async_op`` only starts the all-gather: ``wait_for_unshard`` finishes it."""
        if self._gathered_version is not None and self._kept_form_stale():  # no call for a form not kept
            self.reshard()
        if self.sharded_state is not ShardedState.UNSHARDED and self._all_gather is None and self.spec.params:
            self._start_all_gather(async_op)
        if not async_op:
            self._finish_unshard()

    def _start_all_gather(self, async_op: bool) -> None:
        spec, buffers = self.spec, self.buffers
        if buffers.shard_buffer.is_meta:
            raise buffers.unmaterialized()
        if self._post_forward_shard is None and spec.mesh_info.shard.size == 1:
            if not buffers.needs_cast and not buffers.extended and not spec.offload:
                self._alias_unsharded()
                return
        self._all_gather = self.gather.start(self._gather_input(), async_op, spec.label)

    def _kept_form_stale(self) -> bool:
        """Whether the shards changed in place since the kept form was gathered (see
        [Note: Kept forms go stale]); traced graphs keep their own forms."""
        version = self._gathered_version
        return version is not None and version != self._shards_version() and not torch.compiler.is_compiling()

    def _shards_version(self) -> int | None:
        """Grows with every in-place change of the shards (versions never decrease);
        None for shards made under ``torch.inference_mode`` (they keep no versions)."""
        buffer = self.buffers.shard_buffer
        if buffer.is_inference():
            return None
        version = buffer._version
        for param in self.spec.params:  # a loop: no generator to build, twice per unit and step
            version += param.sharded_param._version
        return version

    def _gather_input(self) -> GatherInput:
        """What this unit's all-gather sends (copied in), its layout and its group."""
        kept = self._post_forward_shard
        if kept is not None:
            return GatherInput(kept.source, kept.layout, kept.group)
        return self.gather.input(self.spec.label, self.spec.mesh_info.shard)

    def _gather_needed(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        if self._kept_form_stale():
            return self.spec.mesh_info.shard.size > 1
        if self.is_unsharded or self._all_gather is not None or not self.spec.params:
            return False
        if self._post_forward_shard is not None:
            return self._post_forward_shard.group.size > 1
        return self.spec.mesh_info.shard.size > 1

    def join_all_gather(self) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        self.gather.join(self._gather_input(), self.spec.label)

    def _alias_unsharded(self) -> None:
        buffers = self.buffers
        if buffers.view is not None:
            buffers.view.sync_requires_grad()
        for index, param in enumerate(self.spec.params):
            param.alias_unsharded(buffers.storage_layout.region(buffers.shard_buffer, index, param.orig_dtype))
            param.to_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    @outside_transforms
    def wait_for_unshard(self) -> None:
        """Finishes an in-flight unshard: copy-out and registration of full parameters."""
        self._finish_unshard()

    def _finish_unshard(self) -> None:  # wait_for_unshard, for callers outside transforms already
        in_flight, self._all_gather = self._all_gather, None
        if in_flight is None:
            if self._shows_shards_unsharded:  # kept unsharded but showing the shards
                self._register_unsharded()
            return
        self.gather.copy_out(in_flight, self.spec.label)
        if self._post_forward_shard is None:  # else still the version the kept shard came from
            self._gathered_version = self._shards_version()
        self._post_forward_shard = None
        self._register_unsharded()
        self.sharded_state = ShardedState.UNSHARDED

    def _register_unsharded(self) -> None:
        if self.buffers.view is not None:
            self.buffers.view.sync_requires_grad()
        for param in self.spec.params:
            param.to_unsharded()
        self._shows_shards_unsharded = False

    def show_shards(self) -> None:
        """Registers the shards but keeps the full parameters for the next use
        (a no-grad forward under a presentation that asks for it)."""
        for param in self.spec.params:
            param.to_sharded()
        self._shows_shards_unsharded = True

    @outside_transforms
    def reshard(self) -> None:
        """Frees the full parameters and registers the shards."""
        if self._all_gather is not None:
            self._finish_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self.spec.presentation.refuses_unsharded_data_assignment and self.is_unsharded:
            self._refuse_unsharded_data_assignment()
        trace.call("reshard", self.spec.label, self._free_and_register_shards)
        self._shows_shards_unsharded = False
        self._post_forward_shard = None
        self._gathered_version = None
        self.sharded_state = ShardedState.SHARDED

    def _free_and_register_shards(self) -> None:
        for param in self.spec.params:
            if not param.aliases_shard:
                param.free_unsharded()
            param.to_sharded()

    def _refuse_unsharded_data_assignment(self) -> None:
        assigned = [p.fqn for p in self.spec.params if p.unsharded_data_assigned()]
        if assigned:
            presentation = self.spec.presentation
            raise presentation.refusal(
                f"{self.spec.name}{presentation.refusal_setting}: the .data of gathered parameters {assigned} was "
                "assigned a new tensor while they were unsharded (between forward and backward, or after "
                "unshard()); its values cannot reach the shards. Assign .data outside forward and backward, or "
                "copy values in place inside summon_full_params(writeback=True)"
            )

    def reshard_to_post_forward(self, group: GroupInfo) -> None:
        """Keeps 1/k of the full parameters for a re-gather within the k-group."""
        kept, version = self.gather.keep_post_forward(self.spec.mesh_info.shard.size, group), self._gathered_version
        self.reshard()
        self._post_forward_shard, self._gathered_version = kept, version
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    def drop_post_forward_shard(self) -> None:
        """Forgets the larger shard kept since forward (the shards are registered)."""
        if self._post_forward_shard is not None:
            self._post_forward_shard = None
            self._gathered_version = None
            self.sharded_state = ShardedState.SHARDED

    def set_full_precision(self, full_precision: bool) -> None:
        """Gathers and computes in the parameters' own dtype (True) instead of the
        mixed-precision ``param_dtype``; the unsharded forms change dtype, so a
        change reshards first."""
        params = self.spec.params
        if all(p.full_precision == full_precision for p in params):
            return
        self.reshard()
        for param in params:
            param.full_precision = full_precision
        self.buffers.set_dtypes()

    def repack_after_apply(self) -> None:
        """``nn.Module._apply`` (``to_empty``, ``to``, ``half``) gave the shards new
        tensors: re-packs them into the shard buffer so the all-gather stays
        copy-free. ``_apply`` visits a unit over several modules (``[norm, head]``)
        one module at a time: re-packs once all its shards share a device again,
        since packing a moved half with a meta half would leave it all on meta."""
        if len({getattr(p.module_registration(), "device", None) for p in self.spec.params}) == 1:
            self.buffers.rebind(self.spec.name)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.spec.name}, {len(self.spec.params)} params)"


def prefetch_following(order: list[ParamGroup], start: int, step: int, in_backward: bool) -> list[ParamGroup]:
    """Starts gathering ``order[start]`` ahead of use, together with the units after it (``step``
    1 or -1) that may share its all-gather (see [Note: Gather buckets]); returns the units that
    started gathering."""
    head = order[start]
    entry = head.bucket_entry() if head.gathers_on_prefetch(in_backward) else None
    bucket = [head]
    if entry is not None:
        key, total, limit = entry
        index = start + step
        while 0 <= index < len(order):
            unit = order[index]
            index += step
            if not unit.gathers_on_prefetch(in_backward):
                if unit in bucket:  # used twice: the bucket ends at its second use
                    break
                continue  # already unsharded or in flight: nothing to gather
            joining = unit.bucket_entry()
            if joining is None or joining[0] != key or total + joining[1] > limit:
                break
            bucket.append(unit)
            total += joining[1]
    if len(bucket) == 1:
        return bucket if head.prefetch(in_backward) else []
    _gather_together(bucket)
    return bucket


@outside_transforms
def _gather_together(units: list[ParamGroup]) -> None:
    """Starts one all-gather for ``units`` (their bucket keys equal): each finishes it as
    its own (``wait_for_unshard``)."""
    for unit in units:
        if unit.buffers.shard_buffer.is_meta:
            raise unit.buffers.unmaterialized()
    head = units[0].spec
    in_flight = gather_bucket([u.gather for u in units], head.mesh_info.shard, head.label)
    for unit, gathering in zip(units, in_flight):
        unit._all_gather = gathering


# On the registered tensor itself: it lives exactly as long as the tensor.
_UNIT_ATTR = "_fullshard_unit"


def register_param_unit(tensor: torch.Tensor, unit: ParamGroup) -> None:
    """Records that ``tensor`` (a plain tensor the optimizer sees) holds shards of ``unit``."""
    setattr(tensor, _UNIT_ATTR, unit)


def unit_of(tensor: torch.Tensor) -> ParamGroup | None:
    """The unit ``tensor`` was registered with (None for DTensors and tensors outside units)."""
    return getattr(tensor, _UNIT_ATTR, None)


def buffer_param(unit: ParamGroup) -> torch.Tensor | None:
    """The one tensor a front end registered over ``unit``'s whole shard buffer (the
    wrapper's flat parameter; see ``BufferView``), if any."""
    return unit.buffers.view.tensor if unit.buffers.view is not None else None
