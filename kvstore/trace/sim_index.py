"""An in-memory record index with the LMDB tier's write-transaction interface (no LMDB in the loop).

The simulation stores no bytes: it runs the tier's own Put transaction
(`tiers.puts.commit_puts`), eviction (`tiers.eviction.make_room`) and retention rule
(`tiers.retention.Retention`) against this index, which answers what they ask of a
`tiers.block_txn.BlockTxn`: each block's meta record (depth, size, last use), its
children, the usage totals, and the LRU index in the tier's own key order
(`tiers.records.lru_key`), walked by a cursor with LMDB's `first`/`set_range`/`iternext`.
A change to those rules changes the simulation with them.

A write is a transaction as in LMDB: a Put that the store refuses (StoreFull after some
evictions) leaves the index as it was, so every change is journaled and undone on error.

The LRU index is brought up to date only when a walk asks for a cursor (an eviction):
a block stored or used since the last walk is noted, and its entry moved then. Until a
store fills, no walk runs, and a run costs no sorted-index work per use; once it walks,
it sees exactly the entries an LMDB index would hold.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.records import lru_key
from tiers.usage import Usage


class _Uses:
    """Holds an index's last-use array for its blocks' records.

    A block's record points here, not at its index, so the index and its records hold no
    reference cycle: a finished simulation is freed by reference counting as it is dropped,
    not left for the cyclic collector to find (a pass over millions of records: 1.5 s of a
    Mooncake run).
    """

    __slots__ = ("last",)

    def __init__(self, last: np.ndarray) -> None:
        self.last = last


class SimBlock:
    """One stored block's meta record (the fields the tier's rules read), and its children.

    Its last use lives in its index's array (`SimIndex.last`, at the block's number), so a
    Get's refresh of thousands of blocks is one vector step.
    """

    __slots__ = ("children", "depth", "idx", "indexed", "owner", "parent", "size_bytes")

    def __init__(self, owner: _Uses, idx: int, depth: int, size_bytes: int, parent: bytes | None) -> None:
        self.owner = owner
        self.idx = idx
        self.depth = depth
        self.size_bytes = size_bytes
        self.parent = parent
        self.children: list[bytes] | None = None
        #: Its entry in the sorted LRU index, None until a walk first needs it.
        self.indexed: bytes | None = None

    @property
    def last_access_s(self) -> float:
        """Its recorded last use."""
        return float(self.owner.last[self.idx])


class _Cursor:
    """An LMDB-like cursor over the LRU index (what `tiers.eviction` walks)."""

    def __init__(self, index: SortedList) -> None:
        self._index = index
        self._at = 0

    def first(self) -> bool:
        self._at = 0
        return len(self._index) > 0

    def set_range(self, key: bytes) -> bool:
        self._at = self._index.bisect_left(key)
        return self._at < len(self._index)

    def iternext(self, keys: bool = True, values: bool = False) -> Iterator[bytes]:
        return self._index.islice(self._at)  # type: ignore[no-any-return]


class _Txn:
    """The raw `txn` the tier's rules read beside BlockTxn's methods: the LRU index, walked by
    eviction; and the pins db (tiers/pins.py), which a trace never writes, so it reads empty."""

    def __init__(self, owner: SimIndex) -> None:
        self._owner = owner

    def cursor(self, db: Any = None) -> _Cursor:
        return _Cursor(self._owner.synced_lru() if db == "lru" else SortedList())

    def get(self, key: bytes, db: Any = None) -> bytes | None:
        return None


@dataclass(frozen=True, slots=True)
class _Dbs:
    """Names standing for the tier's databases (`tiers.block_txn.BlockDbs`)."""

    lru: str = "lru"
    pins: str = "pins"


_NS_END = KEY_BYTES - HASH_BYTES  # a storage key's fingerprint and namespace id: its parent's key starts so
#: Refreshes of at most this many blocks run block by block (a vector step's fixed cost is higher).
_SMALL_REFRESH = 16
#: Refreshed numbers noted as lists until this many, then as flags in an array (bounded memory).
_STALE_LIST_MAX = 1 << 20


class SimIndex:
    """The blocks one simulated store holds, as the tier's records would say.

    `write()` yields it as the write transaction (`BlockTxn`'s interface); `blocks` maps
    each stored key to its `SimBlock`. Each key has a number (its place in `key_of`, shared
    with `kvstore.trace.chains.ChainKeys`): `last[number]` is the block's recorded last use
    (NaN: not stored here), `size[number]` its bytes. A Put names the numbers of the keys it
    may insert in `numbers` (a key without one is numbered at the end of `key_of`).

    Args:
        use_bucket_s: width of the last-use buckets `bytes_used_since` counts by.
        key_of: every key by its number (shared by the nodes of a simulation).
        per_namespace: keep each namespace's bytes (a quota's make-room reads them, R19).
    """

    def __init__(self, *, use_bucket_s: float = 3600.0, key_of: list[bytes] | None = None,
                 per_namespace: bool = False) -> None:
        self.blocks: dict[bytes, SimBlock] = {}
        #: Bytes by the bucket of their block's last recorded use (`bytes_used_since`).
        self.use_bucket_s = use_bucket_s
        self.bytes_by_use: dict[int, int] = {}
        self.lru = SortedList()
        self.usage = Usage()
        self.dbs = _Dbs()
        self.namespace_names: dict[bytes, str] = {}
        self.unreadable: frozenset[bytes] = frozenset()
        self.key_of: list[bytes] = [] if key_of is None else key_of
        self.numbers: dict[bytes, int] = {}
        self.last = np.full(0, np.nan)
        self.size = np.zeros(0, dtype=np.int64)
        # the same arrays as memoryviews: an insert's one-item writes through them cost a third of numpy's
        self._last_items: Any = self.last.data
        self._size_items: Any = self.size.data
        self._uses = _Uses(self.last)
        #: Bytes each namespace stores, and has had evicted (None: one namespace, not kept).
        self.ns_bytes: dict[bytes, int] | None = {} if per_namespace else None
        self.ns_evicted: dict[bytes, list[int]] = {}
        #: The last uses of the blocks deleted in this write (the simulation reads and clears it).
        self.evicted_uses: list[float] = []
        self._journal: list[tuple[Any, ...]] | None = None
        # entries to move in the LRU index at the next walk: keys, and refreshed numbers
        self._stale: set[bytes] = set()
        self._stale_ids: list[np.ndarray] = []
        self._stale_count = 0
        self._dirty: np.ndarray | None = None
        #: The last use an insert bucketed, and its bucket (`bytes_by_use`'s slot).
        self._slot_of: tuple[float, int] = (np.nan, 0)

    def _grow(self, at_least: int) -> None:
        n = max(at_least, 2 * len(self.last), 1024)
        last, size = np.full(n, np.nan), np.zeros(n, dtype=np.int64)
        last[: len(self.last)], size[: len(self.size)] = self.last, self.size
        self.last, self.size = last, size
        self._uses.last = last
        self._last_items, self._size_items = last.data, size.data
        if self._dirty is not None:
            dirty = np.zeros(n, dtype=bool)
            dirty[: len(self._dirty)] = self._dirty
            self._dirty = dirty

    @property
    def txn(self) -> _Txn:
        """The raw `txn` the tier's rules read (made when asked: kept, it would make a reference cycle)."""
        return _Txn(self)

    # -- transactions -------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[SimIndex]:
        """A write transaction: every change is undone if the body raises (as an aborted LMDB txn)."""
        self._journal = []
        try:
            yield self
        except BaseException:
            journal, self._journal = self._journal, None
            for entry in reversed(journal):
                self._undo(entry)
            raise
        self._journal = None

    def _undo(self, entry: tuple[Any, ...]) -> None:
        kind, key = entry[0], entry[1]
        if kind == "insert":
            self._remove(key)
        elif kind == "delete":
            self._add(key, entry[2], entry[3])
            if self.ns_bytes is not None:
                self.ns_evicted[key[8:16]][0] -= 1
                self.ns_evicted[key[8:16]][1] -= entry[2].size_bytes
        else:  # touch
            self._retime(key, entry[2])

    # -- what BlockTxn answers ----------------------------------------------------

    def meta(self, key: bytes) -> SimBlock | None:
        """The block's record, None when not stored."""
        return self.blocks.get(key)

    def namespace_name(self, ns_id: bytes) -> str | None:
        """The namespace's name, once a Put named it."""
        return self.namespace_names.get(ns_id)

    def namespace_bytes(self, ns_id: bytes) -> int:
        """Bytes the namespace stores (all of them when one namespace runs)."""
        return self.usage.stored_bytes if self.ns_bytes is None else self.ns_bytes.get(ns_id, 0)

    def children(self, key: bytes) -> Iterator[bytes]:
        """Keys of the stored children of `key`."""
        block = self.blocks.get(key)
        return iter(block.children or () if block is not None else ())

    def insert(self, key: bytes, parent_hash: bytes, depth: int, data: Any, now_s: float,
               is_first: bool, *, last_use_s: float | None = None) -> None:
        """Store a new block (its data is not kept: only its size)."""
        idx = self.numbers.get(key)
        if idx is None:
            key_of = self.key_of
            idx = len(key_of)
            key_of.append(key)
        if idx >= len(self.last):
            self._grow(idx + 1)
        # `_add`, inlined: the Put of every new block runs it (a third of a Mooncake run's time)
        size = len(data)
        blocks = self.blocks
        if is_first:
            parent = None
        else:
            parent = key[:_NS_END] + parent_hash
            up = blocks.get(parent)
            if up is not None:
                if up.children is None:
                    up.children = [key]
                else:
                    up.children.append(key)
        # its LRU entry is made at the next walk (`note_put`)
        blocks[key] = SimBlock(self._uses, idx, depth, size, parent)
        when = now_s if last_use_s is None else last_use_s
        self._last_items[idx] = when
        self._size_items[idx] = size
        usage = self.usage
        usage.blocks += 1
        usage.stored_bytes += size
        if self.ns_bytes is not None:
            self.ns_bytes[key[8:16]] = self.ns_bytes.get(key[8:16], 0) + size
        # a Put's blocks share one use time: its bucket is worked out once
        if when != self._slot_of[0]:
            self._slot_of = (when, int(when // self.use_bucket_s))
        slot = self._slot_of[1]
        hist = self.bytes_by_use
        hist[slot] = hist.get(slot, 0) + size
        if self._journal is not None:
            self._journal.append(("insert", key))

    def touch(self, key: bytes, now_s: float) -> None:
        """Record a use at `now_s` (nothing if absent or used since)."""
        block = self.blocks.get(key)
        if block is None:
            return
        old = self.last[block.idx]
        if old >= now_s:
            return
        if self._journal is not None:
            self._journal.append(("touch", key, float(old)))
        self._retime(key, now_s)

    def refresh(self, numbers: np.ndarray, now_s: float, due_before_s: float) -> None:
        """A Get's refresh (R5), outside any Put: each stored block of `numbers` (keys by their number)
        whose recorded use is before `due_before_s` (`Retention.touch_due_before`) is recorded used at
        `now_s`.

        `touch` for many blocks at once, as one vector step: a Get of a long prompt refreshes
        thousands (most of a simulation's time), and this write cannot fail, so it needs no journal.
        """
        if len(self.last) < len(self.key_of):
            self._grow(len(self.key_of))
        if len(numbers) <= _SMALL_REFRESH:  # a Lookup's deepest block, a short fetch: vector steps cost more
            for i in numbers.tolist():
                block = self.blocks.get(self.key_of[i])
                if block is not None and self.last[i] < min(due_before_s, now_s):
                    self._retime(self.key_of[i], now_s)
            return
        old = self.last[numbers]
        due = old < min(due_before_s, now_s)  # NaN (not stored here) is never due
        if not due.any():
            return
        chosen, old = numbers[due], old[due]
        sizes = self.size[chosen]
        slots = np.floor_divide(old, self.use_bucket_s)
        hist = self.bytes_by_use
        low, high = slots.min(), slots.max()
        if low == high:  # the usual case: the prefix was last used in one bucket
            hist[int(low)] -= int(sizes.sum())
        else:
            values, where = np.unique(slots.astype(np.int64), return_inverse=True)
            for slot, n in zip(values.tolist(), np.bincount(where, weights=sizes).tolist(), strict=True):
                hist[slot] -= int(n)
        slot = int(now_s // self.use_bucket_s)
        hist[slot] = hist.get(slot, 0) + int(sizes.sum())
        self.last[chosen] = now_s
        self._note_stale(chosen)

    def note_put(self, numbers: np.ndarray) -> None:
        """The keys numbered `numbers` were just put (inserted or touched): their LRU entries are made or
        moved at the next walk. (Noting more than changed is harmless: an entry is rebuilt from the record.)"""
        self._note_stale(numbers)

    def _note_stale(self, chosen: np.ndarray) -> None:
        if len(self.last) < len(self.key_of):
            self._grow(len(self.key_of))
        if self._dirty is not None:
            self._dirty[chosen] = True
            return
        self._stale_ids.append(chosen)
        self._stale_count += len(chosen)
        if self._stale_count > _STALE_LIST_MAX:  # many refreshes and no walk: flags, not a growing list
            self._dirty = np.zeros(len(self.last), dtype=bool)
            for part in self._stale_ids:
                self._dirty[part] = True
            self._stale_ids, self._stale_count = [], 0

    def delete(self, key: bytes, *, carry_up: bool) -> int:
        """Remove a block with no stored child; with `carry_up`, its parent takes its last use if later."""
        block = self.blocks.get(key)
        if block is None:
            raise KeyError(f"no meta for block {key.hex()}")
        last = float(self.last[block.idx])
        self._remove(key)
        if self._journal is not None:
            self._journal.append(("delete", key, block, last))
        self.evicted_uses.append(last)
        if self.ns_bytes is not None:
            counts = self.ns_evicted.setdefault(key[8:16], [0, 0])
            counts[0] += 1
            counts[1] += block.size_bytes
        if carry_up and block.parent is not None:
            self.touch(block.parent, last)
        return block.size_bytes

    # -- the records --------------------------------------------------------------

    def synced_lru(self) -> SortedList:
        """The LRU index with every entry where the blocks' last uses put it now."""
        stale, self._stale = self._stale, set()
        parts, self._stale_ids, self._stale_count = self._stale_ids, [], 0
        if self._dirty is not None:
            parts.append(np.flatnonzero(self._dirty))
            self._dirty = None
        if parts:
            key_of = self.key_of
            stale.update(key_of[i] for i in np.unique(np.concatenate(parts)).tolist())
        blocks, last, fresh = self.blocks, self.last, []
        for key in stale:
            block = blocks.get(key)
            if block is None:
                continue
            if block.indexed is not None:
                self.lru.remove(block.indexed)
            block.indexed = lru_key(float(last[block.idx]), block.depth, key)
            fresh.append(block.indexed)
        self.lru.update(fresh)
        return self.lru

    def _add(self, key: bytes, block: SimBlock, last_use_s: float) -> None:
        self.blocks[key] = block
        self._stale.add(key)
        self.last[block.idx] = last_use_s
        self.size[block.idx] = block.size_bytes
        if block.parent is not None:
            parent = self.blocks.get(block.parent)
            if parent is not None:  # a fleet run's first block: its parent may live on another node
                if parent.children is None:
                    parent.children = [key]
                else:
                    parent.children.append(key)
        self.usage.blocks += 1
        self.usage.stored_bytes += block.size_bytes
        if self.ns_bytes is not None:
            self.ns_bytes[key[8:16]] = self.ns_bytes.get(key[8:16], 0) + block.size_bytes
        slot = int(last_use_s // self.use_bucket_s)
        self.bytes_by_use[slot] = self.bytes_by_use.get(slot, 0) + block.size_bytes

    def _count_use(self, when_s: float, nbytes: int) -> None:
        slot = int(when_s // self.use_bucket_s)
        self.bytes_by_use[slot] = self.bytes_by_use.get(slot, 0) + nbytes

    def bytes_used_since(self, since_s: float) -> int:
        """Bytes of the blocks whose recorded use is in or after the bucket holding `since_s`.

        What retention keeps, to a bucket's width, leaving out blocks kept only as the prefix of
        a later-used one (R6) whose own use is older: a Get refreshes a whole fetched prefix, so
        those are few (a Lookup alone refreshes only its deepest block).
        """
        first = int(since_s // self.use_bucket_s)
        return sum(n for slot, n in self.bytes_by_use.items() if slot >= first)

    def _remove(self, key: bytes) -> None:
        block = self.blocks.pop(key)
        if block.indexed is not None:
            self.lru.remove(block.indexed)
            block.indexed = None
        self._stale.discard(key)
        if block.parent is not None:
            parent = self.blocks.get(block.parent)
            if parent is not None and parent.children and key in parent.children:
                parent.children.remove(key)
        self.usage.blocks -= 1
        self.usage.stored_bytes -= block.size_bytes
        if self.ns_bytes is not None:
            self.ns_bytes[key[8:16]] -= block.size_bytes
        self._count_use(float(self.last[block.idx]), -block.size_bytes)
        self.last[block.idx] = np.nan

    def _retime(self, key: bytes, when_s: float) -> None:
        block = self.blocks[key]
        self._count_use(float(self.last[block.idx]), -block.size_bytes)
        self.last[block.idx] = when_s
        self._count_use(when_s, block.size_bytes)
        self._stale.add(key)
