"""Making room in the NVMe tier: which blocks go, in what order, when a Put needs space.

The rule of what may go is `tiers.retention.Retention`; this module walks the
LRU index in order (R7: least recently used first, deepest first among equals)
and asks it. A chain whose blocks are all past retention goes tail first in one
pass: a parent whose children were all chosen already is a leaf by the time
it is deleted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterator
from dataclasses import dataclass

from kvstore.errors import StoreFull
from tiers.block_txn import BlockTxn, DamagedBlock
from tiers.records import lru_entry
from tiers.retention import Retention


@dataclass(frozen=True, kw_only=True, slots=True)
class Evicted:
    """What one make-room pass took."""

    blocks: int = 0
    freed_bytes: int = 0


def make_room(w: BlockTxn, need_bytes: int, *, capacity_bytes: int, rule: Retention, now_s: float,
              protected: Collection[bytes]) -> Evicted:
    """Evict blocks past retention, LRU first, until `need_bytes` more fit under `capacity_bytes`.

    Args:
        w: the write transaction the new blocks go in.
        need_bytes: bytes about to be written.
        capacity_bytes: the store's capacity.
        rule: the retention rule.
        now_s: retention time now.
        protected: keys that must stay whatever their age (leases, the Put's own blocks and parent).

    Raises:
        StoreFull: not enough blocks may go; nothing was evicted that the caller keeps
            (the caller aborts the transaction).
        DamagedBlock: a candidate's records are unreadable.
    """
    excess = w.usage.stored_bytes + need_bytes - capacity_bytes
    if excess <= 0:
        return Evicted()
    cutoff = rule.cutoff(now_s)
    freed = count = 0
    while freed < excess:
        victims = list(_evictable(w, rule, cutoff, protected, excess - freed))
        if not victims:
            raise StoreFull(
                f"store full: {need_bytes} bytes needed, {max(capacity_bytes - w.usage.stored_bytes, 0)} free, "
                f"and every other block is within its {rule.retention_s / 3600:g}-hour retention, leased, "
                "or part of this Put's chain",
                soonest_evictable_s=_soonest_evictable_s(w, rule, now_s, protected),
            )
        for key in victims:
            freed += w.delete(key, carry_up=True)
            count += 1
    return Evicted(blocks=count, freed_bytes=freed)


def _evictable(w: BlockTxn, rule: Retention, cutoff: float, protected: Collection[bytes],
               want: int) -> Iterator[bytes]:
    """Blocks that may go, oldest first, until `want` bytes are found."""
    found = 0
    chosen: set[bytes] = set()
    for raw in w.txn.cursor(db=w.dbs.lru).iternext(keys=True, values=False):
        access_s, key = lru_entry(raw)
        if access_s >= cutoff or found >= want:
            return
        def children_stay(k: bytes = key) -> bool:
            return any(c not in chosen for c in w.children(k))

        if not rule.may_evict(key, access_s, cutoff, protected, children_stay=children_stay):
            continue
        meta = w.meta(key)
        if meta is None:
            raise DamagedBlock(key, KeyError("an LRU entry without its block"))
        chosen.add(key)
        found += meta.size_bytes
        yield key


def _soonest_evictable_s(w: BlockTxn, rule: Retention, now_s: float, protected: Collection[bytes]) -> float | None:
    """Seconds until the least recently used unprotected block passes retention (None: none is)."""
    for raw in w.txn.cursor(db=w.dbs.lru).iternext(keys=True, values=False):
        access_s, key = lru_entry(raw)
        if key not in protected:
            return max(rule.evictable_in_s(access_s, now_s), 0.0)
    return None
