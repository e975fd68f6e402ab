"""The walk of `kvstore check`: every record, LRU, state, pin, run-index and event-log entry, read page by page.

LMDB's cursor aborts the process on a damaged page, so the walk reads the file through
`tiers.lmdb_pages.PageReader`: a damaged page is stepped over and reported with the key range
it held. What it finds of each storage key is a `BlockRecords`; what it finds of the whole
file, a `Walk`, from which `tiers.integrity_plan` decides what a repair keeps.

A lost branch page (or a lost root: the main tree's, whose page a truncation takes as often
as any other) cuts its leaves off from the tree, though they are intact. So when any page is
lost, the walk also reads every leaf page of the file that no tree reached and that the free
tree does not list as free (LMDB leaves freed pages' old bytes in place: those are earlier
copies, blocks evicted or purged since), and takes those holding records (`record_entries`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import xxhash

from kvstore.native.records import CHILD_TAG, DATA_TAG, META_STRUCT, META_TAG, BlockMeta
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.integrity_report import CheckReport
from tiers.lmdb_pages import PageReader, Tree

#: Called as (records walked, records in all) now and then.
Progress = Callable[[int, int], None]

_PROGRESS_EVERY = 4096


@dataclass(slots=True)
class BlockRecords:
    """The records of one storage key, as the walk found them."""

    meta: BlockMeta | None = None
    data_size: int | None = None
    data_checksum: int | None = None
    fault: str = ""
    children: list[bytes] = field(default_factory=list)
    #: (size, xxh3) of every copy of its data found (a scan may find more than one).
    data_copies: set[tuple[int, int]] = field(default_factory=set)


@dataclass(kw_only=True)
class Walk:
    """What the walk found of the whole file."""

    blocks: dict[bytes, BlockRecords] = field(default_factory=dict)
    odd_records: list[bytes] = field(default_factory=list)
    lru_entries: set[bytes] = field(default_factory=set)
    state: dict[bytes, bytes] = field(default_factory=dict)
    damaged_pages: bool = False
    #: The raw entries of the pins and run-index databases, and the event log's (key, value)s in key
    #: order (tiers/integrity_dbs.py checks them against the kept blocks).
    pins: dict[bytes, bytes] = field(default_factory=dict)
    runs: dict[bytes, bytes] = field(default_factory=dict)
    events: list[tuple[bytes, bytes]] = field(default_factory=list)
    #: Named databases the main tree lists, and the trees with a damaged page (pins, runs, events: their
    #: entries there are lost).
    trees: set[bytes] = field(default_factory=set)
    damaged_trees: set[str] = field(default_factory=set)
    #: Records leaves no tree reached, found by reading the file page by page.
    stray_leaves: list[int] = field(default_factory=list)


def _is_record_key(key: bytes) -> bool:
    tag = key[KEY_BYTES:KEY_BYTES + 1]
    return (len(key) == KEY_BYTES + 1 and tag in (DATA_TAG, META_TAG)) or \
        (len(key) == KEY_BYTES + 1 + HASH_BYTES and tag == CHILD_TAG)


def record_entries(reader: PageReader, records: Tree | None, *, scan: bool,
                   strays: list[int] | None = None) -> Iterator[tuple[bytes, bytes | None]]:
    """The records tree's (key, value)s, then, with `scan`, those of the records leaves it does
    not reach (their page numbers appended to `strays`).

    A leaf is taken when every key on it has a record's form (the other trees' keys have other
    lengths) and the free tree does not list it; when the free tree cannot be read, every
    unreached leaf is taken (older copies then come back too: the walk keeps the newest meta).
    """
    if records is not None:
        yield from reader.entries(records, "records")
    if not scan:
        return
    free = reader.free_pages()
    for page, entries in reader.stray_leaves(reader.reached | (free or set())):
        if all(_is_record_key(key) for key, _ in entries):
            if strays is not None:
                strays.append(page)
            yield from entries


def walk_records(reader: PageReader, report: CheckReport, progress: Progress | None) -> Walk:
    """Read every record, LRU, state, pin, run-index and event-log entry the file's trees reach."""
    walk = Walk()
    trees = reader.named_trees()
    reader.check_free_tree()
    records = trees.get(b"records")
    total = records.entries if records is not None else 0
    scan = bool(reader.damaged) or records is None or "truncated" in report.counts
    done = 0
    for key, value in record_entries(reader, records, scan=scan, strays=walk.stray_leaves):
        _record(walk, report, key, value)
        done += 1
        if progress and done % _PROGRESS_EVERY == 0:
            progress(done, max(done, total))
    if progress:
        progress(done, max(done, total))
    if (lru := trees.get(b"lru")) is not None:
        walk.lru_entries.update(key for key, _ in reader.entries(lru, "lru", values=False))
    if (state := trees.get(b"state")) is not None:
        walk.state.update((key, value) for key, value in reader.entries(state, "state") if value is not None)
    walk.trees = set(trees)
    for name, into in ((b"pins", walk.pins), (b"runs", walk.runs)):
        if (tree := trees.get(name)) is not None:
            into.update((key, value) for key, value in reader.entries(tree, name.decode()) if value is not None)
    if (events := trees.get(b"events")) is not None:
        walk.events = [(key, value) for key, value in reader.entries(events, "events") if value is not None]
    walk.damaged_trees = {page.tree for page in reader.damaged}
    for page in reader.damaged:
        report.unreadable.append(page.describe())
        report.add("damaged-page", page.describe())
    walk.damaged_pages = bool(reader.damaged) or "truncated" in report.counts
    if walk.stray_leaves:
        report.leaves_recovered = len(walk.stray_leaves)
        report.notes.append(f"read {len(walk.stray_leaves)} records leaf pages that no surviving branch page "
                            "reaches, by scanning the file")
    return walk


def _record(walk: Walk, report: CheckReport, key: bytes, value: bytes | None) -> None:
    storage, tag = key[:KEY_BYTES], key[KEY_BYTES:KEY_BYTES + 1]
    if tag == CHILD_TAG and len(key) == KEY_BYTES + 1 + HASH_BYTES:
        walk.blocks.setdefault(storage, BlockRecords()).children.append(key[KEY_BYTES + 1:])
        return
    if len(key) != KEY_BYTES + 1 or tag not in (DATA_TAG, META_TAG):
        walk.odd_records.append(key)
        return
    block = walk.blocks.setdefault(storage, BlockRecords())
    if tag == DATA_TAG:
        if value is None:
            block.fault = block.fault or ("" if block.data_copies else _DATA_LOST)
        else:
            copy = (len(value), xxhash.xxh3_64_intdigest(value))
            if not block.data_copies:
                block.data_size, block.data_checksum = copy
            block.data_copies.add(copy)
            block.fault = "" if block.fault == _DATA_LOST else block.fault
        return
    if value is None or len(value) != META_STRUCT.size:
        if block.meta is None:  # a second copy, read from another leaf, may be intact
            block.fault = f"its meta record is {len(value)} bytes, not {META_STRUCT.size}" if value is not None \
                else "its meta record is on a damaged page"
        return
    meta = BlockMeta.unpack(value)
    if block.meta is not None:  # copies differ only in the last use: the latest is the newest copy
        block.meta = max(block.meta, meta, key=lambda m: m.last_access_s)
        return
    block.fault = "" if block.fault.startswith("its meta record") else block.fault
    block.meta = meta
    report.blocks_checked += 1
    report.bytes_checked += block.meta.size_bytes


_DATA_LOST = "its data is on a damaged page"
