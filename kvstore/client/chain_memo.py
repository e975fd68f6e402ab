"""The client's memo of the chains it hashed, so a conversation's next turn hashes only its new tokens.

A worker's next turn repeats the whole prompt and adds a few thousand tokens;
hashing a million tokens again costs ~25 ms of SHA-256 in Python, five times
the Lookup it feeds. The chain of a prompt's full blocks is a pure function of
the chain's root (geometry fingerprint and block size), its extra keys and the
token bytes (docs/PREFIX_HASHING.md), so the memo keeps, per chain it hashed:

- the token bytes of its full blocks, compared byte for byte with a new prompt's
  (`bytes.startswith`, a memcmp: ~0.2 ms for a million tokens), never a digest
  of them: a prompt reuses a chain only when its tokens begin with exactly the
  tokens that chain was hashed from (C1);
- the root and the extra keys' tail (their count and SHA-256) in the entry's
  key: another root, block size or extra keys never reuse it (C2);
- the hashes, so a hit returns them and hashes only the blocks after them.

What comes back is always what `kvstore.prefix.chain_hashes` would return for
the same arguments (C3, `tests/kvstore/client/test_chain_memo.py`'s property
test). The namespace is no input of a chain hash (it is in the storage key), so
a memo could not hand one tenant another's chain even if it were shared; each
`Connection` has its own anyway.

Memory is bounded (C4): at most `max_bytes` of token bytes and hashes (about 4.5
bytes per token) and `max_entries` chains, least recently used forgotten first;
a chain larger than `max_bytes` is not kept. When a prompt extends a chain the
memo holds (the same conversation's next turn), the longer chain replaces it.
Thread-safe (C5): one lock guards the table; hashing runs outside it.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

from kvstore.prefix import HASH_BYTES, ExtraKey, chain_hashes_of_bytes, extra_keys_tail, token_buffer

#: Token bytes and hashes kept by default: ~14M tokens, a dozen 1M-token conversations.
DEFAULT_MAX_BYTES = 64 << 20
#: Chains kept by default; each lookup compares a prompt with the chains of its root and keys.
DEFAULT_MAX_ENTRIES = 64
#: Chains shorter than this many blocks are not kept: they hash in well under a millisecond.
DEFAULT_MIN_BLOCKS = 16
#: What an entry costs beyond its bytes (the objects and the table's slot), counted against max_bytes.
_ENTRY_OVERHEAD_BYTES = 256


@dataclass(frozen=True, kw_only=True)
class MemoStats:
    """What the memo did: lookups answered from a kept chain, the blocks it spared, what it holds."""

    hits: int
    misses: int
    reused_blocks: int
    entries: int
    size_bytes: int


@dataclass(frozen=True, kw_only=True, slots=True)
class _Chain:
    """A kept chain: the token bytes of its full blocks (copies of the prompts') and their hashes.

    The bytes are kept as the segments each turn added: a next turn copies only its new
    blocks' bytes and shares the rest with the chain it replaces, rather than copying the
    whole prompt again (4 MB and its page faults for a million tokens).
    """

    segments: tuple[bytes, ...]
    length: int
    hashes: tuple[bytes, ...]

    def is_prefix_of(self, raw: memoryview) -> bool:
        """Whether `raw` begins with exactly this chain's token bytes (C1: a memcmp per segment)."""
        if self.length > len(raw):
            return False
        at = 0
        for segment in self.segments:
            # Equal lengths, so startswith is equality; a memoryview slice copies nothing.
            if not segment.startswith(raw[at:at + len(segment)]):
                return False
            at += len(segment)
        return True

    @property
    def size_bytes(self) -> int:
        return self.length + HASH_BYTES * len(self.hashes) + _ENTRY_OVERHEAD_BYTES


class ChainMemo:
    """Chains hashed before, reused for prompts that begin with their tokens (module docstring: C1-C5).

    Args:
        block_tokens: tokens per block of every chain hashed here.
        max_bytes: most bytes of token bytes and hashes kept (0: keep nothing).
        max_entries: most chains kept.
        min_blocks: shortest chain kept.
    """

    def __init__(self, *, block_tokens: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entries: int = DEFAULT_MAX_ENTRIES, min_blocks: int = DEFAULT_MIN_BLOCKS) -> None:
        self.block_tokens = block_tokens
        self.max_bytes = max_bytes
        self.max_entries = max_entries
        self.min_blocks = min_blocks
        self._lock = threading.Lock()
        # (root, extra-keys tail) -> entries of that chain family, least recently used first.
        # An entry's table key is its last hash: one chain per distinct token prefix.
        self._chains: OrderedDict[tuple[bytes, bytes, bytes], _Chain] = OrderedDict()
        self._size_bytes = 0
        self._hits = self._misses = self._reused_blocks = 0

    def hashes(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """`kvstore.prefix.chain_hashes(tokens, block_tokens, parent=root, extra_keys)`, from a kept chain
        when `tokens` begins with one's tokens (then only the blocks after it are hashed).

        Raises:
            InvalidArgument: a bad token id or extra key (as `chain_hashes`).
        """
        tail = extra_keys_tail(extra_keys)
        # A view of the caller's array where it holds the bytes already: compared and hashed in
        # place, copied only into a kept chain (the caller may change its array afterwards).
        raw = token_buffer(tokens)
        step = 4 * self.block_tokens
        full = len(raw) - len(raw) % step
        if full < step * max(self.min_blocks, 1):  # too short to keep, or to begin with a kept chain
            return chain_hashes_of_bytes(raw, block_tokens=self.block_tokens, parent=root, tail=tail)
        view = memoryview(raw)
        base = self._longest_prefix(root, tail, view)
        if base is None:
            hashes = chain_hashes_of_bytes(view[:full], block_tokens=self.block_tokens, parent=root, tail=tail)
        else:
            hashes = list(base.hashes)
            if base.length < full:
                hashes += chain_hashes_of_bytes(view[base.length:full], block_tokens=self.block_tokens,
                                                parent=base.hashes[-1], tail=tail)
        self._keep(root, tail, view[:full], hashes, base)
        return hashes

    def stats(self) -> MemoStats:
        """The counters and what is kept now."""
        with self._lock:
            return MemoStats(hits=self._hits, misses=self._misses, reused_blocks=self._reused_blocks,
                             entries=len(self._chains), size_bytes=self._size_bytes)

    def clear(self) -> None:
        """Forget every chain (the counters stay)."""
        with self._lock:
            self._chains.clear()
            self._size_bytes = 0

    def _longest_prefix(self, root: bytes, tail: bytes, raw: memoryview) -> _Chain | None:
        """The kept chain of this root and keys with the longest tokens that `raw` begins with (C1, C2)."""
        with self._lock:  # the candidates under the lock; the byte compares (a memcmp each) outside it
            candidates = [(key, chain) for key, chain in self._chains.items()
                          # C2: the root and the keys' tail are compared in full, before any token.
                          if key[0] == root and key[1] == tail and chain.length <= len(raw)]
        best_key, best = None, None
        for key, chain in candidates:
            if (best is None or chain.length > best.length) and chain.is_prefix_of(raw):  # C1
                best_key, best = key, chain
        with self._lock:
            if best_key is None or best is None:
                self._misses += 1
                return None
            if best_key in self._chains:
                self._chains.move_to_end(best_key)
            self._hits += 1
            self._reused_blocks += len(best.hashes)
            return best

    def _keep(self, root: bytes, tail: bytes, raw: memoryview, hashes: list[bytes], base: _Chain | None) -> None:
        """Keep the chain of `raw` (its full blocks); it replaces `base` when it extends it (C4)."""
        if base is not None and len(base.hashes) == len(hashes):
            return  # the kept chain is this prompt's whole chain
        # A chain larger than the whole memo is dropped again by the loop below (C4).
        if base is None:
            chain = _Chain(segments=(bytes(raw),), length=len(raw), hashes=tuple(hashes))
        else:  # the new blocks' bytes only, after the segments of the chain this one extends
            chain = _Chain(segments=(*base.segments, bytes(raw[base.length:])), length=len(raw),
                           hashes=tuple(hashes))
        key = (root, tail, hashes[-1])
        with self._lock:
            if base is not None:
                old = self._chains.pop((root, tail, base.hashes[-1]), None)
                if old is not None:
                    self._size_bytes -= old.size_bytes
            old = self._chains.pop(key, None)
            if old is not None:
                self._size_bytes -= old.size_bytes
            self._chains[key] = chain
            self._size_bytes += chain.size_bytes
            while self._chains and (self._size_bytes > self.max_bytes or len(self._chains) > self.max_entries):
                _, dropped = self._chains.popitem(last=False)
                self._size_bytes -= dropped.size_bytes
