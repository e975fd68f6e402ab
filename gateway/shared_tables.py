"""A fleet's shared tables in etcd: the tenants' tokens, their policies and the audit log (docs/FLEET.md).

With `[fleet] etcd` set, a node keeps none of these in its data dir: every node
reads them from etcd and follows its watch (kvstore.fleet.tables.WatchedPrefix),
so a token revoked or a policy set through any node holds on every node within
a second. Each is one implementation of the seam the server already has:
`EtcdTenants` of gateway.tenants.TokenTable (auth), `EtcdPolicies` of
gateway.policies.PolicyTable and `EtcdAudit` of gateway.audit.AuditTrail (the
Admin service). Without `[fleet] etcd` the data dir's files serve, unchanged, and
aetcd is never imported.

Keys (kvstore.fleet.endpoints): `/kvstore/<cluster>/tenants/<token_id>` (one
token's record: its SHA-256, never the token), `/kvstore/<cluster>/policies/<tenant>`
(a tenant's own fields) and `.../policies/.defaults` (the retention floor),
`/kvstore/<cluster>/audit/<time_ns>-<random>` (one entry, bounded to the last
`AUDIT_MAX_ENTRIES`). A policy change and its audit entry are one transaction,
which compares the policy's mod revision: no lost update, and no change without
its entry. While etcd is away each table serves the rows it last saw (marked
stale: a log line and `kvstore_fleet_table_current` 0) and every write is refused
with UNAVAILABLE naming etcd's endpoints.

Migration: a node of a fleet whose data dir still holds tenants.json or
admin/policies.json imports it once, when etcd holds none of that table, and sets
the file aside (`<name>.imported`); beside a table etcd already holds, the file is
refused at start with one line (`import_file_once`).
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from aetcd import transactions as txn
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from gateway.admin_servicer import ADMIN_DIR, AdminParts, admin_parts
from gateway.audit import AuditEntry, AuditTrail, entry_json, log_entry, parse_entry
from gateway.policies import POLICIES_NAME, Policy, PolicyTable, changed_fields, check_floor, parse_fields, read_file
from gateway.tenants import Identity, identities, lookup
from kvstore.api_tokens import TokenRecord, read_records, record_to_json
from kvstore.clock import Clock, SystemClock
from kvstore.config import Settings
from kvstore.errors import ConfigError, FailedPrecondition
from kvstore.fleet.endpoints import (
    POLICY_DEFAULTS,
    audit_prefix,
    imported_key,
    policies_prefix,
    policy_key,
    tenants_prefix,
    token_key,
)
from kvstore.fleet.etcd import EtcdSession
from kvstore.fleet.membership import read_nodes, session_for
from kvstore.fleet.tables import CAS_RETRIES, WatchedPrefix, put_if, read_tokens, token_parser

log = logging.getLogger("kvstore.fleet")

#: Entries the audit log in etcd keeps: after each append the oldest past this are deleted (F28). An entry
#: is a few hundred bytes, so about 3 MB of etcd's space.
AUDIT_MAX_ENTRIES = 10_000


def _where(session: EtcdSession, prefix: bytes) -> str:
    return f"etcd {', '.join(str(e) for e in session.endpoints)} {prefix.decode()}"


# -- tokens ---------------------------------------------------------------------------------------------------


class EtcdTenants:
    """The fleet's tenants' tokens, from etcd, kept current by its watch (a gateway.tenants.TokenTable).

    Auth is on once any record is under the prefix (or `required`), and stays on while the
    server runs, as with the file. A damaged record is skipped: that token is refused (F23).

    Args:
        table: the watched prefix of token records (loaded).
        required: auth on even while etcd holds no token.
    """

    def __init__(self, table: WatchedPrefix[TokenRecord], *, required: bool = False) -> None:
        self.table = table
        self.enabled = required or bool(table.names)
        self._tokens: dict[bytes, Identity] = {}
        table.on_change = self._rebuild
        self._rebuild()

    def _rebuild(self) -> None:
        if self.table.names and not self.enabled:
            log.warning("fleet: tokens appeared in %s: auth is on, every call needs a token from now on",
                        self.describe())
            self.enabled = True
        self._tokens = identities([row.value for row in self.table.rows.values()])

    @property
    def tenants(self) -> frozenset[str]:
        """Tenants with at least one active token."""
        return frozenset(i.tenant for i in self._tokens.values())

    def find(self, token: str) -> Identity | None:
        """The identity of `token`, or None when it is unknown or revoked (gateway.tenants.lookup)."""
        return lookup(self._tokens, token)

    def describe(self) -> str:
        """etcd's endpoints and the table's prefix."""
        return _where(self.table.session, self.table.prefix)

    def start(self, every_s: float) -> None:
        """Follow etcd's watch from the revision loaded (`every_s` is the file's poll: a watch needs none)."""
        self.table.follow(self.table.revision)

    async def stop(self) -> None:
        """Stop following and close the session."""
        await self.table.close()


def tokens_watch(session: EtcdSession, cluster: str) -> WatchedPrefix[TokenRecord]:
    """The token records' table of `cluster` (not loaded): a damaged record is dropped, so its token is refused."""
    return WatchedPrefix(session, tenants_prefix(cluster), token_parser(cluster), table="tenants")


async def open_fleet_tenants(settings: Settings) -> EtcdTenants:
    """The fleet's token table, loaded (after importing the data dir's tenants file once: `import_file_once`).

    Raises:
        Unavailable: etcd does not answer (the node does not start, as F14).
        ConfigError: the data dir's tenants file is damaged, or etcd already holds tokens beside it.
    """
    fleet = settings.fleet
    session = session_for(fleet)
    table = tokens_watch(session, fleet.cluster)
    try:
        path = settings.auth.tenants_path(settings.store.data_dir)
        records = read_records(path)
        if records is not None:
            await import_file_once(session, fleet.cluster, "tenants", path,
                                   [(token_key(fleet.cluster, r.token_id), record_to_json(r)) for r in records],
                                   held=(await read_tokens(session, fleet.cluster))[1])
        await table.load()
    except BaseException:
        await session.close()
        raise
    return EtcdTenants(table, required=settings.auth.required)


# -- migration ------------------------------------------------------------------------------------------------


async def import_file_once(session: EtcdSession, cluster: str, name: str, path: Path,
                           records: list[tuple[bytes, bytes]], *, held: int) -> None:
    """Import a data dir's `name` file (its records as (key, value)) into an etcd that holds none of that
    table, once for the cluster, then set the file aside as `<file>.imported` (F27).

    The import is claimed by a marker key written only where absent, naming this host; each record is
    created only where its key is absent, so an import resumed after a crash never overwrites what etcd
    holds (a token revoked since stays revoked).

    Raises:
        ConfigError: etcd already holds the table (`held` records) or another host imported it: the
            file beside it is refused, naming it and what to do.
        Unavailable: etcd does not answer.
    """
    marker = imported_key(cluster, name)
    claim = json.dumps({"host": socket.gethostname(), "file": str(path), "records": len(records),
                        "time_s": time.time()}).encode()
    written = await put_if(session, marker, claim, mod_revision=0) if not held else None
    if written is None or not written.written:
        found = await session.call(lambda c: c.get(marker))
        try:
            theirs = json.loads(found.value) if found is not None else {}
        except ValueError:  # a damaged marker claims nothing for this host: refused below
            theirs = {}
        ours = isinstance(theirs, dict) and theirs.get("host") == socket.gethostname() \
            and theirs.get("file") == str(path)
        if not ours:  # only this host's own unfinished import of this file is resumed
            raise ConfigError(
                f"{path} holds {name} for a single node, but fleet {cluster!r} keeps its {name} in etcd "
                f"({held} records there): its records would be served by this node alone, or undo changes "
                "made through the fleet",
                hint=f"move {path} away (etcd's table is the fleet's), and recreate what it held that the "
                     "fleet lacks through any node (kvstore tenant / kvstore policy)")
    for key, value in records:
        await put_if(session, key, value, mod_revision=0)  # absent keys only: never undo a fleet's change
    aside = path.with_name(path.name + ".imported")
    os.replace(path, aside)
    log.warning("fleet: imported %d %s records of %s into etcd for fleet %r; the file is set aside as %s",
                len(records), name, path, cluster, aside)


# -- the audit log --------------------------------------------------------------------------------------------


class EtcdAudit(AuditTrail):
    """The fleet's audit log in etcd: one key per entry, in time order by key, the last `max_entries` kept.

    Args:
        session: shared with the policies' table (the log has no watch of its own).
        cluster: the fleet's name.
        clock: the time written into each entry.
        max_entries: entries kept; older ones are deleted after each append (F28).
    """

    def __init__(self, session: EtcdSession, cluster: str, *, clock: Clock | None = None,
                 max_entries: int = AUDIT_MAX_ENTRIES) -> None:
        self.session = session
        self.prefix = audit_prefix(cluster)
        self.clock: Clock = clock or SystemClock()
        self.max_entries = max_entries
        #: Keys of damaged entries already logged (each is logged once).
        self._reported: set[bytes] = set()

    def entry(self, *, actor: str, action: str, tenant: str, old: Any, new: Any) -> AuditEntry:
        """An entry stamped now."""
        return AuditEntry(time_s=self.clock.now(), actor=actor, action=action, tenant=tenant, old=old, new=new)

    def put_op(self, entry: AuditEntry) -> Any:
        """The transaction operation that writes `entry` (under a key that orders by its time)."""
        key = self.prefix + f"{int(entry.time_s * 1e9):020d}-{secrets.token_hex(4)}".encode()
        return txn.Put(key, entry_json(entry))

    async def written(self, entry: AuditEntry) -> None:
        """After `entry` was written: log it, and trim the log to its bound."""
        log_entry(entry)
        await self.trim()

    async def record(self, *, actor: str, action: str, tenant: str, old: Any, new: Any) -> AuditEntry:
        """Write one entry to etcd before returning it.

        Raises:
            Unavailable: etcd does not answer (the entry is not written).
        """
        entry = self.entry(actor=actor, action=action, tenant=tenant, old=old, new=new)
        op = self.put_op(entry)
        await self.session.call(lambda c: c.transaction(compare=[], success=[op], failure=[]))
        await self.written(entry)
        return entry

    async def trim(self) -> None:
        """Delete the oldest entries past `max_entries` (a failure is logged: the next append trims)."""
        try:
            found = await self.session.call(lambda c: c.get_prefix(self.prefix, keys_only=True))
            keys = [kv.key for kv in found]
            excess = len(keys) - self.max_entries
            if excess > 0:
                await self.session.call(lambda c: c.delete_range(self.prefix, keys[excess]))
        except Exception as exc:  # the entry is written; keeping the bound can wait for the next append
            log.warning("fleet: could not trim the audit log %s to %d entries: %s", self.prefix.decode(),
                        self.max_entries, exc)

    async def read(self, *, tenant: str = "", limit: int = 0) -> list[AuditEntry]:
        """The entries, oldest first; a damaged one is skipped, logged once.

        Raises:
            Unavailable: etcd does not answer.
        """
        found = await self.session.call(lambda c: c.get_prefix(self.prefix))
        out = []
        for kv in found:
            entry = parse_entry(kv.value)
            if entry is None:
                if kv.key not in self._reported:
                    self._reported.add(kv.key)
                    log.warning("fleet: the audit entry %s is damaged: skipped", kv.key.decode(errors="replace"))
            elif not tenant or entry.tenant == tenant:
                out.append(entry)
        return out[-limit:] if limit else out

    async def check_writable(self) -> None:
        """One read of etcd: a purge, export or import is refused before it starts while etcd is away.

        Raises:
            Unavailable: etcd does not answer.
        """
        await self.session.call(lambda c: c.get(self.prefix))

    def close(self) -> None:
        """Nothing: the session is the policies' (closed with them)."""


# -- policies -------------------------------------------------------------------------------------------------


def _parse_policy(name: str, value: bytes) -> dict[str, Any]:
    """A tenant's own fields, or the defaults' record (`.defaults`), every value checked as in the file."""
    try:
        raw = json.loads(value)
    except (ValueError, RecursionError) as exc:
        raise ValueError(f"not JSON ({type(exc).__name__})") from None
    if name == POLICY_DEFAULTS:
        if not isinstance(raw, dict) or set(raw) != {"retention_floor_hours"}:
            raise ValueError("the defaults' record is not {\"retention_floor_hours\": hours}")
        return {"retention_floor_hours": check_floor(raw["retention_floor_hours"])}
    return parse_fields(name, raw)


def policies_watch(session: EtcdSession, cluster: str) -> WatchedPrefix[dict[str, Any]]:
    """The policies' table of `cluster` (not loaded): a damaged new version keeps the last good one, so a
    tenant never falls back to the defaults' (maybe shorter) retention while the node serves."""
    return WatchedPrefix(session, policies_prefix(cluster), _parse_policy, table="policies", keep_last_good=True)


class EtcdPolicies(PolicyTable):
    """The fleet's tenants' policies, from etcd, kept current by its watch; changes by compare-and-set.

    Args:
        table: the watched prefix of policies (loaded).
        cluster: the fleet's name.
        configured: the defaults of this node's configuration; the floor in etcd may raise their retention.
        max_swa_ttl_s: the pool's TTL.
        audit: the fleet's audit log (each change's entry is written in the change's transaction).
    """

    fleet = True

    def __init__(self, table: WatchedPrefix[dict[str, Any]], *, cluster: str, configured: Policy,
                 max_swa_ttl_s: float, audit: EtcdAudit) -> None:
        super().__init__(defaults=configured, max_swa_ttl_s=max_swa_ttl_s)
        self.table = table
        self.cluster = cluster
        self.audit = audit
        table.on_change = self._rebuild
        self._rebuild()

    def _rebuild(self) -> None:
        """The tenants' policies from the rows (readers on other threads see the old dict or the new one)."""
        rows = self.table.rows
        floor_row = rows.get(POLICY_DEFAULTS)
        floor = max(self.defaults.retention_hours, floor_row.value["retention_floor_hours"] if floor_row else 0.0)
        if floor != self.defaults.retention_hours:  # only raised: a new object only then (`before is defaults`)
            self.defaults = Policy(**{**self.defaults.to_dict(), "retention_hours": floor})
        own = {name: dict(row.value) for name, row in rows.items() if name != POLICY_DEFAULTS}
        self._set = own
        self._own = {name: self._apply(fields) for name, fields in own.items()}

    def _current(self, tenant: str, value: bytes | None) -> dict[str, Any] | None:
        """The tenant's own fields as another writer left them (None: on the defaults); over a damaged
        record, the last good fields this node saw (the change then repairs it)."""
        if value is None:
            return None
        try:
            return _parse_policy(tenant, value)
        except ValueError as exc:
            row = self.table.rows.get(tenant)
            log.error("fleet: the policy of tenant %r in etcd is damaged (%s): the change is checked against the "
                      "last good one and replaces it", tenant, exc)
            return None if row is None else dict(row.value)

    async def replication_note(self, tenant: str, policy: Policy) -> str:
        """A replication above the nodes live now (etcd's count): what is done meanwhile (F51)."""
        if policy.replication <= 1:
            return ""
        nodes, _ = await read_nodes(self.table.session, self.cluster)
        live = len(nodes)
        if live >= policy.replication:
            return ""
        return (f"tenant {tenant!r}: {policy.replication} copies of each run asked, {live} node"
                f"{'s' if live != 1 else ''} live now: each run is kept on {max(live, 1)} until more nodes join, "
                "then copied to them (re-replication)")

    async def change(self, tenant: str, changes: Mapping[str, float], *, actor: str) -> tuple[Policy, Policy]:
        """Change, audit in the same transaction, compared on the policy's mod revision (F25, F26).

        Raises:
            InvalidArgument, FailedPrecondition: as PolicyTable.change (checked against the newest policy).
            Unavailable: etcd does not answer (nothing changed).
        """
        from kvstore.api_tokens import check_tenant

        tenant = check_tenant(tenant)
        key = policy_key(self.cluster, tenant)
        row = self.table.rows.get(tenant)
        fields = None if row is None else dict(row.value)
        mod = 0 if row is None else row.mod_revision
        for _ in range(CAS_RETRIES):
            before, after, new_fields = self._plan(tenant, changes, fields)
            if after == before:
                return before, after
            old, new = changed_fields(before, after)
            entry = self.audit.entry(actor=actor, action="set_policy", tenant=tenant, old=old, new=new)
            done = await put_if(self.table.session, key, json.dumps(new_fields, sort_keys=True).encode(),
                                mod_revision=mod, also=[self.audit.put_op(entry)])
            if done.written:
                await self.table.note(tenant, new_fields, done.revision)
                await self.audit.written(entry)
                return before, after
            fields, mod = self._current(tenant, done.value), done.mod_revision  # another admin got there first
        raise FailedPrecondition(f"the policy of tenant {tenant!r} kept changing under {CAS_RETRIES} tries",
                                 hint="retry")

    async def raise_floor(self, hours: float) -> None:
        """Record `hours` as the defaults' retention floor unless etcd holds a higher one (P2, fleet-wide).

        Raises:
            Unavailable: etcd does not answer.
        """
        key = policies_prefix(self.cluster) + POLICY_DEFAULTS.encode()
        row = self.table.rows.get(POLICY_DEFAULTS)
        stored, mod = (row.value["retention_floor_hours"], row.mod_revision) if row else (0.0, 0)
        for _ in range(CAS_RETRIES):
            if stored >= hours:
                return
            done = await put_if(self.table.session, key, json.dumps({"retention_floor_hours": hours}).encode(),
                                mod_revision=mod)
            if done.written:
                await self.table.note(POLICY_DEFAULTS, {"retention_floor_hours": hours}, done.revision)
                return
            current = self._current(POLICY_DEFAULTS, done.value) or {}
            stored, mod = float(current.get("retention_floor_hours", 0.0)), done.mod_revision
        raise FailedPrecondition("the fleet's retention floor kept changing", hint="retry")

    async def close(self) -> None:
        """Stop following and close the session (the audit log's too)."""
        await self.table.close()


async def open_fleet_admin(settings: Settings, *, clock: Clock | None = None,
                           audit_max_entries: int = AUDIT_MAX_ENTRIES) -> AdminParts:
    """The fleet's policies and audit log in etcd, loaded and followed, and the quota interceptor on them.

    Raises:
        Unavailable: etcd does not answer.
        ConfigError: a policy in etcd is damaged (serving on the defaults could shorten a tenant's
            retention), or the data dir's policies file is damaged or lies beside a table etcd holds.
    """
    clock = clock or SystemClock()
    fleet = settings.fleet
    session = session_for(fleet)
    prefix = policies_prefix(fleet.cluster)
    table = policies_watch(session, fleet.cluster)
    audit = EtcdAudit(session, fleet.cluster, clock=clock, max_entries=audit_max_entries)
    configured = Policy(retention_hours=settings.store.retention_hours, swa_ttl_s=settings.swa.ttl_s,
                        pin_max_hours=settings.store.pin_max_hours, pin_budget_bytes=settings.store.pin_budget_bytes,
                        replication=fleet.replication)
    try:
        await table.load()
        path = settings.store.data_dir / ADMIN_DIR / POLICIES_NAME
        saved = read_file(path)
        if saved:
            records = [(policy_key(fleet.cluster, name), json.dumps(fields, sort_keys=True).encode())
                       for name, fields in saved["tenants"].items()]
            await import_file_once(session, fleet.cluster, "policies", path, records,
                                   held=len(table.names - {POLICY_DEFAULTS}))
            await table.load()
        damaged = sorted(table.names - set(table.rows))
        if damaged:
            raise ConfigError(f"tenant policies in etcd at {prefix.decode()}{damaged[0]} are damaged "
                              f"({len(damaged)} records; the log says why)",
                              hint="put a valid record back with etcdctl (deleting it puts the tenant on the "
                                   "defaults, a shorter retention for some)")
        policies = EtcdPolicies(table, cluster=fleet.cluster, configured=configured,
                                max_swa_ttl_s=settings.swa.ttl_s, audit=audit)
        floor = max(configured.retention_hours, float(saved.get("retention_floor_hours", 0.0)))
        await policies.raise_floor(floor)
        if policies.defaults.retention_hours > configured.retention_hours:
            log.warning("store.retention_hours is %g but fleet %r was served with %g: tenants on the defaults keep "
                        "%g h (retention is only raised)", configured.retention_hours, fleet.cluster,
                        policies.defaults.retention_hours, policies.defaults.retention_hours)
        table.follow(table.revision)
    except BaseException:
        await session.close()
        raise
    return admin_parts(settings, policies, audit, clock=clock)


# -- metrics --------------------------------------------------------------------------------------------------


class SharedTablesCollector(Collector):
    """How the shared tables follow etcd, read at scrape time (docs/FLEET.md, "Shared tables").

    Args:
        tables: the watched prefixes by table name.
    """

    def __init__(self, tables: Callable[[], Mapping[str, WatchedPrefix[Any]]]) -> None:
        self.tables = tables

    def describe(self) -> list[Metric]:
        """Nothing: the values are read at each scrape."""
        return []

    def collect(self) -> Iterator[Metric]:
        tables = self.tables()
        current = GaugeMetricFamily("kvstore_fleet_table_current",
                                    "1 while the table follows etcd's watch, 0 while etcd is out of reach (the "
                                    "last rows seen are served; changes are refused).", labels=["table"])
        skipped = CounterMetricFamily("kvstore_fleet_table_skipped_records",
                                      "Versions of records in etcd skipped as damaged.", labels=["table"])
        changed = GaugeMetricFamily("kvstore_fleet_table_last_change_timestamp_seconds",
                                    "Wall-clock time the table last changed (or was loaded).", labels=["table"])
        for name, table in sorted(tables.items()):
            current.add_metric([name], 0.0 if table.stale else 1.0)
            skipped.add_metric([name], table.skipped)
            changed.add_metric([name], table.last_change_s)
        yield current
        yield skipped
        yield changed
