"""Step time of one sharding choice: compute and communication on two clocks, overlapped as the engine overlaps them.

[Note: Step time model]
Two timelines run through a traced step's events (see [Note: Traced step]):
the compute stream advances by each operator's FLOPs over the profile's
matmul throughput in the compute dtype (or its launch and dispatch overhead,
when that is longer: small operators are overhead-bound), plus the bytes it
allocates written and read once over the memory bandwidth (element-wise
work); the link
advances by each collective, issued when the engine issues it (an all-gather
when a unit is gathered or prefetched, a reduce-scatter or all-reduce at a
unit's post-backward) and queued behind the ones before it. Compute waits
only where the engine waits: for a unit's all-gather before its forward or
backward, and for every reduction at the end of backward. So the next unit's
all-gather hides behind this unit's compute when the link keeps up, and
shows when it does not. Collectives are rings: an all-gather or
reduce-scatter of ``B`` bytes (the gathered size) over ``n`` ranks sends
``(n-1)/n B`` per rank, an all-reduce twice that, plus ``n-1`` (all-reduce:
``2(n-1)``) latencies; a group within one node uses NVLink, one across nodes
the slower inter-node link (hybrid sharding's point: its shard group stays in
a node). CPU offload adds each gathered shard's host-to-device copy before
its all-gather, each reduced shard's copy back, and runs the optimizer in
host memory. The optimizer reads and writes the shards, gradients and states
three times over. Not modelled: the quantized all-gather's encode and decode (only its
smaller bytes count), the engine's own host work per unit (hooks, copy-in and
copy-out), the compute slowdown
of communication kernels sharing the GPU, stragglers, congestion between
nodes; so the figures rank choices and are meant as estimates, not promises.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .choice import Choice
from .profiles import DeviceProfile

__all__ = ["StepClock", "StepTime"]


@dataclass
class StepTime:
    """Seconds of one optimizer step, and where they went."""

    total: float = 0.0
    compute: float = 0.0  # on the compute stream, waits excluded
    communication: float = 0.0  # the link busy
    exposed: float = 0.0  # compute stalled on a collective
    optimizer: float = 0.0
    comm_bytes: dict[str, int] = field(default_factory=dict)


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

    def operator(self, flops: int) -> None:
        """One operator: its FLOPs, or its launch and dispatch overhead where that is longer (an
        accelerator runs kernels behind the host's launches); on a CPU the host runs both in turn."""
        work = flops / self.flop_rate
        overhead = self.profile.op_overhead
        seconds = work + overhead if self.profile.device == "cpu" else max(work, overhead)
        self.now += seconds
        self.time.compute += seconds

    def memory_traffic(self, nbytes: int) -> None:
        """An operator's output: written, then read once."""
        seconds = 2 * nbytes / self.profile.memory_bandwidth
        self.now += seconds
        self.time.compute += seconds

    def _group(self, op: str) -> tuple[int, bool]:
        """(ranks, whether they span nodes) of the group ``op`` runs on."""
        choice, per_node = self.choice, self.choice.ranks_per_node
        if op == "all_reduce":
            return choice.replicate_size, choice.world_size > per_node
        size = choice.shard_size
        if op == "all_gather" and self.in_backward and choice.reshard_to is not None:
            size = choice.reshard_to
        return size, size > per_node

    def collective(self, op: str, names: tuple[str, ...], nbytes: int) -> None:
        """Queue ``op`` on the link when the engine issues it; ``names`` are ready when it ends."""
        ranks, inter_node = self._group(op)
        self.time.comm_bytes[op] = self.time.comm_bytes.get(op, 0) + nbytes
        steps = 2 * (ranks - 1) if op == "all_reduce" else ranks - 1
        moved = nbytes * steps / ranks if op != "all_reduce" else 2 * nbytes * (ranks - 1) / ranks
        seconds = moved / self.profile.link_bandwidth(inter_node) + steps * self.profile.collective_latency
        if self.choice.cpu_offload:  # the shard up before the gather, the reduced shard down after
            seconds += (nbytes / max(1, ranks)) / self.profile.host_bandwidth
        start = max(self.now, self.link_free)
        self.link_free = start + seconds
        self.time.communication += seconds
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

    def optimizer_step(self, state_bytes: int) -> None:
        """AdamW over this rank's shards, gradients and states: read and written about three times."""
        bandwidth = self.profile.host_memory_bandwidth if self.choice.cpu_offload else self.profile.memory_bandwidth
        seconds = 3 * state_bytes / bandwidth
        self.now += seconds
        self.time.optimizer += seconds

    def finish(self) -> StepTime:
        self.time.total = self.now
        return self.time
