"""An in-memory record index with the LMDB tier's write-transaction interface (no LMDB in the loop).

The simulation stores no bytes: it runs the tier's own Put transaction
(`tiers.puts.commit_puts`), eviction (`tiers.eviction.make_room`) and retention rule
(`tiers.retention.Retention`) against this index, which answers what they ask of a
`tiers.block_txn.BlockTxn`: each block's meta record (depth, size, last use), its
children, the usage totals, and the LRU index in the tier's own key order
(`kvstore.native.records.lru_key`), walked by a cursor with LMDB's `first`/`set_range`/`iternext`.
A change to those rules changes the simulation with them.

A write is a transaction as in LMDB: a Put that the store refuses (StoreFull after some
evictions) leaves the index as it was, so every change is journaled and undone on error.

The LRU index is brought up to date only when a walk asks for a cursor (an eviction):
a block stored or used since the last walk is noted, and its entry moved then. Until a
store fills, no walk runs, and a run costs no sorted-index work per use; once it walks,
it sees exactly the entries an LMDB index would hold.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
from sortedcontainers import SortedList

from kvstore.native.records import lru_key
from kvstore.prefix import HASH_BYTES, KEY_BYTES
from tiers.usage import Usage


class SimBlock:
    """One stored block's meta record (the fields the tier's rules read), and its children: a view of its
    index's per-block arrays at the block's number, made when asked (`SimIndex.meta`).

    The index keeps no object per block (a Put of a new block writes array items, no record is made), so
    the Put of Mooncake's 1.41 M new blocks costs no object each, and a dropped index frees in a few
    array frees.
    """

    __slots__ = ("_index", "idx", "key")

    def __init__(self, index: SimIndex, key: bytes, idx: int) -> None:
        self._index = index
        self.key = key
        self.idx = idx

    @property
    def depth(self) -> int:
        """Its depth in its chain (1: a chain's first block)."""
        return int(self._index.depth[self.idx])

    @property
    def size_bytes(self) -> int:
        """Its data's length."""
        return int(self._index.size[self.idx])

    @property
    def last_access_s(self) -> float:
        """Its recorded last use."""
        return float(self._index.last[self.idx])

    @property
    def parent(self) -> bytes | None:
        """Its parent's storage key (None: a chain's first block)."""
        return self._index.parent_key(self.idx)

    @property
    def children(self) -> list[bytes] | None:
        """Its stored children's keys (None: none)."""
        return list(self._index.children(self.key)) or None


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
    each stored key to its number (its place in `key_of`, shared with
    `kvstore.trace.chains.ChainKeys`). A block's fields live in arrays at its number:
    `last` its recorded last use (NaN: not stored here), `size` its bytes, `depth`, its parent
    (`parent`: the parent's number; -1 none, a chain's first block; -2 a parent kept by key, not
    stored here when the block was: a fleet copy's first block) and its children (a list linked
    through `first_child` and `next_sibling`). `meta` answers a `SimBlock` view. A Put names the
    numbers of the keys it may insert in `numbers` (a key without one is numbered at the end of
    `key_of`).

    A Put's inserts are queued and stored together, in a few array steps, when its write ends or
    anything reads the index first (`_flush`): what every read sees is what inserting them one by
    one would give.

    Args:
        use_bucket_s: width of the last-use buckets `bytes_used_since` counts by.
        key_of: every key by its number (shared by the nodes of a simulation).
        per_namespace: keep each namespace's bytes (a quota's make-room reads them, R19).
    """

    def __init__(self, *, use_bucket_s: float = 3600.0, key_of: list[bytes] | None = None,
                 per_namespace: bool = False) -> None:
        self.blocks: dict[bytes, int] = {}
        #: Bytes by the bucket of their block's last recorded use (`bytes_used_since`).
        self.use_bucket_s = use_bucket_s
        self.bytes_by_use: dict[int, int] = {}
        self.lru = SortedList()
        self._usage = Usage()
        self.dbs = _Dbs()
        self.namespace_names: dict[bytes, str] = {}
        self.unreadable: frozenset[bytes] = frozenset()
        self.key_of: list[bytes] = [] if key_of is None else key_of
        self.numbers: dict[bytes, int] = {}
        #: The keys a Put may insert, their numbers and the depth of the first (`put_run`).
        self._run: tuple[list[bytes], np.ndarray, int] | None = None
        self.last = np.full(0, np.nan)
        self.size = np.zeros(0, dtype=np.int64)
        self.depth = np.zeros(0, dtype=np.int32)
        self.parent = np.full(0, -1, dtype=np.int32)
        self.first_child = np.full(0, -1, dtype=np.int32)
        self.next_sibling = np.full(0, -1, dtype=np.int32)
        #: The parent key of a block whose parent was not stored here when it was (`parent` -2).
        self._far_parent: dict[int, bytes] = {}
        #: Each block's entry in the sorted LRU index, by number, once a walk needed it.
        self._indexed: dict[int, bytes] = {}
        #: Inserts not stored yet: (key, parent hash, depth, bytes, is_first, last use).
        self._pending: list[tuple[bytes, bytes, int, int, bool, float]] = []
        #: Bytes each namespace stores, and has had evicted (None: one namespace, not kept).
        self.ns_bytes: dict[bytes, int] | None = {} if per_namespace else None
        #: `bytes_by_use` of each namespace (kept with `ns_bytes`): what a tenant's own retention keeps.
        self.ns_bytes_by_use: dict[bytes, dict[int, int]] = {}
        self.ns_evicted: dict[bytes, list[int]] = {}
        #: The last uses of the blocks deleted in this write (the simulation reads and clears it).
        self.evicted_uses: list[float] = []
        self._journal: list[tuple[Any, ...]] | None = None
        # entries to move in the LRU index at the next walk: keys, and refreshed numbers
        self._stale: set[bytes] = set()
        self._stale_ids: list[np.ndarray] = []
        self._stale_count = 0
        self._dirty: np.ndarray | None = None

    def put_run(self, keys: list[bytes], numbers: np.ndarray, first_depth: int) -> None:
        """Name the numbers of the keys the next Put may insert: `keys` (consecutive blocks of a chain, the
        first at `first_depth`) and their `numbers`. An insert finds its run's numbers by slicing them,
        checked against its keys (else by `numbers`, a dict of them)."""
        self._run = (keys, numbers, first_depth)
        self.numbers = {}

    def _numbers_of(self, keys: Sequence[bytes], first_depth: int) -> list[Any]:
        """The numbers of `keys` (consecutive from `first_depth`); None for a key without one."""
        run = self._run
        if run is not None:
            named, numbers, depth = run
            at = first_depth - depth
            if at >= 0 and named[at:at + len(keys)] == list(keys):
                return numbers[at:at + len(keys)].tolist()  # type: ignore[no-any-return]
            if not self.numbers:
                self.numbers = dict(zip(named, numbers.tolist(), strict=True))
        return list(map(self.numbers.get, keys))

    def _grow(self, at_least: int) -> None:
        n = max(at_least, 2 * len(self.last), 1024)

        def grown(a: np.ndarray, fill: float) -> np.ndarray:
            b = np.full(n, fill, dtype=a.dtype)
            b[: len(a)] = a
            return b

        self.last, self.size, self.depth = grown(self.last, np.nan), grown(self.size, 0), grown(self.depth, 0)
        self.parent, self.first_child = grown(self.parent, -1), grown(self.first_child, -1)
        self.next_sibling = grown(self.next_sibling, -1)
        if self._dirty is not None:
            dirty = np.zeros(n, dtype=bool)
            dirty[: len(self._dirty)] = self._dirty
            self._dirty = dirty

    @property
    def txn(self) -> _Txn:
        """The raw `txn` the tier's rules read (made when asked: kept, it would make a reference cycle)."""
        return _Txn(self)

    @property
    def usage(self) -> Usage:
        """Blocks and bytes stored (what `tiers.usage` counts for the tier)."""
        if self._pending:
            self._flush()
        return self._usage

    # -- transactions -------------------------------------------------------------

    @contextmanager
    def write(self) -> Iterator[SimIndex]:
        """A write transaction: every change is undone if the body raises (as an aborted LMDB txn)."""
        self._journal = []
        try:
            yield self
            if self._pending:
                self._flush()
        except BaseException:
            self._pending = []  # queued inserts were never stored
            journal, self._journal = self._journal, None
            for entry in reversed(journal):
                self._undo(entry)
            raise
        self._journal = None

    def _undo(self, entry: tuple[Any, ...]) -> None:
        kind, key = entry[0], entry[1]
        if kind == "inserts":
            for one in reversed(key):
                self._remove(one)
        elif kind == "delete":
            _, _, idx, last, size, depth, parent = entry
            self._add(key, idx, last, size, depth, parent)
            if self.ns_bytes is not None:
                self.ns_evicted[key[8:16]][0] -= 1
                self.ns_evicted[key[8:16]][1] -= size
        else:  # touch
            self._retime(key, entry[2])

    # -- what BlockTxn answers ----------------------------------------------------

    def meta(self, key: bytes) -> SimBlock | None:
        """The block's record, None when not stored."""
        if self._pending:
            self._flush()
        idx = self.blocks.get(key)
        return None if idx is None else SimBlock(self, key, idx)

    def records(self) -> Iterator[tuple[bytes, SimBlock]]:
        """Every stored block's key and record."""
        if self._pending:
            self._flush()
        for key, idx in self.blocks.items():
            yield key, SimBlock(self, key, idx)

    def parent_key(self, idx: int) -> bytes | None:
        """The parent key of the block numbered `idx` (None: a chain's first block)."""
        p = int(self.parent[idx])
        if p == -1:
            return None
        return self._far_parent[idx] if p == -2 else self.key_of[p]

    def namespace_name(self, ns_id: bytes) -> str | None:
        """The namespace's name, once a Put named it."""
        return self.namespace_names.get(ns_id)

    def namespace_bytes(self, ns_id: bytes) -> int:
        """Bytes the namespace stores (all of them when one namespace runs)."""
        if self._pending:
            self._flush()
        return self._usage.stored_bytes if self.ns_bytes is None else self.ns_bytes.get(ns_id, 0)

    def children(self, key: bytes) -> Iterator[bytes]:
        """Keys of the stored children of `key`."""
        if self._pending:
            self._flush()
        idx = self.blocks.get(key)
        if idx is None:
            return iter(())
        out, c, key_of, nxt = [], int(self.first_child[idx]), self.key_of, self.next_sibling
        while c >= 0:
            out.append(key_of[c])
            c = int(nxt[c])
        return iter(out)

    def insert(self, key: bytes, parent_hash: bytes, depth: int, data: Any, now_s: float,
               is_first: bool, *, last_use_s: float | None = None) -> None:
        """Store a new block (its data is not kept: only its size).

        Queued, and stored with the write's other inserts in one pass (`_flush`) when the write
        ends or the index is read: the Put of every new block runs this, so it does no more.
        """
        self._pending.append((key, parent_hash, depth, len(data), is_first,
                              now_s if last_use_s is None else last_use_s))

    def _number_new(self, keys: Sequence[bytes], idxs: list[Any]) -> None:
        """Give each key numbered None in `idxs` the next free number, and grow the arrays to hold them."""
        if None in idxs:
            key_of = self.key_of
            for j, i in enumerate(idxs):
                if i is None:
                    idxs[j] = len(key_of)
                    key_of.append(keys[j])
        if max(idxs) >= len(self.last):
            self._grow(max(idxs) + 1)

    def _flush(self) -> None:
        """Store the queued inserts, as inserting them one by one in order would."""
        pending, self._pending = self._pending, []
        keys, hashes, depths, sizes, firsts, whens = zip(*pending, strict=True)
        chain = list(depths) == list(range(depths[0], depths[0] + len(depths)))
        idxs: list[Any] = self._numbers_of(keys, depths[0]) if chain else list(map(self.numbers.get, keys))
        self._number_new(keys, idxs)
        blocks: dict[Any, int] = self.blocks
        if chain and not any(firsts[1:]) and list(hashes[1:]) == [k[_NS_END:] for k in keys[:-1]]:
            # one run of a chain, each block's parent the one queued before it: `insert_run`'s case
            self._chain_run(keys, idxs, hashes[0], firsts[0], depths[0], list(sizes), list(whens))
            return
        # a block's parent: a queued one before it (the chain going on), else a stored one, else (a
        # fleet copy's first block, its parent on another node) kept by key
        parent_keys: list[Any] = [None if first else key[:_NS_END] + h
                                  for key, h, first in zip(keys, hashes, firsts, strict=True)]
        stored_before = list(map(blocks.get, parent_keys))
        blocks.update(zip(keys, idxs, strict=True))
        parents = list(map(blocks.get, parent_keys))
        if stored_before != parents:  # a parent queued here: only one queued before its child counts
            seen: set[bytes] = set()
            for j, key in enumerate(keys):
                pk = parent_keys[j]
                if pk is not None and stored_before[j] is None and pk not in seen:
                    parents[j] = None
                seen.add(key)
        pa = [-1 if p is None else p for p in parents]
        far: dict[int, bytes] = {}
        if parents.count(None) != firsts.count(True):  # parents not stored here: kept by key
            for j, p in enumerate(parents):
                if p is None and parent_keys[j] is not None:
                    pa[j] = -2
                    far[idxs[j]] = parent_keys[j]
        self._store(keys, idxs, pa, far, depths, sizes, whens, chain=False)

    def insert_run(self, keys: Sequence[bytes], parent_hash: bytes, first_depth: int, datas: Sequence[Any],
                   checksums: Sequence[int], now_s: float, is_root: bool, *,
                   last_use_s: Sequence[float]) -> None:
        """Store new consecutive blocks of one chain (`BlockTxn.insert_run`): `keys[0]`'s parent is
        `parent_hash` (none when `is_root`), each later block's the one before it; depths from
        `first_depth`. Only sizes are kept (not the data nor its checksums)."""
        if not keys:
            return
        if self._pending:
            self._flush()
        self._chain_run(keys, self._numbers_of(keys, first_depth), parent_hash, is_root, first_depth,
                        list(map(len, datas)), last_use_s)

    def _chain_run(self, keys: Sequence[bytes], idxs: list[Any], parent_hash: bytes, is_root: bool,
                   first_depth: int, sizes: list[int], whens: Sequence[float]) -> None:
        """Store consecutive new blocks of one chain (`insert_run`'s arguments, the numbers found)."""
        self._number_new(keys, idxs)
        far: dict[int, bytes] = {}
        if is_root:
            head = -1
        else:
            parent = keys[0][:_NS_END] + parent_hash
            up = self.blocks.get(parent)
            if up is None:  # a fleet copy's first block: its parent may live on another node
                head, far[idxs[0]] = -2, parent
            else:
                head = up
        self._store(keys, idxs, [head, *idxs[:-1]], far, range(first_depth, first_depth + len(keys)),
                    sizes, whens, chain=True)

    def _store(self, keys: Sequence[bytes], idxs: list[int], parents: list[int], far: dict[int, bytes],
               depths: Sequence[int], sizes: Sequence[int], whens: Sequence[float], *, chain: bool) -> None:
        """Store new blocks numbered `idxs` with their parents' numbers (-1: none, -2: kept by key in `far`);
        `chain`: each block's parent is the one before it (the first's aside), so no two share one."""
        self.blocks.update(zip(keys, idxs, strict=True))
        self._far_parent.update(far)
        at = np.array(idxs, dtype=np.int64)
        self.last[at] = whens
        self.size[at] = sizes
        self.depth[at] = depths
        self.first_child[at] = -1
        self.next_sibling[at] = -1
        pa = np.array(parents, dtype=np.int64)
        self.parent[at] = pa
        linked = pa >= 0
        child, up = at[linked], pa[linked]
        if chain or len(np.unique(up)) == len(up):  # each parent gains one child (a chain): one step
            self.next_sibling[child] = self.first_child[up]
            self.first_child[up] = child
        else:
            fc, nxt = self.first_child, self.next_sibling
            for c, p in zip(child.tolist(), up.tolist(), strict=True):
                nxt[c] = fc[p]
                fc[p] = c
        total = sum(sizes)
        usage = self._usage
        usage.blocks += len(keys)
        usage.stored_bytes += total
        hist, width = self.bytes_by_use, self.use_bucket_s
        if self.ns_bytes is not None:
            ns, by_use = self.ns_bytes, self.ns_bytes_by_use
            for key, n, when in zip(keys, sizes, whens, strict=True):
                ns[key[8:16]] = ns.get(key[8:16], 0) + n
                own = by_use.setdefault(key[8:16], {})
                slot = int(when // width)
                own[slot] = own.get(slot, 0) + n
        if min(whens) == max(whens):  # a Put's blocks share one use time
            slot = int(whens[0] // width)
            hist[slot] = hist.get(slot, 0) + total
        else:
            for when, n in zip(whens, sizes, strict=True):
                slot = int(when // width)
                hist[slot] = hist.get(slot, 0) + n
        if self._journal is not None:
            self._journal.append(("inserts", keys))

    def touch(self, key: bytes, now_s: float) -> None:
        """Record a use at `now_s` (nothing if absent or used since)."""
        if self._pending:
            self._flush()
        idx = self.blocks.get(key)
        if idx is None:
            return
        old = self.last[idx]
        if old >= now_s:
            return
        if self._journal is not None:
            self._journal.append(("touch", key, float(old)))
        self._retime(key, now_s)

    def refresh(self, numbers: np.ndarray, now_s: float, due_before_s: float) -> None:
        """A Get's refresh (R5), outside any Put: each stored block of `numbers` (keys by their number, of
        one namespace: one prompt's chain) whose recorded use is before `due_before_s`
        (`Retention.touch_due_before`) is recorded used at `now_s`.

        `touch` for many blocks at once, as one vector step: a Get of a long prompt refreshes
        thousands (most of a simulation's time), and this write cannot fail, so it needs no journal.
        """
        if self._pending:
            self._flush()
        if len(self.last) < len(self.key_of):
            self._grow(len(self.key_of))
        if len(numbers) <= _SMALL_REFRESH:  # a Lookup's deepest block, a short fetch: vector steps cost more
            for i in numbers.tolist():
                idx = self.blocks.get(self.key_of[i])
                if idx is not None and self.last[i] < min(due_before_s, now_s):
                    self._retime(self.key_of[i], now_s)
            return
        old = self.last[numbers]
        due = old < min(due_before_s, now_s)  # NaN (not stored here) is never due
        if not due.any():
            return
        chosen, old = numbers[due], old[due]
        sizes = self.size[chosen]
        slots = np.floor_divide(old, self.use_bucket_s)
        moves: list[tuple[int, int]] = []  # (slot, bytes) leaving it
        low, high = slots.min(), slots.max()
        if low == high:  # the usual case: the prefix was last used in one bucket
            moves.append((int(low), int(sizes.sum())))
        else:
            values, where = np.unique(slots.astype(np.int64), return_inverse=True)
            moves.extend((slot, int(n)) for slot, n in zip(values.tolist(), np.bincount(where, weights=sizes).tolist(),
                                                           strict=True))
        slot, total = int(now_s // self.use_bucket_s), int(sizes.sum())
        hists = [self.bytes_by_use]
        if self.ns_bytes is not None:  # one namespace's blocks: its own histogram moves the same way
            hists.append(self.ns_bytes_by_use.setdefault(self.key_of[int(chosen[0])][8:16], {}))
        for hist in hists:
            for old_slot, n in moves:
                hist[old_slot] -= n
            hist[slot] = hist.get(slot, 0) + total
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

    def delete(self, key: bytes, *, carry_up: bool, now_s: float | None = None) -> int:
        """Remove a block with no stored child; with `carry_up`, its parent takes its last use if later.

        `now_s` is the tier's (an expired pin journalled for the audit, R29): the simulation keeps no
        audit log, so it is taken and not used."""
        if self._pending:
            self._flush()
        idx = self.blocks.get(key)
        if idx is None:
            raise KeyError(f"no meta for block {key.hex()}")
        last, size, depth = float(self.last[idx]), int(self.size[idx]), int(self.depth[idx])
        parent = self.parent_key(idx)
        self._remove(key)
        if self._journal is not None:
            self._journal.append(("delete", key, idx, last, size, depth, parent))
        self.evicted_uses.append(last)
        if self.ns_bytes is not None:
            counts = self.ns_evicted.setdefault(key[8:16], [0, 0])
            counts[0] += 1
            counts[1] += size
        if carry_up and parent is not None:
            self.touch(parent, last)
        return size

    # -- the records --------------------------------------------------------------

    def synced_lru(self) -> SortedList:
        """The LRU index with every entry where the blocks' last uses put it now."""
        if self._pending:
            self._flush()
        stale, self._stale = self._stale, set()
        parts, self._stale_ids, self._stale_count = self._stale_ids, [], 0
        if self._dirty is not None:
            parts.append(np.flatnonzero(self._dirty))
            self._dirty = None
        if parts:
            key_of = self.key_of
            stale.update(key_of[i] for i in np.unique(np.concatenate(parts)).tolist())
        blocks, last, depth, indexed, fresh = self.blocks, self.last, self.depth, self._indexed, []
        for key in stale:
            idx = blocks.get(key)
            if idx is None:
                continue
            old = indexed.get(idx)
            if old is not None:
                self.lru.remove(old)
            entry = indexed[idx] = lru_key(float(last[idx]), int(depth[idx]), key)
            fresh.append(entry)
        self.lru.update(fresh)
        return self.lru

    def _add(self, key: bytes, idx: int, last_use_s: float, size: int, depth: int, parent: bytes | None) -> None:
        """Store again a block `delete` removed (an aborted write's undo)."""
        self.blocks[key] = idx
        self._stale.add(key)
        self.last[idx] = last_use_s
        self.size[idx] = size
        self.depth[idx] = depth
        up = None if parent is None else self.blocks.get(parent)
        if up is not None:
            self.parent[idx] = up
            self.next_sibling[idx] = self.first_child[up]
            self.first_child[up] = idx
        elif parent is None:
            self.parent[idx] = -1
        else:  # a fleet run's first block: its parent may live on another node
            self.parent[idx] = -2
            self._far_parent[idx] = parent
        self._usage.blocks += 1
        self._usage.stored_bytes += size
        if self.ns_bytes is not None:
            self.ns_bytes[key[8:16]] = self.ns_bytes.get(key[8:16], 0) + size
        self._count_use(key, last_use_s, size)

    def _count_use(self, key: bytes, when_s: float, nbytes: int) -> None:
        slot = int(when_s // self.use_bucket_s)
        self.bytes_by_use[slot] = self.bytes_by_use.get(slot, 0) + nbytes
        if self.ns_bytes is not None:
            own = self.ns_bytes_by_use.setdefault(key[8:16], {})
            own[slot] = own.get(slot, 0) + nbytes

    def bytes_used_since(self, since_s: float, ns_id: bytes | None = None) -> int:
        """Bytes of the blocks (of namespace `ns_id` only, when given: a run with per-namespace counts)
        whose recorded use is in or after the bucket holding `since_s`.

        What retention keeps, to a bucket's width, leaving out blocks kept only as the prefix of
        a later-used one (R6) whose own use is older: a Get refreshes a whole fetched prefix, so
        those are few (a Lookup alone refreshes only its deepest block).

        Raises:
            ValueError: `ns_id` given to an index that does not count per namespace.
        """
        if self._pending:
            self._flush()
        if ns_id is not None and self.ns_bytes is None:
            raise ValueError("bytes per namespace are kept only by an index made with per_namespace=True")
        hist = self.bytes_by_use if ns_id is None else self.ns_bytes_by_use.get(ns_id, {})
        if since_s == -math.inf:  # an infinite retention (a failing provider keeps everything, R18)
            return sum(hist.values())
        first = int(since_s // self.use_bucket_s)
        return sum(n for slot, n in hist.items() if slot >= first)

    def _remove(self, key: bytes) -> None:
        idx = self.blocks.pop(key)
        entry = self._indexed.pop(idx, None)
        if entry is not None:
            self.lru.remove(entry)
        self._stale.discard(key)
        up = int(self.parent[idx])
        if up >= 0 and self.key_of[up] in self.blocks:  # unlinked from its parent's children
            fc, nxt = self.first_child, self.next_sibling
            c, before = int(fc[up]), -1
            while c >= 0 and c != idx:
                c, before = int(nxt[c]), c
            if c == idx:
                if before < 0:
                    fc[up] = nxt[idx]
                else:
                    nxt[before] = nxt[idx]
        size = int(self.size[idx])
        self._usage.blocks -= 1
        self._usage.stored_bytes -= size
        if self.ns_bytes is not None:
            self.ns_bytes[key[8:16]] -= size
        self._count_use(key, float(self.last[idx]), -size)
        self.last[idx] = np.nan

    def _retime(self, key: bytes, when_s: float) -> None:
        idx = self.blocks[key]
        size = int(self.size[idx])
        self._count_use(key, float(self.last[idx]), -size)
        self.last[idx] = when_s
        self._count_use(key, when_s, size)
        self._stale.add(key)
