"""Ctrl-C during ``fullshard train``: every rank finishes the same step, saves, and exits.

The launcher forwards Ctrl-C to the ranks as SIGINT. A rank must not stop
where the signal finds it (its peers would wait for it in the next
collective), so the handler only raises a flag; the flags are summed over the
ranks once per step with the step's other statistics, and all ranks stop after
the same step.
"""

from __future__ import annotations

import signal
from types import FrameType

__all__ = ["StopRequest"]


class StopRequest:
    """A SIGINT flag; the previous handler comes back on ``restore``."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, frame: FrameType | None) -> None:
        self.requested = True

    def restore(self) -> None:
        signal.signal(signal.SIGINT, self._previous)
