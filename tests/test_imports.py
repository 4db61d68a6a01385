"""The package's modules import each other without a cycle, type-hint imports included.

A cycle hidden behind ``if TYPE_CHECKING:`` still ties two modules into one
concept; the engine's layering (unit < per-root context < module state < front
ends) is what keeps each file readable on its own. Imports inside functions are
deliberate late bindings and not counted.
"""

import ast
from pathlib import Path

import fullshard

PACKAGE = Path(fullshard.__file__).parent


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _module_level_imports(tree: ast.Module) -> list[ast.Import | ast.ImportFrom]:
    """Imports run when the module is (type-)checked: at top level, or inside
    top-level ``if`` (``TYPE_CHECKING`` included) and ``try`` blocks."""
    found: list[ast.Import | ast.ImportFrom] = []
    pending: list[ast.stmt] = list(tree.body)
    while pending:
        node = pending.pop()
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If):
            pending += node.body + node.orelse
        elif isinstance(node, ast.Try):
            pending += node.body + node.orelse + node.finalbody + [s for h in node.handlers for s in h.body]
    return found


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``fullshard`` modules it imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        is_package = path.name == "__init__.py"
        edges: set[str] = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = name.split(".")[: len(name.split(".")) - node.level + (1 if is_package else 0)]
                    base = ".".join(anchor + ([base] if base else []))
                # "from pkg import mod" imports the module pkg.mod when there is one.
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in paths else base for a in node.names]
            edges |= {t for t in targets if t in paths and t != name}
        graph[name] = edges
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle as [a, b, ..., a], or None."""
    done: set[str] = set()
    stack: list[str] = []
    on_stack: set[str] = set()

    def visit(node: str) -> list[str] | None:
        stack.append(node)
        on_stack.add(node)
        for target in sorted(graph[node]):
            if target in on_stack:
                return stack[stack.index(target) :] + [target]
            if target not in done:
                cycle = visit(target)
                if cycle:
                    return cycle
        stack.pop()
        on_stack.discard(node)
        done.add(node)
        return None

    for start in sorted(graph):
        if start not in done:
            cycle = visit(start)
            if cycle:
                return cycle
    return None


def test_find_cycle_reports_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_graph_sees_type_checking_imports_but_not_function_bodies():
    source = "if TYPE_CHECKING:\n    from .a import A\ntry:\n    import b\nexcept ImportError:\n    pass\n"
    source += "def f():\n    from .c import C\n"
    found = _module_level_imports(ast.parse(source))
    assert sorted(n.module if isinstance(n, ast.ImportFrom) else n.names[0].name for n in found) == ["a", "b"]
    assert "fullshard._core.gather" in import_graph()["fullshard._core.unit.group"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among fullshard modules: " + " -> ".join(cycle or [])


# -- the engine's rooms (see docs/architecture.md) --------------------------------------------------
# The engine (fullshard._core) is a ground floor of modules, each its own face, and rooms: packages
# whose __init__ names what the rest may use. A room imports only the ground and the faces of rooms
# below it (no cycle between rooms); every module outside a room imports it through its face.
ENGINE = "fullshard._core"
ROOMS = {f"{ENGINE}.{name}" for name in ("gather", "gather.codec", "reduce", "unit", "step")}


def _place(module: str, rooms: set[str] = ROOMS) -> str:
    """The room (innermost of ``rooms``) or ground module that ``module`` belongs to."""
    rooms = {room for room in rooms if module == room or module.startswith(room + ".")}
    return max(rooms, key=len) if rooms else module


def from_imports() -> dict[str, set[str]]:
    """Module -> the ``fullshard`` modules named after ``from`` in its module-level imports."""
    paths = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    found: dict[str, set[str]] = {}
    for name, path in paths.items():
        package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
        modules = set()
        for node in _module_level_imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                modules.add(".".join(anchor + ([node.module] if node.module else [])))
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("fullshard"):
                modules.add(node.module or "")
        found[name] = modules
    return found


def test_rooms_import_only_faces():
    wrong = []
    for importer, modules in from_imports().items():
        for module in modules:
            if not module.startswith(ENGINE + "."):
                continue
            place = _place(module)
            inside = importer == place or importer.startswith(place + ".")
            if place in ROOMS and module != place and not inside:
                wrong.append(f"{importer} imports {module}, inside the room {place}: import its face")
    assert not wrong, "\n".join(wrong)


def test_rooms_have_no_cycle():
    """Between whole rooms: ``gather/codec/`` is part of ``gather/`` (it reads its layouts)."""
    cycle = find_cycle(engine_places())
    assert cycle is None, "the engine's rooms import each other: " + " -> ".join(cycle or [])


def test_every_room_has_a_face():
    for room in ROOMS:
        face = PACKAGE.parent / (room.replace(".", "/") + "/__init__.py")
        assert face.exists(), f"{room} has no __init__.py naming what the rest may use"
        assert "__all__" in face.read_text(), f"{room}'s face has no __all__"


def test_the_architecture_names_every_engine_module():
    """docs/architecture.md is the map of the engine: every room and module of it is on it."""
    text = (PACKAGE.parent / "docs" / "architecture.md").read_text()
    missing = [
        str(path.relative_to(PACKAGE / "_core"))
        for path in (PACKAGE / "_core").rglob("*.py")
        if path.name != "__init__.py" and path.name not in text
    ]
    missing += [room for room in ROOMS if room.rsplit(".", 1)[1] + "/" not in text]
    assert not missing, f"docs/architecture.md does not name {missing}"


def floors(graph: dict[str, set[str]]) -> dict[str, int]:
    """Each node's floor: 1 + the highest floor it imports (1: imports nothing in ``graph``)."""
    found: dict[str, int] = {}

    def floor(node: str) -> int:
        if node not in found:
            found[node] = 1 + max((floor(t) for t in graph[node] if t in graph), default=0)
        return found[node]

    for node in graph:
        floor(node)
    return found


def engine_places() -> dict[str, set[str]]:
    """The engine's places (ground modules and whole rooms) -> the places each imports."""
    top = {room for room in ROOMS if room.count(".") == 2}
    places: dict[str, set[str]] = {}
    for importer, targets in import_graph().items():
        if importer.startswith(ENGINE + "."):
            place = _place(importer, top)
            places.setdefault(place, set())
            places[place] |= {_place(t, top) for t in targets if t.startswith(ENGINE + ".")} - {place}
    return places


MAX_ENGINE_FLOORS = 8  # issue 34: 13 places (8 ground modules, 4 rooms, manage.py) on 8 floors; FSDP2: 9 files on 9


def test_the_engine_stands_on_few_floors():
    found = floors(engine_places())
    assert max(found.values()) <= MAX_ENGINE_FLOORS, f"the engine's places stand on more floors than before: {found}"


if __name__ == "__main__":
    for place, floor in sorted(floors(engine_places()).items(), key=lambda item: item[1]):
        print(floor, place)
