"""Drop a tenant's pins on a running service (docs/RETENTION.md R27, audited).

A pin keeps a prefix past its tenant's retention until a time a Put or a Lookup asked
(`keep_until_s`); `kvstore stats` shows each tenant's. Dropping them leaves the prefixes
to retention alone. Nothing is dropped without --yes. Needs a token with the "admin" right
(--token or $KVSTORE_TOKEN); a server without tenants on a loopback bind needs none.

Example:
  kvstore pins --tenant acme --drop --yes
"""

from __future__ import annotations

import argparse
import json

from kvstore.commands.admin_call import add_connection_arguments, admin_client
from kvstore.counted import counted
from kvstore.errors import InvalidArgument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments."""
    parser.add_argument("--tenant", required=True, help="the tenant whose pins go")
    parser.add_argument("--drop", action="store_true", required=True, help="drop every pin of the tenant")
    parser.add_argument("--yes", action="store_true", help="really drop (required)")
    add_connection_arguments(parser, timeout_s=30.0)


def run(args: argparse.Namespace) -> int:
    """Ask the server to drop the tenant's pins; print how many were live."""
    if not args.yes:
        raise InvalidArgument(f"this drops every pin of tenant {args.tenant!r}: add --yes to go ahead")
    with admin_client(args) as admin:
        dropped = admin.drop_pins(args.tenant)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "dropped_pins": dropped}))
    else:
        print(f"tenant {args.tenant}: {counted(dropped, 'pin')} dropped")
    return 0
