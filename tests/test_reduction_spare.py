"""The reduce-scatter input handed from one reduction to the next of its size (see
[Note: Reduction pipeline] in ``fullshard/_core/reduce/reduction.py``).

On torch's fake process group (world 8, one process): units of one shape reuse one
input within a backward, a unit of another size gets its own, nothing is handed on
before its collective was waited for, and nothing is held after backward.
Equal losses and parameters with the reuse are the training parity suites' job.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

from fullshard import fully_shard
from fullshard._core import comm
from fullshard._core.reduce.reduction import GradReduction, ReductionQueue, plan_reduction
from fullshard._core.settings import ReduceSettings
from fullshard._core.step.state import get_state
from fullshard.testing.fake_group import fake_world


def _reduce_scatter_inputs(step) -> list[tuple[int, int]]:
    """(data pointer, numel) of every reduce-scatter input during ``step()``."""
    seen: list[tuple[int, int]] = []

    def record(record: comm.CommRecord, tensors: list[torch.Tensor]) -> None:
        if record.op == "reduce_scatter":
            seen.append((tensors[1].data_ptr(), tensors[1].numel()))

    remove = comm.add_listener(record)
    try:
        step()
    finally:
        remove()
    return seen


def test_units_of_one_size_share_the_input_and_backward_keeps_none():
    with fake_world(8):
        mesh = init_device_mesh("cpu", (8,))
        torch.manual_seed(0)
        # Four units of one shape, then a wider one (another size), then the root (no parameters).
        model = nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)], nn.Linear(16, 48))
        for layer in model:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        x = torch.randn(2, 16)

        def step() -> None:
            model(x).sum().backward()

        step()  # lazy init, first allocations
        inputs = _reduce_scatter_inputs(step)
        assert len(inputs) == 5
        wide, *same = inputs  # backward runs the last layer first
        assert wide[1] != same[0][1]
        assert {numel for _, numel in same} == {same[0][1]}
        # The wide unit's input was freed before the first small one was allocated (no reuse across
        # sizes); the small units' backward reuses the first small input throughout.
        assert len({ptr for ptr, _ in same}) == 1, same
        queue = get_state(model).ctx.reductions
        assert queue.spare.take(same[0][1], torch.float32, torch.device("cpu")) is None  # dropped at the end


def test_input_handed_on_only_after_its_wait():
    with fake_world(8):
        layer = fully_shard(nn.Linear(16, 16), mesh=init_device_mesh("cpu", (8,)))
        group = get_state(layer).group
        params = list(group.spec.params)
        plan = plan_reduction(params, group.spec.mesh_info, ReduceSettings(), torch.float32)
        grads = [torch.ones(p.unsharded_size) for p in params]
        queue, done = ReductionQueue(), []
        first = GradReduction(grads, plan, done.append, spare=queue.spare)
        queue.submit(first)  # the reduce-scatter is issued, not waited for
        first_input = first._spare_on_wait
        assert first_input is not None and first_input.numel() == 8 * sum(plan.shard_numels)
        assert queue.spare.take(first_input.numel(), torch.float32, torch.device("cpu")) is None
        queue.make_room()  # waits for it: its input becomes the spare
        assert len(done) == 1
        second = GradReduction(grads, plan, done.append, spare=queue.spare)
        queue.submit(second)
        assert second._spare_on_wait is first_input  # reduces from the first one's input
        queue.drain()
        assert len(done) == 2
        assert queue.spare.take(first_input.numel(), torch.float32, torch.device("cpu")) is None
