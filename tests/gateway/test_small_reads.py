"""Small reads are answered on the server's event loop, never queued behind the LMDB threads; large ones
still go to those threads (gateway/kvstore_servicer.py: INLINE_LOOKUP_BLOCKS, INLINE_GET_BYTES).

Each test holds every thread of the tier's executor (as Put commits waiting on LMDB's writer lock do
under load) and checks what is answered meanwhile: ordering, not timing. A corrupt block in a small
Get takes the executor's careful read (reported, counted, dropped), as a large Get's does.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import pytest

from gateway import kvstore_servicer
from kvstore.client import Client

#: Ends a wait that would never end (a call queued behind the held threads); not a measurement.
NEVER_S = 20.0


class HeldThreads:
    """Every thread of a tier's executor busy until `release`."""

    def __init__(self, executor: ThreadPoolExecutor, threads: int) -> None:
        self.released = threading.Event()
        started = [threading.Event() for _ in range(threads)]
        self.futures = [executor.submit(self._hold, s) for s in started]
        assert all(s.wait(NEVER_S) for s in started), "the tier's threads were not all taken"

    def _hold(self, started: threading.Event) -> None:
        started.set()
        self.released.wait(60)

    def release(self) -> None:
        self.released.set()
        for f in self.futures:
            f.result(timeout=NEVER_S)


@pytest.fixture
def held(server: Any) -> Iterator[Callable[[], HeldThreads]]:
    """Hold the server's LMDB threads (after the test's own setup); released at the end whatever happens."""
    holds: list[HeldThreads] = []

    def hold() -> HeldThreads:
        holds.append(HeldThreads(server.tier.executor, server.tier.settings.io_threads))
        return holds[-1]

    yield hold
    for h in holds:
        h.released.set()


def stored(client: Client, blocks: int) -> tuple[list[int], list[bytes]]:
    tokens = list(range(client.block_tokens * blocks))
    data = [os.urandom(client.block_bytes) for _ in range(blocks)]
    client.put(tokens, data)
    return tokens, data


def test_a_small_lookup_and_get_are_answered_while_every_lmdb_thread_is_busy(
        client: Client, held: Callable[[], HeldThreads]) -> None:
    tokens, data = stored(client, 4)
    client.get(tokens)  # recorded now: no refresh is due (R5), so the Get needs no thread at all
    hold = held()
    with ThreadPoolExecutor(1) as pool:
        assert pool.submit(client.lookup, tokens).result(timeout=NEVER_S).found_blocks == 4
        assert pool.submit(client.get, tokens).result(timeout=NEVER_S).blocks == data
    hold.release()


def test_a_large_get_and_a_long_lookup_still_wait_for_the_lmdb_threads(
        client: Client, held: Callable[[], HeldThreads], monkeypatch: pytest.MonkeyPatch) -> None:
    tokens, data = stored(client, 4)
    monkeypatch.setattr(kvstore_servicer, "INLINE_GET_BYTES", 3 * client.block_bytes)  # 4 blocks: large
    monkeypatch.setattr(kvstore_servicer, "INLINE_LOOKUP_BLOCKS", 3)
    hold = held()
    with ThreadPoolExecutor(3) as pool:
        large: Future[Any] = pool.submit(client.get, tokens)
        long: Future[Any] = pool.submit(client.lookup, tokens)
        small = pool.submit(client.get, tokens[:3 * client.block_tokens])  # 3 blocks: on the loop
        assert small.result(timeout=NEVER_S).blocks == data[:3]
        assert not large.done() and not long.done()  # queued for a thread: none is free
        hold.release()
        assert large.result(timeout=NEVER_S).blocks == data
        assert long.result(timeout=NEVER_S).found_blocks == 4


def test_a_corrupt_block_in_a_small_get_is_reported_and_dropped(server: Any, client: Client) -> None:
    tokens, data = stored(client, 2)
    path = server.tier.settings.data_dir / "data.mdb"
    at = path.read_bytes().find(data[1][:64])
    assert at >= 0
    fd = os.open(path, os.O_WRONLY)
    try:  # one byte of block 1's data flipped in the file the server maps
        os.pwrite(fd, bytes([data[1][0] ^ 0xFF]), at)
    finally:
        os.close(fd)
    got = client.get(tokens)
    assert got.statuses == ["found", "corrupt"] and got.blocks[0] == data[0]
    assert client.stats().corrupt_blocks == 1
    assert client.lookup(tokens).found_blocks == 1  # dropped: the careful read ran, not only the loop's


def test_a_lookup_and_a_small_get_are_answered_while_a_group_commit_holds_the_writer(
        server: Any, client: Client) -> None:
    """A unary Put's group commit runs on an LMDB thread and keeps it while more batches queue
    (gateway/put_group.py); the Lookups and small Gets of stored blocks never wait for it: held here with
    LMDB's writer lock taken and every other LMDB thread busy, both are answered before it is let go."""
    tier = server.tier
    tokens, data = stored(client, 4)
    client.get(tokens)  # recorded now: no refresh is due (R5), so neither read needs a thread
    entered, let_go = threading.Event(), threading.Event()
    real = tier.commit_many

    def held_commit(batches: Any) -> Any:
        with tier.env.begin(write=True):  # LMDB's one writer, as a long commit holds it
            entered.set()
            assert let_go.wait(60), "the test never let the commit go"
        return real(batches)

    tier.commit_many = held_commit  # the instance's own: what the Put handler's group commits with
    others: HeldThreads | None = None
    with ThreadPoolExecutor(2) as pool:
        try:
            put = pool.submit(client.put, [t + 10_000 for t in tokens],
                              [os.urandom(client.block_bytes) for _ in range(4)])
            assert entered.wait(NEVER_S), put.exception(timeout=1)
            others = HeldThreads(tier.executor, tier.settings.io_threads - 1)  # the committer holds the last
            assert pool.submit(client.lookup, tokens).result(timeout=NEVER_S).found_blocks == 4
            assert pool.submit(client.get, tokens).result(timeout=NEVER_S).blocks == data
            assert not put.done()  # the commit was held all along
        finally:
            let_go.set()
            if others is not None:
                others.release()
        assert put.result(timeout=NEVER_S).written_blocks == 4
