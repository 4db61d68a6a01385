"""``benchmarks/bench.py --device cpu --fake-world 8``: the device mode's code path
(fake process group, one process, profiled copy time) runs for one step."""

import os
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench  # noqa: E402  (the benchmarks folder is not a package)
import device_mode  # noqa: E402


def test_fake_world_smoke():
    args = bench.parse_args(
        ["--device", "cpu", "--fake-world", "8", "--model", "gpt-tiny", "--seq", "16", "--batch", "1"]
        + ["--warmup", "1", "--steps", "1", "--frameworks", "fullshard,fsdp2,fullshard-wrapper,local"]
    )
    results = device_mode.run(args)
    assert list(results) == ["fullshard", "fsdp2", "fullshard-wrapper"]  # no unsharded row at a fake world
    for row in results.values():
        assert row["step_s"] > 0 and row["copy_calls"] > 0 and row["tokens_per_s"] > 0
        assert all(torch.isfinite(torch.tensor(row["losses"])))
