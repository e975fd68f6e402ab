"""The server's view of the tenants file: token hash -> who the caller is.

The file (kvstore.api_tokens) is read at start and re-read by a background task
when its size, inode or modification time changes, every `auth.reload_s`: a
`kvstore tenant create` or `revoke` takes effect without a restart, and no call
ever reads a file. A call costs one SHA-256 of its token and one dict lookup.

Auth is on once the file exists (even with every token revoked: revoking the
last token must not open the store) or when `auth.required` says so. A file
that disappears or breaks while the server runs keeps auth on: a vanished file
accepts no token, a damaged one keeps the last good table (and says so in the log).

The reload never stops (issue 29): whatever the file holds (binary, truncated,
JSON of the wrong shape, a folder, gone and back), a read that fails keeps the
last table and is logged once per version of the file (not once a poll), and
the watch loop itself logs and goes on past any exception. `status()` says when
the table was last loaded and how many loads failed (the metrics
`kvstore_tenants_last_load_timestamp_seconds`, `kvstore_tenants_load_failures_total`,
`kvstore_tenants_file_ok` and `kvstore_tenants_file_checks_total`, docs/METRICS.md).

`TokenTable` is what auth asks of a tenants table: this file's `TenantRegistry`, or in
a fleet (`[fleet] etcd` set) `gateway.shared_tables.EtcdTenants`, the tokens in etcd
that every node follows (docs/FLEET.md, "Shared tables").
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from kvstore.api_tokens import TokenRecord, read_records, token_hash
from kvstore.clock import Clock, SystemClock
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.auth")


@dataclass(frozen=True, slots=True)
class Identity:
    """What a valid token says: its tenant, rights and id."""

    tenant: str
    rights: frozenset[str]
    token_id: str
    digest: bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class LoadStatus:
    """How the tenants file's reloads went."""

    #: Wall-clock time of the last load that replaced the table (a read that parsed, or the file found gone).
    last_load_s: float
    #: Loads that failed since the server started: each damaged version of the file once, each other error once.
    failures: int
    #: Whether the table is the file's current content (False while a damaged file is on disk, or while
    #: the reload fails).
    file_ok: bool
    #: Checks the watch loop made (one a tick, whatever their outcome): it stops growing only if the loop died.
    checks: int


class TokenTable(Protocol):
    """What auth asks of a tenants table: `TenantRegistry` (the data dir's file) or, in a fleet,
    `gateway.shared_tables.EtcdTenants` (etcd, docs/FLEET.md)."""

    #: Whether calls must carry a token (once on, on for as long as the server runs).
    enabled: bool

    @property
    def tenants(self) -> frozenset[str]:
        """Tenants with at least one active token."""

    def find(self, token: str) -> Identity | None:
        """The identity of `token`, or None when it is unknown or revoked."""

    def describe(self) -> str:
        """Where the table lives, for the server's start line."""

    def start(self, every_s: float) -> None:
        """Keep the table current in the background, on the running loop."""

    async def stop(self) -> None:
        """Stop keeping it current."""


def identities(records: list[TokenRecord]) -> dict[bytes, Identity]:
    """The active tokens of `records`, keyed by their SHA-256 digest."""
    table = {}
    for r in records:
        if r.active:
            digest = bytes.fromhex(r.sha256)
            table[digest] = Identity(tenant=r.tenant, rights=frozenset(r.rights), token_id=r.token_id, digest=digest)
    return table


def lookup(tokens: Mapping[bytes, Identity], token: str) -> Identity | None:
    """The identity of `token` in `tokens`, or None when it is unknown or revoked.

    The dict is keyed by the token's SHA-256, so a lookup's timing depends on
    that digest, not on the token: learning digest bits from it tells nothing
    usable about any token (SHA-256 is preimage resistant). The final
    comparison is constant-time all the same.
    """
    digest = token_hash(token)
    identity = tokens.get(digest)
    if identity is None or not hmac.compare_digest(identity.digest, digest):
        return None
    return identity


def _signature(path: Path) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    return st.st_ino, st.st_size, st.st_mtime_ns


class TenantRegistry:
    """The active tokens of the tenants file at `path`, kept current.

    Args:
        path: the tenants file.
        required: auth on even while the file does not exist.
        clock: the wall-clock time `status()` gives for the last load.

    Raises:
        ConfigError: at start, the file exists but cannot be read or parsed.
    """

    def __init__(self, path: Path, *, required: bool = False, clock: Clock | None = None) -> None:
        self.path = path
        self._clock: Clock = clock or SystemClock()
        self._signature = _signature(path)
        records = read_records(path)
        #: Whether calls must carry a token (see the module doc: never turns off while running).
        self.enabled = required or records is not None
        self._tokens: dict[bytes, Identity] = identities(records or [])
        self._task: asyncio.Task[None] | None = None
        self._last_load_s = self._clock.now()
        self._failures = 0
        self._checks = 0
        #: The signature of the file version that failed to load, and why: it is not read (or logged) again.
        self._failed: tuple[tuple[int, int, int] | None, str] | None = None
        #: The exception the last reload raised (None: it returned), logged once while it repeats.
        self._erring: str | None = None

    @property
    def tenants(self) -> frozenset[str]:
        """Tenants with at least one active token."""
        return frozenset(i.tenant for i in self._tokens.values())

    def find(self, token: str) -> Identity | None:
        """The identity of `token`, or None when it is unknown or revoked (`lookup`)."""
        return lookup(self._tokens, token)

    def describe(self) -> str:
        """The tenants file's path."""
        return str(self.path)

    def status(self) -> LoadStatus:
        """When the table was last loaded, and how many loads failed (any thread)."""
        return LoadStatus(last_load_s=self._last_load_s, failures=self._failures,
                          file_ok=self._failed is None and self._erring is None, checks=self._checks)

    def refresh(self) -> bool:
        """Re-read the file if it changed since last read; True when the table changed.

        A damaged file keeps the table as it was: the failure is logged and counted
        once, and that version of the file is not read again (the next change is).
        """
        signature = _signature(self.path)
        if signature == self._signature or (self._failed is not None and self._failed[0] == signature):
            return False
        try:
            records = read_records(self.path)
        except KVStoreError as exc:
            self._fail(signature, exc.message)
            return False
        self._signature = signature
        self._failed = None
        self._last_load_s = self._clock.now()
        if records is None:
            if self.enabled:
                log.warning("tenants file %s is gone: every token is refused until it is back", self.path)
            self._tokens = {}
            return True
        if not self.enabled:
            log.warning("tenants file %s appeared: auth is on, every call needs a token from now on", self.path)
        self.enabled = True
        self._tokens = identities(records)
        log.info("tenants file %s loaded: %d active tokens", self.path, len(self._tokens))
        return True

    def _fail(self, signature: tuple[int, int, int] | None, why: str) -> None:
        """Count and log a failed load (refresh reads each version of the file once: once per damage)."""
        self._failed = (signature, why)
        self._failures += 1
        log.error("kept the previous tenants table (%d active tokens): %s", len(self._tokens), why)

    def _error(self, exc: Exception) -> None:
        """Count and log an exception of a reload once while it repeats (with its traceback: it is unforeseen)."""
        why = f"{type(exc).__name__}: {exc}"
        if why == self._erring:
            return
        self._erring = why
        self._failures += 1
        log.error("cannot check tenants file %s (the previous table stays; tried again every tick): %s",
                  self.path, why, exc_info=exc)

    def start(self, every_s: float) -> None:
        """Re-read the file when it changes, every `every_s` seconds, on the running loop.

        The loop ends only when cancelled (`stop`): any exception of a reload is
        logged (once while it repeats) and the next tick tries again, so revocation
        can never stop silently.
        """
        async def watch() -> None:
            while True:
                await asyncio.sleep(every_s)
                try:
                    await asyncio.to_thread(self.refresh)
                except Exception as exc:  # a stat that fails, or anything unforeseen: try again next tick
                    self._error(exc)
                else:
                    self._erring = None
                self._checks += 1

        self._task = asyncio.get_running_loop().create_task(watch())

    async def stop(self) -> None:
        """Stop watching the file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
