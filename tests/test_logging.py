"""The ``fullshard`` logger: DEBUG lines at lazy init that match what a step moves; silence by default."""

import logging
import re

import torch
import torch.nn as nn

from fullshard import MixedPrecisionPolicy, fully_shard
from fullshard._core import comm
from fullshard.models import MLP
from fullshard.testing import distributed


class _Capture(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


def _step(model: nn.Module) -> list[comm.CommRecord]:
    with comm.record_comms() as records:
        model(torch.ones(2, 8)).sum().backward()
    return records


def _capture(level: int) -> tuple[_Capture, logging.Logger]:
    handler = _Capture()
    logger = logging.getLogger("fullshard")
    logger.addHandler(handler)
    logger.setLevel(level)
    return handler, logger


@distributed(world_size=2)
def test_debug_lines_at_lazy_init_count_the_step_bytes():
    handler, logger = _capture(logging.DEBUG)
    try:
        model = nn.Sequential(MLP(8), MLP(8))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16)
        fully_shard(model[0], mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        records = _step(model)
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    lines = [r.getMessage() for r in handler.records]
    assert all(r.levelno == logging.DEBUG and r.name.startswith("fullshard") for r in handler.records)
    assert lines[0] == "lazy init of root Sequential: 2 units"
    assert lines[1].startswith("mesh (2,) (dims None) on cpu: shard group 2 ranks, replicate group 1 ranks")
    units = [line for line in lines if line.startswith("unit ") and " bytes per step" not in line]
    assert [u.split(":")[0] for u in units] == ["unit Sequential", "unit 0"]
    # MLP(8): in_proj 8x32 + 32, out_proj 32x8 + 8 = 552 fp32 elements (276 per rank);
    # the root unit holds the second MLP.
    assert units[1].startswith("unit 0: 4 parameters, 552 elements, 2208 bytes (1104 per rank sharded)")
    assert "dtypes ['torch.float32'], compute dtype ['torch.bfloat16'], reduce dtype torch.bfloat16" in units[1]
    assert "offload False, reshard after forward True" in units[1]
    per_unit = [
        re.search(r"all-gather (\d+) \((\d+) calls\), reduce-scatter (\d+), all-reduce (\d+)", line)
        for line in lines
        if " bytes per step" in line
    ]
    logged = {
        "all_gather": sum(int(m.group(1)) for m in per_unit),
        "reduce_scatter": sum(int(m.group(3)) for m in per_unit),
        "all_reduce": sum(int(m.group(4)) for m in per_unit),
    }
    measured = {op: sum(r.nbytes for r in records if r.op == op) for op in logged}
    assert logged == measured and measured["all_gather"] > 0 and measured["reduce_scatter"] > 0


@distributed(world_size=2)
def test_nothing_logged_at_the_default_level():
    handler, logger = _capture(logging.WARNING)
    try:
        model = nn.Sequential(MLP(8), MLP(8))
        fully_shard(model[0])
        fully_shard(model)
        _step(model)
        model.state_dict()
    finally:
        logger.removeHandler(handler)
        logger.setLevel(logging.NOTSET)
    assert handler.records == []


def test_one_logger_tree():
    """Every logger the package makes is ``fullshard`` or a child of it."""
    import fullshard.wrapper  # noqa: F401  - import every module that might make one

    names = [name for name in logging.root.manager.loggerDict if "fullshard" in name]
    assert names and all(name == "fullshard" or name.startswith("fullshard.") for name in names)
