"""Waiting on what another thread or process does, by observing it: a condition polled until it
holds or a deadline passes. The deadline only turns a hang into a failure; it is long (30 s by
default) so that a loaded machine reaches the same outcome as a quiet one, only later."""

from __future__ import annotations

import time
from collections.abc import Callable

#: Longest wait for a condition another thread or process makes true.
DEADLINE_S = 30.0


def wait_until(holds: Callable[[], object], what: str, timeout_s: float = DEADLINE_S) -> None:
    """Return once `holds()` is true; fail the test saying `what` did not happen after `timeout_s`.

    Polls every millisecond for the first 50 ms, then every 10 ms (a wait that is usually short stays
    short, a long one costs little CPU).
    """
    start = time.monotonic()
    deadline = start + timeout_s
    while not holds():
        now = time.monotonic()
        assert now < deadline, f"{what}: not within {timeout_s:g} s"
        time.sleep(0.001 if now - start < 0.05 else 0.01)
