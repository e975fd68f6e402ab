"""A PutStream on a node: receive, plan, commit and acknowledge, each stage beside the others.

The stages, in order for every batch: gRPC receives the message (on the event loop); `plan`
checks it, hashes its tokens into the chain and takes its blocks' checksums (on a thread); the
tier commits it, durably, with the batches already planned when the previous commit ended (group
commit: one fsync for several); its reply goes out. A batch's parent is always committed before
or with it, and a batch is acknowledged only once its commit has returned (acknowledged = durable).

The stages overlap (docs/BENCHMARKS.md, `bench store`, the budget of session 24): the next message
is received while earlier ones are planned, up to `depth` plans running at once on threads, and the
next group's commit starts while the last group's replies are being written. Before, each stage
waited on its neighbour: a message was received only once the one before it was planned, and a
commit started only once every reply of the one before it had been sent, so the commit, the one
stage that cannot run twice at once (LMDB has one writer), sat idle between them.

A store with `PipelinedPuts` commits in two steps: the next group's transaction is written while the
disk flushes the last one (docs/RETENTION.md R34-R35), and a group's replies wait for its flush.

The stream ends with the first error, wherever it arose (a bad batch, an undecodable message, a
refused commit): the batches before it are committed and acknowledged, then it is raised.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, TypeVar

from tiers.durable import Committed
from tiers.store import BlockStore, PipelinedPuts, PutBatch, PutResult

R = TypeVar("R")
#: A planned batch, the error that ends the stream, or None: the requests ended.
_Planned = PutBatch | Exception | None


async def _planned(plan: Callable[[R], PutBatch], request: R) -> PutBatch | Exception:
    """`plan(request)` on a thread; its error returned, not raised (the committer raises it in its turn)."""
    try:
        return await asyncio.to_thread(plan, request)
    except Exception as exc:
        return exc


def _settled(item: _Planned) -> asyncio.Future[_Planned]:
    done: asyncio.Future[_Planned] = asyncio.get_running_loop().create_future()
    done.set_result(item)
    return done


#: A group's commit: its results, or (with a `Durable`) what that turns into its results once durable.
Commit = Callable[[list[PutBatch]], Awaitable[Any]]
Durable = Callable[[Any], Awaitable[Sequence[PutResult]]]


def store_commits(store: BlockStore) -> tuple[Commit, Durable | None]:
    """How a group commit writes to `store`: committed then durable where it has the two steps
    (`PipelinedPuts`), else `put_many` (durable when it returns); both on the store's executor."""
    if isinstance(store, PipelinedPuts):
        pipelined = store

        async def commit(batches: list[PutBatch]) -> Committed[list[PutResult]]:
            return await store.call(pipelined.commit_many, batches)

        return commit, pipelined.durable

    async def put(batches: list[PutBatch]) -> list[PutResult]:
        return await store.call(store.put_many, batches)

    return put, None


async def committed(requests: AsyncIterator[R], plan: Callable[[R], PutBatch], commit: Commit,
                    depth: int, durable: Durable | None = None) -> AsyncGenerator[tuple[PutBatch, PutResult], None]:
    """Each batch of `requests` with its result, in order, once its commit has returned (module docstring).

    Args:
        requests: the stream's requests.
        plan: a request's validated batch (blocking: run on a thread; it may run for several at once). A request
            that is a `PutBatch` was planned already (a TCP put's frame, on its connection's thread) and is not.
        commit: commits batches, in order, in one durable transaction (its results), or with `durable`, in one
            transaction whose results `durable` gives once it is durable.
        depth: requests received ahead of the commit, each planned or being planned (one committed
            group more may wait for its replies, or its flush, while the next commits).
        durable: see `commit`; None: `commit`'s results are durable when it returns.

    Raises:
        Exception: the first error of the stream, after every batch before it was yielded.
    """
    plans: asyncio.Queue[asyncio.Future[_Planned]] = asyncio.Queue(maxsize=depth)
    acks: asyncio.Queue[tuple[list[PutBatch], Any] | Exception | None] = asyncio.Queue(maxsize=1)

    async def receive() -> None:
        try:
            async for request in requests:  # a batch planned already (on a TCP put's connection thread) goes as is
                await plans.put(_settled(request) if isinstance(request, PutBatch)
                                else asyncio.ensure_future(_planned(plan, request)))
        except Exception as exc:  # an undecodable message: after the batches before it
            await plans.put(_settled(exc))
            return
        await plans.put(_settled(None))

    async def commit_all() -> None:
        held: asyncio.Future[_Planned] | None = None  # taken from the queue, not yet planned
        try:
            while True:
                item = await (held if held is not None else await plans.get())
                held = None
                if not isinstance(item, PutBatch):
                    await acks.put(item)
                    return
                batches = [item]
                while not plans.empty():  # group commit: the batches planned by now share this one
                    ahead = plans.get_nowait()
                    if not ahead.done() or not isinstance(ahead.result(), PutBatch):
                        held = ahead  # still planning, or the end: after this commit
                        break
                    batches.append(ahead.result())  # type: ignore[arg-type]
                results = await commit(batches)
                await acks.put((batches, results))
        except Exception as exc:  # a refused commit ends the stream
            await acks.put(exc)

    stages = [asyncio.ensure_future(receive()), asyncio.ensure_future(commit_all())]
    try:
        while True:
            done = await acks.get()
            if done is None:
                return
            if isinstance(done, Exception):
                raise done
            batches, results = done
            if durable is not None:  # R34: flushed before any reply (the next group is written meanwhile)
                results = await durable(results)
            for pair in zip(batches, results, strict=True):
                yield pair
    finally:
        for stage in stages:
            stage.cancel()
        _cancel_queued(plans)


def _cancel_queued(plans: asyncio.Queue[Any]) -> None:
    """Plans no commit will take: cancelled (a thread already running one finishes and is dropped)."""
    while not plans.empty():
        plans.get_nowait().cancel()
