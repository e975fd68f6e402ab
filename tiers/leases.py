"""Short leases that pin blocks between a Lookup and the Get that follows it.

A lease pins one key: the deepest block the Lookup found (a fleet node's runs found by their last blocks share
one lease over each run's, F77). Eviction only takes
blocks with no stored descendants, so pinning the tail protects the whole
prefix. Leases live in memory: they last seconds and need not survive a restart,
so they run on the monotonic clock: setting the wall clock forward cannot end a
lease early.
"""

from __future__ import annotations

import heapq
import threading
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from kvstore.clock import Clock


@dataclass(frozen=True, kw_only=True, slots=True)
class Lease:
    """One pinned key and when the pin lapses (on the clock's monotonic face)."""

    lease_id: str
    key: bytes
    expires_s: float
    #: Further keys the same lease pins (a fleet node's runs leased together: docs/FLEET.md F77).
    more: tuple[bytes, ...] = ()

    @property
    def keys(self) -> tuple[bytes, ...]:
        """Every key this lease pins."""
        return (self.key, *self.more)


class LeaseTable:
    """Active leases and the keys they pin; thread-safe."""

    def __init__(self, clock: Clock) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._leases: dict[str, Lease] = {}
        self._pins: Counter[bytes] = Counter()
        #: (expires_s, lease_id) of every lease granted and not yet expired or released (a released one's entry stays
        #: until its time and is then skipped): expiring costs the leases that end, not a walk of every lease.
        self._ends: list[tuple[float, str]] = []
        #: `pinned()`'s answer while no pin changed (each Put's commit asks for it).
        self._pinned: frozenset[bytes] | None = frozenset()

    def grant(self, key: bytes, duration_s: float) -> Lease:
        """Pin `key` for `duration_s` seconds."""
        lease = Lease(lease_id=uuid.uuid4().hex, key=key, expires_s=self._clock.monotonic() + duration_s)
        with self._lock:
            self._expire_locked()
            self._add_locked(lease)
        return lease

    def grant_many(self, keys: Sequence[bytes], duration_s: float) -> list[Lease]:
        """Pin each of `keys` for `duration_s` seconds, a lease each, under one lock (a fleet node's runs)."""
        expires_s = self._clock.monotonic() + duration_s
        leases = [Lease(lease_id=uuid.uuid4().hex, key=key, expires_s=expires_s) for key in keys]
        with self._lock:
            self._expire_locked()
            for lease in leases:
                self._add_locked(lease)
        return leases

    def grant_together(self, keys: Sequence[bytes], duration_s: float) -> Lease:
        """Pin every key of `keys` (at least one) for `duration_s` seconds under one lease (a fleet node's runs
        found by their last blocks, F77: one id to answer and release, not one per run)."""
        lease = Lease(lease_id=uuid.uuid4().hex, key=keys[0], more=tuple(keys[1:]),
                      expires_s=self._clock.monotonic() + duration_s)
        with self._lock:
            self._expire_locked()
            self._add_locked(lease)
        return lease

    def release(self, lease_id: str, *, owns: Callable[[bytes], bool] | None = None) -> bool:
        """Drop a lease; False when it was unknown, had already expired, or pins a key
        `owns` refuses (another tenant's: answered as an unknown lease)."""
        with self._lock:
            self._expire_locked()
            lease = self._leases.get(lease_id)
            if lease is None or (owns is not None and not owns(lease.key)):
                return False
            del self._leases[lease_id]
            for key in lease.keys:
                self._unpin_locked(key)
            return True

    def pinned(self) -> frozenset[bytes]:
        """Keys pinned by a lease that has not expired."""
        with self._lock:
            self._expire_locked()
            if self._pinned is None:
                self._pinned = frozenset(self._pins)
            return self._pinned

    def active(self) -> int:
        """Number of live leases."""
        with self._lock:
            self._expire_locked()
            return len(self._leases)

    def _add_locked(self, lease: Lease) -> None:
        self._leases[lease.lease_id] = lease
        heapq.heappush(self._ends, (lease.expires_s, lease.lease_id))
        for key in lease.keys:
            self._pins[key] += 1
        self._pinned = None

    def _expire_locked(self) -> None:
        now, ends = self._clock.monotonic(), self._ends
        while ends and ends[0][0] <= now:
            lease = self._leases.pop(heapq.heappop(ends)[1], None)
            if lease is None:
                continue  # released before its time
            for key in lease.keys:
                self._unpin_locked(key)

    def _unpin_locked(self, key: bytes) -> None:
        self._pinned = None
        self._pins[key] -= 1
        if self._pins[key] <= 0:
            del self._pins[key]
