"""Ctrl-C during ``fullshard train``: every rank finishes the same step, saves, and exits.

The launcher forwards Ctrl-C to the ranks as SIGINT. A rank must not stop
where the signal finds it (its peers would wait for it in the next
collective), so the handler only raises a flag; the flags are summed over the
ranks once per step with the step's other statistics, and all ranks stop after
the same step.

A second Ctrl-C makes the launcher stop the ranks at once with SIGTERM (and
SIGKILL 30 s later). A rank that is saving then finishes the save first
(``deferring_termination``): the checkpoint on disk is either the previous one or
the new, complete one, never a partial folder.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator
from types import FrameType

__all__ = ["StopRequest"]


class StopRequest:
    """A SIGINT flag; the previous handler comes back on ``restore``."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    @contextlib.contextmanager
    def deferring_termination(self) -> Iterator[None]:
        """SIGTERM (and SIGHUP) wait until the block is done, then act as they would have."""
        held: list[int] = []
        deferred = (signal.SIGTERM, signal.SIGHUP)
        previous = {sig: signal.signal(sig, lambda signum, frame: held.append(signum)) for sig in deferred}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for signum in dict.fromkeys(held):
                signal.raise_signal(signum)

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)
