"""The NVMe tier's accounting: running counters, the recent write rate, the stats snapshot."""

from __future__ import annotations

import dataclasses
import json
from collections import deque
from dataclasses import dataclass, field


@dataclass(kw_only=True)
class Counters:
    """Running totals since the store was created (persisted with each write)."""

    lookups: int = 0
    lookup_tokens_asked: int = 0
    lookup_tokens_found: int = 0
    gets: int = 0
    get_tokens_asked: int = 0
    get_tokens_returned: int = 0
    puts: int = 0
    blocks_written: int = 0
    bytes_written: int = 0
    rejected_puts: int = 0
    evictions: int = 0
    evicted_bytes: int = 0
    corrupt_blocks: int = 0
    #: Of those, blocks a damaged page turned into misses (R16), each counted once.
    damaged_blocks: int = 0
    purged_blocks: int = 0
    imported_blocks: int = 0

    @classmethod
    def load(cls, saved: bytes | None) -> Counters:
        """The persisted counters; names this version does not know are dropped (an older or newer store)."""
        if not saved:
            return cls()
        known = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in json.loads(saved).items() if k in known and isinstance(v, int)})


@dataclass(frozen=True, kw_only=True)
class TierStats:
    """A snapshot of the tier's counters, usage and headroom."""

    counters: Counters
    blocks_stored: int
    bytes_stored: int
    capacity_bytes: int
    bytes_free: int
    write_rate_bytes_per_s: float
    headroom_hours: float
    retention_hours: float
    active_leases: int
    uptime_s: float
    #: Blocks and bytes stored per layout (geometry fingerprint): blocks of a geometry
    #: this server no longer serves (an earlier codec) show under their own.
    by_layout: dict[bytes, tuple[int, int]] = field(default_factory=dict)


#: Writes within one bucket of this many seconds are kept as one entry: the window's memory is bounded by
#: its length, not by the Puts in it (one entry per Put held 1 h of them: ~40 MiB at 100 Puts/s, rising
#: through a whole `bench load` soak), and the rate is off by at most one bucket's writes at its edge.
WRITE_RATE_BUCKET_S = 1.0


class WriteRate:
    """Bytes written per second over a sliding window (the headroom's denominator).

    Not thread-safe: the tier calls it under its lock.

    Args:
        window_s: how far back writes count.
        started_s: when counting began; a younger store divides by its age.
    """

    def __init__(self, window_s: float, started_s: float) -> None:
        self.window_s = window_s
        self.started_s = started_s
        #: (bucket start, bytes written in it), oldest first.
        self._writes: deque[tuple[float, int]] = deque()

    @property
    def entries(self) -> int:
        """Buckets held: at most window_s / WRITE_RATE_BUCKET_S + 1, however many writes."""
        return len(self._writes)

    def note(self, now: float, nbytes: int) -> None:
        """Record `nbytes` written at `now`."""
        if nbytes:
            bucket = now - now % WRITE_RATE_BUCKET_S
            if self._writes and self._writes[-1][0] == bucket:
                self._writes[-1] = (bucket, self._writes[-1][1] + nbytes)
            else:
                self._writes.append((bucket, nbytes))
        self._expire(now)

    def per_second(self, now: float) -> float:
        """Bytes per second over the window ending `now`."""
        self._expire(now)
        window = min(self.window_s, max(now - self.started_s, 1.0))
        return sum(n for _, n in self._writes) / window

    def _expire(self, now: float) -> None:
        horizon = now - self.window_s
        while self._writes and self._writes[0][0] < horizon:
            self._writes.popleft()
