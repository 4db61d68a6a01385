"""What the units under one root share within and across steps.

The root's lazy init puts every state below it, and their units, under one
``RootContext`` (FSDP2's per-root state context): the schedule that orders
their gathers and prefetches (schedule.py, see [Note: Prefetch]), the
reduction queue each unit is handed when it joins (see [Note: Reduction
pipeline]), and the end-of-backward callback. The context knows the units; a
unit knows only the schedule, as its ``UnitRoot``.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn as nn
from torch.autograd import Variable

from . import offload
from .common import TrainingState
from .exec_order import CheckedSchedule, check_ranks_agree_on_units
from .group import ParamGroup
from .reduction import ReductionQueue
from .schedule import Schedule, ScheduledState


class ContextState(ScheduledState, Protocol):
    """What the context reads of a module state under it (``state.ModuleState``)."""

    @property
    def modules(self) -> tuple[nn.Module, ...]: ...

    def finish_forward_pass(self) -> None: ...

    def abandon_step(self) -> None: ...


class RootContext:
    """See the module docstring."""

    def __init__(self) -> None:
        self.all_states: list[ContextState] = []
        self.reductions = ReductionQueue()
        self.schedule = Schedule(self.queue_end_of_backward)
        self.iteration_root: ContextState | None = None
        self.end_of_backward_queued = False
        # False: this backward is not the step's last (micro-batching); its end leaves
        # reductions in flight instead of waiting, and keeps the prefetch order.
        self.is_last_backward = True
        # FSDPModule.set_post_optim_event's event: the next all-gather waits for it, once.
        self.post_optim_event: torch.Event | None = None
        self._units: list[ParamGroup] = []
        self._grouped_states: list[ContextState] = []

    def adopt(self, states: list[ContextState], validate: bool, root_name: str) -> None:
        """Puts ``states`` (the root's first) and their units under this context, once every
        rank agrees on them (see [Note: Ranks agree on the model]); ``validate``: check the
        execution order (see [Note: Execution order])."""
        self.all_states = states
        # Only a unit over several modules can end a forward with some not run (see finish_forward_pass).
        self._grouped_states = [s for s in states if len(s.modules) > 1]
        self._units = [s.group for s in states if s.group is not None]
        if self._units:
            mesh_info = self._units[0].spec.mesh_info
            check_ranks_agree_on_units(root_name, mesh_info, [unit.describe() for unit in self._units])
        gate = None
        if validate:
            checked = CheckedSchedule(self.queue_end_of_backward, self._units)
            self.schedule, gate = checked, checked.gate_reduction
        for unit in self._units:
            unit.join_root(self.schedule, self.reductions, gate)
        root_unit = states[0].group
        if root_unit is not None:  # backward needs the root's parameters first
            root_unit.settings.keep_unsharded_as_root()

    # -- forward ---------------------------------------------------------------------
    def begin_iteration(self, root: ContextState) -> None:
        self.iteration_root = root
        self.schedule.begin_iteration()

    def end_forward(self) -> None:
        """Finishes passes some of whose modules did not run, and reshards units
        whose prefetch went unused (the order changed)."""
        for state in self._grouped_states:
            if state is not self.iteration_root:
                state.finish_forward_pass()
        self.schedule.end_forward()
        self.iteration_root = None

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
        self.schedule.end_backward(self.is_last_backward)
        self.end_of_backward_queued = False
        if self.is_last_backward:
            self.reductions.drain()
            offload.wait_for_host_copies()  # offloaded gradients readable by the CPU optimizer

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
        self.schedule.abandon_step()
        self.iteration_root = None
        self.end_of_backward_queued = False  # autograd drops the callback of a failed backward

    @property
    def step_cut_short(self) -> bool:
        """Whether a forward or backward under this root stopped midway (an exception):
        seen when the root's next forward starts."""
        return self.end_of_backward_queued or any(
            state.training_state is TrainingState.FORWARD for state in self.all_states
        )
