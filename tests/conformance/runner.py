"""Runs scenarios on this rank under torch's FSDP and under fullshard, and compares the two records.

Called on every rank of a pool (``run_distributed(run_chunk, world, names)``); returns, per scenario, the
differences this rank saw and whether torch itself failed (see ``known.TORCH_FAILURES``).
"""

from __future__ import annotations

import re
import warnings

import torch
import torch.distributed as dist

from . import probes_variants  # noqa: F401 - registers its probes in probes.PROBES
from .frontends import api, forget_meshes, make
from .known import single_state_optimizer, torch_failure_row
from .probes import Run, run_probe
from .record import Difference, Record, compare
from .scenarios import Scenario

IGNORED_WARNINGS = (FutureWarning, DeprecationWarning)
# torch.distributed's own notes on its internals (object collectives), not about FSDP.
IGNORED_MESSAGES = re.compile(r"Multiple backends are registered|`_get_pg_default_device` will be deprecated")


def record(s: Scenario, lib: str) -> Record:
    """Everything a user could observe of scenario ``s`` under framework ``lib``."""
    rec = Record()
    a = api(lib)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            model = make(s, a)
            params = [p for p in model.parameters() if p.requires_grad]
            optim = (
                torch.optim.SGD(params, lr=0.05, momentum=0.9)
                if single_state_optimizer(s)
                else torch.optim.Adam(params, lr=0.01)
            )
            run_probe(Run(s, a, model, optim, rec))
        except Exception as exc:  # noqa: BLE001 - an exception is an observable like any other
            rec.items["raised"] = type(exc).__name__
            rec.items["message"] = str(exc)
    kept = [
        w
        for w in caught
        if not issubclass(w.category, IGNORED_WARNINGS) and not IGNORED_MESSAGES.search(str(w.message))
    ]
    rec.items["warnings"] = tuple(sorted({w.category.__name__ for w in kept}))
    rec.items["~warning_text"] = tuple(sorted({str(w.message)[:160] for w in kept}))  # shown, not compared
    dist.barrier()
    return rec


# [Note: Matrix tolerances]
# A tolerance must sit well below the smallest effect it is there to see: one optimizer update. The probes
# step Adam at lr 0.01 (each step moves a parameter by about 0.01 whatever its gradient's size) or SGD at lr
# 0.05 to 0.1, 1 to 3 times. fp32: both sides sum the same numbers in another order, about 1e-6 apart.
# bf16 (mixed precision, or a bf16 model): a value cast to bf16 is rounded to 2**-8 of itself and the two sides
# may round a sum at different points, so two bf16 steps (2**-7) relative, and 1e-3 absolute for values near
# zero: a tenth of one Adam update. A zeroed, unreduced or doubled gradient moves a parameter by a whole
# update and fails in either precision.
FP32_TOLERANCE = (1e-4, 1e-5)
BF16_TOLERANCE = (2.0**-7, 1e-3)


def tolerance(s: Scenario) -> tuple[float, float]:
    """(rtol, atol) for scenario ``s``'s tensors (see [Note: Matrix tolerances])."""
    half = s.mixed or s.probe == "eval_half_root"  # that probe's model itself is in bf16
    return BF16_TOLERANCE if half else FP32_TOLERANCE


def run_scenario(s: Scenario) -> tuple[str, str | None, list[Difference]]:
    """(name, why torch failed or None, differences)."""
    print("scenario", s.name, flush=True)  # the rank's log names the scenario a crash came from
    failure = torch_failure_row(s)
    if failure is None:
        theirs = record(s, "torch")
        return s.name, None, compare(theirs, record(s, "ours"), *tolerance(s))
    if failure.stand_in is not None:  # torch's record of a scenario it can run, with the same values
        theirs = record(failure.stand_in(s), "torch")
        return s.name, failure.reason, compare(theirs, record(s, "ours"), *tolerance(s))
    ours = record(s, "ours")  # the documented error
    raised = ours.items.get("raised")
    wrong = [] if raised == failure.raises else [Difference("exception", "raised", f"documented {failure.raises}, ours {raised}")]
    return s.name, failure.reason, wrong


def run_chunk(scenarios: list[Scenario]) -> list[tuple[str, str | None, list[Difference]]]:
    torch.set_num_threads(1)
    try:
        return [run_scenario(s) for s in scenarios]
    finally:
        forget_meshes()


def raised_by_ours(scenarios: list[Scenario]) -> list[str | None]:
    """The exception type each scenario raised under fullshard (None: it ran to the end)."""
    torch.set_num_threads(1)
    try:
        return [record(s, "ours").items.get("raised") for s in scenarios]
    finally:
        forget_meshes()
