"""``benchmarks/bench_units.py --fake-world N``: every framework trains the same
small-unit model in one process, and the profiler breakdown attributes the step."""

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_units  # noqa: E402  (the benchmarks folder is not a package)


def test_fake_world_smoke():
    args = bench_units.parse_args(
        ["--fake-world", "4", "--units", "3", "--warmup", "1", "--steps", "2", "--count-steps", "1"]
    )
    result = bench_units.measure(args)
    assert list(result["frameworks"]) == list(bench_units.FRAMEWORKS)
    # (the fake group moves no data, so the sharded frameworks' losses are not the plain model's)
    for name, entry in result["frameworks"].items():
        assert entry["step"]["median"] > 0 and entry["cpu"]["median"] > 0 and len(entry["first_losses"]) == 2
        categories = entry["breakdown"]["by_category"]
        assert sum(categories.values()) > 0 and categories["model + optimizer"] > 0
        assert entry["calls"]["python"] > 0 and entry["calls"]["builtin"] > 0
        if name == "fullshard":  # our profiler labels, see [Note: Profiler labels]
            assert entry["calls"]["python"] > result["frameworks"]["local"]["calls"]["python"]
            assert {"fullshard::all_gather", "fullshard::copy_out", "fullshard::reduce_scatter"} <= set(
                entry["breakdown"]["by_label"]
            )
