"""Tables of cases run inside one spawn of ranks.

Spawning ranks per case is slow, so a multi-rank test often loops over a
table of cases in one distributed body; ``case`` names the row a failure came
from, which a plain loop would lose.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator


@contextlib.contextmanager
def case(label: str) -> Iterator[None]:
    """Adds ``in case <label>`` to any exception raised inside the block."""
    try:
        yield
    except BaseException as failure:
        note = f"in case {label}"
        if sys.version_info >= (3, 11):
            failure.add_note(note)
        else:  # no add_note on 3.10: the list it appends to (PEP 678), which pytest shows too
            failure.__dict__.setdefault("__notes__", []).append(note)
        raise
