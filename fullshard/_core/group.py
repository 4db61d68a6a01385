"""One communication unit: the parameters that one ``fully_shard`` call manages.

A unit costs one all-gather before it runs (again in backward when it was
resharded after forward) and one reduce-scatter of its gradients, no matter how
many parameters it has. This file is the unit's lifecycle (unshard, reshard,
forward and backward transitions); its shard buffer is in buffers.py (see
[Note: Unit buffers]), its all-gather steps in all_gather.py, and what happens
to its gradients in grads.py (see [Note: Reduction pipeline]).

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

import enum

import torch

from . import compat, trace
from .all_gather import AllGather, AllGatherInFlight, PostForwardShard
from .buffers import UnitBuffers
from .common import TrainingState, outside_transforms
from .grads import GradIntake
from .layout import Layout
from .mesh import GroupInfo
from .param import ShardParam
from .reduction import ReduceSettings, ReductionQueue
from .root import ReductionGate, UnitRoot, Unrooted
from .spec import UnitSpec


class ShardedState(enum.Enum):
    SHARDED = enum.auto()  # only this rank's shards exist
    SHARDED_POST_FORWARD = enum.auto()  # a larger shard for the smaller post-forward group
    UNSHARDED = enum.auto()  # full parameters registered on the modules


class UnitUse:
    """One forward call of a unit whose inputs need gradients (see [Note: When a
    unit's backward is done])."""

    __slots__ = ("in_backward",)

    def __init__(self) -> None:
        self.in_backward = False


class ParamGroup:
    """One unit's lifecycle over its parameters (see the module docstring); what the
    unit is (parameters, mesh, devices, name) is its ``spec`` (see [Note: Unit spec])."""

    def __init__(
        self, spec: UnitSpec, reshard_after_forward: bool, post_forward: GroupInfo | None, chosen: bool
    ) -> None:
        """``chosen``: the user set ``reshard_after_forward`` (the root keeps it too)."""
        self.spec = spec
        self.buffers = UnitBuffers(spec, [p.bound_rows for p in spec.params])
        self.gather = AllGather(spec, self.buffers)
        self.reduce_settings = ReduceSettings()
        self.grads = GradIntake(spec, self.buffers, self.reduce_settings)
        # Run-time settings (FSDPModule's setters).
        self.reshard_after_forward = reshard_after_forward
        self.post_forward_group = post_forward  # None unless resharding to a smaller group
        self._reshard_after_forward_chosen = chosen
        self.reshard_after_backward = True
        self.requires_gradient_sync = True
        self.unshard_in_backward = True  # False: backward needs no parameter values (embeddings)
        # Lifecycle.
        self.root: UnitRoot[ParamGroup] = Unrooted()  # the root's schedule from its lazy init on
        self.reduction_gate: ReductionGate | None = None  # the order check's, at DETAIL debug level
        self.training_state = TrainingState.IDLE
        self.sharded_state = ShardedState.SHARDED
        self._all_gather: AllGatherInFlight | None = None
        self._shows_shards_unsharded = False  # see show_shards
        self._post_forward_shard: PostForwardShard | None = None
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
        self.buffers.adopt_registered(self.spec.name)

    def set_module_path(self, path: str) -> None:
        """The root's lazy init knows the managed module's ``path`` in the model."""
        self.spec = self.spec.named(path)
        self.grads.spec = self.spec

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
        self.buffers.set_gather_layout()

    # -- unshard / reshard -------------------------------------------------------
    @property
    def is_unsharded(self) -> bool:
        return self.sharded_state is ShardedState.UNSHARDED

    @outside_transforms
    def unshard(self, async_op: bool = False) -> None:
        """Starts gathering the full parameters (no-op if unsharded or in flight)."""
        if self.is_unsharded or self._all_gather is not None or not self.spec.params:
            return
        spec, buffers = self.spec, self.buffers
        buffers.check_materialized()
        if self._post_forward_shard is None and spec.mesh_info.shard.size == 1:
            if not buffers.needs_cast and not buffers.extended and not spec.offload:
                self._alias_unsharded()
                return
        self._all_gather = self.gather.start(*self._gather_input(), async_op, spec.labels)

    def _gather_input(self) -> tuple[torch.Tensor, Layout, GroupInfo]:
        """What this unit's all-gather sends (copied in), its layout and its group."""
        kept = self._post_forward_shard
        if kept is not None:
            return kept.source, kept.layout, kept.group
        source, layout = self.gather.input(self.spec.labels)
        return source, layout, self.spec.mesh_info.shard

    def unshard_needs_collective(self) -> bool:
        """Whether ``unshard()`` would issue an all-gather now."""
        if self.is_unsharded or self._all_gather is not None or not self.spec.params:
            return False
        if self._post_forward_shard is not None:
            return self._post_forward_shard.group.size > 1
        return self.spec.mesh_info.shard.size > 1

    def join_all_gather(self) -> None:
        """Takes part in another rank's all-gather of this unit, into scratch
        (execution-order validation, see [Note: Execution order])."""
        self.gather.join(*self._gather_input(), self.spec.labels)

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
        in_flight, self._all_gather = self._all_gather, None
        if in_flight is None:
            if self._shows_shards_unsharded:  # kept unsharded but showing the shards
                self._register_unsharded()
            return
        self.gather.copy_out(in_flight, self.spec.labels)
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
            self.wait_for_unshard()
        if self.sharded_state is ShardedState.SHARDED:
            return
        if self.spec.presentation.refuses_unsharded_data_assignment and self.is_unsharded:
            self._refuse_unsharded_data_assignment()
        with trace.span(self.spec.labels.reshard):
            for param in self.spec.params:
                if param.aliases_shard:
                    continue
                param.free_unsharded()
            for param in self.spec.params:
                param.to_sharded()
        self._shows_shards_unsharded = False
        self._post_forward_shard = None
        self.sharded_state = ShardedState.SHARDED

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

    def _reshard_to_post_forward(self, group: GroupInfo) -> None:
        """Keeps 1/k of the full parameters for a re-gather within the k-group."""
        kept = self.gather.keep_post_forward(self.spec.mesh_info.shard.size, group)
        self.reshard()
        self._post_forward_shard = kept
        self.sharded_state = ShardedState.SHARDED_POST_FORWARD

    # -- forward -------------------------------------------------------------------
    @outside_transforms
    def post_forward(self) -> None:
        if self.reshard_after_forward:
            group = self.post_forward_group
            if group is not None and self.is_unsharded:
                self._reshard_to_post_forward(group)
            else:
                self.reshard()
        elif self.is_unsharded and not torch.is_grad_enabled() and self.spec.presentation.sharded_after_no_grad_forward:
            self.show_shards()
        self.training_state = TrainingState.IDLE

    # -- backward (see [Note: When a unit's backward is done]) ---------------------
    def pre_backward(self) -> None:
        """Gathers for backward (once per backward: see the schedule) and expects
        the gradients of the parameters that require them."""
        self.training_state = TrainingState.PRE_BACKWARD
        if self.unshard_in_backward:
            self.unshard()
        self.wait_for_unshard()
        self.grads.expect()

    def set_reshard_after_forward(self, reshard_after_forward: bool) -> None:
        """A bool reshards fully or not at all, dropping a smaller post-forward group."""
        if self._post_forward_shard is not None:  # 1/k kept since forward: the shards are registered
            self._post_forward_shard = None
            self.sharded_state = ShardedState.SHARDED
        self.reshard_after_forward = reshard_after_forward
        self._reshard_after_forward_chosen = True
        self.post_forward_group = None

    def keep_unsharded_as_root(self) -> None:
        """Unless the user chose: the root keeps its parameters (backward needs them first)."""
        if not self._reshard_after_forward_chosen:
            self.reshard_after_forward = False

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

    def _on_grad_ready(self, param: ShardParam) -> None:
        self.root.queue_end_of_backward()
        self.grads.awaiting.discard(param)
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
        if not self.grads.awaiting and not self._uses_in_backward and self.training_state is TrainingState.PRE_BACKWARD:
            self.post_backward()

    def post_backward(self) -> None:
        """Reshards and hands this unit's gradients to reduction (idempotent)."""
        if self.training_state is TrainingState.POST_BACKWARD:
            return
        self.training_state = TrainingState.POST_BACKWARD
        self.grads.awaiting = set()
        self.root.after_backward(self)
        if not self.requires_gradient_sync:
            self.grads.accumulate_unsynced()
            if self.reshard_after_backward:
                self.reshard()
            return
        params, grads = self.grads.take()
        if self.reshard_after_backward:
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
        if self.reshard_after_backward and self.is_unsharded:
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

    def __repr__(self) -> str:
        return f"ParamGroup({self.spec.name}, {len(self.spec.params)} params)"
