"""Execution-order validation, on at ``TORCH_DISTRIBUTED_DEBUG=DETAIL``.

[Note: Execution order]
Collectives are matched by order, not by name: if ranks gather different units
at the same point (a data-dependent branch, a rank-dependent freeze), two
same-sized all-gathers silently swap data and differently-sized ones hang. At
DETAIL level the engine stops at every point where it is about to all-gather
(forward, backward) or reduce-scatter a unit, and the ranks exchange a
fingerprint of what they are about to do: the unit's index in the root's
order, and its parameters' FQNs and shapes (two units with the same number of
elements still differ).
  - First iteration: if the forward fingerprints differ, every rank raises
    "Forward order differs across ranks", before any mismatched collective runs.
  - Later iterations: a rank whose forward order departs from its first
    iteration's warns once. The ranks then run the union of what they asked
    for, unit by unit in the root's order, each joining the others' collectives
    (gathering into scratch, reducing zero gradients, as DDP does for unused
    parameters): nothing hangs, and the gradients stay those of the union.
Prefetching is off meanwhile, so every collective passes a check. At other
debug levels none of this exists: the engine tests ``ctx.validator is None``.
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING

import torch.distributed as dist

from . import comm

if TYPE_CHECKING:
    from .group import ParamGroup

# (kind, unit index, issues a collective, (FQN, shape) of the parameters involved)
_Fingerprint = tuple[str, int, bool, tuple[tuple[str, tuple[int, ...]], ...]]


def validation_enabled() -> bool:
    return dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL


class ExecOrderValidator:
    """See [Note: Execution order]."""

    def __init__(self, groups: list[ParamGroup]) -> None:
        self.groups = groups  # the root's order: a unit's index names it across ranks
        self.index = {id(group): i for i, group in enumerate(groups)}
        self.iteration = -1
        self.first_forward: list[int] | None = None
        self.forward: list[int] = []
        self.warned = False

    def begin_iteration(self) -> None:
        if self.iteration == 0:
            self.first_forward = self.forward
        self.iteration += 1
        self.forward = []

    def _fingerprint(self, kind: str, group: ParamGroup, collective: bool, params: list | None = None) -> _Fingerprint:
        shapes = tuple((p.fqn, tuple(p.global_size)) for p in params or group.params)
        return (kind, self.index[id(group)], collective, shapes)

    def _exchange(self, fingerprint: _Fingerprint) -> list[_Fingerprint]:
        return comm.all_gather_objects(fingerprint)

    def _describe(self, fingerprint: _Fingerprint) -> str:
        _, index, _, shapes = fingerprint
        listing = ", ".join(f"{name} {list(shape)}" for name, shape in shapes)
        return f"unit {index} ({listing})"

    def _union(self, fingerprints: list[_Fingerprint]) -> list[tuple[ParamGroup, list[str]]]:
        """(unit, FQNs of its parameters involved) for each collective some rank asked
        for, in the root's order."""
        wanted = sorted({(f[1], f[3]) for f in fingerprints if f[2]})
        return [(self.groups[index], [name for name, _ in shapes]) for index, shapes in wanted]

    def gate_forward(self, group: ParamGroup, gathers: bool) -> list[tuple[ParamGroup, list[str]]] | None:
        """Before a unit's forward. Returns None if all ranks agree, else the
        collectives every rank must run, in order (see ``_union``)."""
        self._record_forward(group)
        mine = self._fingerprint("forward", group, gathers)
        fingerprints = self._exchange(mine)
        if all(f == mine for f in fingerprints):
            return None
        if self.iteration == 0:
            differing = next(r for r, f in enumerate(fingerprints) if f != fingerprints[0])
            raise RuntimeError(
                f"Forward order differs across ranks: rank 0 is all-gathering {self._describe(fingerprints[0])} "
                f"but rank {differing} is all-gathering {self._describe(fingerprints[differing])}. Every rank must "
                "run the sharded modules in the same order (data-dependent or rank-dependent control flow?)"
            )
        return self._union(fingerprints)

    def gate(
        self, kind: str, group: ParamGroup, collective: bool = True, params: list | None = None
    ) -> list[tuple[ParamGroup, list[str]]] | None:
        """Before a backward all-gather (``kind="backward"``) or a reduction of
        ``params`` (``"reduce"``)."""
        mine = self._fingerprint(kind, group, collective, params)
        fingerprints = self._exchange(mine)
        return None if all(f == mine for f in fingerprints) else self._union(fingerprints)

    def _record_forward(self, group: ParamGroup) -> None:
        index = self.index[id(group)]
        position = len(self.forward)
        self.forward.append(index)
        first = self.first_forward
        if first is None or self.warned:
            return
        if position >= len(first) or first[position] != index:
            self.warned = True
            warnings.warn(
                f"Forward order differs from that of the first iteration on rank {dist.get_rank()}. "
                "Collectives are unchecked and may give incorrect results or hang (at this debug level "
                "fullshard runs every rank's collectives in one agreed order instead)",
                UserWarning,
                stacklevel=4,
            )
