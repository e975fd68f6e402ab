"""Drop a tenant's pins on a running service (docs/RETENTION.md R27, audited).

A pin keeps a prefix past its tenant's retention until a time a Put or a Lookup asked
(`keep_until_s`); `kvstore stats` shows each tenant's. Dropping them leaves the prefixes
to retention alone. Nothing is dropped without --yes. Needs a token with the "admin" right
(--token or $KVSTORE_TOKEN); a server without tenants on a loopback bind needs none.

An etcd:// --target drops them on every node of the fleet (a fleet pin is one per run per copy,
docs/RETENTION.md R28): each node is asked, the counts summed, an unreachable node named.

Example:
  kvstore pins --tenant acme --drop --yes
  kvstore pins --tenant acme --drop --yes --target etcd://10.0.0.5:2379/prod
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
    if args.target.startswith(("etcd://", "etcds://")):  # etcds://: TLS to etcd (F57)
        return _run_fleet(args)
    with admin_client(args) as admin:
        dropped = admin.drop_pins(args.tenant)
    if args.json:
        print(json.dumps({"tenant": args.tenant, "dropped_pins": dropped}))
    else:
        print(f"tenant {args.tenant}: {counted(dropped, 'pin')} dropped")
    return 0


def _run_fleet(args: argparse.Namespace) -> int:
    """Drop the tenant's pins on every node of the fleet; exit 1 when some node could not be asked.

    Raises:
        KVStoreError: etcd does not answer, or a node refused (a bad token: every node shares the fleet's).
    """
    from kvstore.client.admin import AdminClient
    from kvstore.client.fleet import FleetClient
    from kvstore.commands import client_options
    from kvstore.errors import DeadlineExceeded, Unavailable

    per_node: dict[str, int] = {}
    failed: dict[str, str] = {}
    with FleetClient(args.target, timeout_s=args.timeout, **client_options(args)) as fleet:
        for node_id, record in sorted(fleet.view.nodes.items()):
            try:
                with AdminClient(record.address, timeout_s=args.timeout, **client_options(args)) as admin:
                    per_node[node_id] = admin.drop_pins(args.tenant)
            except (Unavailable, DeadlineExceeded) as exc:  # its pins stay: said, and the exit status says so
                failed[node_id] = f"{type(exc).__name__}: {exc.message}"
    total = sum(per_node.values())
    if args.json:
        print(json.dumps({"tenant": args.tenant, "dropped_pins": total, "nodes": per_node, "unreachable": failed}))
    else:
        print(f"tenant {args.tenant}: {counted(total, 'pin')} dropped on {counted(len(per_node), 'node')}")
        for node_id, why in failed.items():
            print(f"  node {node_id} not asked, its pins stay: {why}")
    return 1 if failed else 0
