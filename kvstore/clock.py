"""Injectable time, so retention and TTLs are tested by moving a clock, not by sleeping."""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """A source of wall-clock time in seconds since the epoch."""

    def now(self) -> float:
        """The current time in seconds."""
        ...


class SystemClock:
    """The real wall clock. Wall time, not monotonic: timestamps outlive the process."""

    def now(self) -> float:
        """The current time in seconds."""
        return time.time()


class ManualClock:
    """A clock that moves only when told to (tests, simulations)."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self._now = start
        self._lock = threading.Lock()

    def now(self) -> float:
        """The current time in seconds."""
        with self._lock:
            return self._now

    def advance(self, seconds: float) -> None:
        """Move time forward by `seconds`."""
        with self._lock:
            self._now += seconds
