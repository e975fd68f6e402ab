"""The server's view of the tenants file: token hash -> who the caller is.

The file (kvstore.api_tokens) is read at start and re-read by a background task
when its size, inode or modification time changes, every `auth.reload_s`: a
`kvstore tenant create` or `revoke` takes effect without a restart, and no call
ever reads a file. A call costs one SHA-256 of its token and one dict lookup.

Auth is on once the file exists (even with every token revoked: revoking the
last token must not open the store) or when `auth.required` says so. A file
that disappears or breaks while the server runs keeps auth on: a vanished file
accepts no token, a damaged one keeps the last good table (and says so in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.api_tokens import TokenRecord, read_records, token_hash
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.auth")


@dataclass(frozen=True, slots=True)
class Identity:
    """What a valid token says: its tenant, rights and id."""

    tenant: str
    rights: frozenset[str]
    token_id: str
    digest: bytes


def _table(records: list[TokenRecord]) -> dict[bytes, Identity]:
    table = {}
    for r in records:
        if r.active:
            digest = bytes.fromhex(r.sha256)
            table[digest] = Identity(tenant=r.tenant, rights=frozenset(r.rights), token_id=r.token_id, digest=digest)
    return table


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

    Raises:
        ConfigError: at start, the file exists but cannot be read or parsed.
    """

    def __init__(self, path: Path, *, required: bool = False) -> None:
        self.path = path
        self._signature = _signature(path)
        records = read_records(path)
        #: Whether calls must carry a token (see the module doc: never turns off while running).
        self.enabled = required or records is not None
        self._tokens: dict[bytes, Identity] = _table(records or [])
        self._task: asyncio.Task[None] | None = None

    @property
    def tenants(self) -> frozenset[str]:
        """Tenants with at least one active token."""
        return frozenset(i.tenant for i in self._tokens.values())

    def find(self, token: str) -> Identity | None:
        """The identity of `token`, or None when it is unknown or revoked.

        The dict is keyed by the token's SHA-256, so a lookup's timing depends on
        that digest, not on the token: learning digest bits from it tells nothing
        usable about any token (SHA-256 is preimage resistant). The final
        comparison is constant-time all the same.
        """
        digest = token_hash(token)
        identity = self._tokens.get(digest)
        if identity is None or not hmac.compare_digest(identity.digest, digest):
            return None
        return identity

    def refresh(self) -> bool:
        """Re-read the file if it changed since last read; True when the table changed."""
        signature = _signature(self.path)
        if signature == self._signature:
            return False
        try:
            records = read_records(self.path)
        except KVStoreError as exc:
            log.error("kept the previous tenants table: %s", exc.message)
            return False
        self._signature = signature
        if records is None:
            if self.enabled:
                log.warning("tenants file %s is gone: every token is refused until it is back", self.path)
            self._tokens = {}
            return True
        if not self.enabled:
            log.warning("tenants file %s appeared: auth is on, every call needs a token from now on", self.path)
        self.enabled = True
        self._tokens = _table(records)
        log.info("tenants file %s loaded: %d active tokens", self.path, len(self._tokens))
        return True

    def start(self, every_s: float) -> None:
        """Re-read the file when it changes, every `every_s` seconds, on the running loop."""
        async def watch() -> None:
            while True:
                await asyncio.sleep(every_s)
                try:
                    await asyncio.to_thread(self.refresh)
                except OSError as exc:  # a stat that fails for another reason: try again next tick
                    log.error("cannot check tenants file %s: %s", self.path, exc)

        self._task = asyncio.get_running_loop().create_task(watch())

    async def stop(self) -> None:
        """Stop watching the file."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
