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

A next turn's answer shares the kept hashes rather than copying them (C6, `chain`): a
`HashChain` holds the pieces each turn added (one tuple each), so the turn's work after
the byte compare is its new blocks', not one reference per block of the whole prompt
(15,625 for a million tokens, each a cache miss: ~0.1-0.3 ms). `hashes` returns a list,
as ever.

A next turn's Lookup need not wait for C1's compare (C7, `guess`): the kept chain whose last
block's bytes the prompt repeats at the same place is a guess, its new blocks are hashed from
its last hash and the request sent while a worker runs the compare (`holds`: libc's memcmp,
the GIL released); the chain is reused (`take`) only when the compare holds, else the guess is
dropped (`refuse`) and the prompt goes through `chain` as any other.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from bisect import bisect_right
from collections import OrderedDict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, cast, overload

import numpy as np

from kvstore.prefix import HASH_BYTES, ExtraKey, chain_hashes_of_bytes, extra_keys_tail, token_buffer

#: Token bytes and hashes kept by default: ~14M tokens, a dozen 1M-token conversations.
DEFAULT_MAX_BYTES = 64 << 20
#: Chains kept by default; each lookup compares a prompt with the chains of its root and keys.
DEFAULT_MAX_ENTRIES = 64
#: Chains shorter than this many blocks are not kept: they hash in well under a millisecond.
DEFAULT_MIN_BLOCKS = 16
#: What an entry costs beyond its bytes (the objects and the table's slot), counted against max_bytes.
_ENTRY_OVERHEAD_BYTES = 256
#: Pieces a kept chain's hashes are held in before they are joined into one (one per turn that extended it).
MAX_PIECES = 32


def _libc_memcmp() -> Any:
    """libc's memcmp through ctypes, which releases the GIL for the call (`bytes.startswith` holds it), or
    None where there is no libc to load (then `holds` compares with `startswith`)."""
    try:
        memcmp = ctypes.CDLL(None).memcmp
    except (OSError, AttributeError):
        return None
    memcmp.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
    memcmp.restype = ctypes.c_int
    return memcmp


_MEMCMP = _libc_memcmp()


def token_array(tokens: Sequence[int]) -> Sequence[int]:
    """`tokens` itself where the memo reads it in place (a uint32 array: `token_buffer`'s view), else a
    uint32 numpy view of its bytes, converted once: a guess (C7) that fails is looked up again without a
    second conversion of a Python list (~10 ms per million tokens).

    Raises:
        InvalidArgument: a bad token id (as `chain_hashes`).
    """
    raw = token_buffer(tokens)
    if isinstance(raw, memoryview):
        return tokens
    return cast(Sequence[int], np.frombuffer(raw, dtype="<u4"))  # read-only, a view of the converted bytes


class HashChain(Sequence[bytes]):
    """A chain's hashes, held as the tuples each turn added, read as one sequence (C6). Immutable.

    An item costs a binary search over the pieces; a slice is a list of the hashes in it; equal to
    a list or tuple of the same hashes.

    Args:
        pieces: the hashes, in order, in consecutive tuples.
    """

    __slots__ = ("_len", "_pieces", "_starts")

    def __init__(self, pieces: tuple[tuple[bytes, ...], ...]) -> None:
        self._pieces = pieces
        self._starts = list(itertools.accumulate((len(p) for p in pieces[:-1]), initial=0))
        self._len = self._starts[-1] + len(pieces[-1]) if pieces else 0

    def __len__(self) -> int:
        return self._len

    @overload
    def __getitem__(self, index: int) -> bytes: ...

    @overload
    def __getitem__(self, index: slice) -> list[bytes]: ...

    def __getitem__(self, index: int | slice) -> bytes | list[bytes]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._len)
            if step != 1:
                return list(self)[index]
            out: list[bytes] = []
            for begin, piece in zip(self._starts, self._pieces, strict=True):
                if begin + len(piece) > start and begin < stop:
                    out += piece[max(start - begin, 0):stop - begin]
            return out
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("hash index out of range")
        at = bisect_right(self._starts, index) - 1
        return self._pieces[at][index - self._starts[at]]

    def __iter__(self) -> Iterator[bytes]:
        return itertools.chain.from_iterable(self._pieces)

    @property
    def pieces(self) -> tuple[tuple[bytes, ...], ...]:
        """The tuples the hashes are held in, in order."""
        return self._pieces

    def __eq__(self, other: object) -> bool:
        if isinstance(other, HashChain | list | tuple):
            return len(other) == self._len and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which are not hashable

    def __repr__(self) -> str:
        return f"HashChain({self._len} hashes in {len(self._pieces)} pieces)"


@dataclass(frozen=True, kw_only=True)
class MemoStats:
    """What the memo did: lookups answered from a kept chain, the blocks it spared, what it holds."""

    hits: int
    misses: int
    reused_blocks: int
    entries: int
    size_bytes: int
    #: Guesses whose compare held (their reply used, C7); counted in `hits` too.
    guesses_held: int = 0
    #: Guesses whose compare failed (their reply dropped, the prompt looked up the safe way, C7).
    guesses_refused: int = 0


@dataclass(frozen=True, kw_only=True, slots=True)
class _Chain:
    """A kept chain: the token bytes of its full blocks (copies of the prompts') and their hashes.

    The bytes are kept as the segments each turn added: a next turn copies only its new
    blocks' bytes and shares the rest with the chain it replaces, rather than copying the
    whole prompt again (4 MB and its page faults for a million tokens).
    """

    segments: tuple[bytes, ...]
    length: int
    #: The hashes, one tuple per turn that extended the chain (C6).
    pieces: tuple[tuple[bytes, ...], ...]
    blocks: int

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

    def is_prefix_of_released(self, raw: memoryview) -> bool:
        """`is_prefix_of`, each segment compared by libc's memcmp with the GIL released (C7: run by a worker
        while the caller's thread sends the request)."""
        if _MEMCMP is None:
            return self.is_prefix_of(raw)
        if self.length > len(raw):
            return False
        # The array holds the caller's buffer (a view of it, no copy) until the compare is done.
        address = np.frombuffer(raw, dtype=np.uint8).ctypes.data
        at = 0
        for segment in self.segments:
            if _MEMCMP(segment, address + at, len(segment)) != 0:
                return False
            at += len(segment)
        return True

    def ends_like(self, raw: memoryview, step: int) -> bool:
        """Whether `raw` holds this chain's last block's bytes at the same place (C7's guess, not C1)."""
        return self.length <= len(raw) and self.segments[-1].endswith(raw[self.length - step:self.length])

    @property
    def size_bytes(self) -> int:
        return self.length + HASH_BYTES * self.blocks + _ENTRY_OVERHEAD_BYTES

    @property
    def last(self) -> bytes:
        """The chain's last hash (its table key)."""
        return self.pieces[-1][-1]


@dataclass(frozen=True, kw_only=True, slots=True)
class Guess:
    """A next turn's candidate chain before C1's compare (`ChainMemo.guess`, C7): nothing is reused on it until
    `ChainMemo.holds` says the prompt begins with its tokens."""

    base: _Chain
    #: The prompt's token bytes: a view of the caller's array where it holds them (valid while it is unchanged).
    raw: memoryview
    #: Bytes of the prompt's full blocks.
    full: int
    root: bytes
    tail: bytes


class ChainMemo:
    """Chains hashed before, reused for prompts that begin with their tokens (module docstring: C1-C7).

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
        self._guesses_held = self._guesses_refused = 0

    def hashes(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """`kvstore.prefix.chain_hashes(tokens, block_tokens, parent=root, extra_keys)`, from a kept chain
        when `tokens` begins with one's tokens (then only the blocks after it are hashed).

        Raises:
            InvalidArgument: a bad token id or extra key (as `chain_hashes`).
        """
        chain = self.chain(tokens, root=root, extra_keys=extra_keys)
        return chain if isinstance(chain, list) else list(chain)

    def chain(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> Sequence[bytes]:
        """`hashes`, as a `HashChain` sharing the kept chain's hashes where it is one (C6: no copy of
        them), else a list.

        Raises:
            InvalidArgument: a bad token id or extra key (as `chain_hashes`).
        """
        tail, raw, full = self._cut(tokens, extra_keys)
        if not self._keepable(full):  # too short to keep, or to begin with a kept chain
            return chain_hashes_of_bytes(raw, block_tokens=self.block_tokens, parent=root, tail=tail)
        view = memoryview(raw)
        base = self._longest_prefix(root, tail, view)
        if base is None:
            pieces: tuple[tuple[bytes, ...], ...] = (
                tuple(chain_hashes_of_bytes(view[:full], block_tokens=self.block_tokens, parent=root, tail=tail)),)
        else:
            pieces = self._pieces_after(base, view, full, tail)
        self._keep(root, tail, view[:full], pieces, base)
        return HashChain(pieces)

    def _cut(self, tokens: Sequence[int], extra_keys: Sequence[ExtraKey]) -> tuple[bytes, bytes | memoryview, int]:
        """(the extra keys' tail, the tokens' bytes, how many of those bytes are whole blocks). The bytes are a
        view of the caller's array where it holds them already: compared and hashed in place, copied only into a
        kept chain (the caller may change its array afterwards)."""
        raw = token_buffer(tokens)
        return extra_keys_tail(extra_keys), raw, len(raw) - len(raw) % (4 * self.block_tokens)

    def _keepable(self, full: int) -> bool:
        """Whether `full` bytes of whole blocks are enough to keep, or to begin with a kept chain."""
        return full >= 4 * self.block_tokens * max(self.min_blocks, 1)

    def _pieces_after(self, base: _Chain, raw: memoryview, full: int, tail: bytes) -> tuple[tuple[bytes, ...], ...]:
        """The hashes of `raw`'s `full` bytes of blocks, which begin with `base`'s: its pieces, then the blocks
        after them hashed from its last hash."""
        if base.length == full:
            return base.pieces
        new = chain_hashes_of_bytes(raw[base.length:full], block_tokens=self.block_tokens, parent=base.last, tail=tail)
        pieces = (*base.pieces, tuple(new))
        if len(pieces) > MAX_PIECES:  # a long conversation's turns: joined once, then shared again
            pieces = (tuple(itertools.chain.from_iterable(pieces)),)
        return pieces

    def kept_tokens(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> int:
        """How many of `tokens` a kept chain of this root and keys covers: C1's byte compare alone, as `chain`
        makes it, nothing hashed, kept or counted (what a next turn would reuse; `kvstore bench lookup` times
        it as the compare's share of a turn).

        Raises:
            InvalidArgument: a bad token id or extra key (as `chain_hashes`).
        """
        best = self._longest_prefix(root, extra_keys_tail(extra_keys), memoryview(token_buffer(tokens)),
                                    count=False)
        return 0 if best is None else best.length // 4

    def guess(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> Guess | None:
        """The kept chain of this root and keys a next turn most likely extends (C7): the longest whose last
        block's bytes `tokens` repeats at the same place. Nothing is compared in full, reused or counted: see
        `holds`, `extend`, `take`, `refuse`. None when no kept chain ends like the prompt.

        Raises:
            InvalidArgument: a bad token id or extra key (as `chain_hashes`).
        """
        tail, raw, full = self._cut(tokens, extra_keys)
        if not self._keepable(full):
            return None
        view, step = memoryview(raw), 4 * self.block_tokens
        with self._lock:
            candidates = [chain for key, chain in self._chains.items() if key[0] == root and key[1] == tail]
        best = None
        for chain in candidates:
            if (best is None or chain.length > best.length) and chain.length <= full and chain.ends_like(view, step):
                best = chain
        return None if best is None else Guess(base=best, raw=view, full=full, root=root, tail=tail)

    @staticmethod
    def holds(guess: Guess) -> bool:
        """C1 for the guess: whether the prompt begins with exactly its chain's token bytes (a memcmp per
        segment, the GIL released: a worker runs it while the request flies)."""
        return guess.base.is_prefix_of_released(guess.raw)

    def extend(self, guess: Guess) -> HashChain:
        """The prompt's chain if the guess holds: its kept hashes, then the blocks after them hashed from its
        last hash (what `chain` would answer; nothing kept or counted)."""
        return HashChain(self._pieces_after(guess.base, guess.raw, guess.full, guess.tail))

    def take(self, guess: Guess, chain: HashChain) -> None:
        """The guess held (`holds` answered True): count it as `chain`'s hit would be and keep `chain`, the
        prompt's chain from `extend` (C4: it replaces the one it extends)."""
        with self._lock:
            key = (guess.root, guess.tail, guess.base.last)
            if key in self._chains:
                self._chains.move_to_end(key)
            self._hits += 1
            self._guesses_held += 1
            self._reused_blocks += guess.base.blocks
        self._keep(guess.root, guess.tail, guess.raw[:guess.full], chain.pieces, guess.base)

    def refuse(self, guess: Guess) -> None:
        """The guess's compare failed: nothing of it is kept; only the count moves (the prompt is then looked
        up through `chain`, which counts its own hit or miss)."""
        with self._lock:
            self._guesses_refused += 1

    def stats(self) -> MemoStats:
        """The counters and what is kept now."""
        with self._lock:
            return MemoStats(hits=self._hits, misses=self._misses, reused_blocks=self._reused_blocks,
                             entries=len(self._chains), size_bytes=self._size_bytes,
                             guesses_held=self._guesses_held, guesses_refused=self._guesses_refused)

    def clear(self) -> None:
        """Forget every chain (the counters stay)."""
        with self._lock:
            self._chains.clear()
            self._size_bytes = 0

    def _longest_prefix(self, root: bytes, tail: bytes, raw: memoryview, *, count: bool = True) -> _Chain | None:
        """The kept chain of this root and keys with the longest tokens that `raw` begins with (C1, C2);
        `count`: a lookup's (the counters and the recency order move), not a probe's."""
        with self._lock:  # the candidates under the lock; the byte compares (a memcmp each) outside it
            candidates = [(key, chain) for key, chain in self._chains.items()
                          # C2: the root and the keys' tail are compared in full, before any token.
                          if key[0] == root and key[1] == tail and chain.length <= len(raw)]
        best_key, best = None, None
        for key, chain in candidates:
            if (best is None or chain.length > best.length) and chain.is_prefix_of(raw):  # C1
                best_key, best = key, chain
        if not count:
            return best
        with self._lock:
            if best_key is None or best is None:
                self._misses += 1
                return None
            if best_key in self._chains:
                self._chains.move_to_end(best_key)
            self._hits += 1
            self._reused_blocks += best.blocks
            return best

    def _keep(self, root: bytes, tail: bytes, raw: memoryview, pieces: tuple[tuple[bytes, ...], ...],
              base: _Chain | None) -> None:
        """Keep the chain of `raw` (its full blocks; its hashes in `pieces`); it replaces `base` when it
        extends it (C4)."""
        blocks = len(raw) // (4 * self.block_tokens)
        if base is not None and base.blocks == blocks:
            return  # the kept chain is this prompt's whole chain
        # A chain larger than the whole memo is dropped again by the loop below (C4).
        if base is None:
            chain = _Chain(segments=(bytes(raw),), length=len(raw), pieces=pieces, blocks=blocks)
        else:  # the new blocks' bytes only, after the segments of the chain this one extends
            chain = _Chain(segments=(*base.segments, bytes(raw[base.length:])), length=len(raw), pieces=pieces,
                           blocks=blocks)
        key = (root, tail, chain.last)
        with self._lock:
            if base is not None:
                old = self._chains.pop((root, tail, base.last), None)
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
