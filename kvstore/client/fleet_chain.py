"""A chain's hashes in a fleet: each run of `run_blocks` blocks is a chain of its own, bridged to the one before.

A node keeps R6 (docs/RETENTION.md): it stores a block only when its parent is
stored there, and a Lookup counts block i only at depth i + 1. A fleet places
run r on other nodes than run r - 1, so the node of run r never holds run r's
parent. So in a fleet every run is stored as its own chain from the root, and
the prefix before it is bound in by one more extra key, the *bridge*:

    run 0:      block hashes as on one server (kvstore.prefix, from the root)
    run r > 0:  from the root, with extra keys = the caller's + [BRIDGE_TAG | hash of block r*run_blocks - 1]

The last hash of run r - 1 names the whole prefix before run r (it is chained
the same way), so two prompts share run r's blocks exactly when they share
every token up to its end and their extra keys, as on one server. Every node
keeps its own R6 within a run unchanged; across runs the client keeps it
(docs/FLEET.md, "Data path"). A run's first hash is its placement key
(`kvstore.fleet.placement.run_key`), and on the node it is the run's depth-1
block: a node can find the run of any block it holds by walking to depth 1.

The bridge takes one extra key of 53 bytes from the caller's budget
(kvstore.prefix: 128 keys, 8 KiB in all), so a fleet client takes 127 keys and
8,139 bytes.

A snapshot's key is anchored on this chain too (`fleet_snapshot_keys`, F45): here, so that the SWA
client through a gateway (kvstore.client.swa) and the fleet's (kvstore.client.fleet_swa, built on
it) share one derivation without importing each other.

A conversation's next turn hashes only its new tokens here too (`FleetChainMemo`, F56): each run
is a chain of its own (from the root, with its bridge key), so each run goes through the client's
chain memo (`kvstore.client.chain_memo.ChainMemo`, the single server's, unchanged) as one chain.
The memo compares every run's tokens byte for byte (C1) and keys it by the root and the run's
extra keys, bridge included (C2), so what comes back is `fleet_hashes`' answer exactly (C3).
"""

from __future__ import annotations

import threading
from array import array
from collections.abc import Sequence

from kvstore.client import arguments
from kvstore.client.chain_memo import DEFAULT_MAX_BYTES, DEFAULT_MAX_ENTRIES, DEFAULT_MIN_BLOCKS, ChainMemo
from kvstore.errors import InvalidArgument
from kvstore.prefix import ExtraKey, chain_hashes, token_bytes
from kvstore.swa_snapshot import snapshot_key

#: Marks the bridge key; a new bridging rule gets a new tag.
BRIDGE_TAG = b"kvstore.fleet.run.v1\0"


def run_extra_keys(extra_keys: Sequence[ExtraKey], previous: bytes | None) -> list[ExtraKey]:
    """The extra keys a run is hashed (and Put) with: the caller's, plus the bridge to `previous`.

    Args:
        extra_keys: the caller's keys.
        previous: the hash of the block before the run (None for run 0).
    """
    keys = list(extra_keys)
    if previous is not None:
        keys.append(BRIDGE_TAG + previous)
    return keys


def fleet_hashes(tokens: Sequence[int], *, root: bytes, block_tokens: int, run_blocks: int,
                 extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
    """The fleet hash of every full block of `tokens`, from the prompt start (run by run, bridged).

    Raises:
        InvalidArgument: a bad token id or extra key (kvstore.prefix names the limits).
    """
    run_tokens = run_blocks * block_tokens
    hashes: list[bytes] = []
    for start in range(0, len(tokens) - block_tokens + 1, run_tokens):
        keys = run_extra_keys(extra_keys, hashes[-1] if hashes else None)
        hashes += chain_hashes(tokens[start:start + run_tokens], block_tokens=block_tokens, parent=root,
                               extra_keys=keys)
    return hashes


class FleetChainMemo:
    """`fleet_hashes`, each run through a `ChainMemo`: a prompt that begins with the tokens of runs hashed
    before (a conversation's next turn) hashes only the runs after them, and the part of its last kept
    run past that run's kept blocks (F56). Thread-safe (each memo is; the list of them has a lock).

    One memo per run index, not one for every run: a memo compares a prompt with each chain it keeps of
    the same root (a Python loop over its entries), and a run's bridge key makes every run a family of
    its own, so one memo holding a million-token conversation's 61 runs and 14 such conversations would
    scan ~900 entries per run (measured: 17 ms a next turn, more than hashing it cold); per index each
    memo holds one entry per conversation reaching that run (~1 ms for the same next turn).

    Memory is bounded as the single server's memo is (C4): at most `max_bytes` over every index; past
    it the deepest run indexes are forgotten first, since run r is reused only by prompts reaching it,
    so a shallower run is reused at least as often (a shared system prompt's run 0 most of all).

    Args:
        block_tokens: tokens per block.
        run_blocks: blocks per run (the fleet's layout).
        max_bytes: most bytes of token bytes and hashes kept over every run (0: keep nothing, hash cold).
        max_entries: most chains kept per run index (one per conversation reaching that run).
    """

    def __init__(self, *, block_tokens: int, run_blocks: int, max_bytes: int = DEFAULT_MAX_BYTES,
                 max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        self.block_tokens, self.run_blocks = block_tokens, run_blocks
        self.max_bytes, self.max_entries = max_bytes, max_entries
        # A whole run is always worth keeping (a node's unit); a shorter last run as the single memo decides.
        self._min_blocks = min(DEFAULT_MIN_BLOCKS, run_blocks)
        self._lock = threading.Lock()
        self._memos: list[ChainMemo] = []

    def hashes(self, tokens: Sequence[int], *, root: bytes, extra_keys: Sequence[ExtraKey] = ()) -> list[bytes]:
        """`fleet_hashes(tokens, root=root, block_tokens=, run_blocks=, extra_keys=)`, each run from a kept
        chain where the prompt begins with its tokens.

        Raises:
            InvalidArgument: a bad token id or extra key (as `fleet_hashes`).
        """
        if not self.max_bytes:
            return fleet_hashes(tokens, root=root, block_tokens=self.block_tokens, run_blocks=self.run_blocks,
                                extra_keys=extra_keys)
        ids = _uint32_array(tokens)
        run_tokens = self.run_blocks * self.block_tokens
        hashes: list[bytes] = []
        for index, start in enumerate(range(0, len(ids) - self.block_tokens + 1, run_tokens)):
            keys = run_extra_keys(extra_keys, hashes[-1] if hashes else None)
            # A slice of a uint32 array: the memo compares and hashes it in place (prefix.token_buffer).
            hashes += self._memo(index).chain(ids[start:start + run_tokens], root=root, extra_keys=keys)
        self._bound()
        return hashes

    def memos(self) -> list[ChainMemo]:
        """The memo of each run index kept now (run 0's first): their stats say what each spared."""
        with self._lock:
            return list(self._memos)

    def clear(self) -> None:
        """Forget every run's chains."""
        with self._lock:
            self._memos.clear()

    def _memo(self, index: int) -> ChainMemo:
        with self._lock:
            while len(self._memos) <= index:
                self._memos.append(ChainMemo(block_tokens=self.block_tokens, max_bytes=self.max_bytes,
                                             max_entries=self.max_entries, min_blocks=self._min_blocks))
            return self._memos[index]

    def _bound(self) -> None:
        """C4 over every index: forget the deepest runs' memos while the kept bytes are over `max_bytes`."""
        with self._lock:
            sizes = [m.stats().size_bytes for m in self._memos]
            while self._memos and sum(sizes) > self.max_bytes:
                self._memos.pop()
                sizes.pop()


def _uint32_array(tokens: Sequence[int]) -> array[int]:
    """`tokens` as a uint32 array, whose slices the memo reads in place (a copy of the bytes at most)."""
    if isinstance(tokens, array) and tokens.typecode == "I" and tokens.itemsize == 4:
        return tokens
    ids = array("I")
    ids.frombytes(token_bytes(tokens))  # checked, and one C pass for numpy arrays and tensors
    return ids


def fleet_snapshot_keys(tokens: Sequence[int], positions: Sequence[int], *, root: bytes, block_tokens: int,
                        run_blocks: int, extra_keys: Sequence[ExtraKey] = (),
                        chain: Sequence[bytes] | None = None) -> list[bytes]:
    """Snapshot keys of `tokens` at each position, each anchored on the fleet hash of the last full block before
    it (F29's chain; the root inside the first block), with the caller's extra keys (F45).

    `chain`, when given, is `fleet_hashes` of `tokens` (or of a longer prompt they begin) already made, so the
    prompt is not hashed a second time: a prefix's fleet hashes are the first of the whole prompt's.

    Raises:
        InvalidArgument: a position outside [0, len(tokens)], a bad token id or extra key.
    """
    tokens = arguments.token_ids(tokens)
    positions = [arguments.integer(p, f"positions[{i}]") for i, p in enumerate(positions)]
    extra_keys = arguments.extra_keys(extra_keys)
    for p in positions:
        if p > len(tokens):
            raise InvalidArgument(f"snapshot position {p} is outside the {len(tokens)} tokens given")
    b = block_tokens
    if chain is None or len(chain) < max(positions, default=0) // b:
        chain = fleet_hashes(tokens[:max(positions, default=0)], root=root, block_tokens=b, run_blocks=run_blocks,
                             extra_keys=extra_keys)
    return [snapshot_key(chain[p // b - 1] if p >= b else root, tokens[p // b * b:p], p, extra_keys)
            for p in positions]
