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
from dataclasses import dataclass

import lmdb

from kvstore.errors import DataLoss
from kvstore.prefix import KEY_BYTES
from tiers.records import META_TAG

log = logging.getLogger(__name__)

#: State-db key of the totals: blocks, bytes (two little-endian u64).
USAGE_KEY = b"usage"
_USAGE = struct.Struct("<QQ")
_META_SIZE_FIELD = struct.Struct("<I")  # size_bytes, after the 32-byte parent hash and the u32 depth
_META_SIZE_OFFSET = 36
_META_KEY_LEN = KEY_BYTES + len(META_TAG)


@dataclass(kw_only=True, slots=True)
class Usage:
    """Blocks and bytes stored."""

    blocks: int = 0
    stored_bytes: int = 0


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


def recount(txn: lmdb.Transaction, records_db: lmdb._Database) -> Usage:
    """Totals counted from the meta records (one pass over the records' B-tree leaves).

    Data values live on overflow pages that this walk never reads, so it costs
    about one leaf page per 15 blocks.
    """
    usage = Usage()
    tag = META_TAG[0]
    unpack = _META_SIZE_FIELD.unpack_from
    for key, value in txn.cursor(db=records_db).iternext(keys=True, values=True):
        if len(key) == _META_KEY_LEN and key[KEY_BYTES] == tag:
            usage.blocks += 1
            usage.stored_bytes += unpack(value, _META_SIZE_OFFSET)[0]
    return usage


def check_and_repair(env: lmdb.Environment, records_db: lmdb._Database, state_db: lmdb._Database, *,
                     max_tree_pages: int) -> Usage:
    """Recount the totals at open; rewrite the persisted ones (and warn) when they differ.

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
            return stored
        try:
            counted = recount(txn, records_db)
        except (lmdb.Error, struct.error, DataLoss) as exc:
            log.error("could not recount the usage totals (%s): keeping the stored ones (%d blocks, %d bytes); "
                      "run `kvstore check` on %s", exc, stored.blocks, stored.stored_bytes, env.path())
            return stored
    if counted != stored:
        log.warning("usage totals were %d blocks, %d bytes but the records hold %d blocks, %d bytes: repaired",
                    stored.blocks, stored.stored_bytes, counted.blocks, counted.stored_bytes)
        with env.begin(write=True) as txn:
            write_usage(txn, state_db, counted)
    return counted
