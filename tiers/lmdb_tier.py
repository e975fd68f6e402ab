"""The NVMe tier: global-KV blocks in LMDB, with the 72-hour retention guarantee.

Storage rules (docs/RETENTION.md numbers them; tests are named after them):
- A Put commits, fsync included, before it returns; one transaction per batch
  (or per group of batches, all or none, with `put_many`).
- A block is stored only when its parent is stored (or is the chain root), and
  eviction takes only blocks with no stored child, so a chain's stored blocks
  always form a prefix: no cached prefix loses a middle block, and Lookup can
  binary-search.
- A block becomes evictable `retention_s` after its last write or read. Its
  ancestors cannot go before it does (they have a stored child), so a read or
  write of a block protects its whole prefix.
- When space is needed, evictable leaves go least recently used first; when
  none is left, the Put fails with ResourceExhausted and stores nothing.

All methods here block; the service runs them on `executor`, the tier's one
bounded pool, through `call`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import enum
import json
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

import lmdb
import xxhash

from kvstore.clock import Clock, SystemClock
from kvstore.config import StoreSettings
from kvstore.errors import FailedPrecondition, ResourceExhausted
from kvstore.prefix import BlockScope
from tiers import blockcopy
from tiers.accounting import Counters, TierStats, WriteRate
from tiers.datadir import open_environment
from tiers.leases import Lease, LeaseTable
from tiers.records import (
    DATA_TAG,
    META_TAG,
    BlockMeta,
    child_key,
    children_prefix,
    data_key,
    lru_entry,
    lru_key,
    meta_key,
    parent_key_of,
)

T = TypeVar("T")

#: A read within this many seconds of a block's recorded access is not recorded
#: again: hot blocks would otherwise cost a write per read. Eviction waits this
#: much longer than the retention, so the guarantee holds for the true last read.
TOUCH_GRANULARITY_S = 60.0
_USAGE = struct.Struct("<QQ")
Buffer = bytes | bytearray | memoryview


class ReadStatus(enum.Enum):
    """Outcome of reading one block."""

    FOUND = 1
    MISSING = 2
    CORRUPT = 3


#: `blockcopy` result code -> status (NOT_REACHED -> None).
_READ_STATUS: dict[int, ReadStatus | None] = {blockcopy.NOT_REACHED: None, **{s.value: s for s in ReadStatus}}


@dataclass(frozen=True, kw_only=True, slots=True)
class PutResult:
    """What one Put batch did."""

    written_blocks: int
    existing_blocks: int
    written_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class PutBatch:
    """Consecutive blocks of one chain to store (validated by the caller)."""

    scope: BlockScope
    parent_hash: bytes
    hashes: Sequence[bytes]
    blocks: Sequence[Buffer]
    is_root: bool


class LmdbBlockTier:
    """Global-KV blocks on NVMe through LMDB.

    Args:
        settings: the store section of the configuration.
        clock: time source for retention and leases (inject a ManualClock in tests).
    """

    def __init__(self, settings: StoreSettings, *, clock: Clock | None = None) -> None:
        self.settings = settings
        self.clock: Clock = clock or SystemClock()
        self.leases = LeaseTable(self.clock)
        self.executor = ThreadPoolExecutor(settings.io_threads, thread_name_prefix="lmdb")
        # Checks, locks and opens the data dir (docs/OPERATIONS.md); close() releases the lock.
        self.env, self._dir_lock = open_environment(settings)
        # Data, meta and child entries of each block, side by side (tiers/records.py).
        self._records = self.env.open_db(b"records")
        self._lru = self.env.open_db(b"lru")
        self._state = self.env.open_db(b"state")
        self._lock = threading.Lock()
        self._touch_lock = threading.Lock()
        self._touch_pending: set[bytes] = set()
        self._touch_future: Future[None] = Future()
        self._touch_scheduled = False
        self._started_s = self.clock.now()
        self._write_rate = WriteRate(settings.write_rate_window_s, self._started_s)
        with self.env.begin() as txn:
            raw = txn.get(b"usage", db=self._state)
            self._blocks_stored, self._bytes_stored = _USAGE.unpack(raw) if raw else (0, 0)
            saved = txn.get(b"counters", db=self._state)
            self.counters = Counters(**json.loads(saved)) if saved else Counters()

    # -- lifecycle ---------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking tier work on the tier's executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        """Persist the counters, finish queued work and close LMDB."""
        self.executor.shutdown(wait=True)
        with self.env.begin(write=True) as txn:
            self._save_state(txn)
        self.env.close()
        self._dir_lock.release()

    @contextmanager
    def _write(self) -> Iterator[lmdb.Transaction]:
        """A write transaction that commits with the usage and counters, or undoes
        the in-memory usage when it aborts."""
        usage = self._blocks_stored, self._bytes_stored
        try:
            with self.env.begin(write=True) as txn:
                yield txn
                self._save_state(txn)
        except BaseException:
            self._blocks_stored, self._bytes_stored = usage
            raise

    # -- lookup and leases -------------------------------------------------

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], lease_s: float = 0.0) -> tuple[int, Lease | None]:
        """How many leading blocks of `hashes` are stored, and a lease on them if asked.

        Stored blocks of a chain always form a prefix, so this is a binary search:
        a 1M-token prompt costs about 14 index reads.
        """
        with self.env.begin() as txn:
            lo, hi = 0, len(hashes)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if txn.get(meta_key(scope.key(hashes[mid - 1])), db=self._records) is not None:
                    lo = mid
                else:
                    hi = mid - 1
            lease = self.leases.grant(scope.key(hashes[lo - 1]), lease_s) if lo and lease_s > 0 else None
        tokens = self.settings.block_tokens
        with self._lock:
            self.counters.lookups += 1
            self.counters.lookup_tokens_asked += len(hashes) * tokens
            self.counters.lookup_tokens_found += lo * tokens
        return lo, lease

    # -- writes ------------------------------------------------------------

    def put(self, scope: BlockScope, parent_hash: bytes, hashes: Sequence[bytes],
            blocks: Sequence[Buffer], is_root: bool) -> PutResult:
        """Store consecutive blocks of one chain, durably, in one transaction.

        Args:
            scope: layout and tenant.
            parent_hash: hash before the first block.
            hashes: chain hashes of the blocks, in order.
            blocks: the blocks' bytes (sizes are checked by the caller).
            is_root: whether `parent_hash` is the chain root (no stored parent needed).

        Raises:
            FailedPrecondition: the parent block is not stored.
            ResourceExhausted: no room without evicting a protected block.
        """
        batch = PutBatch(scope=scope, parent_hash=parent_hash, hashes=hashes, blocks=blocks, is_root=is_root)
        return self.put_many([batch])[0]

    def put_many(self, batches: Sequence[PutBatch]) -> list[PutResult]:
        """Store several Put batches in one transaction (group commit): all or none.

        Batches are applied in order, so a batch may extend the chain of the one
        before it. One fsync serves them all; each counts as its own put.
        """
        now = self.clock.now()
        try:
            with self._write() as txn:
                results = [self._put_in(txn, b, now) for b in batches]
        except lmdb.MapFullError:
            self._count_rejected()
            raise ResourceExhausted("the LMDB map is full; raise store.capacity_bytes") from None
        except ResourceExhausted:
            self._count_rejected()
            raise
        with self._lock:
            for r in results:
                self.counters.puts += 1
                self.counters.blocks_written += r.written_blocks
                self.counters.bytes_written += r.written_bytes
                self._write_rate.note(now, r.written_bytes)
        return results

    def _put_in(self, txn: lmdb.Transaction, batch: PutBatch, now: float) -> PutResult:
        parent_depth = self._parent_depth(txn, batch.scope, batch.parent_hash, batch.is_root)
        keys = [batch.scope.key(h) for h in batch.hashes]
        fresh = [txn.get(meta_key(k), db=self._records) is None for k in keys]
        need = sum(len(b) for b, f in zip(batch.blocks, fresh, strict=True) if f)
        self._make_room(txn, need, now)
        parent = batch.parent_hash
        for i, (key, data) in enumerate(zip(keys, batch.blocks, strict=True)):
            if fresh[i]:
                self._insert(txn, key, parent, parent_depth + i + 1, data, now, batch.is_root and i == 0)
            else:
                self._touch(txn, key, now)
            parent = batch.hashes[i]
        written = sum(fresh)
        return PutResult(written_blocks=written, existing_blocks=len(keys) - written, written_bytes=need)

    def _parent_depth(self, txn: lmdb.Transaction, scope: BlockScope, parent_hash: bytes, is_root: bool) -> int:
        if is_root:
            return 0
        raw = txn.get(meta_key(scope.key(parent_hash)), db=self._records)
        if raw is None:
            raise FailedPrecondition(
                f"parent block {parent_hash.hex()[:16]}... is not stored; put the prefix first"
            )
        return BlockMeta.unpack(raw).depth

    def _insert(self, txn: lmdb.Transaction, key: bytes, parent_hash: bytes, depth: int,
                data: Buffer, now: float, is_first: bool) -> None:
        meta = BlockMeta(parent_hash=parent_hash, depth=depth, size_bytes=len(data),
                         checksum=xxhash.xxh3_64_intdigest(data), created_s=now, last_access_s=now)
        txn.put(data_key(key), data, db=self._records)
        txn.put(meta_key(key), meta.pack(), db=self._records)
        txn.put(lru_key(now, depth, key), b"", db=self._lru)
        if not is_first:
            txn.put(child_key(parent_key_of(key, parent_hash), key[-32:]), b"", db=self._records)
        self._blocks_stored += 1
        self._bytes_stored += len(data)

    def _touch(self, txn: lmdb.Transaction, key: bytes, now: float) -> None:
        raw = txn.get(meta_key(key), db=self._records)
        if raw is None:
            return
        meta = BlockMeta.unpack(raw)
        if meta.last_access_s >= now:
            return
        txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=self._lru)
        txn.put(lru_key(now, meta.depth, key), b"", db=self._lru)
        txn.put(meta_key(key), dataclasses.replace(meta, last_access_s=now).pack(), db=self._records)

    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a read of `keys` now: the retention clock of each restarts (one fsync'd commit).

        Blocks recorded less than TOUCH_GRANULARITY_S ago are skipped, and when
        all are, nothing is written.
        """
        now = self.clock.now()
        with self.env.begin() as txn:
            stale = [k for k in keys if self._stale(txn, k, now)]
        if stale:
            with self._write() as txn:
                for key in stale:
                    self._touch(txn, key, now)

    def _stale(self, txn: lmdb.Transaction, key: bytes, now: float) -> bool:
        raw = txn.get(meta_key(key), db=self._records)
        return raw is not None and BlockMeta.unpack(raw).last_access_s < now - TOUCH_GRANULARITY_S

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        """Queue a read of `keys` for the next group commit; the future resolves once it is durable.

        Reads come in many small batches; one fsync'd write transaction per batch
        would queue them all behind LMDB's single writer. Touches that arrive while
        a commit runs are merged into the next one.
        """
        with self._touch_lock:
            self._touch_pending.update(keys)
            future = self._touch_future
            if not self._touch_scheduled:
                self._touch_scheduled = True
                self.executor.submit(self._flush_touches)
        return future

    def _flush_touches(self) -> None:
        with self._touch_lock:
            keys, self._touch_pending = self._touch_pending, set()
            future, self._touch_future = self._touch_future, Future()
            self._touch_scheduled = False
        try:
            self.touch(keys)
        except BaseException as exc:
            future.set_exception(exc)
        else:
            future.set_result(None)

    # -- eviction ----------------------------------------------------------

    def _make_room(self, txn: lmdb.Transaction, need: int, now: float) -> None:
        """Evict expired leaves, LRU first, until `need` more bytes fit."""
        excess = self._bytes_stored + need - self.settings.capacity_bytes
        if excess <= 0:
            return
        cutoff = now - self.settings.retention_s - TOUCH_GRANULARITY_S
        pinned = self.leases.pinned()
        freed = 0
        while freed < excess:
            victims = list(self._evictable(txn, cutoff, pinned, excess - freed))
            if not victims:
                raise ResourceExhausted(
                    f"store full: {need} bytes needed, {self.settings.capacity_bytes - self._bytes_stored} "
                    f"free, and every other block is within its {self.settings.retention_hours:g}-hour "
                    "retention or leased"
                )
            for key in victims:
                freed += self._delete(txn, key, propagate_access=True)
                with self._lock:
                    self.counters.evictions += 1
        with self._lock:
            self.counters.evicted_bytes += freed

    def _evictable(self, txn: lmdb.Transaction, cutoff: float, pinned: frozenset[bytes],
                   want: int) -> Iterator[bytes]:
        """Leaves past retention, oldest first, until `want` bytes are found."""
        found = 0
        chosen: set[bytes] = set()
        cursor = txn.cursor(db=self._lru)
        for raw in cursor.iternext(keys=True, values=False):
            access_s, key = lru_entry(raw)
            if access_s >= cutoff or found >= want:
                return
            # A parent whose children are all chosen already is a leaf by the
            # time it is deleted: the whole chain goes, tail first.
            if key in pinned or any(c not in chosen for c in self._children_of(txn, key)):
                continue
            chosen.add(key)
            found += self._meta_of(txn, key).size_bytes
            yield key

    def _meta_of(self, txn: lmdb.Transaction, key: bytes) -> BlockMeta:
        raw = txn.get(meta_key(key), db=self._records)
        if raw is None:
            raise KeyError(f"no meta for block {key.hex()}")  # an index entry without its block: a bug
        return BlockMeta.unpack(raw)

    def _children_of(self, txn: lmdb.Transaction, key: bytes) -> Iterator[bytes]:
        """Storage keys of the stored children of `key`."""
        prefix = children_prefix(key)
        cursor = txn.cursor(db=self._records)
        if not cursor.set_range(prefix):
            return
        for raw in cursor.iternext(keys=True, values=False):
            raw = bytes(raw)
            if not raw.startswith(prefix):
                return
            yield key[:-32] + raw[len(prefix):]

    def _delete(self, txn: lmdb.Transaction, key: bytes, *, propagate_access: bool) -> int:
        """Remove one block and its index entries; return its size."""
        meta = self._meta_of(txn, key)
        txn.delete(data_key(key), db=self._records)
        txn.delete(meta_key(key), db=self._records)
        txn.delete(lru_key(meta.last_access_s, meta.depth, key), db=self._lru)
        parent = parent_key_of(key, meta.parent_hash)
        txn.delete(child_key(parent, key[-32:]), db=self._records)
        if propagate_access:
            # The parent was in use whenever this child was: carry the child's
            # time up so the parent's LRU position is not older than its subtree's.
            raw = txn.get(meta_key(parent), db=self._records)
            if raw is not None and BlockMeta.unpack(raw).last_access_s < meta.last_access_s:
                self._touch(txn, parent, meta.last_access_s)
        self._blocks_stored -= 1
        self._bytes_stored -= meta.size_bytes
        return meta.size_bytes

    # -- reads -------------------------------------------------------------

    def read(self, keys: Sequence[bytes]) -> list[tuple[ReadStatus, bytes | None]]:
        """Read blocks, each verified against its checksum.

        A corrupt block is never returned: it is reported CORRUPT, counted, and
        removed with its descendants (which could no longer be reached as a prefix).
        """
        out: list[tuple[ReadStatus, bytes | None]] = []
        corrupt: list[bytes] = []
        with self.env.begin(buffers=True) as txn:
            for key in keys:
                status, view = self._verified(txn, key)
                out.append((status, bytes(view) if view is not None else None))
                if status is ReadStatus.CORRUPT:
                    corrupt.append(key)
        if corrupt:
            self.drop_corrupt(corrupt)
        return out

    def read_into(self, keys: Sequence[bytes], dests: Sequence[memoryview | None],
                  stop_at_missing: bool = False, *, touch_due: list[bytes] | None = None
                  ) -> list[ReadStatus | None]:
        """Copy blocks straight from LMDB's map into caller memory, in one read txn.

        Each block is checksum-verified in the map before it is copied, so a
        corrupt block never reaches `dests` (it is reported, counted and dropped
        as `read` does). The only copy is map -> destination. This is
        `stage_reads` then `StagedReads.copy` on one thread; the transfer path
        runs the two halves on different threads.

        Args:
            keys: storage keys, in order.
            dests: one writable view per key, each exactly the block's size; None
                skips that key (its result is None).
            stop_at_missing: stop at the first block not FOUND; later results are None.
            touch_due: if given, the keys of FOUND blocks whose retention clock is
                due a restart (those `touch` would write) are appended to it, so the
                caller touches only those without reading their records again.

        Returns:
            A status per key; None where the key was skipped or not reached.

        Raises:
            ValueError: a destination's size differs from the stored block's.
        """
        wanted = [None if d is None else k for k, d in zip(keys, dests, strict=True)]
        codes = self.stage_reads(wanted).copy(dests, stop_at_missing, touch_due=touch_due)
        return [_READ_STATUS[c] for c in codes]

    def stage_reads(self, keys: Sequence[bytes | None]) -> StagedReads:
        """Look blocks up for `read_into` (None: skip that one), leaving their read txn open for the copy.

        The lookups hold the GIL between gets; the copy (`StagedReads.copy`)
        need not, so a caller can look up on one thread and copy on others.
        """
        txn = self.env.begin(buffers=True)
        try:
            get, db, meta_tag, data_tag = txn.get, self._records, META_TAG, DATA_TAG
            metas = [None if k is None else get(k + meta_tag, None, db) for k in keys]
            # A key with a meta record is not None.
            datas = [None if m is None else get(k + data_tag, None, db)  # type: ignore[operator]
                     for k, m in zip(keys, metas, strict=True)]
        except BaseException:
            txn.abort()
            raise
        return StagedReads(self, txn, list(keys), metas, datas)

    def _verified(self, txn: lmdb.Transaction, key: bytes) -> tuple[ReadStatus, memoryview | None]:
        """The block's bytes as a view valid until `txn` ends, if intact."""
        raw_meta = txn.get(meta_key(key), db=self._records)
        if raw_meta is None:
            return ReadStatus.MISSING, None
        meta = BlockMeta.unpack(raw_meta)
        data = txn.get(data_key(key), db=self._records)
        if data is None or len(data) != meta.size_bytes or xxhash.xxh3_64_intdigest(data) != meta.checksum:
            return ReadStatus.CORRUPT, None
        return ReadStatus.FOUND, memoryview(data)

    def drop_corrupt(self, keys: Sequence[bytes]) -> None:
        """Remove corrupt blocks and their descendants; count them."""
        with self._write() as txn:
            for key in keys:
                if txn.get(meta_key(key), db=self._records) is None:
                    continue
                for victim in reversed(list(self._subtree(txn, key))):
                    self._delete(txn, victim, propagate_access=False)
                with self._lock:
                    self.counters.corrupt_blocks += 1

    def _subtree(self, txn: lmdb.Transaction, key: bytes) -> Iterator[bytes]:
        """`key` and every stored descendant, parents before children."""
        todo = [key]
        while todo:
            node = todo.pop()
            yield node
            todo.extend(self._children_of(txn, node))

    def count_get(self, asked_blocks: int, returned_blocks: int) -> None:
        """Count one Get: blocks asked for and blocks actually returned."""
        tokens = self.settings.block_tokens
        with self._lock:
            self.counters.gets += 1
            self.counters.get_tokens_asked += asked_blocks * tokens
            self.counters.get_tokens_returned += returned_blocks * tokens

    # -- accounting --------------------------------------------------------

    def stats(self) -> TierStats:
        """Counters, usage and retention headroom now."""
        now = self.clock.now()
        with self._lock:
            rate = self._write_rate.per_second(now)
            counters = Counters(**asdict(self.counters))
            blocks, used = self._blocks_stored, self._bytes_stored
        free = max(self.settings.capacity_bytes - used, 0)
        return TierStats(
            counters=counters, blocks_stored=blocks, bytes_stored=used,
            capacity_bytes=self.settings.capacity_bytes, bytes_free=free,
            write_rate_bytes_per_s=rate,
            headroom_hours=free / rate / 3600.0 if rate > 0 else float("inf"),
            retention_hours=self.settings.retention_hours, active_leases=self.leases.active(),
            uptime_s=now - self._started_s,
        )


    def _count_rejected(self) -> None:
        with self._lock:
            self.counters.rejected_puts += 1

    def _save_state(self, txn: lmdb.Transaction) -> None:
        with self._lock:
            counters = json.dumps(asdict(self.counters)).encode()
        txn.put(b"usage", _USAGE.pack(self._blocks_stored, self._bytes_stored), db=self._state)
        txn.put(b"counters", counters, db=self._state)

    def __repr__(self) -> str:
        return f"LmdbBlockTier({self.settings.data_dir})"


class StagedReads:
    """Blocks looked up for a copy (`LmdbBlockTier.stage_reads`): views into LMDB's
    map, valid while the read txn they came from is open.

    The txn is not tied to the thread that began it (py-lmdb opens every
    environment with MDB_NOTLS), so `copy` may run on another thread; it ends
    the txn. Use it once.
    """

    def __init__(self, tier: LmdbBlockTier, txn: lmdb.Transaction, keys: list[bytes | None], metas: list[Any],
                 datas: list[Any]) -> None:
        self._tier = tier
        self._txn: lmdb.Transaction | None = txn
        self._keys = keys
        self._metas = metas
        self._datas = datas

    def copy(self, dests: Sequence[memoryview | None], stop_at_missing: bool = False, *,
             touch_due: list[bytes] | None = None) -> bytes:
        """Verify and copy each block into its dest, then end the txn: see `LmdbBlockTier.read_into`.

        A block whose key was None is skipped, so is one whose dest is None.

        Returns:
            A `blockcopy` result code per key (`ReadStatus` values; 0 where not reached).
        """
        if self._txn is None:
            raise RuntimeError("these reads were copied or closed already")
        tier, keys = self._tier, self._keys
        try:
            due_before = tier.clock.now() - TOUCH_GRANULARITY_S
            if len(dests) != len(keys):
                raise ValueError(f"{len(dests)} dests for {len(keys)} keys")
            wanted = [None if k is None else d for k, d in zip(keys, dests, strict=True)]
            codes, due = blockcopy.verify_copy(self._metas, self._datas, wanted, due_before, stop_at_missing)
        finally:
            self.close()
        if blockcopy.WRONG_SIZE in codes:
            raise ValueError(f"destination {codes.index(blockcopy.WRONG_SIZE)}'s size differs from the stored block's")
        if touch_due is not None:
            touch_due.extend(keys[i] for i in due)  # type: ignore[misc]  # FOUND blocks have keys
        if blockcopy.CORRUPT in codes:
            tier.drop_corrupt([k for k, c in zip(keys, codes, strict=True) if c == blockcopy.CORRUPT and k])
        return codes

    def close(self) -> None:
        """Drop the views and end the txn (a no-op once done)."""
        self._metas = self._datas = []
        if self._txn is not None:
            self._txn.abort()
            self._txn = None
