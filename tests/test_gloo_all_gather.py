"""[Note: Gloo collectives]: which all-gather a gloo group gets, and that both gather right."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard._core import comm, compat
from fullshard.testing import distributed


def _gather_counting(numel: int) -> dict[str, int]:
    """All-gathers ``numel`` floats holding each rank's index; counts the calls made."""
    calls = {"native": 0, "broadcast": 0}
    real_native, real_broadcast = compat._all_gather, dist.broadcast

    def native(*args, **kwargs):
        calls["native"] += 1
        return real_native(*args, **kwargs)

    def broadcast(*args, **kwargs):
        calls["broadcast"] += 1
        return real_broadcast(*args, **kwargs)

    world, rank = dist.get_world_size(), dist.get_rank()
    output = torch.empty(world * numel)
    with mock.patch.object(compat, "_all_gather", native), mock.patch.object(dist, "broadcast", broadcast):
        comm.all_gather(output, torch.full((numel,), float(rank)), dist.group.WORLD, async_op=False)
    expected = torch.arange(world, dtype=torch.float32).repeat_interleave(numel)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    return calls


def _small_and_large(world: int) -> tuple[int, int]:
    limit = comm.GLOO_NATIVE_ALL_GATHER_BYTES // 4  # floats gathered at the bound
    return limit // world, limit // world + 1


@distributed(world_size=4)
def test_small_units_gather_in_one_call_on_more_than_two_ranks():
    small, large = _small_and_large(4)
    assert _gather_counting(small) == {"native": 1, "broadcast": 0}  # latency-bound: one round
    assert _gather_counting(large) == {"native": 0, "broadcast": 4}  # one broadcast per rank


@pytest.mark.parametrize("numel", [3, 70000])
@distributed(world_size=2)
def test_two_ranks_always_broadcast(numel):
    assert _gather_counting(numel) == {"native": 0, "broadcast": 2}
