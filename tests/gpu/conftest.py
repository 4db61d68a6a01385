"""GPU tests: they run where CUDA is visible and are skipped, with the reason, elsewhere.

A test gets NCCL at world 1 in the pytest process (``nccl_world``), or runs its
body on 1 and 2 GPUs through gpu_ranks.py (one process per GPU; world 2 skipped
on a one-GPU machine); the CPU suite's rank pool hides CUDA from its ranks and
never runs these.
Run them on a GPU machine with ``make test`` or ``pytest -q tests/gpu``.
"""

from __future__ import annotations

import os
from typing import Iterator

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_REASON = "needs a CUDA GPU (NCCL): run `pytest -q tests/gpu` on a GPU machine"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.skip(reason=_REASON))


@pytest.fixture
def nccl_world(monkeypatch: pytest.MonkeyPatch) -> Iterator[DeviceMesh]:
    """NCCL at world 1 (``init_process_group("nccl", rank=0, world_size=1)``) and its CUDA mesh."""
    monkeypatch.setenv("LOCAL_RANK", "0")
    torch.cuda.set_device(0)
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cuda", (1,))
    finally:
        dist.destroy_process_group()
