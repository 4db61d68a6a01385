"""Stand-in process groups for single-process tests: one rank, or many faked."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.distributed as dist


class FakeSingleRankGroup:
    """A process group of one rank (this process): ``rank()`` is 0, ``size()`` is 1.

    It has no collectives, so code that tries to communicate over a group of
    one (which it never needs to) fails loudly instead of passing by accident.
    """

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1


@contextlib.contextmanager
def fake_world(world_size: int, rank: int = 0) -> Iterator[None]:
    """This process as ``rank`` of ``world_size`` ranks on torch's fake process group.

    Collectives return at once without moving data, through the backend's
    native ``all_gather_into_tensor`` / ``reduce_scatter_tensor`` path (the
    one NCCL takes: the backend is not gloo), so one process runs fullshard at
    world sizes no test machine could spawn: shapes, padding, the bytes each
    collective is handed and the memory a rank holds are real; values are not.
    """
    from torch.testing._internal.distributed.fake_pg import FakeStore  # registers the "fake" backend

    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()
