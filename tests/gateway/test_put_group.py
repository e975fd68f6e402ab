"""`PutGroups`: Puts that arrive while a commit runs share the next one; a failing group is committed
again batch by batch, so each caller gets its own outcome. A real LMDB tier underneath; the first
commit is held (ordering, not timing) so that the others arrive while it runs."""

from __future__ import annotations

import asyncio
import contextvars
import gc
import os
import threading
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gateway.put_group import PutGroups
from kvstore.clock import ManualClock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition
from kvstore.geometry import V4_1_FLASH
from kvstore.prefix import BlockScope, chain_hashes, root_hash
from tests.waiting import wait_until
from tiers.durable import Committed
from tiers.lmdb_tier import LmdbBlockTier, ReadStatus
from tiers.store import PutBatch, PutResult

BLOCK = 1024
SCOPE = BlockScope(V4_1_FLASH.fingerprint, "default")
ROOT = root_hash(V4_1_FLASH.fingerprint, 16)


class CountedTier(LmdbBlockTier):
    """The real tier, counting its commits and holding the first until `let_go` is set."""

    def __init__(self, settings: StoreSettings, clock: ManualClock) -> None:
        super().__init__(settings, clock=clock)
        self.commits: list[int] = []  # batches in each put_many
        self.entered, self.let_go = threading.Event(), threading.Event()

    def commit_many(self, batches: Sequence[PutBatch]) -> Committed[list[PutResult]]:
        # The commit step (`put_many` commits through it too; the groups flush and answer after it: R34).
        self.commits.append(len(batches))
        if len(self.commits) == 1:
            self.entered.set()
            assert self.let_go.wait(30), "the test never released the first commit"
        return super().commit_many(batches)


@pytest.fixture
def tier(tmp_path: Path, clock: ManualClock) -> Iterator[CountedTier]:
    t = CountedTier(StoreSettings(data_dir=tmp_path / "store", capacity_bytes=1 << 24, block_tokens=16), clock)
    yield t
    t.let_go.set()
    t.close()


def batch(seed: int, *, parent: bytes = ROOT) -> PutBatch:
    hashes = chain_hashes(list(range(seed, seed + 32)), block_tokens=16, parent=parent)
    return PutBatch(scope=SCOPE, parent_hash=parent, hashes=hashes, blocks=[os.urandom(BLOCK)] * 2,
                    is_root=parent == ROOT)


async def first_held_then(tier: CountedTier, groups: PutGroups, later: list[PutBatch]) -> list[Any]:
    """Put one batch, and while its commit is held put `later`; every outcome (a result or an error)."""
    first = asyncio.ensure_future(groups.put(batch(10_000)))
    assert await asyncio.to_thread(tier.entered.wait, 30)
    rest = [asyncio.ensure_future(groups.put(b)) for b in later]
    await asyncio.sleep(0)  # let them queue (no timing: they are queued once they ran to their await)
    tier.let_go.set()
    # The timeout only ends a wait that would never end (a caller left unanswered).
    return await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 30)


def test_puts_waiting_behind_a_commit_share_the_next(tier: CountedTier) -> None:
    later = [batch(i * 100) for i in range(5)]
    outcomes = asyncio.run(first_held_then(tier, PutGroups(tier), later))
    assert tier.commits == [1, 5]  # the five that waited went in one transaction
    assert [r.written_blocks for r in outcomes] == [2] * 6
    keys = [SCOPE.key(h) for b in later for h in b.hashes]
    assert [s for s, _ in tier.read(keys)] == [ReadStatus.FOUND] * len(keys)


def test_a_group_is_bounded(tier: CountedTier) -> None:
    asyncio.run(first_held_then(tier, PutGroups(tier, max_batches=2), [batch(i * 100) for i in range(5)]))
    assert tier.commits == [1, 2, 2, 1]


def test_a_refused_batch_fails_alone_and_the_rest_of_its_group_is_stored(tier: CountedTier) -> None:
    orphan = batch(500, parent=b"\x07" * 32)  # its parent is not stored: FailedPrecondition
    later = [batch(0), orphan, batch(100)]
    outcomes = asyncio.run(first_held_then(tier, PutGroups(tier), later))
    assert isinstance(outcomes[2], FailedPrecondition)
    assert [outcomes[i].written_blocks for i in (0, 1, 3)] == [2, 2, 2]
    assert tier.commits == [1, 3, 1, 1, 1]  # the group failed whole, then each batch alone
    keys = [SCOPE.key(h) for b in (later[0], later[2]) for h in b.hashes]
    assert [s for s, _ in tier.read(keys)] == [ReadStatus.FOUND] * 4
    assert tier.read([SCOPE.key(orphan.hashes[0])])[0][0] is ReadStatus.MISSING


def test_the_servers_unary_puts_share_a_commit_while_one_runs(server: Any) -> None:
    """Wired into the Put handler: clients' unary Puts that arrive during a commit go in the next one together."""
    from concurrent.futures import ThreadPoolExecutor

    from kvstore.client import Client

    tier, commits = server.tier, []
    entered, let_go = threading.Event(), threading.Event()
    real = tier.commit_many

    def held_first(batches: Sequence[PutBatch]) -> Committed[list[PutResult]]:
        commits.append(len(batches))
        if len(commits) == 1:
            entered.set()
            assert let_go.wait(30), "the test never released the first commit"
        return real(batches)

    tier.commit_many = held_first  # the instance's own: what the handler's group calls
    with Client(server.target) as client, ThreadPoolExecutor(3) as pool:
        def put(seed: int) -> Any:
            tokens = list(range(seed, seed + client.block_tokens * 2))
            return client.put(tokens, [os.urandom(client.block_bytes) for _ in range(2)])

        first = pool.submit(put, 0)
        assert entered.wait(30), first.exception(timeout=1)
        rest = [pool.submit(put, s) for s in (1_000, 2_000)]
        # Released once both are queued behind the held commit (the handler's group, found by its store).
        groups = next(g for g in gc.get_objects() if isinstance(g, PutGroups) and g.store is tier)
        deadline = time.monotonic() + 30
        while groups.waiting < 2:
            assert time.monotonic() < deadline, f"{groups.waiting} Puts queued behind the held commit"
            entered.wait(0.005)  # a condition polled with a deadline, not a timed wait for the outcome
        let_go.set()
        for f in [first, *rest]:
            f.result(timeout=30)
    assert commits == [1, 2], commits


def test_a_put_is_planned_and_committed_in_one_call_on_the_tiers_executor(tier: CountedTier) -> None:
    """One hop: with no commit running, the plan and the commit run in the same call, on the tier's thread."""
    tier.let_go.set()  # no commit held here
    threads: dict[str, int] = {}
    real = tier.commit_many

    def commit_many(batches: Sequence[PutBatch]) -> Committed[list[PutResult]]:
        threads["commit"] = threading.get_ident()
        return real(batches)

    tier.commit_many = commit_many  # type: ignore[method-assign]

    def plan() -> PutBatch:
        threads["plan"] = threading.get_ident()
        assert threading.current_thread().name.startswith("lmdb"), threading.current_thread().name
        return batch(0)

    async def main() -> tuple[PutBatch, PutResult]:
        return await PutGroups(tier).plan_and_put(plan)

    planned, result = asyncio.run(main())
    assert threads["plan"] == threads["commit"]
    assert result.written_blocks == 2 and planned.hashes == batch(0).hashes
    assert [s for s, _ in tier.read([SCOPE.key(h) for h in planned.hashes])] == [ReadStatus.FOUND] * 2


def test_puts_planned_while_a_commit_runs_share_the_next_and_a_bad_plan_fails_alone(tier: CountedTier) -> None:
    later = [batch(i * 100) for i in range(4)]

    def refused() -> PutBatch:
        raise FailedPrecondition("a plan's own error")

    async def main() -> list[Any]:
        groups = PutGroups(tier)
        first = asyncio.ensure_future(groups.plan_and_put(lambda: batch(10_000)))
        assert await asyncio.to_thread(tier.entered.wait, 30)
        plans: list[Any] = [(lambda b=b: b) for b in later]
        plans.insert(2, refused)
        rest = [asyncio.ensure_future(groups.plan_and_put(p)) for p in plans]
        # Queued for the committer, which plans them after the held commit: released once all five are queued.
        await asyncio.to_thread(wait_until, lambda: groups.waiting == 5, "five Puts queued")
        tier.let_go.set()
        return await asyncio.wait_for(asyncio.gather(first, *rest, return_exceptions=True), 30)

    outcomes = asyncio.run(main())
    assert isinstance(outcomes[3], FailedPrecondition) and "own error" in str(outcomes[3])
    stored = [o for i, o in enumerate(outcomes) if i != 3]
    assert [r.written_blocks for _, r in stored] == [2] * 5
    assert tier.commits == [1, 4]  # the four planned meanwhile went in one transaction
    assert sorted(b.hashes[0] for b, _ in stored[1:]) == sorted(b.hashes[0] for b in later)
    keys = [SCOPE.key(h) for b in later for h in b.hashes]
    assert [s for s, _ in tier.read(keys)] == [ReadStatus.FOUND] * len(keys)


def test_puts_queued_behind_a_commit_are_planned_by_its_thread_and_wake_no_other(tier: CountedTier) -> None:
    """While a commit runs, a Put only queues its plan: the committing thread plans them all after its commit
    (one executor call for the group), so no other LMDB thread is woken for them."""
    threads: list[int] = []
    submits: list[Any] = []
    real_submit = tier.executor.submit

    def counted_submit(fn: Any, *args: Any, **kwargs: Any) -> Any:
        submits.append(fn)
        return real_submit(fn, *args, **kwargs)

    tier.executor.submit = counted_submit  # type: ignore[method-assign,assignment]

    def plan_of(b: PutBatch) -> Any:
        def plan() -> PutBatch:
            threads.append(threading.get_ident())
            return b
        return plan

    async def main() -> list[Any]:
        groups = PutGroups(tier)
        first = asyncio.ensure_future(groups.plan_and_put(plan_of(batch(10_000))))
        assert await asyncio.to_thread(tier.entered.wait, 30)
        rest = [asyncio.ensure_future(groups.plan_and_put(plan_of(batch(i * 100)))) for i in range(3)]
        await asyncio.to_thread(wait_until, lambda: groups.waiting == 3, "three Puts queued")
        tier.let_go.set()
        return await asyncio.wait_for(asyncio.gather(first, *rest), 30)

    outcomes = asyncio.run(main())
    assert [r.written_blocks for _, r in outcomes] == [2] * 4
    assert tier.commits == [1, 3]
    # One executor call served the held commit and the group behind it (their answers go from the store's flusher).
    assert [fn.__name__ for fn in submits] == ["_commit_all"]
    assert len(threads) == 4 and len(set(threads)) == 1, threads  # every plan on the committing thread


def test_a_put_cancelled_before_its_plan_runs_is_not_stored(tier: CountedTier) -> None:
    """A caller gone while its plan waits behind a commit: its plan never runs and nothing of it is stored;
    the Puts queued with it are committed as usual."""
    planned: list[int] = []
    gone, kept = batch(100), batch(200)

    def plan_of(b: PutBatch, seed: int) -> Any:
        def plan() -> PutBatch:
            planned.append(seed)
            return b
        return plan

    async def main() -> Any:
        groups = PutGroups(tier)
        first = asyncio.ensure_future(groups.plan_and_put(plan_of(batch(10_000), 0)))
        assert await asyncio.to_thread(tier.entered.wait, 30)
        leaving = asyncio.ensure_future(groups.plan_and_put(plan_of(gone, 100)))
        staying = asyncio.ensure_future(groups.plan_and_put(plan_of(kept, 200)))
        await asyncio.to_thread(wait_until, lambda: groups.waiting == 2, "two Puts queued")
        leaving.cancel()
        await asyncio.gather(leaving, return_exceptions=True)
        tier.let_go.set()
        return await asyncio.wait_for(asyncio.gather(first, staying), 30)

    outcomes = asyncio.run(main())
    assert [r.written_blocks for _, r in outcomes] == [2, 2]
    assert planned == [0, 200] and tier.commits == [1, 1]
    assert tier.read([SCOPE.key(gone.hashes[0])])[0][0] is ReadStatus.MISSING
    assert tier.read([SCOPE.key(kept.hashes[0])])[0][0] is ReadStatus.FOUND


def test_a_put_is_planned_in_its_callers_context(tier: CountedTier) -> None:
    """The plan reads the call's context (its caller, hence its tenant's namespace), as on `asyncio.to_thread`."""
    tier.let_go.set()
    caller: contextvars.ContextVar[str] = contextvars.ContextVar("caller", default="nobody")
    seen: list[str] = []

    def plan() -> PutBatch:
        seen.append(caller.get())
        return batch(0)

    async def main() -> None:
        caller.set("acme")
        await PutGroups(tier).plan_and_put(plan)

    asyncio.run(main())
    assert seen == ["acme"]
