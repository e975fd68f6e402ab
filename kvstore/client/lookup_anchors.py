"""The chains this client's server found stored, by their last hash: a next turn's Lookup names one
(LookupRequest.anchor_hash) and sends only the hashes after it (gateway/lookup_anchors.py, A1-A5).

The server remembers the found prefix of each Lookup of at least `MIN_BLOCKS` blocks; so does
this table, bounded to `max_entries` anchors, least recently used forgotten first. An anchor
the server has forgotten costs one more round trip (it answers `anchor_unknown`; the client
forgets it and sends the whole chain).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

#: The server's shortest remembered chain (gateway.lookup_anchors.DEFAULT_MIN_BLOCKS).
MIN_BLOCKS = 64
#: Anchors kept by default; each lookup checks them all (a dict probe per anchor).
DEFAULT_MAX_ENTRIES = 256


class AnchorTable:
    """Last hash -> length of the chains the server found stored. Thread-safe.

    Args:
        max_entries: most anchors kept.
        min_blocks: the shortest chain kept (the server's, by default; a fleet client keeps its guesses of
            where a prompt's stored prefix ends from one block: docs/FLEET.md F81).
    """

    def __init__(self, max_entries: int = DEFAULT_MAX_ENTRIES, *, min_blocks: int = MIN_BLOCKS) -> None:
        self.max_entries, self.min_blocks = max_entries, min_blocks
        self._lock = threading.Lock()
        self._anchors: OrderedDict[bytes, int] = OrderedDict()

    def best(self, hashes: Sequence[bytes]) -> int:
        """The length of the longest kept chain that `hashes` begins with (its last hash is
        hashes[length - 1], and a hash fixes its ancestors); 0 when none."""
        with self._lock:
            anchors = list(self._anchors.items())
        best = 0
        for anchor, blocks in anchors:
            if best < blocks <= len(hashes) and hashes[blocks - 1] == anchor:
                best = blocks
        if best:
            with self._lock:
                if hashes[best - 1] in self._anchors:
                    self._anchors.move_to_end(hashes[best - 1])
        return best

    def ends(self, last_hash: bytes, blocks: int) -> bool:
        """Whether the chain of `blocks` blocks ending at `last_hash` is itself a kept anchor: `best` of that
        chain in one dict probe (no anchor can be longer than the chain), for a next turn whose kept chain is
        the one the server found the turn before (C7)."""
        with self._lock:
            if self._anchors.get(last_hash) != blocks:
                return False
            self._anchors.move_to_end(last_hash)
            return True

    def note(self, last_hash: bytes, blocks: int, *, replaces: bytes = b"") -> None:
        """The server found `blocks` blocks stored, the last `last_hash`; `replaces`, the anchor the
        request named, is dropped (the server replaced it too)."""
        if blocks < self.min_blocks:
            return
        with self._lock:
            if replaces and replaces != last_hash:
                self._anchors.pop(replaces, None)
            self._anchors[last_hash] = blocks
            self._anchors.move_to_end(last_hash)
            while len(self._anchors) > self.max_entries:
                self._anchors.popitem(last=False)

    def forget(self, anchor: bytes) -> None:
        """The server does not know `anchor` (any more)."""
        with self._lock:
            self._anchors.pop(anchor, None)

    def __len__(self) -> int:
        return len(self._anchors)
