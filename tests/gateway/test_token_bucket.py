"""The re-replication copy rate (gateway/token_bucket.py, docs/FLEET.md F18), by a moved clock, not by timing."""

from __future__ import annotations

import asyncio
import random

import pytest

from gateway.token_bucket import TokenBucket
from kvstore.clock import ManualClock
from kvstore.errors import InvalidArgument


class Recorded(TokenBucket):
    """A bucket on a manual clock whose sleeps move the clock; each grant noted with its time."""

    def __init__(self, rate: float, burst: float) -> None:
        self.manual = ManualClock()

        async def sleep(seconds: float) -> None:
            self.manual.advance(seconds)
            await asyncio.sleep(0)

        super().__init__(rate, burst, clock=self.manual, sleep=sleep)
        self.start = self.manual.monotonic()
        self.grants: list[tuple[float, int]] = []

    async def take(self, n_bytes: int) -> None:
        await super().take(n_bytes)
        self.grants.append((self.manual.monotonic() - self.start, n_bytes))


def test_f18_what_the_bucket_lets_through_stays_under_its_rate() -> None:
    bucket = Recorded(rate=1_000_000, burst=250_000)
    rng = random.Random(18)

    async def copy() -> None:
        for _ in range(400):
            await bucket.take(rng.randint(1, 400_000))  # batches larger than the burst go into debt
            if rng.random() < 0.1:
                bucket.manual.advance(rng.random())  # an idle while (a pass between runs)

    asyncio.run(copy())
    total = 0
    for t, n in bucket.grants:
        total += n
        assert total <= bucket.burst_bytes + bucket.rate_bytes_per_s * t + 1e-6, (t, total)
    elapsed = bucket.grants[-1][0]
    assert total >= 0.5 * bucket.rate_bytes_per_s * elapsed  # and it is not idle either: it runs near the rate


def test_f18_concurrent_takers_share_the_rate() -> None:
    bucket = Recorded(rate=100_000, burst=10_000)

    async def copies() -> None:
        await asyncio.gather(*(bucket.take(50_000) for _ in range(8)))

    asyncio.run(copies())
    assert bucket.grants[-1][0] >= (8 * 50_000 - 10_000) / 100_000 - 1e-9


def test_a_bucket_needs_a_rate() -> None:
    with pytest.raises(InvalidArgument, match="above 0"):
        TokenBucket(0, 1)
