"""[Note: Direct collective calls]: plain tensors reach the process group's own method,
with the values torch.distributed's functions give; anything else takes those functions."""

from unittest import mock

import pytest
import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from fullshard._core import comm, compat
from fullshard.testing import distributed


class _Passthrough(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _counting_functions() -> tuple[dict[str, int], list]:
    """Counts the calls that go through torch.distributed's Python functions."""
    calls = {"functions": 0}
    real_gather, real_scatter = compat.ALL_GATHER_INTO_TENSOR, compat.REDUCE_SCATTER_TENSOR

    def counted(real):
        def call(*args, **kwargs):
            calls["functions"] += 1
            return real(*args, **kwargs)

        return call

    patches = [
        mock.patch.object(compat, "ALL_GATHER_INTO_TENSOR", counted(real_gather)),
        mock.patch.object(compat, "REDUCE_SCATTER_TENSOR", counted(real_scatter)),
    ]
    return calls, patches


def _gather_and_scatter(dtype: torch.dtype, async_op: bool) -> None:
    world, rank, group = dist.get_world_size(), dist.get_rank(), dist.group.WORLD
    output = torch.empty(world * 3, dtype=dtype)  # gloo takes a flat output only
    work = comm.native_all_gather(output, torch.full((3,), rank + 1, dtype=dtype), group, async_op)
    if async_op:
        work.wait()
    expected = torch.arange(1, world + 1).repeat_interleave(3).to(dtype)
    torch.testing.assert_close(output, expected, rtol=0, atol=0)
    reduced = torch.empty(2, dtype=dtype)
    source = (torch.arange(2 * world) + rank).to(dtype)
    work = comm.native_reduce_scatter(reduced, source, dist.ReduceOp.SUM, group, async_op)
    if async_op:
        work.wait()
    total = (world * torch.arange(2 * world) + sum(range(world))).to(dtype)
    torch.testing.assert_close(reduced, total.view(world, 2)[rank], rtol=0, atol=0)


@pytest.mark.parametrize("async_op", [False, True])
@distributed(world_size=2)
def test_plain_tensors_call_the_group_directly(async_op):
    calls, patches = _counting_functions()
    with patches[0], patches[1]:
        _gather_and_scatter(torch.float32, async_op)
    assert calls == {"functions": 0}


@distributed(world_size=2)
def test_complex_tensors_and_function_modes_take_torch_functions():
    calls, patches = _counting_functions()
    with patches[0], patches[1]:
        _gather_and_scatter(torch.complex64, async_op=False)
        assert calls == {"functions": 2}
        with _Passthrough():
            _gather_and_scatter(torch.float32, async_op=False)
    assert calls == {"functions": 4}
