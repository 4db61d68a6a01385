"""A traced step (any model) played back with the engine's buffers: per-rank peak memory and step time of one choice.

The engine's side is ``replay.EngineReplay`` (the same gathers, prefetches,
buckets and reductions the reference Transformer's replay checks against the
real engine); the model's side is the trace's events, in the trace's order
(see [Note: Traced step]). An int ``reshard_after_forward`` keeps each block's
parameters split over that many ranks from forward to its backward gather
(its own buffer, freed at the copy-out), gathered alone (no bucket).
Gradient accumulation over ``k`` micro-batches is played as its last
micro-batch: the sharded gradients of the earlier ones are alive from its
start, and each reduced shard is added into them (the engine's
``set_requires_gradient_sync(True)`` default: every micro-batch reduces).
"""

from __future__ import annotations

from dataclasses import dataclass

from .choice import Choice
from .replay import ACTIVATIONS, GRADS, UNSHARDED_GRADS, EngineReplay, Reduction
from .segments import Segment
from .step_time import NO_WORK, StepClock, StepTime, Work, codec_work
from .trace import StepTrace
from .units import Unit, comm_per_step

__all__ = ["Prediction", "predict"]

BUFFERS, POST_FORWARD = "module buffers", "post-forward shards"


@dataclass(frozen=True)
class Prediction:
    """Rank 0's step under one choice. Bytes; seconds per optimizer step."""

    choice: Choice
    peak: int
    peak_phase: str
    peak_breakdown: dict[str, int]
    params: int  # sharded parameters, gradients, optimizer states: bytes each (states: all of them)
    grads: int
    optimizer_states: int
    activations: int  # alive at the end of forward
    host: int  # host memory under CPU offload
    comm: dict[str, int]  # bytes per optimizer step by collective
    time: StepTime
    flops: int  # per optimizer step

    @property
    def comm_bytes(self) -> int:
        return sum(self.comm.values())


def plan_units(trace: StepTrace, choice: Choice) -> list[Unit]:
    return [Unit(u.name, u.shapes, choice.shard_size, u.exact) for u in trace.units]


class TracedReplay(EngineReplay):
    """The trace's events with the engine's buffers; a ``StepClock`` listens."""

    def __init__(self, choice: Choice, trace: StepTrace, units: list[Unit], clock: StepClock) -> None:
        super().__init__(choice, units)
        self.choice, self.trace, self.clock = choice, trace, clock
        self.units = units
        self.position = 0
        self.post_forward: dict[str, int] = {}
        self.accumulating = choice.accumulation > 1

    def on_collective(self, op: str, names: tuple[str, ...], nbytes: int, unit: Unit | None = None) -> None:
        encode = self._codec(unit)[0] if unit is not None and self._coded else NO_WORK
        self.clock.collective(op, names, nbytes, encode)

    def on_wait(self, name: str) -> None:
        self.clock.wait(name)

    def on_copy_out(self, unit: Unit) -> None:
        if self._coded:
            self.clock.engine_work(self._codec(unit)[1])
        else:  # the gathered (or cast) values read, the unsharded parameters written
            self.clock.engine_work(Work(2 * unit.unsharded_numel * self.c, 1))

    def on_copy_in(self, unit: Unit) -> None:
        """Autograd's gradients read, the reduction's input written (cast and padded)."""
        self.clock.engine_work(Work(unit.numel * self.c + unit.gathered_numel * self.red, 1))

    @property
    def _coded(self) -> bool:
        return self.codes is not None and self.config.shard_size > 1

    def _codec(self, unit: Unit) -> tuple[Work, Work]:
        coded = unit.coded_shard_numel()
        exact = (unit.shard_numel - coded) * self.c
        return codec_work(coded, exact, self.config.shard_size, self.orig, self.c, self._fused_codec(unit))

    def wait(self, unit: Unit) -> None:
        """The copy-out, then the post-forward shard the gather came from is dropped."""
        super().wait(unit)
        if unit.name in self.unsharded:
            self.tape.free(POST_FORWARD, self.post_forward.pop(unit.name, 0))

    def run(self) -> None:
        buffers = sum(u.buffer_bytes for u in self.trace.units)
        self.tape.alloc(BUFFERS, buffers)
        if self.accumulating and self.states_on_device:  # the earlier micro-batches' reduced gradients
            self.tape.alloc(GRADS, sum(u.shard_numel for u in self.units) * self.orig)
        super().run()

    def forward(self) -> None:
        self._play(until="backward_start")

    def backward(self) -> None:
        self.clock.in_backward = True
        self._play(until=None)

    def _play(self, until: str | None) -> None:
        events = self.trace.folded
        while self.position < len(events):
            event = events[self.position]
            if isinstance(event, Segment):  # the model's operators, allocations and frees
                self.position += 1
                self.clock.segment(event)
                self.tape.alloc(ACTIVATIONS, event.rise)
                self.tape.free(ACTIVATIONS, event.rise - event.net)
                continue
            kind, index, value = event
            if kind == until:
                break
            self.position += 1
            if kind == "forward_pre" or kind == "backward_post":  # the engine's hooks: half a pass each
                self.clock.engine_work(units=0.5)
            if kind == "grad":
                self.tape.free(ACTIVATIONS, value)
                self.tape.alloc(UNSHARDED_GRADS, value)
            elif kind == "grad_free":
                self.tape.free(UNSHARDED_GRADS, value)
            elif kind == "backward_end":
                self._end_backward()
            elif kind != "backward_start":
                self._boundary(kind, index, value)

    def _boundary(self, kind: str, index: int, value: int) -> None:
        unit = self.units[index]
        blocks = self.blocks
        if kind == "forward_pre":
            self.gather(unit)
            self.wait(unit)
            self.prefetch(blocks, index, 1)  # the next block (the root: the first)
        elif kind == "forward_post" and index > 0 and self.choice.reshard_after_forward:
            self.reshard(unit)
            if self.choice.reshard_to is not None and self.choice.reshard_to < self.choice.shard_size:
                kept = unit.gathered_numel // self.choice.reshard_to * self.c
                self.post_forward[unit.name] = kept
                self.tape.alloc(POST_FORWARD, kept)
        elif kind == "backward_pre":
            self.pre_backward(unit, len(blocks) - 1 if index == 0 else index - 2)
        elif kind == "backward_post":
            self.post_backward(unit, grad_bytes=value)

    def _end_backward(self) -> None:
        for reduction in self.reductions:
            while not self._advance(reduction):
                pass
        self.reductions = []
        self.clock.end_backward()

    def prefetch(self, blocks: list[Unit], start: int, step: int) -> None:
        if self.clock.in_backward and self.post_forward:
            if 0 <= start < len(blocks):  # kept post-forward shards are gathered alone
                self.gather(blocks[start])
            return
        super().prefetch(blocks, start, step)

    def _advance(self, reduction: Reduction) -> bool:
        accepted = super()._advance(reduction)
        if accepted and self.accumulating and self.states_on_device:
            self.tape.free(GRADS, reduction.output // self.red * self.orig)  # added into the existing .grad
        return accepted


def predict(trace: StepTrace, choice: Choice, clock: StepClock) -> Prediction:
    """Peak memory and step time of ``choice`` on the traced step (one micro-batch; see the module's
    docstring for accumulation)."""
    units = plan_units(trace, choice)
    replay = TracedReplay(choice, trace, units, clock)
    replay.run()
    shards = sum(u.shard_numel for u in units) * choice.dtype.itemsize
    clock.optimizer_step(shards * (2 + choice.optimizer_states), sum(len(u.shapes) for u in units))
    time = clock.finish()
    comm, _ = comm_per_step(choice, units)
    per_step = {op: n * choice.accumulation for op, n in comm.items()}
    if choice.accumulation > 1:  # the micro-batches before the last: their compute and collectives again
        before = time.total - time.optimizer
        time.total += (choice.accumulation - 1) * before
        time.compute *= choice.accumulation
        time.engine *= choice.accumulation
        time.communication *= choice.accumulation
        time.exposed *= choice.accumulation
    time.comm_bytes = per_step
    return Prediction(
        choice=choice,
        peak=replay.tape.peak,
        peak_phase=replay.tape.peak_phase,
        peak_breakdown={k: v for k, v in replay.tape.at_peak.items() if v},
        params=shards,
        grads=shards,
        optimizer_states=shards * choice.optimizer_states,
        activations=replay.activations,
        host=(2 + choice.optimizer_states) * shards if choice.cpu_offload else 0,
        comm=per_step,
        time=time,
        flops=trace.flops * choice.accumulation,
    )
