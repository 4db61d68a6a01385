"""Nothing sharded outlives its model (issue 36): after ``del model, optim`` no state, unit,
shard, gathered tensor, mesh or process group of ours stays alive, for every front end and
strategy and every path a step can take; and a process that creates and destroys process
groups around sharded models keeps a flat thread count (a leaked gloo group keeps its threads)."""

import pytest

from fullshard.testing import case, distributed
from fullshard.testing.lifecycle import CONFIGS, leftovers, threads_over_group_cycles

# The inner loop keeps one configuration per front end; the table runs whole in make test.
FAST = ("full", "wrapper:FULL_SHARD")


def _assert_nothing_left(names):
    for name in names:
        with case(name):
            left = leftovers(name)
            assert not left, f"{name}: one more build-step-delete cycle left these alive: {left}"


@distributed(world_size=2)
def test_nothing_outlives_its_model_fast():
    _assert_nothing_left(FAST)


@pytest.mark.slow
@distributed(world_size=2, timeout=300)
def test_nothing_outlives_its_model_in_any_configuration():
    _assert_nothing_left([name for name in CONFIGS if name not in FAST])


@pytest.mark.slow
@distributed(world_size=4)
def test_nothing_outlives_a_two_dimensional_mesh():
    _assert_nothing_left(["hsdp", "wrapper:HYBRID_SHARD:orig"])


@pytest.mark.slow
def test_thread_count_stays_flat_over_process_group_cycles():
    # One pair of fresh processes for the three configurations (each pair costs two imports of torch).
    names = ["full", "hsdp", "wrapper:HYBRID_SHARD:orig"]
    for name, counts in threads_over_group_cycles(names, cycles=3).items():
        for rank, per_cycle in enumerate(counts):
            assert per_cycle[-1] == per_cycle[0], f"{name}: rank {rank}'s threads after each cycle: {per_cycle}"
