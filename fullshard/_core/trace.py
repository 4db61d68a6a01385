"""Profiler labels: each unit's data flow, named, in a ``torch.profiler`` trace.

[Note: Profiler labels]
Every communication step of a unit runs inside a ``record_function`` range
named ``fullshard::<stage>(<unit fqn>)`` (the root unit, and every unit before
the root's lazy init named it, is ``<root>``): ``all_gather_copy_in`` (the cast
or host-to-device copy into the input), ``all_gather_quantize``, ``all_gather``
(the collective's issue), ``all_gather_dequantize``, ``copy_out`` (the gathered
buffer into the unsharded parameters), ``reshard``, and the reduction stages
``reduce_copy_in``, ``reduce_scatter``, ``all_reduce`` and ``reduce_copy_out``
(the reduced shards into ``.grad``). A unit carries only its name (the spec's
``label``); the string is built while a profiler runs, once per stage and unit.
``span`` is a no-op context when no profiler is running; the stages every unit
runs twice a step use ``call`` instead, which has no context to enter and exit
then: the hot path pays one C check and one Python call per stage.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

ROOT = "<root>"  # the label of the root unit, and of every unit not yet named
_NOT_PROFILING: contextlib.AbstractContextManager[None] = contextlib.nullcontext()
_Result = TypeVar("_Result")


@functools.cache
def _label(stage: str, unit: str) -> str:
    return f"fullshard::{stage}({unit})"


def span(stage: str, unit: str) -> contextlib.AbstractContextManager[None]:
    """A profiler range for ``unit``'s ``stage`` while a profiler runs, else nothing."""
    if not torch._C._autograd._profiler_enabled():
        return _NOT_PROFILING
    return torch.profiler.record_function(_label(stage, unit))


def call(stage: str, unit: str, fn: Callable[..., _Result], *args: Any) -> _Result:
    """``fn(*args)``, inside a profiler range for ``unit``'s ``stage`` while a profiler runs."""
    if not torch._C._autograd._profiler_enabled():
        return fn(*args)
    with torch.profiler.record_function(_label(stage, unit)):
        return fn(*args)
