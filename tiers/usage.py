"""The NVMe tier's usage totals (blocks and bytes stored), kept in the state db.

The totals are read, changed and written back inside each write transaction,
after LMDB's writer lock is held, so a transaction that aborts changes nothing
and no commit can overwrite another's totals. The tier's in-memory copy (for
stats and the quick "is there room" check) is replaced after each commit.
At open the totals are recounted from the block records and repaired, with a
warning, when they differ (a store written by an older version, or damage).
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Iterator
from dataclasses import dataclass

import lmdb

from kvstore.errors import DataLoss
from kvstore.native.records import META_TAG
from kvstore.prefix import KEY_BYTES

log = logging.getLogger(__name__)

#: State-db key of the totals: blocks, bytes (two little-endian u64).
USAGE_KEY = b"usage"
#: State-db keys of the totals per layout: this prefix and the layout's 8-byte
#: geometry fingerprint (the first bytes of every storage key), same value format.
LAYOUT_USAGE_PREFIX = b"usage/"
_FINGERPRINT_BYTES = 8
_USAGE = struct.Struct("<QQ")
_META_SIZE_FIELD = struct.Struct("<I")  # size_bytes, after the 32-byte parent hash and the u32 depth
_META_SIZE_OFFSET = 36
_META_CREATED = struct.Struct("<d")  # created_s, after size (u32) and checksum (u64)
_META_CREATED_OFFSET = 48
_NAMESPACE_END = _FINGERPRINT_BYTES + 8  # a storage key: fingerprint (8), namespace id (8), hash
_META_KEY_LEN = KEY_BYTES + len(META_TAG)


@dataclass(kw_only=True, slots=True)
class Usage:
    """Blocks and bytes stored."""

    blocks: int = 0
    stored_bytes: int = 0


@dataclass(kw_only=True, slots=True)
class NamespaceCount:
    """One namespace's blocks and bytes counted from the records, and the sum of their creation times."""

    blocks: int = 0
    stored_bytes: int = 0
    created_sum_s: float = 0.0


def read_usage(txn: lmdb.Transaction, state_db: lmdb._Database) -> Usage:
    """The persisted totals, as this transaction sees them."""
    raw = txn.get(USAGE_KEY, db=state_db)
    if raw is None:
        return Usage()
    blocks, stored = _USAGE.unpack(raw)
    return Usage(blocks=blocks, stored_bytes=stored)


def write_usage(txn: lmdb.Transaction, state_db: lmdb._Database, usage: Usage) -> None:
    """Persist the totals with this (write) transaction."""
    txn.put(USAGE_KEY, _USAGE.pack(usage.blocks, usage.stored_bytes), db=state_db)


def scan_prefix(txn: lmdb.Transaction, db: lmdb._Database, prefix: bytes) -> Iterator[tuple[bytes, bytes]]:
    """(key without `prefix`, value) of every record of `db` whose key starts with `prefix`, in key order."""
    cursor = txn.cursor(db=db)
    if not cursor.set_range(prefix):
        return
    for key, value in cursor.iternext(keys=True, values=True):
        key = bytes(key)
        if not key.startswith(prefix):
            return
        yield key[len(prefix):], bytes(value)


def read_layout_usage(txn: lmdb.Transaction, state_db: lmdb._Database) -> dict[bytes, Usage]:
    """The persisted totals per layout (geometry fingerprint), as this transaction sees them."""
    out: dict[bytes, Usage] = {}
    for fingerprint, value in scan_prefix(txn, state_db, LAYOUT_USAGE_PREFIX):
        if len(value) == _USAGE.size:
            blocks, stored = _USAGE.unpack(value)
            out[fingerprint] = Usage(blocks=blocks, stored_bytes=stored)
    return out


def layout_totals(env: lmdb.Environment, state_db: lmdb._Database) -> dict[bytes, tuple[int, int]]:
    """Blocks and bytes per layout, as last committed (empty if the state db cannot be read)."""
    try:
        with env.begin() as txn:
            layouts = read_layout_usage(txn, state_db)
    except lmdb.Error as exc:
        log.error("cannot read the per-geometry usage totals: %s", exc)
        return {}
    return {fp: (u.blocks, u.stored_bytes) for fp, u in layouts.items()}


def add_layout_usage(txn: lmdb.Transaction, state_db: lmdb._Database, deltas: dict[bytes, Usage]) -> None:
    """Add (blocks, bytes) deltas to the persisted totals of each layout, with this (write) transaction.

    A layout whose count reaches zero loses its entry.
    """
    for fingerprint, delta in deltas.items():
        if not delta.blocks and not delta.stored_bytes:
            continue
        key = LAYOUT_USAGE_PREFIX + fingerprint
        raw = txn.get(key, db=state_db)
        blocks, stored = _USAGE.unpack(raw) if raw is not None and len(raw) == _USAGE.size else (0, 0)
        blocks, stored = max(blocks + delta.blocks, 0), max(stored + delta.stored_bytes, 0)
        if blocks:
            txn.put(key, _USAGE.pack(blocks, stored), db=state_db)
        else:
            txn.delete(key, db=state_db)


def write_layout_usage(txn: lmdb.Transaction, state_db: lmdb._Database, layouts: dict[bytes, Usage]) -> None:
    """Replace every persisted per-layout total with `layouts`."""
    for fingerprint in read_layout_usage(txn, state_db):
        txn.delete(LAYOUT_USAGE_PREFIX + fingerprint, db=state_db)
    for fingerprint, usage in layouts.items():
        txn.put(LAYOUT_USAGE_PREFIX + fingerprint, _USAGE.pack(usage.blocks, usage.stored_bytes), db=state_db)


def recount(txn: lmdb.Transaction, records_db: lmdb._Database) -> Usage:
    """Totals counted from the meta records (one pass over the records' B-tree leaves)."""
    return recount_by_layout(txn, records_db)[0]


def recount_by_layout(txn: lmdb.Transaction, records_db: lmdb._Database) -> tuple[Usage, dict[bytes, Usage]]:
    """Totals, and totals per layout, counted from the meta records in one pass."""
    total, layouts, _ = recount_all(txn, records_db)
    return total, layouts


def recount_all(txn: lmdb.Transaction, records_db: lmdb._Database
                ) -> tuple[Usage, dict[bytes, Usage], dict[bytes, NamespaceCount]]:
    """Totals, totals per layout and per namespace id, counted from the meta records in one pass.

    Data values live on overflow pages that this walk never reads, so it costs
    about one leaf page per 15 blocks.
    """
    usage = Usage()
    layouts: dict[bytes, Usage] = {}
    namespaces: dict[bytes, NamespaceCount] = {}
    tag = META_TAG[0]
    unpack, created = _META_SIZE_FIELD.unpack_from, _META_CREATED.unpack_from
    for key, value in txn.cursor(db=records_db).iternext(keys=True, values=True):
        if len(key) == _META_KEY_LEN and key[KEY_BYTES] == tag:
            size = unpack(value, _META_SIZE_OFFSET)[0]
            usage.blocks += 1
            usage.stored_bytes += size
            layout = layouts.setdefault(bytes(key[:_FINGERPRINT_BYTES]), Usage())
            layout.blocks += 1
            layout.stored_bytes += size
            ns = namespaces.setdefault(bytes(key[_FINGERPRINT_BYTES:_NAMESPACE_END]), NamespaceCount())
            ns.blocks += 1
            ns.stored_bytes += size
            ns.created_sum_s += created(value, _META_CREATED_OFFSET)[0]
    return usage, layouts, namespaces


def check_and_repair(env: lmdb.Environment, records_db: lmdb._Database, state_db: lmdb._Database, *,
                     max_tree_pages: int) -> tuple[Usage, dict[bytes, NamespaceCount] | None]:
    """Recount the totals at open; rewrite the persisted ones (and warn) when they differ.

    Returns the totals, and the counts per namespace id when the records were
    recounted (None when they were not: `tiers/namespaces.py` repairs its own).

    The walk is a cursor over the records, and LMDB aborts the process when a
    cursor steps onto a damaged leaf, so it runs only on a store small enough
    (`max_tree_pages` branch and leaf pages) for the start-time page check
    (tiers/datadir.py) to have found none; a larger store keeps its totals
    unchecked (logged): `kvstore check` walks it safely.
    """
    with env.begin(buffers=True) as txn:
        stored = read_usage(txn, state_db)
        stat = txn.stat(records_db)
        if stat["branch_pages"] + stat["leaf_pages"] > max_tree_pages:
            log.info("usage totals not recounted at open: the records span more than %d pages", max_tree_pages)
            return stored, None
        try:
            counted, layouts, namespaces = recount_all(txn, records_db)
        except (lmdb.Error, struct.error, DataLoss) as exc:
            log.error("could not recount the usage totals (%s): keeping the stored ones (%d blocks, %d bytes); "
                      "run `kvstore check` on %s", exc, stored.blocks, stored.stored_bytes, env.path())
            return stored, None
        stored_layouts = read_layout_usage(txn, state_db)
    if counted != stored:
        log.warning("usage totals were %d blocks, %d bytes but the records hold %d blocks, %d bytes: repaired",
                    stored.blocks, stored.stored_bytes, counted.blocks, counted.stored_bytes)
    if layouts != stored_layouts:
        log.info("usage totals per geometry recounted from the records (%d geometries)", len(layouts))
    if counted != stored or layouts != stored_layouts:
        with env.begin(write=True) as txn:
            write_usage(txn, state_db, counted)
            write_layout_usage(txn, state_db, layouts)
    return counted, namespaces
