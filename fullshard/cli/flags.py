"""Flags the user set, and the line for flags that do nothing in a combination.

A flag that has no effect is an error or a warning, never ignored (issue 39): the commands
ask which of a group the user set (a value other than the parser's default) and say so
in one line that names them.
"""

from __future__ import annotations

import argparse

__all__ = ["only_with", "set_flags"]


def set_flags(args: argparse.Namespace, dests: list[str]) -> list[str]:
    """The flags among ``dests`` whose value is not the parser's default, as typed (``--rows 5``, ``--cpu-offload``)."""
    parser: argparse.ArgumentParser = args.parser
    options = {action.dest: action.option_strings[0] for action in parser._actions if action.option_strings}
    said = []
    for dest in dests:
        value = getattr(args, dest)
        if value == parser.get_default(dest):
            continue
        if isinstance(value, bool):
            said.append(options[dest])
        else:
            values = value if isinstance(value, list) else [value]
            values = [v for part in values for v in (part if isinstance(part, list) else [part])]  # --world-size
            said.append(" ".join([options[dest], *(f"{v:g}" if isinstance(v, float) else str(v) for v in values)]))
    return said


def only_with(flags: list[str], condition: str, fix: str) -> str:
    """``--a, --b apply only <condition>: <fix>, or drop them``."""
    one = len(flags) == 1
    return (
        f"{', '.join(flags)} {'applies' if one else 'apply'} only {condition}: {fix}, or drop {'it' if one else 'them'}"
    )
