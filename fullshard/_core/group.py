"""One communication unit: the parameters that one ``fully_shard`` call manages.

A unit costs one all-gather before it runs (again in backward when it was
resharded after forward) and one reduce-scatter of its gradients, no matter how
many parameters it has. This file is the unit's lifecycle in a step (forward
and backward transitions, when its backward is done); the forms of its
parameters and the moves between them (unshard, reshard) are in forms.py, what
happens to its gradients in grads.py (see [Note: Reduction pipeline]).

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
"""

from __future__ import annotations

import torch
import torch.nn as nn

from . import compat
from .bucket import BucketKey, bucket_key, gather_bucket, gathered_bytes
from .common import TrainingState, outside_transforms
from .forms import ParamForms, ShardedState
from .grads import GradIntake
from .param import ShardParam
from .reduction import ReductionQueue
from .root import ReductionGate, UnitRoot, Unrooted
from .spec import UnitSpec
from .unit_settings import UnitSettings


class UnitUse:
    """One forward call of a unit whose inputs need gradients (see [Note: When a
    unit's backward is done])."""

    __slots__ = ("in_backward",)

    def __init__(self) -> None:
        self.in_backward = False


class ParamGroup(ParamForms):
    """One unit's lifecycle in a step (see the module docstring), over its
    parameters' forms (``ParamForms``); ``settings`` are the user's run-time choices."""

    def __init__(self, spec: UnitSpec, settings: UnitSettings) -> None:
        super().__init__(spec)
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
        self.spec = self.grads.spec = self.spec.named(path)

    def describe(self) -> tuple:
        """What every rank of this unit's groups must agree on (see [Note: Ranks agree on the
        model] in exec_order.py): its name, its parameters and the settings that shape its collectives."""
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
        self.settings.choose_reshard_after_forward(reshard_after_forward)

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
        return (not in_backward or self.settings.unshard_in_backward) and super().unshard_needs_collective()

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
        unit.buffers.check_materialized()
    head = units[0].spec
    in_flight = gather_bucket([u.gather for u in units], head.mesh_info.shard, head.labels)
    for unit, gathering in zip(units, in_flight):
        unit._all_gather = gathering
