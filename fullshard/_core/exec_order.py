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
from typing import NamedTuple, cast

import torch.distributed as dist

from . import comm


class Fingerprint(NamedTuple):
    """What a rank is about to do; equal on every rank when the order agrees."""

    kind: str  # "forward", "backward" (all-gathers) or "reduce"
    unit: int  # the unit's index in the root's order
    collective: bool  # whether this rank issues the collective (False: nothing to gather)
    params: tuple[tuple[str, tuple[int, ...]], ...]  # (FQN, shape) of the parameters involved


class Agreed(NamedTuple):
    """A collective every rank runs: unit ``unit``'s, for its parameters ``names``."""

    unit: int
    names: list[str]


def validation_enabled() -> bool:
    return dist.is_initialized() and dist.get_debug_level() == dist.DebugLevel.DETAIL


class ExecOrderValidator:
    """See [Note: Execution order]. Units are named by their index in the root's order."""

    def __init__(self) -> None:
        self.iteration = -1
        self.first_forward: list[int] | None = None
        self.forward: list[int] = []
        self.warned = False

    def begin_iteration(self) -> None:
        if self.iteration == 0:
            self.first_forward = self.forward
        self.iteration += 1
        self.forward = []

    def _exchange(self, fingerprint: Fingerprint) -> list[Fingerprint]:
        return cast(list[Fingerprint], comm.all_gather_objects(fingerprint))  # every rank sends one

    def _describe(self, fingerprint: Fingerprint) -> str:
        listing = ", ".join(f"{name} {list(shape)}" for name, shape in fingerprint.params)
        return f"unit {fingerprint.unit} ({listing})"

    def _union(self, fingerprints: list[Fingerprint]) -> list[Agreed]:
        """Each collective some rank asked for, in the root's order."""
        wanted = sorted({(f.unit, f.params) for f in fingerprints if f.collective})
        return [Agreed(unit, [name for name, _ in params]) for unit, params in wanted]

    def gate_forward(self, mine: Fingerprint) -> list[Agreed] | None:
        """Before a unit's forward. Returns None if all ranks agree, else the
        collectives every rank must run, in order (see ``_union``)."""
        self._record_forward(mine.unit)
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

    def gate(self, mine: Fingerprint) -> list[Agreed] | None:
        """Before a backward all-gather (``kind="backward"``) or a reduction (``"reduce"``)."""
        fingerprints = self._exchange(mine)
        return None if all(f == mine for f in fingerprints) else self._union(fingerprints)

    def _record_forward(self, index: int) -> None:
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
                stacklevel=5,
            )
