"""A fault on one rank ends every rank within a bounded time, with the rank and the cause named
(issue 36): real processes under torchrun, as ``fullshard train`` launches them. The table of
every fault next to torch's FSDP2 is benchmarks/bench_faults.py's (benchmarks/RESULTS.md)."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))

import bench_faults  # noqa: E402  (the benchmarks folder is not a package)


@pytest.mark.launch
@pytest.mark.parametrize("fault", ["raise-backward", "sigkill", "disagree"])
def test_a_fault_on_one_rank_ends_every_rank_naming_it(fault):
    result = bench_faults.run_one("fullshard", fault)
    tail = result.pop("tail")  # the launcher's output, shown whole: a dict's repr in pytest's report is cut short
    # code 1, not the run's 150 s timeout: every rank exited, well inside the process group's 60 s timeout
    # (nobody waited it out), the rank and the cause named, and no gloo abort on the way
    assert result["code"] == 1 and result["seconds"] < 60 and result["named"] and not result["aborted"], (
        f"{result}\n{tail}"
    )
    assert result["last_step"] == (-1 if fault == "disagree" else 2), result
