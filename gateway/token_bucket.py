"""A token bucket over bytes: the bounded rate re-replication copies at (docs/FLEET.md F18).

`take(n)` returns once `n` bytes may go: by any time t, what was let through since
the bucket was made is at most `burst_bytes + rate_bytes_per_s * (t - start)`.
A take larger than what is in the bucket goes into debt and waits the debt off,
so one large batch is neither refused nor split here. Time and sleeping are
injected, so the bound is tested by moving a clock, not by timing.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from kvstore.clock import Clock, SystemClock
from kvstore.errors import InvalidArgument

#: The shortest wait (a rounding residue of a debt must not be waited in steps too small to move a clock).
_MIN_WAIT_S = 1e-6


class TokenBucket:
    """Bytes let through at `rate_bytes_per_s`, with bursts of up to `burst_bytes`.

    Args:
        rate_bytes_per_s: the long-run rate.
        burst_bytes: what may go at once after a pause (the bucket's size).
        clock: its monotonic face paces the bucket.
        sleep: waits that many seconds (asyncio.sleep; a test's moves its clock).
    """

    def __init__(self, rate_bytes_per_s: float, burst_bytes: float, *, clock: Clock | None = None,
                 sleep: Callable[[float], Awaitable[None]] = asyncio.sleep) -> None:
        if rate_bytes_per_s <= 0 or burst_bytes <= 0:
            raise InvalidArgument(f"a token bucket needs a rate and a burst above 0, got {rate_bytes_per_s}, "
                                  f"{burst_bytes}")
        self.rate_bytes_per_s = rate_bytes_per_s
        self.burst_bytes = burst_bytes
        self.clock = clock or SystemClock()
        self._sleep = sleep
        self._tokens = burst_bytes
        self._at = self.clock.monotonic()
        self._lock = asyncio.Lock()

    def _refill(self) -> None:
        now = self.clock.monotonic()
        self._tokens = min(self.burst_bytes, self._tokens + (now - self._at) * self.rate_bytes_per_s)
        self._at = now

    async def take(self, n_bytes: int) -> None:
        """Wait until `n_bytes` may go (callers queue in turn: one waits its debt off at a time)."""
        async with self._lock:
            self._refill()
            self._tokens -= n_bytes
            while self._tokens < 0:
                # The debt's time at the rate; at least 1 us, so a rounding residue cannot spin the loop.
                await self._sleep(max(-self._tokens / self.rate_bytes_per_s, _MIN_WAIT_S))
                self._refill()
