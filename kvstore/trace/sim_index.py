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

from sortedcontainers import SortedList

from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.records import lru_key
from tiers.usage import Usage


class SimBlock:
    """One stored block's meta record (the fields the tier's rules read), and its children."""

    __slots__ = ("children", "depth", "indexed", "last_access_s", "parent", "size_bytes")

    def __init__(self, *, depth: int, size_bytes: int, last_access_s: float, parent: bytes | None) -> None:
        self.depth = depth
        self.size_bytes = size_bytes
        self.last_access_s = last_access_s
        self.parent = parent
        self.children: list[bytes] = []
        #: Its entry in the sorted LRU index, None until a walk first needs it.
        self.indexed: bytes | None = None


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


class SimIndex:
    """The blocks one simulated store holds, as the tier's records would say.

    `write()` yields it as the write transaction (`BlockTxn`'s interface); `blocks` maps
    each stored key to its `SimBlock`.
    """

    def __init__(self, *, use_bucket_s: float = 3600.0) -> None:
        self.blocks: dict[bytes, SimBlock] = {}
        #: Bytes by the bucket of their block's last recorded use (`bytes_used_since`).
        self.use_bucket_s = use_bucket_s
        self.bytes_by_use: dict[int, int] = {}
        self.lru = SortedList()
        self.usage = Usage()
        self.txn = _Txn(self)
        self._stale: set[bytes] = set()
        self.dbs = _Dbs()
        self.namespace_names: dict[bytes, str] = {}
        self.unreadable: frozenset[bytes] = frozenset()
        self._journal: list[tuple[Any, ...]] | None = None

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
            block: SimBlock = entry[2]
            self._add(key, block)
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
        """Bytes the namespace stores (the simulation runs one namespace: the store's)."""
        return self.usage.stored_bytes

    def children(self, key: bytes) -> Iterator[bytes]:
        """Keys of the stored children of `key`."""
        block = self.blocks.get(key)
        return iter(block.children if block is not None else ())

    def insert(self, key: bytes, parent_hash: bytes, depth: int, data: Any, now_s: float,
               is_first: bool, *, last_use_s: float | None = None) -> None:
        """Store a new block (its data is not kept: only its size)."""
        parent = None if is_first else key[: KEY_BYTES - HASH_BYTES] + parent_hash
        block = SimBlock(depth=depth, size_bytes=len(data), last_access_s=now_s if last_use_s is None else last_use_s,
                         parent=parent)
        self._add(key, block)
        if self._journal is not None:
            self._journal.append(("insert", key))

    def touch(self, key: bytes, now_s: float) -> None:
        """Record a use at `now_s` (nothing if absent or used since)."""
        block = self.blocks.get(key)
        if block is None or block.last_access_s >= now_s:
            return
        if self._journal is not None:
            self._journal.append(("touch", key, block.last_access_s))
        self._retime(key, now_s)

    def refresh(self, keys: list[bytes], now_s: float, due_before_s: float) -> None:
        """A Get's refresh (R5), outside any Put: each stored block of `keys` whose recorded use is
        before `due_before_s` (`Retention.touch_due_before`) is recorded used at `now_s`.

        `touch` for many blocks at once, in one loop: a Get of a long prompt refreshes thousands
        (most of a simulation's time), and this write cannot fail, so it needs no journal.
        """
        blocks, hist, stale, width = self.blocks, self.bytes_by_use, self._stale, self.use_bucket_s
        moved = 0
        for key in keys:
            block = blocks.get(key)
            if block is None or block.last_access_s >= due_before_s or block.last_access_s >= now_s:
                continue
            slot = int(block.last_access_s // width)
            hist[slot] -= block.size_bytes
            moved += block.size_bytes
            block.last_access_s = now_s
            stale.add(key)
        if moved:
            slot = int(now_s // width)
            hist[slot] = hist.get(slot, 0) + moved

    def delete(self, key: bytes, *, carry_up: bool) -> int:
        """Remove a block with no stored child; with `carry_up`, its parent takes its last use if later."""
        block = self.blocks.get(key)
        if block is None:
            raise KeyError(f"no meta for block {key.hex()}")
        self._remove(key)
        if self._journal is not None:
            self._journal.append(("delete", key, block))
        if carry_up and block.parent is not None:
            self.touch(block.parent, block.last_access_s)
        return block.size_bytes

    # -- the records --------------------------------------------------------------

    def synced_lru(self) -> SortedList:
        """The LRU index with every entry where the blocks' last uses put it now."""
        stale, self._stale = self._stale, set()
        blocks, fresh = self.blocks, []
        for key in stale:
            block = blocks.get(key)
            if block is None:
                continue
            if block.indexed is not None:
                self.lru.remove(block.indexed)
            block.indexed = lru_key(block.last_access_s, block.depth, key)
            fresh.append(block.indexed)
        self.lru.update(fresh)
        return self.lru

    def _add(self, key: bytes, block: SimBlock) -> None:
        self.blocks[key] = block
        block.indexed = None
        self._stale.add(key)
        if block.parent is not None:
            parent = self.blocks.get(block.parent)
            if parent is not None:  # a fleet run's first block: its parent may live on another node
                parent.children.append(key)
        self.usage.blocks += 1
        self.usage.stored_bytes += block.size_bytes
        self._count_use(block.last_access_s, block.size_bytes)

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
            if parent is not None and key in parent.children:
                parent.children.remove(key)
        self.usage.blocks -= 1
        self.usage.stored_bytes -= block.size_bytes
        self._count_use(block.last_access_s, -block.size_bytes)

    def _retime(self, key: bytes, when_s: float) -> None:
        block = self.blocks[key]
        self._count_use(block.last_access_s, -block.size_bytes)
        block.last_access_s = when_s
        self._count_use(when_s, block.size_bytes)
        self._stale.add(key)
