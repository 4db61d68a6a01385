"""Tables of cases run inside one spawn of ranks.

Spawning ranks per case is slow, so a multi-rank test often loops over a
table of cases in one distributed body; ``case`` names the row a failure came
from, which a plain loop would lose.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


@contextlib.contextmanager
def case(label: str) -> Iterator[None]:
    """Adds ``in case <label>`` to any exception raised inside the block."""
    try:
        yield
    except BaseException as failure:
        failure.add_note(f"in case {label}")
        raise
