"""The embedded SWA pool: an in-process LRU dict with a byte cap and per-record expiry.

No other process is involved, so this is the default for a single node. Time
comes from the injected Clock: tests expire records by moving it.
"""

from __future__ import annotations

import heapq
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.clock import Clock
from kvstore.config import SwaSettings
from tiers.swa_pool import PoolUsage, SwaPool, dram_cap_bytes


@dataclass(slots=True)
class _Entry:
    record: bytes
    expires_s: float


class MemoryPool(SwaPool):
    """Records in an OrderedDict kept in LRU order, evicted to stay under `cap_bytes`.

    Args:
        cap_bytes: most record bytes held (keys not counted: they are 32-64 bytes
            against megabyte records).
        clock: the time source for expiry.
    """

    name = "memory"

    def __init__(self, *, cap_bytes: int, clock: Clock) -> None:
        self.cap_bytes = cap_bytes
        self.clock = clock
        # OrderedDict, not dict: move_to_end makes a hit O(1) and popitem(last=False) gives the LRU.
        self._entries: OrderedDict[bytes, _Entry] = OrderedDict()
        # (expires_s, key) in expiry order, so a sweep finds expired records without a scan;
        # stale pairs (key rewritten or gone) are skipped when popped.
        self._expiry: list[tuple[float, bytes]] = []
        self._bytes = 0
        self._expirations = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @classmethod
    def from_settings(cls, settings: SwaSettings, *, clock: Clock) -> MemoryPool:
        """A pool capped by the settings (explicit bytes or a share of DRAM)."""
        return cls(cap_bytes=dram_cap_bytes(settings), clock=clock)

    def _drop(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        self._bytes -= len(entry.record)

    def _sweep(self, now: float) -> None:
        while self._expiry and self._expiry[0][0] <= now:
            expires_s, key = heapq.heappop(self._expiry)
            entry = self._entries.get(key)
            if entry is not None and entry.expires_s == expires_s:
                self._drop(key)
                self._expirations += 1

    async def put_many(self, items: Sequence[tuple[bytes, bytes]], ttl_s: float) -> None:
        with self._lock:
            now = self.clock.now()
            self._sweep(now)
            for key, record in items:
                if len(record) > self.cap_bytes:
                    self._evictions += 1  # larger than the whole pool: dropped at once, as Redis would
                    continue
                if key in self._entries:
                    self._drop(key)
                while self._bytes + len(record) > self.cap_bytes:
                    old, _ = next(iter(self._entries.items()))
                    self._drop(old)
                    self._evictions += 1
                self._entries[key] = _Entry(record=record, expires_s=now + ttl_s)
                self._bytes += len(record)
                heapq.heappush(self._expiry, (now + ttl_s, key))

    def _live(self, key: bytes, now: float) -> _Entry | None:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_s <= now:
            self._drop(key)
            self._expirations += 1
            return None
        return entry

    async def get_many(self, keys: Sequence[bytes]) -> list[bytes | None]:
        with self._lock:
            now = self.clock.now()
            out: list[bytes | None] = []
            for key in keys:
                entry = self._live(key, now)
                if entry is not None:
                    self._entries.move_to_end(key)
                out.append(entry.record if entry else None)
            return out

    async def exists_many(self, keys: Sequence[bytes]) -> list[bool]:
        with self._lock:
            now = self.clock.now()
            return [self._live(key, now) is not None for key in keys]

    async def delete_many(self, keys: Sequence[bytes]) -> int:
        with self._lock:
            now = self.clock.now()
            gone = 0
            for key in keys:
                if self._live(key, now) is not None:
                    self._drop(key)
                    gone += 1
            return gone

    async def usage(self) -> PoolUsage:
        with self._lock:
            self._sweep(self.clock.now())
            return PoolUsage(backend=self.name, items=len(self._entries), bytes_used=self._bytes,
                             cap_bytes=self.cap_bytes, expirations=self._expirations, evictions=self._evictions)
