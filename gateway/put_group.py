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

The group lives on the tier's executor's threads, not on the event loop: one thread at a time is the
committer, and it both plans and commits. A unary Put's plan (its checks, its chain's hashes, its
checksums) is queued on the loop; the Put that finds no committer submits one call to the executor
(`_commit_all`), which plans whatever is queued, commits it as a group, and goes on while more arrive.
The Puts that arrive while it runs only queue their plan: no thread is woken for them. Each group's
results go back to the event loop in one callback. So a Put costs the loop a queued plan, and a group
one hop to a thread and one wake-up: planning each Put on a thread of its own (as 895adc3 did) woke a
thread per Put, which then fought the committer and the loop for the GIL (docs/BENCHMARKS.md, `bench
load`: a Put's commit under 16 clients).

On a store with `PipelinedPuts` (docs/RETENTION.md R34-R35) the committer leaves each committed group's
answers to the store's flusher (they go once the group is durable) and goes on to the next group's
transaction while the disk writes this one.
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

from tiers.durable import Committed
from tiers.store import BlockStore, PipelinedPuts, PutBatch, PutResult

#: Batches committed in one transaction at most: a group's size bounds its commit's time (and so the
#: wait of the Puts queued behind it); the rest wait for the next.
MAX_GROUP_BATCHES = 32

#: What a caller awaits: its batch and that batch's result.
_Outcome = tuple[PutBatch, PutResult]
#: A batch queued for a commit, with the loop and the future its caller awaits.
_Queued = tuple[PutBatch, asyncio.AbstractEventLoop, asyncio.Future[_Outcome]]
#: A plan queued for the committer (run in its caller's context), with its caller's loop and future.
_Planned = tuple[Callable[[], PutBatch], asyncio.AbstractEventLoop, asyncio.Future[_Outcome]]
#: A caller's future with its outcome or its error.
_Settled = tuple[asyncio.Future[_Outcome], _Outcome | None, BaseException | None]


class PutGroups:
    """Commits Put batches on `store` in groups: one commit in flight, the next one taking every batch
    that arrived meanwhile (at most `max_batches`). The committer runs on the store's executor (its
    `executor` attribute when it has one, else through `call`) and plans the Puts queued for it.

    Args:
        store: where the batches are committed.
        max_batches: batches in one commit at most.
    """

    def __init__(self, store: BlockStore, max_batches: int = MAX_GROUP_BATCHES) -> None:
        self.store = store
        self.max_batches = max_batches
        self._lock = threading.Lock()  # the queues and the committer's flag, shared by the loop and the committer
        self._waiting: list[_Queued] = []  # planned batches, in order
        self._plans: list[_Planned] = []  # plans the committer runs before its next commit, in order
        self._committing = False  # a committer is running (it takes whatever is queued)
        executor = getattr(store, "executor", None)
        self._executor = executor if isinstance(executor, Executor) else None
        self._calls: set[asyncio.Future[None]] = set()  # `call`s in flight, for a store without an executor
        self._pipelined = store if isinstance(store, PipelinedPuts) and self._executor is not None else None

    @property
    def waiting(self) -> int:
        """Batches queued for the next commit, planned or not (not counting the commit running)."""
        return len(self._waiting) + len(self._plans)

    async def put(self, batch: PutBatch) -> PutResult:
        """Commit `batch` with whatever else is waiting; its result once durable.

        Raises:
            whatever committing `batch` alone raises (FailedPrecondition, ResourceExhausted, DataLoss...).
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Outcome] = loop.create_future()
        # Queued now, on the loop: a batch put before another is in the same group or an earlier one.
        with self._lock:
            self._waiting.append((batch, loop, done))
            start = self._take_commit()
        if start:
            self._submit(self._commit_all)
        # A caller gone (cancelled) leaves its batch in the group: it is stored or refused all the same,
        # as a Put whose commit had started always was; its result goes nowhere (`_settle`).
        return (await done)[1]

    async def plan_and_put(self, plan: Callable[[], PutBatch]) -> _Outcome:
        """`plan()`'s batch (a blocking call: its checks and hashes), committed with whatever else is waiting,
        both on the store's executor, by the committer; the batch and its result once durable.

        Raises:
            whatever `plan()` raises, or committing its batch alone raises.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future[_Outcome] = loop.create_future()
        # In the caller's context, as `asyncio.to_thread` runs it: the plan reads the call's caller (its tenant).
        in_context = functools.partial(contextvars.copy_context().run, plan)
        with self._lock:
            self._plans.append((in_context, loop, done))
            start = self._take_commit()
        if start:  # else the running committer plans it before its next commit: no thread woken for it
            self._submit(self._commit_all)
        return await done

    def _take_commit(self) -> bool:
        """Under the lock: True when the caller is to start a committer (none is running)."""
        if self._committing:
            return False
        self._committing = True
        return True

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        """Run `fn(*args)` on the store's executor; nothing awaits it (it settles its callers' futures)."""
        if self._executor is not None:
            self._executor.submit(fn, *args)
            return
        call = asyncio.ensure_future(self.store.call(fn, *args))
        self._calls.add(call)
        call.add_done_callback(self._calls.discard)

    def _commit_all(self) -> None:
        """On the executor: plan what is queued and commit groups until nothing is."""
        try:
            self._drain()
        except BaseException:  # not a plan's or a commit's own error (those go to their callers): the next Put
            with self._lock:   # starts a committer again, which takes what is still queued
                self._committing = False
            raise

    def _drain(self) -> None:
        while True:
            with self._lock:  # checked and given up together: a Put queued after this finds no committer
                plans, self._plans = self._plans, []
                if not plans and not self._waiting:
                    self._committing = False
                    return
            if plans:
                self._plan_each(plans)
            with self._lock:
                group, self._waiting = self._waiting[:self.max_batches], self._waiting[self.max_batches:]
            if group:
                self._commit(group)

    def _plan_each(self, plans: list[_Planned]) -> None:
        """Run each plan; its batch queued for the next commit, or its own error sent to its caller."""
        planned: list[_Queued] = []
        refused: list[tuple[asyncio.AbstractEventLoop, _Settled]] = []
        for plan, loop, done in plans:
            if done.cancelled():  # the caller left before its batch was planned: not stored, as before
                continue
            try:
                planned.append((plan(), loop, done))
            except Exception as exc:
                refused.append((loop, (done, None, exc)))
        with self._lock:
            self._waiting.extend(planned)
        for loop, settled in refused:
            _post(loop, [settled])

    def _commit(self, group: list[_Queued]) -> None:
        """One commit for `group`; if it fails and holds more than one batch, each batch alone."""
        try:
            if self._pipelined is not None:  # answered once durable (`_answer`, from the store's flusher)
                committed = self._pipelined.commit_many([batch for batch, _, _ in group])
                self._pipelined.on_durable(committed, functools.partial(self._answer, group, committed))
                return
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

    @staticmethod
    def _answer(group: list[_Queued], committed: Committed[list[PutResult]], error: BaseException | None) -> None:
        """`group`'s answers once its commit is durable (R34); the flush's error to each when it failed."""
        if error is not None:
            _post(group[0][1], [(done, None, error) for _, _, done in group])
            return
        _post(group[0][1], [(done, (batch, result), None)
                            for (batch, _, done), result in zip(group, committed.value, strict=True)])


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
