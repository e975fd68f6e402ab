"""A PutStream's stages on a node (gateway/put_stream.py): each batch acknowledged in order and only after its
commit; the next message received while one is planned, the next commit started while the last replies are
written; the first error ends the stream after the batches before it."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable

import pytest

from gateway.put_stream import committed
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope
from tiers.store import PutBatch, PutResult

DEADLINE_S = 10.0
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")


def _batch(i: int) -> PutBatch:
    return PutBatch(scope=SCOPE, parent_hash=b"", hashes=[i.to_bytes(32, "big")], blocks=[], is_root=True)


async def _requests(n: int, before: Callable[[int], object] | None = None) -> AsyncIterator[int]:
    for i in range(n):
        if before is not None:
            waited = before(i)
            if asyncio.iscoroutine(waited):
                await waited
        yield i


class _Tier:
    """Commits batches by remembering them; `fail_at`: the commit (by count) that raises."""

    def __init__(self, fail_at: int | None = None) -> None:
        self.groups: list[list[int]] = []
        self.fail_at = fail_at
        self.second = asyncio.Event()

    async def commit(self, batches: list[PutBatch]) -> list[PutResult]:
        if len(self.groups) == self.fail_at:
            raise RuntimeError("refused")
        self.groups.append([int.from_bytes(b.hashes[0], "big") for b in batches])
        if len(self.groups) == 2:
            self.second.set()
        return [PutResult(written_blocks=1, existing_blocks=0, written_bytes=0) for _ in batches]

    def committed(self) -> list[int]:
        return [i for group in self.groups for i in group]


def _plan(i: int) -> PutBatch:
    return _batch(i)


def test_batches_come_back_in_order_each_after_its_commit() -> None:
    async def main() -> None:
        tier, seen = _Tier(), []
        async for batch, result in committed(_requests(20), _plan, tier.commit, 4):
            i = int.from_bytes(batch.hashes[0], "big")
            assert i in tier.committed()  # acknowledged = durable
            assert result.written_blocks == 1
            seen.append(i)
        assert seen == list(range(20)) == tier.committed()

    asyncio.run(main())


def test_the_next_message_is_received_while_one_is_planned() -> None:
    second_received = threading.Event()

    def plan(i: int) -> PutBatch:
        if i == 0 and not second_received.wait(DEADLINE_S):  # a serial reader never gets to message 1
            raise AssertionError("message 1 was not received while message 0 was planned")
        return _batch(i)

    def before(i: int) -> None:
        if i == 1:
            second_received.set()

    async def main() -> list[int]:
        tier = _Tier()
        return [int.from_bytes(b.hashes[0], "big") async for b, _ in committed(_requests(3, before), plan,
                                                                                tier.commit, 4)]

    assert asyncio.run(main()) == [0, 1, 2]


def test_the_next_commit_starts_while_the_last_replies_are_written() -> None:
    async def main() -> None:
        tier = _Tier()
        first_commit = asyncio.Event()

        async def before(i: int) -> None:  # message 1 comes once batch 0 commits alone
            if i == 1:
                await first_commit.wait()

        async def commit(batches: list[PutBatch]) -> list[PutResult]:
            results = await tier.commit(batches)
            first_commit.set()
            return results

        stream = committed(_requests(2, before), _plan, commit, 4)
        batch, _ = await stream.__anext__()
        assert batch.hashes == _batch(0).hashes
        # Batch 0's reply is still being written: batch 1's commit goes ahead meanwhile.
        await asyncio.wait_for(tier.second.wait(), DEADLINE_S)
        assert [b.hashes for b, _ in [pair async for pair in stream]] == [_batch(1).hashes]
        assert tier.groups == [[0], [1]]

    asyncio.run(main())


@pytest.mark.parametrize("where", ["plan", "receive", "commit"])
def test_the_first_error_ends_the_stream_after_the_batches_before_it(where: str) -> None:
    gate = asyncio.Event()

    def plan(i: int) -> PutBatch:
        if where == "plan" and i == 3:
            raise ValueError("bad batch 3")
        return _batch(i)

    async def before(i: int) -> None:
        if i == 1:  # batch 0 commits alone, so a failing second commit has batches behind it
            await gate.wait()
        if where == "receive" and i == 3:
            raise ValueError("undecodable message 3")

    async def main() -> tuple[list[int], _Tier]:
        tier = _Tier(fail_at=1 if where == "commit" else None)

        async def commit(batches: list[PutBatch]) -> list[PutResult]:
            try:
                return await tier.commit(batches)
            finally:
                gate.set()

        seen: list[int] = []
        with pytest.raises((ValueError, RuntimeError)):
            async for batch, _ in committed(_requests(8, before), plan, commit, 4):
                seen.append(int.from_bytes(batch.hashes[0], "big"))
        return seen, tier

    seen, tier = asyncio.run(main())
    if where == "commit":
        assert seen == [0] == tier.committed()
    else:
        assert seen == [0, 1, 2] == tier.committed()


def test_a_group_is_answered_after_its_flush_and_the_next_written_meanwhile() -> None:
    # R34-R35 (docs/RETENTION.md): with a two-step store, a group's replies wait for its flush, and the next
    # group's transaction is written while the disk flushes the last.
    async def main() -> None:
        tier, flushed, first = _Tier(), set[int](), asyncio.Event()

        async def commit(batches: list[PutBatch]) -> tuple[int, list[PutResult]]:
            results = await tier.commit(batches)
            first.set()
            return len(tier.groups) - 1, results

        async def durable(pending: tuple[int, list[PutResult]]) -> list[PutResult]:
            group, results = pending
            if group == 0:  # the first flush ends only once the second group was committed beside it
                await asyncio.wait_for(tier.second.wait(), DEADLINE_S)
            flushed.add(group)
            return results

        seen = []
        async for batch, _ in committed(_requests(6, lambda i: first.wait() if i == 1 else None), _plan, commit,
                                        4, durable):
            i = int.from_bytes(batch.hashes[0], "big")
            assert next(g for g, ids in enumerate(tier.groups) if i in ids) in flushed  # acknowledged = durable
            seen.append(i)
        assert seen == list(range(6))
        assert len(tier.groups) >= 2

    asyncio.run(main())
