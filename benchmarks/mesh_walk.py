"""Follow ``fully_shard``'s ``mesh`` argument through the code (issue 34): where it stops.

A stop is a call of a function of the package that is handed the mesh or what it
became: among the call's arguments (``self`` included) the ``DeviceMesh`` itself,
one of its process groups, or a mesh description holding either (our ``MeshInfo``
and ``GroupInfo``; torch's ``FSDPMeshInfo`` and its subclasses). Objects that
merely keep such a description (a parameter's shard) are not followed. The walk is the stops in call order on
one ``fully_shard(model, mesh=mesh)`` of a 2-layer model at fake world 4 (init
only: lazy init and the step are other measures, ``tests/test_traced_step.py``).
Reported: stops, distinct files, and returns (a stop in a file the walk had
entered before, but not at the stop just before).

    PYTHONPATH=$PWD python benchmarks/mesh_walk.py            # fullshard
    PYTHONPATH=$PWD python benchmarks/mesh_walk.py --torch    # torch's FSDP2, the same walk
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from types import FrameType
from typing import Any

import torch
import torch.nn as nn
from torch.distributed.device_mesh import init_device_mesh

import fullshard
from fullshard.testing.fake_group import fake_world

DESCRIPTIONS = ("MeshInfo", "GroupInfo", "FSDPMeshInfo", "HSDPMeshInfo", "DDPMeshInfo")


def _holds(value: Any, mesh: Any, groups: list[Any]) -> bool:
    if value is mesh or any(value is g for g in groups):
        return True
    if type(value).__name__ not in DESCRIPTIONS:
        return False
    attributes = getattr(value, "__dict__", None) or {
        name: getattr(value, name) for name in getattr(type(value), "__slots__", ())
    }
    return any(v is mesh or any(v is g for g in groups) for v in attributes.values())


def walk(use_torch: bool) -> list[tuple[str, str]]:
    """(file, function) of every stop, in call order."""
    if use_torch:
        from torch.distributed.fsdp import _fully_shard as package
        from torch.distributed.fsdp import fully_shard
    else:
        from fullshard import fully_shard

        package = fullshard
    root = Path(package.__file__).resolve().parent
    skipped = root / "testing"
    stops: list[tuple[str, str]] = []
    with fake_world(4):
        mesh = init_device_mesh("cpu", (4,))
        groups = [mesh.get_group(0)]
        model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 4))
        torch.manual_seed(0)

        def profile(frame: FrameType, event: str, arg: Any) -> None:
            if event != "call":
                return
            path = Path(frame.f_code.co_filename)
            if not path.is_relative_to(root) or path.is_relative_to(skipped):
                return
            code = frame.f_code
            names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
            if any(_holds(frame.f_locals.get(name), mesh, groups) for name in names):
                stops.append((str(path.relative_to(root)), code.co_qualname))

        sys.setprofile(profile)
        try:
            fully_shard(model, mesh=mesh)
        finally:
            sys.setprofile(None)
    return stops


def summary(stops: list[tuple[str, str]]) -> tuple[int, int, int]:
    """(stops, files, returns to a file left before)."""
    seen: set[str] = set()
    returns, previous = 0, None
    for file, _ in stops:
        if file in seen and file != previous:
            returns += 1
        seen.add(file)
        previous = file
    return len(stops), len(seen), returns


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--torch", action="store_true", help="walk torch's FSDP2 instead")
    args = parser.parse_args()
    found = walk(args.torch)
    for file, function in found:
        print(f"  {file}: {function}")
    count, files, returns = summary(found)
    print(f"{'FSDP2' if args.torch else 'fullshard'}: {count} stops in {files} files, {returns} returns")
