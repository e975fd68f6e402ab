"""Show and change tenants' policies (retention, SWA TTL, quotas) and read their audit log.

Every subcommand needs a token with the "admin" right (--token, or the
KVSTORE_TOKEN environment variable; --tls* flags for a TLS server); a server
without tenants on a loopback bind needs none. Retention is at least 72 hours and may only be raised; a quota
of 0 is unlimited. Byte quotas take a plain number or a unit (10GiB, 512MiB, 2TB).

Examples:
  kvstore policy get acme
  kvstore policy set acme --retention-hours 96 --nvme-quota-bytes 200GiB --requests-per-s 500
  kvstore policy set acme --replay-fidelity kl:1e-3
  kvstore policy list --json
  kvstore policy log --tenant acme --limit 20
"""

from __future__ import annotations

import argparse
import json
import re
import time
from typing import Any

from kvstore.commands import add_connection_arguments, client_options
from kvstore.errors import InvalidArgument

DEFAULT_TARGET = "127.0.0.1:50051"
_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40}
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*")
#: (flag, policy field, parser, help)
SETTABLE = (
    ("--retention-hours", "retention_hours", float, "hours a block is kept after its last use (>= 72, only raised)"),
    ("--swa-ttl-s", "swa_ttl_s", float, "longest a SWA snapshot lives, seconds (at most the server's swa.ttl_s)"),
    ("--nvme-quota-bytes", "nvme_quota_bytes", "bytes", "block bytes on NVMe (0: unlimited)"),
    ("--swa-quota-bytes", "swa_quota_bytes", "bytes", "snapshot bytes in the SWA pool (0: unlimited)"),
    ("--requests-per-s", "requests_per_s", float, "data requests per second (0: unlimited)"),
    ("--pin-max-hours", "pin_max_hours", float, "longest a pin (keep_until_s) may run past now, hours (0: no pins)"),
    ("--pin-budget-bytes", "pin_budget_bytes", "bytes", "bytes of pinned prefixes the tenant may hold (0: no pins)"),
    ("--replication", "replication", int, "copies of each run in a fleet, 1 to 5 (default [fleet] replication; "
     "1 on a single node)"),
    ("--replay-fidelity", "replay_fidelity", str, "replay fidelity: exact, windows:N, or an error budget kl:X "
     "(nats per continued token) or fastllm:P (percent of resumes); the planner picks the smallest measured "
     "span meeting it (docs/PLANNER.md)"),
)


def parse_bytes(text: str) -> int:
    """A byte count: a number with an optional unit (B, KB, MB, GB, TB, KiB, MiB, GiB, TiB).

    Raises:
        argparse.ArgumentTypeError: not a size.
    """
    match = _SIZE.fullmatch(text)
    unit = match.group(2).lower() if match else ""
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a byte count (e.g. 1000000, 512MiB, 10GiB, 2TB)")
    value = float(match.group(1)) * _UNITS[unit]
    if not value.is_integer():
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of bytes")
    return int(value)


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default=DEFAULT_TARGET, help=f"server address (default {DEFAULT_TARGET})")
    add_connection_arguments(p)  # --token (an admin's; default $KVSTORE_TOKEN) and the TLS flags
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The `policy` subcommands."""
    sub = parser.add_subparsers(dest="policy_command", required=True, metavar="SUBCOMMAND")
    get = sub.add_parser("get", help="show a tenant's policy and usage")
    get.add_argument("tenant")
    _common(get)
    set_ = sub.add_parser("set", help="change fields of a tenant's policy (audited)")
    set_.add_argument("tenant")
    for flag, field, kind, help_ in SETTABLE:
        set_.add_argument(flag, dest=field, type=parse_bytes if kind == "bytes" else kind, help=help_)
    _common(set_)
    list_ = sub.add_parser("list", help="every tenant with a policy of its own, and the defaults")
    _common(list_)
    log = sub.add_parser("log", help="the audit log of admin changes, oldest first")
    log.add_argument("--tenant", default="", help="only this tenant's entries")
    log.add_argument("--limit", type=int, default=0, help="only the last N entries (0: all)")
    _common(log)


def _fields(message: Any) -> dict[str, Any]:
    """A message's fields in their declared order (64-bit ints stay ints)."""
    return {f.name: getattr(message, f.name) for f in message.DESCRIPTOR.fields}


def _show(field: str, value: Any) -> str:
    if isinstance(value, float):
        text = f"{value:g}"
    elif isinstance(value, int) and not isinstance(value, bool):
        text = f"{value:,}"
        if field.endswith("_bytes") and value >= 1 << 20:
            text += f" ({_binary(value)})"
    else:
        text = str(value)
    unlimited = value == 0 and field.endswith(("_quota_bytes", "requests_per_s"))
    return text + (" (unlimited)" if unlimited else "")


def _binary(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20)):
        if n >= size:
            return f"{n / size:.4g} {unit}"
    return f"{n} B"


def run(args: argparse.Namespace) -> int:
    """Run the chosen subcommand against the server's Admin service."""
    from kvstore.client.admin import AdminClient

    with AdminClient(args.target, timeout_s=args.timeout, **client_options(args)) as admin:
        out = _COMMANDS[args.policy_command](admin, args)
    if args.json:
        print(json.dumps(out["json"]))
    else:
        print("\n".join(out["lines"]))
    return 0


def _get(admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    reply = admin.get_policy(args.tenant)
    policy, usage = _fields(reply.policy.policy), _fields(reply.usage)
    data = {"tenant": reply.policy.tenant, "is_default": reply.policy.is_default, "policy": policy, "usage": usage}
    lines = [f"tenant {reply.policy.tenant}" + (" (server defaults: no policy of its own)"
                                                if reply.policy.is_default else "")]
    lines += [f"  {k:<18} {_show(k, v)}" for k, v in policy.items()]
    lines += ["usage"] + [f"  {k:<18} {_show(k, v)}" for k, v in usage.items()]
    return {"json": data, "lines": lines}


def _set(admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    fields = {f: getattr(args, f) for _, f, _, _ in SETTABLE if getattr(args, f) is not None}
    if not fields:
        raise InvalidArgument("nothing to set: give at least one of " + ", ".join(flag for flag, *_ in SETTABLE))
    reply = admin.set_policy(args.tenant, **fields)
    before, after = _fields(reply.before.policy), _fields(reply.after.policy)
    changed = {k: {"old": before[k], "new": after[k]} for k in after if before[k] != after[k]}
    lines = [f"tenant {args.tenant}: " + ("nothing changed" if not changed else "policy changed (audited)")]
    lines += [f"  {k:<18} {_show(k, v['old'])} -> {_show(k, v['new'])}" for k, v in changed.items()]
    if reply.note:
        lines.append(f"note: {reply.note}")
    return {"json": {"tenant": args.tenant, "before": before, "after": after, "changed": changed,
                     "note": reply.note}, "lines": lines}


def _list(admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    reply = admin.list_policies()
    rows = {p.tenant: _fields(p.policy) for p in reply.policies}
    defaults = _fields(reply.defaults)
    names = list(defaults)
    table = [["tenant", *names], ["(defaults)", *(_cell(n, defaults[n]) for n in names)]]
    table += [[t, *(_cell(n, r[n]) for n in names)] for t, r in rows.items()]
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines = ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip() for row in table]
    return {"json": {"defaults": defaults, "tenants": rows}, "lines": lines}


def _cell(field: str, value: Any) -> str:
    if isinstance(value, str):
        return value
    return f"{value:g}" if isinstance(value, float) else f"{value:,}"


def _log(admin: Any, args: argparse.Namespace) -> dict[str, Any]:
    entries = admin.policy_log(tenant=args.tenant, limit=args.limit)
    data = [{"time_s": e.time_s, "time": _when(e.time_s), "actor": e.actor, "action": e.action, "tenant": e.tenant,
             "old": json.loads(e.old_json or "null"), "new": json.loads(e.new_json or "null")} for e in entries]
    lines = [f"{d['time']}  by {d['actor']}  {d['action']}  tenant {d['tenant']}  {_change(d['old'], d['new'])}"
             for d in data] or ["(no admin changes recorded)"]
    return {"json": {"entries": data}, "lines": lines}


def _when(time_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time_s))


def _change(old: Any, new: Any) -> str:
    """`field old -> new` per field when both are dicts, else both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        keys = list(dict.fromkeys([*old, *new]))
        return ", ".join(f"{k} {_show(k, old.get(k, '-'))} -> {_show(k, new.get(k, '-'))}" for k in keys)
    return f"{json.dumps(old)} -> {json.dumps(new)}"


_COMMANDS = {"get": _get, "set": _set, "list": _list, "log": _log}
