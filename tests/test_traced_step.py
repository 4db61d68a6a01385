"""How many of fullshard's files one step walks through, on torch's fake process group.

A reader follows a step by following its calls; every file a call crosses into is
one more file to open. The measure is the set of fullshard's files a phase enters
(any function of the file runs), for init (the ``fully_shard`` calls), lazy init
(the root's first-forward setup), a steady-state forward and backward, and a
``state_dict()``. torch's FSDP2 enters 7 / 3 / 6 / 5 / 1 files; no phase may enter
more than issue 34's ``LIMITS``. ``fullshard/testing/`` (the harness) is not counted.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard import fully_shard
from fullshard.testing.fake_group import fake_world
from fullshard.testing.harness import run_in_fresh_process

PACKAGE = Path(fullshard.__file__).resolve().parent
NOT_COUNTED = PACKAGE / "testing"
LIMITS = {"init": 12, "lazy init": 6, "forward": 8, "backward": 8, "state dict": 3}  # issue 34's targets


def _ours(filename: str) -> str | None:
    path = Path(filename)
    if path.is_relative_to(PACKAGE) and not path.is_relative_to(NOT_COUNTED):
        return str(path.relative_to(PACKAGE))
    return None


@contextmanager
def entered_files(inside: Callable[..., Any] | None = None) -> Iterator[set[str]]:
    """The files of ours whose functions run in the block; with ``inside``, only
    those run (transitively) by a call of the function ``inside``."""
    files: set[str] = set()
    target = inside.__code__ if inside is not None else None
    active: list[FrameType] = []

    def profile(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            if frame.f_code is target:
                active.append(frame)
            if target is None or active:
                name = _ours(frame.f_code.co_filename)
                if name is not None:
                    files.add(name)
        elif event == "return" and active and frame is active[-1]:
            active.pop()

    sys.setprofile(profile)
    try:
        yield files
    finally:
        sys.setprofile(None)


def traced_step() -> dict[str, set[str]]:
    """The files of ours each phase enters, on a 3-unit model at fake world 4."""
    phases: dict[str, set[str]] = {}
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.Linear(16, 4))
        x = torch.randn(2, 8)
        with entered_files() as phases["init"]:
            fully_shard(model[0], mesh=mesh)
            fully_shard(model[2], mesh=mesh)
            fully_shard(model, mesh=mesh)
        lazy_init = type(fully_shard.state(model)).lazy_init
        with entered_files(lazy_init) as phases["lazy init"]:
            model(x).sum().backward()
        model(x).sum().backward()  # the orders recorded: the next step prefetches
        with entered_files() as phases["forward"]:
            loss = model(x).sum()
        with entered_files() as phases["backward"]:
            loss.backward()
        with entered_files() as phases["state dict"]:
            model.state_dict()
    return phases


def test_the_measure_sees_a_call_and_only_inside_the_function() -> None:
    with entered_files() as everything:
        assert fullshard.DataParallelMeshDims(shard="dp").shard_names == ("dp",)  # __post_init__, then _names
        _ours("x")  # this test's file is not ours
    assert everything == {"api.py"}, everything
    with entered_files(fullshard.DataParallelMeshDims.__post_init__) as inside:
        assert fullshard.DataParallelMeshDims(shard="dp").shard_names == ("dp",)
    assert inside == {"api.py"}, inside
    with entered_files(fullshard.DataParallelMeshDims.__post_init__) as inside:
        fullshard.api._names("dp")
    assert inside == set(), inside


@pytest.fixture(scope="module")
def phases() -> dict[str, set[str]]:
    """Traced in a fresh process, as a user's step runs: after earlier tests, torch's DTensor
    dispatch caches hold their equal meshes, an op's output spec can carry one, and the state
    dict then takes the mesh-identity fallback (``compat.same_groups``)."""
    return run_in_fresh_process(traced_step, timeout=300)


def test_a_step_enters_few_files(phases: dict[str, set[str]]) -> None:
    for phase, limit in LIMITS.items():
        count = len(phases[phase])
        assert count <= limit, f"{phase} enters {count} files of fullshard: {sorted(phases[phase])}"


if __name__ == "__main__":
    for phase, files in traced_step().items():
        print(f"{phase:11s} {len(files):3d}  {' '.join(sorted(files))}")
