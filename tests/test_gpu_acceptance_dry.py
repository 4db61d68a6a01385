"""``benchmarks/gpu_acceptance.sh``: its plan fits the 8-minute window, and its dry mode (CPU, tiny
models, the fake group) writes a summary row with a figure for every step it runs, and a timed-out
step for one that runs past its cap, so the first GPU run does not find a wrong flag or path."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

# make test-launch: the GPU script run as a user runs it, a check of its plumbing, not of the library.
pytestmark = pytest.mark.launch

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "gpu_acceptance.sh"
ALL_STEPS = ["env", "tests-gpu", "tests-smoke", "train-fp32", "train-fp32-offload", "train-bf16",
             "train-bf16-offload", "train-int8", "compile", "bench-offload", "bench-world1", "bench-fake8",
             "bench-fake64"]


def run(tmp_path: Path, *stages: str, **env: str) -> dict[str, tuple[str, str]]:
    """Runs the script; returns its summary's rows, step -> (rc, figure)."""
    environ = os.environ | {"OUT": str(tmp_path), "PYTHON": sys.executable} | env
    subprocess.run(["bash", str(SCRIPT), *stages], cwd=ROOT, env=environ, check=True, timeout=240,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    rows = {}
    for line in (tmp_path / "summary.txt").read_text().splitlines()[2:]:
        match = re.match(r"(\S+)\s+(\S+)\s+\d+\s+(.*)$", line)
        if match and not line.startswith("total"):
            rows[match.group(1)] = (match.group(2), match.group(3))
    return rows


def test_plan_lists_every_step_within_budget(tmp_path):
    summary = subprocess.run(["bash", str(SCRIPT), "plan"], cwd=ROOT, env=os.environ | {"OUT": str(tmp_path)},
                             check=True, capture_output=True, text=True).stdout
    assert [line.split()[0] for line in summary.splitlines()[:-1] if not line.startswith(" ")] == ALL_STEPS
    caps = int(re.search(r"^caps: (\d+)s in all", summary, re.MULTILINE).group(1))
    assert caps <= 450  # 7.5 minutes: under 8 with the machine's start-up


def test_gpu_run_arguments_parse(tmp_path):
    """PYTHON=echo: each step of the GPU run writes its arguments, which each script's parser accepts."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import bench
    import bench_offload_gpu
    import compile_parity

    from fullshard.cli.__main__ import build_parser
    from fullshard.models import get_preset
    from fullshard.training import TrainConfig

    rows = run(tmp_path, "all", PYTHON="echo")
    assert list(rows) == ALL_STEPS
    checked = []
    for step in ALL_STEPS:
        argv = (tmp_path / f"{step}.log").read_text().splitlines()[-1].split()
        if argv[:3] == ["-m", "fullshard", "train"]:
            args = build_parser().parse_args(argv[2:])
            TrainConfig.from_args(args).validate_world(args.nproc)
            assert args.device == "cuda" and args.metrics == str(tmp_path / f"{step}.jsonl")
        elif argv[0] == "benchmarks/bench.py":
            assert bench.parse_args(argv[1:]).device == "cuda"
        elif argv[0] == "benchmarks/compile_parity.py":
            assert compile_parity.parse_args(argv[1:]).device == "cuda"
        elif argv[0] == "benchmarks/bench_offload_gpu.py":
            get_preset(bench_offload_gpu.parse_args(argv[1:]).model)
        else:
            continue
        checked.append(step)
    assert checked == ALL_STEPS[3:]


@pytest.mark.slow  # real processes: three steps, 60 to 90 s on the loaded 2-core machine
def test_dry_run_writes_every_row(tmp_path):
    rows = run(tmp_path, "dry", "compile", "world1", "fake8", COMPILE_BACKEND="aot_eager")
    assert list(rows) == ["compile", "bench-world1", "bench-fake8"]
    assert all(rc == "0" for rc, _ in rows.values()), rows
    assert rows["compile"][1].startswith("PASS")
    assert re.fullmatch(r"step [\d.]+x local \(<= 1.03, dry\)", rows["bench-world1"][1])
    assert re.fullmatch(r"step [\d.]+x fsdp2 \(<= 0.9, dry\), peak nanx \(<= 0.85, dry\)", rows["bench-fake8"][1])


def test_dry_run_times_out_a_step_and_goes_on(tmp_path):
    rows = run(tmp_path, "dry", "fake8", "fake64", SLACK="0.01", BUDGET_S="100000")  # caps of 1 s
    assert list(rows) == ["bench-fake8", "bench-fake64"]
    assert all(rc == "124" and figure.startswith("TIMED OUT") for rc, figure in rows.values()), rows


def test_steps_past_the_budget_are_skipped(tmp_path):
    rows = run(tmp_path, "dry", "fake8", "fake64", BUDGET_S="1", SLACK="1")
    assert rows == dict.fromkeys(["bench-fake8", "bench-fake64"], ("skip", "skipped: the run's budget (1s) is spent"))
