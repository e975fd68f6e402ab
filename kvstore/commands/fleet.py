"""Look at the fleet of storage nodes registered in etcd (docs/FLEET.md).

`kvstore fleet status` lists every node of the cluster: its id (kept in its data
dir), the address clients reach it at, the seconds left on its lease (renewed
every third of the TTL; a node that stops renewing leaves when it reaches 0),
its capacity and when it started, and its re-replication: the bytes it still
has to copy to bring its runs back to their replication factor, and what it has
copied, and how many of the runs it holds its last pass planned (fewer after a
membership change, and in a big node's periodic sweep: F18f, F87); the last line
sums them fleet-wide (docs/FLEET.md F18). `kvstore fleet drain NODE` (a member's
id, or a prefix of exactly one) has a node drain from its next pass, which the
request starts (F85): it stays a member and serves, no one places on it, the
other nodes take its runs at their replication, and it leaves once they hold
them; status shows the bytes left and says when it is drained, and may be
stopped (F21), and lists a request no node has taken up yet (a node down: it
drains when it joins again); `--cancel` undoes it. etcd's endpoints come from
--etcd, else the [fleet] section of --config (or KVSTORE_CONFIG,
KVSTORE_FLEET_ETCD). Exit 0 with
the list (empty too), 2 when etcd cannot be reached (one line naming the endpoints)
or NODE names no node of the fleet (nothing is written then).

Examples:
  kvstore fleet status --etcd 127.0.0.1:2379
  kvstore fleet drain 6f1c... --etcd 127.0.0.1:2379
  kvstore fleet status --config /etc/kvstore/kvstore.toml --json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvstore.config_sections import FleetSettings


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The command's arguments: the subcommands status and drain."""
    sub = parser.add_subparsers(dest="fleet_command", required=True, metavar="SUBCOMMAND")
    status = sub.add_parser("status", help="list the nodes registered in etcd: id, address, lease left, started, "
                                           "re-replication")
    drain = sub.add_parser("drain", help="have a node leave the fleet once the others hold every run it holds at "
                                         "its replication (it serves until then)")
    drain.add_argument("node", metavar="NODE", help="the node's id as `kvstore fleet status` lists it, or a prefix "
                                                    "of exactly one member's id")
    drain.add_argument("--cancel", action="store_true", help="cancel the drain: a draining node is placed on again; "
                                                             "a drained one joins again at its restart")
    for p in (status, drain):
        p.add_argument("--etcd", default=None, help="etcd endpoints, host:port,... or https://host:port,... for TLS "
                                                   "(default: [fleet] etcd)")
        for name, what in (("ca", "CA certificates etcd's certificate is checked against"),
                           ("cert", "this command's certificate, for an etcd asking for one"), ("key", "its key")):
            p.add_argument(f"--etcd-{name}-file", default=None,
                           help=f"TLS to etcd: {what} (default: [fleet] etcd_{name}_file; docs/FLEET.md F57)")
        p.add_argument("--etcd-user", default=None,
                       help="etcd's authentication: the user to authenticate as (default: [fleet] etcd_user; F70)")
        p.add_argument("--etcd-password-file", default=None,
                       help="a file whose first line is that user's password, never the password itself "
                            "(default: [fleet] etcd_password_file)")
        p.add_argument("--cluster", default=None, help="the fleet's name (default: [fleet] cluster, 'default')")
        p.add_argument("--config", type=Path, default=None, help="TOML config whose [fleet] section to use")
        p.add_argument("--timeout", type=float, default=3.0, help="seconds each etcd call may take (default 3)")
    status.add_argument("--json", action="store_true", help="print one JSON object")


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand."""
    from kvstore.config import load_settings
    from kvstore.errors import ConfigError

    fleet = load_settings(args.config, overrides={"fleet": {
        "etcd": args.etcd, "cluster": args.cluster, "etcd_ca_file": args.etcd_ca_file,
        "etcd_cert_file": args.etcd_cert_file, "etcd_key_file": args.etcd_key_file, "etcd_user": args.etcd_user,
        "etcd_password_file": args.etcd_password_file}}).fleet
    if not fleet.enabled:
        raise ConfigError("no etcd endpoints to ask: this is a single node's configuration",
                          hint="give --etcd host:port, or set [fleet] etcd in --config (or KVSTORE_FLEET_ETCD)")
    if args.fleet_command == "drain":
        print(asyncio.run(_drain(fleet, args.node, cancel=args.cancel, timeout_s=args.timeout)))
        return 0
    report = asyncio.run(_status(fleet, args.timeout))
    print(json.dumps(report) if args.json else "\n".join(_lines(report)))
    return 0


async def _drain(fleet: FleetSettings, node: str, *, cancel: bool, timeout_s: float) -> str:
    """Ask a node to drain (docs/FLEET.md F21), or cancel its drain; what was done, in one line.

    Raises:
        NotFound: `node` names no member of the fleet (with --cancel: nor a node with a drain asked or done).
        InvalidArgument: `node` is a prefix of more than one such id.
    """
    from kvstore.fleet.membership import read_nodes, session_for
    from kvstore.fleet.repair_progress import (
        RepairProgress,
        drain_key,
        drain_prefix,
        drained_node,
        repair_key,
        repair_prefix,
    )

    session = session_for(fleet, timeout_s=timeout_s)
    try:
        members = [n.record.node_id for n in (await read_nodes(session, fleet.cluster))[0]]
        others: list[str] = []
        if cancel:  # F85: a drained node has left the membership; its request and record are still there
            asked = await session.call(lambda c: c.get_prefix(drain_prefix(fleet.cluster)))
            records = await session.call(lambda c: c.get_prefix(repair_prefix(fleet.cluster)))
            others = [drained_node(kv.key) for kv in asked]
            others += [p.node_id for p in (RepairProgress.from_json(kv.value) for kv in records)
                       if p is not None and p.draining]
        node_id = resolve_node(node, members, others, cluster=fleet.cluster)
        key = drain_key(fleet.cluster, node_id)
        if cancel:
            await session.call(lambda c: c.delete(key))
            await session.call(lambda c: c.delete(repair_key(fleet.cluster, node_id)))
            return (f"node {node_id}: drain cancelled; the node is placed on again at its next pass, which this "
                    "starts (drained already: it joins the fleet again when restarted)")
        await session.call(lambda c: c.put(key, json.dumps({"requested_at": time.time()}).encode()))
    finally:
        await session.close()
    return (f"node {node_id}: drain requested; from its next pass, which this starts (after the one under way, if "
            "any), it stays a member and serves while the other nodes take its runs, and leaves once they hold them; "
            "stop it once `kvstore fleet status` says it is drained")


def resolve_node(node: str, members: Sequence[str], others: Sequence[str] = (), *, cluster: str) -> str:
    """The node id `node` names (docs/FLEET.md F85): a member's id, or a prefix of exactly one (as `kvstore fleet
    status` lists them); `others` are ids a name may also match (a drained node's, for --cancel).

    Raises:
        NotFound: no id starts with `node`.
        InvalidArgument: `node` is empty, or a prefix of more than one id.
    """
    from kvstore.errors import InvalidArgument, NotFound

    known = list(dict.fromkeys([*members, *others]))
    if not node:
        raise InvalidArgument("NODE is empty", hint="give a node id as `kvstore fleet status` lists it")
    if node in known:
        return node
    matches = [n for n in known if n.startswith(node)]
    if len(matches) == 1:
        return matches[0]
    if matches:
        raise InvalidArgument(f"{node!r} is the start of {len(matches)} node ids in fleet {cluster!r}: "
                              f"{', '.join(sorted(matches))}", hint="give more of the id")
    listed = ", ".join(sorted(members)) if members else "none"
    raise NotFound(f"no node {node!r} in fleet {cluster!r} (its members: {listed}); nothing was asked",
                   hint="give an id `kvstore fleet status` lists, or a prefix of one; check --cluster and --etcd")


async def _status(fleet: FleetSettings, timeout_s: float) -> dict[str, Any]:
    """Every node of the cluster with its lease's seconds left."""
    from kvstore.fleet.membership import lease_ttl_s, read_nodes, session_for
    from kvstore.fleet.repair_progress import RepairProgress, drain_prefix, drained_node, repair_prefix

    session = session_for(fleet, timeout_s=timeout_s)
    try:
        nodes, revision = await read_nodes(session, fleet.cluster)
        ttls = [await lease_ttl_s(session, n.lease_id) for n in nodes]
        found = await session.call(lambda c: c.get_prefix(repair_prefix(fleet.cluster)))
        asked = await session.call(lambda c: c.get_prefix(drain_prefix(fleet.cluster)))
    finally:
        await session.close()
    repairs = {p.node_id: p for p in (RepairProgress.from_json(kv.value) for kv in found) if p is not None}
    rows = [{"node_id": n.record.node_id, "address": n.record.address, "host": n.record.host,
             "lease_ttl_left_s": ttl, "started_at": n.record.started_at, "capacity_bytes": n.record.capacity_bytes,
             "version": n.record.version, "draining": n.record.draining,
             "repair": _repair(repairs.get(n.record.node_id))}
            for n, ttl in zip(nodes, ttls, strict=True)]
    report: dict[str, Any] = {"cluster": fleet.cluster, "etcd": [str(e) for e in session.endpoints],
                              "revision": revision, "nodes": rows}
    report["replication"] = _replication(report["nodes"])
    live = {n["node_id"] for n in rows}
    # F21: a draining node is a member until the others hold its runs (`left_bytes` of its blocks they lack, as they
    # answered its last pass); drained, it left the membership and may be stopped.
    report["draining"] = [{"node_id": p.node_id, "member": p.node_id in live, "drained": p.drained,
                           "left_bytes": p.drain_left_bytes, "left_runs": p.drain_left_runs,
                           "may_stop": p.drained and p.node_id not in live, "repair": _repair(p)}
                          for p in sorted(repairs.values(), key=lambda p: p.node_id) if p.draining]
    # F85: a request no pass has taken up yet: the node has not woken to it, or is not a member (it died while the
    # request stood: it drains once it joins again).
    draining = {d["node_id"] for d in report["draining"]}
    requested = [(drained_node(kv.key), kv.value) for kv in asked]
    report["drain_requested"] = [{"node_id": node, "member": node in live, "requested_at": _requested_at(value)}
                                 for node, value in requested if node not in draining]
    return report


def _requested_at(value: bytes) -> float | None:
    """A drain request's time (None: not the JSON `kvstore fleet drain` writes)."""
    try:
        at = json.loads(value).get("requested_at")
    except (ValueError, AttributeError):
        return None
    return float(at) if isinstance(at, int | float) else None


def _repair(progress: Any) -> dict[str, Any] | None:
    """A node's re-replication record as the report shows it (None: it published none)."""
    if progress is None:
        return None
    return {k: getattr(progress, k) for k in ("planned_nodes", "running", "passes", "under_replicated_bytes",
                                              "under_replicated_runs", "copied_bytes", "copied_blocks", "sent_bytes",
                                              "bulk_bytes", "damaged_blocks", "failed_runs", "draining",
                                              "drain_left_bytes", "drain_left_runs", "drained",
                                              "stale_dropped_runs", "stale_dropped_bytes", "pass_runs",
                                              "held_runs", "updated_at")}


def _replication(nodes: list[dict[str, Any]]) -> dict[str, Any]:
    """Fleet-wide re-replication (docs/FLEET.md F18): under-replicated bytes and runs over the nodes, and
    whether every node has finished a pass over today's membership (`settled`: the 0 can be trusted)."""
    live = sorted(n["node_id"] for n in nodes)
    repairs = [n["repair"] for n in nodes]
    known = [r for r in repairs if r is not None]
    return {"under_replicated_bytes": sum(r["under_replicated_bytes"] for r in known),
            "under_replicated_runs": sum(r["under_replicated_runs"] for r in known),
            "copied_bytes": sum(r["copied_bytes"] for r in known),
            "failed_runs": sum(r["failed_runs"] for r in known),
            "settled": bool(nodes) and all(r is not None and not r["running"] and r["planned_nodes"] == live
                                           and r["passes"] > 0 for r in repairs)}


def _lines(report: dict[str, Any]) -> list[str]:
    nodes = report["nodes"]
    lines = [f"fleet {report['cluster']!r} in etcd {', '.join(report['etcd'])}: {len(nodes)} node"
             f"{'' if len(nodes) == 1 else 's'}"]
    if not nodes:
        return lines
    rows = [("NODE", "ADDRESS", "LEASE LEFT", "STARTED", "CAPACITY", "VERSION", "UNDER-REPLICATED", "COPIED",
             "PASS RUNS")]
    for n in nodes:
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(n["started_at"]))
        r = n.get("repair")
        under = "-" if r is None else f"{r['under_replicated_bytes'] / 1e9:.3f} GB" + (" (pass)" * r["running"])
        rows.append((n["node_id"], n["address"], f"{n['lease_ttl_left_s']} s", started,
                     f"{n['capacity_bytes'] / 1e12:.2f} TB", n["version"], under,
                     "-" if r is None else f"{r['copied_bytes'] / 1e9:.3f} GB",
                     # F18f, F86, F87: what the last pass planned of the runs held (a sweep's part, the moved runs)
                     "-" if r is None else f"{r['pass_runs']:,} of {r['held_runs']:,}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in rows]
    for d in report["draining"]:
        if d["may_stop"]:
            lines.append(f"node {d['node_id']} is out of the membership, drained: it may be stopped")
        else:
            lines.append(f"node {d['node_id']} is draining: {d['left_bytes']} bytes of {d['left_runs']} runs not yet "
                         "on their replicas among the other nodes at its last pass; a member and serving until they "
                         "are: do not stop it")
    for d in report["drain_requested"]:
        lines.append(f"node {d['node_id']}: drain requested, not started: " + (
            "it starts at the node's next pass (after the one under way, if any)" if d["member"] else
            "the node is not a member; it drains when it joins again (`kvstore fleet drain --cancel` drops the "
            "request)"))
    rep = report["replication"]
    lines.append(f"under-replicated: {rep['under_replicated_bytes']} bytes in {rep['under_replicated_runs']} runs"
                 f"{'' if rep['settled'] else ' (a pass over the current membership is under way)'}")
    return lines
