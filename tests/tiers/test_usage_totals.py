"""R14: the usage totals (blocks and bytes stored) agree with the records, whatever aborts or races."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import pytest

from kvstore.errors import FailedPrecondition
from tests.waiting import wait_until
from tiers import usage
from tiers.lmdb_tier import PutBatch

Kit = Any  # tests/tiers/conftest.py


def recounted(kit: Kit) -> tuple[int, int]:
    with kit.tier.env.begin(buffers=True) as txn:
        counted = usage.recount(txn, kit.tier._records)
    return counted.blocks, counted.stored_bytes


def persisted(kit: Kit) -> tuple[int, int]:
    with kit.tier.env.begin() as txn:
        u = usage.read_usage(txn, kit.tier._state)
    return u.blocks, u.stored_bytes


def in_memory(kit: Kit) -> tuple[int, int]:
    s = kit.tier.stats()
    return s.blocks_stored, s.bytes_stored


class WriterCount:
    """An LMDB environment that counts the write txns asked of it (`asked`); the rest as the real one."""

    def __init__(self, env: Any) -> None:
        self.env = env
        self.asked = 0

    def begin(self, *args: Any, **kwargs: Any) -> Any:
        """The real `begin`, counted when it asks for a write txn."""
        if kwargs.get("write"):
            self.asked += 1
        return self.env.begin(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.env, name)


def _in_futex_wait(thread: threading.Thread) -> bool:
    """Whether `thread` sleeps in a futex wait (syscall 202 on x86-64: a lock it waits for)."""
    with open(f"/proc/self/task/{thread.native_id}/syscall") as f:
        return f.read().split()[0] == "202"


def _run(fn: Callable[..., object], args: tuple[Any, ...], errors: list[BaseException]) -> None:
    try:
        fn(*args)
    except FailedPrecondition:
        pass
    except BaseException as exc:
        errors.append(exc)


def test_r14_an_aborted_put_never_writes_back_stale_totals(make_kit: Callable[..., Kit]) -> None:
    # Issue 9, item 2: a Put that aborts while another thread's Put commits must not
    # restore the totals it saw before waiting for LMDB's writer lock.
    kit = make_kit(1000)
    for round_ in range(8):
        good = kit.chain(10_000 * round_, 3)
        doomed = [
            PutBatch(scope=kit.scope, parent_hash=kit.root, hashes=kit.chain(10_000 * round_ + 5000, 2),
                     blocks=[kit.data(0), kit.data(1)], is_root=True),
            PutBatch(scope=kit.scope, parent_hash=b"\x09" * 32, hashes=kit.chain(99, 1), blocks=[kit.data(2)],
                     is_root=False),  # its parent is absent: the whole group aborts
        ]
        held = kit.tier.env.begin(write=True)  # both Puts queue behind the writer lock
        errors: list[BaseException] = []
        threads = [threading.Thread(target=_run, args=(kit.put, (good,), errors)),
                   threading.Thread(target=_run, args=(kit.tier.put_many, (doomed,), errors))]
        env, kit.tier.env = kit.tier.env, WriterCount(kit.tier.env)
        try:
            for t in threads:
                t.start()
            # Both reach the lock: each has asked LMDB for its write txn and sleeps in the kernel (py-lmdb
            # lets the GIL go around it). The assertions hold whatever the order; this makes it the race.
            wait_until(lambda ts=threads: kit.tier.env.asked == 2 and all(_in_futex_wait(t) for t in ts),
                       "the two Puts never both waited for LMDB's writer lock")
        finally:
            kit.tier.env = env
            held.abort()
            for t in threads:
                t.join()
        assert not errors
        assert in_memory(kit) == persisted(kit) == recounted(kit) == (3 * (round_ + 1), 3 * 1024 * (round_ + 1))
    kit.tier.close()
    again = make_kit(1000)
    assert in_memory(again) == (24, 24 * 1024)


def test_r14_concurrent_puts_and_evictions_keep_the_totals(make_kit: Callable[..., Kit], clock: Any) -> None:
    kit = make_kit(40)
    for i in range(4):
        kit.put(kit.chain(1000 * i, 10))
    clock.advance(100 * 3600)

    errors: list[BaseException] = []

    def writer(base: int) -> None:
        try:
            for j in range(5):
                kit.put(kit.chain(base + 100 * j, 2))  # 40 new blocks in all: every old one goes
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=writer, args=(100_000 * (i + 1),)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert in_memory(kit) == persisted(kit) == recounted(kit) == (40, 40 * 1024)


def test_r14_wrong_totals_are_repaired_at_open(make_kit: Callable[..., Kit], caplog: pytest.LogCaptureFixture) -> None:
    kit = make_kit()
    kit.put(kit.chain(0, 3))
    kit.tier.close()
    with kit.tier.env.__class__(str(kit.tier.settings.data_dir), max_dbs=8) as env, env.begin(write=True) as txn:
        usage.write_usage(txn, env.open_db(b"state", txn=txn), usage.Usage(blocks=0, stored_bytes=0))
    with caplog.at_level(logging.WARNING, logger="tiers.usage"):
        again = make_kit()
    assert in_memory(again) == persisted(again) == (3, 3 * 1024)
    assert "repaired" in caplog.text
