"""The retention rule of the NVMe tier: what may be evicted, and when.

Everything that decides whether a stored block may go is here; the rest of
the tier asks. Rules enforced (numbered as in docs/RETENTION.md):

- R4  A block may go only once `retention_s + TOUCH_GRANULARITY_S` has passed,
      on the retention clock, since its recorded last use (`Retention.cutoff`).
- R5  A use within TOUCH_GRANULARITY_S of the recorded one is not recorded
      again (`Retention.touch_due`); R4 waits that much longer to make up.
- R6  Only a block with no stored child may go, or one whose children all go
      before it in the same pass (`Retention.may_evict`'s `children_stay`).
- R9  Never a block a live lease pins (`protected`).
- R12 Never a block a Put in progress names, nor the parent it extends
      (`protected`; R6 then keeps the whole chain above them).
- R18 Each block's retention is its namespace's (`NamespaceRetention`): the
      provider's value for the namespace, never below the store's.
- R13 The retention clock (`RetentionClock`) never runs behind a time already
      persisted, and never ahead of the persisted high-water mark plus the
      monotonic time since the store was opened: setting the wall clock forward
      cannot make a block evictable early, setting it back cannot make a block
      stamped later look older, and time while the server is down does not
      age blocks.
"""

from __future__ import annotations

import logging
import math
import struct
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

import lmdb

from kvstore.clock import Clock
from kvstore.native.records import lru_entry

log = logging.getLogger(__name__)

#: A use within this many seconds of a block's recorded use is not recorded
#: again: hot blocks would otherwise cost a write per read. Eviction waits this
#: much longer than the retention, so the guarantee holds for the true last use.
TOUCH_GRANULARITY_S = 60.0

#: State-db key of the retention clock's high-water mark (a little-endian double).
HIGH_WATER_KEY = b"clock"
HIGH_WATER = struct.Struct("<d")


@dataclass(frozen=True, kw_only=True, slots=True)
class Retention:
    """The eviction rule for one store.

    Attributes:
        retention_s: the promised minimum time a block stays after its last use.
    """

    retention_s: float

    def cutoff(self, now_s: float, retention_s: float | None = None) -> float:
        """Blocks whose recorded use is before this time are past retention (R4).

        Args:
            now_s: retention time now.
            retention_s: the block's namespace's retention (R18); None: the store's.
        """
        return now_s - (self.retention_s if retention_s is None else retention_s) - TOUCH_GRANULARITY_S

    def evictable_in_s(self, last_use_s: float, now_s: float, retention_s: float | None = None) -> float:
        """Seconds until a block last used at `last_use_s` passes its retention (<= 0: it has)."""
        return last_use_s - self.cutoff(now_s, retention_s)

    @staticmethod
    def touch_due_before(now_s: float) -> float:
        """A use recorded before this time must be recorded again at `now_s` (R5)."""
        return now_s - TOUCH_GRANULARITY_S

    @staticmethod
    def touch_due(last_use_s: float, now_s: float) -> bool:
        """Whether a use at `now_s` must be recorded over one recorded at `last_use_s` (R5)."""
        return last_use_s < Retention.touch_due_before(now_s)

    @staticmethod
    def may_evict(key: bytes, last_use_s: float, cutoff_s: float, protected: Collection[bytes], *,
                  children_stay: Callable[[], bool]) -> bool:
        """Whether the block at `key` may go now.

        Args:
            key: the block's storage key.
            last_use_s: its recorded last use.
            cutoff_s: `cutoff(now)`.
            protected: keys leased (R9) or named by the Put making room (R12).
            children_stay: whether any stored child of it is not going first (R6);
                asked last, as it reads the index.
        """
        return last_use_s < cutoff_s and key not in protected and not children_stay()


class NamespaceRetention:
    """Retention per namespace (R18): a provider's value, never below the store's floor.

    Retention may only be raised (the policy service refuses a lower value), so
    the value now is at least every value a stored block was written under: it
    keeps every earlier promise.

    Args:
        floor_s: the store's retention (`store.retention_hours`, at least 72 h).
        provider: namespace name -> retention seconds; None: every namespace gets `floor_s`.
    """

    def __init__(self, floor_s: float, provider: Callable[[str], float] | None = None) -> None:
        self.floor_s = floor_s
        self.provider = provider

    def seconds(self, namespace: str | None) -> float:
        """The namespace's retention in seconds; the floor for a namespace not known by name.

        A provider that fails (or answers NaN) keeps the namespace's blocks (infinite
        retention): refusing Puts is recoverable, a broken promise is not.
        """
        if namespace is None or self.provider is None:
            return self.floor_s
        try:
            value = float(self.provider(namespace))
        except Exception:
            log.exception("the retention provider failed for namespace %r: its blocks are kept", namespace)
            return math.inf
        return math.inf if math.isnan(value) else max(value, self.floor_s)

    def for_keys(self, name_of: Callable[[bytes], str | None]) -> Callable[[bytes], float]:
        """storage key -> its namespace's retention seconds, asking once per namespace id.

        Args:
            name_of: namespace id (a key's bytes 8..16) -> its name, None when unknown.
        """
        cache: dict[bytes, float] = {}

        def retention_of(key: bytes) -> float:
            ns_id = key[8:16]
            if ns_id not in cache:
                cache[ns_id] = self.seconds(name_of(ns_id))
            return cache[ns_id]

        return retention_of


def persisted_high_water(txn: lmdb.Transaction, state_db: Any, lru_db: Any) -> float | None:
    """The persisted retention high-water mark; for a store written before it was kept
    (or whose mark is unreadable), the newest recorded use; None for an empty store."""
    raw = txn.get(HIGH_WATER_KEY, db=state_db)
    if raw is not None and len(raw) == HIGH_WATER.size:
        return float(HIGH_WATER.unpack(raw)[0])
    if raw is not None:
        log.warning("the retention clock's high-water mark is damaged; using the newest recorded use")
    cursor = txn.cursor(db=lru_db)
    return lru_entry(cursor.key())[0] if cursor.last() else None


class RetentionClock:
    """The time the tier stamps on blocks and evicts by: the wall clock, guarded (R13).

    `now()` is the wall clock clamped between the last time it returned (so it
    never goes back) and `high_water_s + monotonic time since open` (so a jump
    forward cannot age blocks). The tier persists `now()` with every write, as
    the next open's `high_water_s`: a restart never stamps a time earlier than
    one already stored, and time while the server is down does not count.

    Args:
        clock: the wall and monotonic clocks.
        high_water_s: the persisted high-water mark; None for a new store (the
            wall clock at open is taken as is).
    """

    def __init__(self, clock: Clock, high_water_s: float | None) -> None:
        self._clock = clock
        self._lock = threading.Lock()
        self._base_s = clock.now() if high_water_s is None else high_water_s
        self._last_s = self._base_s
        self._opened_mono_s = clock.monotonic()

    def now(self) -> float:
        """Retention time now: never earlier than before, never faster than monotonic time."""
        with self._lock:
            ceiling = self._base_s + max(self._clock.monotonic() - self._opened_mono_s, 0.0)
            t = min(self._clock.now(), ceiling)
            if t > self._last_s:
                self._last_s = t
            return self._last_s

    def uptime_s(self) -> float:
        """Monotonic seconds since the store was opened."""
        return self._clock.monotonic() - self._opened_mono_s
