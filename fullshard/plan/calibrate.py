"""``fullshard plan --calibrate``: this machine's throughputs, measured in a few seconds, as a ``DeviceProfile``.

Matmuls (fp32 and bf16, square, large enough to be compute-bound), memory
bandwidth (a large copy) and the per-operator overhead on the device the step
would run on (CUDA when present, else CPU). On the CPU everything is measured
in the process's CPU time, not the wall clock: the plan's CPU step is the
work the rank's cores do (see [Note: Device profiles]), and CPU time is what a
machine shared with other work changes least. Also on the CPU, through the
rank pool's gloo ranks: the collectives the engine runs (``comm.all_gather``,
``comm.reduce_scatter``, ``comm.all_reduce``), each at its own bus bandwidth,
and the engine's and the optimizer's host work, from a small sharded model
(see ``engine_costs``). On a GPU the link figures stay the base profile's:
NCCL between GPUs needs one process per GPU, which ``fullshard train`` starts,
not this check. The efficiencies are 1: measured throughputs are what a step
reaches.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from .._core import comm  # the engine's collectives, timed as the engine runs them
from ..fully_shard import fully_shard
from .choice import Choice
from .playback import predict
from .profiles import PROFILES, DeviceProfile
from .step_time import StepClock
from .trace import trace_step

__all__ = ["calibrate", "collective_bandwidth", "engine_costs"]


def _clock(device: str) -> Callable[[], float]:
    """The clock a profile of ``device`` is measured with: the process's CPU time on the CPU."""
    if device == "cuda":

        def wall() -> float:
            torch.cuda.synchronize()
            return time.perf_counter()

        return wall
    return time.process_time


def _rate(work: float, run: Callable[[], object], device: str, seconds: float = 0.5) -> float:
    """``work`` units per second of ``run()``, over about ``seconds``."""
    clock = _clock(device)
    run()
    count, start = 0, clock()
    while clock() - start < seconds:
        run()
        count += 1
    return work * count / (clock() - start)


def _matmul_flops(device: str, dtype: torch.dtype, size: int) -> float:
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    return _rate(2 * size**3, lambda: torch.mm(a, b), device)


def _memory_bandwidth(device: str) -> float:
    source = torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
    target = torch.empty_like(source)
    return _rate(2 * source.numel(), lambda: target.copy_(source), device)


def _median_seconds(run: Callable[[], object], repeats: int) -> float:
    """The median CPU seconds of ``run()`` over ``repeats`` calls, after one."""
    run()
    seconds = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        seconds.append(time.process_time() - start)
    return sorted(seconds)[len(seconds) // 2]


def collective_bandwidth(nbytes: int = 4 * 2**20, repeats: int = 5) -> dict[str, float]:
    """On every rank: bus bytes per CPU second of the engine's all-gather, reduce-scatter and
    all-reduce (ring convention: (n-1)/n of the gathered bytes per rank, twice that for an
    all-reduce), and ``latency``: CPU seconds per ring step of a tiny all-gather."""
    world, group = dist.get_world_size(), comm.default_group()
    numel = nbytes // 4 // world * world
    output, shard = torch.empty(numel), torch.ones(numel // world)
    full, reduced = torch.ones(numel), torch.empty(numel // world)
    rates = {}
    for op, factor, run in (
        ("all_gather", 1, lambda: comm.all_gather(output, shard, group, async_op=False)),
        ("reduce_scatter", 1, lambda: comm.reduce_scatter(reduced, full, group, dist.ReduceOp.SUM, async_op=False)),
        ("all_reduce", 2, lambda: comm.all_reduce(full, group, dist.ReduceOp.SUM, async_op=False)),
    ):
        rates[op] = factor * numel * 4 * (world - 1) / world / _median_seconds(run, repeats)
    tiny, piece = torch.empty(256 * world), torch.ones(256)
    rates["latency"] = _median_seconds(lambda: comm.all_gather(tiny, piece, group, async_op=False), 12 * repeats) / max(
        1, world - 1
    )
    return rates


class _Blocks(nn.Module):
    """The engine-cost model: small linear blocks, so host work, not bytes, is what a step costs."""

    def __init__(self, width: int = 32, blocks: int = 8) -> None:
        super().__init__()
        self.layers = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def _blocks_batch(n: int) -> torch.Tensor:
    return torch.randn(n, 32)


_ENGINE_BATCH = 4


def engine_costs(repeats: int = 15) -> dict[str, float]:
    """On every rank: median CPU seconds of a forward and backward of ``_Blocks`` sharded block by
    block, and of the ``optimizer.step()`` (AdamW) after it."""
    torch.manual_seed(0)
    model = _Blocks()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    batch = _blocks_batch(_ENGINE_BATCH)
    steps, optimizer = [], []
    for index in range(repeats + 2):  # two warm-up steps: lazy init, the optimizer's states
        start = time.process_time()
        model(batch).sum().backward()
        middle = time.process_time()
        optim.step()
        optim.zero_grad()
        if index >= 2:
            steps.append(middle - start)
            optimizer.append(time.process_time() - middle)
    return {"step": sorted(steps)[len(steps) // 2], "optimizer": sorted(optimizer)[len(optimizer) // 2]}


def _with_engine_overheads(profile: DeviceProfile, measured: dict[str, float], ranks: int) -> DeviceProfile:
    """``profile`` with ``unit_overhead`` and ``optimizer_overhead``: what ``engine_costs`` measured
    beyond what the plan predicts for its model without them, per unit and per parameter tensor."""
    base = dataclasses.replace(profile, unit_overhead=0.0, optimizer_overhead=0.0)
    choice = Choice(ranks, "full", micro_batch=_ENGINE_BATCH, device=profile.device, ranks_per_node=ranks)
    trace = trace_step(_Blocks, _blocks_batch, _ENGINE_BATCH, device=profile.device)
    predicted = predict(trace, choice, StepClock(base, choice))
    tensors = sum(len(unit.shapes) for unit in trace.units)
    step = predicted.time.total - predicted.time.optimizer
    return dataclasses.replace(
        profile,
        unit_overhead=max(0.0, (measured["step"] - step) / len(trace.units)),
        optimizer_overhead=max(0.0, (measured["optimizer"] - predicted.time.optimizer) / tensors),
    )


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
    return 1 / _rate(counter.count, step, device)


class _OperatorCount(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        self.count += 1
        return func(*args, **(kwargs or {}))


def calibrate(base: str = "h100", ranks: int = 2) -> DeviceProfile:
    """This machine's profile: measured compute and memory; on CPU also the collectives over gloo
    and the engine's host work, in CPU time (see the module's docstring)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    size = 4096 if device == "cuda" else 512
    flops = {
        "float32": _matmul_flops(device, torch.float32, size),
        "bfloat16": _matmul_flops(device, torch.bfloat16, size),
    }
    flops["float16"] = flops["bfloat16"] if device == "cpu" else _matmul_flops(device, torch.float16, size)
    memory = _memory_bandwidth(device)
    name = torch.cuda.get_device_name() if device == "cuda" else "CPU"
    fields: dict[str, Any] = dict(
        name=f"calibrated ({device}, {name})",
        device=device,
        matmul_flops=flops,
        matmul_efficiency=1.0,
        memory_bandwidth=memory,
        source=f"fullshard plan --calibrate, torch {torch.__version__}"
        + (", CPU time" if device == "cpu" else "; links, host and engine costs: the base profile's guesses"),
        op_overhead=_op_overhead(device),
        measured=True,
    )
    if device == "cpu":
        from ..testing import run_distributed

        per_rank = run_distributed(collective_bandwidth, ranks, timeout=600)
        rates = {op: min(rank[op] for rank in per_rank) for op in ("all_gather", "reduce_scatter", "all_reduce")}
        fields.update(
            memory_gib=_host_memory_gib(),
            intra_node_bandwidth=min(rates.values()),
            inter_node_bandwidth=min(rates.values()),
            collective_bandwidth=rates,
            collectives_overlap=False,
            link_efficiency=1.0,
            collective_latency=max(rank["latency"] for rank in per_rank),
            host_bandwidth=memory,
            host_memory_bandwidth=memory,
        )
    profile = dataclasses.replace(PROFILES[base], **fields)
    if device == "cpu":
        engine = run_distributed(engine_costs, ranks, timeout=600)
        slowest = {key: max(rank[key] for rank in engine) for key in ("step", "optimizer")}
        profile = _with_engine_overheads(profile, slowest, ranks)
    return profile


def _host_memory_gib() -> float:
    try:
        with open("/proc/meminfo") as f:
            return int(f.readline().split()[1]) / 2**20
    except (OSError, ValueError, IndexError):
        return 16.0
