"""Look at the fleet of storage nodes registered in etcd (docs/FLEET.md).

`kvstore fleet status` lists every node of the cluster: its id (kept in its data
dir), the address clients reach it at, the seconds left on its lease (renewed
every third of the TTL; a node that stops renewing leaves when it reaches 0),
its capacity and when it started. etcd's endpoints come from --etcd, else the
[fleet] section of --config (or KVSTORE_CONFIG, KVSTORE_FLEET_ETCD). Exit 0 with
the list (empty too), 2 when etcd cannot be reached (one line naming the endpoints).

Examples:
  kvstore fleet status --etcd 127.0.0.1:2379
  kvstore fleet status --config /etc/kvstore/kvstore.toml --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.config_sections import FleetSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: one subcommand, status."""
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    status = sub.add_parser("status", help="list the nodes registered in etcd: id, address, lease left, started")
    status.add_argument("--etcd", default=None, help="etcd endpoints, host:port,... (default: [fleet] etcd)")
    status.add_argument("--cluster", default=None, help="the fleet's name (default: [fleet] cluster, 'default')")
    status.add_argument("--config", type=Path, default=None, help="TOML config whose [fleet] section to use")
    status.add_argument("--timeout", type=float, default=3.0, help="seconds each etcd call may take (default 3)")
    status.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand."""
    from kvstore.config import load_settings
    from kvstore.errors import ConfigError

    fleet = load_settings(args.config, overrides={"fleet": {"etcd": args.etcd, "cluster": args.cluster}}).fleet
    if not fleet.enabled:
        raise ConfigError("no etcd endpoints to ask: this is a single node's configuration",
                          hint="give --etcd host:port, or set [fleet] etcd in --config (or KVSTORE_FLEET_ETCD)")
    report = asyncio.run(_status(fleet, args.timeout))
    print(json.dumps(report) if args.json else "\n".join(_lines(report)))
    return 0


async def _status(fleet: FleetSettings, timeout_s: float) -> dict[str, Any]:
    """Every node of the cluster with its lease's seconds left."""
    from kvstore.fleet.membership import lease_ttl_s, read_nodes, session_for

    session = session_for(fleet, timeout_s=timeout_s)
    try:
        nodes, revision = await read_nodes(session, fleet.cluster)
        ttls = [await lease_ttl_s(session, n.lease_id) for n in nodes]
    finally:
        await session.close()
    return {"cluster": fleet.cluster, "etcd": [str(e) for e in session.endpoints], "revision": revision,
            "nodes": [{"node_id": n.record.node_id, "address": n.record.address, "host": n.record.host,
                       "lease_ttl_left_s": ttl, "started_at": n.record.started_at,
                       "capacity_bytes": n.record.capacity_bytes, "version": n.record.version}
                      for n, ttl in zip(nodes, ttls, strict=True)]}


def _lines(report: dict[str, Any]) -> list[str]:
    nodes = report["nodes"]
    lines = [f"fleet {report['cluster']!r} in etcd {', '.join(report['etcd'])}: {len(nodes)} node"
             f"{'' if len(nodes) == 1 else 's'}"]
    if not nodes:
        return lines
    rows = [("NODE", "ADDRESS", "LEASE LEFT", "STARTED", "CAPACITY", "VERSION")]
    for n in nodes:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(n["started_at"]))
        rows.append((n["node_id"], n["address"], f"{n['lease_ttl_left_s']} s", started,
                     f"{n['capacity_bytes'] / 1e12:.2f} TB", n["version"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    return lines
