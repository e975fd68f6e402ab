"""Chains a Lookup found stored, remembered by their last hash, so a conversation's next turn can
send only its new hashes (LookupRequest.anchor_hash; docs/PREFIX_HASHING.md, "The next turn").

A million-token prompt's Lookup carries 15,625 hashes (500 KB); its next turn repeats all of
them and adds a few dozen. The server keeps, per tenant and geometry, the packed hashes of
each chain a Lookup found stored in full, keyed by the chain's last hash. A next turn names
that hash and the chain's length (the anchor) and sends the hashes after it; the server puts
the remembered ones in front and looks the whole chain up as any other (R15 checks it in the
tier, as ever).

Only a found prefix is remembered, never what a client merely sent: the tier verified that
those hashes are the stored chain ending at the last one, and a block's hash fixes its
ancestors, so an anchor stands for exactly one chain, whoever names it (A1). The key holds
the scope (fingerprint and tenant), so one tenant's anchors are never another's (A2).
Memory is bounded by bytes, least recently used forgotten first (A3); an unknown anchor is
answered `anchor_unknown` and the client sends the whole chain (A4).
"""

from __future__ import annotations

import threading
from collections import OrderedDict

from kvstore.prefix import HASH_BYTES

#: Packed hashes remembered by default: 64 MiB, about 128 conversations of a million tokens.
DEFAULT_MAX_BYTES = 64 << 20
#: Shorter chains are not remembered: sending them whole costs little.
DEFAULT_MIN_BLOCKS = 64


class LookupAnchors:
    """Found chains' packed hashes by (scope prefix, last hash). Thread-safe.

    Args:
        max_bytes: most bytes of packed hashes kept.
        min_blocks: shortest chain kept.
    """

    def __init__(self, *, max_bytes: int = DEFAULT_MAX_BYTES, min_blocks: int = DEFAULT_MIN_BLOCKS) -> None:
        self.max_bytes = max_bytes
        self.min_blocks = min_blocks
        self._lock = threading.Lock()
        self._chains: OrderedDict[bytes, bytes] = OrderedDict()
        self._size_bytes = 0

    def expand(self, scope_prefix: bytes, anchor_hash: bytes, anchor_blocks: int, after: bytes) -> bytes | None:
        """The whole chain's packed hashes: the remembered `anchor_blocks` ending at `anchor_hash`, then
        `after`; None when no such chain is remembered in this scope (A2, A4)."""
        with self._lock:
            packed = self._chains.get(scope_prefix + anchor_hash)
            if packed is None or len(packed) != anchor_blocks * HASH_BYTES:
                return None
            self._chains.move_to_end(scope_prefix + anchor_hash)
        return packed + after

    def remember(self, scope_prefix: bytes, found: bytes, *, replaces: bytes = b"") -> None:
        """Remember `found`, packed hashes the tier found stored as one chain from block 0 (A1).

        Args:
            replaces: the anchor hash the request named, forgotten when `found` extends its chain
                (the conversation moved on; one entry per conversation, not one per turn).
        """
        blocks = len(found) // HASH_BYTES
        if blocks < max(self.min_blocks, 1) or len(found) > self.max_bytes:
            return
        key = scope_prefix + found[-HASH_BYTES:]
        with self._lock:
            for old_key in (scope_prefix + replaces if replaces else b"", key):
                old = self._chains.pop(old_key, None) if old_key else None
                if old is not None:
                    self._size_bytes -= len(old)
            self._chains[key] = found
            self._size_bytes += len(found)
            while self._size_bytes > self.max_bytes:  # A3
                _, dropped = self._chains.popitem(last=False)
                self._size_bytes -= len(dropped)

    @property
    def size_bytes(self) -> int:
        """Bytes of packed hashes kept now."""
        return self._size_bytes

    def __len__(self) -> int:
        return len(self._chains)
