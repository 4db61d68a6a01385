"""Ctrl-C while the ``fullshard`` command is still starting: one line and exit status 130, no traceback.

The command's own Ctrl-C handling (``fullshard <command>: interrupted``; on a rank, the
flag that stops every rank after the same step) begins once the package is imported,
and importing torch takes seconds: a Ctrl-C then would print Python's traceback through
torch's import (one per rank once the ranks are starting). ``fullshard/__init__.py``
calls ``quiet_interrupts_while_starting`` before it imports anything else. It acts only
when this process is the command: the console script, ``python -m fullshard`` or a rank
that ``fullshard train`` launched (``-m fullshard.training``); a program that imports
fullshard as a library keeps Python's KeyboardInterrupt. A rank exits silently (the
launcher says that the run was stopped).
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from types import FrameType

__all__ = ["quiet_interrupts_while_starting", "started"]

_LAUNCHERS = ("fullshard", "fullshard.cli")  # python -m targets of the command itself
_RANKS = ("fullshard.training",)


def _role() -> str | None:
    """The role: "launcher", "rank", or None when this process is not the ``fullshard`` command."""
    argv = list(getattr(sys, "orig_argv", []))
    if "-m" in argv[1:-1]:
        module = argv[argv.index("-m", 1) + 1]
        return "launcher" if module in _LAUNCHERS else "rank" if module in _RANKS else None
    return "launcher" if os.path.basename(sys.argv[0] if sys.argv else "") == "fullshard" else None


def _exit_quietly(signum: int, frame: FrameType | None) -> None:
    print("\nfullshard: interrupted while starting", file=sys.stderr, flush=True)
    raise SystemExit(130)


def _exit_silently(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(130)


def quiet_interrupts_while_starting() -> None:
    """Makes a Ctrl-C before ``started()`` exit with status 130, without a traceback (command processes only)."""
    role = _role()
    if role is None or threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is not signal.default_int_handler:  # ignored (a background job), or taken
        return
    signal.signal(signal.SIGINT, _exit_quietly if role == "launcher" else _exit_silently)


def started() -> None:
    """The command's own handling takes over: Ctrl-C raises KeyboardInterrupt again."""
    if signal.getsignal(signal.SIGINT) in (_exit_quietly, _exit_silently):
        signal.signal(signal.SIGINT, signal.default_int_handler)


quiet_interrupts_while_starting()  # on import: fullshard/__init__.py imports this module first
