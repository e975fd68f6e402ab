"""`kvstore check`: walk a store's records, verify them, and repair what the walk finds.

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
"""

from __future__ import annotations

import json
import os
import shutil
import struct
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import lmdb
import xxhash

from kvstore.config import GiB
from kvstore.errors import ConfigError
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.accounting import Counters
from tiers.datadir import DATA_NAME, DataDirBusy, DataDirLock
from tiers.lmdb_pages import HeaderError, LmdbHeader, PageReader, read_headers, short_key
from tiers.records import CHILD_TAG, DATA_TAG, META_STRUCT, META_TAG, BlockMeta, lru_key, parent_key_of

Progress = Callable[[int, int], None]

_USAGE = struct.Struct("<QQ")
_PREFIX_BYTES = KEY_BYTES - HASH_BYTES
#: Problems of one kind listed in a report; the rest are counted only.
LISTED_PER_KIND = 20
_PROGRESS_EVERY = 4096
DAMAGED_SUFFIX = ".damaged"


@dataclass(frozen=True, kw_only=True, slots=True)
class Problem:
    """One thing the walk found wrong."""

    kind: str
    detail: str
    key: str = ""  # hex storage key of the block concerned, when there is one


@dataclass(kw_only=True)
class CheckReport:
    """What `check_store` found, and what a repair drops (or dropped).

    Attributes:
        data_dir: the store checked.
        repair: whether a repair was asked for; `repaired` whether one was written.
        live: a server held the store while it was checked (read-only).
        blocks_checked / bytes_checked: blocks whose records were read.
        blocks_kept / bytes_kept: blocks a repair keeps (the usage totals after it).
        blocks_dropped / bytes_dropped: damaged blocks, their descendants and orphans.
        entries_dropped / entries_added: index and child entries a repair removes or adds.
        usage_recorded: (blocks, bytes) the state records say; None when absent.
        unreadable: key ranges on pages LMDB could not read.
        counts: problems per kind; `problems` lists up to LISTED_PER_KIND of each.
        fatal: why the walk could not run at all (None when it ran).
        notes: what the repair did beyond the counts.
    """

    data_dir: str
    repair: bool
    repaired: bool = False
    live: bool = False
    blocks_checked: int = 0
    bytes_checked: int = 0
    blocks_kept: int = 0
    bytes_kept: int = 0
    blocks_dropped: int = 0
    bytes_dropped: int = 0
    entries_dropped: int = 0
    entries_added: int = 0
    usage_recorded: tuple[int, int] | None = None
    unreadable: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    problems: list[Problem] = field(default_factory=list)
    fatal: str | None = None
    notes: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        """The store is sound: nothing to drop, add or fix."""
        return self.fatal is None and not self.counts

    def add(self, kind: str, detail: str, key: bytes = b"") -> None:
        """Count a problem, listing it while its kind has fewer than LISTED_PER_KIND listed."""
        self.counts[kind] = self.counts.get(kind, 0) + 1
        if self.counts[kind] <= LISTED_PER_KIND:
            self.problems.append(Problem(kind=kind, detail=detail, key=key.hex()))

    def to_dict(self) -> dict[str, Any]:
        """The report as JSON-able values."""
        out = asdict(self)
        out["ok"] = self.ok
        out["usage_recorded"] = list(self.usage_recorded) if self.usage_recorded else None
        return out

    def lines(self) -> list[str]:
        """The report for a person, one line each."""
        head = f"kvstore check {self.data_dir}"
        if self.live:
            head += " (live: a server holds it; read-only)"
        out = [head]
        if self.fatal:
            out.append(f"cannot check: {self.fatal}")
        out.append(f"blocks checked: {self.blocks_checked} ({self.bytes_checked} bytes)")
        for kind, n in sorted(self.counts.items()):
            out.append(f"{kind}: {n}")
            out.extend(f"  {short_key(bytes.fromhex(p.key)) + ' ' if p.key else ''}{p.detail}"
                       for p in self.problems if p.kind == kind)
        if self.ok:
            out.append("OK: every record is intact and consistent")
        elif self.fatal is None:
            verb = "dropped" if self.repaired else "a repair drops"
            out.append(f"{verb}: {self.blocks_dropped} blocks ({self.bytes_dropped} bytes), "
                       f"{self.entries_dropped} index entries; adds {self.entries_added}; keeps "
                       f"{self.blocks_kept} blocks ({self.bytes_kept} bytes)")
            if not self.repaired:
                out.append(f"to repair: kvstore check --data-dir {self.data_dir} --repair (with no server running)")
        out.extend(self.notes)
        return out


@dataclass(slots=True)
class _Block:
    """The records of one storage key, as the walk found them."""

    meta: BlockMeta | None = None
    data_size: int | None = None
    data_checksum: int | None = None
    fault: str = ""
    children: list[bytes] = field(default_factory=list)


@dataclass(kw_only=True)
class _Walk:
    blocks: dict[bytes, _Block] = field(default_factory=dict)
    odd_records: list[bytes] = field(default_factory=list)
    lru_entries: set[bytes] = field(default_factory=set)
    state: dict[bytes, bytes] = field(default_factory=dict)
    damaged_pages: bool = False


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
            walk = _walk(reader, report, progress)
    finally:
        if pin:
            pin.close()
    plan = _plan(walk, report)
    if not report.repair or report.ok:
        return
    if walk.damaged_pages:
        _rebuild(data_dir, header, walk, plan, report)
    else:
        env = lmdb.open(str(data_dir), map_size=size + GiB, max_dbs=8, readahead=False)
        try:
            _repair_in_place(env, walk, plan)
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


def _walk(reader: PageReader, report: CheckReport, progress: Progress | None) -> _Walk:
    """Read every record, LRU entry and state entry the file's trees reach."""
    walk = _Walk()
    trees = reader.named_trees()
    reader.check_free_tree()
    records = trees.get(b"records")
    if records is not None:
        done = 0
        for key, value in reader.entries(records, "records"):
            _record(walk, report, key, value)
            done += 1
            if progress and done % _PROGRESS_EVERY == 0:
                progress(done, records.entries)
        if progress:
            progress(done, records.entries)
    if (lru := trees.get(b"lru")) is not None:
        walk.lru_entries.update(key for key, _ in reader.entries(lru, "lru", values=False))
    if (state := trees.get(b"state")) is not None:
        walk.state.update((key, value) for key, value in reader.entries(state, "state") if value is not None)
    for page in reader.damaged:
        report.unreadable.append(page.describe())
        report.add("damaged-page", page.describe())
    walk.damaged_pages = bool(reader.damaged) or "truncated" in report.counts
    return walk


def _record(walk: _Walk, report: CheckReport, key: bytes, value: bytes | None) -> None:
    storage, tag = key[:KEY_BYTES], key[KEY_BYTES:KEY_BYTES + 1]
    if tag == CHILD_TAG and len(key) == KEY_BYTES + 1 + HASH_BYTES:
        walk.blocks.setdefault(storage, _Block()).children.append(key[KEY_BYTES + 1:])
        return
    if len(key) != KEY_BYTES + 1 or tag not in (DATA_TAG, META_TAG):
        walk.odd_records.append(key)
        return
    block = walk.blocks.setdefault(storage, _Block())
    if tag == DATA_TAG:
        if value is None:
            block.fault = "its data is on a damaged page"
        else:
            block.data_size, block.data_checksum = len(value), xxhash.xxh3_64_intdigest(value)
        return
    if value is None:
        block.fault = "its meta record is on a damaged page"
        return
    if len(value) != META_STRUCT.size:
        block.fault = f"its meta record is {len(value)} bytes, not {META_STRUCT.size}"
        return
    block.meta = BlockMeta.unpack(value)
    report.blocks_checked += 1
    report.bytes_checked += block.meta.size_bytes


@dataclass(kw_only=True)
class _Plan:
    kept: dict[bytes, BlockMeta]
    drop_blocks: list[bytes]
    drop_entries: list[tuple[str, bytes]]  # (db name, key)
    add_entries: list[tuple[str, bytes]]
    usage: tuple[int, int]
    fix_counters: bool


def _plan(walk: _Walk, report: CheckReport) -> _Plan:
    """Decide what a repair keeps, drops and adds, recording each problem in `report`."""
    blocks = walk.blocks
    for key, b in blocks.items():
        if not b.fault:
            b.fault = _fault(b)
        if b.fault:
            report.add("damaged-block", b.fault, key)
    kept: dict[bytes, BlockMeta] = {}
    for key, b in sorted(((k, b) for k, b in blocks.items() if b.meta is not None and not b.fault),
                         key=lambda kb: kb[1].meta.depth):  # type: ignore[union-attr]
        meta = b.meta
        assert meta is not None
        if meta.depth == 1:
            kept[key] = meta
            continue
        parent = kept.get(parent_key_of(key, meta.parent_hash))
        if parent is not None and parent.depth == meta.depth - 1:
            kept[key] = meta
        else:
            why = "is not stored" if parent_key_of(key, meta.parent_hash) not in blocks else "is dropped"
            report.add("orphan-block", f"its parent {meta.parent_hash.hex()[:16]}... {why}", key)
    drop_blocks = [k for k in blocks if k not in kept]
    report.blocks_kept, report.bytes_kept = len(kept), sum(m.size_bytes for m in kept.values())
    dropped_metas = [m for m in (blocks[k].meta for k in drop_blocks) if m is not None]
    report.blocks_dropped, report.bytes_dropped = len(dropped_metas), sum(m.size_bytes for m in dropped_metas)
    drop: list[tuple[str, bytes]] = [("records", k) for k in walk.odd_records]
    for key in walk.odd_records:
        report.add("unknown-record", f"record key of {len(key)} bytes matches no record kind", key)
    add: list[tuple[str, bytes]] = []
    for key, kept_meta in kept.items():
        for child in blocks[key].children:
            child_meta = kept.get(key[:_PREFIX_BYTES] + child)
            if child_meta is None or child_meta.parent_hash != key[_PREFIX_BYTES:]:
                drop.append(("records", key + CHILD_TAG + child))
                report.add("stale-child-entry", f"names child {child.hex()[:16]}..., which is not kept", key)
        if kept_meta.depth > 1:
            parent_key = parent_key_of(key, kept_meta.parent_hash)
            if key[_PREFIX_BYTES:] not in blocks[parent_key].children:
                add.append(("records", parent_key + CHILD_TAG + key[_PREFIX_BYTES:]))
                report.add("missing-child-entry", "its parent has no entry naming it", key)
    expected_lru = {lru_key(m.last_access_s, m.depth, k): k for k, m in kept.items()}
    for entry in walk.lru_entries - expected_lru.keys():
        drop.append(("lru", entry))
        report.add("stale-index-entry", "LRU entry matches no kept block's meta", entry[12:])
    for entry in expected_lru.keys() - walk.lru_entries:
        add.append(("lru", entry))
        report.add("missing-index-entry", "kept block has no LRU entry", expected_lru[entry])
    report.entries_dropped, report.entries_added = len(drop), len(add)
    fix_counters = _check_state(walk, blocks, report)
    return _Plan(kept=kept, drop_blocks=drop_blocks, drop_entries=drop, add_entries=add,
                 usage=(report.blocks_kept, report.bytes_kept), fix_counters=fix_counters)


def _fault(b: _Block) -> str:
    if b.meta is None:
        return "data or child entries without a meta record"
    if b.data_size is None:
        return "meta record without data"
    if b.data_size != b.meta.size_bytes:
        return f"data is {b.data_size} bytes, meta says {b.meta.size_bytes}"
    if b.data_checksum != b.meta.checksum:
        return "data does not match its xxh3 checksum"
    return ""


def _check_state(walk: _Walk, blocks: dict[bytes, _Block], report: CheckReport) -> bool:
    """Check the usage totals and counters; return whether the counters need rewriting."""
    raw = walk.state.get(b"usage")
    present = [b.meta for b in blocks.values() if b.meta is not None]
    in_records = (len(present), sum(m.size_bytes for m in present))
    if raw is not None and len(raw) == _USAGE.size:
        report.usage_recorded = _USAGE.unpack(raw)
    if report.usage_recorded != in_records and (raw is not None or present):
        report.add("usage-mismatch", f"state records say {report.usage_recorded or 'nothing'} (blocks, bytes); "
                                     f"the records hold {in_records}")
    counters = walk.state.get(b"counters")
    if counters is None:
        return False
    try:
        if isinstance(json.loads(counters), dict):
            return False
    except ValueError:
        pass
    report.add("damaged-counters", "the counters record does not parse; a repair resets them to zero")
    return True


def _usage_changed(walk: _Walk, plan: _Plan) -> bool:
    raw = walk.state.get(b"usage")
    return raw is None or len(raw) != _USAGE.size or _USAGE.unpack(raw) != plan.usage


def _repair_in_place(env: lmdb.Environment, walk: _Walk, plan: _Plan) -> None:
    """Apply the plan in one write transaction (every page read, so every key can be reached)."""
    with env.begin(write=True) as txn:
        dbs = {name: env.open_db(name.encode(), txn=txn) for name in ("records", "lru", "state")}
        for key in plan.drop_blocks:
            b = walk.blocks[key]
            for suffix in (DATA_TAG, META_TAG, *(CHILD_TAG + c for c in b.children)):
                txn.delete(key + suffix, db=dbs["records"])
        for name, key in plan.drop_entries:
            txn.delete(key, db=dbs[name])
        for name, key in plan.add_entries:
            txn.put(key, b"", db=dbs[name])
        _write_state(txn, dbs["state"], walk, plan)


def _write_state(txn: lmdb.Transaction, state: Any, walk: _Walk, plan: _Plan) -> None:
    if _usage_changed(walk, plan):
        txn.put(b"usage", _USAGE.pack(*plan.usage), db=state)
    if plan.fix_counters:
        txn.put(b"counters", json.dumps(asdict(Counters())).encode(), db=state)


def _rebuild(data_dir: Path, header: LmdbHeader, walk: _Walk, plan: _Plan, report: CheckReport) -> None:
    """Copy the kept records into a fresh environment in one transaction, then swap it in.

    LMDB aborts the process when its cursor meets a damaged page, so a store with
    one is read here page by page (tiers/lmdb_pages.py) and rebuilt, not edited.
    """
    tmp = data_dir / "repair.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    fresh = lmdb.open(str(tmp), map_size=int(plan.usage[1] * 1.25) + GiB, max_dbs=8, sync=True, metasync=True)
    try:
        with PageReader(path=data_dir / DATA_NAME, header=header) as reader, fresh.begin(write=True) as txn:
            records = fresh.open_db(b"records", txn=txn)
            lru = fresh.open_db(b"lru", txn=txn)
            state = fresh.open_db(b"state", txn=txn)
            old_records = reader.named_trees().get(b"records")
            for key, data in reader.entries(old_records, "records") if old_records else ():
                meta = plan.kept.get(key[:KEY_BYTES])
                if meta is None or key[KEY_BYTES:] != DATA_TAG:
                    continue
                if data is None or xxhash.xxh3_64_intdigest(data) != meta.checksum:  # verified by the walk
                    raise ConfigError(f"block {key.hex()} read differently the second time; nothing was changed")
                txn.put(key, data, db=records)
                txn.put(key[:KEY_BYTES] + META_TAG, meta.pack(), db=records)
                txn.put(lru_key(meta.last_access_s, meta.depth, key[:KEY_BYTES]), b"", db=lru)
                if meta.depth > 1:
                    txn.put(parent_key_of(key[:KEY_BYTES], meta.parent_hash) + CHILD_TAG + key[_PREFIX_BYTES:KEY_BYTES],
                            b"", db=records)
            for name, value in walk.state.items():
                if name not in (b"usage", b"counters") or (name == b"counters" and not plan.fix_counters):
                    txn.put(name, value, db=state)
            txn.put(b"usage", _USAGE.pack(*plan.usage), db=state)
            if plan.fix_counters or b"counters" not in walk.state:
                txn.put(b"counters", json.dumps(asdict(Counters())).encode(), db=state)
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

