"""A traced step's events folded into segments between the engine's boundaries: a playback costs per unit.

[Note: Trace segments]
Between two events the engine acts on (a unit boundary, a parameter's
gradient, the start and end of backward) a trace holds runs of operators,
allocations and frees that only the model does. ``fold`` replaces each run by
one ``Segment``: its operators' count and FLOPs (sorted, with the sums of the
largest, so that the time of "each operator's FLOPs or its overhead, whichever
is longer" is one bisection for any throughput and overhead), the bytes it
allocates (their memory traffic), its net change of live bytes and the highest
point the live bytes reach in it. Played back, a segment allocates up to that
highest point and frees down to its net: the same peak, the same breakdown at
the peak and the same times as the events one by one (checked by
``tests/test_plan_any_model.py``), since nothing the engine does happens
inside a run.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["Segment", "fold"]

_MODEL_KINDS = ("op", "alloc", "free")


@dataclass(frozen=True)
class Segment:
    """A run of the model's operators, allocations and frees (see [Note: Trace segments])."""

    operators: int
    flops: tuple[int, ...]  # the operators' FLOPs, ascending (zeros included)
    tail_flops: tuple[int, ...]  # tail_flops[i]: the sum of flops[i:]
    allocated: int  # bytes allocated in the run
    rise: int  # the highest live bytes above the run's start
    net: int  # live bytes at its end above its start

    def seconds(self, flop_rate: float, overhead: float, additive: bool) -> float:
        """The operators' time: FLOPs over ``flop_rate`` plus ``overhead`` each (``additive``: a
        CPU's host runs both), or the longer of the two each."""
        if additive:
            return self.tail_flops[0] / flop_rate + self.operators * overhead if self.operators else 0.0
        cut = bisect.bisect_right(self.flops, overhead * flop_rate)  # these take the overhead
        return cut * overhead + self.tail_flops[cut] / flop_rate


def _segment(flops: list[int], allocated: int, rise: int, net: int) -> Segment:
    ordered = sorted(flops)
    tails = [0] * (len(ordered) + 1)
    for index in range(len(ordered) - 1, -1, -1):
        tails[index] = tails[index + 1] + ordered[index]
    return Segment(len(ordered), tuple(ordered), tuple(tails), allocated, rise, net)


def fold(events: tuple[tuple[str, int, int], ...]) -> tuple[tuple[str, int, int] | Segment, ...]:
    """The events with each run of model events folded into a ``Segment``."""
    folded: list[tuple[str, int, int] | Segment] = []
    flops: list[int] = []
    allocated = live = rise = 0
    open_run = False
    for event in events:
        kind, _, value = event
        if kind in _MODEL_KINDS:
            open_run = True
            if kind == "op":
                flops.append(value)
            elif kind == "alloc":
                allocated += value
                live += value
                rise = max(rise, live)
            else:
                live -= value
            continue
        if open_run:
            folded.append(_segment(flops, allocated, rise, live))
            flops, allocated, live, rise, open_run = [], 0, 0, 0, False
        folded.append(event)
    if open_run:
        folded.append(_segment(flops, allocated, rise, live))
    return tuple(folded)
