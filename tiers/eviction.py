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
Put a walk of them all, one make-room call examines at most
`MAX_EVICTION_SCAN` index entries; past that it refuses (R8), saying so.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from kvstore.errors import ResourceExhausted, StoreFull
from tiers.block_txn import BlockTxn, DamagedBlock
from tiers.namespaces import id_of_key
from tiers.records import lru_entry
from tiers.retention import Retention

#: Most LRU index entries one make-room call examines (R18): about 0.1 s of walking.
MAX_EVICTION_SCAN = 65_536


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
    """

    rule: Retention
    now_s: float
    protected: Collection[bytes]
    retention_of: Callable[[bytes], float] | None = None
    namespace: bytes | None = None

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
              protected: Collection[bytes], retention_of: Callable[[bytes], float] | None = None) -> Evicted:
    """Evict blocks past retention, LRU first, until `need_bytes` more fit under `capacity_bytes`.

    Args:
        w: the write transaction the new blocks go in.
        need_bytes: bytes about to be written.
        capacity_bytes: the store's capacity.
        rule: the retention rule.
        now_s: retention time now.
        protected: keys that must stay whatever their age (leases, the Put's own blocks and parent).
        retention_of: storage key -> its namespace's retention seconds (R18); None: the store's.

    Raises:
        StoreFull: not enough blocks may go; nothing was evicted that the caller keeps
            (the caller aborts the transaction).
        DamagedBlock: a candidate's records are unreadable.
    """
    excess = w.usage.stored_bytes + need_bytes - capacity_bytes
    if excess <= 0:
        return Evicted()
    can = Candidates(rule=rule, now_s=now_s, protected=protected, retention_of=retention_of)
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
                        namespace=ns_id)
    try:
        return _evict(w, used + need_bytes - quota_bytes, ns_can, lambda: "")
    except StoreFull:
        soonest = _soonest_evictable_s(w, ns_can)
        wait = ("wait until its blocks pass their retention" if soonest is None
                else f"retry in {soonest / 3600:.1f} h, when its first block passes its retention")
        raise ResourceExhausted(
            f"namespace {namespace!r} is over its NVMe quota: it stores {used} bytes, this Put needs "
            f"{need_bytes} more, and its quota (nvme_quota_bytes) is {quota_bytes} bytes; nothing was stored",
            hint=f"raise the namespace's nvme_quota_bytes (`kvstore policy set`), purge some of its blocks, or {wait}",
        ) from None


def _evict(w: BlockTxn, excess: int, can: Candidates, why_full: Callable[[], str]) -> Evicted:
    freed = count = 0
    scan = _Scan()
    while freed < excess:
        victims = list(_evictable(w, can, excess - freed, scan))
        if not victims:
            why = why_full()
            if scan.cut_short:
                why += (f" (the eviction scan stopped after the {MAX_EVICTION_SCAN} least recently used blocks, "
                        "all kept by their namespaces' longer retention)")
            raise StoreFull(why, soonest_evictable_s=_soonest_evictable_s(w, can))
        for key in victims:
            freed += w.delete(key, carry_up=True)
            count += 1
    return Evicted(blocks=count, freed_bytes=freed)


def _evictable(w: BlockTxn, can: Candidates, want: int, scan: _Scan) -> Iterator[bytes]:
    """Blocks that may go, oldest first, until `want` bytes are found."""
    found = 0
    chosen: set[bytes] = set()
    floor_cutoff = can.rule.cutoff(can.now_s)
    for raw in w.txn.cursor(db=w.dbs.lru).iternext(keys=True, values=False):
        access_s, key = lru_entry(raw)
        if access_s >= floor_cutoff or found >= want:
            return
        if scan.seen >= MAX_EVICTION_SCAN:
            scan.cut_short = True
            return
        scan.seen += 1
        if can.excluded(key):
            continue

        def children_stay(k: bytes = key) -> bool:
            return any(c not in chosen for c in w.children(k))

        if not can.rule.may_evict(key, access_s, can.cutoff(key), can.protected, children_stay=children_stay):
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
    best: float | None = None
    for i, raw in enumerate(w.txn.cursor(db=w.dbs.lru).iternext(keys=True, values=False)):
        access_s, key = lru_entry(raw)
        if i >= MAX_EVICTION_SCAN or (best is not None and can.rule.evictable_in_s(access_s, can.now_s) >= best):
            break
        if can.excluded(key):
            continue
        wait = access_s - can.cutoff(key)
        best = wait if best is None else min(best, wait)
    return None if best is None else max(best, 0.0)
