"""A write transaction over the NVMe tier's databases: insert, refresh and delete blocks.

Each block has records side by side in `records` (kvstore/native/records.py), an entry
in the `lru` index, and a share of the usage totals in `state`; this module is
the one place that changes them together. `BlockTxn.usage` is the totals as
read inside the transaction (after the writer lock is held) plus what this
transaction changed.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import lmdb
import xxhash

from kvstore.errors import DataLoss
from kvstore.native.records import (
    DATA_TAG,
    META_STRUCT,
    META_TAG,
    BlockMeta,
    child_key,
    children_prefix,
    data_key,
    lru_key,
    meta_key,
    parent_key_of,
)
from kvstore.prefix import FINGERPRINT_BYTES, HASH_BYTES, BlockScope
from tiers import namespaces, pins, run_index
from tiers.usage import Usage, read_usage

Buffer = bytes | bytearray | memoryview


@dataclass(frozen=True, kw_only=True, slots=True)
class PutResult:
    """What one Put batch did."""

    written_blocks: int
    existing_blocks: int
    written_bytes: int
    #: What the batch's pin request got (R22, R24); None: it asked for none.
    pin: pins.PinGrant | None = None
    #: Blocks (and their bytes) evicted to make room for this batch (its trace record says so).
    evicted_blocks: int = 0
    evicted_bytes: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class PutBatch:
    """Consecutive blocks of one chain to store (validated by the caller)."""

    scope: BlockScope
    parent_hash: bytes
    hashes: Sequence[bytes]
    blocks: Sequence[Buffer]
    is_root: bool
    #: The namespace's NVMe quota (R19): past it the Put evicts the namespace's own
    #: blocks past retention, else is refused; None: no quota.
    quota_bytes: int | None = None
    #: A fleet copy of a run whose first block's parent lives on another node (docs/FLEET.md F17):
    #: the first block's depth, used when `parent_hash` is not stored here; None: the parent must be.
    first_depth: int | None = None
    #: A fleet copy's last use of each block on its source (the receiver keeps the later of its own
    #: and this, F19); None: now.
    last_use_s: Sequence[float] | None = None
    #: Keep the batch's last block, and so its prefix, until this time (a pin, R22); None: no pin.
    keep_until_s: float | None = None
    #: The xxh3-64 of each block, taken by the caller off the write transaction (`kvstore.native.blockcopy.digests`,
    #: on the stream reader's thread); None: the transaction takes them. Each must be the block's own.
    checksums: Sequence[int] | None = None


@dataclass(frozen=True, slots=True)
class Change:
    """One block a write transaction stored (`stored`) or removed, for its events (docs/EVENTS.md).

    `parent_hash` is the stored block's parent, None for a chain's first block (or a removal).
    """

    key: bytes
    parent_hash: bytes | None
    stored: bool


class DamagedBlock(Exception):
    """A block's records could not be read: the page holding them is damaged.

    Internal to the tier: the caller notes `key` as damaged and retries without
    it, or reports the block as a miss. The transaction that met it is unusable
    (LMDB marks it failed) and must be aborted.
    """

    def __init__(self, key: bytes, cause: BaseException) -> None:
        super().__init__(f"block {key.hex()[:24]}...'s records are unreadable: {cause}")
        self.key = key
        self.cause = cause


@dataclass(frozen=True, slots=True)
class BlockDbs:
    """The tier's named databases in one LMDB environment."""

    records: Any
    lru: Any
    state: Any
    #: The fleet's run index (tiers/run_index.py): kept only while the store is a fleet node's.
    runs: Any = None
    #: Pins (tiers/pins.py, R22-R27).
    pins: Any = None

    @classmethod
    def open(cls, env: lmdb.Environment) -> BlockDbs:
        """Open (or create) the databases, in one write transaction (one commit, where any is made)."""
        with env.begin(write=True) as txn:
            return cls(**{field: env.open_db(name, txn=txn) for field, name in (
                ("records", b"records"), ("lru", b"lru"), ("state", b"state"), ("runs", run_index.RUNS_DB),
                ("pins", pins.PINS_DB))})


def read_meta(txn: lmdb.Transaction, dbs: BlockDbs, key: bytes) -> BlockMeta | None:
    """A block's meta record, None when it is not stored.

    Raises:
        DamagedBlock: the record (or the page on the way to it) is damaged.
    """
    try:
        raw = txn.get(meta_key(key), db=dbs.records)
        return None if raw is None else BlockMeta.unpack(raw)
    except (lmdb.Error, struct.error, DataLoss) as exc:
        raise DamagedBlock(key, exc) from exc


@contextmanager
def _damage_names(key: bytes) -> Iterator[None]:
    """An LMDB error while changing `key`'s records is damage on their way: say whose."""
    try:
        yield
    except (lmdb.MapFullError, lmdb.TxnFullError):
        raise
    except lmdb.Error as exc:
        raise DamagedBlock(key, exc) from exc


class BlockTxn:
    """One write transaction: block records, LRU index and usage totals changed together.

    Args:
        txn: an open write transaction (the writer lock is held).
        dbs: the tier's databases.
        unreadable: keys known to sit on damaged pages: never read (a failed read
            would fail the whole transaction), never given a carried-up time.
    """

    def __init__(self, txn: lmdb.Transaction, dbs: BlockDbs, *, unreadable: frozenset[bytes] = frozenset()) -> None:
        self.txn = txn
        self.dbs = dbs
        #: The transaction's id once committed (set by the tier's writer).
        self.txn_id = 0
        self.unreadable = unreadable
        self.usage: Usage = read_usage(txn, dbs.state)
        #: Blocks per fleet run while the store keeps a run index (0: a single node's store, none kept).
        self.run_blocks = run_index.run_blocks_of(txn, dbs.state)
        #: Changes to the totals per layout (geometry fingerprint, the key's first 8 bytes).
        self.layout_deltas: dict[bytes, Usage] = {}
        #: Changes to the totals per namespace id (the key's next 8 bytes), and names learned.
        self.namespace_deltas: dict[bytes, Usage] = {}
        self.namespace_names: dict[bytes, str] = {}
        self._namespace_read: dict[bytes, namespaces.NamespaceTotals | None] = {}
        #: What this transaction stored and removed, in order, while the store publishes events
        #: (tiers/events.py turns them into the commit's event batches); None: not recorded.
        self.changes: list[Change] | None = None

    def namespace(self, ns_id: bytes) -> namespaces.NamespaceTotals | None:
        """The namespace's record as this transaction found it (read once; without this txn's changes)."""
        if ns_id not in self._namespace_read:
            self._namespace_read[ns_id] = namespaces.read(self.txn, self.dbs.state, ns_id)
        return self._namespace_read[ns_id]

    def namespace_bytes(self, ns_id: bytes) -> int:
        """Bytes the namespace stores, with this transaction's changes so far."""
        totals = self.namespace(ns_id)
        delta = self.namespace_deltas.get(ns_id)
        return (totals.stored_bytes if totals else 0) + (delta.stored_bytes if delta else 0)

    def namespace_name(self, ns_id: bytes) -> str | None:
        """The namespace's name, None while the store has not learned it."""
        name = self.namespace_names.get(ns_id)
        if name is None:
            totals = self.namespace(ns_id)
            name = totals.name if totals is not None else None
        return name or None

    def _count(self, key: bytes, blocks: int, nbytes: int) -> None:
        self.usage.blocks += blocks
        self.usage.stored_bytes += nbytes
        for deltas, part in ((self.layout_deltas, key[:FINGERPRINT_BYTES]),
                             (self.namespace_deltas, namespaces.id_of_key(key))):
            delta = deltas.setdefault(part, Usage())
            delta.blocks += blocks
            delta.stored_bytes += nbytes

    def meta(self, key: bytes) -> BlockMeta | None:
        """The block's meta record, None when not stored (raises DamagedBlock)."""
        if key in self.unreadable:
            raise DamagedBlock(key, LookupError("found on a damaged page earlier"))
        return read_meta(self.txn, self.dbs, key)

    def insert(self, key: bytes, parent_hash: bytes, depth: int, data: Buffer, now_s: float,
               is_first: bool, *, last_use_s: float | None = None) -> None:
        """Store a new block (its parent, unless `is_first`, is stored; a fleet copy's first block
        may name a parent on another node). `last_use_s`: a fleet copy's last use on its source."""
        meta = BlockMeta(parent_hash=parent_hash, depth=depth, size_bytes=len(data),
                         checksum=xxhash.xxh3_64_intdigest(data), created_s=now_s,
                         last_access_s=now_s if last_use_s is None else last_use_s)
        txn, records = self.txn, self.dbs.records
        with _damage_names(key):
            txn.put(data_key(key), data, db=records)
            txn.put(meta_key(key), meta.pack(), db=records)
            txn.put(lru_key(meta.last_access_s, meta.depth, key), b"", db=self.dbs.lru)
            if not is_first:
                txn.put(child_key(parent_key_of(key, parent_hash), key[-32:]), b"", db=records)
            if self.run_blocks:  # F16: a run's first block names its run in the index, in this same write
                run_index.note_insert(txn, self.dbs.runs, key, depth, self.run_blocks)
        self._count(key, 1, len(data))
        if self.changes is not None:  # E1: every stored block, from the one place that stores it
            self.changes.append(Change(key=key, parent_hash=None if is_first else parent_hash, stored=True))

    def insert_run(self, keys: Sequence[bytes], parent_hash: bytes, first_depth: int, datas: Sequence[Buffer],
                   checksums: Sequence[int], now_s: float, is_root: bool, *,
                   last_use_s: Sequence[float]) -> None:
        """Store new consecutive blocks of one chain, each as `insert` stores it (the same records, in the
        same order), in one loop: `keys[0]`'s parent is `parent_hash` (none stored when `is_root`), each
        later block's the one before it; depths from `first_depth`; `checksums` the blocks' xxh3-64 and
        `last_use_s` their last uses. The blocks share a layout and namespace, so the totals change once.

        A Put's blocks come here rather than one `insert` call each: a batch's per-block Python runs inside
        the write transaction, which LMDB's one writer cannot overlap with the previous commit.
        """
        txn, records, lru, pack = self.txn, self.dbs.records, self.dbs.lru, META_STRUCT.pack
        put, run_blocks, runs = txn.put, self.run_blocks, self.dbs.runs
        changes = self.changes
        parent, key, nbytes = parent_hash, b"", 0
        try:
            for i, key in enumerate(keys):
                data, depth, use = datas[i], first_depth + i, last_use_s[i]
                size = len(data)
                put(key + DATA_TAG, data, db=records)
                put(key + META_TAG, pack(parent, depth, size, checksums[i], now_s, use), db=records)
                put(lru_key(use, depth, key), b"", db=lru)
                first = is_root and i == 0
                if not first:
                    put(child_key(parent_key_of(key, parent), key[-32:]), b"", db=records)
                if run_blocks:  # F16: a run's first block names its run in the index, in this same write
                    run_index.note_insert(txn, runs, key, depth, run_blocks)
                nbytes += size
                if changes is not None:  # E1: every stored block, from the one place that stores it
                    changes.append(Change(key=key, parent_hash=None if first else parent, stored=True))
                parent = key[-HASH_BYTES:]
        except (lmdb.MapFullError, lmdb.TxnFullError):
            raise
        except lmdb.Error as exc:  # damage on the way to this block's records: say whose
            raise DamagedBlock(key, exc) from exc
        if keys:
            self._count(keys[0], len(keys), nbytes)

    def touch(self, key: bytes, now_s: float) -> None:
        """Record a use of the block at `now_s` (nothing if it is absent or used since)."""
        meta = self.meta(key)
        if meta is None or meta.last_access_s >= now_s:
            return
        with _damage_names(key):
            self.txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=self.dbs.lru)
            self.txn.put(lru_key(now_s, meta.depth, key), b"", db=self.dbs.lru)
            self.txn.put(meta_key(key), dataclasses.replace(meta, last_access_s=now_s).pack(), db=self.dbs.records)

    def delete(self, key: bytes, *, carry_up: bool, now_s: float | None = None) -> int:
        """Remove one block and its index entries; return its size.

        Args:
            key: a stored block with no stored child.
            carry_up: give the parent this block's last use when it is later:
                the parent was in use whenever its child was, so its LRU place
                must not be older than its subtree's.
            now_s: the retention time now: a pin of the block past its time is journalled as an expiry (R29).
        """
        meta = self.meta(key)
        if meta is None:
            raise KeyError(f"no meta for block {key.hex()}")  # an index entry without its block: a bug
        txn, records = self.txn, self.dbs.records
        parent = parent_key_of(key, meta.parent_hash)
        with _damage_names(key):
            txn.delete(data_key(key), db=records)
            txn.delete(meta_key(key), db=records)
            txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=self.dbs.lru)
            txn.delete(child_key(parent, key[-32:]), db=records)
            if self.run_blocks:  # F16: the run goes from the index with its first block
                run_index.note_delete(txn, self.dbs.runs, key, meta.depth, self.run_blocks)
            if self.dbs.pins is not None:  # R26: a removed block's pin goes with it (its budget freed)
                pins.drop(self, key, expired_by=now_s)
        if carry_up and parent not in self.unreadable:
            self.touch(parent, meta.last_access_s)
        self._count(key, -1, -meta.size_bytes)
        if self.changes is not None:  # E1: every removal (eviction, purge, corrupt), from the one place that removes
            self.changes.append(Change(key=key, parent_hash=None, stored=False))
        return meta.size_bytes

    def children(self, key: bytes) -> Iterator[bytes]:
        """Storage keys of the stored children of `key`."""
        prefix = children_prefix(key)
        cursor = self.txn.cursor(db=self.dbs.records)
        try:
            if not cursor.set_range(prefix):
                return
            for raw in cursor.iternext(keys=True, values=False):
                raw = bytes(raw)
                if not raw.startswith(prefix):
                    return
                yield key[:-32] + raw[len(prefix):]
        except lmdb.Error as exc:
            raise DamagedBlock(key, exc) from exc

    def subtree(self, key: bytes) -> list[bytes]:
        """`key` and every stored descendant, parents before children."""
        out: list[bytes] = []
        todo = [key]
        while todo:
            node = todo.pop()
            out.append(node)
            todo.extend(self.children(node))
        return out
