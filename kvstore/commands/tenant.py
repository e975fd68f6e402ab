"""Manage tenants and their API tokens: `kvstore tenant create|revoke|list`.

Works on the tenants file directly (by default `<data dir>/tenants.json`, or
auth.tenants_file), with or without a server running: a running server picks
a change up within auth.reload_s seconds, without a restart. With a
configuration whose `[fleet] etcd` is set (--config, KVSTORE_CONFIG or
KVSTORE_FLEET_ETCD), it works on the fleet's table in etcd instead, which every
node follows: a token created or revoked holds on every node within a second
(docs/FLEET.md, "Shared tables"); while etcd is away it fails with one line
naming etcd's endpoints, and nothing changes. `--target etcd://HOST:PORT[,...]/CLUSTER`
(the address `kvstore.Client` takes) names the fleet's table without a config file;
a `--target host:port` (a gateway or a node) is refused, naming the etcd:// form:
tokens are written in etcd, never through the serving API (docs/FLEET.md F54). The first
`create` turns auth on (docs/SECURITY.md); that is also how the first admin
token is made: `kvstore tenant create ops --admin --data-dir DIR`.

`create` prints the new token alone on stdout, once: it is stored only as a
hash and cannot be shown again. Give it to the tenant's clients as --token,
KVSTORE_TOKEN or kvstore.Client(token=...).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kvstore.api_tokens import ADMIN, READ, RIGHTS, WRITE, TokenRecord, create, read_records, revoke
from kvstore.config_sections import FleetSettings
from kvstore.counted import counted
from kvstore.errors import InvalidArgument


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `kvstore tenant`."""
    where = argparse.ArgumentParser(add_help=False)
    where.add_argument("--data-dir", type=Path, help="the store's folder (default ./kvstore-data, store.data_dir)")
    where.add_argument("--tenants-file", type=Path, help="the tenants file itself (auth.tenants_file)")
    where.add_argument("--config", type=Path, help="the server's TOML config, to find the file as it does")
    where.add_argument("--json", action="store_true", help="print one JSON object")
    where.add_argument("--target", help="etcd://HOST:PORT[,HOST:PORT]/CLUSTER: the fleet's table in etcd "
                       "(docs/FLEET.md F54; a gateway's or node's host:port is refused: tokens live in etcd)")
    sub = parser.add_subparsers(dest="action", required=True, metavar="ACTION")
    new = sub.add_parser("create", parents=[where], help="issue a token for a tenant (created if new)")
    new.add_argument("tenant", help="tenant name: 1-128 of [A-Za-z0-9._-], alphanumeric first")
    new.add_argument("--rights", default=f"{READ},{WRITE}",
                     help=f"comma-separated, among {', '.join(RIGHTS)} (default {READ},{WRITE})")
    new.add_argument("--admin", action="store_true", help=f"add the {ADMIN!r} right (policies, purge, any tenant)")
    gone = sub.add_parser("revoke", parents=[where], help="revoke a tenant's tokens (or one of them)")
    gone.add_argument("tenant")
    gone.add_argument("--token-id", help="revoke only this token (as `list` shows it)")
    sub.add_parser("list", parents=[where], help="list tokens: tenant, id, rights, created, revoked")


def parse_rights(text: str, *, admin: bool) -> frozenset[str]:
    """The rights of `--rights` (comma-separated), plus "admin" with --admin.

    Raises:
        InvalidArgument: naming each right that is not one of RIGHTS alone, or none given.
    """
    rights = {r.strip() for r in text.split(",") if r.strip()} | ({ADMIN} if admin else set())
    unknown = [r for r in dict.fromkeys(r.strip() for r in text.split(",")) if r and r not in RIGHTS]
    if unknown:
        names = ", ".join(repr(r) for r in unknown)
        raise InvalidArgument(f"unknown right{'s' if len(unknown) > 1 else ''} {names} in --rights: "
                              f"the rights are {', '.join(RIGHTS)}")
    if not rights:
        raise InvalidArgument(f"--rights names no right: give some of {', '.join(RIGHTS)}")
    return frozenset(rights)


def _where(args: argparse.Namespace) -> Path | FleetSettings:
    """The tenants file, or the fleet whose table in etcd holds the tenants ([fleet] etcd set, or an etcd://
    --target).

    Raises:
        FailedPrecondition: a --target that is not an etcd:// address (F54).
        InvalidArgument: a bad etcd:// address.
    """
    if getattr(args, "target", None):
        return _fleet_of(args.target)
    if args.tenants_file is not None:
        return Path(args.tenants_file)
    from kvstore.config import load_settings

    settings = load_settings(args.config, overrides={"store": {"data_dir": args.data_dir}})
    if settings.fleet.enabled:
        return settings.fleet
    return settings.auth.tenants_path(settings.store.data_dir)


def _fleet_of(target: str) -> FleetSettings:
    """The fleet an etcd:// `target` names; any other target is refused naming the etcd:// form (F54): a gateway
    or a node serves no call that writes a token, and tokens act fleet-wide from etcd whoever wrote them."""
    from kvstore.client.fleet_address import is_fleet_address, parse_fleet_address
    from kvstore.errors import FailedPrecondition

    if not is_fleet_address(target):
        raise FailedPrecondition(
            f"--target {target!r} is a server's address, but tokens are not made or revoked through a gateway or "
            "a node: they live in the fleet's etcd (or a single node's tenants file)",
            hint="give --target etcd://HOST:PORT[,HOST:PORT]/CLUSTER (the fleet's etcd, as kvstore.Client takes "
                 "it), or --config/--data-dir for a single node's tenants file")
    address = parse_fleet_address(target)
    tls, auth = address.tls, address.auth  # etcds://: https:// endpoints and the query's files (F57); user (F70)
    return FleetSettings(etcd=",".join(f"https://{e}" if tls else str(e) for e in address.endpoints),
                         cluster=address.cluster, etcd_ca_file=tls.ca_file if tls else "",
                         etcd_cert_file=tls.cert_file if tls else "", etcd_key_file=tls.key_file if tls else "",
                         etcd_user=auth.user if auth else "", etcd_password_file=auth.password_file if auth else "")


def run(args: argparse.Namespace) -> int:
    """Run `kvstore tenant ACTION`."""
    where = _where(args)
    if isinstance(where, FleetSettings):
        return asyncio.run(_run_fleet(args, where))
    return _run_file(args, where)


async def _run_fleet(args: argparse.Namespace, fleet: FleetSettings) -> int:
    """`kvstore tenant ACTION` on the fleet's table in etcd (kvstore.fleet.tables)."""
    from kvstore.fleet.membership import session_for
    from kvstore.fleet.tables import create_token, read_tokens, revoke_tokens

    session = session_for(fleet)
    place = f"etcd {fleet.etcd} (fleet {fleet.cluster!r})"
    try:
        if args.action == "create":
            record, token = await create_token(session, fleet.cluster, args.tenant,
                                               parse_rights(args.rights, admin=args.admin))
            return _created(args, record, token, place, "every node of the fleet takes it within a second")
        if args.action == "revoke":
            return _revoked(args, await revoke_tokens(session, fleet.cluster, args.tenant, args.token_id))
        found, keys = await read_tokens(session, fleet.cluster)
    finally:
        await session.close()
    return _listed(args, [r for r, _ in found] if keys else None, place, f"no tenants in {place}")


def _created(args: argparse.Namespace, record: TokenRecord, token: str, place: str, when: str) -> int:
    if args.json:
        print(json.dumps({"tenant": record.tenant, "token_id": record.token_id, "rights": list(record.rights),
                          "token": token, "tenants_file": place}))
    else:
        print(f"tenant {record.tenant}: token {record.token_id} ({', '.join(record.rights)}) added to {place}; "
              f"shown once below, stored only as a hash ({when})", file=sys.stderr)
        print(token)
    return 0


def _revoked(args: argparse.Namespace, gone: list[TokenRecord]) -> int:
    if args.json:
        print(json.dumps({"revoked": [r.token_id for r in gone], "tenant": args.tenant}))
    else:
        print(f"revoked {counted(len(gone), 'token')} of tenant {args.tenant}: "
              f"{', '.join(r.token_id for r in gone)}")
    return 0


def _run_file(args: argparse.Namespace, path: Path) -> int:
    """`kvstore tenant ACTION` on the tenants file."""
    if args.action == "create":
        record, token = create(path, args.tenant, parse_rights(args.rights, admin=args.admin))
        return _created(args, record, token, str(path), "a running server takes it within auth.reload_s")
    if args.action == "revoke":
        return _revoked(args, revoke(path, args.tenant, args.token_id))
    return _listed(args, read_records(path), str(path), f"no tenants file at {path}")


def _listed(args: argparse.Namespace, found: list[TokenRecord] | None, place: str, none: str) -> int:
    """Print the records (None: no table at all, so auth is off)."""
    records = found or []
    if args.json:
        print(json.dumps({"tenants_file": place, "auth": found is not None, "tokens": [
            {"tenant": r.tenant, "token_id": r.token_id, "rights": list(r.rights), "created_at": r.created_at,
             "revoked_at": r.revoked_at} for r in records]}))
        return 0
    if found is None:
        print(f"{none}: auth is off (loopback serves one tenant without a token)")
        return 0
    rows = [("TENANT", "TOKEN", "RIGHTS", "CREATED", "REVOKED")] + [
        (r.tenant, r.token_id, ",".join(r.rights), r.created_at, r.revoked_at or "-") for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    for row in rows:
        print("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())
    return 0
