"""The ``fullshard`` command line.

    fullshard train                                  # a small GPT on 2 CPU ranks, with progress and summary
    fullshard train --nproc 4 --strategy hybrid --shard-size 2 --checkpoint-dir ckpt
    fullshard plan --model gpt-7b --world-size 8 64 1024
    fullshard plan --model gpt-7b --world-size 1-16384 --strategy all --plot plan.png
    fullshard plan --model gpt-30m --world-size 1 2 4 --batch-per-rank 2 --device cpu
    python -m fullshard train                        # the same, without the console script

Each subcommand is one module of this package with ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status); ``SUBCOMMANDS`` lists them.
"""

from __future__ import annotations

import argparse
import difflib
import os
import sys

from . import plan, train

SUBCOMMANDS = {"train": train, "plan": plan}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullshard", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run, parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the process's arguments) and runs the subcommand.

    Returns:
        The exit status.
    """
    args, unknown = build_parser().parse_known_args(argv)
    if unknown:  # the subcommand's usage, not the top level's, and the flag meant
        args.parser.error(_unknown_flags(args.parser, unknown))
    try:
        return args.run(args)
    except BrokenPipeError:  # `fullshard plan ... | head`: the reader has all it wanted
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # Python's own flush at exit would fail again
        return 141  # as a shell reports a process ended by SIGPIPE
    except KeyboardInterrupt:  # Ctrl-C before any rank started, or during a long plan
        print(f"\nfullshard {args.command}: interrupted", file=sys.stderr)
        return 130


def _unknown_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    known = [option for action in parser._actions for option in action.option_strings]
    said = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1)
        said.append(f"{word} (did you mean {close[0]}?)" if close else word)
    return "unrecognized arguments: " + " ".join(said)


if __name__ == "__main__":
    sys.exit(main())
