"""When each unit of one root gathers: the forward and backward orders and the
prefetches they imply.

[Note: Prefetch]
Forward: units run in the same order every step, so the order recorded in the
previous step names the next unit; its all-gather is issued (once the current
unit's own gather is finished) and runs while the current unit computes.
Backward: the unit that ran before the current one in this step's forward. On
CPU the overlap comes from gloo's asynchronous work handles; on accelerators the
backend runs the collective on its own stream and ``Work.wait`` makes the
compute stream wait for it. Every rank derives the same decisions from the same
order, so collectives stay matched. Explicit lists
(``set_modules_to_forward_prefetch`` / ``..._backward_prefetch``) replace the
implicit choice. So by default at most one prefetched unit is in flight, or
one bucket of small units gathered together (see [Note: Gather buckets] in
all_gather.py), and ``fullshard plan`` models exactly that (see [Note: Plan model]).

The module hooks make one call each: ``before_forward`` (gather this unit,
prefetch the next one in forward) and ``before_backward`` (the same in
backward). At DETAIL debug level the root runs ``exec_order.CheckedSchedule``,
which checks every gather against the other ranks first; at other levels that
costs nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from ...api import BackwardPrefetch
from ..common import TrainingState
from ..settings import UnitConfig
from ..unit import ParamGroup, UnitUse, prefetch_following


class ScheduledState(Protocol):
    """What the schedule reads of a module state (``state.ModuleState``)."""

    training_state: TrainingState

    @property
    def config(self) -> UnitConfig: ...
    @property
    def group(self) -> ParamGroup | None: ...

    # Explicit prefetch targets (set_modules_to_{forward,backward}_prefetch); None: implicit.
    @property
    def forward_prefetch(self) -> Sequence[ScheduledState] | None: ...
    @property
    def backward_prefetch(self) -> Sequence[ScheduledState] | None: ...


class Schedule:
    """The orders and prefetches of one root's units (see the module docstring);
    the ``UnitRoot`` its units see."""

    def __init__(self, queue_end_of_backward: Callable[[], None]) -> None:
        self.queue_end_of_backward = queue_end_of_backward  # the root context's end-of-backward callback
        self.forward_order: list[ParamGroup] = []
        self.previous_forward_order: list[ParamGroup] = []  # names the next unit to prefetch in forward
        self.post_forward_order: list[ParamGroup] = []  # this step's forward uses: backward runs it in reverse
        self._post_forward_indices: dict[ParamGroup, list[int]] = {}  # each unit's uses in that order
        self._after_backward: dict[ParamGroup, list[ParamGroup]] = {}  # BackwardPrefetch.BACKWARD_POST
        self.prefetched: set[ParamGroup] = set()  # gathering ahead of their use

    def begin_iteration(self) -> None:
        self.previous_forward_order, self.forward_order = self.forward_order, []
        self.post_forward_order.clear()
        self._post_forward_indices.clear()

    # -- forward ---------------------------------------------------------------------
    def before_forward(self, state: ScheduledState, unit: ParamGroup) -> None:
        """Gathers ``unit`` (``state``'s) for its forward and prefetches the next one."""
        self.prefetched.discard(unit)
        self._gather_for_forward(unit)
        position = len(self.forward_order)
        self.forward_order.append(unit)
        if state.forward_prefetch is not None:
            for target in [s.group for s in state.forward_prefetch if s.group is not None]:
                self.prefetch(target)
        elif state.config.forward_prefetch:
            previous = self.previous_forward_order
            if position + 1 < len(previous) and previous[position] is unit:
                self.prefetch_following(previous, position + 1, 1)

    def _gather_for_forward(self, unit: ParamGroup) -> None:
        # Finish this unit's gather before starting the next one's: at most one
        # all-gather output is alive (its own was usually prefetched already).
        unit.unshard()

    def after_forward(self, unit: ParamGroup) -> None:
        """A forward use of ``unit`` whose backward will run (grad enabled) ended."""
        self._post_forward_indices.setdefault(unit, []).append(len(self.post_forward_order))
        self.post_forward_order.append(unit)

    def end_forward(self) -> None:
        """Finishes the units whose prefetch went unused (the order changed)."""
        for unit in self.prefetched:
            unit.finish_unused_prefetch()
        self.prefetched.clear()

    def prefetch(self, unit: ParamGroup, in_backward: bool = False) -> None:
        if unit.prefetch(in_backward):
            self.prefetched.add(unit)

    def prefetch_following(self, order: list[ParamGroup], start: int, step: int, in_backward: bool = False) -> None:
        """Prefetches ``order[start]`` and, in the same all-gather, the units after it
        (``step`` 1: forward, -1: backward) that agree with it (see [Note: Gather buckets])."""
        self.prefetched.update(prefetch_following(order, start, step, in_backward))

    # -- backward --------------------------------------------------------------------
    def before_backward(self, state: ScheduledState, use: UnitUse | None) -> None:
        """Backward reached the outputs of ``use`` of ``state``'s unit: gathers the
        unit (once per backward) and prefetches the one that ran before it."""
        self.queue_end_of_backward()
        unit = state.group
        again = state.training_state is TrainingState.PRE_BACKWARD  # another use's backward came first
        state.training_state = TrainingState.PRE_BACKWARD
        if unit is None or not unit.start_use_backward(use, again):
            return
        self._gather_for_backward(unit)  # waits for it before prefetching: see before_forward
        self.prefetched.discard(unit)  # used: what remains at the end of backward is stale
        indices = self._post_forward_indices.get(unit)
        index = indices.pop() if indices else None  # this use's place in the post-forward order
        mode = state.config.backward_prefetch
        if state.backward_prefetch is not None:
            targets = [s.group for s in state.backward_prefetch if s.group is not None]
        else:
            targets = [self.post_forward_order[index - 1]] if index and mode is not None else []
        if mode is BackwardPrefetch.BACKWARD_POST:
            self._after_backward[unit] = targets  # issued once this unit's gradients are out, alone
            return
        if state.backward_prefetch is None and targets and index:  # the units that ran before, in reverse
            self.prefetch_following(self.post_forward_order, index - 1, -1, in_backward=True)
            return
        for target in targets:
            self.prefetch(target, in_backward=True)

    def _gather_for_backward(self, unit: ParamGroup) -> None:
        unit.pre_backward()

    def after_backward(self, unit: ParamGroup) -> None:
        """``unit`` handed its gradients to reduction: its BACKWARD_POST prefetches."""
        for target in self._after_backward.pop(unit, ()):
            self.prefetch(target, in_backward=True)

    def end_backward(self, is_last: bool) -> None:
        for unit in self.prefetched:
            # Issued by a reduction finished at the end of backward (BACKWARD_POST): it gathered
            # the values the optimizer is about to change, so the next forward must not use them.
            unit.reshard()
        self.prefetched.clear()
        self._post_forward_indices.clear()
        if is_last:
            self.post_forward_order.clear()

    def abandon_step(self) -> None:
        """Forgets the orders of a step an exception cut short (see ``RootContext.abandon_step``)."""
        self.prefetched.clear()
        self.forward_order, self.previous_forward_order = [], []
        self.post_forward_order.clear()
        self._post_forward_indices.clear()
        self._after_backward.clear()
