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
- R13 The retention clock (`RetentionClock`) never runs behind a time already
      persisted, and never ahead of the persisted high-water mark plus the
      monotonic time since the store was opened: setting the wall clock forward
      cannot make a block evictable early, setting it back cannot make a block
      stamped later look older, and time while the server is down does not
      age blocks.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Callable, Collection
from dataclasses import dataclass

from kvstore.clock import Clock

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

    def cutoff(self, now_s: float) -> float:
        """Blocks whose recorded use is before this time are past retention (R4)."""
        return now_s - self.retention_s - TOUCH_GRANULARITY_S

    def evictable_in_s(self, last_use_s: float, now_s: float) -> float:
        """Seconds until a block last used at `last_use_s` passes its retention (<= 0: it has)."""
        return last_use_s - self.cutoff(now_s)

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
