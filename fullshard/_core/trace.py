"""Profiler labels: each unit's data flow, named, in a ``torch.profiler`` trace.

[Note: Profiler labels]
Every communication step of a unit runs inside a ``record_function`` range
named ``fullshard::<stage>(<unit fqn>)`` (the root unit is ``<root>``):
``all_gather_copy_in`` (the cast or host-to-device copy into the input),
``all_gather`` (the collective's issue),
``copy_out`` (the gathered buffer into the unsharded parameters), ``reshard``,
and the reduction stages ``reduce_copy_in``, ``reduce_scatter``,
``all_reduce`` and ``reduce_copy_out`` (the reduced shards into ``.grad``).
The strings are built once per unit name (``unit_labels``), and ``span`` is a
no-op context when no profiler is running. The stages every unit runs twice a
step use ``call`` instead, which has no context to enter and exit then: the
hot path pays one C check and one Python call per stage.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

_NOT_PROFILING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
_Result = TypeVar("_Result")


@dataclass(frozen=True)
class UnitLabels:
    all_gather_copy_in: str
    all_gather_quantize: str
    all_gather: str
    all_gather_dequantize: str
    copy_out: str
    reshard: str
    reduce_copy_in: str
    reduce_scatter: str
    all_reduce: str
    reduce_copy_out: str


@functools.cache
def unit_labels(fqn: str) -> UnitLabels:
    """The labels of the unit managing module ``fqn`` ("" for the root)."""
    name = fqn or "<root>"
    return UnitLabels(*(f"fullshard::{stage}({name})" for stage in UnitLabels.__dataclass_fields__))


def span(label: str) -> contextlib.AbstractContextManager[None]:
    """A profiler range named ``label`` while a profiler runs, else nothing."""
    if not torch._C._autograd._profiler_enabled():
        return _NOT_PROFILING
    return torch.profiler.record_function(label)


def call(label: str, fn: Callable[..., _Result], *args: Any) -> _Result:
    """``fn(*args)``, inside a profiler range named ``label`` while a profiler runs."""
    if not torch._C._autograd._profiler_enabled():
        return fn(*args)
    with torch.profiler.record_function(label):
        return fn(*args)
