"""`kvstore.block_feed` taken on a thread (`drained`, the fleet client's read-ahead, docs/FLEET.md F33b): items in
order, a bounded number held, the producer's error raised after the items before it, an early stop ending the
producer."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from kvstore.block_feed import Feed, drained, produce
from tests.waiting import wait_until


def test_items_come_in_order_and_the_producer_waits_for_room() -> None:
    feed: Feed[int] = Feed(3)
    made: list[int] = []

    def items() -> Iterator[int]:
        for i in range(10):
            made.append(i)
            yield i

    produce(None, feed, items)
    wait_until(lambda: len(made) == 4, "the producer at its fourth item")  # three held, the fourth waits for room
    assert len(made) == 4
    assert list(drained(feed)) == list(range(10))


def test_the_producers_error_is_raised_after_the_items_before_it() -> None:
    feed: Feed[int] = Feed(8)

    def items() -> Iterator[int]:
        yield 1
        yield 2
        raise RuntimeError("node gone")

    produce(None, feed, items)
    got: list[int] = []
    with pytest.raises(RuntimeError, match="node gone"):
        for item in drained(feed):
            got.append(item)
    assert got == [1, 2]


def test_a_consumer_that_stops_early_ends_the_producer() -> None:
    feed: Feed[int] = Feed(1)
    closed = threading.Event()

    def items() -> Iterator[int]:
        try:
            i = 0
            while True:
                yield i
                i += 1
        finally:
            closed.set()  # the generator closed on the producer's thread

    produce(None, feed, items)
    taken = drained(feed)
    assert next(taken) == 0
    taken.close()  # the caller stopped: the feed closed, the producer's next put refused
    wait_until(closed.is_set, "the producer's generator closed")
