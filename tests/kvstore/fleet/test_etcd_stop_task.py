"""`kvstore.fleet.etcd.stop_task` (docs/FLEET.md F88): a task that loses a cancel (as one inside aetcd's watch
creation can, through Python 3.11's `asyncio.wait_for`) is cancelled again until it ends, so stopping a node's
etcd followers cannot wait forever."""

from __future__ import annotations

import asyncio

from kvstore.fleet.etcd import stop_task


def test_f88_a_task_that_swallows_its_first_cancel_is_cancelled_again_until_it_ends() -> None:
    cancels = []

    async def follower() -> None:
        while True:
            try:
                await asyncio.Event().wait()  # a watch that never ends on its own
            except asyncio.CancelledError:
                cancels.append(1)
                if len(cancels) < 2:
                    continue  # the first cancel lost, as wait_for can lose it
                raise

    async def main() -> None:
        task = asyncio.ensure_future(follower())
        await asyncio.sleep(0)
        await asyncio.wait_for(stop_task(task, again_s=0.01), 10)
        assert task.cancelled()

    asyncio.run(main())
    assert len(cancels) == 2


def test_f88_a_task_that_ends_on_its_first_cancel_is_cancelled_once() -> None:
    cancels = []

    async def follower() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            cancels.append(1)
            raise

    async def main() -> None:
        task = asyncio.ensure_future(follower())
        await asyncio.sleep(0)
        await stop_task(task, again_s=0.01)

    asyncio.run(main())
    assert cancels == [1]
