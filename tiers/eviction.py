"""Making room in the NVMe tier: which blocks go, in what order, when a Put needs space.

The rule of what may go is `tiers.retention.Retention`; this module walks the
LRU index in order (R7: least recently used first, deepest first among equals)
and asks it. A chain whose blocks are all past retention goes tail first in one
pass: a parent whose children were all chosen already is a leaf by the time
it is deleted.

Each block's retention is its namespace's (R18), never below the store's: the
walk stops at the store's cutoff (no block used later may go) and skips, on
the way, blocks whose namespace promises more. So that a store whose least
recently used blocks all belong to long-retention tenants does not cost every
Put a walk of them all, the run of such blocks at the head of the index is
remembered (`SkippedRuns`) and the next walk starts after it; and one make-room
call examines at most `MAX_EVICTION_SCAN` index entries: past that it refuses
(R8), saying so, and the next call goes on from where it stopped.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ResourceExhausted, StoreFull
from kvstore.native.records import lru_entry
from tiers.block_txn import BlockTxn, DamagedBlock
from tiers.namespaces import id_of_key
from tiers.retention import Retention

#: Most LRU index entries one make-room call examines (R18): about 25 ms of walking.
MAX_EVICTION_SCAN = 16_384
#: Walk kinds whose skipped run is remembered (the store's, and one per namespace at its quota).
MAX_SKIPPED_RUNS = 4096


class SkippedRuns:
    """For each kind of walk, the head of the LRU index it need not walk again yet (R18, R19).

    A kind is None (making room in the store) or a namespace id (making room under
    its quota). Its run is the index's entries from the start up to `end`, each of
    which that walk skipped without looking further: a block kept by its namespace's
    retention until at least `until_s`, or (for a quota's walk) another namespace's
    block. That stays true: retention only rises, and entries only enter the index
    after the run (a use is stamped now; a carried-up time is that of an evicted
    child, found after the run). An entry skipped for any other reason (a lease, a
    Put, a child that stays) ends the run. Kept in memory: a restart walks again.
    Only write transactions use it, and LMDB runs one at a time.
    """

    def __init__(self) -> None:
        self._runs: dict[bytes | None, tuple[bytes, float]] = {}

    def start(self, kind: bytes | None, now_s: float) -> tuple[bytes | None, float]:
        """(the first index key after the run, or None: from the start; the run's earliest deadline)."""
        run = self._runs.get(kind)
        if run is None:
            return None, math.inf
        if now_s >= run[1]:  # a block of the run may go now: walk it again
            del self._runs[kind]
            return None, math.inf
        return run

    def extend(self, kind: bytes | None, entry: bytes, until_s: float) -> None:
        """The run now reaches past the index entry `entry`, kept until `until_s`."""
        _, until = self._runs.pop(kind, (b"", math.inf))
        self._runs[kind] = (bytes(entry) + b"\x00", min(until, until_s))
        if len(self._runs) > MAX_SKIPPED_RUNS:
            del self._runs[next(iter(self._runs))]


@dataclass(frozen=True, kw_only=True, slots=True)
class Evicted:
    """What one make-room pass took."""

    blocks: int = 0
    freed_bytes: int = 0

    def __add__(self, other: Evicted) -> Evicted:
        return Evicted(blocks=self.blocks + other.blocks, freed_bytes=self.freed_bytes + other.freed_bytes)


@dataclass(frozen=True, kw_only=True, slots=True)
class Candidates:
    """Which blocks a make-room call may take, and how each one's retention is found.

    Attributes:
        rule: the store's retention rule (its floor).
        now_s: retention time now.
        protected: keys that must stay whatever their age (leases, the Put's own blocks and parent).
        retention_of: storage key -> its namespace's retention seconds (R18); None: the store's.
        namespace: only blocks of this namespace id may go (a quota, R19); None: any.
        skipped: the runs at the index's head that walks need not look at again.
    """

    rule: Retention
    now_s: float
    protected: Collection[bytes]
    retention_of: Callable[[bytes], float] | None = None
    namespace: bytes | None = None
    skipped: SkippedRuns | None = None

    def cutoff(self, key: bytes) -> float:
        return self.rule.cutoff(self.now_s, self.retention_of(key) if self.retention_of else None)

    def excluded(self, key: bytes) -> bool:
        return key in self.protected or (self.namespace is not None and id_of_key(key) != self.namespace)


class _Scan:
    """How many index entries a make-room call has examined."""

    def __init__(self) -> None:
        self.seen = 0
        self.cut_short = False


def make_room(w: BlockTxn, need_bytes: int, *, capacity_bytes: int, rule: Retention, now_s: float,
              protected: Collection[bytes], retention_of: Callable[[bytes], float] | None = None,
              skipped: SkippedRuns | None = None) -> Evicted:
    """Evict blocks past retention, LRU first, until `need_bytes` more fit under `capacity_bytes`.

    Args:
        w: the write transaction the new blocks go in.
        need_bytes: bytes about to be written.
        capacity_bytes: the store's capacity.
        rule: the retention rule.
        now_s: retention time now.
        protected: keys that must stay whatever their age (leases, the Put's own blocks and parent).
        retention_of: storage key -> its namespace's retention seconds (R18); None: the store's.
        skipped: where walks may start (`SkippedRuns`); None: from the index's start.

    Raises:
        StoreFull: not enough blocks may go; nothing was evicted that the caller keeps
            (the caller aborts the transaction).
        DamagedBlock: a candidate's records are unreadable.
    """
    excess = w.usage.stored_bytes + need_bytes - capacity_bytes
    if excess <= 0:
        return Evicted()
    can = Candidates(rule=rule, now_s=now_s, protected=protected, retention_of=retention_of, skipped=skipped)
    return _evict(w, excess, can, lambda: (
        f"store full: {need_bytes} bytes needed, {max(capacity_bytes - w.usage.stored_bytes, 0)} free, "
        "and every other block is within its namespace's retention, leased, or part of this Put's chain"))


def make_quota_room(w: BlockTxn, ns_id: bytes, need_bytes: int, *, quota_bytes: int, namespace: str,
                    can: Candidates) -> Evicted:
    """Evict the namespace's own blocks past retention until `need_bytes` more fit under its quota (R19).

    Raises:
        ResourceExhausted: the namespace's blocks that may go do not free enough;
            the message names the namespace, the quota and its usage.
    """
    used = w.namespace_bytes(ns_id)
    if used + need_bytes <= quota_bytes:
        return Evicted()
    ns_can = Candidates(rule=can.rule, now_s=can.now_s, protected=can.protected, retention_of=can.retention_of,
                        namespace=ns_id, skipped=can.skipped)
    try:
        return _evict(w, used + need_bytes - quota_bytes, ns_can, lambda: "")
    except StoreFull as exc:
        cut_short = " (its eviction scan stopped early; the next Put looks further)" if _CUT_SHORT in str(exc) else ""
        soonest = _soonest_evictable_s(w, ns_can)
        wait = ("wait until its blocks pass their retention" if soonest is None
                else f"retry in {soonest / 3600:.1f} h, when its first block passes its retention")
        raise ResourceExhausted(
            f"namespace {namespace!r} is over its NVMe quota: it stores {used} bytes, this Put needs "
            f"{need_bytes} more, and its quota (nvme_quota_bytes) is {quota_bytes} bytes; "
            f"nothing was stored{cut_short}",
            hint=f"raise the namespace's nvme_quota_bytes (`kvstore policy set`), purge some of its blocks, or {wait}",
        ) from None


_CUT_SHORT = "the eviction scan stopped"


def _evict(w: BlockTxn, excess: int, can: Candidates, why_full: Callable[[], str]) -> Evicted:
    freed = count = 0
    scan = _Scan()
    while freed < excess:
        victims = list(_evictable(w, can, excess - freed, scan))
        if not victims:
            why = why_full()
            if scan.cut_short:
                why += f" ({_CUT_SHORT} after {MAX_EVICTION_SCAN} index entries; the next Put looks further)"
            raise StoreFull(why, soonest_evictable_s=_soonest_evictable_s(w, can))
        for key in victims:
            freed += w.delete(key, carry_up=True, now_s=can.now_s)  # R29: an unswept expiry is journalled
            count += 1
    return Evicted(blocks=count, freed_bytes=freed)


def _walk(w: BlockTxn, can: Candidates) -> tuple[Iterator[Any], float]:
    """The LRU index from where `can`'s walk starts, and the skipped run's earliest deadline."""
    start, until_s = can.skipped.start(can.namespace, can.now_s) if can.skipped else (None, math.inf)
    cursor = w.txn.cursor(db=w.dbs.lru)
    if not (cursor.set_range(start) if start is not None else cursor.first()):
        return iter(()), until_s
    return cursor.iternext(keys=True, values=False), until_s


def _evictable(w: BlockTxn, can: Candidates, want: int, scan: _Scan) -> Iterator[bytes]:
    """Blocks that may go, oldest first, until `want` bytes are found."""
    found = 0
    chosen: set[bytes] = set()
    floor_cutoff = can.rule.cutoff(can.now_s)
    entries, _ = _walk(w, can)
    extending = can.skipped is not None
    for raw in entries:
        access_s, key = lru_entry(raw)
        if access_s >= floor_cutoff or found >= want:
            return
        if scan.seen >= MAX_EVICTION_SCAN:
            scan.cut_short = True
            return
        scan.seen += 1
        if key in can.protected:
            extending = False
            continue
        if can.namespace is not None and id_of_key(key) != can.namespace:
            if extending and can.skipped:
                can.skipped.extend(can.namespace, raw, math.inf)
            continue
        cutoff = can.cutoff(key)
        if access_s >= cutoff:  # kept by its namespace's longer retention (R18)
            if extending and can.skipped:
                can.skipped.extend(can.namespace, raw, access_s - cutoff + can.now_s)
            continue
        extending = False

        def children_stay(k: bytes = key) -> bool:
            return any(c not in chosen for c in w.children(k))

        if not can.rule.may_evict(key, access_s, cutoff, can.protected, children_stay=children_stay):
            continue
        meta = w.meta(key)
        if meta is None:
            raise DamagedBlock(key, KeyError("an LRU entry without its block"))
        chosen.add(key)
        found += meta.size_bytes
        yield key


def _soonest_evictable_s(w: BlockTxn, can: Candidates) -> float | None:
    """Seconds until the first candidate block passes its retention (None: none is known).

    Walks the LRU index until no later block can pass earlier (every retention is
    at least the store's), at most `MAX_EVICTION_SCAN` entries.
    """
    entries, until_s = _walk(w, can)
    best: float | None = None if math.isinf(until_s) else until_s - can.now_s
    for i, raw in enumerate(entries):
        access_s, key = lru_entry(raw)
        if i >= MAX_EVICTION_SCAN or (best is not None and can.rule.evictable_in_s(access_s, can.now_s) >= best):
            break
        if can.excluded(key):
            continue
        wait = access_s - can.cutoff(key)
        best = wait if best is None else min(best, wait)
    return None if best is None else max(best, 0.0)
