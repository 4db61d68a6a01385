"""[Note: Gloo collectives]: which all-gather and reduce-scatter a gloo group gets, and that each is right."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist

from fullshard._core import comm
from fullshard.testing import distributed


def _gather_counting(numel: int) -> dict[str, int]:
    """All-gathers ``numel`` floats holding each rank's index; counts the calls made."""
    calls = {"native": 0, "broadcast": 0}
    real_native, real_broadcast = comm.native_all_gather, dist.broadcast

    def native(*args, **kwargs):
        calls["native"] += 1
        return real_native(*args, **kwargs)

    def broadcast(*args, **kwargs):
        calls["broadcast"] += 1
        return real_broadcast(*args, **kwargs)

    world, rank = dist.get_world_size(), dist.get_rank()
    output = torch.empty(world * numel)
    with mock.patch.object(comm, "native_all_gather", native), mock.patch.object(dist, "broadcast", broadcast):
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


def _reduce_scatter_counting(numel: int, op: dist.ReduceOp.RedOpType) -> dict[str, int]:
    """Reduce-scatters ``numel`` floats (rank r holds r + i / numel at i); checks the chunk
    against the sum or average over ranks and counts the collectives called."""
    calls = {"all_gather": 0, "all_reduce": 0}
    real_native, real_all_reduce = comm.native_all_gather, dist.all_reduce

    def native(*args, **kwargs):
        calls["all_gather"] += 1
        return real_native(*args, **kwargs)

    def all_reduce(*args, **kwargs):
        calls["all_reduce"] += 1
        return real_all_reduce(*args, **kwargs)

    world, rank = dist.get_world_size(), dist.get_rank()
    ramp = torch.arange(numel, dtype=torch.float32) / numel
    output = torch.empty(numel // world)
    with mock.patch.object(comm, "native_all_gather", native), mock.patch.object(dist, "all_reduce", all_reduce):
        comm.reduce_scatter(output, ramp + rank, dist.group.WORLD, op, async_op=False)
    total = world * ramp + sum(range(world))
    expected = (total if op == dist.ReduceOp.SUM else total / world).view(world, -1)[rank]
    torch.testing.assert_close(output, expected)
    return calls


def _small_reduce_scatters_gather_and_sum(op):
    limit = comm.GLOO_GATHERED_REDUCE_SCATTER_BYTES // 4
    assert _reduce_scatter_counting(limit, op) == {"all_gather": 1, "all_reduce": 0}  # latency-bound
    assert _reduce_scatter_counting(limit + 4, op) == {"all_gather": 0, "all_reduce": 1}


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
@distributed(world_size=4)
def test_small_reduce_scatters_gather_and_sum_on_four_ranks(op):
    _small_reduce_scatters_gather_and_sum(op)


@pytest.mark.parametrize("op", [dist.ReduceOp.SUM, dist.ReduceOp.AVG])
@distributed(world_size=2)
def test_small_reduce_scatters_gather_and_sum_on_two_ranks(op):
    """One latency step (the all-gather) instead of the all-reduce's two, values as gloo's."""
    _small_reduce_scatters_gather_and_sum(op)


@distributed(world_size=4)
def test_the_two_bounds_are_separate():
    """Broadcast all-gathers (bound 0) leave the small reduce-scatter on its all-gather."""
    with mock.patch.object(comm, "GLOO_NATIVE_ALL_GATHER_BYTES", 0):
        assert _gather_counting(8) == {"native": 0, "broadcast": 4}
        assert _reduce_scatter_counting(8, dist.ReduceOp.SUM) == {"all_gather": 1, "all_reduce": 0}
    with mock.patch.object(comm, "GLOO_GATHERED_REDUCE_SCATTER_BYTES", 0):
        assert _gather_counting(8) == {"native": 1, "broadcast": 0}
        assert _reduce_scatter_counting(8, dist.ReduceOp.SUM) == {"all_gather": 0, "all_reduce": 1}
