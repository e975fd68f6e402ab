"""What a repair of `kvstore check` keeps, drops and adds, decided from the walk.

A block is kept when its meta record parses, its data is there with the recorded size and
xxh3 checksum, and its parent is kept (or it is a chain's first block), so what a repair
keeps is prefix-closed, as rule R6 wants. Each problem met is recorded in the report.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass, field

from kvstore.native.records import CHILD_TAG, BlockMeta, lru_key, parent_key_of
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers import integrity_usage
from tiers.integrity_report import CheckReport
from tiers.integrity_walk import BlockRecords, Walk

#: The usage totals' state record: (blocks, bytes).
USAGE = struct.Struct("<QQ")
#: Bytes of a storage key before its block hash (layout and tenant).
PREFIX_BYTES = KEY_BYTES - HASH_BYTES


@dataclass(kw_only=True)
class RepairPlan:
    """What a repair keeps, drops and adds, and the usage totals it writes."""

    kept: dict[bytes, BlockMeta]
    drop_blocks: list[bytes]
    drop_entries: list[tuple[str, bytes]]  # (db name, key)
    add_entries: list[tuple[str, bytes]]
    usage: tuple[int, int]
    fix_counters: bool
    #: R33: state records to delete and to write so each geometry's and tenant's usage is what `kept` holds.
    usage_deletes: list[bytes] = field(default_factory=list)
    usage_puts: dict[bytes, bytes] = field(default_factory=dict)


def plan_repair(walk: Walk, report: CheckReport) -> RepairPlan:
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
            child_meta = kept.get(key[:PREFIX_BYTES] + child)
            if child_meta is None or child_meta.parent_hash != key[PREFIX_BYTES:]:
                drop.append(("records", key + CHILD_TAG + child))
                report.add("stale-child-entry", f"names child {child.hex()[:16]}..., which is not kept", key)
        if kept_meta.depth > 1:
            parent_key = parent_key_of(key, kept_meta.parent_hash)
            if key[PREFIX_BYTES:] not in blocks[parent_key].children:
                add.append(("records", parent_key + CHILD_TAG + key[PREFIX_BYTES:]))
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
    deletes, puts = integrity_usage.rewrites(walk.state, kept)
    return RepairPlan(kept=kept, drop_blocks=drop_blocks, drop_entries=drop, add_entries=add,
                      usage=(report.blocks_kept, report.bytes_kept), fix_counters=fix_counters,
                      usage_deletes=deletes, usage_puts=puts)


def _fault(b: BlockRecords) -> str:
    if b.meta is None:
        return "data or child entries without a meta record"
    if b.data_size is None:
        return "meta record without data"
    if (b.meta.size_bytes, b.meta.checksum) in b.data_copies:
        return ""
    if b.data_size != b.meta.size_bytes:
        return f"data is {b.data_size} bytes, meta says {b.meta.size_bytes}"
    if b.data_checksum != b.meta.checksum:
        return "data does not match its xxh3 checksum"
    return ""


def _check_state(walk: Walk, blocks: dict[bytes, BlockRecords], report: CheckReport) -> bool:
    """Check the usage totals and counters; return whether the counters need rewriting."""
    raw = walk.state.get(b"usage")
    present = [b.meta for b in blocks.values() if b.meta is not None]
    in_records = (len(present), sum(m.size_bytes for m in present))
    if raw is not None and len(raw) == USAGE.size:
        report.usage_recorded = USAGE.unpack(raw)
    if report.usage_recorded != in_records and (raw is not None or present):
        report.add("usage-mismatch", f"state records say {report.usage_recorded or 'nothing'} (blocks, bytes); "
                                     f"the records hold {in_records}")
    integrity_usage.check(walk.state, {k: b.meta for k, b in blocks.items() if b.meta is not None}, report)
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
