"""Which modules of any model become units: the repeated blocks, as an auto-wrap policy would pick them.

[Note: Repeated blocks]
A model worth sharding is mostly a stack of one block class (a transformer
layer, a ResNet bottleneck). Among the classes with two or more instances
that hold parameters, containers aside (``Sequential``, ``ModuleList``,
``ModuleDict``), a candidate is one none of whose instances sits inside an
instance of another such class (so ``Linear``, also used inside the blocks,
is not one, while the decoder layer is); the candidate holding the most
parameters wins. Its instances become units in the order forward meets them,
the rest (embeddings, heads, final norms) stays with the root. A given
``policy`` (a predicate on modules, like ``lambda_auto_wrap_policy``'s) or
``unit_classes`` (like ``ModuleWrapPolicy``'s) replaces the guess.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch.nn as nn

_CONTAINERS = (nn.Sequential, nn.ModuleList, nn.ModuleDict)


def _numel(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def repeated_block_class(model: nn.Module) -> type[nn.Module] | None:
    """The class of the model's repeated blocks (see [Note: Repeated blocks]), or None."""
    instances: dict[type[nn.Module], list[nn.Module]] = {}
    for module in model.modules():
        if module is model or isinstance(module, _CONTAINERS) or _numel(module) == 0:
            continue
        instances.setdefault(type(module), []).append(module)
    repeated = {cls: mods for cls, mods in instances.items() if len(mods) >= 2}
    inside: set[type[nn.Module]] = set()  # classes with an instance nested in another repeated class
    for cls, mods in repeated.items():
        for outer in mods:
            for module in outer.modules():
                if module is not outer and type(module) in repeated and type(module) is not cls:
                    inside.add(type(module))
    candidates = [cls for cls in repeated if cls not in inside]
    if not candidates:
        return None
    return max(candidates, key=lambda cls: sum(_numel(m) for m in repeated[cls]))


def select_blocks(
    model: nn.Module,
    policy: Callable[[nn.Module], bool] | None = None,
    unit_classes: Iterable[type[nn.Module]] | None = None,
) -> list[tuple[str, nn.Module]]:
    """(FQN, module) of each unit but the root, outermost first in module order.

    Raises:
        ValueError: both ``policy`` and ``unit_classes`` given.
    """
    if policy is not None and unit_classes is not None:
        raise ValueError("plan expects policy or unit_classes, not both")
    if policy is None:
        classes = tuple(unit_classes) if unit_classes is not None else ()
        if not classes:
            found = repeated_block_class(model)
            classes = (found,) if found is not None else ()
        if not classes:
            return []

        def policy(module: nn.Module) -> bool:
            return isinstance(module, classes)

    chosen: list[tuple[str, nn.Module]] = []
    taken: set[int] = set()
    for name, module in model.named_modules():
        if module is model or id(module) in taken or not policy(module):
            continue
        chosen.append((name, module))
        taken.update(id(m) for m in module.modules())
    return chosen
