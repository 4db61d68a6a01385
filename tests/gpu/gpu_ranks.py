"""The GPU tests' ranks: one process per GPU over NCCL, so that at world 2 every all-gather and
reduce-scatter really crosses devices (at world 1 the engine issues none). The CPU suite's rank pool
hides CUDA from its ranks (see [Note: Rank pool]), hence this small spawner of its own.

``on_ranks(world, body, *args)`` runs ``body(mesh, *args)`` on ``world`` ranks: world 1 in the pytest
process, more in spawned processes (rank r on GPU r), skipped with the reason where there are fewer
GPUs. ``backend="gloo", device_type="cpu"`` runs the same bodies on CPU ranks
(tests/test_gpu_ranks_dry.py), which checks the spawning and the bodies' logic without a GPU.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

Body = Callable[..., None]


def device_of(mesh: DeviceMesh) -> torch.device:
    """This rank's device: its GPU, or the CPU for a dry run."""
    if mesh.device_type == "cuda":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device(mesh.device_type)


def _rank_main(rank: int, world: int, init: str | None, body: Body, args: tuple, backend: str, device: str) -> None:
    saved = os.environ.get("LOCAL_RANK")
    os.environ["LOCAL_RANK"] = str(rank)
    if device == "cuda":
        torch.cuda.set_device(rank)
    if init is None:  # world 1, in this process
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend, init_method=f"file://{init}", rank=rank, world_size=world)
    try:
        body(init_device_mesh(device, (world,)), *args)
    finally:
        dist.destroy_process_group()
        if saved is None:
            os.environ.pop("LOCAL_RANK", None)
        else:
            os.environ["LOCAL_RANK"] = saved


def on_ranks(
    world: int, body: Body, *args: Any, backend: str = "nccl", device_type: str = "cuda", timeout_s: float = 300.0
) -> None:
    """Runs ``body(mesh, *args)`` on ``world`` ranks; a rank's exception is raised here with its
    traceback, and ranks still running after ``timeout_s`` are killed and reported."""
    if device_type == "cuda" and torch.cuda.device_count() < world:
        pytest.skip(f"needs {world} CUDA GPUs, found {torch.cuda.device_count()}: run on a machine with {world}")
    if world == 1:
        _rank_main(0, 1, None, body, args, backend, device_type)
        return
    with tempfile.TemporaryDirectory(prefix="gpu-ranks-") as scratch:
        init = os.path.join(scratch, "rendezvous")
        context = mp.start_processes(
            _rank_main, (world, init, body, args, backend, device_type), nprocs=world, join=False, start_method="spawn"
        )
        deadline = time.monotonic() + timeout_s
        while not context.join(timeout=1.0):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise TimeoutError(f"{body.__name__} did not finish on {world} ranks within {timeout_s:.0f} s")
