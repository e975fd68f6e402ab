"""A gateway's PutStream: the next requests received and cut while this one's copies are sent (F69c).

A gateway's Put of one request is two stages: its cut (checked, hashed as the fleet does and cut at run
boundaries, on a thread: O(request bytes)) and its store (F69's parent check, then each part sent to every
replica at once, F30, acknowledged once on all of them). The store stage runs one request at a time, in the
stream's order: a request's parent check may need what the request before it stored (F69b), and a node takes a
run's blocks only after their parent's. The cut needs nothing of the requests before it, so up to `depth`
requests are received and cut ahead of the store (bounded: their blocks are held until stored). Before, the next
request was received and cut only once this one was acknowledged.

The stream ends with the first error, wherever it arose (a bad request's cut, an undecodable message, a refused
store): every request before it was stored and acknowledged, none after it is stored, and the one that failed is
named in the error (`request N of the stream`: its 0-based place), so nothing half-stored is reported stored.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from kvstore.errors import KVStoreError

R = TypeVar("R")
C = TypeVar("C")
Y = TypeVar("Y")


def named(exc: Exception, index: int) -> Exception:
    """`exc` with the request it arose from named (a KVStoreError keeps its class, hint and attributes)."""
    if isinstance(exc, KVStoreError):
        exc.message = f"request {index} of the stream: {exc.message}"
        exc.args = (exc.message, *exc.args[1:])
    return exc


async def stored(
    requests: AsyncIterator[R], cut: Callable[[R], Awaitable[C]], store: Callable[[R, C], Awaitable[Y]], depth: int
) -> AsyncGenerator[Y, None]:
    """Each request's reply, in order, once `store` has returned for it (module docstring).

    Args:
        requests: the stream's requests.
        cut: a request's cut (may run for `depth` requests at once).
        store: stores a request with its cut; called one request at a time, in order.
        depth: requests received and cut (or being cut) ahead of the one being stored.

    Raises:
        Exception: the first error of the stream, naming its request, after every reply before it was yielded.
    """
    ahead: asyncio.Queue[tuple[R, asyncio.Future[C]] | Exception | None] = asyncio.Queue(maxsize=depth)

    async def receive() -> None:
        try:
            async for request in requests:
                await ahead.put((request, asyncio.ensure_future(cut(request))))
        except Exception as exc:  # an undecodable message: after the requests before it
            await ahead.put(exc)
            return
        await ahead.put(None)

    receiver = asyncio.ensure_future(receive())
    index = 0
    try:
        while True:
            item = await ahead.get()
            if item is None:
                return
            if isinstance(item, Exception):
                raise named(item, index)
            request, cutting = item
            try:
                reply = await store(request, await cutting)
            except Exception as exc:
                raise named(exc, index) from None
            yield reply
            index += 1
    finally:
        receiver.cancel()
        _cancel_queued(ahead)


def _cancel_queued(ahead: asyncio.Queue[Any]) -> None:
    """Cuts no store will take: cancelled (a thread already running one finishes and is dropped)."""
    while not ahead.empty():
        item = ahead.get_nowait()
        if isinstance(item, tuple):
            item[1].cancel()
