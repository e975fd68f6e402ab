"""Injectable time, so retention and TTLs are tested by moving a clock, not by sleeping.

A clock has two faces: `now`, wall-clock time that outlives the process (stored
in records), and `monotonic`, which never jumps but means nothing across
processes. The NVMe tier uses both to guard its retention clock against a wall
clock set forward or back (tiers/retention.py).
"""

from __future__ import annotations

import threading
import time
from typing import Protocol


class Clock(Protocol):
    """A source of time in seconds."""

    def now(self) -> float:
        """Wall-clock time in seconds since the epoch (may jump when the clock is set)."""
        ...

    def monotonic(self) -> float:
        """Seconds on a clock that never jumps; only differences within one process mean anything."""
        ...


class SystemClock:
    """The real clocks: `time.time` and `time.monotonic`."""

    def now(self) -> float:
        """Wall-clock time in seconds since the epoch."""
        return time.time()

    def monotonic(self) -> float:
        """Seconds on the process's monotonic clock."""
        return time.monotonic()


class ManualClock:
    """A clock that moves only when told to (tests, simulations).

    `advance` is time passing: both faces move. `jump` is someone setting the
    wall clock: only `now` moves, in either direction.
    """

    def __init__(self, start: float = 1_800_000_000.0, monotonic_start: float = 1_000.0) -> None:
        self._now = start
        self._monotonic = monotonic_start
        self._lock = threading.Lock()

    def now(self) -> float:
        """Wall-clock time in seconds."""
        with self._lock:
            return self._now

    def monotonic(self) -> float:
        """Monotonic seconds (moved only by `advance`)."""
        with self._lock:
            return self._monotonic

    def advance(self, seconds: float) -> None:
        """Let `seconds` pass: both the wall clock and the monotonic clock move forward."""
        if seconds < 0:
            raise ValueError(f"time cannot pass backwards ({seconds} s); use jump() to set the wall clock back")
        with self._lock:
            self._now += seconds
            self._monotonic += seconds

    def jump(self, seconds: float) -> None:
        """Set the wall clock `seconds` forward (or back, when negative); the monotonic clock does not move."""
        with self._lock:
            self._now += seconds
