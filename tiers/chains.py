"""Finding how much of a prompt's chain is stored (R15), with a memo of verified chains
so that a Lookup of a prompt already seen costs a binary search and one memcmp.

Lookup must not report blocks that are not a chain (R15): block i of the hashes
a client sends counts only when it is stored with hashes[i - 1] as its parent.
Checking that reads one record per block: about 10 ms for a 1M-token prompt.

But which blocks come before a stored block is fixed by its hash: the server
computes every block's hash from its parent's hash and tokens (Put and transfer
writes alike), so the block stored under a key always has the same ancestors. So
"the chain ending at key K is exactly these hashes" stays true for good, and can
be remembered as the hashes themselves, packed end to end (32 bytes each, the first
block's first). Whether K is still stored is asked of LMDB each time; its ancestors
are then stored too (R6: stored blocks are prefix-closed).

A Lookup then binary-searches the stored prefix (about 14 reads), and accepts it
when the memo holds the chain of the last found block at that depth and the hashes
before it are byte for byte those (`bytes.startswith`, a memcmp: ~20 µs for the
500 KB of a 1M-token prompt, where a SHA-256 of them and the join cost 0.4 ms);
otherwise it walks the chain and remembers what it found. A Put that extends a
remembered chain remembers only its own hashes and a link to the chain it extends,
so an agent's next turn is found by binary search too; the first Lookup that follows
more than a few links keeps the whole chain as one piece.

A Lookup's hashes arrive packed (`PackedHashes`: one bytes object, no object per
hash; LookupRequest.block_hashes_packed), so the server neither cuts them into
15,625 objects (1 ms) nor joins them again.

Where the walk stops, the store may contradict the stop (R16): a meta record not
of its size, the next block stored as the child of one that cannot be found, or
a record whose depth or parent R6 rules out. Those are damage LMDB read without
an error; the block is noted in `tiers.damage.DamagedBlocks` (counted once, its
page logged once). A plain end of the stored prefix costs one more read.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, overload

import lmdb

from kvstore.native.records import META_STRUCT, META_TAG
from kvstore.prefix import HASH_BYTES, BlockScope
from tiers.damage import DamagedBlocks, SilentDamage

#: Chains remembered (least recently used forgotten first).
DEFAULT_CAPACITY = 16_384
#: Bytes of remembered hashes (and `ENTRY_OVERHEAD_BYTES` each): 128 chains of a million tokens.
DEFAULT_MAX_BYTES = 64 << 20
#: What an entry costs beyond its hashes (its objects and the table's slot), counted against max_bytes.
ENTRY_OVERHEAD_BYTES = 200
#: Links followed before a verified chain is kept as one piece (a Put of 64-block batches leaves
#: one link per batch: 245 for a million tokens).
MAX_LINKS = 4

#: Parent hash and depth at the head of a meta record (`META_STRUCT`), and the last use at its end.
_PARENT_DEPTH = struct.Struct("<32sI")
_LAST_USE, _LAST_USE_OFFSET = struct.Struct("<d"), META_STRUCT.size - 8


class PackedHashes(Sequence[bytes]):
    """Block hashes packed end to end in one bytes object (32 bytes each), read as a sequence of hashes.

    What a Lookup carries (`block_hashes_packed`), kept packed so that a million-token prompt is
    not cut into 15,625 objects: an item is a 32-byte slice, a slice is another `PackedHashes`.

    Args:
        packed: the hashes; its length is a multiple of 32 (the caller checked it).
    """

    __slots__ = ("packed",)

    def __init__(self, packed: bytes) -> None:
        if len(packed) % HASH_BYTES:
            raise ValueError(f"packed hashes are {len(packed)} bytes, not a multiple of {HASH_BYTES}")
        self.packed = packed

    def __len__(self) -> int:
        return len(self.packed) // HASH_BYTES

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> PackedHashes: ...

    def __getitem__(self, index: int | slice) -> bytes | PackedHashes:
        n = len(self)
        if isinstance(index, slice):
            start, stop, step = index.indices(n)
            if step != 1:
                return PackedHashes(b"".join(self[i] for i in range(start, stop, step)))
            if start == 0 and stop >= n:
                return self
            return PackedHashes(self.packed[start * HASH_BYTES:max(stop, start) * HASH_BYTES])
        if index < 0:
            index += n
        if not 0 <= index < n:
            raise IndexError("hash index out of range")
        return self.packed[index * HASH_BYTES:(index + 1) * HASH_BYTES]

    def __iter__(self) -> Iterator[bytes]:
        p = self.packed
        return (p[i:i + HASH_BYTES] for i in range(0, len(p), HASH_BYTES))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedHashes):
            return self.packed == other.packed
        if isinstance(other, (list, tuple)):
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    def __hash__(self) -> int:
        return hash(self.packed)

    def __repr__(self) -> str:
        return f"PackedHashes({len(self)} hashes)"


def packed_of(hashes: Sequence[bytes]) -> bytes:
    """`hashes` packed end to end: the packed bytes themselves when they are `PackedHashes`."""
    return hashes.packed if isinstance(hashes, PackedHashes) else b"".join(hashes)


@dataclass(frozen=True, slots=True)
class _Tail:
    """A remembered chain of `depth` blocks: the chain ending at `parent` (None: none, the
    piece starts at the root), then `piece` (packed hashes, the last the tail's own)."""

    depth: int
    parent: bytes | None
    piece: bytes


class ChainCache:
    """Verified chains: storage key -> the hashes of the chain ending there (packed, from the first
    block; a Put's extension as a link to the chain it extends and its own hashes). Thread-safe.

    Args:
        capacity: most chains remembered.
        max_bytes: most bytes of hashes kept (and `ENTRY_OVERHEAD_BYTES` per chain).
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._capacity = capacity
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._tails: OrderedDict[bytes, _Tail] = OrderedDict()
        self._size_bytes = 0

    def knows(self, key: bytes, hashes: Sequence[bytes]) -> bool:
        """Whether `hashes` (from the first block) are the chain ending at `key`, as remembered."""
        return self.knows_packed(key, packed_of(hashes), len(hashes))

    def knows_packed(self, key: bytes, packed: bytes, depth: int, offset: int = 0) -> bool:
        """Whether the first `depth` hashes of `packed` from byte `offset` (a run's, F75) are the chain ending at
        `key`, as remembered: each piece compared byte for byte where it sits (a memcmp each; no copy, no digest)."""
        pieces: list[tuple[int, bytes]] = []
        with self._lock:
            tail = self._tails.get(key)
            if tail is None or tail.depth != depth:
                return False
            self._tails.move_to_end(key)
            end = depth
            while True:
                start = end - len(tail.piece) // HASH_BYTES
                pieces.append((start, tail.piece))
                if tail.parent is None:
                    if start:
                        return False
                    break
                tail = self._tails.get(tail.parent)  # type: ignore[assignment]
                if tail is None or tail.depth != start:
                    return False  # a link forgotten: the walk verifies it again
                end = start
        if len(packed) < offset + depth * HASH_BYTES:
            return False
        for start, piece in pieces:
            if not packed.startswith(piece, offset + start * HASH_BYTES):
                return False
        if len(pieces) > MAX_LINKS:  # verified: keep it as one piece, so the next Lookup follows no link
            self._put(key, _Tail(depth, None, packed[offset:offset + depth * HASH_BYTES]))
        return True

    def remember(self, key: bytes, hashes: Sequence[bytes]) -> None:
        """Record that `hashes` (from the first block) are the stored chain ending at `key`."""
        self.remember_packed(key, packed_of(hashes))

    def remember_packed(self, key: bytes, packed: bytes) -> None:
        """Record that `packed` (hashes from the first block) is the stored chain ending at `key`."""
        self._put(key, _Tail(len(packed) // HASH_BYTES, None, packed))

    def extend(self, parent_key: bytes | None, key: bytes, hashes: Sequence[bytes]) -> None:
        """Record the chain ending at `key`: the remembered one ending at `parent_key` (None:
        the chain's root) followed by `hashes`. Nothing is recorded if the parent is not remembered."""
        if parent_key is None:
            self.remember(key, hashes)
            return
        with self._lock:
            parent = self._tails.get(parent_key)
        if parent is None:
            return
        self._put(key, _Tail(parent.depth + len(hashes), parent_key, packed_of(hashes)))

    def _put(self, key: bytes, tail: _Tail) -> None:
        cost = len(tail.piece) + ENTRY_OVERHEAD_BYTES
        if cost > self.max_bytes:
            return
        with self._lock:
            old = self._tails.pop(key, None)
            if old is not None:
                self._size_bytes -= len(old.piece) + ENTRY_OVERHEAD_BYTES
            self._tails[key] = tail
            self._size_bytes += cost
            while len(self._tails) > self._capacity or self._size_bytes > self.max_bytes:
                _, dropped = self._tails.popitem(last=False)
                self._size_bytes -= len(dropped.piece) + ENTRY_OVERHEAD_BYTES

    @property
    def size_bytes(self) -> int:
        """Bytes of hashes kept now (and `ENTRY_OVERHEAD_BYTES` per chain)."""
        return self._size_bytes

    def __len__(self) -> int:
        return len(self._tails)


class ChainIndex:
    """How many leading blocks of a prompt's hashes are stored as that chain (R15).

    Args:
        env: the tier's LMDB environment.
        records_db: its records database (kvstore/native/records.py).
        damage: where a block whose record sits on a damaged page is noted (the
            chain ends before it).
    """

    def __init__(self, env: lmdb.Environment, records_db: Any, damage: DamagedBlocks) -> None:
        self._env = env
        self._records = records_db
        self._damage = damage
        self.memo = ChainCache()

    def find(self, scope: BlockScope, hashes: Sequence[bytes]) -> tuple[int, float]:
        """(blocks found as a chain, the deepest one's recorded last use; 0.0 when none or unknown).

        `hashes` may be `PackedHashes` (a Lookup's, as they came), read without cutting them up.
        """
        packed = packed_of(hashes)
        known = self._known_prefix(scope, packed)
        if known is not None:
            return known
        found, last_use_s = self._walk(scope, hashes)
        if found:
            self.memo.remember_packed(scope.key(hashes[found - 1]), packed[:found * HASH_BYTES])
        return found, last_use_s

    def find_runs(self, scope: BlockScope, hashes: Sequence[bytes], lengths: Sequence[int]) -> list[tuple[int, float]]:
        """`find` of each run of `hashes` cut by `lengths` (each run a chain of its own from the root: a fleet
        node's runs, docs/FLEET.md F50), every run read in one read txn (F75).

        Each answer is the run's own `find`'s: the memo's check first (a stored run costs one read, its last
        block's), else the walk, in the same txn. A walk that meets damage (an LMDB error, or a stop the store
        contradicts, R16) is done again alone by `find`, from that run on, which notes it as it always does.
        """
        packed, prefix = packed_of(hashes), scope.prefix
        answers: list[tuple[int, float]] = []
        walked: list[tuple[int, int]] = []  # (start, found) of the runs walked: remembered after the txn
        try:
            with self._env.begin(buffers=True) as txn:
                get, start = txn.get, 0
                for n in lengths:
                    known = self._known_in(get, prefix, packed, start, n)
                    if known is None:
                        run = PackedHashes(packed[start * HASH_BYTES:(start + n) * HASH_BYTES])
                        found, last_use_s, damaged = _walk_in(get, self._records, prefix, run, [0],
                                                              self._damage.known)
                        if damaged:
                            break  # `find` walks it again and notes the damage
                        known = found, last_use_s
                        walked.append((start, found))
                    answers.append(known)
                    start += n
        except lmdb.Error:
            pass  # the txn is gone with the error: this run and the rest are found one by one
        for start, found in walked:
            if found:
                end = (start + found) * HASH_BYTES
                self.memo.remember_packed(prefix + packed[end - HASH_BYTES:end], packed[start * HASH_BYTES:end])
        start = sum(lengths[:len(answers)])
        for n in lengths[len(answers):]:
            answers.append(self.find(scope, PackedHashes(packed[start * HASH_BYTES:(start + n) * HASH_BYTES])))
            start += n
        return answers

    def find_anchors(self, scope: BlockScope, anchors: Sequence[bytes], depths: Sequence[int]
                     ) -> list[float | None]:
        """For each run named by its last hash (docs/FLEET.md F77): the last use of `anchors[i]` when it is stored
        at `depths[i]` in `scope` (its run whole: `find_after`'s reasoning), else None; every run in one read txn.
        An LMDB error (a damaged page) sends each run to `find_after` alone, which reads it as it always does."""
        prefix, tag, size, unpack = scope.prefix, META_TAG, META_STRUCT.size, _PARENT_DEPTH.unpack_from
        answers: list[float | None] = []
        try:
            with self._env.begin(buffers=True) as txn:
                get, db = txn.get, self._records
                for anchor, depth in zip(anchors, depths, strict=True):
                    meta = get(prefix + anchor + tag, None, db)
                    whole = meta is not None and len(meta) == size and unpack(meta)[1] == depth
                    answers.append(_LAST_USE.unpack_from(meta, _LAST_USE_OFFSET)[0] if meta is not None and whole
                                   else None)
        except lmdb.Error:
            found = [self.find_after(scope, anchor, depth, ()) for anchor, depth in zip(anchors, depths, strict=True)]
            return [known[1] if known is not None else None for known in found]
        return answers

    def find_after(self, scope: BlockScope, anchor: bytes, depth: int, after: Sequence[bytes]
                   ) -> tuple[int, float] | None:
        """A next turn's `find` from its anchor: (blocks found from the first block, the deepest one's
        last use), or None when `anchor` is not stored at `depth` in `scope`.

        The anchor stored at its depth stands for its whole prefix: R6 keeps the chain above a
        stored block stored, and its hash fixes which blocks those are. So only the hashes after
        it are read, each as `_walk` reads them (R15: stored, one level down, naming the one
        before as its parent): the work is the new blocks', not the prompt's.
        """
        prefix, tag, size, unpack = scope.prefix, META_TAG, META_STRUCT.size, _PARENT_DEPTH.unpack_from
        chain = _Anchored(anchor, depth, after)
        i = depth - 1
        damaged = ""
        try:
            with self._env.begin(buffers=True) as txn:
                get, db = txn.get, self._records
                last_meta = get(prefix + anchor + tag, None, db)
                if last_meta is None or len(last_meta) != size or unpack(last_meta)[1] != depth:
                    return None
                previous, raw = anchor, None
                for i, h in enumerate(after, depth):
                    raw = get(prefix + h + tag, None, db)
                    if raw is None or len(raw) != size:
                        break
                    parent, at = unpack(raw)
                    if at != i + 1 or parent != previous:
                        break
                    previous, last_meta = h, raw
                else:
                    i = len(chain)
                last_use_s = _LAST_USE.unpack_from(last_meta, _LAST_USE_OFFSET)[0]
                if i < len(chain) and not self._damage.known(prefix + chain[i]):
                    damaged = _contradiction(get, db, prefix, chain, i, raw)
        except lmdb.Error as exc:  # a damaged page: the chain ends before it (or the anchor is not read)
            if i < depth:
                return None
            self._damage.note(prefix + chain[i], exc)
            return i, 0.0
        if damaged:
            self._damage.note(prefix + chain[i], SilentDamage(damaged))
        return i, last_use_s

    def extend(self, parent_key: bytes | None, key: bytes, hashes: Sequence[bytes]) -> None:
        """A Put stored `hashes` after `parent_key` (None: from the root): see `ChainCache.extend`."""
        self.memo.extend(parent_key, key, hashes)

    def forget(self) -> None:
        """Drop the memo: every chain is walked again once (benchmarks, tests)."""
        self.memo = ChainCache()

    def _known_prefix(self, scope: BlockScope, packed: bytes) -> tuple[int, float] | None:
        """The stored prefix by binary search, if the memo vouches that it is a chain; else None."""
        try:
            with self._env.begin(buffers=True) as txn:
                return self._known_in(txn.get, scope.prefix, packed, 0, len(packed) // HASH_BYTES)
        except lmdb.Error:
            return None  # the walk meets the damage again and notes it

    def _known_in(self, get: Callable[..., Any], prefix: bytes, packed: bytes, start: int, n: int
                  ) -> tuple[int, float] | None:
        """The stored prefix of the `n` hashes of `packed` from hash `start`, by binary search in the caller's
        txn, if the memo vouches that it is a chain; else None.

        The search assumes the hashes are a chain (stored blocks of one are a prefix, R6); the memo then checks
        that the hashes up to the last found block are exactly that block's ancestors. The last block is read
        first, so a stored chain (a prompt sent again, a fleet node's complete run) costs one read, and then the
        first, so an absent one costs one more (F75); not while damage is known in the store.
        """
        tag, size, hb, db, base = META_TAG, META_STRUCT.size, HASH_BYTES, self._records, start * HASH_BYTES
        if not n:
            return None
        # A store with damage known searches as before its probes: the search's reads are what meet a damaged
        # page (and send the Lookup to the walk, which notes it, R16), not a probe that skips past it.
        probes = not self._damage.snapshot()
        raw = get(prefix + packed[base + (n - 1) * hb:base + n * hb] + tag, None, db) if probes else None
        if raw is not None:
            lo = n
        else:
            lo, hi = 0, n - 1 if probes else n
            if probes and hi and get(prefix + packed[base:base + hb] + tag, None, db) is None:
                hi = 0  # the first block is not stored: none is (the walk checks the stop, R16)
            while lo < hi:
                mid = (lo + hi + 1) // 2
                if get(prefix + packed[base + (mid - 1) * hb:base + mid * hb] + tag, None, db) is not None:
                    lo = mid
                else:
                    hi = mid - 1
        if not lo:
            return None
        last = prefix + packed[base + (lo - 1) * hb:base + lo * hb]
        if not self.memo.knows_packed(last, packed, lo, base):
            return None
        if raw is None:  # (the probe's record is the last found block's when the whole chain is stored)
            raw = get(last + tag, None, db)
        if raw is None or len(raw) != size or _PARENT_DEPTH.unpack_from(raw)[1] != lo:
            return None
        return lo, _LAST_USE.unpack_from(raw, _LAST_USE_OFFSET)[0]

    def _walk(self, scope: BlockScope, hashes: Sequence[bytes]) -> tuple[int, float]:
        """(blocks found as a chain, the deepest one's last use), reading every block's record."""
        at = [0]
        try:
            with self._env.begin(buffers=True) as txn:
                found, last_use_s, damaged = _walk_in(txn.get, self._records, scope.prefix, hashes, at,
                                                      self._damage.known)
        except lmdb.Error as exc:  # a damaged page: the chain ends before it
            self._damage.note(scope.prefix + hashes[at[0]], exc)
            return at[0], 0.0  # the deepest one's record died with the txn: call it due (a touch checks)
        if damaged:
            self._damage.note(scope.prefix + hashes[found], SilentDamage(damaged))
        return found, last_use_s


def _walk_in(get: Callable[..., Any], db: Any, prefix: bytes, hashes: Sequence[bytes], at: list[int],
             known_damaged: Callable[[bytes], bool]) -> tuple[int, float, str]:
    """(blocks found as a chain, the deepest one's last use, why the stop must be damage or ""), reading every
    block's record in the caller's txn; `at[0]` is the block being read (where an LMDB error stopped it)."""
    size, unpack = META_STRUCT.size, _PARENT_DEPTH.unpack_from
    i = 0
    last_meta: Any = None
    previous = b""
    raw = None
    for i, h in enumerate(hashes):
        at[0] = i
        raw = get(prefix + h + META_TAG, None, db)
        if raw is None or len(raw) != size:
            break
        parent, depth = unpack(raw)
        if depth != i + 1 or (i and parent != previous):
            break
        previous, last_meta = h, raw
    else:
        i = len(hashes)
    last_use_s = _LAST_USE.unpack_from(last_meta, _LAST_USE_OFFSET)[0] if i else 0.0
    damaged = ""
    if i < len(hashes) and not known_damaged(prefix + hashes[i]):
        damaged = _contradiction(get, db, prefix, hashes, i, raw)
    return i, last_use_s, damaged


class _Anchored:
    """A next turn's chain as `_contradiction` reads it, by block index from the first block: the
    anchor at `depth - 1`, the hashes after it from `depth` (the blocks above the anchor are
    never read: the walk starts below it)."""

    __slots__ = ("_after", "_anchor", "_depth")

    def __init__(self, anchor: bytes, depth: int, after: Sequence[bytes]) -> None:
        self._anchor, self._depth, self._after = anchor, depth, after

    def __len__(self) -> int:
        return self._depth + len(self._after)

    def __getitem__(self, index: int) -> bytes:
        if index == self._depth - 1:
            return self._anchor
        if index < self._depth:
            raise IndexError(f"block {index} is above the anchor (block {self._depth - 1})")
        return self._after[index - self._depth]


def _contradiction(get: Callable[..., Any], db: Any, prefix: bytes, hashes: Sequence[bytes] | _Anchored, i: int,
                   raw: Any) -> str:
    """Why block i, where a chain walk stopped, must be damaged ("" when the stop may be true).

    `raw` is its meta record as read (None: not found). Block i + 1 stored as its child
    means block i is stored, at depth i + 1 (R6: the chain above a stored block is
    stored, and the server derives each hash from its parent's). A record that is read
    must agree with its own parent: a first block names no stored block, any other
    one a block one level up.
    """
    size, unpack = META_STRUCT.size, _PARENT_DEPTH.unpack_from
    if raw is not None and len(raw) != size:
        return f"its meta record is {len(raw)} bytes, not {size}"
    child = get(prefix + hashes[i + 1] + META_TAG, None, db) if i + 1 < len(hashes) else None
    named = child is not None and len(child) == size and unpack(child) == (hashes[i], i + 2)
    if raw is None:
        return "its meta record is not found, but the next block's names it as its parent" if named else ""
    parent, depth = unpack(raw)
    if named and depth != i + 1:
        return f"its meta record says depth {depth}; its child's record puts it at {i + 1}"
    up = get(prefix + bytes(parent) + META_TAG, None, db)
    if depth == 1 and up is not None:
        return "its meta record says it is a chain's first block, but names a stored block as its parent"
    if depth > 1 and (up is None or len(up) != size or unpack(up)[1] != depth - 1):
        return f"its meta record says depth {depth}, but names a parent not stored one level up"
    return ""
