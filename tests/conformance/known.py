"""What the matrix knows: where torch's FSDP itself fails on CPU, and our deliberate differences.

Each row names the scenarios it covers and why. A torch failure makes a scenario compare nothing (ours must
still not raise); a deliberate difference excuses one difference of a kind other than ``value`` (wrong
values are never deliberate: they are fixed).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import NamedTuple

from .record import Difference
from .scenarios import Scenario


class TorchFailure(NamedTuple):
    applies: Callable[[Scenario], bool]
    message: str  # a regex on torch's exception message
    reason: str


class Deliberate(NamedTuple):
    applies: Callable[[Scenario, Difference], bool]
    reason: str


TORCH_FAILURES: tuple[TorchFailure, ...] = ()

DELIBERATE: tuple[Deliberate, ...] = ()


def torch_failure(s: Scenario, message: str) -> str | None:
    for row in TORCH_FAILURES:
        if row.applies(s) and re.search(row.message, message):
            return row.reason
    return None


def deliberate(s: Scenario, d: Difference) -> str | None:
    if d.kind == "value":
        return None
    for row in DELIBERATE:
        if row.applies(s, d):
            return row.reason
    return None
