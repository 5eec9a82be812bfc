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
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = build_parser(argv[0] if argv else None).parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
