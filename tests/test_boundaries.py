"""The package's internal boundaries, checked on the source (no ranks needed).

- ``fullshard/_core/comm.py`` is the only module of the library that calls a
  torch.distributed collective (so the comm spy sees every one). ``training/``
  and ``testing/`` are programs built on the library, like a user's script:
  ``fullshard train``'s statistics all-reduce is not the model's traffic and
  must not be counted in its bytes per step.
- ``training/`` (the ranks of ``fullshard train``) does not import ``cli/``
  (the launcher).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "fullshard"

COLLECTIVES = {
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "all_gather_single",
    "all_reduce",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "batch_isend_irecv",
    "broadcast",
    "broadcast_object_list",
    "gather",
    "gather_object",
    "irecv",
    "isend",
    "monitored_barrier",
    "recv",
    "reduce",
    "reduce_scatter",
    "reduce_scatter_single",
    "reduce_scatter_tensor",
    "scatter",
    "scatter_object_list",
    "send",
    "_all_gather_base",
    "_reduce_scatter_base",
}


def collective_calls(source: str) -> list[str]:
    """``name:line`` of each torch.distributed collective called (or imported by name) in ``source``."""
    tree = ast.parse(source)
    aliases = {"torch.distributed"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {a.asname or a.name for a in node.names if a.name == "torch.distributed"}
        if isinstance(node, ast.ImportFrom) and node.module == "torch" and node.level == 0:
            aliases |= {a.asname or a.name for a in node.names if a.name == "distributed"}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found += [f"{a.name}:{node.lineno}" for a in node.names if a.name in COLLECTIVES]
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in COLLECTIVES:
            if ast.unparse(node.func.value) in aliases:
                found.append(f"{node.func.attr}:{node.lineno}")
    return found


def _library_modules() -> list[Path]:
    skipped = {"training", "testing"}
    return [p for p in sorted(PACKAGE.rglob("*.py")) if p.relative_to(PACKAGE).parts[0] not in skipped]


def test_scanner_finds_collectives() -> None:
    source = (
        "import torch.distributed as dist\nimport torch\nfrom torch.distributed import barrier\n"
        "dist.all_reduce(t)\ntorch.distributed.broadcast_object_list(x)\ndist.get_rank()\n"
    )
    assert collective_calls(source) == ["barrier:3", "all_reduce:4", "broadcast_object_list:5"]


@pytest.mark.parametrize("path", _library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_comm_calls_collectives(path: Path) -> None:
    if path == PACKAGE / "_core" / "comm.py":
        assert collective_calls(path.read_text()), "comm.py calls no collective: is the scanner broken?"
        return
    calls = collective_calls(path.read_text())
    assert not calls, f"{path.relative_to(PACKAGE)} calls collectives {calls}; go through fullshard._core.comm"


@pytest.mark.parametrize("path", sorted((PACKAGE / "training").glob("*.py")), ids=lambda p: p.name)
def test_training_does_not_import_cli(path: Path) -> None:
    imported = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    assert not [m for m in imported if m in ("..cli", "fullshard.cli") or m.startswith(("..cli.", "fullshard.cli."))]
