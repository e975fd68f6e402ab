"""Finding how much of a prompt's chain is stored (R15), with a memo of verified chains
so that a Lookup of a prompt already seen costs a binary search.

Lookup must not report blocks that are not a chain (R15): block i of the hashes
a client sends counts only when it is stored with hashes[i - 1] as its parent.
Checking that reads one record per block: about 10 ms for a 1M-token prompt.

But which blocks come before a stored block is fixed by its hash: the server
computes every block's hash from its parent's hash and tokens (Put and transfer
writes alike), so the block stored under a key always has the same ancestors. So
"the chain ending at key K is exactly these hashes" stays true for good, and can
be remembered as a digest of the hashes (SHA-256 over their concatenation, the
first block's first). Whether K is still stored is asked of LMDB each time; its
ancestors are then stored too (R6: stored blocks are prefix-closed).

A Lookup then binary-searches the stored prefix (about 14 reads), and accepts it
when the memo knows the last found block at that depth with the same digest of
the hashes before it; otherwise it walks the chain and remembers what it found.
A Put that extends a remembered chain remembers the extended one, so an agent's
next turn is found by binary search too.

Where the walk stops, the store may contradict the stop (R16): a meta record not
of its size, the next block stored as the child of one that cannot be found, or
a record whose depth or parent R6 rules out. Those are damage LMDB read without
an error; the block is noted in `tiers.damage.DamagedBlocks` (counted once, its
page logged once). A plain end of the stored prefix costs one more read.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import lmdb

from kvstore.prefix import BlockScope
from tiers.damage import DamagedBlocks, SilentDamage
from tiers.records import META_STRUCT, META_TAG

#: Chains remembered (least recently used forgotten first); about 200 bytes each.
DEFAULT_CAPACITY = 16_384

#: Parent hash and depth at the head of a meta record (`META_STRUCT`), and the last use at its end.
_PARENT_DEPTH = struct.Struct("<32sI")
_LAST_USE, _LAST_USE_OFFSET = struct.Struct("<d"), META_STRUCT.size - 8


class ChainCache:
    """Verified chain tails: storage key -> (depth, running SHA-256 of the chain's hashes). Thread-safe.

    Args:
        capacity: most tails remembered.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        self._capacity = capacity
        self._lock = threading.Lock()
        self._tails: OrderedDict[bytes, tuple[int, Any]] = OrderedDict()

    def knows(self, key: bytes, hashes: Sequence[bytes]) -> bool:
        """Whether `hashes` (from the first block) are the chain ending at `key`, as remembered."""
        with self._lock:
            entry = self._tails.get(key)
            if entry is None:
                return False
            self._tails.move_to_end(key)
        depth, state = entry
        return depth == len(hashes) and state.digest() == hashlib.sha256(b"".join(hashes)).digest()

    def remember(self, key: bytes, hashes: Sequence[bytes]) -> None:
        """Record that `hashes` (from the first block) are the stored chain ending at `key`."""
        state = hashlib.sha256(b"".join(hashes))
        self._put(key, len(hashes), state)

    def extend(self, parent_key: bytes | None, key: bytes, hashes: Sequence[bytes]) -> None:
        """Record the chain ending at `key`: the remembered one ending at `parent_key` (None:
        the chain's root) followed by `hashes`. Nothing is recorded if the parent is not remembered."""
        if parent_key is None:
            self.remember(key, hashes)
            return
        with self._lock:
            entry = self._tails.get(parent_key)
        if entry is None:
            return
        depth, state = entry
        state = state.copy()
        state.update(b"".join(hashes))
        self._put(key, depth + len(hashes), state)

    def _put(self, key: bytes, depth: int, state: Any) -> None:
        with self._lock:
            self._tails[key] = (depth, state)
            self._tails.move_to_end(key)
            while len(self._tails) > self._capacity:
                self._tails.popitem(last=False)


class ChainIndex:
    """How many leading blocks of a prompt's hashes are stored as that chain (R15).

    Args:
        env: the tier's LMDB environment.
        records_db: its records database (tiers/records.py).
        damage: where a block whose record sits on a damaged page is noted (the
            chain ends before it).
    """

    def __init__(self, env: lmdb.Environment, records_db: Any, damage: DamagedBlocks) -> None:
        self._env = env
        self._records = records_db
        self._damage = damage
        self.memo = ChainCache()

    def find(self, scope: BlockScope, hashes: Sequence[bytes]) -> tuple[int, float]:
        """(blocks found as a chain, the deepest one's recorded last use; 0.0 when none or unknown)."""
        known = self._known_prefix(scope, hashes)
        if known is not None:
            return known
        found, last_use_s = self._walk(scope, hashes)
        if found:
            self.memo.remember(scope.key(hashes[found - 1]), hashes[:found])
        return found, last_use_s

    def extend(self, parent_key: bytes | None, key: bytes, hashes: Sequence[bytes]) -> None:
        """A Put stored `hashes` after `parent_key` (None: from the root): see `ChainCache.extend`."""
        self.memo.extend(parent_key, key, hashes)

    def forget(self) -> None:
        """Drop the memo: every chain is walked again once (benchmarks, tests)."""
        self.memo = ChainCache()

    def _known_prefix(self, scope: BlockScope, hashes: Sequence[bytes]) -> tuple[int, float] | None:
        """The stored prefix by binary search, if the memo vouches that it is a chain; else None.

        The search assumes the hashes are a chain (stored blocks of one are a
        prefix, R6); the memo then checks that the hashes up to the last found
        block are exactly that block's ancestors.
        """
        prefix, tag, size = scope.prefix, META_TAG, META_STRUCT.size
        try:
            with self._env.begin(buffers=True) as txn:
                get, db = txn.get, self._records
                lo, hi = 0, len(hashes)
                while lo < hi:
                    mid = (lo + hi + 1) // 2
                    if get(prefix + hashes[mid - 1] + tag, None, db) is not None:
                        lo = mid
                    else:
                        hi = mid - 1
                if not lo or not self.memo.knows(prefix + hashes[lo - 1], hashes[:lo]):
                    return None
                raw = get(prefix + hashes[lo - 1] + tag, None, db)
                if raw is None or len(raw) != size or _PARENT_DEPTH.unpack_from(raw)[1] != lo:
                    return None
                return lo, _LAST_USE.unpack_from(raw, _LAST_USE_OFFSET)[0]
        except lmdb.Error:
            return None  # the walk meets the damage again and notes it

    def _walk(self, scope: BlockScope, hashes: Sequence[bytes]) -> tuple[int, float]:
        """(blocks found as a chain, the deepest one's last use), reading every block's record."""
        prefix, tag, size, unpack = scope.prefix, META_TAG, META_STRUCT.size, _PARENT_DEPTH.unpack_from
        i = 0
        last_meta: Any = None
        damaged = ""
        try:
            with self._env.begin(buffers=True) as txn:
                get, db = txn.get, self._records
                previous = b""
                raw = None
                for i, h in enumerate(hashes):
                    raw = get(prefix + h + tag, None, db)
                    if raw is None or len(raw) != size:
                        break
                    parent, depth = unpack(raw)
                    if depth != i + 1 or (i and parent != previous):
                        break
                    previous, last_meta = h, raw
                else:
                    i = len(hashes)
                last_use_s = _LAST_USE.unpack_from(last_meta, _LAST_USE_OFFSET)[0] if i else 0.0
                if i < len(hashes) and not self._damage.known(prefix + hashes[i]):
                    damaged = _contradiction(get, db, prefix, hashes, i, raw)
        except lmdb.Error as exc:  # a damaged page: the chain ends before it
            self._damage.note(prefix + hashes[i], exc)
            return i, 0.0  # the deepest one's record died with the txn: call it due (a touch checks)
        if damaged:
            self._damage.note(prefix + hashes[i], SilentDamage(damaged))
        return i, last_use_s


def _contradiction(get: Callable[..., Any], db: Any, prefix: bytes, hashes: Sequence[bytes], i: int,
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
