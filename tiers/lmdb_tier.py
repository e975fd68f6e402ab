"""The NVMe tier: global-KV blocks in LMDB, with the 72-hour retention guarantee.

The tier's front: it opens the store and runs each call in a transaction; the ideas
live beside it (docs/RETENTION.md numbers the rules):

- `tiers/retention.py`: the retention rule, what may be evicted and when, the retention clock.
- `tiers/eviction.py`: making room, least recently used first.
- `tiers/puts.py`: a Put's write transaction: what it protects, room made, blocks stored.
- `tiers/block_txn.py`: a write transaction's block records, LRU index and usage.
- `tiers/usage.py`: the usage totals, kept inside write transactions; `tiers/refresh.py`: refreshes' group commit.
- `tiers/durable.py`: each commit flushed outside LMDB's write lock, and rolled back at start if a crash left it
  not durable (R34-R36).
- `tiers/reads.py`: verified and staged zero-copy reads; `tiers/damage.py`: damaged pages met at run time.
- `tiers/namespaces.py`, `tiers/purge.py`, `tiers/export.py`: usage per namespace, purge, export/import.
- `kvstore/native/records.py`, `tiers/leases.py`, `tiers/accounting.py`: the on-disk records, leases,
  counters; `tiers/tally.py`: each call's outcome counted; `tiers/datadir.py`: the data dir.

It implements `tiers.store`'s BlockStore, MappedReads (`map`: `tiers/lmdb_map.py`) and ManagedStore,
which are all the gateway sees of it. Its methods block; the service runs them on `executor`, through `call`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import TYPE_CHECKING, Any, TypeVar

import lmdb

from kvstore.clock import Clock, SystemClock
from kvstore.config import StoreSettings
from kvstore.prefix import BlockScope, namespace_id
from tiers import export, namespaces, pins, purge, reads, run_index, stale_copies, usage
from tiers.accounting import Counters, TierStats, WriteRate
from tiers.block_txn import BlockDbs, BlockTxn, Buffer, PutBatch, PutResult, read_meta
from tiers.chains import ChainIndex
from tiers.damage import DamagedBlocks
from tiers.datadir import MAX_CHECKED_TREE_PAGES, open_environment
from tiers.durable import Committed, DurableCommits
from tiers.eviction import Evicted, SkippedRuns
from tiers.leases import Lease, LeaseTable
from tiers.lmdb_map import LmdbMap
from tiers.namespaces import NamespaceUsage
from tiers.puts import RoomRules, commit_puts
from tiers.reads import READ_STATUS, ReadStatus, StagedReads
from tiers.refresh import RefreshBatcher
from tiers.retention import (
    HIGH_WATER,
    HIGH_WATER_KEY,
    TOUCH_GRANULARITY_S,
    NamespaceRetention,
    Retention,
    RetentionClock,
    persisted_high_water,
)
from tiers.tally import Tally

if TYPE_CHECKING:
    from kvstore.config_sections import EventsSettings
    from kvstore.events.publisher import EventPublisher
    from tiers.events import EventLog

__all__ = ["TOUCH_GRANULARITY_S", "LmdbBlockTier", "NamespaceUsage", "PutBatch", "PutResult", "ReadStatus",
           "StagedReads"]

log = logging.getLogger(__name__)
T = TypeVar("T")

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
        try:  # leave nothing open: a second try must not find the dir locked
            # R34-R36: each commit flushed outside LMDB's write lock, one at most not yet durable.
            self._durable = DurableCommits(self.env, settings.data_dir)
            try:
                self._open_state(settings)
            except BaseException:
                self._durable.close()
                raise
        except BaseException:
            self.env.close()
            self._dir_lock.release()
            self.executor.shutdown(wait=False)
            raise

    def _open_state(self, settings: StoreSettings) -> None:
        # Data, meta and child entries of each block, side by side (kvstore/native/records.py).
        self._dbs = BlockDbs.open(self.env)
        self._durable.sync()  # R35: the writes at open are not made through `_write`: each flushed before the next
        self._records, self._state = self._dbs.records, self._dbs.state
        self.rule = Retention(retention_s=settings.retention_s)
        self.retention = NamespaceRetention(settings.retention_s)
        self._skipped = SkippedRuns()  # where eviction's walks of the LRU index start (R18)
        self._quota_of: Callable[[str], int] = _no_quota
        default_pins = pins.PinLimits(max_s=settings.pin_max_hours * 3600.0, budget_bytes=settings.pin_budget_bytes)
        self._pin_limits: Callable[[str], pins.PinLimits] = lambda namespace: default_pins
        self._default_pins = default_pins
        with self.env.begin() as txn:
            saved = txn.get(b"counters", db=self._state)
            counters = Counters.load(saved)
            high_water = persisted_high_water(txn, self._dbs.state, self._dbs.lru)
        self.retention_clock = RetentionClock(self.clock, high_water)
        totals, by_namespace = usage.check_and_repair(self.env, self._records, self._state,
                                                      max_tree_pages=MAX_CHECKED_TREE_PAGES)
        self._durable.sync()
        if by_namespace is not None:
            namespaces.check_and_repair(self.env, self._state, by_namespace, self.retention_clock.now())
            self._durable.sync()
        self._tally = Tally(counters, totals, WriteRate(settings.write_rate_window_s, self.retention_clock.now()))
        self._damage = DamagedBlocks(settings.data_dir, self._tally.damaged_on_page, self.env)
        self._refresh = RefreshBatcher(self.executor, self.touch)
        self.chains = ChainIndex(self.env, self._records, self._damage)
        self.map = LmdbMap(self.env, self._records)  # the MappedReads capability's raw read txns
        #: KV cache events (docs/EVENTS.md): the log written in each commit and its sockets; None while off.
        self.events: EventLog | None = None
        self.publisher: EventPublisher | None = None
        self._commit_order: AbstractContextManager[Any] = nullcontext()

    def publish_events(self, settings: EventsSettings, node_id: str) -> EventPublisher:
        """Log every stored and removed block as KV cache events from now on, and publish them (docs/EVENTS.md).

        Call it before the first write the events must cover (the server does, before it serves).

        Raises:
            zmq.ZMQError: an endpoint cannot be bound.
        """
        import threading

        from kvstore.events.publisher import start_publisher
        from tiers.events import EventLog

        log_ = EventLog(self.env, node_id=node_id, block_tokens=self.settings.block_tokens, topic=settings.topic,
                        keep_batches=settings.replay_batches, now=self.clock.now, token_ids=settings.token_ids)
        self._durable.sync()  # the log's opening batch (R35: flushed before the next commit)
        self.publisher = start_publisher(settings, log_.read_from, log_.opening)
        self.events = log_
        # E6: commit and queue in one order (LMDB serializes the commits, this the queueing after them),
        # so the live stream's numbers only go up.
        self._commit_order = threading.Lock()
        return self.publisher

    # -- lifecycle ---------------------------------------------------------

    async def call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking tier work on the tier's executor."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def close(self) -> None:
        """Persist the counters and the retention clock, finish queued work and close LMDB."""
        self.executor.shutdown(wait=True)
        with self._write():
            pass
        self._durable.close()
        if self.publisher is not None:  # its thread reads the log: closed before the environment
            self.publisher.close()
        self.env.close()
        self._dir_lock.release()

    def enable_run_index(self, run_blocks: int) -> int:
        """Keep the fleet's run index for `run_blocks` (`tiers.run_index.enable`), durably; the runs it indexed."""
        built = run_index.enable(self.env, run_blocks)
        self._durable.sync()
        return built

    async def durable(self, committed: Committed[T]) -> T:
        """`committed`'s value once its commit is durable (R34; the flusher thread flushes it, no executor
        thread waits).

        Raises:
            Unavailable: its flush failed.
        """
        if self._durable.durable_txn < committed.txn_id:
            loop = asyncio.get_running_loop()
            done: asyncio.Future[None] = loop.create_future()
            self._durable.when_durable(committed.txn_id, functools.partial(_resolve_soon, loop, done))
            await done
        return committed.value

    def on_durable(self, committed: Committed[T], then: Callable[[BaseException | None], None]) -> None:
        """Run `then(None)` once `committed` is durable, `then(error)` if its flush failed (on the flusher
        thread: keep it short)."""
        self._durable.when_durable(committed.txn_id, then)

    def wait_durable(self, committed: Committed[T]) -> T:
        """`durable`, blocking."""
        self._durable.wait(committed.txn_id)
        return committed.value

    @contextmanager
    def _write(self, *, durable: bool = True) -> Iterator[BlockTxn]:
        """A write transaction that commits with the usage totals, counters and retention clock; on return
        durable (R34), or with `durable` False committed only (its id in `txn_id`: the caller waits).

        The totals are read inside the transaction (after LMDB's writer lock is held) and written
        back by it, so an abort changes nothing (R14); the in-memory copy is replaced after the commit,
        by the newest commit only. Its pages are written only once the commit before it is durable (R35).
        """
        with self._commit_order:
            with self.env.begin(write=True) as txn:
                w = BlockTxn(txn, self._dbs, unreadable=self._damage.snapshot())
                if self.events is not None:
                    w.changes = []
                yield w
                usage.write_usage(txn, self._state, w.usage)
                usage.add_layout_usage(txn, self._state, w.layout_deltas)
                namespaces.apply(txn, self._state, w.namespace_deltas, w.namespace_names,
                                 self.retention_clock.now())
                self._save_state(txn)
                # E1: the events go into this same transaction: they exist exactly when their blocks' change does.
                logged = self.events.log(w, w.changes) if self.events is not None and w.changes else []
                txn_id = txn.id()
                self._durable.before_commit(txn_id)
            if self.env.info()["last_txnid"] < txn_id:  # nothing written: LMDB committed no transaction
                txn_id -= 1
            # Committed; only once durable may anyone hear of it (E1), in commit order (E6).
            publish = functools.partial(_publish, self.publisher, logged) if logged and self.publisher else None
            self._durable.committed(txn_id, publish)
        self._tally.committed(txn_id, w.usage)
        w.txn_id = txn_id
        if durable:
            self._durable.wait(txn_id)

    # -- lookup and leases -------------------------------------------------

    def lookup(self, scope: BlockScope, hashes: Sequence[bytes], lease_s: float = 0.0, *,
               touch_due: list[bytes] | None = None) -> tuple[int, Lease | None]:
        """How many leading blocks of `hashes` are stored as one chain, and a lease on them if asked.

        Block i counts only when it is stored with depth i + 1 and, after the
        first, with hashes[i - 1] as its parent (R15): hashes that are not a
        chain (a repeated hash, a stored block after an absent one) find no more
        than Get would. One index read per found block: a 1M-token prompt
        (15,625 blocks) is one tight loop.

        Args:
            scope: layout and tenant.
            hashes: the prompt's chain hashes, from its first block.
            lease_s: pin the deepest found block (and so its prefix) this long; 0: no lease.
            touch_due: if given, the deepest found block's key is appended to it when its retention
                clock is due a restart (what `touch` would write): the caller refreshes it (R5).
        """
        found, last_use_s = self.chains.find(scope, hashes)
        return found, self._found(scope, hashes[found - 1] if found else b"", found, len(hashes), last_use_s,
                                  lease_s, touch_due)

    def lookup_runs(self, scope: BlockScope, hashes: Sequence[bytes], lengths: Sequence[int], lease_s: float = 0.0,
                    *, touch_due: list[bytes] | None = None) -> list[tuple[int, Lease | None]]:
        """`lookup` of each run of `hashes` cut by `lengths`, each its own chain from the root (`tiers.store.RunLookup`,
        docs/FLEET.md F50): one read txn for them all (`ChainIndex.find_runs`), their leases granted together."""
        found = self.chains.find_runs(scope, hashes, lengths)
        now, tokens = self.retention_clock.now(), self.settings.block_tokens
        deepest: list[bytes | None] = []
        start = 0
        for n, (blocks, last_use_s) in zip(lengths, found, strict=True):
            key = scope.key(hashes[start + blocks - 1]) if blocks else None
            if key is not None and touch_due is not None and self.rule.touch_due(last_use_s, now):
                touch_due.append(key)
            deepest.append(key)
            self._tally.lookup(asked_tokens=n * tokens, found_tokens=blocks * tokens)
            start += n
        granted = iter(self.leases.grant_many([k for k in deepest if k is not None], lease_s) if lease_s > 0 else ())
        return [(blocks, next(granted) if key is not None and lease_s > 0 else None)
                for (blocks, _), key in zip(found, deepest, strict=True)]

    def lookup_run_anchors(self, scope: BlockScope, anchors: Sequence[bytes], lengths: Sequence[int],
                           lease_s: float = 0.0, *,
                           touch_due: list[bytes] | None = None) -> list[tuple[int, Lease | None]]:
        """Each run named by its last hash (docs/FLEET.md F77): (its length, the lease if asked) when the hash is
        stored at the run's length, else (0, None); one read txn (`ChainIndex.find_anchors`), one lease pinning
        every whole run's last block (`LeaseTable.grant_together`), each run counted as a Lookup of it."""
        found = self.chains.find_anchors(scope, anchors, lengths)
        now, tokens = self.retention_clock.now(), self.settings.block_tokens
        whole: list[bytes] = []
        for anchor, n, last_use_s in zip(anchors, lengths, found, strict=True):
            if last_use_s is not None:
                whole.append(key := scope.key(anchor))
                if touch_due is not None and self.rule.touch_due(last_use_s, now):
                    touch_due.append(key)
            self._tally.lookup(asked_tokens=n * tokens, found_tokens=n * tokens if last_use_s is not None else 0)
        lease = self.leases.grant_together(whole, lease_s) if whole and lease_s > 0 else None
        return [(n, lease) if last_use_s is not None else (0, None)
                for n, last_use_s in zip(lengths, found, strict=True)]

    def lookup_after(self, scope: BlockScope, anchor_hash: bytes, anchor_blocks: int, hashes: Sequence[bytes],
                     lease_s: float = 0.0, *, touch_due: list[bytes] | None = None) -> tuple[int, Lease | None] | None:
        """`lookup` of a next turn: the chain of `anchor_blocks` blocks ending at `anchor_hash`, then `hashes`
        (`tiers.store.AnchoredLookup`); None when the anchor is not stored at that depth (nothing leased)."""
        known = self.chains.find_after(scope, anchor_hash, anchor_blocks, hashes)
        if known is None:
            return None
        found, last_use_s = known
        deepest = hashes[found - anchor_blocks - 1] if found > anchor_blocks else anchor_hash
        return found, self._found(scope, deepest, found, anchor_blocks + len(hashes), last_use_s, lease_s, touch_due)

    def _found(self, scope: BlockScope, deepest: bytes, found: int, asked: int, last_use_s: float, lease_s: float,
               touch_due: list[bytes] | None) -> Lease | None:
        """A Lookup's found prefix used (R5: the deepest block due a refresh), leased if asked, counted."""
        if touch_due is not None and found and self.rule.touch_due(last_use_s, self.retention_clock.now()):
            touch_due.append(scope.key(deepest))
        lease = self.leases.grant(scope.key(deepest), lease_s) if found and lease_s > 0 else None
        tokens = self.settings.block_tokens
        self._tally.lookup(asked_tokens=asked * tokens, found_tokens=found * tokens)
        return lease

    def release(self, lease_id: str, *, owns: Callable[[bytes], bool] | None = None) -> bool:
        """Drop a lease (`LeaseTable.release`): False when unknown, expired, or pinning a key `owns` refuses."""
        return self.leases.release(lease_id, owns=owns)

    # -- writes ------------------------------------------------------------

    def put(self, scope: BlockScope, parent_hash: bytes, hashes: Sequence[bytes],
            blocks: Sequence[Buffer], is_root: bool, *, quota_bytes: int | None = None,
            keep_until_s: float | None = None) -> PutResult:
        """Store consecutive blocks of one chain, durably, in one transaction.

        Args:
            scope: layout and tenant.
            parent_hash: hash before the first block.
            hashes: chain hashes of the blocks, in order.
            blocks: the blocks' bytes (sizes are checked by the caller).
            is_root: whether `parent_hash` is the chain root (no stored parent needed).
            quota_bytes: the namespace's NVMe quota (R19); None: none.
            keep_until_s: pin the last block (and so the prefix) until this time (R22); the result's
                `pin` says what was granted.

        Raises:
            FailedPrecondition: the parent block is not stored.
            ResourceExhausted: no room without evicting a protected block, or the
                namespace's quota would be passed (the message names both).
            DataLoss: the records the Put needs are on a damaged page.
        """
        batch = PutBatch(scope=scope, parent_hash=parent_hash, hashes=hashes, blocks=blocks, is_root=is_root,
                         quota_bytes=quota_bytes, keep_until_s=keep_until_s)
        return self.put_many([batch])[0]

    def put_many(self, batches: Sequence[PutBatch]) -> list[PutResult]:
        """Store several Put batches in one transaction (group commit): all or none.

        Batches are applied in order, so a batch may extend the chain of the one
        before it. One fsync serves them all; each counts as its own put. Every
        block they name and every parent they extend is protected while room is
        made (R12), so what a result reports as existing is stored when it returns.
        Returns once the transaction is durable (R34).
        """
        return self.wait_durable(self.commit_many(batches))

    def commit_many(self, batches: Sequence[PutBatch]) -> Committed[list[PutResult]]:
        """`put_many`, returning once committed: the caller answers no one before `durable` gives the results.

        The group commits of a stream and of the fleet's copies go on to their next transaction meanwhile:
        its work runs while the disk flushes this one (R35).
        """
        now = self.retention_clock.now()
        txns: list[int] = []

        @contextmanager
        def write() -> Iterator[BlockTxn]:
            with self._write(durable=False) as w:
                yield w
            txns.append(w.txn_id)

        results, evicted = self._commit(batches, now, write)
        for batch in (b for b in batches if b.hashes):  # extending a known chain makes the longer one known
            parent = None if batch.is_root else batch.scope.key(batch.parent_hash)
            self.chains.extend(parent, batch.scope.key(batch.hashes[-1]), batch.hashes)
        self._tally.put(results, evicted, now)
        return Committed(results, txns[-1])

    def _commit(self, batches: Sequence[PutBatch], now: float,
                write: Callable[[], AbstractContextManager[BlockTxn]]) -> tuple[list[PutResult], Evicted]:
        """Apply `batches` in one transaction (`tiers/puts.py`); a refusal is counted and raised."""
        room = RoomRules(rule=self.rule, retention=self.retention, quota_of=self._quota_of,
                         capacity_bytes=self.settings.capacity_bytes, skipped=self._skipped,
                         pin_limits=self._pin_limits)
        return commit_puts(write, self._damage, batches, now_s=now, pinned=self.leases.pinned, room=room,
                           data_dir=self.settings.data_dir, on_refused=self._tally.rejected)

    # -- pins (R22-R27, tiers/pins.py) ---------------------------------------

    def pin(self, scope: BlockScope, block_hash: bytes, until_s: float) -> pins.PinGrant:
        """Keep the stored block `block_hash` and its prefix until `until_s` (a Lookup's ask), durably.

        Returns what was granted: the time, or 0 and why not (R24).
        """
        now = self.retention_clock.now()
        with self._write() as w:
            pins.sweep(w, now)
            return pins.grant(w, scope.key(block_hash), until_s, now_s=now, limits=self._pin_limits(scope.namespace))

    def pins_of(self, namespace: str) -> tuple[pins.PinTotals, list[pins.Pin]]:
        """The namespace's live pins (R27): (count and bytes charged, each pin)."""
        ns_id = namespace_id(namespace)
        now = self.retention_clock.now()
        with self.env.begin() as txn:
            live = list(pins.tenant_pins(txn, self._dbs.pins, ns_id, now))
        return pins.PinTotals(pins=len(live), charged_bytes=sum(p.charged_bytes for p in live)), live

    def drop_pins(self, namespace: str) -> int:
        """Drop every pin of the namespace (an operator's call, R27); how many were live."""
        ns_id = namespace_id(namespace)
        now = self.retention_clock.now()
        with self._write() as w:
            keys = [p.key for p in pins.tenant_pins(w.txn, w.dbs.pins, ns_id, -math.inf)]  # past-time ones too
            dropped = [pins.drop(w, k) for k in keys]
        return sum(1 for p in dropped if p is not None and p.until_s > now)

    def expired_pins(self) -> list[tuple[str, pins.Pin]]:
        """Sweep the pins past their time and list the expiries not yet audited (R25, R29): (namespace name,
        pin) each, soonest first, at most `pins.SWEEP_MAX` a call; a read alone when none is due. The caller
        audits them, then `forget_expired_pins`."""
        now = self.retention_clock.now()
        with self.env.begin() as txn:
            if not pins.due(txn, self._dbs.pins, now):
                return []
        with self._write() as w:
            pins.sweep(w, now)
            gone = pins.journal(w.txn, w.dbs.pins)
            names = namespaces.names(w.txn, w.dbs.state) if gone else {}
        return [(names.get(namespaces.id_of_key(p.key), ""), p) for p in gone]

    def forget_expired_pins(self, audited: list[pins.Pin]) -> None:
        """Drop the journal records of expiries the caller audited (R29)."""
        if audited:
            with self._write() as w:
                pins.forget(w, audited)

    def set_pin_limits_provider(self, provider: Callable[[str], pins.PinLimits] | None) -> None:
        """Give each namespace its own limits on pins (R24); None: `[store] pin_max_hours`, `pin_budget_bytes`."""
        default = self._default_pins
        self._pin_limits = provider or (lambda namespace: default)

    # -- refreshes ---------------------------------------------------------

    def touch(self, keys: Iterable[bytes]) -> None:
        """Record a use of `keys` now: the retention clock of each restarts (one fsync'd commit).

        Blocks recorded less than TOUCH_GRANULARITY_S ago are skipped, and when
        all are, nothing is written. A block on a damaged page is skipped.
        """
        now = self.retention_clock.now()
        keys = list(keys)
        metas = self._damage.read_each(self.env, keys, lambda txn, key: read_meta(txn, self._dbs, key))
        stale = [k for k, m in zip(keys, metas, strict=True)
                 if m is not None and self.rule.touch_due(m.last_access_s, now)]
        if stale:
            self._damage.retry(lambda: self._touch_all(stale, now), "a refresh")

    def _touch_all(self, keys: list[bytes], now: float) -> None:
        with self._write() as w:
            for key in keys:
                if key not in w.unreadable:
                    w.touch(key, now)

    def touch_soon(self, keys: Sequence[bytes]) -> Future[None]:
        """Queue a use of `keys` for the next group commit; the future resolves once it is durable.

        Reads come in many small batches; one fsync'd write transaction per batch
        would queue them all behind LMDB's single writer. Touches that arrive while
        a commit runs are merged into the next one (`tiers/refresh.py`).
        """
        return self._refresh.submit(keys)

    # -- reads -------------------------------------------------------------

    def read(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None
             ) -> list[tuple[ReadStatus, Any]]:
        """Read blocks, each verified against its checksum; `copy`: see `reads.read_copies`.

        A corrupt block (or one on a damaged page) is never returned: it is reported CORRUPT,
        counted, and removed with its descendants (which could no longer be reached as a
        prefix) when the removal itself can be done.
        """
        out = reads.read_copies(self.env, self._dbs, keys, self._damage, copy)
        corrupt = [k for k, (s, _) in zip(keys, out, strict=True) if s is ReadStatus.CORRUPT]
        if corrupt:
            self.drop_corrupt(corrupt)
        return out

    def read_found(self, keys: Sequence[bytes], copy: Callable[[int, memoryview], Any] | None = None, *,
                   touch_due: list[bytes] | None = None) -> list[Any] | None:
        """`read` when every block is stored and intact, with no side effect; None at the first that is not
        (`reads.read_found`): the caller then reads through `read`, which reports, counts and drops.

        It never writes, so a small one may run on the event loop (`tiers.store.FoundReads`). The FOUND
        blocks whose retention clock is due a restart (those `touch` would write, R5) go to `touch_due`.
        """
        return reads.read_found(self.env, self._dbs, keys, self._damage, copy,
                                self.rule.touch_due_before(self.retention_clock.now()), touch_due)

    def read_into(self, keys: Sequence[bytes], dests: Sequence[memoryview | None],
                  stop_at_missing: bool = False, *, touch_due: list[bytes] | None = None
                  ) -> list[ReadStatus | None]:
        """Copy blocks straight from LMDB's map into caller memory, in one read txn.

        Each block is checksum-verified in the map before it is copied, so a corrupt block never
        reaches `dests` (it is reported, counted and dropped as `read` does). The only copy is map ->
        destination: `stage_reads`, then `StagedReads.copy` (the transfer path runs them on two threads).

        Args:
            keys: storage keys, in order.
            dests: one writable view per key, each exactly the block's size; None
                skips that key (its result is None).
            stop_at_missing: stop at the first block not FOUND; later results are None.
            touch_due: if given, the keys of FOUND blocks whose retention clock is due a restart
                (those `touch` would write) are appended to it, so the caller touches only those.

        Returns:
            A status per key; None where the key was skipped or not reached.

        Raises:
            ValueError: a destination's size differs from the stored block's.
        """
        wanted = [None if d is None else k for k, d in zip(keys, dests, strict=True)]
        codes = self.stage_reads(wanted).copy(dests, stop_at_missing, touch_due=touch_due)
        return [READ_STATUS[c] for c in codes]

    def stage_reads(self, keys: Sequence[bytes | None]) -> StagedReads:
        """Look blocks up for `read_into` (None: skip that one), leaving their read txn open for the copy.

        The lookups hold the GIL between gets; the copy (`StagedReads.copy`)
        need not, so a caller can look up on one thread and copy on others.
        """
        txn, metas, datas = reads.stage(self.env, self._dbs, keys, self._damage)
        return StagedReads(txn, list(keys), metas, datas, now=self.retention_clock.now,
                           drop_corrupt=self.drop_corrupt, damage=self._damage)

    def drop_corrupt(self, keys: Sequence[bytes]) -> None:
        """Remove corrupt blocks and their descendants; count them (R10, `tiers/purge.py`)."""
        purge.drop_corrupt(self._write, self._damage, keys, self._tally.damaged, self.settings.data_dir)

    def purge(self, scope: BlockScope, hashes: Sequence[bytes] | None) -> int:
        """Remove blocks durably (R20, `tiers/purge.py`); how many went.

        `hashes`: each stored block named goes with every block below it (R6), whatever
        prompt it serves. None: every block of `scope.namespace`, in every geometry.
        A lease does not stop a purge. Raises DataLoss for a block on a damaged page.
        """
        if hashes is None:
            blocks = purge.namespace_blocks(self.env, self._dbs, namespaces.id_of_key(scope.prefix))
        else:
            blocks = purge.subtree_blocks(self.env, self._dbs, [scope.key(h) for h in hashes])
        removed = purge.remove_deepest_first(self._write, self._damage, blocks)
        self._tally.purged(removed)
        return removed

    def raise_uses(self, uses: Sequence[tuple[bytes, float]]) -> list[bool]:
        """F79: raise held blocks' last uses to those given, durably (`stale_copies.raise_uses`)."""
        now = self.retention_clock.now()
        return self._damage.retry(lambda: stale_copies.raise_uses(self.env, self._write, uses, now), "a raise of uses")

    def drop_confirmed_run(self, root: bytes, confirmed: dict[bytes, float], window_start_s: float) -> int:
        """F79: remove a run its replicas confirmed, unless leased or pinned here (`stale_copies.drop_confirmed`)."""
        return self.drop_confirmed_runs([(root, confirmed, window_start_s)])[0]

    def drop_confirmed_runs(self, runs: Sequence[tuple[bytes, dict[bytes, float], float]]) -> list[int]:
        """F84: `drop_confirmed_run` for each of `runs` (root, confirmed, window start), in one write transaction
        (`stale_copies.drop_confirmed_runs`); the bytes removed, per run."""
        now = self.retention_clock.now()
        return self._damage.retry(lambda: stale_copies.drop_confirmed_runs(
            self._write, runs, leased=self.leases.pinned, now_s=now), "a stale run's drop")

    def export_records(self, namespace: str) -> Iterator[export.ExportRecord]:
        """Every block of `namespace` (every geometry) as `ExportRecord`s, parents first (R21).

        Each `ExportRecord(namespace, fingerprint, block_hash, parent_hash, depth, checksum, data)` is
        verified against its checksum; a corrupt one is left out (and dropped, as a read drops it) with
        everything below it. `next()` reads LMDB (`EXPORT_CHUNK` blocks at a time): call it on the executor.
        """
        return export.export_records(self.env, self._dbs, namespace, self.drop_corrupt, self._damage.note)

    def import_records(self, records: Iterable[export.BlockRecord], namespace: str | None = None,
                       quota_bytes: int | None = None) -> int:
        """Write exported records back, durably (R21, `tiers/export.py`); how many blocks were new.

        `records` (parents first) need fingerprint, block_hash, parent_hash, depth, checksum
        and data; `namespace` None puts each in its own `.namespace`; `quota_bytes` None
        asks the quota provider. Raises DataLoss (a checksum), InvalidArgument (a malformed
        or out-of-order record), ResourceExhausted (as a Put).
        """
        def commit(batches: list[PutBatch]) -> list[PutResult]:
            results, evicted = self._commit(batches, self.retention_clock.now(), self._write)
            self._tally.imported(results, evicted)
            return results

        return export.import_records(commit, records, namespace=namespace, quota_bytes=quota_bytes)

    def count_get(self, asked_blocks: int, returned_blocks: int) -> None:
        """Count one Get: blocks asked for and blocks actually returned."""
        tokens = self.settings.block_tokens
        self._tally.get(asked_tokens=asked_blocks * tokens, returned_tokens=returned_blocks * tokens)

    # -- accounting --------------------------------------------------------

    def stats(self) -> TierStats:
        """Counters, usage and retention headroom now."""
        counters, rate, blocks, used = self._tally.snapshot(self.retention_clock.now())
        free = max(self.settings.capacity_bytes - used, 0)
        return TierStats(
            counters=counters, blocks_stored=blocks, bytes_stored=used,
            capacity_bytes=self.settings.capacity_bytes, bytes_free=free,
            write_rate_bytes_per_s=rate,
            headroom_hours=free / rate / 3600.0 if rate > 0 else float("inf"),
            retention_hours=self.settings.retention_hours, active_leases=self.leases.active(),
            uptime_s=self.retention_clock.uptime_s(), by_layout=usage.layout_totals(self.env, self._state),
        )

    def namespace_usage(self, namespace: str) -> NamespaceUsage:
        """`NamespaceUsage(blocks, stored_bytes, token_hours)` of `namespace` as last committed (R17)."""
        with self.env.begin() as txn:
            return namespaces.usage_of(txn, self._state, namespace, now_s=self.retention_clock.now(),
                                       block_tokens=self.settings.block_tokens)

    def set_retention_provider(self, provider: Callable[[str], float] | None) -> None:
        """Give each namespace its own retention (R18): `provider(namespace) -> seconds`.

        Every eviction decision asks it (once per namespace per pass); below the
        store's retention counts as the store's. It must be quick and never lower a
        value (retention only rises, so old promises hold). None: the store's for all.
        """
        self.retention = NamespaceRetention(self.settings.retention_s, provider)

    def set_quota_provider(self, provider: Callable[[str], int] | None) -> None:
        """Give each namespace an NVMe quota (R19): `provider(namespace) -> bytes`, 0 for none.

        Asked in each Put's write transaction for a batch without `quota_bytes`. None: no quotas.
        """
        self._quota_of = provider or _no_quota

    def _save_state(self, txn: lmdb.Transaction) -> None:
        """Counters and the retention clock's high-water mark, with this write (R13)."""
        txn.put(b"counters", self._tally.saved(), db=self._state)
        txn.put(HIGH_WATER_KEY, HIGH_WATER.pack(self.retention_clock.now()), db=self._state)

    def __repr__(self) -> str:
        return f"LmdbBlockTier({self.settings.data_dir})"


def _no_quota(namespace: str) -> int:
    return 0


def _publish(publisher: EventPublisher, logged: list[Any], error: BaseException | None) -> None:
    """E1: a commit's events go out once it is durable; never for a commit whose flush failed."""
    if error is None:
        publisher.submit(logged)


def _resolve_soon(loop: asyncio.AbstractEventLoop, done: asyncio.Future[None], error: BaseException | None) -> None:
    """From the flusher thread: settle `done` on its loop (nothing when the loop is gone)."""
    def settle() -> None:
        if done.done():
            return
        if error is not None:
            done.set_exception(error)
        else:
            done.set_result(None)

    with contextlib.suppress(RuntimeError):  # the loop closed: no one is left to answer
        loop.call_soon_threadsafe(settle)
