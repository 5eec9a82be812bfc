"""The ``hemiola`` command line: ``hemiola <command> [options]``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence


def _info(_: argparse.Namespace) -> int:
    from hemiola._native import C

    print(C.build_info(), end="")
    return 0


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The parser for all commands, or, given ``command="cluster"``, for that one only."""
    parser = argparse.ArgumentParser(
        prog="hemiola",
        description="hemiola: schedule data-parallel communication under computation.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    commands.required = True

    info = commands.add_parser("info", help="what this build of hemiola compiled in")
    info.set_defaults(run=_info)

    # Each feature registers its own sub-commands. The demo and the parameter
    # server import torch (2-3 s); the cluster simulator needs none of it, so
    # its commands leave them out.
    if command != "cluster":
        from hemiola import advise, demo
        from hemiola.bench import cli as bench_cli

        demo.register(commands)
        advise.register(commands)
        bench_cli.register(commands)
    from hemiola.cluster import cli as cluster_cli

    cluster_cli.register(commands)
    if command != "cluster":
        from hemiola.ps import cli as ps_cli

        ps_cli.register(commands)
    from hemiola.elastic import coordinator

    coordinator.register(commands)
    return parser


#: The exit status of a command ended by Ctrl-C (128 + SIGINT), as a shell reports it.
INTERRUPTED = 130


def main(argv: Sequence[str] | None = None) -> int:
    """Runs one ``hemiola`` command; returns its exit status.

    A Ctrl-C that the command does not handle itself (while arguments are
    parsed, modules imported, or an error message is written) ends with status
    130 and one line, never a traceback: the command's own handlers say what
    was interrupted where they can.
    """
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser(argv[0] if argv else None).parse_args(argv)
        return int(args.run(args) or 0)
    except KeyboardInterrupt:
        try:
            print("hemiola: interrupted (Ctrl-C)", file=sys.stderr)
        except (KeyboardInterrupt, OSError):
            pass  # a second Ctrl-C, or stderr gone: the status says it
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
