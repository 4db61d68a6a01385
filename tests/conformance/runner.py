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
from .known import single_state_optimizer, torch_failure
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


def run_scenario(s: Scenario) -> tuple[str, str | None, list[Difference]]:
    """(name, why torch failed or None, differences)."""
    print("scenario", s.name, flush=True)  # the rank's log names the scenario a crash came from
    reason = torch_failure(s)
    if reason is not None:
        record(s, "ours")  # must not crash or hang
        return s.name, reason, []
    theirs = record(s, "torch")
    ours = record(s, "ours")
    half = s.mixed or s.probe == "eval_half_root"  # that probe's model itself is in bf16
    tol = (2e-2, 2e-2) if half else (1e-4, 1e-5)
    return s.name, None, compare(theirs, ours, *tol)


def run_chunk(scenarios: list[Scenario]) -> list[tuple[str, str | None, list[Difference]]]:
    torch.set_num_threads(1)
    try:
        return [run_scenario(s) for s in scenarios]
    finally:
        forget_meshes()
