"""A receiver's reads over the bulk transport (gateway/fleet_bulk.py, docs/FLEET.md F18) with real Mooncake engines
in two processes on loopback: several copies' reads in flight together, their ends waited for one at a time."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import numpy as np
import pytest

from gateway import fleet_bulk
from gateway.fleet_bulk import BulkReceiver
from gateway.transfer_bulk import engine_missing
from kvstore.bench.transfer_baselines import mooncake_target

READS = 8
READ_BYTES = 2 << 20


class Watched:
    """The receiver's real engine, its waits counted: how many wait at once, and how many reads were submitted
    before the first wait began. The first wait starts only once every read is submitted, so reads waited for
    together would overlap there."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.lock = threading.Lock()
        self.submitted = 0
        self.all_submitted = threading.Event()
        self.waiting = 0
        self.most_waiting = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def batch_transfer_async_read(self, *args: Any) -> int:
        batch = self.engine.batch_transfer_async_read(*args)
        with self.lock:
            self.submitted += 1
            if self.submitted == READS:
                self.all_submitted.set()
        return int(batch)

    def get_batch_transfer_status(self, batches: list[int]) -> int:
        with self.lock:
            self.waiting += 1
            self.most_waiting = max(self.most_waiting, self.waiting)
        try:
            self.all_submitted.wait(10.0)  # a deadline, not a pause: set once the last read is submitted
            return int(self.engine.get_batch_transfer_status(batches))
        finally:
            with self.lock:
                self.waiting -= 1


def test_f18_a_receivers_reads_stay_in_flight_together_and_are_waited_for_one_at_a_time(
        monkeypatch: pytest.MonkeyPatch) -> None:
    reason = engine_missing()
    if reason:
        pytest.skip(reason)
    # The wait taken in turn is a small host's (the sync read, Mooncake's own wait, where cores are not short).
    monkeypatch.setattr(fleet_bulk, "SLEEP_SHARE", 0.7)
    source = np.random.default_rng(18).integers(0, 256, READS * READ_BYTES, dtype=np.uint8)
    receiver = BulkReceiver("127.0.0.1", READ_BYTES, READS)
    try:
        with mooncake_target(memoryview(source.data)) as (segment, remote):
            assert receiver._start() == ""
            watched = Watched(receiver._engine)
            receiver._engine = watched

            async def read_all() -> list[bytes]:
                async def one(i: int) -> bytes:
                    view, slot = await receiver.read(segment, [remote + i * READ_BYTES], [READ_BYTES])
                    try:
                        return bytes(view)
                    finally:
                        receiver.release(slot)

                return await asyncio.gather(*(one(i) for i in range(READS)))

            got = asyncio.run(read_all())
    finally:
        receiver.close()
    assert got == [source[i * READ_BYTES:(i + 1) * READ_BYTES].tobytes() for i in range(READS)]
    assert watched.submitted == READS and watched.all_submitted.is_set()  # all in flight before the first ended
    assert watched.most_waiting == 1  # each polling wait alone: they took the cores the engine moves bytes on
