"""`kvstore plan`: the resume plan of a prompt against a running service (being built: issue 11)."""

from __future__ import annotations

import argparse

from kvstore.errors import FailedPrecondition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--tokens", help="file of token ids")


def run(args: argparse.Namespace) -> int:
    """Not built yet."""
    raise FailedPrecondition("kvstore plan is not built yet (issue 11)")
