"""The ``fullshard`` command line.

    fullshard train                                  # a small GPT on 2 CPU ranks, with progress and summary
    fullshard train --nproc 4 --strategy hybrid --shard-size 2 --checkpoint-dir ckpt
    fullshard plan --model gpt-7b --world-size 8 64 1024
    fullshard plan --model gpt-7b --world-size 1-16384 --strategy all --plot plan.png
    fullshard plan --model gpt-30m --world-size 1 2 4 --batch 2 --device cpu
    python -m fullshard train                        # the same, without the console script

Each subcommand is one module of this package with ``HELP``, ``add_arguments(parser)``
and ``run(args) -> int`` (the exit status); ``SUBCOMMANDS`` lists them.
"""

from __future__ import annotations

import argparse
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
        subparser.set_defaults(run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the process's arguments) and runs the subcommand.

    Returns:
        The exit status.
    """
    args = build_parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
