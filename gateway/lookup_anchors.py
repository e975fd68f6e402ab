"""Chains a Lookup found stored, remembered by their last hash, so a conversation's next turn can
send only its new hashes (LookupRequest.anchor_hash; docs/PREFIX_HASHING.md, "The next turn").

A million-token prompt's Lookup carries 15,625 hashes (500 KB); its next turn repeats all of
them and adds a few dozen. The server keeps, per tenant and geometry, the hashes of each
prefix a Lookup found stored, keyed by the prefix's last hash, packed end to end as the
request carried them (`tiers.chains.PackedHashes`: usually the request's own bytes, no copy;
a next turn then adds its new hashes with one copy of the two). A next turn names
that hash and the chain's length (the anchor) and sends the hashes after it; the server puts
the remembered ones in front and looks the whole chain up as any other (R15 checks it in the
tier, as ever).

Only a found prefix is remembered, never what a client merely sent: the tier verified that
those hashes are the stored chain ending at the last one, and a block's hash fixes its
ancestors, so an anchor stands for exactly one chain, whoever names it (A1). The key holds
the scope (fingerprint and tenant), so one tenant's anchors are never another's (A2).
Memory is bounded by bytes, least recently used forgotten first (A3); an unknown anchor is
answered `anchor_unknown` and the client sends the whole chain (A4).

A node on its own store needs none of this (A5, `KVStoreServicer._lookup_after`): it reads
the anchor's record, and the anchor stored at its depth stands for its whole prefix (R6),
so a next turn's work is its new hashes'. This table serves what must see the whole chain:
a fleet's gateway (it routes the fleet hashes across the runs' nodes) and a node whose trace
records every Lookup's hashes.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

from tiers.chains import PackedHashes, packed_of

#: Bytes of remembered hashes by default: 64 MiB, about 128 conversations of a million tokens.
DEFAULT_MAX_BYTES = 64 << 20
#: Shorter chains are not remembered: sending them whole costs little.
DEFAULT_MIN_BLOCKS = 64
#: What one remembered hash costs: 32 bytes, packed.
BYTES_PER_HASH = 32


class LookupAnchors:
    """Found chains' hashes by (scope prefix, last hash). Thread-safe.

    Args:
        max_bytes: most bytes of hashes kept (`BYTES_PER_HASH` each).
        min_blocks: shortest chain kept.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, min_blocks: int = DEFAULT_MIN_BLOCKS) -> None:
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self._lock = threading.Lock()
        self._chains: OrderedDict[bytes, bytes] = OrderedDict()
        self._size_bytes = 0

    def expand(self, scope_prefix: bytes, anchor_hash: bytes, anchor_blocks: int) -> PackedHashes | None:
        """The remembered `anchor_blocks` hashes ending at `anchor_hash`; None when no such chain is
        remembered in this scope (A2, A4)."""
        key = scope_prefix + anchor_hash
        with self._lock:
            chain = self._chains.get(key)
            if chain is None or len(chain) != anchor_blocks * BYTES_PER_HASH:
                return None
            self._chains.move_to_end(key)
        return PackedHashes(chain)

    def remember(self, scope_prefix: bytes, found: Sequence[bytes], *, replaces: bytes = b"") -> None:
        """Remember `found`, hashes the tier found stored as one chain from block 0 (A1).

        Args:
            replaces: the anchor hash the request named, forgotten when `found` extends its chain
                (the conversation moved on; one entry per conversation, not one per turn).
        """
        if len(found) < max(self.min_blocks, 1) or len(found) * BYTES_PER_HASH > self.max_bytes:
            return
        chain = packed_of(found)
        key = scope_prefix + chain[-BYTES_PER_HASH:]
        with self._lock:
            for old_key in (scope_prefix + replaces if replaces else b"", key):
                old = self._chains.pop(old_key, None) if old_key else None
                if old is not None:
                    self._size_bytes -= len(old)
            self._chains[key] = chain
            self._size_bytes += len(chain)
            while self._size_bytes > self.max_bytes:  # A3
                _, dropped = self._chains.popitem(last=False)
                self._size_bytes -= len(dropped)

    @property
    def size_bytes(self) -> int:
        """Bytes of hashes kept now (`BYTES_PER_HASH` each)."""
        return self._size_bytes

    def __len__(self) -> int:
        return len(self._chains)
