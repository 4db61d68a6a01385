"""One build-step-delete cycle per configuration, and what it left behind.

The leak test (tests/test_lifecycle.py) and the soak benchmark
(benchmarks/bench_soak.py) share these: each configuration builds a small
model, shards it, takes a training step (and what the configuration adds: a
state dict, a checkpoint, an exception mid-step), then drops every reference.
``leftovers`` counts what is still alive by type, so a leak shows as the name
of the class that leaked, not as a number.
"""

from __future__ import annotations

import gc
import os
import queue
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


class Block(nn.Module):
    """A residual MLP block that can be told to raise in forward (a step cut short)."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin1 = nn.Linear(dim, 2 * dim)
        self.lin2 = nn.Linear(2 * dim, dim)
        self.fail = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fail:
            raise RuntimeError("a forward that fails on purpose")
        return x + self.lin2(torch.relu(self.lin1(x)))


def small_model(dim: int = 16, depth: int = 3) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(Block(dim) for _ in range(depth)), nn.Linear(dim, 4))


def _fully_shard(model: nn.Sequential, **kwargs: Any) -> nn.Module:
    from fullshard import fully_shard

    for block in list(model)[:-1]:
        fully_shard(block, **kwargs)
    return fully_shard(model, **kwargs)


def _wrapper(model: nn.Module, **kwargs: Any) -> nn.Module:
    from fullshard import FullyShardedDataParallel
    from fullshard.wrap import ModuleWrapPolicy

    return FullyShardedDataParallel(model, auto_wrap_policy=ModuleWrapPolicy({Block}), **kwargs)


def _hsdp_mesh() -> DeviceMesh:
    world = dist.get_world_size()
    shard = 2 if world % 2 == 0 and world > 2 else 1
    return init_device_mesh("cpu", (world // shard, shard), mesh_dim_names=("replicate", "shard"))


def shard_as(name: str, model: nn.Sequential) -> nn.Module:
    """``model`` sharded as configuration ``name`` says."""
    from fullshard import (
        AllGatherQuantization,
        CPUOffload,
        CPUOffloadPolicy,
        MixedPrecisionPolicy,
        ShardingStrategy,
        replicate,
        set_all_gather_bucket_size,
        set_all_gather_quantization,
    )

    if name == "reshard_after_forward=False":
        return _fully_shard(model, reshard_after_forward=False)
    if name == "reshard_after_forward=1":
        return _fully_shard(model, reshard_after_forward=1)
    if name == "hsdp":
        return _fully_shard(model, mesh=_hsdp_mesh())
    if name == "offload":
        return _fully_shard(model, offload_policy=CPUOffloadPolicy())
    if name == "bf16":
        return _fully_shard(model, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    if name == "quantized":
        sharded = _fully_shard(model)
        set_all_gather_quantization(sharded, AllGatherQuantization(dtype=torch.int8, block_size=16))
        return sharded
    if name == "buckets":
        sharded = _fully_shard(model)
        set_all_gather_bucket_size(sharded, 1 << 20)
        return sharded
    if name == "compiled":
        for block in list(model)[:-1]:
            block.compile(backend="eager")
        return _fully_shard(model)
    if name == "replicate":
        return replicate(model)
    if name.startswith("wrapper"):
        strategy = ShardingStrategy[name.split(":")[1]]
        kwargs: dict[str, Any] = {"sharding_strategy": strategy, "use_orig_params": name.endswith("orig")}
        if "offload" in name:
            kwargs["cpu_offload"] = CPUOffload(offload_params=True)
        return _wrapper(model, **kwargs)
    return _fully_shard(model)  # "full", "state_dict", "checkpoint", "exception"


CONFIGS = (
    "full",
    "reshard_after_forward=False",
    "reshard_after_forward=1",
    "hsdp",
    "offload",
    "bf16",
    "quantized",
    "buckets",
    "compiled",
    "replicate",
    "state_dict",
    "checkpoint",
    "exception",
    "wrapper:FULL_SHARD",
    "wrapper:FULL_SHARD:orig",
    "wrapper:SHARD_GRAD_OP",
    "wrapper:NO_SHARD",
    "wrapper:HYBRID_SHARD:orig",
    "wrapper:FULL_SHARD:offload",
)


def after_step(name: str, model: Any, optim: torch.optim.Optimizer) -> None:
    """What configuration ``name`` does after its step."""
    if name == "state_dict":
        from torch.distributed.checkpoint.state_dict import get_state_dict

        from fullshard import full_state_dict

        full_state_dict(model)
        get_state_dict(model, optim)
        model.state_dict()
    elif name == "checkpoint":
        from fullshard import checkpoint

        with tempfile.TemporaryDirectory() as folder:
            shared = [folder]
            dist.broadcast_object_list(shared)  # one folder for every rank
            checkpoint.save(shared[0], model, optim, extra={"step": 1})
            checkpoint.load(shared[0], model, optim)
            dist.barrier()  # rank 0 removes the folder only once every rank has read it
    elif name.startswith("wrapper"):
        from fullshard import FullyShardedDataParallel, StateDictType

        with FullyShardedDataParallel.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
            model.state_dict()
            FullyShardedDataParallel.optim_state_dict(model, optim)
    elif name == "exception":
        model[1].fail = True
        try:
            model(torch.randn(2, 16))
        except RuntimeError:
            pass
        model[1].fail = False


def cycle(name: str) -> None:
    """Builds, shards, steps and drops one model as ``name`` says (every rank calls it)."""
    model = shard_as(name, small_model())
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(2):
        model(torch.randn(4, 16, generator=generator)).sum().backward()
        optim.step()
        optim.zero_grad()
    after_step(name, model, optim)
    del model, optim


def _ours(obj: object) -> str | None:
    """The type name of an object the library owns or makes per model, else None."""
    cls = type(obj)
    module = cls.__dict__.get("__module__")  # a type's own (a class attribute of a metaclass is not)
    if isinstance(module, str) and module.startswith("fullshard.") and not module.startswith("fullshard.testing"):
        return f"{module}.{cls.__qualname__}"
    if isinstance(obj, (dist.ProcessGroup, DeviceMesh)):
        return cls.__qualname__
    if isinstance(obj, nn.Module):  # the model's own modules (FSDP-swapped classes included)
        return f"nn.Module {cls.__qualname__}"
    if isinstance(obj, torch.Tensor):
        return "Tensor"
    return None


def live_objects() -> Counter[str]:
    """How many objects of each of the library's (and the model's) kinds are alive."""
    gc.collect()
    return Counter(name for name in map(_ours, gc.get_objects()) if name is not None)


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def leftovers(name: str, run: Callable[[str], None] = cycle) -> dict[str, int]:
    """What each further cycle of ``name`` leaves alive: the kinds that grew over both of two
    more cycles (with how many more after both).

    The first cycle warms caches that live as long as the process (compiled kernels, torch's
    lazily made objects); a leak grows with every cycle after it, while an object that a
    collective still holds for a moment (gloo's work in flight) shows up once and is gone.
    """
    run(name)
    first = live_objects()
    run(name)
    second = live_objects()
    run(name)
    third = live_objects()
    return {kind: third[kind] - first[kind] for kind in third if third[kind] > second[kind] > first[kind]}


def _group_cycles(rank: int, world_size: int, port: int, cycles: int, names: list[str], results: object) -> None:
    """In a fresh process, for each of ``names`` in turn: ``cycles`` times a new default group,
    one ``cycle(name)``, and the group destroyed; puts the thread count after each on ``results``."""
    import datetime

    torch.set_num_threads(1)
    counts: dict[str, list[int]] = {name: [] for name in names}
    store = dist.TCPStore("127.0.0.1", port, world_size, is_master=rank == 0, timeout=datetime.timedelta(seconds=60))
    for name in names:
        for index in range(cycles):
            prefix = dist.PrefixStore(f"{name}/cycle{index}/", store)
            dist.init_process_group("gloo", store=prefix, rank=rank, world_size=world_size)
            cycle(name)
            dist.destroy_process_group()
            gc.collect()
            counts[name].append(thread_count())
    results.put((rank, counts))  # type: ignore[attr-defined]


def threads_over_group_cycles(names: list[str], cycles: int, world_size: int = 2) -> dict[str, list[list[int]]]:
    """For each configuration in ``names``: each rank's thread count after each of ``cycles`` cycles
    of process-group creation, one ``cycle(name)`` and destruction. The configurations share two
    fresh processes (a leaked group keeps gloo's threads, so a leak grows within its own cycles)."""
    from .harness import free_port, rank_process_context

    ctx = rank_process_context()
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_group_cycles, args=(rank, world_size, port, cycles, names, results), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    counts: dict[int, dict[str, list[int]]] = {}
    deadline = time.monotonic() + 120 * len(names)
    try:
        while len(counts) < world_size:
            try:
                rank, rank_counts = results.get(timeout=1)
                counts[rank] = rank_counts
            except queue.Empty:
                if time.monotonic() > deadline or any(p.exitcode not in (None, 0) for p in procs):
                    raise RuntimeError(
                        f"the group cycles of {names} failed or hung (exit codes "
                        f"{[p.exitcode for p in procs]}); see the ranks' stderr"
                    ) from None
    finally:
        for proc in procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return {name: [counts[rank][name] for rank in range(world_size)] for name in names}
