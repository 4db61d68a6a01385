"""A long stack of identical blocks traced as four of them, the middle one's events repeated for the rest.

[Note: Repeated block events]
Tracing costs a few milliseconds per operator on fake tensors, so a 32-layer
7B model at one micro-batch, compute dtype and checkpointing choice takes
most of a minute, and a plan traces up to a dozen such steps. The blocks of a
stack (one container's items, one class, the same parameter shapes) do the
same work on the same shapes, so their events are the same up to the unit's
index: ``shorten`` leaves the container with its first three blocks and its
last one for the trace, and ``lengthen`` writes the missing ones back into the
events, each a copy of the second block's forward events (from its forward
pre-hook to the next block's) and backward events (from its pre-backward to
the previous block's). The first and the last block are traced as they are,
since their neighbours are the embeddings and the head. A block's events can
still differ from its neighbour's (a model that alternates attention kinds
under one class): the second and third block's events are compared first,
and where they differ ``lengthen`` answers None and the step is traced whole.
What each block keeps until the autograd graph dies (activation
checkpointing's saved inputs) is freed after backward's last operator, outside
any block's events: the missing blocks' share is freed there in one event.
Checked against whole traces of the test models (``tests/test_plan_any_model.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch.nn as nn

__all__ = ["TRACED_BLOCKS", "lengthen", "live_bytes", "shorten"]

Event = tuple[str, int, int]
TRACED_BLOCKS = 4  # the first, two to compare, the last
_CONTAINERS = (nn.ModuleList, nn.Sequential)


def _signature(module: nn.Module) -> tuple:
    return (
        type(module),
        tuple((name, tuple(p.shape), p.dtype, p.requires_grad) for name, p in module.named_parameters()),
        tuple((name, tuple(b.shape), b.dtype) for name, b in module.named_buffers()),
    )


def _stack(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> nn.Module | None:
    """The container whose items are exactly ``blocks``, in order, all alike; None if there is none."""
    if len(blocks) <= TRACED_BLOCKS:
        return None
    parents = {name.rpartition(".")[0] for name, _ in blocks}
    if len(parents) != 1:
        return None
    parent = model.get_submodule(parents.pop())
    if not isinstance(parent, _CONTAINERS) or list(parent) != [block for _, block in blocks]:
        return None
    first = _signature(blocks[0][1])
    return parent if all(_signature(block) == first for _, block in blocks[1:]) else None


@contextlib.contextmanager
def shorten(model: nn.Module, blocks: list[tuple[str, nn.Module]]) -> Iterator[bool]:
    """Within the block, the stack of ``blocks`` holds its first three and its last one; yields
    whether it was shortened (see [Note: Repeated block events])."""
    stack = _stack(model, blocks)
    if stack is None:
        yield False
        return
    kept = [block for _, block in blocks[: TRACED_BLOCKS - 1]] + [blocks[-1][1]]
    whole = stack._modules
    stack._modules = {str(i): block for i, block in enumerate(kept)}
    try:
        yield True
    finally:
        stack._modules = whole


def _span(events: list[Event], start: tuple[str, int], stop: tuple[str, int]) -> tuple[int, int]:
    begin = events.index((*start, 0))
    return begin, events.index((*stop, 0), begin)


def _renamed(events: list[Event], old: int, new: int) -> list[Event]:
    return [(kind, new if unit == old else unit, value) for kind, unit, value in events]


def lengthen(events: list[Event], num_blocks: int) -> list[Event] | None:
    """The events of the whole stack of ``num_blocks`` from those of the shortened one (units: 0 the
    root, 1 to 3 the first blocks, ``num_blocks`` the last; the units in between never ran), or None
    where the second and third block's events differ."""
    second, third, last = 2, 3, num_blocks
    missing = range(TRACED_BLOCKS, num_blocks)  # units 4 .. num_blocks - 1
    # The units that never ran got an empty post-backward from the end-of-backward callback.
    events = [e for e in events if not (e[0] == "backward_post" and e[1] in missing)]
    forward = _span(events, ("forward_pre", second), ("forward_pre", third))
    forward_next = _span(events, ("forward_pre", third), ("forward_pre", last))
    backward = _span(events, ("backward_pre", second), ("backward_pre", second - 1))
    backward_next = _span(events, ("backward_pre", third), ("backward_pre", second))
    pattern = _renamed(events[forward[0] : forward[1]], second, -2)
    pattern_back = _renamed(events[backward[0] : backward[1]], second, -2)
    if (
        _renamed(events[forward_next[0] : forward_next[1]], third, -2) != pattern
        or _renamed(events[backward_next[0] : backward_next[1]], third, -2) != pattern_back
    ):
        return None
    inserted_forward = [e for unit in missing for e in _renamed(pattern, -2, unit)]
    inserted_backward = [e for unit in reversed(missing) for e in _renamed(pattern_back, -2, unit)]
    # Forward: the copies go before the last block's forward; backward: before the third block's.
    whole = (
        events[: forward_next[1]]
        + inserted_forward
        + events[forward_next[1] : backward_next[0]]
        + inserted_backward
        + events[backward_next[0] :]
    )
    # What the blocks keep to the end of backward (checkpointing's saved inputs, say) dies when the
    # graph does, after the last operator: the missing blocks' share, freed there at once.
    excess = live_bytes(whole) - live_bytes(events)
    if excess < 0:
        return None
    last = max(i for i, (kind, _, _) in enumerate(whole) if kind in ("op", "alloc", "grad"))
    return whole[: last + 1] + [("free", -1, excess)] * (excess > 0) + whole[last + 1 :]


def live_bytes(events: list[Event]) -> int:
    """Bytes of activations alive after ``events`` (gradients of parameters moved out of them)."""
    return sum(value if kind == "alloc" else -value for kind, _, value in events if kind in ("alloc", "free", "grad"))
