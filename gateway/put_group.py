"""Group commit across unary Put calls: the batches of the Puts that arrive while a commit runs are
committed together in the next one (one write transaction, one fsync), each acknowledged only once
the commit holding it is durable.

Each unary Put used to be its own transaction: under load every Put queued for LMDB's one writer and
paid a whole fsync (`kvstore bench load`, 16 clients on the 2-core box: Put's p50 64-70 ms, 0.2x the
echo's, most of a cycle). PutStream already commits the batches waiting behind a commit together;
this does the same for the Puts of many callers.

A group is all or none (`BlockStore.put_many`): when it fails, each of its batches is committed
again alone, so every caller gets its own result or its own error (a parent not stored, a quota)
and no batch is refused for another's fault.

The group lives on the tier's executor's threads, not on the event loop: a unary Put's plan (its checks,
its chain's hashes, its checksums) and its commit run in one executor call (`plan_and_put`). The call
that finds no commit running commits the group, and every group after it while more batches wait; the
others queue their batch and return. Each group's results go back to the event loop in one callback. So a
Put costs the loop one hop to a thread and at most one wake-up, where a plan on `asyncio.to_thread`
followed by a commit through `BlockStore.call` cost two of each (docs/BENCHMARKS.md, `bench load`'s budget:
the two hops' wake-ups ~180 us of a serial Put's server time).
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import threading
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from tiers.store import BlockStore, PutBatch, PutResult

#: Batches committed in one transaction at most: a group's size bounds its commit's time (and so the
#: wait of the Puts queued behind it); the rest wait for the next.
MAX_GROUP_BATCHES = 32

#: What a caller awaits: its batch and that batch's result.
_Outcome = tuple[PutBatch, PutResult]
#: A batch queued for a commit, with the loop and the future its caller awaits.
_Queued = tuple[PutBatch, asyncio.AbstractEventLoop, asyncio.Future[_Outcome]]
#: A caller's future with its outcome or its error.
_Settled = tuple[asyncio.Future[_Outcome], _Outcome | None, BaseException | None]


class PutGroups:
    """Commits Put batches on `store` in groups: one commit in flight, the next one taking every batch
    that arrived meanwhile (at most `max_batches`). The commits run on the store's executor (its
    `executor` attribute when it has one, else through `call`).

    Args:
        store: where the batches are committed.
        max_batches: batches in one commit at most.
    """

    def __init__(self, store: BlockStore, max_batches: int = MAX_GROUP_BATCHES) -> None:
        self.store = store
        self.max_batches = max_batches
        self._lock = threading.Lock()  # the queue and the committer's flag, shared by the executor's threads
        self._waiting: list[_Queued] = []
        self._committing = False  # a thread is committing groups (it takes whatever is queued)
        executor = getattr(store, "executor", None)
        self._executor = executor if isinstance(executor, Executor) else None
        self._calls: set[asyncio.Future[None]] = set()  # `call`s in flight, for a store without an executor

    @property
    def waiting(self) -> int:
        """Batches queued for the next commit (not counting the one running)."""
        return len(self._waiting)

    async def put(self, batch: PutBatch) -> PutResult:
        """Commit `batch` with whatever else is waiting; its result once durable.

        Raises:
            whatever committing `batch` alone raises (FailedPrecondition, ResourceExhausted, DataLoss...).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Outcome] = loop.create_future()
        # Queued now, on the loop: a batch put before another is in the same group or an earlier one.
        if self._queue(batch, loop, done):
            self._submit(self._commit_all)
        # A caller gone (cancelled) leaves its batch in the group: it is stored or refused all the same,
        # as a Put whose commit had started always was; its result goes nowhere (`_settle`).
        return (await done)[1]

    async def plan_and_put(self, plan: Callable[[], PutBatch]) -> _Outcome:
        """`plan()`'s batch (a blocking call: its checks and hashes), committed with whatever else is waiting,
        both in one call on the store's executor; the batch and its result once durable.

        Raises:
            whatever `plan()` raises, or committing its batch alone raises.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Outcome] = loop.create_future()
        # In the caller's context, as `asyncio.to_thread` runs it: the plan reads the call's caller (its tenant).
        in_context = functools.partial(contextvars.copy_context().run, plan)
        self._submit(self._plan_then_queue, in_context, loop, done)
        return await done

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the store's executor; nothing awaits it (it settles its callers' futures)."""
        if self._executor is not None:
            self._executor.submit(fn, *args)
            return
        call = asyncio.ensure_future(self.store.call(fn, *args))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    def _plan_then_queue(self, plan: Callable[[], PutBatch], loop: asyncio.AbstractEventLoop,
                         done: asyncio.Future[_Outcome]) -> None:
        """On the executor: plan the batch, queue it, and commit if no thread is committing."""
        try:
            batch = plan()
        except Exception as exc:
            _post(loop, [(done, None, exc)])
            return
        if done.cancelled():  # the caller left before its batch was planned: not stored, as before
            return
        if self._queue(batch, loop, done):
            self._commit_all()

    def _queue(self, batch: PutBatch, loop: asyncio.AbstractEventLoop, done: asyncio.Future[_Outcome]) -> bool:
        """Queue a batch for the next commit; True when the caller is to commit (no thread is)."""
        with self._lock:
            self._waiting.append((batch, loop, done))
            if self._committing:
                return False
            self._committing = True
            return True

    def _commit_all(self) -> None:
        """On the executor: commit groups until none is waiting."""
        while True:
            with self._lock:  # checked and given up together: a batch queued after this finds no committer
                if not self._waiting:
                    self._committing = False
                    return
                group, self._waiting = self._waiting[:self.max_batches], self._waiting[self.max_batches:]
            self._commit(group)

    def _commit(self, group: list[_Queued]) -> None:
        """One commit for `group`; if it fails and holds more than one batch, each batch alone."""
        try:
            results = self.store.put_many([batch for batch, _, _ in group])
        except Exception as exc:
            if len(group) == 1:
                _post(group[0][1], [(group[0][2], None, exc)])
                return
            settled: list[_Settled] = []
            for batch, _, done in group:  # whose fault it was: each alone, in order
                try:
                    settled.append((done, (batch, self.store.put_many([batch])[0]), None))
                except Exception as alone:
                    settled.append((done, None, alone))
            _post(group[0][1], settled)
            return
        _post(group[0][1], [(done, (batch, result), None)
                            for (batch, _, done), result in zip(group, results, strict=True)])


def _post(loop: asyncio.AbstractEventLoop, settled: list[_Settled]) -> None:
    """Resolve callers' futures on their loop, in one callback (one wake-up of the loop for a group)."""
    with contextlib.suppress(RuntimeError):  # the loop is closed (the server stopped): no one is left to answer
        loop.call_soon_threadsafe(_settle_all, settled)


def _settle_all(settled: list[_Settled]) -> None:
    for done, outcome, error in settled:
        _settle(done, result=outcome, error=error)


def _settle(done: asyncio.Future[_Outcome], *, result: _Outcome | None = None,
            error: BaseException | None = None) -> None:
    """Resolve a caller's future (nothing when it is already resolved or cancelled)."""
    if done.done():
        return
    if error is not None:
        done.set_exception(error)
    else:
        assert result is not None
        done.set_result(result)
