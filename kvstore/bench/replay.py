"""Replay: planner overhead, bounded-replay fidelity and speed (being built: issue 11)."""

from __future__ import annotations

import argparse
from typing import Any

from kvstore.errors import FailedPrecondition


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's arguments."""


def run(args: argparse.Namespace, progress: Any) -> Any:
    """Not built yet."""
    raise FailedPrecondition("kvstore bench replay is not built yet (issue 11)")
