"""The walk of `kvstore check`: every record, LRU entry and state entry of a store, read page by page.

LMDB's cursor aborts the process on a damaged page, so the walk reads the file through
`tiers.lmdb_pages.PageReader`: a damaged page is stepped over and reported with the key range
it held. What it finds of each storage key is a `BlockRecords`; what it finds of the whole
file, a `Walk`, from which `tiers.integrity_plan` decides what a repair keeps.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import xxhash

from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.integrity_report import CheckReport
from tiers.lmdb_pages import PageReader
from tiers.records import CHILD_TAG, DATA_TAG, META_STRUCT, META_TAG, BlockMeta

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


@dataclass(kw_only=True)
class Walk:
    """What the walk found of the whole file."""

    blocks: dict[bytes, BlockRecords] = field(default_factory=dict)
    odd_records: list[bytes] = field(default_factory=list)
    lru_entries: set[bytes] = field(default_factory=set)
    state: dict[bytes, bytes] = field(default_factory=dict)
    damaged_pages: bool = False


def walk_records(reader: PageReader, report: CheckReport, progress: Progress | None) -> Walk:
    """Read every record, LRU entry and state entry the file's trees reach."""
    walk = Walk()
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
