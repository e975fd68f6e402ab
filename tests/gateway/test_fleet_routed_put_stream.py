"""gateway/routed_put_stream.py (docs/FLEET.md F69c): a gateway's PutStream cuts the next requests while one is
stored, bounded, stores and acknowledges in order, and ends with the first error naming its request. Plain
asyncio with real callables (the real-process side is tests/kvstore/fleet/test_gateway_stream.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import pytest

from gateway.routed_put_stream import stored
from kvstore.errors import FailedPrecondition, InvalidArgument

#: Seconds a condition another task makes true may take (a deadline, not a pause).
DEADLINE_S = 30.0


async def _requests(n: int, received: list[int]) -> AsyncIterator[int]:
    for i in range(n):
        received.append(i)
        yield i


def test_f69c_the_next_requests_are_cut_while_one_is_stored_in_order_and_bounded() -> None:
    async def run() -> None:
        received: list[int] = []
        cut_seen: list[int] = []
        stored_seen: list[int] = []
        two_ahead = asyncio.Event()

        async def cut(request: int) -> str:
            cut_seen.append(request)
            if len(cut_seen) >= 3:
                two_ahead.set()
            return f"cut {request}"

        async def store(request: int, cut_request: str) -> str:
            if request == 0:  # held until the next two are cut: they must not wait on this store
                await asyncio.wait_for(two_ahead.wait(), DEADLINE_S)
                assert len(received) <= 1 + 3 + 1  # this one, ROUTED depth ahead, one waiting for room
            stored_seen.append(request)
            return f"ack {cut_request}"

        replies = [reply async for reply in stored(_requests(8, received), cut, store, depth=3)]
        assert replies == [f"ack cut {i}" for i in range(8)] and stored_seen == list(range(8))

    asyncio.run(run())


def test_f69c_the_first_error_ends_the_stream_naming_its_request_nothing_after_it_stored() -> None:
    async def run(bad_cut: int | None, bad_store: int | None) -> tuple[list[str], list[int], Exception]:
        stored_seen: list[int] = []

        async def cut(request: int) -> int:
            if request == bad_cut:
                raise InvalidArgument("blocks has 3 entries but token_ids 2 blocks")
            return request

        async def store(request: int, _: int) -> str:
            if request == bad_store:
                raise FailedPrecondition("the parent is not stored on any live replica")
            stored_seen.append(request)
            return f"ack {request}"

        replies: list[str] = []
        with pytest.raises(Exception) as failed:
            async for reply in stored(_requests(6, []), cut, store, depth=3):
                replies.append(reply)
        return replies, stored_seen, failed.value

    replies, stored_seen, error = asyncio.run(run(bad_cut=2, bad_store=None))
    assert replies == ["ack 0", "ack 1"] and stored_seen == [0, 1]
    assert isinstance(error, InvalidArgument) and str(error).startswith("request 2 of the stream: blocks has 3")
    assert error.message == str(error) and error.hint == InvalidArgument.hint
    replies, stored_seen, error = asyncio.run(run(bad_cut=None, bad_store=3))
    assert replies == ["ack 0", "ack 1", "ack 2"] and stored_seen == [0, 1, 2]
    assert isinstance(error, FailedPrecondition) and "request 3 of the stream: the parent" in str(error)
