"""Command line: argument handling only; every subcommand calls into the packages.

``args`` builds the parser, ``serve`` runs ``distserve serve``, ``commands`` the other subcommands.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence as Seq

from distserve.cli.args import build_parser
from distserve.errors import DistServeError

__all__ = ["build_parser", "main"]


def main(argv: Seq[str] | None = None) -> int:
    """Bad flags and bad input both exit with code 2 and a message naming the problem."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except DistServeError as exc:
        print(f"distserve {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
