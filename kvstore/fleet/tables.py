"""Tables the fleet shares in etcd: the records under one prefix kept current by a watch, and the tenants' tokens.

A fleet keeps its tenants' token hashes, their policies and the audit log in etcd
(docs/FLEET.md, "Shared tables"), so that a token revoked or a policy set through
any node holds on every node within a second. `WatchedPrefix` is the reader each
node keeps: it lists a prefix, then follows `watch_prefix` from the listed
revision + 1, so no change between the two is missed (F22); it parses every
record, skipping a damaged one (logged once per version of the key, counted:
F23); while etcd is away it keeps the rows it last saw, marked stale (logged once
when lost and once when back: F24). Writers change a record only if its mod
revision is still the one they read (`put_if`, one etcd transaction), so two
admins through two nodes never lose each other's update (F25).

The tenants' table in etcd is one key per token, `/kvstore/<cluster>/tenants/<token_id>`,
holding the record the tenants file holds (kvstore.api_tokens: the SHA-256 of the
token, never the token): `create_token`, `revoke_tokens`, `read_tokens`, used by
`kvstore tenant` and by the server's token table (gateway.shared_tables).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType
from typing import Any, Generic, TypeVar

import aetcd
from aetcd import transactions as txn

from kvstore.api_tokens import (
    TokenRecord,
    check_rights,
    check_tenant,
    issue,
    now_stamp,
    record_from_json,
    record_to_json,
)
from kvstore.errors import DeadlineExceeded, FailedPrecondition, NotFound
from kvstore.fleet.endpoints import tenants_prefix, token_key
from kvstore.fleet.etcd import EtcdSession, follow_prefix, stop_task

log = logging.getLogger(__name__)
T = TypeVar("T")
#: How many times a writer retries a transaction whose compare failed (another writer got there first).
CAS_RETRIES = 16


@dataclass(frozen=True, kw_only=True)
class Row(Generic[T]):
    """One parsed record and the etcd revision it was last written at (what a compare-and-set compares)."""

    value: T
    mod_revision: int


class WatchedPrefix(Generic[T]):
    """The parsed records under `prefix`, by the rest of their key, kept current from etcd's watch.

    Args:
        session: the etcd session (closed by `close`).
        prefix: the keys' common prefix.
        parse: the record of (name, value); raises ValueError for a damaged one.
        table: the table's name in logs and metrics ("tenants", "policies").
        keep_last_good: a damaged new version of a key keeps the key's last good row (policies: a tenant
            never falls back to shorter defaults) instead of dropping it (tokens: a damaged one is refused).
        retry_s: seconds between attempts to reach etcd again while it is away.
        on_change: called (on the loop) after every change of the rows.
    """

    def __init__(self, session: EtcdSession, prefix: bytes, parse: Callable[[str, bytes], T], *, table: str,
                 keep_last_good: bool = False, retry_s: float = 1.0,
                 on_change: Callable[[], None] | None = None) -> None:
        self.session = session
        self.prefix = prefix
        self.parse = parse
        self.table = table
        self.keep_last_good = keep_last_good
        self.retry_s = retry_s
        self.on_change = on_change
        self._rows: Mapping[str, Row[T]] = MappingProxyType({})
        self._names: frozenset[str] = frozenset()
        self._revision = 0
        self._stale_since: float | None = None
        #: Versions of keys whose record was skipped as damaged: each is logged and counted once.
        self._reported: set[tuple[str, int]] = set()
        #: Wall-clock time of the last change applied (or of the first load).
        self.last_change_s = 0.0
        self._changed = asyncio.Condition()
        self._task: asyncio.Task[None] | None = None

    @property
    def rows(self) -> Mapping[str, Row[T]]:
        """name -> row of every parsable record, as last seen (an immutable snapshot, replaced on change)."""
        return self._rows

    @property
    def names(self) -> frozenset[str]:
        """Every name under the prefix, damaged records' too (a table with only damaged records exists)."""
        return self._names

    @property
    def revision(self) -> int:
        """The etcd revision the rows reflect."""
        return self._revision

    @property
    def stale(self) -> bool:
        """Whether etcd is out of reach, so the rows are the last seen, not necessarily today's (F24)."""
        return self._stale_since is not None

    @property
    def skipped(self) -> int:
        """Versions of records skipped as damaged since the table was opened."""
        return len(self._reported)

    def _parse(self, name: str, value: bytes, mod_revision: int) -> T | None:
        try:
            return self.parse(name, value)
        except ValueError as exc:
            if (name, mod_revision) not in self._reported:
                self._reported.add((name, mod_revision))
                kept = " (its last good version stays)" if self.keep_last_good and name in self._rows else ""
                log.error("fleet: skipped the damaged %s record %s%s (revision %d)%s: %s", self.table,
                          self.prefix.decode(), name, mod_revision, kept, exc)
            return None

    async def load(self) -> int:
        """Read every record now; the revision read at.

        Raises:
            Unavailable: etcd does not answer at any endpoint.
        """
        found = await self.session.call(lambda c: c.get_prefix(self.prefix))
        rows: dict[str, Row[T]] = {}
        names = set()
        for kv in found:
            name = kv.key[len(self.prefix):].decode(errors="replace")
            names.add(name)
            value = self._parse(name, kv.value, kv.mod_revision)
            if value is not None:
                rows[name] = Row(value=value, mod_revision=kv.mod_revision)
            elif self.keep_last_good and name in self._rows:
                rows[name] = self._rows[name]
        await self._publish(rows, names, found.header.revision, stale=False)
        return int(found.header.revision)

    async def start(self) -> None:
        """Load, then follow the watch in the background (`close` ends it).

        Raises:
            Unavailable: etcd does not answer at any endpoint (nothing was started).
        """
        revision = await self.load()
        self.follow(revision)

    def follow(self, revision: int) -> None:
        """Follow the watch from `revision + 1` in a task of the running loop."""
        self._task = asyncio.get_running_loop().create_task(self._follow(revision), name=f"fleet-{self.table}")

    async def _publish(self, rows: Mapping[str, Row[T]], names: set[str] | frozenset[str], revision: int, *,
                       stale: bool) -> None:
        changed = rows != self._rows
        self._rows = MappingProxyType(dict(rows))
        self._names = frozenset(names)
        self._revision = max(self._revision, revision)
        if not stale:
            self._stale_since = None
        elif self._stale_since is None:
            self._stale_since = time.monotonic()
        if changed or not self.last_change_s:
            self.last_change_s = time.time()
            if self.on_change is not None:
                self.on_change()
        async with self._changed:
            self._changed.notify_all()

    async def _follow(self, revision: int) -> None:
        """Apply watch events; on any failure mark the rows stale, then reload and watch again when etcd answers."""
        await follow_prefix(self.session, self.prefix, revision, apply=self._apply, lost=self._lost,
                            reload=self._reloaded, retry_s=self.retry_s)

    async def _lost(self, exc: Exception) -> None:
        # Once per outage: the retries say nothing until etcd answers.
        log.warning("fleet: lost etcd's watch of the %s table %s (%s); serving the %d records last "
                    "seen until etcd answers; changes to it are refused meanwhile", self.table,
                    self.prefix.decode(), exc, len(self._rows))
        await self._publish(self._rows, self._names, self._revision, stale=True)

    async def _reloaded(self) -> int:
        revision = await self.load()
        log.warning("fleet: etcd answers again; the %s table is current (%d records)", self.table, len(self._rows))
        return revision

    async def _apply(self, event: aetcd.Event) -> None:
        name = event.kv.key[len(self.prefix):].decode(errors="replace")
        rows, names = dict(self._rows), set(self._names)
        known = rows.get(name)
        if known is not None and known.mod_revision > event.kv.mod_revision:
            return  # older than what this node wrote itself (`note`): the event of its own write follows
        if event.kind == aetcd.EventKind.PUT:
            names.add(name)
            value = self._parse(name, event.kv.value, event.kv.mod_revision)
            if value is not None:
                rows[name] = Row(value=value, mod_revision=event.kv.mod_revision)
            elif not self.keep_last_good:
                rows.pop(name, None)
        else:
            names.discard(name)
            rows.pop(name, None)
        await self._publish(rows, names, event.kv.mod_revision, stale=False)

    async def note(self, name: str, value: T, mod_revision: int) -> None:
        """Apply this node's own write, done at `mod_revision`, before the watch brings it: a reader of
        this node sees a change once the call that made it has answered (the watch's event is the same)."""
        known = self._rows.get(name)
        if known is not None and known.mod_revision >= mod_revision:
            return
        await self._publish({**self._rows, name: Row(value=value, mod_revision=mod_revision)},
                            self._names | {name}, self._revision, stale=self.stale)

    async def wait_until(self, predicate: Callable[[WatchedPrefix[T]], bool], timeout_s: float) -> None:
        """Return once `predicate(self)` holds (checked now and after every change).

        Raises:
            DeadlineExceeded: it did not hold within `timeout_s`.
        """
        async with self._changed:
            try:
                await asyncio.wait_for(self._changed.wait_for(lambda: predicate(self)), timeout_s)
            except TimeoutError:
                raise DeadlineExceeded(f"the {self.table} table did not reach the awaited state within "
                                       f"{timeout_s:g} s (revision {self._revision}, stale={self.stale})") from None

    async def close(self) -> None:
        """Stop following and close the session."""
        if self._task is not None:
            await stop_task(self._task)  # again while a cancel is lost (aetcd)
            self._task = None
        await self.session.close()


@dataclass(frozen=True, kw_only=True)
class PutIf:
    """What `put_if` did: written at `revision`, or not, and then the key as another writer left it."""

    written: bool
    #: The etcd revision of the write (0 when not written).
    revision: int = 0
    #: When not written: the key's value now (None: it is absent) and its mod revision (0: absent).
    value: bytes | None = None
    mod_revision: int = 0


async def put_if(session: EtcdSession, key: bytes, value: bytes, *, mod_revision: int,
                 also: Sequence[Any] = ()) -> PutIf:
    """Put `value` at `key` only if the key's mod revision is still `mod_revision` (0: the key is absent),
    with the operations `also` (aetcd.transactions.Put, ...) in the same transaction (F25).

    When it is not written another writer changed the key first: check the change again against the
    value returned, and retry with its mod revision.

    Raises:
        Unavailable: etcd does not answer at any endpoint (nothing was written).
    """
    async def cas(c: aetcd.Client) -> tuple[bool, list[Any]]:
        return await c.transaction(compare=[txn.Mod(key) == mod_revision],
                                   success=[txn.Put(key, value), *also], failure=[txn.Get(key)])

    done, responses = await session.call(cas)
    if done:
        return PutIf(written=True, revision=int(responses[0].response_put.header.revision))
    found = responses[0][0] if responses and responses[0] else None
    if found is None:
        return PutIf(written=False)
    return PutIf(written=False, value=found[0], mod_revision=int(found[1].mod_revision))


# -- the tenants' tokens --------------------------------------------------------


def token_parser(cluster: str) -> Callable[[str, bytes], TokenRecord]:
    """The parser of the token records of `cluster`: every field checked, and named by its own key."""
    prefix = tenants_prefix(cluster).decode()

    def parse(name: str, value: bytes) -> TokenRecord:
        record = record_from_json(value, f"{prefix}{name}")
        if record.token_id != name:
            raise ValueError(f"token record {prefix}{name} names token {record.token_id!r}")
        return record

    return parse


async def read_tokens(session: EtcdSession, cluster: str) -> tuple[list[tuple[TokenRecord, int]], int]:
    """(record, mod revision) of every parsable token of `cluster`, in key order, and how many keys there are.

    Raises:
        Unavailable: etcd does not answer at any endpoint.
    """
    prefix = tenants_prefix(cluster)
    parse = token_parser(cluster)
    found = await session.call(lambda c: c.get_prefix(prefix))
    records = []
    keys = 0
    for kv in found:
        keys += 1
        try:
            records.append((parse(kv.key[len(prefix):].decode(errors="replace"), kv.value), int(kv.mod_revision)))
        except ValueError as exc:
            log.error("fleet: skipped the damaged token record %s: %s", kv.key.decode(errors="replace"), exc)
    return records, keys


async def create_token(session: EtcdSession, cluster: str, tenant: str,
                       rights: frozenset[str]) -> tuple[TokenRecord, str]:
    """Issue a token for `tenant` in the fleet's table: its record is created only where no token has its id.

    Returns:
        The stored record and the token, shown once and kept nowhere.

    Raises:
        InvalidArgument: a bad tenant name or rights.
        Unavailable: etcd does not answer at any endpoint (no token was issued).
    """
    check_tenant(tenant)
    rights = check_rights(rights)
    for _ in range(CAS_RETRIES):
        record, token = issue(tenant, rights)
        if (await put_if(session, token_key(cluster, record.token_id), record_to_json(record),
                         mod_revision=0)).written:
            return record, token
    raise FailedPrecondition(f"no free token id after {CAS_RETRIES} tries", hint="retry")


async def revoke_tokens(session: EtcdSession, cluster: str, tenant: str,
                        token_id: str | None = None) -> list[TokenRecord]:
    """Revoke every active token of `tenant` (or only `token_id`) in one transaction; revoked records stay listed.

    The transaction compares each record's mod revision, so a token created or changed meanwhile is
    read again, never overwritten with an older version.

    Raises:
        NotFound: no active token matched.
        Unavailable: etcd does not answer at any endpoint (nothing was revoked).
    """
    for _ in range(CAS_RETRIES):
        records, _ = await read_tokens(session, cluster)
        hits = [(r, mod) for r, mod in records if r.tenant == tenant and r.active and token_id in (None, r.token_id)]
        if not hits:
            what = f"token {token_id} of tenant {tenant!r}" if token_id else f"tenant {tenant!r}"
            raise NotFound(f"no active {what} in etcd's tenants table of fleet {cluster!r}",
                           hint="`kvstore tenant list` shows them")
        stamp = now_stamp()
        revoked = [replace(r, revoked_at=stamp) for r, _ in hits]
        compare = [txn.Mod(token_key(cluster, r.token_id)) == mod for r, mod in hits]
        puts = [txn.Put(token_key(cluster, r.token_id), record_to_json(r)) for r in revoked]

        async def revoke(c: aetcd.Client, compare: list[Any] = compare, puts: list[Any] = puts) -> tuple[bool, Any]:
            return await c.transaction(compare=compare, success=puts, failure=[])

        done, _ = await session.call(revoke)
        if done:
            return revoked
    raise FailedPrecondition(f"the tokens of tenant {tenant!r} kept changing while revoking them ({CAS_RETRIES} tries)",
                  hint="retry")
