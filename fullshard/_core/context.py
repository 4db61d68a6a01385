"""What the units under one root share within and across steps.

The root's lazy init puts every state below it, and their units, under one
``RootContext`` (FSDP2's per-root state context): the forward orders that drive
prefetching (see [Note: Prefetch]), the reduction queue, the execution-order
validator (see [Note: Execution order]) and the end-of-backward callback. The
context knows the units; a unit knows its context only as ``UnitRoot``.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch.autograd import Variable

from . import offload
from .common import TrainingState
from .exec_order import Agreed, ExecOrderValidator, Fingerprint
from .group import ParamGroup
from .param import ShardParam
from .reduction import ReductionQueue


class ContextState(Protocol):
    """What the context reads of a module state under it (``state.ModuleState``)."""

    training_state: TrainingState

    @property
    def group(self) -> ParamGroup | None: ...

    def finish_forward_pass(self) -> None: ...

    def abandon_step(self) -> None: ...


class RootContext:
    """See the module docstring; a ``UnitRoot`` for every unit under the root."""

    def __init__(self) -> None:
        self.all_states: list[ContextState] = []
        self.reductions = ReductionQueue()
        self.iteration_root: ContextState | None = None
        self.forward_order: list[ParamGroup] = []
        self.previous_forward_order: list[ParamGroup] = []
        self.post_forward_order: list[ParamGroup] = []
        self.prefetched: set[ParamGroup] = set()
        self.end_of_backward_queued = False
        # False: this backward is not the step's last (micro-batching); its end leaves
        # reductions in flight instead of waiting, and keeps the prefetch order.
        self.is_last_backward = True
        self.validator: ExecOrderValidator | None = None  # at TORCH_DISTRIBUTED_DEBUG=DETAIL
        # FSDPModule.set_post_optim_event's event: the next all-gather waits for it, once.
        self.post_optim_event: torch.Event | None = None
        self._units: list[ParamGroup] = []  # the root's order: a unit's index names it across ranks
        self._unit_index: dict[ParamGroup, int] = {}

    def adopt(self, states: list[ContextState], validate: bool) -> None:
        """Puts ``states`` (the root's first) and their units under this context."""
        self.all_states = states
        self._units = [s.group for s in states if s.group is not None]
        self._unit_index = {unit: index for index, unit in enumerate(self._units)}
        for unit in self._units:
            unit.ctx = self
        if validate:
            self.validator = ExecOrderValidator()

    # -- forward ---------------------------------------------------------------------
    def begin_iteration(self, root: ContextState) -> None:
        self.iteration_root = root
        if self.validator is not None:
            self.validator.begin_iteration()
        self.previous_forward_order, self.forward_order = self.forward_order, []
        self.post_forward_order.clear()
        for unit in self._units:
            unit.forget_post_forward_uses()

    def end_forward(self) -> None:
        """Finishes passes some of whose modules did not run, and reshards units
        whose prefetch went unused (the order changed)."""
        for state in self.all_states:
            if state is not self.iteration_root:
                state.finish_forward_pass()
        for group in self.prefetched:
            group.wait_for_unshard()
            if group.reshard_after_forward:
                group.reshard()
        self.prefetched.clear()
        self.iteration_root = None

    def implicit_forward_prefetch(self, group: ParamGroup) -> ParamGroup | None:
        position = len(self.forward_order)
        self.forward_order.append(group)
        previous = self.previous_forward_order
        if position + 1 < len(previous) and previous[position] is group:
            return previous[position + 1]
        return None

    def prefetch(self, group: ParamGroup) -> None:
        if self.validator is not None:
            return  # every gather passes the order check instead; see [Note: Execution order]
        if group.is_unsharded or group.training_state is TrainingState.POST_BACKWARD:
            return
        self.prefetched.add(group)
        group.unshard(async_op=True)

    def record_post_forward(self, group: ParamGroup) -> int:
        self.post_forward_order.append(group)
        return len(self.post_forward_order) - 1

    # -- backward --------------------------------------------------------------------
    def queue_end_of_backward(self) -> None:
        if not self.end_of_backward_queued:
            self.end_of_backward_queued = True
            Variable._execution_engine.queue_callback(self.end_of_backward)

    def end_of_backward(self) -> None:
        for state in self.all_states:
            if state.group is not None:
                state.group.finalize_backward()
            state.training_state = TrainingState.IDLE
        for group in self.prefetched:
            # Issued by a reduction finished here (BACKWARD_POST): it gathered the values
            # the optimizer is about to change, so the next forward must not use them.
            group.reshard()
        self.prefetched.clear()
        self.end_of_backward_queued = False
        if self.is_last_backward:
            self.reductions.drain()
            offload.wait_for_host_copies()  # offloaded gradients readable by the CPU optimizer
            self.post_forward_order.clear()

    def abandon_step(self) -> None:
        """Forgets a step an exception cut short in forward or backward: waits for the
        collectives in flight, drops its reductions and gradients, reshards every
        unit and starts the next step afresh (``FSDPModule.reset_iter_state``)."""
        self.reductions.discard()
        offload.wait_for_host_copies()
        for state in self.all_states:
            state.abandon_step()
        for unit in self._units:
            unit.abandon_step()
        self.prefetched.clear()
        self.iteration_root = None
        self.forward_order, self.previous_forward_order = [], []
        self.post_forward_order.clear()
        self.end_of_backward_queued = False  # autograd drops the callback of a failed backward
        if self.validator is not None:
            self.validator = ExecOrderValidator()

    @property
    def step_cut_short(self) -> bool:
        """Whether a forward or backward under this root stopped midway (an exception):
        seen when the root's next forward starts."""
        return self.end_of_backward_queued or any(
            state.training_state is TrainingState.FORWARD for state in self.all_states
        )

    def reduce(self, group: ParamGroup, params: list[ShardParam], grads: list[torch.Tensor]) -> None:
        """Starts reducing ``group``'s gradients ``grads`` (of ``params``), after the
        ranks agreed on it at DETAIL debug level (see [Note: Execution order])."""
        validator = self.validator
        agreed = validator.gate(self._fingerprint("reduce", group, True, params)) if validator else None
        if agreed is None:
            group.grads.submit(params, grads, self.reductions)
            return
        for index, names in agreed:  # the same order on every rank
            unit = self._units[index]
            if unit is group and names == [p.fqn for p in params]:
                group.grads.submit(params, grads, self.reductions)
            else:
                unit.join_reduction(names, self.reductions)

    # -- execution order (see [Note: Execution order]) ------------------------------
    def check_forward_order(self, group: ParamGroup) -> None:
        """Before a unit's forward all-gather, at DETAIL debug level."""
        if self.validator is not None:
            fingerprint = self._fingerprint("forward", group, group.unshard_needs_collective())
            self._run_agreed_all_gathers(self.validator.gate_forward(fingerprint), group)

    def check_backward_order(self, group: ParamGroup) -> None:
        """Before a unit's backward all-gather, at DETAIL debug level."""
        if self.validator is not None:
            gathers = group.unshard_in_backward and group.unshard_needs_collective()
            fingerprint = self._fingerprint("backward", group, gathers)
            self._run_agreed_all_gathers(self.validator.gate(fingerprint), group)

    def _fingerprint(
        self, kind: str, group: ParamGroup, collective: bool, params: list[ShardParam] | None = None
    ) -> Fingerprint:
        shapes = tuple((p.fqn, tuple(p.global_size)) for p in params or group.params)
        return Fingerprint(kind, self._unit_index[group], collective, shapes)

    def _run_agreed_all_gathers(self, agreed: list[Agreed] | None, mine: ParamGroup) -> None:
        """Runs the all-gathers the ranks agreed on: this rank's own for real, the
        others' into scratch."""
        for index, _ in agreed or []:
            group = self._units[index]
            if group is mine and group.unshard_needs_collective():
                group.unshard()
                group.wait_for_unshard()
            else:
                group.join_all_gather()
