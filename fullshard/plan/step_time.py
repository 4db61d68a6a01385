"""Step time of one sharding choice: compute and communication on two clocks, overlapped as the engine overlaps them.

[Note: Step time model]
Two timelines run through a traced step's events (see [Note: Traced step]):
the compute stream advances by each operator's FLOPs over the profile's
matmul throughput in the compute dtype (or its launch and dispatch overhead,
when that is longer: small operators are overhead-bound; on a CPU the host
runs both in turn, so they add), plus the bytes it allocates written and read
once over the memory bandwidth (element-wise work); the link advances by each
collective, issued when the engine issues it (an all-gather when a unit is
gathered or prefetched, a reduce-scatter or all-reduce at a unit's
post-backward) and queued behind the ones before it. Compute waits only where
the engine waits: for a unit's all-gather before its forward or backward, and
for every reduction at the end of backward. So the next unit's all-gather
hides behind this unit's compute when the link keeps up, and shows when it
does not. Where collectives do not overlap compute (a CPU profile: gloo works
on the rank's own cores, see [Note: Device profiles]) each one's time is the
compute clock's. Collectives are rings: an all-gather or reduce-scatter of
``B`` bytes (the gathered size) over ``n`` ranks sends ``(n-1)/n B`` per rank,
an all-reduce twice that, plus ``n-1`` (all-reduce: ``2(n-1)``) latencies, at
the bus bandwidth measured for that collective where the profile has one,
else the link's; a group within one node uses NVLink, one across nodes the
slower inter-node link (hybrid sharding's point: its shard group stays in a
node).

The engine's own work is on the compute clock too: per unit and pass its
host work (``unit_overhead``: hooks, the calls of the copy-in and copy-out),
the copy-out of a gathered unit into its parameters and the copy-in of its
gradients into the reduce-scatter input (each one read and one write of the
unit's bytes), and under a quantized all-gather the codec (see [Note: Codec
cost]) in place of the copy-out. CPU offload adds each gathered shard's
host-to-device copy before its all-gather (on the link's side where
collectives overlap) and each reduced shard's copy back, and runs the
optimizer in host memory. The optimizer reads and writes the shards,
gradients and states three times over, plus its host work per parameter
tensor (``optimizer_overhead``). Not modelled: the compute slowdown of
communication kernels sharing the GPU, stragglers, congestion between nodes;
so the figures rank choices and are meant as estimates, not promises.

[Note: Codec cost]
A quantized all-gather encodes this rank's coded values into its chunk before
the collective and decodes every rank's chunk into the unsharded parameters
after it, in place of the copy-out: passes over memory, counted in bytes read
and written at the memory bandwidth, plus an operator's overhead per pass.
The eager codec (an accelerator's, or a small unit's on the CPU) makes six
fp32 passes over the shard's coded values to encode (cast, block maxima,
scale, round, clamp, narrow: 4 bytes each) and three over the gathered coded
values to decode (widen, scale, narrow into the parameters). The CPU's fused
codec (see [Note: Fused codec] in ``fullshard/_core/gather/codec/fused_codec.py``)
reads each shard value once and writes its one-byte code, and reads each code
once and writes the parameter in the compute dtype. The exact values (norms,
biases, embeddings) are copied in and out as a plain gather's are. Checked
against the codec's own timings in benchmarks/RESULTS.md (issue 37).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import NamedTuple

from .choice import Choice
from .profiles import DeviceProfile
from .segments import Segment

__all__ = ["NO_WORK", "StepClock", "StepTime", "Work", "codec_work"]

_EAGER_ENCODE_PASSES, _EAGER_DECODE_PASSES = 6, 3


@dataclass
class StepTime:
    """Seconds of one optimizer step, and where they went."""

    total: float = 0.0
    compute: float = 0.0  # on the compute stream, waits excluded (the engine's work included)
    communication: float = 0.0  # the link busy
    exposed: float = 0.0  # compute stalled on a collective
    optimizer: float = 0.0
    engine: float = 0.0  # of compute: the engine's host work, copies and codec
    comm_bytes: dict[str, int] = field(default_factory=dict)


class Work(NamedTuple):
    """Memory work of the engine: bytes read and written, counted once each, in so many operators."""

    nbytes: int
    operators: int


NO_WORK = Work(0, 0)


def codec_work(
    coded: int, exact_bytes: int, ranks: int, value_bytes: int, out_bytes: int, fused: bool
) -> tuple[Work, Work]:
    """(encode, decode) of one unit (see [Note: Codec cost]): this rank's ``coded`` values and
    ``exact_bytes`` encoded, every one of the ``ranks`` chunks decoded; ``value_bytes``: a shard
    value as the encode reads it, ``out_bytes``: a parameter value as the decode writes it."""
    gathered = ranks * coded
    if fused:
        encode = Work(coded * (value_bytes + 1) + 2 * exact_bytes, 2)
        decode = Work(gathered * (1 + out_bytes) + 2 * ranks * exact_bytes, 2)
    else:
        encode = Work(_EAGER_ENCODE_PASSES * 4 * coded + 2 * exact_bytes, _EAGER_ENCODE_PASSES + 1)
        decode = Work(_EAGER_DECODE_PASSES * 4 * gathered + 2 * ranks * exact_bytes, _EAGER_DECODE_PASSES + 1)
    return encode, decode


class StepClock:
    """Compute stream and link of one rank (see [Note: Step time model])."""

    def __init__(self, profile: DeviceProfile, choice: Choice) -> None:
        self.profile, self.choice = profile, choice
        self.now = 0.0
        self.link_free = 0.0
        self.ready: dict[str, float] = {}
        self.time = StepTime()
        self.in_backward = False
        self.flop_rate = profile.flops_per_second(choice.compute_dtype)

    def _compute(self, seconds: float) -> None:
        self.now += seconds
        self.time.compute += seconds

    def _overhead(self, work: float) -> float:
        """An operator's seconds: its work, or its launch and dispatch overhead where that is longer
        (an accelerator runs kernels behind the host's launches); on a CPU the host runs both in turn."""
        overhead = self.profile.op_overhead
        return work + overhead if self.profile.device == "cpu" else max(work, overhead)

    def operator(self, flops: int) -> None:
        """One operator of the model, by its FLOPs."""
        self._compute(self._overhead(flops / self.flop_rate))

    def memory_traffic(self, nbytes: int) -> None:
        """An operator's output: written, then read once."""
        self._compute(2 * nbytes / self.profile.memory_bandwidth)

    def segment(self, segment: Segment) -> None:
        """A run of the model's operators (see [Note: Trace segments]): each as ``operator``, and the
        bytes they allocate as ``memory_traffic``."""
        additive = self.profile.device == "cpu"
        seconds = segment.seconds(self.flop_rate, self.profile.op_overhead, additive)
        self._compute(seconds + 2 * segment.allocated / self.profile.memory_bandwidth)

    def work_seconds(self, work: Work, bandwidth: float | None = None) -> float:
        """Seconds of the engine's memory work ``work`` (at ``bandwidth``, default the memory's)."""
        if not work.operators:
            return 0.0
        per_operator = work.nbytes / work.operators / (bandwidth or self.profile.memory_bandwidth)
        return work.operators * self._overhead(per_operator)

    def engine_work(self, work: Work = NO_WORK, units: float = 0.0) -> None:
        """The engine's work on the compute stream: copies or a decode, and ``units`` of its per-unit
        host work."""
        seconds = self.work_seconds(work) + units * self.profile.unit_overhead
        self._compute(seconds)
        self.time.engine += seconds

    def _group(self, op: str) -> tuple[int, bool]:
        """(ranks, whether they span nodes) of the group ``op`` runs on."""
        choice, per_node = self.choice, self.choice.ranks_per_node
        if op == "all_reduce":
            return choice.replicate_size, choice.world_size > per_node
        size = choice.shard_size
        if op == "all_gather" and self.in_backward and choice.reshard_to is not None:
            size = choice.reshard_to
        return size, size > per_node

    def collective(self, op: str, names: tuple[str, ...], nbytes: int, encode: Work = NO_WORK) -> None:
        """Queue ``op`` on the link when the engine issues it; ``names`` are ready when it ends.
        ``encode``: a quantized all-gather's, done before it on the issuing side."""
        ranks, inter_node = self._group(op)
        self.time.comm_bytes[op] = self.time.comm_bytes.get(op, 0) + nbytes
        steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        moved = nbytes * steps / ranks if op != "all_reduce" else 2 * nbytes * (ranks - 1) / ranks
        seconds = moved / self.profile.link_bandwidth(inter_node, op) + steps * self.profile.collective_latency
        before = self.work_seconds(encode)  # on the issuing side: the encode, offload's copy of the shard
        if self.choice.cpu_offload:  # the shard up before the gather, the reduced shard down after
            before += self.work_seconds(Work(nbytes // max(1, ranks), 1), self.profile.host_bandwidth)
        self.time.communication += seconds
        if not self.profile.collectives_overlap:  # the rank's own cores do it: compute waits
            self._compute(before)
            self.time.engine += before
            self.now += seconds
            self.time.exposed += seconds
            self.link_free = self.now
        else:
            self.link_free = max(self.now, self.link_free) + before + seconds
        for name in names:
            self.ready[name] = self.link_free

    def wait(self, name: str) -> None:
        ready = self.ready.pop(name, self.now)
        if ready > self.now:
            self.time.exposed += ready - self.now
            self.now = ready

    def end_backward(self) -> None:
        """The end-of-backward callback waits for every reduction."""
        if self.link_free > self.now:
            self.time.exposed += self.link_free - self.now
            self.now = self.link_free

    def optimizer_step(self, state_bytes: int, tensors: int) -> None:
        """AdamW over this rank's shards, gradients and states (``state_bytes``): read and written
        about three times; plus its host work per parameter tensor."""
        bandwidth = self.profile.host_memory_bandwidth if self.choice.cpu_offload else self.profile.memory_bandwidth
        seconds = 3 * state_bytes / bandwidth + tensors * self.profile.optimizer_overhead
        self.now += seconds
        self.time.optimizer += seconds

    def finish(self) -> StepTime:
        self.time.total = self.now
        return self.time
