"""Command line: argument handling only; every subcommand calls into the packages.

``args`` builds the parser, ``serve`` runs ``distserve serve``, ``commands`` the other subcommands.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence as Seq

from distserve.errors import DistServeError

__all__ = ["main"]

SIMULATOR_COMMANDS = ("simulate", "plan")  # they run the simulator: compiled, if built (``distserve.compiled``)


def main(argv: Seq[str] | None = None) -> int:
    """Bad flags and bad input both exit with code 2 and a message naming the problem."""
    args_seen = sys.argv[1:] if argv is None else list(argv)
    if args_seen and args_seen[0] in SIMULATOR_COMMANDS:
        import simulator  # noqa: F401 - before the parser imports the modules it would load compiled

    from distserve.cli.args import build_parser

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except DistServeError as exc:
        print(f"distserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
