"""Auto-wrap policies: which submodules become units of their own.

One mechanism serves both front ends: ``select_modules`` turns a policy into
the list of submodules to shard separately (children before parents, with any
per-module argument overrides); ``fully_shard(policy=...)`` applies
``fully_shard`` to each, ``FullyShardedDataParallel(auto_wrap_policy=...)``
wraps each in place.

Two kinds of policy exist, as in PyTorch's FSDP auto-wrap module:
  - ``Policy`` objects (``ModuleWrapPolicy``, ``CustomPolicy``) pick modules
    directly;
  - functions ``fn(module, recurse, nonwrapped_numel) -> bool`` (usually a
    ``functools.partial`` of ``size_based_auto_wrap_policy`` and friends):
    asked with ``recurse=True`` whether to look inside a module, then with
    ``recurse=False`` whether to wrap it, given the parameters its wrapped
    children did not take.

Manual wrapping (FSDP1's ``enable_wrap`` / ``wrap``) is here too: model code
calls ``wrap(layer)`` where a unit should start, and only an enclosing
``enable_wrap(wrapper_cls=...)`` block turns that into a wrapper, so the same
code builds the plain model outside the block.
"""

from __future__ import annotations

import abc
import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch.nn as nn

from ._core.step import get_state

__all__ = [
    "CustomPolicy",
    "ModuleWrapPolicy",
    "Policy",
    "always_wrap_policy",
    "enable_wrap",
    "lambda_auto_wrap_policy",
    "select_modules",
    "size_based_auto_wrap_policy",
    "transformer_auto_wrap_policy",
    "wrap",
]

PolicyFn = Callable[..., bool]


class Policy(abc.ABC):
    """Chooses the submodules that get their own unit."""

    @abc.abstractmethod
    def wants(self, module: nn.Module) -> bool | dict[str, Any]:
        """False to leave ``module`` in its parent's unit; True (or argument
        overrides for this unit) to give it its own."""


class ModuleWrapPolicy(Policy):
    """Every module that is an instance of one of ``module_classes``."""

    def __init__(self, module_classes: Iterable[type[nn.Module]]) -> None:
        self._module_classes = tuple(set(module_classes))

    def wants(self, module: nn.Module) -> bool:
        return isinstance(module, self._module_classes)

    def __call__(self, module: nn.Module, recurse: bool, nonwrapped_numel: int) -> bool:
        """The function form, for code that calls policies directly."""
        return True if recurse else isinstance(module, self._module_classes)

    def __repr__(self) -> str:
        return f"ModuleWrapPolicy({', '.join(c.__name__ for c in self._module_classes)})"


class CustomPolicy(Policy):
    """``lambda_fn(module)`` returns False, True, or a dict of argument overrides."""

    def __init__(self, lambda_fn: Callable[[nn.Module], bool | dict[str, Any]]) -> None:
        self._lambda_fn = lambda_fn

    def wants(self, module: nn.Module) -> bool | dict[str, Any]:
        result = self._lambda_fn(module)
        if not isinstance(result, (bool, dict)):
            raise ValueError(
                f"CustomPolicy expects its function to return a bool or a dict of overrides but got "
                f"{type(result).__name__} for {type(module).__name__}"
            )
        return result


def size_based_auto_wrap_policy(
    module: nn.Module,
    recurse: bool,
    nonwrapped_numel: int,
    min_num_params: int = int(1e8),
    force_leaf_modules: set[type[nn.Module]] | None = None,
    exclude_wrap_modules: set[type[nn.Module]] | None = None,
) -> bool:
    """Wraps a module once it holds at least ``min_num_params`` not-yet-wrapped parameters.

    ``force_leaf_modules`` (default: ``size_based_auto_wrap_policy.FORCE_LEAF_MODULES``,
    ``nn.MultiheadAttention``) are never looked into; ``exclude_wrap_modules`` (default:
    ``.EXCLUDE_WRAP_MODULES``, ``nn.ModuleList`` and ``nn.ModuleDict``) are never wrapped themselves.
    """
    policy = size_based_auto_wrap_policy
    force_leaf = tuple(force_leaf_modules if force_leaf_modules is not None else policy.FORCE_LEAF_MODULES)  # type: ignore[attr-defined]
    exclude = tuple(exclude_wrap_modules if exclude_wrap_modules is not None else policy.EXCLUDE_WRAP_MODULES)  # type: ignore[attr-defined]
    large_enough = nonwrapped_numel >= min_num_params
    if recurse:
        return large_enough and not isinstance(module, force_leaf)
    return large_enough and not isinstance(module, exclude)


# The defaults, as attributes of the function as torch has them, so that a policy can extend them
# (``size_based_auto_wrap_policy.FORCE_LEAF_MODULES | {MyBlock}``).
size_based_auto_wrap_policy.FORCE_LEAF_MODULES = {nn.MultiheadAttention}  # type: ignore[attr-defined]
size_based_auto_wrap_policy.EXCLUDE_WRAP_MODULES = {nn.ModuleList, nn.ModuleDict}  # type: ignore[attr-defined]


def transformer_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, transformer_layer_cls: set[type[nn.Module]]
) -> bool:
    """Wraps every instance of the given layer classes (e.g. transformer blocks)."""
    return True if recurse else isinstance(module, tuple(transformer_layer_cls))


def lambda_auto_wrap_policy(
    module: nn.Module, recurse: bool, nonwrapped_numel: int, lambda_fn: Callable[[nn.Module], bool]
) -> bool:
    """Wraps every module for which ``lambda_fn(module)`` is true."""
    return True if recurse else bool(lambda_fn(module))


def always_wrap_policy(*args: Any, **kwargs: Any) -> bool:
    """Every submodule gets its own unit (parameterless ones too, as in torch).

    Mostly for tests and tiny models: one unit per module means one
    collective per module.
    """
    return True


# -- manual wrapping ---------------------------------------------------------------------------
class _WrapContext:
    """The active ``enable_wrap`` block: what ``wrap`` builds units with."""

    def __init__(self, wrapper_cls: Callable[..., nn.Module], kwargs: dict[str, Any]) -> None:
        self.wrapper_cls = wrapper_cls
        self.kwargs = kwargs


# Process-wide, as in torch: ``wrap`` called from another thread during the block wraps too.
_active: _WrapContext | None = None


@contextlib.contextmanager
def enable_wrap(*, wrapper_cls: Any, **wrapper_kwargs: Any) -> Iterator[None]:
    """Inside the block, ``wrap(module)`` returns ``wrapper_cls(module, **wrapper_kwargs)``.

    Model code marks its units with ``wrap`` once; whether they are wrapped,
    and with which arguments, is decided by the caller. Blocks do not nest:
    the inner arguments would silently win for some units and not others.

    Raises:
        TypeError: ``wrapper_cls`` is not callable (``None`` included).
        ValueError: already inside an ``enable_wrap`` block.
    """
    global _active
    if not callable(wrapper_cls):
        raise TypeError(
            f"enable_wrap expects wrapper_cls to be the wrapper class (e.g. FullyShardedDataParallel) "
            f"but got {wrapper_cls!r}"
        )
    if _active is not None:
        outer = getattr(_active.wrapper_cls, "__name__", repr(_active.wrapper_cls))
        raise ValueError(
            f"enable_wrap cannot be nested: already inside an enable_wrap block (wrapper_cls={outer}); "
            "pass per-unit arguments to wrap(module, ...) instead"
        )
    _active = _WrapContext(wrapper_cls, dict(wrapper_kwargs))
    try:
        yield
    finally:
        _active = None


def wrap(module: nn.Module, **wrap_overrides: Any) -> nn.Module:
    """``module`` in its own unit inside ``enable_wrap``; ``module`` itself outside.

    ``wrap_overrides`` take precedence over the block's arguments, for this
    unit only (e.g. a different ``sharding_strategy``).
    """
    if _active is None:
        return module
    return _active.wrapper_cls(module, **{**_active.kwargs, **wrap_overrides})


def _is_managed(module: nn.Module) -> bool:
    return get_state(module) is not None


def _unwrapped_numel(module: nn.Module, ignored: set[nn.Module], ignored_params: set[int]) -> int:
    """Parameters under ``module`` not ignored and not in an already-managed submodule."""
    seen: set[int] = set()
    total = 0
    stack = [module]
    while stack:
        current = stack.pop()
        if current in ignored or (current is not module and _is_managed(current)):
            continue
        for param in current.parameters(recurse=False):
            if id(param) not in seen and id(param) not in ignored_params:
                seen.add(id(param))
                total += param.numel()
        stack.extend(current.children())
    return total


def select_modules(
    root: nn.Module,
    policy: Policy | PolicyFn,
    ignored_modules: Iterable[nn.Module] = (),
) -> list[tuple[nn.Module, dict[str, Any]]]:
    """Submodules of ``root`` (not ``root`` itself) the policy gives their own unit.

    Children come before their parents, so applying in order shards bottom-up.
    Ignored modules, their subtrees and already-managed modules are skipped.

    Returns:
        ``(module, overrides)`` pairs; ``overrides`` holds per-unit arguments
        (from a ``CustomPolicy``), usually empty.
    """
    ignored = set(ignored_modules)
    ignored_params = {id(p) for m in ignored for p in m.parameters()}
    chosen: list[tuple[nn.Module, dict[str, Any]]] = []
    visited: set[nn.Module] = set()

    def visit_policy(module: nn.Module, policy: Policy) -> None:
        for child in module.children():
            if child in visited or child in ignored or _is_managed(child):
                continue
            visited.add(child)
            visit_policy(child, policy)
            wanted = policy.wants(child)
            if wanted:
                chosen.append((child, wanted if isinstance(wanted, dict) else {}))

    def visit_function(module: nn.Module, policy: PolicyFn) -> int:
        numel = _unwrapped_numel(module, ignored, ignored_params)
        if not policy(module=module, recurse=True, nonwrapped_numel=numel):
            return 0
        wrapped = 0
        for child in module.children():
            if child in visited or child in ignored or _is_managed(child):
                continue
            visited.add(child)
            wrapped += visit_function(child, policy)
        if module is not root and policy(module=module, recurse=False, nonwrapped_numel=numel - wrapped):
            chosen.append((module, {}))
            return numel
        return wrapped

    if isinstance(policy, Policy):
        visit_policy(root, policy)
    elif callable(policy):
        visit_function(root, policy)
    else:
        raise TypeError(f"auto-wrap policy expects a Policy or a function but got {type(policy).__name__}")
    return chosen
