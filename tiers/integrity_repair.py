"""A repair of `kvstore check`, written in one transaction: in place when every page read, else
a fresh copy of the kept records that replaces `data.mdb` (the damaged file is kept beside it).
The pins, run index and event log are changed (or carried) with the records (tiers/integrity_dbs.py).

Both need the data dir's lock (no server running); `tiers.integrity` takes it.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Any

import lmdb
import xxhash

from kvstore.config import GiB
from kvstore.errors import ConfigError
from kvstore.native.records import CHILD_TAG, DATA_TAG, META_TAG, lru_key, parent_key_of
from kvstore.prefix import KEY_BYTES
from tiers import integrity_dbs
from tiers.accounting import Counters
from tiers.datadir import DATA_NAME
from tiers.integrity_dbs import DbPlan
from tiers.integrity_plan import PREFIX_BYTES, USAGE, RepairPlan
from tiers.integrity_report import CheckReport
from tiers.integrity_walk import Walk, record_entries
from tiers.lmdb_pages import LmdbHeader, PageReader

#: The damaged file's name beside the rebuilt one: `data.mdb.damaged`.
DAMAGED_SUFFIX = ".damaged"


def _usage_changed(walk: Walk, plan: RepairPlan) -> bool:
    raw = walk.state.get(b"usage")
    return raw is None or len(raw) != USAGE.size or USAGE.unpack(raw) != plan.usage


def repair_in_place(env: lmdb.Environment, walk: Walk, plan: RepairPlan, db_plan: DbPlan,
                    report: CheckReport) -> None:
    """Apply the plan in one write transaction (every page read, so every key can be reached): the
    records, and with them the pins, the run index and the event log's removals."""
    log = integrity_dbs.open_log(env, db_plan)
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name.encode(), txn=txn) for name in ("records", "lru", "state")}
        dbs.update({name.decode(): env.open_db(name, txn=txn) for name in (b"pins", b"runs") if name in walk.trees})
        for key in plan.drop_blocks:
            b = walk.blocks[key]
            for suffix in (DATA_TAG, META_TAG, *(CHILD_TAG + c for c in b.children)):
                txn.delete(key + suffix, db=dbs["records"])
        for name, key in plan.drop_entries:
            txn.delete(key, db=dbs[name])
        for name, key in plan.add_entries:
            txn.put(key, b"", db=dbs[name])
        _write_state(txn, dbs["state"], walk, plan)
        integrity_dbs.apply_in_place(txn, dbs, db_plan)
        report.removal_batches = integrity_dbs.log_removals(log, txn, dbs["state"], db_plan.removed)
    if b"events" in walk.trees and log is None and db_plan.removed:
        report.not_carried.append(f"events: the log names no node, so its {len(db_plan.removed)} removals "
                                  "are not logged")


def _write_state(txn: lmdb.Transaction, state: Any, walk: Walk, plan: RepairPlan) -> None:
    if _usage_changed(walk, plan):
        txn.put(b"usage", USAGE.pack(*plan.usage), db=state)
    _write_usage_records(txn, state, plan)
    if plan.fix_counters:
        txn.put(b"counters", json.dumps(asdict(Counters())).encode(), db=state)


def _write_usage_records(txn: lmdb.Transaction, state: Any, plan: RepairPlan) -> None:
    """R33: each geometry's and tenant's usage record as the kept blocks hold (`tiers.integrity_usage`)."""
    for key in plan.usage_deletes:
        txn.delete(key, db=state)
    for key, value in plan.usage_puts.items():
        txn.put(key, value, db=state)


def rebuild(data_dir: Path, header: LmdbHeader, walk: Walk, plan: RepairPlan, db_plan: DbPlan,
            report: CheckReport) -> None:
    """Copy the kept records into a fresh environment in one transaction, then swap it in.

    LMDB aborts the process when its cursor meets a damaged page, so a store with
    one is read here page by page (tiers/lmdb_pages.py) and rebuilt, not edited.
    """
    tmp = data_dir / "repair.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    log_bytes = sum(len(v) for _, v in walk.events)  # the event log is carried too
    fresh = lmdb.open(str(tmp), map_size=int((plan.usage[1] + log_bytes) * 1.25) + GiB, max_dbs=8, sync=True,
                      metasync=True)
    try:
        with PageReader(path=data_dir / DATA_NAME, header=header) as reader, fresh.begin(write=True) as txn:
            records = fresh.open_db(b"records", txn=txn)
            lru = fresh.open_db(b"lru", txn=txn)
            state = fresh.open_db(b"state", txn=txn)
            old_records = reader.named_trees().get(b"records")
            written: set[bytes] = set()
            for key, data in record_entries(reader, old_records, scan=bool(walk.stray_leaves)):
                meta = plan.kept.get(key[:KEY_BYTES])
                if meta is None or key[KEY_BYTES:] != DATA_TAG or key in written:
                    continue
                if data is None or len(data) != meta.size_bytes or xxhash.xxh3_64_intdigest(data) != meta.checksum:
                    continue  # another copy (the walk found one that verifies) or, if none, refused below
                written.add(key)
                txn.put(key, data, db=records)
                txn.put(key[:KEY_BYTES] + META_TAG, meta.pack(), db=records)
                txn.put(lru_key(meta.last_access_s, meta.depth, key[:KEY_BYTES]), b"", db=lru)
                if meta.depth > 1:
                    txn.put(parent_key_of(key[:KEY_BYTES], meta.parent_hash) + CHILD_TAG + key[PREFIX_BYTES:KEY_BYTES],
                            b"", db=records)
            if len(written) != len(plan.kept):
                raise ConfigError(f"{len(plan.kept) - len(written)} kept blocks read differently the second time; "
                                  "nothing was changed")
            for name, value in walk.state.items():
                if name not in (b"usage", b"counters") or (name == b"counters" and not plan.fix_counters):
                    txn.put(name, value, db=state)
            txn.put(b"usage", USAGE.pack(*plan.usage), db=state)
            _write_usage_records(txn, state, plan)
            if plan.fix_counters or b"counters" not in walk.state:
                txn.put(b"counters", json.dumps(asdict(Counters())).encode(), db=state)
            carried_log = integrity_dbs.write_rebuilt(txn, fresh, walk, db_plan, report)
            integrity_dbs.unknown_trees(walk, report)
        if carried_log:  # a second transaction of the fresh file, before it is swapped in: still all or nothing
            log = integrity_dbs.open_log(fresh, db_plan)
            with fresh.begin(write=True) as txn:
                report.removal_batches = integrity_dbs.log_removals(log, txn, fresh.open_db(b"state", txn=txn),
                                                                    db_plan.removed)
    except BaseException:
        fresh.close()
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fresh.close()
    path = data_dir / DATA_NAME
    os.replace(path, data_dir / (DATA_NAME + DAMAGED_SUFFIX))
    os.replace(tmp / DATA_NAME, path)
    (data_dir / "lock.mdb").unlink(missing_ok=True)  # its reader table described the old file
    shutil.rmtree(tmp, ignore_errors=True)
    dir_fd = os.open(data_dir, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
    report.notes.append(f"rebuilt {path} from the kept records; the damaged file is kept as "
                        f"{data_dir / (DATA_NAME + DAMAGED_SUFFIX)}: delete it once the store serves again")
