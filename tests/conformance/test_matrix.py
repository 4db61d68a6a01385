"""The differential conformance matrix (issue 23): each scenario runs under torch's FSDP and under fullshard
on the same ranks, and every observable difference fails here unless ``known.py`` explains it.

``make test-fast`` runs the fast chunks (2 ranks); ``make test`` also the slow ones (2 and 4 ranks).
Diagnose one scenario with ``run_distributed(run_chunk, world, [scenario])`` (it returns each rank's
differences).
"""

from __future__ import annotations

import pytest

from fullshard.testing import run_distributed

from .known import explain, torch_failure
from .runner import run_chunk
from .scenarios import Scenario, matrix

CHUNK = 20


def _chunks() -> list:
    params = []
    for fast in (True, False):
        for world in (2, 4):
            chosen = [s for s in matrix() if s.fast == fast and s.world == world]
            for start in range(0, len(chosen), CHUNK):
                marks = () if fast else (pytest.mark.slow,)
                label = f"{'fast' if fast else 'slow'}-w{world}-{start // CHUNK}"
                params.append(pytest.param(chosen[start : start + CHUNK], id=label, marks=marks))
    return params


def unexplained(scenarios: list[Scenario]) -> list[str]:
    """Every difference no row of ``known.py`` explains, one line each, naming scenario and rank."""
    by_name = {s.name: s for s in scenarios}
    lines = []
    results = run_distributed(run_chunk, scenarios[0].world, scenarios, timeout=600)
    for rank, per_rank in enumerate(results):
        for name, _torch_failure, differences in per_rank:
            for difference in differences:
                if explain(by_name[name], difference) is None:
                    lines.append(f"{name} rank {rank}: {difference.kind} {difference.key}: {difference.detail}")
    return lines


@pytest.mark.parametrize("scenarios", _chunks())
def test_conformance(scenarios: list[Scenario]) -> None:
    lines = unexplained(scenarios)
    assert not lines, f"{len(lines)} differences from torch's FSDP:\n" + "\n".join(lines[:60])


def test_matrix_size_and_coverage() -> None:
    """At least 500 scenarios compared with torch; every probe and every front-end setting appears."""
    from .scenarios import COMPOSABLE_PROBES, STRATEGIES, WRAPPER_PROBES

    chosen = matrix()
    assert sum(torch_failure(s) is None for s in chosen) >= 500  # compared with torch, not run alone
    assert {s.probe for s in chosen if s.front == "wrapper"} == set(WRAPPER_PROBES)
    assert {s.probe for s in chosen if s.front == "composable"} == set(COMPOSABLE_PROBES)
    assert {(s.strategy, s.use_orig_params, s.mixed) for s in chosen if s.front == "wrapper" and s.world == 2} == {
        (st, uop, mp) for st in STRATEGIES for uop in (False, True) for mp in (False, True)
    }
    assert {s.world for s in chosen} == {2, 4}
    assert any(s.fast for s in chosen)
