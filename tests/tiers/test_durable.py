"""tiers/durable.py (docs/RETENTION.md R34-R36): commits flushed outside LMDB's write lock, one at most not
yet durable, and the roll back at start of a commit a crash left not durable."""

from __future__ import annotations

import asyncio
import logging
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lmdb
import pytest

from kvstore.config import StoreSettings
from kvstore.errors import Unavailable
from tests.tiers.conftest import KIT_BLOCK, KIT_TOKENS, Kit
from tiers.block_txn import PutBatch
from tiers.datadir import DATA_NAME
from tiers.durable import CLOSED, MARKER_NAME, OPEN, DurableCommits, read_marker
from tiers.lmdb_pages import read_headers
from tiers.lmdb_tier import LmdbBlockTier

DEADLINE_S = 30.0


def _batch(kit: Kit, hashes: list[bytes], start: int = 0) -> PutBatch:
    parent = kit.root if start == 0 else hashes[start - 1]
    return PutBatch(scope=kit.scope, parent_hash=parent, hashes=hashes[start:],
                    blocks=[kit.data(i) for i in range(start, len(hashes))], is_root=start == 0)


def _crash_image(data_dir: Path, into: Path) -> Path:
    """What a `kill -9` leaves: the files as the kernel holds them now (the tier stays open)."""
    into.mkdir()
    for name in (DATA_NAME, MARKER_NAME, "kvstore-identity.json"):
        shutil.copyfile(data_dir / name, into / name)
    return into


def _settings(data_dir: Path) -> StoreSettings:
    return StoreSettings(data_dir=data_dir, capacity_bytes=64 * KIT_BLOCK, block_tokens=KIT_TOKENS)


def test_r34_a_commit_is_durable_only_once_flushed_and_marked(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit(64)
    a = kit.chain(0, 2)
    committed = kit.tier.commit_many([_batch(kit, a)])
    marker = read_marker(kit.tier.settings.data_dir)
    assert marker is not None and marker[0] == committed.txn_id - 1  # committed, not yet durable
    assert kit.tier.wait_durable(committed)[0].written_blocks == 2
    assert read_marker(kit.tier.settings.data_dir) == (committed.txn_id, OPEN)


def test_r34_a_group_commits_answer_waits_on_the_flusher_not_an_executor_thread(
        make_kit: Callable[..., Kit], monkeypatch: pytest.MonkeyPatch) -> None:
    kit = make_kit(64)
    committed = kit.tier.commit_many([_batch(kit, kit.chain(0, 2))])
    taken: list[Any] = []
    monkeypatch.setattr(kit.tier.executor, "submit", lambda *a, **k: taken.append(a))  # no thread to wait in
    results = asyncio.run(asyncio.wait_for(kit.tier.durable(committed), DEADLINE_S))
    assert results[0].written_blocks == 2 and taken == []
    assert read_marker(kit.tier.settings.data_dir) == (committed.txn_id, OPEN)


def test_r35_a_commit_flushes_the_one_before_it_first(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit(64)
    a, b = kit.chain(0, 2), kit.chain(500, 2)
    first = kit.tier.commit_many([_batch(kit, a)])
    second = kit.tier.commit_many([_batch(kit, b)])
    # The second transaction wrote its pages only once the first was durable; itself it is not yet.
    assert read_marker(kit.tier.settings.data_dir) == (first.txn_id, OPEN)
    assert second.txn_id == first.txn_id + 1


def test_r36_a_commit_a_crash_left_not_durable_is_rolled_back(make_kit: Callable[..., Kit], tmp_path: Path,
                                                              open_tier: Callable[..., LmdbBlockTier]) -> None:
    kit = make_kit(64)
    acked, pending = kit.chain(0, 3), kit.chain(900, 2)
    kit.put(acked)
    kit.tier.commit_many([_batch(kit, pending)])  # committed, never flushed: the process dies here
    image = _crash_image(kit.tier.settings.data_dir, tmp_path / "after-crash")
    after = Kit(open_tier(_settings(image)))
    assert after.stored(acked) == [True] * 3
    assert after.stored(pending) == [False] * 2  # never acknowledged: rolled back
    after.put(pending)  # and the store writes on from there
    assert after.found(pending) == 2


def test_r36_a_commit_flushed_but_not_yet_marked_is_kept_and_the_one_after_it_rolled_back(
        make_kit: Callable[..., Kit], tmp_path: Path, open_tier: Callable[..., LmdbBlockTier]) -> None:
    # The mark follows the flush while the next commit is written (R35): a crash may leave the marker one behind.
    kit = make_kit(64)
    acked, flushed, pending = kit.chain(0, 3), kit.chain(500, 2), kit.chain(900, 2)
    kit.put(acked)
    data_dir = kit.tier.settings.data_dir
    marker_then = (data_dir / MARKER_NAME).read_bytes()
    kit.tier.commit_many([_batch(kit, flushed)])
    kit.tier.commit_many([_batch(kit, pending)])  # flushes the one before it first
    image = _crash_image(data_dir, tmp_path / "after-crash")
    (image / MARKER_NAME).write_bytes(marker_then)  # its mark had not reached the disk
    after = Kit(open_tier(_settings(image)))
    assert after.stored(acked) == [True] * 3 and after.stored(flushed) == [True] * 2
    assert after.stored(pending) == [False] * 2


def test_r36_pages_a_power_cut_never_wrote_do_not_matter_once_rolled_back(
        make_kit: Callable[..., Kit], tmp_path: Path, open_tier: Callable[..., LmdbBlockTier]) -> None:
    kit = make_kit(64)
    acked, pending = kit.chain(0, 3), kit.chain(900, 20)
    kit.put(acked)
    kit.tier.commit_many([_batch(kit, pending)])
    image = _crash_image(kit.tier.settings.data_dir, tmp_path / "after-power-cut")
    data = image / DATA_NAME
    newest, other = sorted(read_headers(data), key=lambda h: -h.txn_id)
    # The meta page reached the disk, the pages it appended did not.
    with data.open("r+b") as f:
        f.seek((other.last_page + 1) * other.page_size)
        f.write(bytes((newest.last_page - other.last_page) * other.page_size))
    after = Kit(open_tier(_settings(image)))
    assert after.stored(acked) == [True] * 3
    assert after.found(acked) == 3
    assert after.stored(pending) == [False] * 20


def test_r36_a_store_closed_cleanly_trusts_what_wrote_it_since(make_kit: Callable[..., Kit]) -> None:
    kit = make_kit(64)
    kit.put(kit.chain(0, 2))
    data_dir = kit.tier.settings.data_dir
    kit.tier.close()
    assert read_marker(data_dir) == (max(h.txn_id for h in read_headers(data_dir / DATA_NAME)), CLOSED)
    env = lmdb.open(str(data_dir), max_dbs=8)  # one commit by something else (a tool), after the clean close
    with env.begin(write=True) as txn:
        txn.put(b"written-by-a-tool", b"1", db=env.open_db(b"state", txn=txn))
    env.close()
    after = make_kit(64)
    with after.tier.env.begin() as txn:
        assert txn.get(b"written-by-a-tool", db=after.tier._state) == b"1"


@pytest.mark.parametrize("damage", ["bytes", "huge", "folder"])
def test_r36_a_damaged_marker_is_set_aside_and_the_store_opens(make_kit: Callable[..., Kit],
                                                               caplog: pytest.LogCaptureFixture, damage: str) -> None:
    kit = make_kit(64)
    a = kit.chain(0, 2)
    kit.put(a)
    data_dir = kit.tier.settings.data_dir
    kit.tier.close()
    marker = data_dir / MARKER_NAME
    if damage == "folder":
        marker.unlink()
        marker.mkdir()
    else:
        marker.write_bytes(b"not a marker" * (1 << 20 if damage == "huge" else 1))
    with caplog.at_level(logging.WARNING, logger="tiers.durable"):
        after = make_kit(64)
    assert after.stored(a) == [True, True]
    assert (data_dir / (MARKER_NAME + ".damaged")).exists()
    assert any("set aside" in r.getMessage() for r in caplog.records)
    assert read_marker(data_dir) is not None


class _FailingSync:
    """The store's environment, whose flushes fail once `fail` is set (a disk that errs)."""

    def __init__(self, env: lmdb.Environment) -> None:
        self.env = env
        self.fail = threading.Event()

    def sync(self, force: bool = False) -> None:
        if self.fail.is_set():
            raise lmdb.Error("mdb_env_sync: Input/output error")
        self.env.sync(force)

    def info(self) -> dict[str, Any]:
        return self.env.info()


def test_r34_a_failed_flush_acknowledges_nothing_and_stops_writes(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), sync=False, max_dbs=2)
    try:
        failing = _FailingSync(env)
        commits = DurableCommits(failing, tmp_path)  # type: ignore[arg-type]
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v")
            txn_id = txn.id()
            commits.before_commit(txn_id)
        commits.committed(txn_id)
        failing.fail.set()
        with pytest.raises(Unavailable, match="failed to flush"):
            commits.wait(txn_id)
        failing.fail.clear()  # a later flush that works does not make the store trusted again
        with pytest.raises(Unavailable):
            commits.before_commit(txn_id + 1)
        assert read_marker(tmp_path) == (txn_id - 1, OPEN)
        commits.close()
    finally:
        env.close()


def test_r34_what_waits_for_a_commit_runs_once_it_is_durable_not_before(tmp_path: Path) -> None:
    env = lmdb.open(str(tmp_path), sync=False, max_dbs=2)
    try:
        commits = DurableCommits(env, tmp_path)
        ran: list[int] = []
        with env.begin(write=True) as txn:
            txn.put(b"k", b"v")
            txn_id = txn.id()
            commits.before_commit(txn_id)
        commits.committed(txn_id, lambda error: ran.append(txn_id))
        assert ran == []  # committed: not yet to be heard of (E1)
        commits.wait(txn_id)
        assert ran == [txn_id]
        commits.close()
    finally:
        env.close()
