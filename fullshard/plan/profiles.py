"""Device profiles: how fast a device computes, moves memory and talks to its peers.

[Note: Device profiles]
The built-in profiles are NVIDIA's published figures (H100 SXM5 and H200 SXM
datasheets): dense tensor-core throughput by dtype (fp32 without TF32, as
torch's matmuls default to), HBM bandwidth, NVLink 4 (900 GB/s per GPU, both
directions: 450 GB/s each way), one 400 Gb/s InfiniBand NDR port per GPU
(50 GB/s) between nodes, PCIe Gen5 x16 to the host (64 GB/s each way). A
step never reaches a datasheet's peak, so each is scaled by an achievable
fraction: ``matmul_efficiency`` (large matmuls reach about 60-75% of peak),
``link_efficiency`` (NCCL's ring bus bandwidth is about 80% of the link's).
The host's costs (``op_overhead``, ``unit_overhead``, ``optimizer_overhead``)
are guesses for a fast host driving a GPU. None of this is measured: these
profiles are datasheet figures times guessed efficiencies, and ``fullshard
plan`` says so when it uses them. ``fullshard plan --calibrate FILE`` on the
GPU machine itself is the way to replace them (see ``calibrate.py``): it
measures the matmuls, the memory, the host's per-operator, per-unit and
optimizer costs there; ``--profile FILE`` then plans with those figures.

A calibrated CPU profile is a CPU-time profile: on the CPU the collectives
(gloo) run on the rank's own cores, so they do not hide behind compute
(``collectives_overlap`` False) and each costs the CPU time it burns,
measured per collective (``collective_bandwidth``: gloo's reduce-scatter is
an all-reduce of the input, so it costs what an all-reduce does).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import torch

__all__ = ["PROFILES", "DeviceProfile", "load_profile"]

_GB = 1e9
_TFLOPS = 1e12


@dataclass(frozen=True)
class DeviceProfile:
    """Throughputs of one rank's device and links; bytes and FLOPs per second.

    Attributes:
        name: what it describes.
        device: ``cuda`` or ``cpu`` (decides what some kernels allocate: see [Note: Plan model]).
        memory_gib: the device memory, the default ``--memory-limit``.
        matmul_flops: peak matmul FLOP/s by dtype name (``float32``, ``bfloat16``, ``float16``).
        matmul_efficiency: the fraction of ``matmul_flops`` a step's matmuls reach.
        memory_bandwidth: device memory bytes/s (element-wise work, the optimizer).
        intra_node_bandwidth: bytes/s one rank sends to a peer in its node, one direction.
        inter_node_bandwidth: bytes/s one rank sends to another node.
        link_efficiency: the fraction of those a ring collective reaches.
        collective_latency: seconds per ring step.
        op_overhead: seconds of host work per operator (eager dispatch, autograd, kernel launch).
        host_bandwidth: host-device copy bytes/s (CPU offload).
        host_memory_bandwidth: host memory bytes/s (the optimizer under CPU offload).
        source: where the numbers come from.
        unit_overhead: host seconds the engine spends on one unit per forward and backward (its
            hooks, the copy-out and copy-in calls, the shards' bookkeeping), bytes aside.
        optimizer_overhead: host seconds of ``optimizer.step()`` per parameter tensor, bytes aside.
        collective_bandwidth: measured bus bytes/s by collective (``all_gather``, ``reduce_scatter``,
            ``all_reduce``), in place of the link's where given.
        collectives_overlap: whether collectives run beside compute (an accelerator's streams) or
            take the compute's own time (CPU ranks: gloo works on the same cores).
        measured: calibrated on a machine (``--calibrate``), not datasheet figures.
    """

    name: str
    device: str
    memory_gib: float
    matmul_flops: dict[str, float]
    matmul_efficiency: float
    memory_bandwidth: float
    intra_node_bandwidth: float
    inter_node_bandwidth: float
    link_efficiency: float
    collective_latency: float
    op_overhead: float
    host_bandwidth: float
    host_memory_bandwidth: float
    source: str
    unit_overhead: float = 0.0
    optimizer_overhead: float = 0.0
    collective_bandwidth: dict[str, float] = dataclasses.field(default_factory=dict)
    collectives_overlap: bool = True
    measured: bool = False

    def flops_per_second(self, dtype: torch.dtype) -> float:
        name = str(dtype).removeprefix("torch.")
        return self.matmul_flops.get(name, self.matmul_flops["float32"]) * self.matmul_efficiency

    def link_bandwidth(self, inter_node: bool, op: str | None = None) -> float:
        """Bus bytes/s of ``op`` (measured, where calibrated) or of the link it crosses."""
        if op in self.collective_bandwidth and not inter_node:
            return self.collective_bandwidth[op]
        return (self.inter_node_bandwidth if inter_node else self.intra_node_bandwidth) * self.link_efficiency

    @property
    def caveat(self) -> str:
        """What to make of this profile's figures, said where a plan uses them."""
        if self.measured:
            return f"profile {self.name}: measured ({self.source})"
        return (
            f"profile {self.name}: datasheet figures times guessed efficiencies, not measured; "
            "run `fullshard plan --calibrate FILE` on that machine and pass --profile FILE to replace them"
        )

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), indent=2)


def load_profile(name_or_path: str) -> DeviceProfile:
    """A built-in profile by name (``h100``, ``h200``) or one saved by ``--calibrate`` (a JSON path).

    Raises:
        ValueError: neither a known name nor a readable profile file.
    """
    if name_or_path.lower() in PROFILES:
        return PROFILES[name_or_path.lower()]
    try:
        with open(name_or_path) as f:
            fields = json.load(f)
        return DeviceProfile(**fields)
    except (OSError, json.JSONDecodeError, TypeError) as exc:
        raise ValueError(
            f"plan expects a device profile named {' or '.join(PROFILES)} or a JSON file written by "
            f"fullshard plan --calibrate, but got {name_or_path!r} ({exc})"
        ) from None


_HOPPER = dict(
    device="cuda",
    matmul_efficiency=0.65,
    intra_node_bandwidth=450 * _GB,
    inter_node_bandwidth=50 * _GB,
    link_efficiency=0.8,
    collective_latency=10e-6,
    op_overhead=6e-6,
    unit_overhead=150e-6,  # guessed: a few dozen Python calls and launches per unit and pass
    optimizer_overhead=2e-6,  # guessed: AdamW's foreach kernels take a list of tensors at once
    host_bandwidth=64 * _GB * 0.8,
    host_memory_bandwidth=100 * _GB,
)

_H100 = DeviceProfile(
    name="H100 SXM5 80GB",
    memory_gib=80 * 1e9 / 2**30,
    matmul_flops={"float32": 66.9 * _TFLOPS, "bfloat16": 989.4 * _TFLOPS, "float16": 989.4 * _TFLOPS},
    memory_bandwidth=3.35e12,
    source="NVIDIA H100 datasheet (SXM5): 989 TFLOPS bf16 dense, 67 TFLOPS fp32, 3.35 TB/s HBM3, "
    "NVLink 900 GB/s, NDR 400 Gb/s per GPU, PCIe Gen5",
    **_HOPPER,  # type: ignore[arg-type]
)

PROFILES = {
    "h100": _H100,
    "h200": dataclasses.replace(  # the same compute and links; more and faster memory
        _H100,
        name="H200 SXM 141GB",
        memory_gib=141 * 1e9 / 2**30,
        memory_bandwidth=4.8e12,
        source="NVIDIA H200 datasheet (SXM): 989 TFLOPS bf16 dense, 67 TFLOPS fp32, 4.8 TB/s HBM3e, "
        "NVLink 900 GB/s, NDR 400 Gb/s per GPU, PCIe Gen5",
    ),
}
