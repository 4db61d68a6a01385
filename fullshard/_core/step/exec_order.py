"""Execution-order validation, on at ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

[Note: Execution order]
Collectives are matched by order, not by name: if ranks gather different units
at the same point (a data-dependent branch, a rank-dependent freeze), two
same-sized all-gathers silently swap data and differently-sized ones hang. At
DETAIL level the engine stops at every point where it is about to all-gather
(forward, backward) or reduce-scatter a unit, and the ranks exchange a
fingerprint of what they are about to do: the unit's index in the root's
order, and its parameters' FQNs and shapes (two units with the same number of
elements still differ).
  - First iteration: if the forward fingerprints differ, every rank raises
    "Forward order differs across ranks", before any mismatched collective runs.
  - Later iterations: a rank whose forward order departs from its first
    iteration's warns once. The ranks then run the union of what they asked
    for, unit by unit in the root's order, each joining the others' collectives
    (gathering into scratch, reducing zero gradients, as DDP does for unused
    parameters): nothing hangs, and the gradients stay those of the union.
Prefetching is off meanwhile, so every collective passes a check. At other
debug levels none of this exists: the root runs a plain ``schedule.Schedule``
and its units reduce without a gate (``CheckedSchedule`` below is the DETAIL one).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import NamedTuple, cast

import torch
import torch.distributed as dist

from .. import comm
from ..common import TrainingState
from ..gather import ShardParam
from ..unit import ParamGroup
from .schedule import Schedule


class Fingerprint(NamedTuple):
    """What a rank is about to do; equal on every rank when the order agrees."""

    kind: str  # "forward", "backward" (all-gathers) or "reduce"
    unit: int  # the unit's index in the root's order
    collective: bool  # whether this rank issues the collective (False: nothing to gather)
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (FQN, shape) of the parameters involved


class Agreed(NamedTuple):
    """A collective every rank runs: unit ``unit``'s, for its parameters ``names``."""

    unit: int
    names: list[str]


class ExecOrderValidator:
    """See [Note: Execution order]. Units are named by their index in the root's order."""

    def __init__(self) -> None:
        self.iteration = -1
        self.first_forward: list[int] | None = None
        self.forward: list[int] = []
        self.warned = False

    def begin_iteration(self) -> None:
        if self.iteration == 0:
            self.first_forward = self.forward
        self.iteration += 1
        self.forward = []

    def _exchange(self, fingerprint: Fingerprint) -> list[Fingerprint]:
        return cast(list[Fingerprint], comm.all_gather_objects(fingerprint))  # every rank sends one

    def _describe(self, fingerprint: Fingerprint) -> str:
        listing = ", ".join(f"{name} {list(shape)}" for name, shape in fingerprint.params)
        return f"unit {fingerprint.unit} ({listing})"

    def _union(self, fingerprints: list[Fingerprint]) -> list[Agreed]:
        """Each collective some rank asked for, in the root's order."""
        wanted = sorted({(f.unit, f.params) for f in fingerprints if f.collective})
        return [Agreed(unit, [name for name, _ in params]) for unit, params in wanted]

    def gate_forward(self, mine: Fingerprint) -> list[Agreed] | None:
        """Before a unit's forward. Returns None if all ranks agree, else the
        collectives every rank must run, in order (see ``_union``)."""
        self._record_forward(mine.unit)
        fingerprints = self._exchange(mine)
        if all(f == mine for f in fingerprints):
            return None
        if self.iteration == 0:
            differing = next(r for r, f in enumerate(fingerprints) if f != fingerprints[0])
            raise RuntimeError(
                f"Forward order differs across ranks: rank 0 is all-gathering {self._describe(fingerprints[0])} "
                f"but rank {differing} is all-gathering {self._describe(fingerprints[differing])}. Every rank must "
                "run the sharded modules in the same order (data-dependent or rank-dependent control flow?)"
            )
        return self._union(fingerprints)

    def gate(self, mine: Fingerprint) -> list[Agreed] | None:
        """Before a backward all-gather (``kind="backward"``) or a reduction (``"reduce"``)."""
        fingerprints = self._exchange(mine)
        return None if all(f == mine for f in fingerprints) else self._union(fingerprints)

    def _record_forward(self, index: int) -> None:
        position = len(self.forward)
        self.forward.append(index)
        first = self.first_forward
        if first is None or self.warned:
            return
        if position >= len(first) or first[position] != index:
            self.warned = True
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank {dist.get_rank()}. "
                "Collectives are unchecked and may give incorrect results or hang without the DETAIL debug "
                "level; at DETAIL (this run) fullshard checks them instead: each waits until the ranks agree "
                "on one order, so this step stays correct but slower. Run the units in one order on every "
                "rank and iteration",
                UserWarning,
                stacklevel=6,
            )


class CheckedSchedule(Schedule):
    """The schedule at DETAIL debug level: every gather and reduction of a unit
    waits until the ranks agreed on it (see [Note: Execution order])."""

    def __init__(self, queue_end_of_backward: Callable[[], None], units: list[ParamGroup]) -> None:
        super().__init__(queue_end_of_backward)
        self.validator = ExecOrderValidator()
        self._units = units  # the root's order: a unit's index names it across ranks
        self._unit_index = {unit: index for index, unit in enumerate(units)}

    def begin_iteration(self) -> None:
        super().begin_iteration()
        self.validator.begin_iteration()

    def abandon_step(self) -> None:
        super().abandon_step()
        self.validator = ExecOrderValidator()

    def prefetch(self, unit: ParamGroup, in_backward: bool = False) -> None:
        pass  # every gather passes the order check instead

    def prefetch_following(self, order: list[ParamGroup], start: int, step: int, in_backward: bool = False) -> None:
        pass  # nor are units gathered in buckets (see [Note: Gather buckets])

    def _gather_for_forward(self, unit: ParamGroup) -> None:
        fingerprint = self._fingerprint("forward", unit, unit.unshard_needs_collective())
        self._run_agreed_all_gathers(self.validator.gate_forward(fingerprint), unit)
        super()._gather_for_forward(unit)

    def _gather_for_backward(self, unit: ParamGroup) -> None:
        gathers = unit.unshard_needs_collective(in_backward=True)
        self._run_agreed_all_gathers(self.validator.gate(self._fingerprint("backward", unit, gathers)), unit)
        super()._gather_for_backward(unit)

    def gate_reduction(self, unit: ParamGroup, params: list[ShardParam], grads: list[torch.Tensor]) -> None:
        """Starts reducing ``unit``'s gradients ``grads`` (of ``params``) once the ranks agreed
        on it; joins the reductions other ranks asked for, in the agreed order."""
        agreed = self.validator.gate(self._fingerprint("reduce", unit, True, params))
        if agreed is None:
            unit.grads.submit(params, grads)
            return
        for index, names in agreed:  # the same order on every rank
            other = self._units[index]
            if other is unit and names == [p.fqn for p in params]:
                unit.grads.submit(params, grads)
            else:
                _join_reduction(other, names)

    def _fingerprint(
        self, kind: str, unit: ParamGroup, collective: bool, params: list[ShardParam] | None = None
    ) -> Fingerprint:
        shapes = tuple((p.fqn, tuple(p.global_size)) for p in params or unit.spec.params)
        return Fingerprint(kind, self._unit_index[unit], collective, shapes)

    def _run_agreed_all_gathers(self, agreed: list[Agreed] | None, mine: ParamGroup) -> None:
        """Runs the all-gathers the ranks agreed on: this rank's own for real, the
        others' into scratch."""
        for index, _ in agreed or []:
            unit = self._units[index]
            if unit is mine and unit.unshard_needs_collective():
                unit.unshard()
            else:
                unit.join_all_gather()


def _join_reduction(unit: ParamGroup, names: list[str]) -> None:
    """Takes part in another rank's reduction of ``unit``'s parameters ``names`` with
    zero gradients; the averaged result is this rank's gradient too, as DDP does
    for unused parameters."""
    params = [p for p in unit.spec.params if p.fqn in names]
    grads = [unit.grads.zero_grad(p) for p in params]
    if unit.training_state is TrainingState.IDLE:
        unit.training_state = TrainingState.POST_BACKWARD  # it will not run here this time
    unit.grads.submit(params, grads)
