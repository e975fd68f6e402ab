"""`kvstore check`: walk a store's records, verify them, and repair what the walk finds.

The pins, the fleet's run index and the event log name blocks too: a repair drops a dropped
block's pin and run-index entry and logs its removal in the same transaction
(`tiers/integrity_dbs.py`), and a rebuild carries all three.

A block is kept when its meta record parses, its data is there with the recorded
size and xxh3 checksum, and its parent is kept (or it is a chain's first block),
so what a repair keeps is prefix-closed, as rule R6 wants. Everything else goes:

- a damaged block (meta, data, size or checksum) and every block below it;
- an orphan: a block whose parent is not stored;
- a child entry naming a block that is not kept, an LRU index entry that does not
  match a kept block's meta, a record with a key of no known form.

Missing child or LRU entries of kept blocks are added, and the usage totals are
rewritten from the kept blocks. The walk reads the file page by page
(tiers/lmdb_pages.py), not through LMDB, whose cursor aborts the process on a
damaged page: such a page is stepped over and reported with the key range it
held, and a truncated file is read as far as it goes. Without `repair` nothing
is written, and a store a live server holds may be checked (a read transaction
pins the snapshot read). A repair needs the data dir's lock (no server running)
and writes in one transaction: in place when every page read, else into a fresh
copy of the kept records that replaces `data.mdb` (the damaged file is kept
beside it). docs/OPERATIONS.md says what each finding means.

This module runs a check; its steps live beside it: the walk (`tiers/integrity_walk.py`),
the decision of what a repair keeps (`tiers/integrity_plan.py`), the repair
(`tiers/integrity_repair.py`), the pins, run index and event log (`tiers/integrity_dbs.py`),
and the report (`tiers/integrity_report.py`).
"""

from __future__ import annotations

from pathlib import Path

import lmdb

from kvstore.config import GiB
from kvstore.errors import ConfigError
from tiers.datadir import DATA_NAME, DataDirBusy, DataDirLock
from tiers.durable import recover
from tiers.integrity_dbs import plan_databases
from tiers.integrity_plan import plan_repair
from tiers.integrity_repair import rebuild, repair_in_place
from tiers.integrity_report import CheckReport, Problem
from tiers.integrity_walk import Progress, walk_records
from tiers.lmdb_pages import HeaderError, LmdbHeader, PageReader, read_headers

__all__ = ["CheckReport", "Problem", "Progress", "check_store"]


def check_store(data_dir: Path, *, repair: bool, progress: Progress | None = None) -> CheckReport:
    """Walk every record of the store in `data_dir`; with `repair`, drop and fix what it finds.

    Args:
        data_dir: the store's folder (store.data_dir).
        repair: write the repair (needs the store's lock: no server may hold it).
        progress: called as (records walked, records in all) now and then.

    Returns:
        The report; `report.ok` when there was nothing to do.

    Raises:
        ConfigError: the folder holds no store, or a repair was asked while a
            server holds the store.
    """
    data = data_dir / DATA_NAME
    if not data.is_file():
        raise ConfigError(f"{data} does not exist: {data_dir} holds no store")
    report = CheckReport(data_dir=str(data_dir), repair=repair)
    lock: DataDirLock | None = None
    try:
        lock = DataDirLock.acquire(data_dir)
    except DataDirBusy as exc:
        if repair:
            raise ConfigError(f"cannot repair {data_dir} while a server serves it: {exc.message}",
                              hint="stop the server, then run the repair; a check without --repair may run "
                                   "while it serves") from None
        report.live = True
    except ConfigError:
        if repair:
            raise
    try:
        if lock is not None:  # as a start would: a commit a crash left not durable is rolled back first (R36)
            recover(data_dir, DATA_NAME)
        _check(data_dir, report, progress)
    finally:
        if lock is not None:
            lock.release()
    return report


def _check(data_dir: Path, report: CheckReport, progress: Progress | None) -> None:
    data = data_dir / DATA_NAME
    try:
        headers = read_headers(data)
    except HeaderError as exc:
        report.fatal = f"{data}: {exc}; nothing can be salvaged: move {data_dir} away and start empty"
        return
    pin = _Pin(data_dir) if report.live else None
    try:
        header = pin.header(data) if pin else max(headers, key=lambda h: h.txn_id)
        size = data.stat().st_size
        if size < header.expected_bytes:
            report.add("truncated", f"{data} is {size} bytes; its header records {header.expected_bytes}: "
                                    "records on the missing pages are lost")
        with PageReader(path=data, header=header) as reader:
            walk = walk_records(reader, report, progress)
    finally:
        if pin:
            pin.close()
    plan = plan_repair(walk, report)
    dbs = plan_databases(walk, plan.kept, report)
    if not report.repair or report.ok:
        return
    if walk.damaged_pages:
        rebuild(data_dir, header, walk, plan, dbs, report)
    else:
        env = lmdb.open(str(data_dir), map_size=size + GiB, max_dbs=8, readahead=False)
        try:
            repair_in_place(env, walk, plan, dbs, report)
        finally:
            env.close()
    report.repaired = True


class _Pin:
    """A read transaction on a live store: the pages of its snapshot are not reused while it is open."""

    def __init__(self, data_dir: Path) -> None:
        self.env = lmdb.open(str(data_dir), readonly=True, max_dbs=8, readahead=False)
        self.txn: lmdb.Transaction | None = None

    def header(self, data: Path) -> LmdbHeader:
        """The meta page of the snapshot pinned (retried while the writer commits meanwhile)."""
        for _ in range(100):
            self.close_txn()
            self.txn = self.env.begin()
            for header in read_headers(data):
                if header.txn_id == self.txn.id():
                    return header
        raise ConfigError(f"{data} changes too fast to pin a snapshot; check it with the server stopped")

    def close_txn(self) -> None:
        if self.txn is not None:
            self.txn.abort()
            self.txn = None

    def close(self) -> None:
        self.close_txn()
        self.env.close()
