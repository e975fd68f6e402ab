"""Memo of verified chains, so a Lookup of a prompt already seen costs a binary search.

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
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

#: Chains remembered (least recently used forgotten first); about 200 bytes each.
DEFAULT_CAPACITY = 16_384


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
