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
    assert "fullshard._core.param" in import_graph()["fullshard._core.group"]


def test_no_import_cycle():
    cycle = find_cycle(import_graph())
    assert cycle is None, "import cycle among fullshard modules: " + " -> ".join(cycle or [])
