"""What the tenant-wide admin commands (`purge`, `export`, `import`) share: the connection
flags, the Admin client they make, and a progress line while the server works."""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from kvstore.commands import add_connection_arguments as add_credentials
from kvstore.commands import client_options

DEFAULT_TARGET = "127.0.0.1:50051"


def add_connection_arguments(p: argparse.ArgumentParser, *, timeout_s: float) -> None:
    """--target, the credentials (--token, TLS), --json, --timeout and --no-progress."""
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    add_credentials(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=timeout_s,
                   help=f"seconds the server may take (default {timeout_s:g})")
    p.add_argument("--no-progress", action="store_true", help="hide the progress line")


def admin_client(args: argparse.Namespace) -> Any:
    """The Admin client for the command's flags (the token from --token, else $KVSTORE_TOKEN; TLS flags)."""
    from kvstore.client.admin import AdminClient

    return AdminClient(args.target, timeout_s=args.timeout, **client_options(args))


@contextmanager
def progress(args: argparse.Namespace, doing: str) -> Iterator[None]:
    """While the block runs, `doing ... N s` on stderr (a terminal only, not under --json or --no-progress).

    The server does the work in one call and reports only at its end, so the line
    says that it is still working and for how long; the result follows it.
    """
    shown = not args.json and not args.no_progress and sys.stderr.isatty()
    done = threading.Event()
    start = time.monotonic()

    def tick() -> None:
        while not done.wait(0.5):
            print(f"\r{doing} ... {time.monotonic() - start:.0f} s", end="", file=sys.stderr, flush=True)

    ticker = threading.Thread(target=tick, daemon=True)
    if shown:
        ticker.start()
    try:
        yield
    finally:
        done.set()
        if shown:
            ticker.join()
            print(f"\r{doing}: {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
