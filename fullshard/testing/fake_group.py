"""A stand-in process group for single-process tests of code that takes a group."""

from __future__ import annotations


class FakeSingleRankGroup:
    """A process group of one rank (this process): ``rank()`` is 0, ``size()`` is 1.

    It has no collectives, so code that tries to communicate over a group of
    one (which it never needs to) fails loudly instead of passing by accident.
    """

    def rank(self) -> int:
        return 0

    def size(self) -> int:
        return 1
