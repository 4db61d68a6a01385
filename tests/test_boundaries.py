"""The package's internal boundaries, checked on the source (no ranks needed).

- ``fullshard/_core/comm.py`` is the only module of the library that calls a
  torch.distributed collective (so the comm spy sees every one), DTensor ones
  included: ``.full_tensor()`` and ``.redistribute(...)`` go through
  ``comm.full_tensor`` / ``comm.redistribute`` (see [Note: DTensor collectives]).
  ``training/`` and ``testing/`` are programs built on the library, like a
  user's script: ``fullshard train``'s statistics all-reduce is not the model's
  traffic and must not be counted in its bytes per step.
- The shared services (state dicts, clipping, the scaler, the engine, ...) do not
  import the wrapper's flat parameter (``_flat_param.py``): they find a
  parameter's unit through the engine (``_core/unit/group.py``). Only the
  wrapper's own modules (``WRAPPER_SIDE``) import it.
- ``training/`` (the ranks of ``fullshard train``) does not import ``cli/``
  (the launcher).
- Clean room: nothing in ``fullshard/`` imports torch's FSDP
  (``torch.distributed.fsdp``, ``torch.distributed._composable``), by an import
  statement or ``importlib``, except the one module marked
  ``# clean-room: rebinds torch's names only`` (``torch_names.py``), which may
  import them to rebind names and calls nothing of theirs: every call in it is
  to a builtin or a function of its own (``REBINDER_CALLS``).
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


DTENSOR_COLLECTIVES = {"full_tensor", "redistribute"}


def dtensor_collective_calls(source: str) -> list[str]:
    """``name:line`` of each ``x.full_tensor()`` / ``x.redistribute(...)`` in ``source`` that is
    not a call of fullshard's comm module (imported as ``from ... import comm``)."""
    tree = ast.parse(source)
    comm_aliases = {
        a.asname or a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names if a.name == "comm"
    }
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in DTENSOR_COLLECTIVES:
            if not (isinstance(node.func.value, ast.Name) and node.func.value.id in comm_aliases):
                found.append(f"{node.func.attr}:{node.lineno}")
    return found


def test_scanner_finds_dtensor_collectives() -> None:
    source = (
        "from ._core import comm\nx.full_tensor()\ncomm.full_tensor(x)\n"
        "g.redistribute(placements=p)\ncomm.redistribute(g, p)\nDTensor.full_tensor(x)\n"
    )
    assert dtensor_collective_calls(source) == ["full_tensor:2", "redistribute:4", "full_tensor:6"]


@pytest.mark.parametrize("path", _library_modules(), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_only_comm_runs_dtensor_collectives(path: Path) -> None:
    if path == PACKAGE / "_core" / "comm.py":
        assert dtensor_collective_calls(path.read_text()), "comm.py runs no DTensor collective: is the scanner broken?"
        return
    calls = dtensor_collective_calls(path.read_text())
    assert not calls, f"{path.relative_to(PACKAGE)} runs DTensor collectives {calls}; use comm.full_tensor / redistribute"


# The wrapper's own modules: the only ones that may import its flat parameter.
WRAPPER_SIDE = {"wrapper.py", "wrapper_arguments.py", "wrapper_optim_state.py", "wrapper_summon.py", "_flat_param.py"}


def imported_modules(path: Path) -> list[str]:
    """The absolute ``fullshard`` modules ``path`` imports (names that may be modules included), anywhere in it."""
    package = list(path.relative_to(PACKAGE.parent).with_suffix("").parts[:-1])
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = ".".join(package[: len(package) - node.level + 1] if node.level else [])
            module = ".".join(part for part in (base, node.module or "") if part)
            found += [module] + [f"{module}.{a.name}" for a in node.names]
    return found


def test_imported_modules_resolves_relative_imports() -> None:
    assert "fullshard._flat_param" in imported_modules(PACKAGE / "wrapper.py")
    assert "fullshard._core.comm" in imported_modules(PACKAGE / "state_dict" / "optim.py")


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_shared_services_do_not_import_the_flat_parameter(path: Path) -> None:
    if path.parent == PACKAGE and path.name in WRAPPER_SIDE:
        return
    flat = [m for m in imported_modules(path) if m == "fullshard._flat_param" or m.startswith("fullshard._flat_param.")]
    assert not flat, (
        f"{path.relative_to(PACKAGE)} imports the wrapper's flat parameter; find a parameter's unit "
        "through fullshard._core.unit (unit_of, buffer_param) instead"
    )


@pytest.mark.parametrize("path", sorted((PACKAGE / "training").glob("*.py")), ids=lambda p: p.name)
def test_training_does_not_import_cli(path: Path) -> None:
    imported = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            imported.append("." * node.level + (node.module or ""))
        if isinstance(node, ast.Import):
            imported += [a.name for a in node.names]
    assert not [m for m in imported if m in ("..cli", "fullshard.cli") or m.startswith(("..cli.", "fullshard.cli."))]


TORCH_FSDP = ("torch.distributed.fsdp", "torch.distributed._composable")
CLEAN_ROOM_MARK = "# clean-room: rebinds torch's names only"
# What the rebinding module may call: builtins, importlib, its own functions and list/dict methods.
REBINDER_CALLS = {
    "getattr", "setattr", "isinstance", "len", "any", "set", "import_module", "TorchNamesRebound", "_ours", "_extra",
    "_torch_modules", "undo",
    "pop", "append", "update", "items",
}  # fmt: skip


def torch_fsdp_imports(source: str) -> list[str]:
    """``module:line`` of each import of torch's FSDP in ``source`` (anywhere, ``importlib`` included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module] + [f"{node.module}.{a.name}" for a in node.names]
        elif isinstance(node, ast.Call) and ast.unparse(node.func).endswith(("import_module", "__import__")):
            names = [a.value for a in node.args[:1] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        found += [f"{n}:{node.lineno}" for n in names if n.startswith(TORCH_FSDP)][:1]
    return found


def called_names(source: str) -> set[str]:
    """The last segment of every called name in ``source`` (``importlib.import_module`` -> ``import_module``)."""
    calls = [n.func for n in ast.walk(ast.parse(source)) if isinstance(n, ast.Call)]
    return {f.attr if isinstance(f, ast.Attribute) else ast.unparse(f) for f in calls}


def test_clean_room_scanner_finds_imports() -> None:
    source = (
        "import torch.distributed.fsdp\nfrom torch.distributed import fsdp\n"
        "def f():\n    from torch.distributed._composable.fsdp import fully_shard\n"
        "importlib.import_module('torch.distributed.fsdp.wrap')\nimport torch.distributed.tensor\n"
    )
    assert torch_fsdp_imports(source) == [
        "torch.distributed.fsdp:1",
        "torch.distributed.fsdp:2",
        "torch.distributed._composable.fsdp:4",
        "torch.distributed.fsdp.wrap:5",
    ]
    assert called_names("a.b.c(x)\nf(g(y))\n") == {"c", "f", "g"}


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: str(p.relative_to(PACKAGE)))
def test_clean_room(path: Path) -> None:
    source = path.read_text()
    if CLEAN_ROOM_MARK in source.splitlines():
        assert path == PACKAGE / "torch_names.py", f"{path.relative_to(PACKAGE)} claims the clean-room exception"
        extra = called_names(source) - REBINDER_CALLS
        assert not extra, f"torch_names.py calls {sorted(extra)}: it may only rebind names"
        return
    imports = torch_fsdp_imports(source)
    assert not imports, f"{path.relative_to(PACKAGE)} imports torch's FSDP {imports}; fullshard is a clean room"


def test_the_rebinding_module_is_marked() -> None:
    assert CLEAN_ROOM_MARK in (PACKAGE / "torch_names.py").read_text().splitlines()
