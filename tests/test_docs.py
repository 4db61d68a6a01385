"""The docs stay honest: docs/api.md documents every public name with its real
signature, and every Python block in the docs and the README compiles.

[Note: Signature stubs in docs/api.md]
A ```python block of docs/api.md may hold stubs: ``def f(...) -> T: ...`` and
classes whose bodies hold only fields (``name: type = default``), enum members
(``NAME = ...``), stub methods and properties. Each stub names a public object
(looked up in the ``__all__`` of fullshard's public modules); its parameter
names, kinds and defaults must match ``inspect.signature`` of the object, a
dataclass's fields its constructor, an enum's members the real ones. Blocks
with real code (examples) are compiled only.
"""

from __future__ import annotations

import abc
import ast
import contextlib
import dataclasses
import enum
import importlib
import inspect
import re
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

import fullshard

ROOT = Path(__file__).resolve().parent.parent
API = ROOT / "docs" / "api.md"
DOCS = [API, ROOT / "docs" / "guide.md", ROOT / "README.md"]

# Public modules (those with an ``__all__``); fullshard._core and the CLI are internal.
PUBLIC_MODULES = [
    "fullshard", "fullshard.api", "fullshard.fully_shard", "fullshard.replicate", "fullshard.wrapper",
    "fullshard.wrap", "fullshard.state_dict", "fullshard.checkpoint", "fullshard.clip",
    "fullshard.grad_scaler", "fullshard.models", "fullshard.plan", "fullshard.training", "fullshard.testing",
]
# Classes whose public methods are API too.
CLASSES_WITH_METHODS = [
    fullshard.FSDPModule, fullshard.UnshardHandle, fullshard.FullyShardedDataParallel, fullshard.ShardedGradScaler,
]


def public_objects() -> dict[str, Any]:
    """Every name in a public module's ``__all__`` -> its object (one object per name)."""
    objects: dict[str, Any] = {}
    for module_name in PUBLIC_MODULES:
        module = importlib.import_module(module_name)
        for name in module.__all__:
            obj = getattr(module, name)
            assert objects.get(name, obj) is obj, f"{name} names two different objects; stubs could not tell them apart"
            objects[name] = obj
    return objects


def fenced_blocks(text: str) -> list[tuple[str, str]]:
    """(language, source) of every fenced code block."""
    return re.findall(r"^```(\w*)\n(.*?)^```", text, flags=re.S | re.M)


def python_blocks(path: Path) -> list[str]:
    return [source for language, source in fenced_blocks(path.read_text()) if language == "python"]


def code_text(text: str) -> str:
    """Everything inside code spans and fenced blocks, where documented names must appear."""
    blocks = "\n".join(source for _, source in fenced_blocks(text))
    spans = "\n".join(re.findall(r"`([^`\n]+)`", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)))
    return blocks + "\n" + spans


# -- every public name is documented ------------------------------------------------------------
def test_every_public_name_is_documented():
    documented = code_text(API.read_text())
    missing = [name for name in public_objects() if not re.search(rf"(?<![\w.]){re.escape(name)}\b", documented)]
    assert not missing, f"docs/api.md does not mention (in code) {missing}"


def test_every_public_method_is_documented():
    documented = code_text(API.read_text())
    missing = [
        f"{cls.__name__}.{name}"
        for cls in CLASSES_WITH_METHODS
        for name in vars(cls)
        if not name.startswith("_") and not re.search(rf"\b{re.escape(name)}\b", documented)
    ]
    assert not missing, f"docs/api.md does not mention {missing}"


# -- code blocks compile --------------------------------------------------------------------------
@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_python_blocks_compile(path: Path):
    blocks = python_blocks(path)
    assert blocks, f"{path.name} has no python blocks: did the fence language change?"
    for index, source in enumerate(blocks):
        compile(source, f"{path.name}, python block {index}", "exec")


# -- links between the docs resolve ------------------------------------------------------------------
def github_anchors(text: str) -> set[str]:
    anchors: set[str] = set()
    for heading in re.findall(r"^#+ (.+)$", re.sub(r"^```.*?^```", "", text, flags=re.S | re.M), flags=re.M):
        slug = re.sub(r"[^\w\- ]", "", heading.lower()).replace(" ", "-")
        candidate, suffix = slug, 0
        while candidate in anchors:
            suffix += 1
            candidate = f"{slug}-{suffix}"
        anchors.add(candidate)
    return anchors


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(path: Path):
    text = path.read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"\w+://", target):
            continue
        file_part, _, anchor = target.partition("#")
        linked = (path.parent / file_part).resolve() if file_part else path
        assert linked.exists(), f"{path.name} links to missing {target}"
        if anchor and linked.suffix == ".md":
            assert anchor in github_anchors(linked.read_text()), f"{path.name} links to missing anchor {target}"


def test_docs_link_each_other():
    assert "docs/api.md" in (ROOT / "README.md").read_text() and "docs/guide.md" in (ROOT / "README.md").read_text()
    assert "(api.md" in (ROOT / "docs" / "guide.md").read_text()
    assert "(guide.md" in API.read_text()


# -- documented signatures match the code ---------------------------------------------------------------
def _namespace() -> dict[str, Any]:
    """What stub defaults may refer to."""
    return {**public_objects(), "torch": torch, "nn": nn, "dist": dist, "enum": enum, "abc": abc,
            "contextlib": contextlib, "Any": Any}


def _is_stub_function(node: ast.AST) -> bool:
    return (
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and len(node.body) == 1
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
        and node.body[0].value.value is Ellipsis
    )


def _is_stub_statement(node: ast.stmt) -> bool:
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True  # `...` or a docstring
    if isinstance(node, ast.AnnAssign):
        return True
    if isinstance(node, ast.Assign):
        return isinstance(node.value, ast.Constant) and node.value.value is Ellipsis
    return _is_stub_function(node)


def _is_stub_class(node: ast.AST) -> bool:
    return isinstance(node, ast.ClassDef) and all(_is_stub_statement(s) for s in node.body)


_KINDS = {
    "posonlyargs": inspect.Parameter.POSITIONAL_ONLY,
    "args": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "kwonlyargs": inspect.Parameter.KEYWORD_ONLY,
}


def _stub_parameters(node: ast.FunctionDef) -> list[tuple[str, Any, str | None]]:
    """(name, kind, default source or None) of a stub's parameters, in order."""
    a = node.args
    positional = [*a.posonlyargs, *a.args]
    defaults = [None] * (len(positional) - len(a.defaults)) + [ast.unparse(d) for d in a.defaults]
    result = []
    for arg, default in zip(positional, defaults):
        kind = _KINDS["posonlyargs"] if arg in a.posonlyargs else _KINDS["args"]
        result.append((arg.arg, kind, default))
    if a.vararg:
        result.append((a.vararg.arg, inspect.Parameter.VAR_POSITIONAL, None))
    for arg, default in zip(a.kwonlyargs, a.kw_defaults):
        result.append((arg.arg, _KINDS["kwonlyargs"], ast.unparse(default) if default is not None else None))
    if a.kwarg:
        result.append((a.kwarg.arg, inspect.Parameter.VAR_KEYWORD, None))
    return result


def _check_parameters(where: str, documented: list[tuple[str, Any, str | None]], real: inspect.Signature,
                      namespace: dict[str, Any]) -> None:
    actual = [p for p in real.parameters.values() if not p.name.startswith("_")]  # private knobs stay private
    assert [(n, k) for n, k, _ in documented] == [(p.name, p.kind) for p in actual], (
        f"{where}: documented parameters {[n for n, _, _ in documented]} but the code has "
        f"{[p.name for p in actual]} (or their kinds differ)"
    )
    for (name, _, default), param in zip(documented, actual):
        if param.default is inspect.Parameter.empty:
            assert default is None, f"{where}: {name} is documented with default {default} but has none"
        elif param.default is dataclasses._HAS_DEFAULT_FACTORY:
            assert default is not None and default.startswith("field("), f"{where}: {name} has a default factory"
        else:
            assert default is not None, f"{where}: {name} has default {param.default!r}, undocumented"
            value = eval(default, namespace)  # noqa: S307 - our own docs
            assert value == param.default and type(value) is type(param.default), (
                f"{where}: {name} is documented with default {default} but the code has {param.default!r}"
            )


def _check_function(node: ast.FunctionDef, obj: Any, where: str, namespace: dict[str, Any]) -> None:
    _check_parameters(where, _stub_parameters(node), inspect.signature(obj), namespace)


def _check_class(node: ast.ClassDef, cls: type, namespace: dict[str, Any]) -> None:
    where = f"class {node.name}"
    assert isinstance(cls, type), f"{where}: the code's {node.name} is not a class"
    for base in node.bases:
        try:
            expected = eval(ast.unparse(base), namespace)  # noqa: S307 - our own docs
        except NameError:
            continue
        assert issubclass(cls, expected), f"{where}: documented base {ast.unparse(base)} is not a base in the code"
    members = [s for s in node.body if isinstance(s, ast.Assign)]
    if issubclass(cls, enum.Enum):
        documented = [t.id for s in members for t in s.targets]
        assert documented == [m.name for m in cls], f"{where}: members {documented} vs {[m.name for m in cls]}"
    fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
    if fields or dataclasses.is_dataclass(cls):
        documented = [(s.target.id, inspect.Parameter.POSITIONAL_OR_KEYWORD,
                       ast.unparse(s.value) if s.value is not None else None) for s in fields]
        _check_parameters(where, documented, inspect.signature(cls), namespace)
    for method in (s for s in node.body if _is_stub_function(s)):
        name = method.name
        assert hasattr(cls, name), f"{where}: no method {name} in the code"
        static = inspect.getattr_static(cls, name)
        if isinstance(static, property):
            assert any(ast.unparse(d) == "property" for d in method.decorator_list), f"{where}.{name} is a property"
            continue
        is_static = isinstance(static, staticmethod)
        assert is_static == any(ast.unparse(d) == "staticmethod" for d in method.decorator_list), (
            f"{where}.{name}: staticmethod in one of the docs and the code only"
        )
        if name == "__init__":
            stub = _stub_parameters(method)[1:]  # without self
            _check_parameters(f"{where}.__init__", stub, inspect.signature(cls), namespace)
        else:
            _check_function(method, getattr(cls, name), f"{where}.{name}", namespace)


def _stubs() -> list[ast.AST]:
    stubs = []
    for source in python_blocks(API):
        for node in ast.parse(source).body:
            if _is_stub_function(node) or _is_stub_class(node):
                stubs.append(node)
    return stubs


def test_documented_signatures_match_the_code():
    objects, namespace = public_objects(), _namespace()
    stubs = _stubs()
    assert len(stubs) > 50, "docs/api.md lost its signature stubs"
    for node in stubs:
        assert node.name in objects, f"docs/api.md documents {node.name}, which no public module exports"
        if isinstance(node, ast.ClassDef):
            _check_class(node, objects[node.name], namespace)
        else:
            _check_function(node, objects[node.name], f"def {node.name}", namespace)


def test_every_public_callable_has_a_stub():
    """Constants (PRESETS, STRATEGIES) and aliases (FSDP) are documented in prose."""
    stubbed = {node.name for node in _stubs()}
    missing = [
        name for name, obj in public_objects().items()
        if callable(obj) and getattr(obj, "__name__", None) == name and name not in stubbed
    ]
    assert not missing, f"docs/api.md has no signature stub for {missing}"
