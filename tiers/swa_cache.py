"""SWA snapshots over a pool: sealed with their geometry and checksum, counted, and never an error on a miss.

The pool below may expire, evict or lose records, or be unreachable; every one
of those reaches the caller as a miss. Unreachable backends and records that
fail their checks are counted, so an operator sees them in `kvstore stats`.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.errors import Unavailable
from kvstore.geometry import ModelGeometry
from kvstore.swa_snapshot import seal, unseal
from tiers.swa_pool import DirectGrant, PoolUsage, SwaPool

#: Seconds between sweeps for direct-path users past their lifetime (a sweep without one costs nothing).
REAP_INTERVAL_S = 1.0


@dataclass(kw_only=True)
class SwaCounters:
    """Running totals since the server started."""

    puts: int = 0
    snapshots_put: int = 0
    bytes_put: int = 0
    failed_puts: int = 0
    gets: int = 0
    snapshots_asked: int = 0
    hits: int = 0
    corrupt: int = 0
    deletes: int = 0
    lookups: int = 0
    backend_errors: int = 0


@dataclass(frozen=True, kw_only=True)
class SwaStats:
    """Counters plus what the backend holds; `usage` is None while it is unreachable."""

    counters: SwaCounters
    usage: PoolUsage | None
    backend: str
    ttl_s: float


@dataclass(frozen=True, kw_only=True)
class Found:
    """A snapshot read back and verified; `position` is its T, from its record."""

    data: bytes
    checksum: int
    position: int


@dataclass(frozen=True, kw_only=True)
class SnapshotItem:
    """A checked snapshot to store: its storage key, T, data and checksum."""

    key: bytes
    position: int
    data: bytes
    checksum: int


class SwaCache:
    """Snapshots of checked size and checksum over one `SwaPool`.

    Args:
        pool: the backend.
        ttl_s: the operator's TTL: the longest any snapshot lives.
    """

    def __init__(self, pool: SwaPool, *, ttl_s: float) -> None:
        self.pool = pool
        self.ttl_s = ttl_s
        self.counters = SwaCounters()
        self._lock = threading.Lock()  # counters are read by Stats while calls run
        self._reaper: asyncio.Task[None] | None = None

    def _count(self, **deltas: int) -> None:
        with self._lock:
            for name, delta in deltas.items():
                setattr(self.counters, name, getattr(self.counters, name) + delta)

    async def put_many(self, fingerprint: bytes, items: Sequence[SnapshotItem],
                       ttl_s: float | None = None) -> bool:
        """Store snapshots of the geometry `fingerprint` names; False when the backend was unreachable.

        The caller has checked sizes (from each T) and checksums; a put the
        backend could not take is counted and answered, never raised: the SWA
        state is a cache.
        """
        ttl = min(ttl_s, self.ttl_s) if ttl_s else self.ttl_s
        records = [(i.key, seal(fingerprint, i.position, i.data, i.checksum)) for i in items]
        try:
            await self.pool.put_many(records, ttl)
        except Unavailable:
            self._count(puts=1, failed_puts=len(items), backend_errors=1)
            return False
        self._count(puts=1, snapshots_put=len(items), bytes_put=sum(len(i.data) for i in items))
        return True

    async def get_many(self, geometry: ModelGeometry, keys: Sequence[bytes]) -> list[Found | None]:
        """Verified snapshots of `geometry` in key order; None where missing, expired, evicted,
        corrupt (another geometry, a size that is not its T's, a bad checksum) or unreachable."""
        try:
            records = await self.pool.get_many(keys)
        except Unavailable:
            self._count(gets=1, snapshots_asked=len(keys), backend_errors=1)
            return [None] * len(keys)
        out: list[Found | None] = []
        corrupt = 0
        for record in records:
            opened = unseal(record, geometry) if record is not None else None
            corrupt += record is not None and opened is None
            out.append(Found(data=opened.data, checksum=opened.checksum, position=opened.position)
                       if opened else None)
        self._count(gets=1, snapshots_asked=len(keys), hits=sum(f is not None for f in out), corrupt=corrupt)
        return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        """Whether each key holds a live snapshot; all False when the backend is unreachable."""
        try:
            found = await self.pool.exists_many(keys)
        except Unavailable:
            self._count(lookups=1, backend_errors=1)
            return [False] * len(keys)
        self._count(lookups=1)
        return found

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        """Drop snapshots; how many existed (0 when the backend is unreachable, counted)."""
        try:
            gone = await self.pool.delete_many(keys)
        except Unavailable:
            self._count(deletes=1, backend_errors=1)
            return 0
        self._count(deletes=1)
        return gone

    async def stats(self) -> SwaStats:
        """Counters and the backend's usage (None when it cannot be reached)."""
        try:
            usage: PoolUsage | None = await self.pool.usage()
        except Unavailable:
            self._count(backend_errors=1)
            usage = None
        with self._lock:
            counters = SwaCounters(**vars(self.counters))
        return SwaStats(counters=counters, usage=usage, backend=self.pool.name, ttl_s=self.ttl_s)

    async def open_direct(self, tenant: str, *, writable: bool) -> DirectGrant:
        """A backend user confined to `tenant`'s keys (SwaPool.open_direct); starts the sweep that
        deletes users past their lifetime.

        Raises:
            FailedPrecondition: the backend has no direct path.
            Unavailable: the backend cannot be reached (counted).
        """
        if self._reaper is None:
            self._reaper = asyncio.get_running_loop().create_task(self._reap_forever())
        try:
            return await self.pool.open_direct(tenant, writable=writable)
        except Unavailable:
            self._count(backend_errors=1)
            raise

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            with contextlib.suppress(Unavailable):
                await self.pool.reap_direct()

    def count_direct(self, **deltas: int) -> None:
        """Count what clients did on the direct path (SwaPool.ReportDirect) as gateway calls are counted."""
        self._count(**deltas)

    async def close(self) -> None:
        """Stop the sweep; close the backend's connections."""
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        await self.pool.close()
