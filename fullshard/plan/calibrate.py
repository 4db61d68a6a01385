"""``fullshard plan --calibrate``: this machine's throughputs, measured in a few seconds, as a ``DeviceProfile``.

Matmuls (fp32 and bf16, square, large enough to be compute-bound), memory
bandwidth (a large copy) on the device the step would run on (CUDA when
present, else CPU), and the collectives the engine runs (``comm.all_gather``
and ``comm.reduce_scatter``, gloo on CPU through the rank pool's two ranks;
on a GPU the link figures stay the base profile's: NCCL between GPUs needs
one process per GPU, which ``fullshard train`` starts, not this check). The
efficiencies are 1: measured throughputs are what a step reaches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import comm  # the engine's collectives, timed as the engine runs them
from .profiles import PROFILES, DeviceProfile

__all__ = ["calibrate"]


def _rate(work: float, run: Callable[[], object], seconds: float = 0.5) -> float:
    """``work`` units per second of ``run()``, over about ``seconds``."""
    run()
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        run()
        count += 1
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return work * count / (time.perf_counter() - start)


def _matmul_flops(device: str, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return _rate(2 * size**3, lambda: torch.mm(a, b))


def _memory_bandwidth(device: str) -> float:
    source = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _rate(2 * source.numel(), lambda: target.copy_(source))


def collective_bandwidth(nbytes: int = 16 * 2**20, repeats: int = 5) -> dict[str, float]:
    """On every rank: bus bytes per second of the engine's all-gather and reduce-scatter (ring
    convention: (n-1)/n of the gathered bytes per rank), and ``latency``: seconds per ring step
    of a tiny all-gather."""
    world, group = dist.get_world_size(), comm.default_group()
    numel = nbytes // 4 // world * world
    output, shard = torch.empty(numel), torch.ones(numel // world)
    full, reduced = torch.ones(numel), torch.empty(numel // world)
    rates = {}
    for op, run in (
        ("all_gather", lambda: comm.all_gather(output, shard, group, async_op=False)),
        ("reduce_scatter", lambda: comm.reduce_scatter(reduced, full, group, dist.ReduceOp.SUM, async_op=False)),
    ):
        run()
        start = time.perf_counter()
        for _ in range(repeats):
            run()
        seconds = (time.perf_counter() - start) / repeats
        rates[op] = numel * 4 * (world - 1) / world / seconds
    tiny, piece = torch.empty(256 * world), torch.ones(256)
    start = time.perf_counter()
    for _ in range(4 * repeats):
        comm.all_gather(tiny, piece, group, async_op=False)
    rates["latency"] = (time.perf_counter() - start) / (4 * repeats) / max(1, world - 1)
    return rates


def _op_overhead(device: str) -> float:
    """Seconds per operator of a small model's training step (dispatch, autograd, launch): the step's
    time over its operator count, its FLOPs negligible."""
    layers = [torch.nn.Linear(16, 16, device=device) for _ in range(8)]
    model = torch.nn.Sequential(*[m for layer in layers for m in (layer, torch.nn.GELU())])
    batch = torch.randn(4, 16, device=device)

    def step() -> None:
        model(batch).sum().backward()

    counter = _OperatorCount()
    with counter:
        step()
    return 1 / _rate(counter.count, step)


class _OperatorCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def calibrate(base: str = "h100", ranks: int = 2) -> DeviceProfile:
    """This machine's profile: measured compute and memory; links measured over gloo on CPU."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = 4096 if device == "cuda" else 512
    flops = {
        "float32": _matmul_flops(device, torch.float32, size),
        "bfloat16": _matmul_flops(device, torch.bfloat16, size),
    }
    flops["float16"] = flops["bfloat16"] if device == "cpu" else _matmul_flops(device, torch.float16, size)
    memory = _memory_bandwidth(device)
    profile = PROFILES[base]
    fields = dict(
        name=f"calibrated ({device}, {torch.cuda.get_device_name() if device == 'cuda' else 'CPU'})",
        device=device,
        matmul_flops=flops,
        matmul_efficiency=1.0,
        memory_bandwidth=memory,
        source=f"fullshard plan --calibrate, torch {torch.__version__}",
        op_overhead=_op_overhead(device),
    )
    if device == "cpu":
        from ..testing import run_distributed

        rates = run_distributed(collective_bandwidth, ranks)[0]
        link = min(rates["all_gather"], rates["reduce_scatter"])
        fields.update(
            memory_gib=_host_memory_gib(),
            intra_node_bandwidth=link,
            inter_node_bandwidth=link,
            link_efficiency=1.0,
            collective_latency=rates["latency"],
            host_bandwidth=memory,
            host_memory_bandwidth=memory,
        )
    return dataclasses.replace(profile, **fields)  # type: ignore[arg-type]


def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return 16.0
