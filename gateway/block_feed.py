"""Items handed from a producer thread to one consumer as they arrive, in order, a bounded number held.

A gateway's Get reads each run from a node on a thread (the fleet client's blocking code) and answers the
client on the event loop (docs/FLEET.md F69a). Between the two a `Feed` holds what was read and not yet taken:
at most `bound` items, the producer waiting for room beyond that, so a Get of any length holds a bounded
number of blocks whatever the speed of the client. The consumer takes everything there is at once (one wake
per batch, not per block) on the event loop (`take`).
Closing a feed (the consumer is gone: an error, a cancelled call) stops its producer at its next item.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import Executor
from functools import partial
from typing import Generic, TypeVar

T = TypeVar("T")


class Feed(Generic[T]):
    """A bounded, ordered buffer from one producer thread to one awaiting consumer (see the module's docstring).

    Args:
        bound: items held at most (the producer waits for room beyond it).
    """

    def __init__(self, bound: int) -> None:
        self._bound = max(1, bound)
        self._items: deque[T] = deque()
        self._cond = threading.Condition()
        self._done = self._closed = False
        self._error: BaseException | None = None
        self._wake: Callable[[], object] | None = None  # the awaiting consumer's, set while it waits

    def put(self, item: T) -> bool:
        """Hand `item` over, waiting while `bound` items are held; False once the consumer closed the feed."""
        with self._cond:
            while len(self._items) >= self._bound and not self._closed:
                self._cond.wait()
            if self._closed:
                return False
            self._items.append(item)
            self._wake_consumer()
            return True

    def finish(self, error: BaseException | None = None) -> None:
        """No more items; the consumer raises `error` once it has taken those held."""
        with self._cond:
            self._done, self._error = True, error
            self._wake_consumer()

    def close(self) -> None:
        """The consumer is gone: the held items dropped, the producer's next `put` answered False."""
        with self._cond:
            self._closed = True
            self._items.clear()
            self._cond.notify_all()

    async def take(self) -> list[T]:
        """Every item held, awaited on the event loop until there is one; [] once finished (the producer's error
        raised instead)."""
        loop = asyncio.get_running_loop()
        while True:
            ready = asyncio.Event()
            with self._cond:
                if self._items or self._done:
                    return self._drain()
                self._wake = partial(loop.call_soon_threadsafe, ready.set)
            await ready.wait()

    def _drain(self) -> list[T]:
        self._wake = None
        if self._items:
            out = list(self._items)
            self._items.clear()
            self._cond.notify_all()  # room again: a waiting producer goes on
            return out
        if self._error is not None:
            raise self._error
        return []

    def _wake_consumer(self) -> None:
        if self._wake is not None:
            wake, self._wake = self._wake, None
            wake()


def produce(executor: Executor, feed: Feed[T], make: Callable[[], Iterable[T]]) -> None:
    """Run `make()`'s items into `feed` on `executor`; its error finishes the feed; a closed feed stops it
    (a generator is closed in its own thread, so a node's call it was streaming is cancelled)."""

    def run() -> None:
        items: Iterable[T] | None = None
        try:
            items = make()
            for item in items:
                if not feed.put(item):
                    break
        except BaseException as exc:  # handed to the consumer, raised there in order
            feed.finish(exc)
            return
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()
        feed.finish()

    executor.submit(run)


async def drained_async(feed: Feed[T]) -> AsyncGenerator[list[T], None]:
    """Each batch of `feed` in order, awaited; the feed closed when the caller stops early."""
    try:
        while batch := await feed.take():
            yield batch
    finally:
        feed.close()
