"""The ``fullshard`` command line.

    fullshard train                                  # a small GPT on 2 CPU ranks, with progress and summary
    fullshard train --nproc 4 --strategy hybrid --shard-size 2 --checkpoint-dir ckpt
    fullshard plan --model gpt-7b --world-size 8 64 1024
    fullshard plan --model gpt-7b --world-size 1-16384 --strategy all --plot plan.png
    fullshard plan --model gpt-30m --world-size 1 2 4 --batch-per-rank 2 --device cpu
    fullshard plan --hf-config ./llama/config.json --world-size 64 --batch 256 --memory-limit 80   # any model
    fullshard train --auto --nproc 4                 # plan picks the sharding, then trains with it
    python -m fullshard train                        # the same, without the console script

Each subcommand is one module of this package with ``HELP``, ``add_arguments(parser)``,
``problems(args) -> list[str]`` (every invalid flag, one line each) and ``run(args) -> int``
(the exit status); ``SUBCOMMANDS`` lists them. A value argparse cannot read (``--steps abc``)
does not hide the others: each such flag is set aside in turn and the rest parsed again, so one
try reports them all, with the other flags' problems.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import os
import sys

from . import plan, startup, train

SUBCOMMANDS = {"train": train, "plan": plan}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fullshard",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        exit_on_error=False,  # a subcommand's unreadable value reaches main()
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, module in SUBCOMMANDS.items():
        subparser = subparsers.add_parser(
            name,
            help=module.HELP,
            description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
            exit_on_error=False,  # main() collects every unreadable value
        )
        module.add_arguments(subparser)
        subparser.set_defaults(run=module.run, parser=subparser)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Parses ``argv`` (default: the process's arguments) and runs the subcommand.

    Returns:
        The exit status.
    """
    startup.started()  # Ctrl-C is KeyboardInterrupt again, handled below
    command = "fullshard"
    try:
        args, unknown, unreadable = _parse(build_parser(), list(sys.argv[1:] if argv is None else argv))
        command = f"fullshard {args.command}"
        if unknown:  # the subcommand's usage, not the top level's, and the flag meant
            unreadable.append(_unknown_flags(args.parser, unknown))
        if unreadable:
            args.parser.print_usage(sys.stderr)
            lines = [f"{command}: error: {line}" for line in unreadable]
            lines += [f"{command}: {line}" for line in SUBCOMMANDS[args.command].problems(args)]
            print("\n".join(lines), file=sys.stderr)
            return 2
        return args.run(args)
    except BrokenPipeError:  # `fullshard plan ... | head`: the reader has all it wanted
        for stream in (sys.stdout, sys.stderr):  # Python's own flush at exit would fail again
            with contextlib.suppress(OSError, ValueError):
                os.dup2(os.open(os.devnull, os.O_WRONLY), stream.fileno())
        return 141  # as a shell reports a process ended by SIGPIPE
    except KeyboardInterrupt:  # Ctrl-C before any rank started, or during a long plan
        print(f"\n{command}: interrupted", file=sys.stderr)
        return 130


def _parse(parser: argparse.ArgumentParser, argv: list[str]) -> tuple[argparse.Namespace, list[str], list[str]]:
    """(args, unknown flags, argparse's message for each flag whose value it cannot read): those
    flags are dropped one by one (their defaults stand) until the rest parses."""
    unreadable: list[str] = []
    while True:
        try:
            args, unknown = parser.parse_known_args(argv)
            return args, unknown, unreadable
        except argparse.ArgumentError as exc:
            remaining = _without(argv, (exc.argument_name or "").split("/"))
            if remaining == argv:  # nothing to set aside: argparse's own way out
                parser.error(str(exc))
            unreadable.append(str(exc))
            argv = remaining


def _without(argv: list[str], flags: list[str]) -> list[str]:
    """``argv`` less every use of ``flags`` with the values that follow it."""
    kept, skipping = [], False
    for word in argv:
        is_flag = word.startswith("-") and not _is_number(word)
        if is_flag:
            skipping = word.split("=")[0] in flags
        if not skipping:
            kept.append(word)
        elif "=" in word and is_flag:  # --flag=value: one word
            skipping = False
    return kept


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _unknown_flags(parser: argparse.ArgumentParser, unknown: list[str]) -> str:
    known = [option for action in parser._actions for option in action.option_strings]
    said = []
    for word in unknown:
        close = difflib.get_close_matches(word.split("=")[0], known, n=1)
        said.append(f"{word} (did you mean {close[0]}?)" if close else word)
    return "unrecognized arguments: " + " ".join(said)


if __name__ == "__main__":
    sys.exit(main())
